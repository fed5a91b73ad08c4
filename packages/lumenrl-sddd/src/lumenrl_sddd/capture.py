"""Teacher capture: hidden states of chosen layers and teacher logits, from an HF causal LM.

Layer choice (0-based decoder-layer outputs, ``hidden_states[i + 1]`` of an HF forward):

* Eagle3: ``[1, N/2 - 1, N - 4]`` (low, mid, high), each clamped into ``[0, N - 1]`` so tiny
  teachers (N < 5) still get three valid layers;
* DFlash: ``n`` layers evenly spaced over ``[1, N - 2]`` (clamped likewise).

A capture is a dict of tensors (what a transfer engine moves): ``input_ids`` (B, T),
``attention_mask`` (B, T), ``hidden`` (B, T, n * H) the chosen layers concatenated, and
``logits`` (B, T, V) float32 (the teacher's next-token logits at every position: the draft's
soft targets). ``regenerate`` builds the training sequences: prompts continued by the teacher
itself (greedy or sampled), so the draft learns the teacher's own distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["eagle3_layer_ids", "dflash_layer_ids", "capture", "select_hidden", "regenerate"]


def _clamp(ids: Sequence[int], num_layers: int) -> list[int]:
    return [min(max(int(i), 0), num_layers - 1) for i in ids]


def eagle3_layer_ids(num_layers: int) -> list[int]:
    return _clamp([1, num_layers // 2 - 1, num_layers - 4], num_layers)


def dflash_layer_ids(num_layers: int, count: int = 3) -> list[int]:
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    if count == 1:
        return _clamp([num_layers // 2], num_layers)
    lo, hi = 1, max(num_layers - 2, 1)
    return _clamp([round(lo + (hi - lo) * i / (count - 1)) for i in range(count)], num_layers)


def select_hidden(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """HF ``hidden_states`` tuple (embeddings first) -> (B, T, n * H) outputs of ``layer_ids``."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """One teacher forward (left- or right-padded batch) -> the capture dict (module docstring)."""
    positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                output_hidden_states=True, use_cache=False)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask.long(),
        "hidden": select_hidden(out.hidden_states, layer_ids),
        "logits": out.logits.float(),
    }


@torch.no_grad()
def regenerate(model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int,
               temperature: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts continued by the teacher (KV-cached HF ``generate``) -> left-padded (ids, mask)."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), device=device)
        mask[row, width - len(prompt):] = 1
    kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, **kwargs)
    full_mask = torch.cat([mask, torch.ones_like(out[:, width:])], dim=1)
    return out, full_mask
