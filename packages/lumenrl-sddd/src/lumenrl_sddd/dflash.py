"""DFlash draft: a block drafter that proposes a whole block in one forward.

Model::

    c_s    = norm_ctx(fc(concat of n teacher layers)_s)        # context features, positions s
    block  = [embed(x_a), m, m, ..., m]                          # B = block_size slots; m learned mask embedding
    layer l: q from the block; K/V = [k/v_proj_l(c_s) for s < a]  ++  [k/v_proj_l(block)]
             (target features injected into every layer's K/V; bidirectional inside the block)
    logits = teacher_lm_head(norm(h))                            # frozen teacher embedding and head

Slot i (1..B-1) of a block anchored at a predicts x_{a+i}. Training (:meth:`DFlashDraft.block_loss`)
samples ``anchors_per_seq`` random anchor positions per sequence and takes cross-entropy against the
teacher's probabilities at a + i - 1 (its prediction of x_{a+i}), weighted exp(-(i - 1) / gamma).

Inference (:meth:`DFlashDraft.propose`): context features are kept per cache column of the engine
(``DFlashState``); each round stores the features of the newly committed tokens and drafts one block
anchored at the newest committed token; the k = B - 1 slots are sampled independently from their
own distributions (a valid proposal for rejection sampling: each acceptance test uses the
distribution its token was drawn from).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lumenrl_sddd import plugin_manifest as manifest
from lumenrl_sddd.layers import MLP, Attention, RMSNorm, attend

__all__ = ["DFlashConfig", "DFlashDraft", "DFlashState"]


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int = 2
    block_size: int = 8  # slots per block: the anchor + block_size - 1 drafted tokens
    aux_layer_ids: list[int] = field(default_factory=list)
    gamma: float = 7.0  # position weights exp(-(i - 1) / gamma)
    anchors_per_seq: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(in_size=c.hidden_size, hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """h (N, B, H) block, ctx (N, S, H) context features, allowed (N, 1, B, S + B)."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        k_ctx, v_ctx = attn.key_value(ctx, ctx_pos)
        k_blk, v_blk = attn.key_value(x, pos)
        out = attend(attn.query(x, pos), torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), allowed)
        h = h + attn.o_proj(out)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(slots=True)
class DFlashState:
    features: torch.Tensor  # (N, L, H) fused context features by column
    positions: torch.Tensor  # (N, L) RoPE position of each column
    valid: torch.Tensor  # (N, L) bool


