"""Token log-probs and entropies from logits, without a full float32 (N, V) softmax.

Both functions walk the flattened (N, V) logits in row chunks and upcast one chunk at a time,
so peak extra memory is O(chunk_rows * V) floats instead of O(N * V) -- the difference
between a few MB and tens of GB for a 150k vocabulary. With autograd on, each chunk is
recomputed in backward (activation checkpointing), so the saved state is just the input logits.

- ``log_probs_from_logits``: log_softmax(logits.float() / temperature) gathered at ``labels``
  (the convention of the batch contract, so engine and trainer numbers are comparable).
- ``entropy_from_logits``: H = logsumexp(z) - sum softmax(z) * z per row, z = logits.float().
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits", "log_probs_from_logits"]

DEFAULT_CHUNK_ROWS = 1024


def entropy_from_logits(logits: torch.Tensor, *, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of the softmax over the last dim; shape ``logits.shape[:-1]``, float32."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    out = _chunked(_entropy_rows, chunk_rows, flat)
    return out.reshape(logits.shape[:-1])


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature); shape ``labels.shape``, float32."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} is invalid: must be > 0 (greedy uses 1.0 here)")
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_labels = labels.reshape(-1, 1)  # (N, 1)

    def rows(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        z = chunk.float() / temperature
        return z.gather(-1, chunk_labels).squeeze(-1) - torch.logsumexp(z, dim=-1)

    return _chunked(rows, chunk_rows, flat, flat_labels).reshape(labels.shape)


def _entropy_rows(chunk: torch.Tensor) -> torch.Tensor:
    z = chunk.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _chunked(fn: Callable[..., torch.Tensor], chunk_rows: int, *tensors: torch.Tensor) -> torch.Tensor:
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows={chunk_rows!r} is invalid: must be a positive int")
    n_rows = tensors[0].shape[0]
    use_ckpt = torch.is_grad_enabled() and tensors[0].requires_grad and n_rows > chunk_rows
    parts = []
    for start in range(0, n_rows, chunk_rows):
        pieces = [t[start : start + chunk_rows] for t in tensors]
        parts.append(checkpoint(fn, *pieces, use_reentrant=False) if use_ckpt else fn(*pieces))
    if not parts:
        return tensors[0].new_zeros((0,), dtype=torch.float32)
    return torch.cat(parts)
