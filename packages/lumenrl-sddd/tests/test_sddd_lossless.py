"""divergence_gaps: the first differing position per row and the reference logit gap there."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lumenrl_sddd import divergence_gaps


def tiny_lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).double().eval()


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_identical_rows_have_no_gap_and_a_changed_token_is_found_with_its_gap():
    seed = int(torch.randint(0, 10_000, ()))
    model = tiny_lm(seed)
    prompts = [[1, 5, 7], [2, 9], [3, 3, 3, 4]]
    plain = torch.tensor([greedy(model, p, 6) for p in prompts])
    assert divergence_gaps(model, prompts, plain, plain.clone()) == []
    spec = plain.clone()
    j = 3
    spec[1, j] = (plain[1, j] + 1) % 40  # another token at position 3 of row 1, then anything
    spec[1, j + 1:] = 0
    (row, position, gap), = divergence_gaps(model, prompts, plain, spec)
    z = model(input_ids=torch.tensor([prompts[1] + plain[1, :j].tolist()])).logits[0, -1]
    assert (row, position) == (1, j)
    assert gap == pytest.approx(float(z[plain[1, j]] - z[spec[1, j]]), abs=1e-12)
    assert gap > 0  # the plain token is the argmax


def test_mismatched_shapes_are_refused():
    model = tiny_lm(0)
    with pytest.raises(ValueError, match="same rows"):
        divergence_gaps(model, [[1]], torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
