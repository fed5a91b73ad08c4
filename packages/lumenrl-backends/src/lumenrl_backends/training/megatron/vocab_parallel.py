"""Token log-probs and entropies from vocab-parallel logits (tensor parallel output layer).

With tp > 1 Megatron's output layer is column-parallel with ``parallel_output=True``: TP rank t
holds logits z[..., t*V/tp : (t+1)*V/tp] (float32 after the cast below). With z = logits / T:

* ``S = sum_t sum_v exp(z_v - m)`` with m the global max (all-reduce MAX, no gradient: nothing
  depends on m), ``lse = m + log S``;
* ``log p(tok) = z_tok - lse``, z_tok from the one rank whose slice holds the token (others add 0);
* ``entropy = lse - sum_v p_v z_v = lse - A / S`` with ``A = sum_t sum_v exp(z_v - m) z_v``.

Every cross-rank quantity is a plain sum (S, A, z_tok) all-reduced with Megatron's
``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward identity). That backward
is right because whatever is computed from the sums is computed identically on every TP rank, so
each rank receives the same gradient for them and passes it to its own slice; the column-parallel
layer's input-gradient all-reduce then adds the slices' contributions to the hidden states. (An
entropy written as ``sum_t all_reduce(sum_v p_v z_v)`` with ``p = exp(z - lse)`` would not be: each
rank's local terms feed rank-specific gradients back into ``lse``.) Same formulas as
:func:`~lumenrl_backends.training.modeling.token_log_probs` (which runs at tp = 1) up to float32
summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lumenrl_backends.training.modeling import token_log_probs

__all__ = ["vocab_parallel_token_log_probs"]


def vocab_parallel_token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    tp_group: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log p(token) and optionally entropy, from this rank's vocab slice ``logits`` (B, T, V/tp)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return token_log_probs(logits, tokens, temperature, with_entropy)
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs")
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as all_sum

    scaled = logits.float() / temperature  # (B, T, V/tp)
    part = scaled.shape[-1]
    first = dist.get_rank(tp_group) * part  # this slice holds tokens [first, first + part)
    peak = scaled.detach().amax(-1)  # (B, T)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    exp = torch.exp(scaled - peak[..., None])  # (B, T, V/tp)
    total = all_sum(exp.sum(-1), group=tp_group)  # S: (B, T)
    lse = peak + total.log()
    local = tokens - first
    mine = (local >= 0) & (local < part)
    picked = scaled.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine  # (B, T)
    log_probs = all_sum(picked, group=tp_group) - lse
    entropy = None
    if with_entropy:
        entropy = lse - all_sum((exp * scaled).sum(-1), group=tp_group) / total
    return log_probs, entropy
