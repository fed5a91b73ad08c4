"""FP8 training of a tiny causal transformer LM on CPU matches the FP32 run (slow: ~40 s)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_quant.training import attach_weight_cache_invalidation, convert_to_fp8_training

VOCAB, D_MODEL, HEADS, SEQ, BATCH, STEPS = 128, 128, 4, 32, 16, 300


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.up, self.down = nn.Linear(D_MODEL, 2 * D_MODEL), nn.Linear(2 * D_MODEL, D_MODEL)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        b = h.shape[0]
        q, k, v = self.qkv(self.ln1(h)).view(b, SEQ, 3, HEADS, D_MODEL // HEADS).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, SEQ, D_MODEL))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        return self.head(self.ln(self.blocks(self.emb(ids) + self.pos)))


def _markov_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences from a fixed random bigram chain: training batches and a held-out set."""
    g = torch.Generator().manual_seed(21)
    transition = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 2.0, dim=-1)

    def sample(n: int) -> torch.Tensor:
        ids = torch.empty(n, SEQ + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(VOCAB, (n,), generator=g)
        for t in range(SEQ):
            ids[:, t + 1] = torch.multinomial(transition[ids[:, t]], 1, generator=g).squeeze(1)
        return ids

    return sample(STEPS * BATCH), sample(256)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _train(fp8: bool) -> tuple[float, float]:
    train_ids, eval_ids = _markov_data()
    torch.manual_seed(22)
    model = _TinyLM()
    if fp8:  # the LM head stays high precision, as in RL (log-probs)
        report = convert_to_fp8_training(
            model, recipe="blockwise", fp8_format="hybrid", module_filter=lambda fqn, _m: fqn != "head"
        )
        assert len(report.converted) == 8 and "module_filter" in report.skipped["head"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    attach_weight_cache_invalidation(opt, model)
    first = None
    for step in range(STEPS):
        loss = _lm_loss(model, train_ids[step * BATCH : (step + 1) * BATCH])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return first, _lm_loss(model, eval_ids).item()


@pytest.mark.slow
def test_fp8_blockwise_hybrid_tiny_transformer_matches_fp32_within_2_percent():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first32, final32 = _train(fp8=False)
        first8, final8 = _train(fp8=True)
    finally:
        torch.set_num_threads(threads)
    assert final32 < 0.75 * first32 and final8 < 0.75 * first8  # both learned the chain
    assert abs(final8 - final32) / final32 <= 0.02, (final8, final32)