class DFlashDraft(nn.Module):
    kind = "dflash"
    capabilities = manifest.DFLASH.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.DFLASH.unavailable_reason()

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for frozen in (self.embed_tokens.weight, self.lm_head.weight):
            frozen.requires_grad_(False)  # the teacher's
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.norm_ctx = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    @classmethod
    def from_teacher(cls, teacher: nn.Module, *, aux_layer_ids: list[int], **overrides: Any) -> DFlashDraft:
        t = teacher.config
        fields = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                      head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                      vocab_size=t.vocab_size, aux_layer_ids=list(aux_layer_ids), rms_norm_eps=t.rms_norm_eps)
        fields.update(overrides)
        draft = cls(DFlashConfig(**fields))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(teacher.get_input_embeddings().weight.float())
            draft.lm_head.weight.copy_(teacher.get_output_embeddings().weight.float())
            draft.mask_embedding.copy_(draft.embed_tokens.weight.mean(0))
        return draft

    @property
    def layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self.config)}

    def _block(self, anchor_tok: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor, ctx_ok: torch.Tensor,
               anchor_pos: torch.Tensor) -> torch.Tensor:
        """anchor_tok (N,), ctx (N, S, H), ctx_ok (N, S) bool, anchor_pos (N,) -> logits (N, B - 1, V)."""
        n, size = anchor_tok.shape[0], self.config.block_size
        h = self.mask_embedding.expand(n, size, -1).clone()
        h[:, 0] = self.embed_tokens(anchor_tok).to(h.dtype)
        pos = anchor_pos[:, None] + torch.arange(size, device=h.device)  # (N, B)
        allowed = torch.cat([ctx_ok[:, None, :].expand(n, size, -1),
                             torch.ones(n, size, size, dtype=torch.bool, device=h.device)], dim=2)[:, None]
        for layer in self.layers:
            h = layer(h, pos, ctx, ctx_pos, allowed)
        return self.lm_head(self.norm(h[:, 1:]))

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm_ctx(self.fc(hidden.to(self.fc.weight.dtype)))

    # ------------------------------------------------------------------ training
    def block_loss(self, batch: Mapping[str, torch.Tensor], generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.config
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        b, t = ids.shape
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        ctx = self.context(batch["hidden"])  # (B, T, H)
        first = (~mask).long().sum(1)  # left padding per row
        # anchors a with a >= first + 1 (some context) and a + 1 < t (something to predict)
        lo = (first + 1).float()
        span = (t - 1 - lo).clamp(min=1)
        u = torch.rand(b, c.anchors_per_seq, generator=generator).to(ids.device)
        anchors = (lo[:, None] + (u * span[:, None]).floor()).long().clamp(max=t - 2)  # (B, A)
        rows = torch.arange(b, device=ids.device)[:, None].expand_as(anchors).flatten()
        a = anchors.flatten()
        cols = torch.arange(t, device=ids.device)
        ctx_ok = mask[rows] & (cols[None, :] < a[:, None])
        logits = self._block(ids[rows, a], ctx[rows], positions[rows], ctx_ok, positions[rows, a])  # (N, B-1, V)
        steps = torch.arange(1, c.block_size, device=ids.device)
        tpos = (a[:, None] + steps - 1).clamp(max=t - 1)  # teacher predicts x_{a+i} at a + i - 1
        live = (a[:, None] + steps < t).float()
        target = batch["logits"][rows[:, None], tpos].float().softmax(-1)
        ce = -(target * logits.float().log_softmax(-1)).sum(-1)  # (N, B-1)
        weight = torch.exp(-(steps - 1).float() / c.gamma) * live
        loss = (ce * weight).sum() / weight.sum().clamp(min=1)
        acc = ((logits.argmax(-1) == target.argmax(-1)).float() * live).sum() / live.sum().clamp(min=1)
        return loss, {"sddd/block_acc": float(acc.detach()),
                      "sddd/block_ce": float((ce * live).sum().detach() / live.sum().clamp(min=1))}

    # ------------------------------------------------------------------ inference
    def start(self, batch: int, max_len: int, device: torch.device) -> DFlashState:
        dtype = self.fc.weight.dtype
        return DFlashState(torch.zeros(batch, max_len, self.config.hidden_size, dtype=dtype, device=device),
                           torch.zeros(batch, max_len, dtype=torch.long, device=device),
                           torch.zeros(batch, max_len, dtype=torch.bool, device=device))

    @torch.no_grad()
    def commit(self, state: DFlashState, *, tokens: torch.Tensor, features: torch.Tensor, columns: torch.Tensor,
               positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Write context entries (as :meth:`propose` takes them) into ``state`` without drafting."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        # the feature before the token at column c belongs to column c - 1
        state.features[rows, columns - 1] = self.context(features)
        state.positions[rows, columns - 1] = positions - 1
        state.valid[rows, columns - 1] = valid

    @torch.no_grad()
    def propose(self, state: DFlashState, *, tokens: torch.Tensor, features: torch.Tensor, columns: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor, last: torch.Tensor, k: int,
                sample: Callable[[torch.Tensor], torch.Tensor], kv_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`Eagle3Draft.propose`; k must be block_size - 1."""
        if k != self.config.block_size - 1:
            raise ValueError(f"DFlash drafts block_size - 1 = {self.config.block_size - 1} tokens per round; asked k={k}")
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.commit(state, tokens=tokens, features=features, columns=columns, positions=positions, valid=valid)
        anchor_col = columns[rows, last]
        if kv_len is None:
            kv_len = int(anchor_col.max())
        cols = torch.arange(kv_len, device=tokens.device)
        ok = state.valid[:, :kv_len] & (cols[None, :] < anchor_col[:, None])
        logits = self._block(tokens[rows, last], state.features[:, :kv_len], state.positions[:, :kv_len], ok,
                             positions[rows, last]).float()  # (N, k, V)
        drafted = torch.stack([sample(logits[:, i]) for i in range(k)], 1)
        return drafted, logits


def position_weights(block_size: int, gamma: float) -> list[float]:
    return [math.exp(-(i - 1) / gamma) for i in range(1, block_size)]
