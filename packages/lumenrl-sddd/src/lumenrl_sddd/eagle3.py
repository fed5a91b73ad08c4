"""Eagle3 draft: fc over three teacher layers, one decoder layer on concat(embeds, hidden), draft vocab.

Model (names as in vLLM/SGLang's ``llama_eagle3``, so :mod:`~lumenrl_sddd.export` writes them as is)::

    g_t   = fc(concat(h_low, h_mid, h_high)_t)                       # 3H -> H
    x     = concat(input_layernorm(embed(tok)), hidden_norm(hid))     # (B, T, 2H); q/k/v take 2H
    h     = hid + o_proj(attn(x));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                         # draft vocab (d2t / t2d)

At position t the first step reads ``(tok = x_t, hid = g_{t-1})`` and predicts x_{t+1}; each later
step j feeds the draft's own ``h`` back with the next token and predicts x_{t+j+1} (RoPE position
t + j). ``embed_tokens`` is the teacher's embedding, frozen.

Training-time test (:meth:`Eagle3Draft.ttt_loss`): unroll ``steps`` such steps over every position
at once. Step j's query at t attends to step 0's keys at positions <= t (the context entries) and to
the keys of steps 1..j at t only (its own earlier chain entries) - the key set the same query has at
inference in the draft's KV cache. Loss per step: cross-entropy against the teacher's probabilities
at position t + j restricted to the draft vocabulary (renormalised), weighted 0.8^j.

Inference (:meth:`Eagle3Draft.propose`, driven by the native engine's speculative decoder): a KV
cache per row (``Eagle3State``), indexed by the engine's cache columns; each round writes the step-0
entries of the newly committed tokens, then chains k tokens; rollback is implicit (later rounds
overwrite the columns past the accepted prefix, which causal masks hide until then).
:meth:`Eagle3Draft.compile_inference` runs each chained step's dense pieces through ``torch.compile``
(for CUDA graphs of the rounds: fewer, fused kernels per step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_sddd import plugin_manifest as manifest
from lumenrl_sddd.layers import MLP, Attention, RMSNorm, attend

__all__ = ["Eagle3Config", "Eagle3Draft", "Eagle3State"]

_COMPILED: dict[str, Callable] = {}  # torch.compile'd step pieces, made once per process (compile_inference)


def _entries(draft: Eagle3Draft, tok: torch.Tensor, hid: torch.Tensor, positions: torch.Tensor,
             tables: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries (tok, hid) (B, q) -> their query (B, H, q, D), key and value (B, H_kv, q, D)."""
    attn = draft.midlayer.self_attn
    x = draft.midlayer.inputs(draft.embed_tokens(tok).to(hid.dtype), hid)
    k, v = attn.key_value(x, positions, tables)
    return attn.query(x, positions, tables), k, v


