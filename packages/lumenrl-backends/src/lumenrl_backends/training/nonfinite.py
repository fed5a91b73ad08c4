"""Non-finite guard: skipped optimizer steps are counted, a streak of them stops the run, and
weights that are not finite are never saved.

An optimizer step whose loss or global grad norm is non-finite is skipped by the backend (no
parameter update, no optimizer-moment update, grads zeroed at the next step). :class:`NonFiniteGuard`
sees the skip flags of every optimizer step in order: it keeps the cumulative count (reported as
``<prefix>/nonfinite_skipped``) and the current streak; ``policy.train.max_consecutive_nonfinite_steps``
skips in a row raise :class:`NonFiniteError`. :func:`first_nonfinite` runs before every
checkpoint and export (the backend all-reduces its verdict so every rank refuses together).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lumenrl_backends.training import distributed as dist_utils

__all__ = ["NonFiniteError", "NonFiniteGuard", "first_nonfinite", "refuse_nonfinite"]


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot recover from (a streak of skipped steps, or weights)."""


class NonFiniteGuard:
    def __init__(self, max_consecutive: int, prefix: str) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive={max_consecutive} must be >= 1")
        self.max_consecutive, self.prefix = max_consecutive, prefix
        self.total = 0
        self.streak = 0

    def observe(self, skipped: Iterable[float]) -> dict[str, float]:
        """Record the skip flags (0/1) of optimizer steps in order; returns the cumulative-count metric."""
        for flag in skipped:
            if flag:
                self.total += 1
                self.streak += 1
            else:
                self.streak = 0
            if self.streak >= self.max_consecutive:
                raise NonFiniteError(
                    f"{self.streak} consecutive optimizer steps of the {self.prefix!r} model had a non-finite loss "
                    f"or gradient norm and were skipped ({self.total} in total); stopping "
                    f"(policy.train.max_consecutive_nonfinite_steps={self.max_consecutive}). Lower "
                    "policy.optim.lr, check the reward and data, or use fp32 (policy.train.mixed_precision=fp32)"
                )
        return {f"{self.prefix}/nonfinite_skipped": float(self.total)}


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor with a NaN/inf (this rank's shard of a DTensor), else None."""
    for name, tensor in named:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return name
    return None


def refuse_nonfinite(named: Iterable[tuple[str, torch.Tensor]], what: str, device: torch.device) -> None:
    """Raise :class:`NonFiniteError` on every rank if any rank holds a NaN/inf weight. Collective."""
    bad = first_nonfinite(named)
    if dist_utils.all_reduce_sum(float(bad is not None), device) > 0:
        raise NonFiniteError(f"refusing to write {what}: weight {bad or '(on another rank)'} is not finite")
