"""A structured synthetic text corpus and a tiny causal-LM trainer, so a small teacher learns structure.

Lines (character-level friendly, lowercase, digits and spaces) follow three patterns:

* counting: ``"count 17 18 19 20 21 ..."`` from a random start;
* repeated phrases: ``"say kab lo kab lo kab lo ..."`` (a random two-word phrase repeated);
* alphabet runs: ``"from h ijklmnopqrstuvwxyz abcdef..."`` (the alphabet, cyclic, from a random letter).

After a few hundred steps the teacher continues these nearly deterministically, which is what gives
a trained draft a long acceptance length. ``prompts`` cut lines after their first few tokens, so the
teacher regenerates the rest itself.
"""

from __future__ import annotations

import random
import string
from typing import Any

import torch
from torch import nn

__all__ = ["corpus_lines", "encode_lines", "train_causal_lm", "prompts_from_lines"]


def _line(rng: random.Random, length: int) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randrange(0, 80)
        text = "count " + " ".join(str(start + i) for i in range(length))
    elif kind == 1:
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 3))) for _ in range(2)]
        text = "say " + " ".join(words * length)
    else:
        first = rng.randrange(26)
        text = f"from {string.ascii_lowercase[first]} " + "".join(
            string.ascii_lowercase[(first + 1 + i) % 26] for i in range(4 * length))
    return text[: 4 * length]


def corpus_lines(count: int, *, length: int = 24, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_line(rng, length) for _ in range(count)]


def encode_lines(tokenizer: Any, lines: list[str], width: int) -> torch.Tensor:
    """Lines -> (N, width) ids: bos + characters, truncated / right-padded with pad."""
    out = torch.full((len(lines), width), tokenizer.pad_token_id, dtype=torch.long)
    for row, line in enumerate(lines):
        ids = ([tokenizer.bos_token_id] + tokenizer(line, add_special_tokens=False)["input_ids"])[:width]
        out[row, : len(ids)] = torch.tensor(ids)
    return out


def prompts_from_lines(tokenizer: Any, lines: list[str], prompt_chars: int) -> list[list[int]]:
    return [[tokenizer.bos_token_id] + tokenizer(line[:prompt_chars], add_special_tokens=False)["input_ids"]
            for line in lines]


def train_causal_lm(model: nn.Module, ids: torch.Tensor, *, pad_id: int, steps: int, batch_size: int = 32,
                    lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-token cross-entropy on rows of ``ids`` (N, T); returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        batch = ids[torch.randint(0, ids.shape[0], (batch_size,), generator=gen)].to(device)
        mask = (batch != pad_id).long()
        logits = model(input_ids=batch, attention_mask=mask).logits[:, :-1]
        target = batch[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
