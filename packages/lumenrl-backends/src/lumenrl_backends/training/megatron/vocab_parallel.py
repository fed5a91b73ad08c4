"""Token log-probs and entropies from vocab-parallel logits (tensor parallel output layer).

With tp > 1 Megatron's output layer is column-parallel with ``parallel_output=True``: TP rank t
holds logits z[..., t*V/tp : (t+1)*V/tp] (float32 after the cast below). With z = logits / T:

* ``lse = m + log(sum_t sum_v exp(z_v - m))``, m the global max (all-reduce MAX, no gradient:
  the result does not depend on m);
* ``log p(tok) = z_tok - lse``, z_tok from the one rank whose slice holds the token (others add 0);
* ``entropy = lse - sum_v p_v z_v``, ``p = exp(z - lse)``.

Sums over the vocabulary are all-reduced with Megatron's ``reduce_from_tensor_model_parallel_region``
(forward all-reduce, backward identity): every TP rank computes the same loss from these sums and
back-propagates it, so each rank's slice receives exactly its own gradient, and the column-parallel
layer's input-gradient all-reduce adds the slices' contributions to the hidden states.
Same formulas as :func:`~lumenrl_backends.training.modeling.token_log_probs` (which runs at tp = 1),
so results equal the 1-rank path up to float32 summation order.
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
    lse = peak + all_sum(torch.exp(scaled - peak[..., None]).sum(-1), group=tp_group).log()  # (B, T)
    local = tokens - first
    mine = (local >= 0) & (local < part)
    picked = scaled.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine  # (B, T)
    log_probs = all_sum(picked, group=tp_group) - lse
    entropy = None
    if with_entropy:
        probs = torch.exp(scaled - lse[..., None])  # (B, T, V/tp)
        entropy = lse - all_sum((probs * scaled).sum(-1), group=tp_group)
    return log_probs, entropy
