"""Clipped value loss (PPO critic).

With predictions V, rollout-time values V_old and returns R, all (B, T):

    V_clip = V_old + clamp(V - V_old, -cliprange_value, cliprange_value)
    L      = 0.5 * max((V - R)^2, (V_clip - R)^2)

aggregated like the policy loss. ``critic/vf_clipfrac`` is the fraction of valid tokens where
the clipped term is the larger one (the update is cut).
"""

from __future__ import annotations

import torch

from lumenrl_core.algorithms.aggregation import agg_loss
from lumenrl_core.algorithms.masked import masked_mean

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    sync_metrics: bool = True,
    **agg_kwargs: object,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Scalar clipped value loss and metrics ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``
    (floats, or 0-dim float64 device tensors with ``sync_metrics=False``)."""
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value={cliprange_value!r} is invalid: must be > 0")
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped_values - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, loss_agg_mode, **agg_kwargs)
    stats = (
        loss.detach(),
        masked_mean((loss_clipped > loss_unclipped).float(), mask),
        masked_mean(values.detach(), mask),
    )
    names = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")
    stacked = torch.stack([t.to(torch.float64) for t in stats])
    values_out = stacked.tolist() if sync_metrics else list(stacked.unbind())  # tolist: one device sync, exact
    return loss, dict(zip(names, values_out, strict=True))
