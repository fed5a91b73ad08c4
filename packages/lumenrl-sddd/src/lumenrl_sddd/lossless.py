"""Greedy losslessness up to numerical ties: where a speculative output differs from the plain one.

Speculative greedy decoding computes the target's argmax over the same tokens as plain decoding,
but through a different kernel shape (a verify forward of k + 1 query columns instead of one): in
floating point the logits differ in their last bits. Where the target's top two logits are that
close, the two decoders may pick different tokens, and the rest of the row follows a different but
equally greedy path. So on a GPU "token for token" is checked as: every row is identical, or at its
first differing position the two tokens' logits under a reference forward (the model in a wider
dtype, e.g. float64 on the CPU) are within a tie bound of each other.

:func:`divergence_gaps` returns, per differing row, (row, position, the reference logit gap between
the plain and the speculative token); an empty list means identical outputs.
"""

from __future__ import annotations

import torch

__all__ = ["divergence_gaps"]


@torch.no_grad()
def divergence_gaps(reference: torch.nn.Module, prompts: list[list[int]], plain: torch.Tensor,
                    spec: torch.Tensor) -> list[tuple[int, int, float]]:
    """``reference``: an HF causal LM (the target in the reference dtype/device); ``prompts``: each row's
    prompt tokens (no padding); ``plain``, ``spec``: (B, T) generated tokens of the two decoders.
    Returns [(row, first differing position j, |z[plain_j] - z[spec_j]|)] with z the reference logits
    after prompt + plain[:j]."""
    if plain.shape != spec.shape or len(prompts) != plain.shape[0]:
        raise ValueError(f"divergence_gaps: plain {tuple(plain.shape)}, spec {tuple(spec.shape)} and "
                         f"{len(prompts)} prompts must describe the same rows")
    device = next(reference.parameters()).device
    gaps = []
    for row, (a, b) in enumerate(zip(plain.tolist(), spec.tolist())):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        ids = torch.tensor([list(prompts[row]) + a[:j]], device=device)
        z = reference(input_ids=ids).logits[0, -1].double()
        gaps.append((row, j, float((z[a[j]] - z[b[j]]).abs())))
    return gaps
