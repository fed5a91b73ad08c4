"""Loss aggregation: how a per-token loss matrix (B, T) becomes one scalar.

Modes (``L`` the per-token loss, ``m`` the 0/1 response mask, ``n_i = sum_t m_it``):

- ``token-mean``: ``sum_{i,t} L m / N_tok`` -- every token weighs the same (DAPO; TRL "dapo"/"bnpo").
- ``seq-mean-token-mean``: ``sum_i (sum_t L m / n_i) / N_seq`` -- per-sequence mean, then mean
  over sequences (original GRPO; TRL "grpo").
- ``seq-mean-token-sum``: ``sum_i sum_t L m / N_seq``.
- ``seq-mean-token-sum-norm``: ``sum_{i,t} L m / (N_seq * max_len)`` with ``max_len`` a fixed
  constant (Dr.GRPO; defaults to T, the padded width of ``loss_mat``).

``N_tok`` defaults to the valid tokens in ``mask`` and ``N_seq`` to the rows with at least one
valid token. A backend that splits a mini-batch into micro-batches (and DP ranks) passes the
*mini-batch* totals as ``global_tokens`` / ``global_seqs`` (and a fixed ``max_len``); every
term above is then a per-row quantity over a shared denominator, so

    sum over micro-batches of agg_loss(micro, ..., global_*) == agg_loss(full mini-batch)

exactly (up to float rounding), and gradient accumulation by plain summation gives the
mini-batch gradient. Across W data-parallel ranks with global totals, the per-rank losses sum
to the global loss: a backend whose gradient all-reduce *averages* (FSDP) multiplies the
rank-local loss by W to keep the sum. Without ``global_*`` each call normalizes locally (the
usual per-micro-batch mean).
"""

from __future__ import annotations

import torch

__all__ = ["LOSS_AGG_MODES", "agg_loss", "count_tokens_and_seqs"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def count_tokens_and_seqs(mask: torch.Tensor) -> tuple[int, int]:
    """Valid tokens and rows with at least one valid token: the ``global_*`` of a mini-batch."""
    per_row = mask.to(torch.float32).sum(dim=-1)
    tokens, seqs = torch.stack([per_row.sum(), (per_row > 0).sum().to(torch.float32)]).tolist()  # one sync
    return int(tokens), int(seqs)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) under ``mask`` (B, T) to a scalar by ``mode``."""
    mask_f = mask.to(loss_mat.dtype)
    seq_sums = (loss_mat * mask_f).sum(dim=-1)  # (B,)
    seq_lens = mask_f.sum(dim=-1)  # (B,)
    if mode == "token-mean":
        return seq_sums.sum() / _denominator(global_tokens, seq_lens.sum())
    n_seqs = _denominator(global_seqs, (seq_lens > 0).to(loss_mat.dtype).sum())
    if mode == "seq-mean-token-mean":
        return (seq_sums / seq_lens.clamp_min(1.0)).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        width = loss_mat.shape[-1] if max_len is None else max_len
        if width <= 0:
            raise ValueError(f"max_len={max_len!r} is invalid: must be a positive int (or None for T)")
        return seq_sums.sum() / (n_seqs * width)
    raise ValueError(f"loss_agg_mode={mode!r} is not supported; allowed: {', '.join(LOSS_AGG_MODES)}")


def _denominator(given: int | float | torch.Tensor | None, local: torch.Tensor) -> torch.Tensor | float:
    """The global count when given, else the local one; clamped to >= 1 so empty batches give 0.

    A Python count stays a Python number: making it a device tensor would copy it from pageable host memory,
    which waits for all the work queued on the stream (the forward this loss follows)."""
    if given is None:
        return local.clamp_min(1.0)
    if isinstance(given, torch.Tensor):
        return given.to(dtype=local.dtype, device=local.device).clamp_min(1.0)
    return max(float(given), 1.0)
