"""HF <-> Megatron-Core weight conversion, one adapter per model family.

Megatron-Core's GPT layout (local layer spec, ``megatron-core`` 0.16) versus HF Llama/Qwen3:

* ``self_attention.linear_qkv.weight`` (G*(q+2)*hd, H): per query group g (G = KV heads),
  the group's ``q = heads/G`` query heads, then its key head, then its value head, each ``hd``
  rows. HF keeps ``q_proj`` (heads*hd, H), ``k_proj``/``v_proj`` (G*hd, H) apart.
* ``mlp.linear_fc1.weight`` (2F, H) = [gate_proj; up_proj] (SwiGLU: first half is activated).
* norms: ``input_layernorm``, ``pre_mlp_layernorm``, ``decoder.final_layernorm``; Qwen3's
  per-head q/k RMSNorm = ``self_attention.{q,k}_layernorm`` (``qk_layernorm=True``).
* ``embedding.word_embeddings``; ``output_layer`` unless embeddings are tied (then absent).
* MoE (Qwen3-MoE, every layer routed): ``mlp.router.weight`` (E, H) = HF ``mlp.gate.weight``;
  expert e's ``mlp.experts.local_experts.{e}.linear_fc1.weight`` (2F, H) = HF
  ``mlp.experts.gate_up_proj[e]`` ([gate; up]) and ``linear_fc2`` (H, F) = ``down_proj[e]``.

Conversion is a pure re-layout (cat/split/view), so HF -> Megatron -> HF is bit-exact.
Families are looked up by ``config.model_type`` in :data:`ADAPTERS`; a family not listed is
refused with the list of supported ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = ["ADAPTERS", "FamilyAdapter", "adapter_for"]

_LAYER_MAP = (  # (megatron suffix, HF suffix): one-to-one tensors of every decoder layer
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
)
_QK_NORM_MAP = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)


@dataclass(kw_only=True, slots=True, frozen=True)
class FamilyAdapter:
    """Dense decoder family with fused QKV/gate-up; ``qk_layernorm`` for Qwen3-style q/k norms."""

    model_type: str
    qk_layernorm: bool = False
    moe: bool = False  # routed experts in every layer (Megatron MoE layer, SequentialMLP experts)

    def _one_to_one(self) -> tuple[tuple[str, str], ...]:
        return _LAYER_MAP + (_QK_NORM_MAP if self.qk_layernorm else ())

    @staticmethod
    def _dims(config) -> tuple[int, int, int]:
        heads, groups = config.num_attention_heads, config.num_key_value_heads
        hd = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads // groups, groups, hd

    def to_megatron(self, config, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF state dict -> Megatron-Core GPTModel state dict (tensors, no ``_extra_state``)."""
        q_per, groups, hd = self._dims(config)
        out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not config.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        for i in range(config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
            for m, h in self._one_to_one():
                out[dst + m] = hf[src + h]
            q = hf[src + "self_attn.q_proj.weight"].view(groups, q_per * hd, -1)  # (G, q*hd, H)
            k = hf[src + "self_attn.k_proj.weight"].view(groups, hd, -1)  # (G, hd, H)
            v = hf[src + "self_attn.v_proj.weight"].view(groups, hd, -1)
            out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
            out.update(self._mlp_to_megatron(hf, src, dst))
        return out

    def _mlp_to_megatron(self, hf, src: str, dst: str) -> dict[str, torch.Tensor]:
        if not self.moe:
            fc1 = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
            return {
                dst + "mlp.linear_fc1.weight": fc1,
                dst + "mlp.linear_fc2.weight": hf[src + "mlp.down_proj.weight"],
            }
        out = {dst + "mlp.router.weight": hf[src + "mlp.gate.weight"]}
        gate_up, down = (
            hf[src + "mlp.experts.gate_up_proj"],
            hf[src + "mlp.experts.down_proj"],
        )  # (E, 2F, H), (E, H, F)
        for e in range(gate_up.shape[0]):
            out[f"{dst}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[f"{dst}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
        return out

    def _mlp_to_hf(self, config, mc, src: str, dst: str) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.moe:
            gate, up = mc[src + "mlp.linear_fc1.weight"].chunk(2)
            yield dst + "mlp.gate_proj.weight", gate
            yield dst + "mlp.up_proj.weight", up
            yield dst + "mlp.down_proj.weight", mc[src + "mlp.linear_fc2.weight"]
            return
        experts = range(config.num_experts)
        yield dst + "mlp.gate.weight", mc[src + "mlp.router.weight"]
        yield (
            dst + "mlp.experts.gate_up_proj",
            torch.stack([mc[f"{src}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]),
        )
        yield (
            dst + "mlp.experts.down_proj",
            torch.stack([mc[f"{src}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]),
        )

    def to_hf(self, config, mc: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Megatron-Core state dict -> HF (name, tensor), in HF order, one tensor at a time."""
        q_per, groups, hd = self._dims(config)
        yield "model.embed_tokens.weight", mc["embedding.word_embeddings.weight"]
        for i in range(config.num_hidden_layers):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            qkv = mc[src + "self_attention.linear_qkv.weight"]
            qkv = qkv.view(groups, (q_per + 2) * hd, qkv.shape[-1])  # (G, (q+2)*hd, H)
            q, k, v = qkv.split([q_per * hd, hd, hd], dim=1)
            yield dst + "self_attn.q_proj.weight", q.reshape(-1, qkv.shape[-1])
            yield dst + "self_attn.k_proj.weight", k.reshape(-1, qkv.shape[-1])
            yield dst + "self_attn.v_proj.weight", v.reshape(-1, qkv.shape[-1])
            yield from self._mlp_to_hf(config, mc, src, dst)
            for m, h in self._one_to_one():
                yield dst + h, mc[src + m]
        yield "model.norm.weight", mc["decoder.final_layernorm.weight"]
        if config.tie_word_embeddings:
            yield "lm_head.weight", mc["embedding.word_embeddings.weight"]
        else:
            yield "lm_head.weight", mc["output_layer.weight"]


ADAPTERS: dict[str, FamilyAdapter] = {
    "llama": FamilyAdapter(model_type="llama"),
    "qwen3": FamilyAdapter(model_type="qwen3", qk_layernorm=True),
    "qwen3_moe": FamilyAdapter(model_type="qwen3_moe", qk_layernorm=True, moe=True),
}
NOT_YET = {
    "mixtral": "Mixtral (MoE without q/k norm) is not converted yet",
    "deepseek_v3": "DeepSeek-V3 (MLA attention, shared experts, grouped routing) is not converted yet",
}


def adapter_for(config) -> FamilyAdapter:
    """The adapter of ``config.model_type``; refuses unsupported families with the reason."""
    mt = config.model_type
    if mt in NOT_YET:
        raise ValueError(f"policy.training_backend='megatron': {NOT_YET[mt]}; use 'fsdp2'")
    if mt not in ADAPTERS:
        raise ValueError(
            f"policy.training_backend='megatron' has no HF<->Megatron adapter for model_type={mt!r}; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[mt]
