"""Build a Megatron-Core ``GPTModel`` from an HF config and wrap it behind the HF call shape.

Parallel sizes come from :mod:`.parallel` (``parallel_state``): the ``TransformerConfig`` carries
tp / pp / ep, so Megatron builds this rank's slice: TP-split linears and vocab-parallel embedding and
output layer (``parallel_output=True``: logits stay split, see :mod:`.vocab_parallel`), this
pipeline stage's layers (``pre_process`` on the first stage, ``post_process`` on the last), this EP
rank's experts. No sequence parallelism (Megatron's sequence-parallel gathers allocate on CUDA), so
an MoE model runs tp = 1 (Megatron's MoE layer refuses TP without SP when training).

Layers: ``get_gpt_layer_local_spec`` (plain torch linears/attention, no TransformerEngine/apex),
unfused softmax/rope/bias-dropout, fp32 params, ``use_cpu_initialization``. Megatron's RoPE
moves its ``inv_freq`` to ``torch.cuda.current_device()`` on first use; on a CPU model
:func:`_keep_rope_on_device` makes it follow the module's device instead. MoE routers move their
weight to CUDA and use a TransformerEngine gemm in ``gating``: :func:`_router_gating` (a plain
linear) replaces it on every device.

Core attention: Megatron's local ``DotProductAttention`` takes its score buffer from a CUDA-only
global memory pool, so the layer spec's ``core_attention`` is :class:`SDPACoreAttention`
(``F.scaled_dot_product_attention``, GQA by head repeat) on every device.

Attention mask: Megatron's bool (b, 1, s, s) mask, True = masked: causal OR key-padding, with
the diagonal always open so a padding query row is never fully masked (its output is unused;
a fully masked row would give NaN that reaches the weight gradients through 0 * NaN). RoPE positions are 0..s-1 per row (Megatron ignores ``position_ids`` for RoPE);
rotary attention depends only on position differences, so left-padded rows give the HF result
up to fp rounding (tested against the FSDP2 backend).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_backends.training.megatron.families import FamilyAdapter
from lumenrl_backends.training.megatron.sharding import RankCoords, rank_state_dict

__all__ = ["MegatronCausalLM", "build_gpt_model", "check_parallel"]

# Megatron-Core 0.16 calls that allocate on CUDA whatever the model's device: why pp / ep need GPUs
CUDA_ONLY = {
    "policy.parallel.pp": "pipeline_parallel/schedules.py allocates torch.zeros([], device='cuda') and "
    "P2PCommunicator._communicate its receive buffers on torch.cuda.current_device()",
    "moe.expert_parallel_size": "the token dispatcher's gather (tensor_parallel/mappings.py "
    "_gather_along_first_dim) allocates on torch.cuda.current_device()",
}


def check_parallel(config, adapter: FamilyAdapter, sizes: tuple[int, int, int], device: torch.device) -> None:
    """Refuse, in one line naming the key, what the model or the device cannot run."""
    tp, pp, ep = sizes
    if ep > 1 and not adapter.moe:
        raise ValueError(f"moe.expert_parallel_size={ep}: {config.model_type} has no experts; allowed: 1")
    if tp > 1 and adapter.moe:
        raise ValueError(f"policy.parallel.tp={tp} with the MoE model {config.model_type}: Megatron's MoE layer "
                         "trains under TP only with sequence parallelism, not wired here; allowed: 1 (use "
                         "moe.expert_parallel_size)")
    sizes_tp = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                "vocab_size": config.vocab_size}  # whole query groups per rank (no KV-head replication)
    bad = [f"{k}={v}" for k, v in sizes_tp.items() if v % tp]
    if bad:
        raise ValueError(f"policy.parallel.tp={tp} does not divide {', '.join(bad)} of {config.model_type}")
    if device.type != "cuda":
        for key, size in (("policy.parallel.pp", pp), ("moe.expert_parallel_size", ep)):
            if size > 1:
                raise ValueError(f"{key}={size} on {device.type}: Megatron-Core needs CUDA here "
                                 f"({CUDA_ONLY[key]}); allowed on CPU: 1")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"megatron backend: rope_type={rope_type!r} is not supported (only 'default')")
    return float(theta if theta is not None else 10000.0)


def _moe_kwargs(config, adapter: FamilyAdapter, sizes: tuple[int, int, int]) -> dict[str, Any]:
    """Qwen3-MoE routing in Megatron terms: top-k over the logits then softmax over the k
    (= HF's softmax, top-k, renormalize when ``norm_topk_prob``); no aux loss in the model.
    Dispatcher (in :func:`_transformer_config`): ``allgather`` (EP included), ``alltoall`` under PP
    (Megatron's allgather dispatcher refuses the variable shapes of pipeline micro-batches)."""
    if not adapter.moe:
        return {}
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "megatron backend: Qwen3-MoE with dense layers (mlp_only_layers/decoder_sparse_step) is not supported"
        )
    return dict(
        num_moe_experts=config.num_experts,
        moe_router_topk=config.num_experts_per_tok,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not config.norm_topk_prob,
        moe_grouped_gemm=False,
    )


def _transformer_config(config, adapter: FamilyAdapter, sizes: tuple[int, int, int]):
    from megatron.core.transformer.transformer_config import TransformerConfig

    for key in ("attention_bias", "mlp_bias"):
        if getattr(config, key, False):
            raise ValueError(f"megatron backend: {config.model_type} with {key}=True is not supported")
    heads = config.num_attention_heads
    return TransformerConfig(
        **_moe_kwargs(config, adapter, sizes),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=getattr(config, "head_dim", None) or config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=adapter.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=sizes[0],
        pipeline_model_parallel_size=sizes[1],
        expert_model_parallel_size=sizes[2],
        sequence_parallel=False,
        pipeline_dtype=torch.float32,  # the residual stream stays fp32 under bf16 autocast
        # Megatron's allgather dispatcher (its default, checked for any model) refuses variable_seq_lengths
        moe_token_dispatcher_type="alltoall" if sizes[1] > 1 else "allgather",
        variable_seq_lengths=sizes[1] > 1,  # pipeline micro-batches differ in rows and columns: shapes exchanged
        calculate_per_token_loss=True,  # the backend's losses are already normalized: no division by micro-batches
    )


def _keep_rope_on_device(rope: nn.Module) -> None:
    original = type(rope).get_emb

    def get_emb(self, max_seq_len: int, offset: int = 0):
        device = self.inv_freq.device
        if device.type == "cuda":
            return original(self, max_seq_len, offset)
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (s, hd/2) on inv_freq's device
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # (s, 1, 1, hd)

    rope.get_emb = types.MethodType(get_emb, rope)


class SDPACoreAttention(nn.Module):
    """Megatron core-attention module: q (sq, b, np, hd), k/v (sk, b, ng, hd) -> (sq, b, np*hd),
    np / ng this TP rank's query heads / query groups."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **_: Any,
    ) -> None:
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention runs without context parallelism")
        self.config, self.softmax_scale = config, softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention: packed sequences and attention bias are not supported")
        rep = query.shape[2] // key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hd)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        allowed = None if attention_mask is None else ~attention_mask  # (b, 1, sq, sk), True = attend
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=attention_mask is None, scale=self.softmax_scale
        )  # (b, np, sq, hd)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _router_gating(self, input):
    """Router logits (tokens, E) with a plain linear: Megatron's ``gating`` moves the weight to
    CUDA and its gemm needs TransformerEngine."""
    dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else input.dtype
    bias = None if self.bias is None else self.bias.to(dtype)
    return F.linear(input.to(dtype), self.weight.to(dtype), bias)


def build_gpt_model(config, adapter: FamilyAdapter, sizes: tuple[int, int, int] = (1, 1, 1), *,
                    stage: int = 0) -> nn.Module:
    """This rank's fp32 Megatron-Core GPTModel with the shapes of HF ``config`` (random init):
    ``sizes`` = (tp, pp, ep) as initialized in ``parallel_state``, ``stage`` its pipeline stage."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_experts if adapter.moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=adapter.qk_layernorm,
        normalization="RMSNorm",
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(
        config=_transformer_config(config, adapter, sizes),
        pre_process=stage == 0,
        post_process=stage == sizes[1] - 1,
        transformer_layer_spec=spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(config),
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
    )
    _keep_rope_on_device(model.rotary_pos_emb)
    for module in model.modules():
        if hasattr(module, "gating") and hasattr(module, "routing"):  # MoE routers
            module.gating = types.MethodType(_router_gating, module)
    return model


class MegatronCausalLM(nn.Module):
    """This rank's GPTModel (its TP slice of its pipeline stage), answering the HF causal-LM call the
    backend's shared forward code makes (pp = 1) and the stage call of the pipeline schedule."""

    def __init__(self, gpt: nn.Module, hf_config: Any, adapter: FamilyAdapter, coords: RankCoords) -> None:
        super().__init__()
        self.gpt, self.config, self.adapter, self.coords = gpt, hf_config, adapter, coords
        self.compute_dtype = torch.float32  # bf16: autocast over fp32 master weights (CUDA)

    def stage_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """This stage's output: logits (b, s, V/tp) on the last stage, hidden states (s, b, H) before
        it; a stage after the first reads its input from ``gpt.set_input_tensor`` (the schedule)."""
        b, s = input_ids.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)  # True = masked
        mask = causal[None, None].expand(b, 1, s, s)
        if attention_mask is not None:
            eye = torch.eye(s, dtype=torch.bool, device=input_ids.device)
            mask = (mask | (attention_mask == 0)[:, None, None, :]) & ~eye  # (b, 1, s, s)
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        rope = self.gpt.rotary_pos_emb  # inv_freq is a plain attribute: .to(device) leaves it behind
        if rope.inv_freq.device != input_ids.device:
            rope.inv_freq = rope.inv_freq.to(input_ids.device)
        low = self.compute_dtype != torch.float32
        with torch.autocast(input_ids.device.type, dtype=self.compute_dtype, enabled=low):
            return self.gpt(input_ids, positions, mask)

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=None, use_cache=False
    ):
        logits = self.stage_forward(input_ids, attention_mask)  # (b, s, V/tp): one stage
        if logits_to_keep is not None:
            logits = logits[:, logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else logits
        return types.SimpleNamespace(logits=logits)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
        """Load this rank's slice of the HF weights; returns the full Megatron shapes by global name."""
        full = self.adapter.to_megatron(self.config, hf)
        local = rank_state_dict(full, self.coords, tied=bool(self.config.tie_word_embeddings))
        missing, unexpected = self.gpt.load_state_dict(local, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"HF->Megatron conversion mismatch: missing={missing} unexpected={unexpected}")
        return {name: tensor.shape for name, tensor in full.items()}