def _finish_and_logits(draft: Eagle3Draft, out: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, q, H * D) -> (h (B, q, H), draft-vocabulary logits (B, q, Vd) in float32)."""
    h = draft.midlayer.finish(out, hid)
    return h, draft._logits(h).float()


def _compiled(fn: Callable, backend: str) -> Callable:
    key = f"{fn.__name__}/{backend}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend, fullgraph=True)
    return _COMPILED[key]


@dataclass(kw_only=True, slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)  # teacher layers fused by fc
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    ttt_steps: int = 7  # unrolled training-time-test steps
    step_decay: float = 0.8  # loss weight of step j: step_decay ** j
    max_position_embeddings: int = 2048

    @classmethod
    def from_teacher(cls, teacher_config: Any, *, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any):
        c = teacher_config
        fields = dict(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size, aux_layer_ids=list(aux_layer_ids),
            rope_theta=float(getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
                "rope_theta", 10000.0)),
            rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings)
        fields.update(overrides)
        return cls(**fields)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = Attention(in_size=2 * h, hidden_size=h, num_heads=c.num_attention_heads,
                                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.mlp = MLP(h, c.intermediate_size)

    def inputs(self, embeds: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hid)], dim=-1)  # (B, T, 2H)

    def finish(self, attn_out: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        h = hid + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(slots=True)
class Eagle3State:
    keys: torch.Tensor  # (B, H_kv, L, D)
    values: torch.Tensor  # (B, H_kv, L, D)
    valid: torch.Tensor  # (B, L) bool: columns holding a real context entry


class Eagle3Draft(nn.Module):
    kind = "eagle3"
    capabilities = manifest.EAGLE3.capabilities
    compiled: str | None = None  # the torch.compile backend of the chained steps' pieces (compile_inference)

    @classmethod
    def probe(cls) -> str | None:
        return manifest.EAGLE3.unavailable_reason()

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = self.config = config
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the teacher's, frozen
        self.fc = nn.Linear(len(c.aux_layer_ids) * h, h, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_teacher(cls, teacher: nn.Module, *, counts: torch.Tensor, draft_vocab_size: int,
                     aux_layer_ids: list[int], **overrides: Any) -> Eagle3Draft:
        from lumenrl_sddd.vocab import draft_vocab_maps

        draft = cls(Eagle3Config.from_teacher(teacher.config, draft_vocab_size=draft_vocab_size,
                                              aux_layer_ids=aux_layer_ids, **overrides))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(teacher.get_input_embeddings().weight.float())
            d2t, t2d = draft_vocab_maps(counts.cpu(), draft_vocab_size)
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        return draft

    @property
    def layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    def compile_inference(self, backend: str | None = "inductor") -> Eagle3Draft:
        """Run each chained draft step's dense pieces through ``torch.compile``: the input norms, q/k/v and RoPE,
        then o_proj, the MLP, the final norm and the head. Inductor fuses their elementwise ops, so a step
        launches fewer kernels; replayed from a CUDA graph at batch 1 each kernel still has a fixed GPU cost,
        which is most of a small draft's step (measured: decision 0013). The KV writes, attention and sampling stay eager;
        the commit of a round's entries and training (:meth:`ttt_loss`) are untouched. Compiles happen at the
        first calls (batch 1 static, then one symbolic batch: automatic dynamic shapes); a piece that fails to
        compile warns and runs eagerly from then on. ``backend``: torch.compile's (None: off)."""
        self.compiled = backend
        return self

    def _piece(self, fn: Callable, chained: bool, *args: Any) -> Any:
        """``fn(self, *args)``, through torch.compile for a chained step (one entry per row) when compiled."""
        if self.compiled and chained:
            try:
                return _compiled(fn, self.compiled)(self, *args)
            except Exception as err:  # noqa: BLE001 - the pieces are pure: the eager call below redoes the work
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"Eagle3 draft: torch.compile failed ({type(err).__name__}: {err}); running the chained "
                              "steps eagerly", stacklevel=3)
                self.compiled = None
        return fn(self, *args)

    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self.config)}

    def target_ids(self) -> torch.Tensor:
        """(Vd,) the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # ------------------------------------------------------------------ training
    def ttt_loss(self, batch: Mapping[str, torch.Tensor], steps: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """batch: a capture (``input_ids``, ``attention_mask`` (B, T), ``hidden`` (B, T, 3H), ``logits``)."""
        steps = steps or self.config.ttt_steps
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        dtype = self.fc.weight.dtype
        b, t = ids.shape
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        g = self.fc(batch["hidden"].to(dtype))  # (B, T, H)
        hid = torch.cat([g.new_zeros(b, 1, g.shape[-1]), g[:, :-1]], dim=1)  # g_{t-1} at t
        base = mask & torch.cat([mask.new_zeros(b, 1), mask[:, :-1]], dim=1)  # (B, T) t and t-1 real
        target = batch["logits"][..., self.t2d].float().softmax(-1)  # (B, T, Vd) teacher at t
        cols = torch.arange(t, device=ids.device)
        causal = (cols[None, :] <= cols[:, None])[None] & base[:, None, :]  # (B, T, T) over step-0 keys
        diag = torch.eye(t, dtype=torch.bool, device=ids.device)[None].expand(b, t, t)
        attn, keys, values = self.midlayer.self_attn, [], []
        total, metrics = 0.0, {}
        for j in range(steps):
            tok = F.pad(ids[:, j:], (0, j), value=0)  # x_{t+j}
            x = self.midlayer.inputs(self.embed_tokens(tok).to(dtype), hid)
            pos = positions + j
            k, v = attn.key_value(x, pos)
            keys.append(k), values.append(v)
            allowed = torch.cat([causal] + [diag] * j, dim=2)[:, None]  # (B, 1, T, T * (j + 1))
            allowed = allowed | torch.eye(t, t * (j + 1), dtype=torch.bool, device=ids.device)[None, None]
            out = attend(attn.query(x, pos), torch.cat(keys, 2), torch.cat(values, 2), allowed)
            hid = self.midlayer.finish(out, hid)
            logp = self._logits(hid).float().log_softmax(-1)  # (B, T, Vd)
            tgt = F.pad(target[:, j:], (0, 0, 0, j))
            live = (base & F.pad(mask[:, j:], (0, j), value=False)).float()
            if j:  # step j needs x_{t+j} and the teacher at t + j
                live = live * (cols < t - j).float()
            ce = -(tgt * logp).sum(-1)
            denom = live.sum().clamp(min=1)
            step_loss = (ce * live).sum() / denom
            total = total + self.config.step_decay ** j * step_loss
            acc = ((logp.argmax(-1) == tgt.argmax(-1)).float() * live).sum() / denom
            metrics[f"sddd/acc_step{j}"] = float(acc.detach())
            metrics[f"sddd/loss_step{j}"] = float(step_loss.detach())
        return total, metrics

    # ------------------------------------------------------------------ inference
    def start(self, batch: int, max_len: int, device: torch.device) -> Eagle3State:
        c = self.config
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        dtype = self.fc.weight.dtype
        # a draft vocabulary that is the whole target vocabulary in order needs no scatter per step
        self._identity_vocab = c.draft_vocab_size == c.vocab_size and not bool(self.d2t.any())
        return Eagle3State(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(batch, max_len, dtype=torch.bool, device=device))

    def _write(self, state: Eagle3State, tok: torch.Tensor, hid: torch.Tensor, columns: torch.Tensor,
               positions: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """K/V of entries (B, q) into ``state`` at ``columns``; returns their queries (B, H, q, D). An entry's K/V
        depend on that entry only, so entries written in several calls equal one call. ``tables``: the
        positions' RoPE tables, when the caller shares them with the query."""
        q, k, v = self._piece(_entries, tok.shape[1] == 1, tok, hid, positions, tables)
        rows = torch.arange(tok.shape[0], device=tok.device)[:, None]
        state.keys[rows, :, columns] = k.transpose(1, 2)
        state.values[rows, :, columns] = v.transpose(1, 2)
        return q

    @torch.no_grad()
    def commit(self, state: Eagle3State, *, tokens: torch.Tensor, features: torch.Tensor, columns: torch.Tensor,
               positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Write context entries (as :meth:`propose` takes them) into ``state`` without drafting."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        state.valid[rows[:, None], columns] = valid
        self._write(state, tokens, self.fc(features.to(self.fc.weight.dtype)), columns, positions)

    def _step(self, state: Eagle3State, tok: torch.Tensor, hid: torch.Tensor, columns: torch.Tensor,
              positions: torch.Tensor, key_cols: torch.Tensor, tables: tuple | None = None, logits: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write entries at ``columns`` (B, q) and attend causally by column over ``key_cols`` (arange(kv_len),
        made once per round); returns (h (B, q, H), with ``logits`` its float32 draft logits (B, q, Vd), else
        None). The RoPE ``tables`` of ``positions`` (made here when not given) serve query and key."""
        attn = self.midlayer.self_attn
        kv_len = key_cols.shape[0]
        if tables is None:
            tables = attn.rope_tables(positions, hid.dtype)
        q = self._write(state, tok, hid, columns, positions, tables)
        allowed = state.valid[:, None, :kv_len] & (key_cols[None, None, :] <= columns[:, :, None])  # (B, q, kv)
        allowed = allowed | (key_cols[None, None, :] == columns[:, :, None])
        out = attend(q, state.keys[:, :, :kv_len], state.values[:, :, :kv_len], allowed[:, None])
        if logits:
            return self._piece(_finish_and_logits, tok.shape[1] == 1, out, hid)
        return self.midlayer.finish(out, hid), None

    @torch.no_grad()
    def propose(self, state: Eagle3State, *, tokens: torch.Tensor, features: torch.Tensor, columns: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor, last: torch.Tensor, k: int,
                sample: Callable[[torch.Tensor], torch.Tensor], kv_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit context entries and chain ``k`` draft tokens.

        tokens (B, q) committed tokens at ``columns`` (B, q) / ``positions`` (B, q); features (B, q, 3H)
        the teacher features of the token before each; ``valid`` (B, q) which entries are real;
        ``last`` (B,) index into q of each row's newest committed token. ``sample(logits (B, V))`` picks
        a token from full-vocabulary logits. ``kv_len``: the columns attended (default: what the entries need;
        a larger fixed value gives fixed shapes, for CUDA graphs). Returns (draft tokens (B, k), logits (B, k, V)).
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if kv_len is None:
            kv_len = int(columns.max()) + k + 1
        state.valid[rows[:, None], columns] = valid
        key_cols = torch.arange(kv_len, device=tokens.device)
        hid, _ = self._step(state, tokens, self.fc(features.to(self.fc.weight.dtype)), columns, positions, key_cols)
        h = hid[rows, last][:, None]  # (B, 1, H)
        small = self._logits(h)[:, 0].float()  # (B, Vd)
        # the chained steps' columns, positions and RoPE tables, made once: step j + 1 takes slice j (views)
        ahead = torch.arange(1, k, device=tokens.device)
        chain_cols, chain_pos = columns[rows, last][:, None] + ahead, positions[rows, last][:, None] + ahead  # (B, k-1)
        chain_cos, chain_sin = self.midlayer.self_attn.rope_tables(chain_pos, h.dtype)  # (B, 1, k-1, D/2)
        target_ids = self.target_ids()
        drafted, all_logits = [], []
        identity = getattr(self, "_identity_vocab", False)
        for j in range(k):
            if identity:
                full = small
            else:
                full = small.new_full((small.shape[0], self.config.vocab_size), float("-inf"))
                full[:, target_ids] = small
            tok = sample(full)
            drafted.append(tok), all_logits.append(full)
            if j + 1 < k:
                col, pos = chain_cols[:, j:j + 1], chain_pos[:, j:j + 1]
                state.valid.scatter_(1, col, True)  # no host copy (CUDA graph capture)
                h, small = self._step(state, tok[:, None], h, col, pos, key_cols,
                                      (chain_cos[:, :, j:j + 1], chain_sin[:, :, j:j + 1]), logits=True)
                small = small[:, 0]
        return torch.stack(drafted, 1), torch.stack(all_logits, 1)
