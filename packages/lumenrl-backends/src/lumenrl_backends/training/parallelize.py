"""Parallelism mesh and tensor + sequence parallel plans for HF decoder families.

Design (torchtitan's composition, applied to the transformers modules):

* Mesh: ``world = dp_shard * cp * tp`` ranks as a 3-D :class:`DeviceMesh` with named dims
  ``("dp_shard", "cp", "tp")``; ``tp`` is the fast (innermost) dim so a TP group is neighbouring
  ranks (one NVLink island on a GPU host). Parameters are replicated over ``cp`` and sharded by
  FSDP2 over the flattened ``dp_shard x cp`` ranks (torchtitan's ``dp_shard_cp``).
* Expert parallel (:mod:`.expert_parallel`) is laid over the ``dp_shard x cp`` ranks (as torchtitan
  does: EP borrows data/context-parallel ranks, whose tokens differ): ``ep`` consecutive ranks of
  the flattened dim own the ``E / ep`` expert slices (a second mesh ``("efsdp", "ep", "tp")`` over
  the same ranks); FSDP2 shards each expert slice over ``efsdp`` (the ranks holding the same
  slice) and divides its reduced gradient by ``dp_shard * cp``, the factor every other parameter
  gets. With ``tp > 1`` too, each expert slice is further split over tp (EP x TP on the experts,
  parameters on the 2-D ``("ep", "tp")`` submesh; dispatch between the EP ranks of one TP coordinate).
* Tensor parallel (Megatron layout) with sequence parallel between the blocks, per family
  (:data:`TP_PLANS`): attention ``q/k/v_proj`` colwise, ``o_proj`` rowwise; MLP ``gate/up_proj``
  colwise, ``down_proj`` rowwise; RMSNorms ``SequenceParallel`` (the residual stream is a DTensor
  ``Shard(1)`` over the sequence; the final norm's output is gathered to the whole sequence, so
  ``logits_to_keep`` index tensors work as on one rank); embeddings rowwise (vocab-sharded) ->
  ``Shard(1)``; ``lm_head`` colwise with a replicated output (full logits on every TP rank: the
  log-prob/entropy code reads full rows). Qwen3's per-head ``q_norm``/``k_norm`` run on the local heads as ``SequenceParallel``
  over dim 2 (the head dim of ``(B, S, H_local, D)``) so their weight gradient is summed over TP.
* MoE blocks (qwen3_moe, mixtral, glm4_moe, deepseek_v3): the block's input is gathered to the whole sequence (a
  local tensor: the replicated router routes every token identically on each TP rank, so R3 replay
  is unchanged); the fused experts become :class:`~.expert_parallel.ShardedExperts` split over tp
  along the expert intermediate dim (matching gate/up rows); shared experts are a dense MLP whose
  down projection stays a partial sum; the block's output (a partial sum) is reduce-scattered to the
  sequence shards. DeepSeek MLA attention: low-rank down projections replicated, up projections colwise
  (whole heads per rank), o_proj rowwise (:func:`_mla_plan`). Qwen2-MoE is refused (:data:`NO_TP_PLAN`).
* Local head counts: q/k/v outputs are local tensors (``use_local_output=True``) holding
  ``heads / tp`` heads; HF attention reshapes with ``(*input_shape, -1, head_dim)`` so the local
  count follows from the tensor, and the GQA repeat factor ``heads / kv_heads`` is unchanged.
* FSDP2 ``fully_shard(mesh=mesh["dp_shard"])`` is applied LAST (per decoder layer, then the root):
  TP DTensor parameters become 2-D DTensors, the rest 1-D over ``dp_shard``. When that dim has one rank
  (and no expert parallelism) only the root is sharded: per-layer units exist to overlap one layer's
  all-gather and reduce-scatter with another's compute and to free each layer's gathered weights, and
  on one rank there is nothing to overlap (the "collectives" are copies) and nothing to free (the
  shard is the whole weight). What per-layer units would add is their hooks: four per layer and step,
  host work that left the GPU idle (82 ms of a 330 ms profiled 1.7B step on an H200). Same math: one
  bf16 all-gather copy of every parameter before forward, one reduce-scatter of every gradient after
  backward; the unsharded bf16 gradients live until the end of backward (+2 bytes per parameter).
  That root unit's unshard is one foreach cast-copy (:mod:`.fsdp_one_rank`) instead of torch's
  per-parameter cast + copy walk, and its one-rank reduce-scatter hands its input buffer back as the output
  instead of copying every gradient into a second fp32 buffer.

Refusals carry the numbers: tp must divide the world size, the query heads, the KV heads, the
intermediate size and the vocabulary (:func:`check_tp`); tp*cp must divide the world and the
heads, ep the ``dp_shard x cp`` ranks (:func:`check_sizes`); :func:`check_mesh` adds the
combinations the training backend does not wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lumenrl_backends.training.context_parallel import enable_ulysses
from lumenrl_backends.training.expert_parallel import (
    ShardedExperts,
    apply_expert_parallel,
    has_fused_experts,
    sum_grad_over,
)
from lumenrl_backends.training.fsdp_one_rank import fast_one_rank_reduce, fast_one_rank_unshard
from lumenrl_backends.training.lora import is_lora_model
from lumenrl_backends.training.lora_tp import expand_lora_plan
from lumenrl_backends.training.modeling import decoder_layers

__all__ = ["MeshDims", "TP_PLANS", "NO_TP_PLAN", "check_mesh", "check_sizes", "check_tp", "build_mesh", "apply_tensor_parallel",
           "parallelize"]


@dataclass(kw_only=True, slots=True)
class MeshDims:
    """Sizes of the mesh dims; ``dp_shard`` is what remains of the world after ``tp * cp``."""

    world: int
    tp: int = 1  # policy.parallel.tp
    cp: int = 1  # policy.parallel.cp
    ep: int = 1  # moe.expert_parallel_size, laid over dp_shard x cp

    @property
    def dp_shard(self) -> int:
        return self.world // (self.tp * self.cp)

    @property
    def fsdp(self) -> int:
        """Ranks FSDP2 shards parameters over (``dp_shard x cp``)."""
        return self.world // self.tp


def _attention_plan(layer: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
    }
    for norm in ("q_norm", "k_norm"):  # per-head RMSNorm (qwen3, glm4_moe) on (B, S, H_local, D): dim 2 = heads
        if isinstance(getattr(layer.self_attn, norm, None), nn.Module):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if _is_mla(layer.self_attn):
        plan = _mla_plan(layer.self_attn, plan)
    return plan


def _is_mla(attn: nn.Module) -> bool:
    return isinstance(getattr(attn, "kv_a_proj_with_mqa", None), nn.Module)


def _mla_plan(attn: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek multi-head latent attention: the low-rank down projections (``q_a_proj``,
    ``kv_a_proj_with_mqa``) and their norms run replicated on the whole sequence (the attention's
    input is a local tensor); the up projections (``q_b_proj`` or ``q_proj``, ``kv_b_proj``; head-major
    outputs) colwise, so each rank holds whole heads; ``o_proj`` rowwise. The rope key slice, shared by
    all heads, gets partial gradients over tp: :func:`_sum_rope_key_grad` sums them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    out = {k: v for k, v in plan.items() if k.split(".")[-1] not in ("q_proj", "k_proj", "v_proj")}
    out["self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    )
    out["self_attn.q_b_proj" if getattr(attn, "q_b_proj", None) is not None else "self_attn.q_proj"] = ColwiseParallel()
    out["self_attn.kv_b_proj"] = ColwiseParallel()
    return out


def _sum_rope_key_grad(attn: nn.Module, tp_group) -> None:
    """``kv_a_proj_with_mqa`` output = [kv latent (kv_lora_rank); rope key]: the latent feeds the colwise
    ``kv_b_proj`` (whose input gradient is summed over tp); the rope key is expanded to this rank's heads
    only, so its gradient is a partial sum: summed here (identity forward)."""
    rank = attn.kv_lora_rank

    def hook(_module, _args, out):
        return torch.cat([out[..., :rank], sum_grad_over(out[..., rank:], tp_group)], dim=-1)

    attn.kv_a_proj_with_mqa.register_forward_hook(hook)


def _mlp_plan(prefix: str, output) -> dict[str, Any]:
    """SwiGLU MLP ``prefix``: gate/up colwise, down rowwise to ``output`` (a placement)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(output_layouts=output, use_local_output=False)}


def _block_plan(layer: nn.Module) -> dict[str, Any]:
    """Plan of one decoder layer (keys relative to it): attention, then a dense MLP or an MoE block.

    MoE block: its input gathered to the whole sequence as a local tensor (the router is replicated
    and routes every token on every TP rank); its ``experts`` already a :class:`ShardedExperts` over
    tp (intermediate slices: a partial sum); shared experts (glm4_moe, deepseek_v3) a dense MLP whose
    down projection stays a partial sum too; the block's output, the sum of partial sums, is
    reduce-scattered to the sequence shards (``Partial -> Shard(1)``)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    plan = _attention_plan(layer)
    if not has_fused_experts(layer.mlp):
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return {**plan, **_mlp_plan("mlp", Shard(1))}
    plan["mlp"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=False,
    )
    if isinstance(getattr(layer.mlp, "shared_experts", None), nn.Module):
        shared = _mlp_plan("mlp.shared_experts", Partial())
        shared["mlp.shared_experts.down_proj"].use_local_output = True  # added to the experts' local partial sum
        plan.update(shared)
    return plan


def _root_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    class GatheredSequenceParallel(SequenceParallel):
        """The final norm: sequence-parallel, its output the whole sequence as a local tensor, so
        ``logits_to_keep`` (a column index tensor) can pick rows before the LM head."""

        @staticmethod
        def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
            return outputs.redistribute(placements=[Replicate()]).to_local()  # (B, S, H) on every TP rank

    return {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": GatheredSequenceParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    }


# model_type -> per-decoder-layer plan factory (keys relative to the layer). The families share the
# Llama attention layout (per-head q/k norms where present) and a dense SwiGLU MLP or an MoE block
# with fused experts (+ shared experts); :data:`NO_TP_PLAN` names the families refused, with why.
TP_PLANS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    family: _block_plan
    for family in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")
}
NO_TP_PLAN: dict[str, str] = {
    "qwen2_moe": "the shared expert's sigmoid gate (shared_expert_gate) scales a partial sum, so its gradient "
                 "would be partial too; no tensor-parallel plan",
}


def check_tp(config: Any, tp: int, world: int) -> None:
    """Refuse a tensor-parallel degree the model or the world cannot meet (one line, with numbers)."""
    if tp < 1 or world % tp:
        raise ValueError(f"policy.parallel.tp={tp} must divide the world size {world}")
    if tp == 1:
        return
    family = getattr(config, "model_type", "?")
    if family in NO_TP_PLAN:
        raise ValueError(f"policy.parallel.tp={tp}: model_type={family!r}: {NO_TP_PLAN[family]}; use tp=1")
    if family not in TP_PLANS:
        raise ValueError(
            f"policy.parallel.tp={tp}: no tensor-parallel plan for model_type={family!r}; "
            f"planned families: {', '.join(sorted(TP_PLANS))}"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    if getattr(config, "moe_intermediate_size", None):  # the experts' (and shared experts') intermediate dim
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"policy.parallel.tp={tp} does not divide {', '.join(bad)} of {family}")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"policy.parallel.tp={tp}: tied embeddings ({family}) are not planned; untie or use tp=1")
    if getattr(config, "router_jitter_noise", 0.0):  # random per rank: the TP ranks would route differently
        raise ValueError(f"policy.parallel.tp={tp}: router_jitter_noise={config.router_jitter_noise} of {family} "
                         "perturbs each TP rank's router input differently; use 0.0 or tp=1")


def check_mesh(model: nn.Module, dims: MeshDims, *, critic: bool = False, fp8: bool = False, r3: bool = False) -> None:
    """Refuse what the mesh cannot carry, in one line: combinations not wired (LoRA dropout, FP8 linears
    or a critic under TP; R3 under CP), then sizes the world or the model cannot meet, with the numbers."""
    tp, cp, ep = dims.tp, dims.cp, dims.ep
    problem = None
    if tp > 1 and is_lora_model(model) and _lora_dropout(model) > 0:
        problem = (f"policy.lora.dropout={_lora_dropout(model)} draws a different mask on each TP rank of a "
                   "replicated adapter input; use dropout 0.0 with tp > 1")
    elif tp > 1 and fp8:
        problem = "FP8 training linears have no tensor-parallel plan; use quantization.training.precision=bf16"
    elif tp > 1 and critic:
        problem = "no tensor-parallel plan for the critic's value head; use tp=1 for a critic"
    elif cp > 1 and r3:
        problem = "R3 replay lays out whole rows, not sequence chunks; use moe.r3.enabled=false or cp=1"
    if problem:
        raise ValueError(f"policy.parallel.tp={tp}, cp={cp}, moe.expert_parallel_size={ep}: {problem}")
    check_sizes(model.config, dims)


def _lora_dropout(model: nn.Module) -> float:
    return max((float(getattr(c, "lora_dropout", 0.0)) for c in getattr(model, "peft_config", {}).values()), default=0.0)


def check_sizes(config: Any, dims: MeshDims) -> None:
    """Refuse mesh sizes the world or the model cannot meet (one line, with the numbers)."""
    tp, cp, ep = dims.tp, dims.cp, dims.ep
    if min(tp, cp, ep) < 1 or dims.world % (tp * cp):
        raise ValueError(f"policy.parallel.tp={tp} * cp={cp} = {tp * cp} must divide the world size {dims.world}")
    check_tp(config, tp, dims.world)
    heads = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    bad = [f"{k}={v}" for k, v in heads.items() if v % (tp * cp)]
    if cp > 1 and bad:  # Ulysses splits each TP rank's heads over cp
        raise ValueError(f"policy.parallel.tp={tp} * cp={cp} = {tp * cp} does not divide {', '.join(bad)}")
    if dims.fsdp % ep:
        raise ValueError(f"moe.expert_parallel_size={ep} must divide the {dims.fsdp} data x context parallel ranks "
                         f"(world {dims.world} / tp {tp}) that expert parallelism is laid over")


def build_mesh(dims: MeshDims, device_type: str):
    """3-D ``("dp_shard", "cp", "tp")`` mesh over the initialized process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dims.dp_shard, dims.cp, dims.tp), mesh_dim_names=("dp_shard", "cp", "tp"))


def _dims(mesh, ep: int) -> MeshDims:
    return MeshDims(world=mesh.size(), tp=mesh["tp"].size(), cp=mesh["cp"].size(), ep=ep)


def expert_mesh(mesh, ep: int):
    """``("efsdp", "ep", "tp")`` over the ranks of ``mesh``: ``ep`` consecutive ``dp_shard x cp`` ranks
    form an EP group; ``efsdp`` links the ranks that own the same expert slice."""
    from torch.distributed.device_mesh import DeviceMesh

    dims = _dims(mesh, ep)
    ranks = mesh.mesh.reshape(dims.fsdp // ep, ep, dims.tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("efsdp", "ep", "tp"))


def fsdp_mesh(mesh):
    """The dim FSDP2 shards over: ``dp_shard``, or ``dp_shard x cp`` flattened when cp > 1."""
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if mesh["cp"].size() > 1 else mesh["dp_shard"]


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """TP + SP in place on an HF causal LM (``model.model.layers``); returns ``model``."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tp(model.config, tp_mesh.size(), tp_mesh.size())
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # a LoRA policy's base
    block_plan = TP_PLANS[model.config.model_type]
    for layer in decoder_layers(model):
        if has_fused_experts(layer.mlp) and not isinstance(layer.mlp.experts, ShardedExperts):
            layer.mlp.experts = ShardedExperts(layer.mlp.experts, tp_mesh)  # intermediate slices over tp
        parallelize_module(layer, tp_mesh, expand_lora_plan(block_plan(layer), layer))  # LoRA: base, A, B
        if _is_mla(layer.self_attn):
            _sum_rope_key_grad(layer.self_attn, tp_mesh.get_group())
    hf = model.get_base_model() if is_lora_model(model) else model
    parallelize_module(hf, tp_mesh, expand_lora_plan(_root_plan(), hf))
    for name, p in model.named_parameters():  # the TP styles re-register parameters as trainable
        p.requires_grad_(name not in frozen)
    return model


def parallelize(
    model: nn.Module, mesh, *, ep: int = 1, mp_policy=None, reshard_after_forward: bool = True
) -> nn.Module:
    """EP over ``ep`` dp x cp ranks, TP + SP over ``mesh["tp"]``, Ulysses over ``mesh["cp"]`` (each when > 1),
    then FSDP2 (last): expert slices over ``efsdp``, everything else over dp_shard (x cp)."""
    from torch.distributed.fsdp import fully_shard

    check_sizes(model.config, _dims(mesh, ep))
    emesh = expert_mesh(mesh, ep) if ep > 1 else None
    # EP x TP on the experts: E/ep experts per EP rank, each split over tp along the intermediate dim
    experts = apply_expert_parallel(model, emesh["ep", "tp"] if mesh["tp"].size() > 1 else emesh["ep"]) if ep > 1 else []
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if mesh["cp"].size() > 1:
        enable_ulysses(model, mesh["cp"].get_group(), mesh["cp"].size())
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    dp = fsdp_mesh(mesh)
    for module in experts:  # gradient = sum over every token's rank / (dp_shard * cp), like the rest
        fully_shard(module, mesh=emesh["efsdp"], **kwargs)
        module.set_gradient_divide_factor(float(dp.size()))
        # a plain SUM, then the division (gloo has no PREMUL_SUM); not on one rank, where torch 2.13 would divide twice
        module.set_force_sum_reduction_for_comms(emesh["efsdp"].size() > 1)
    if dp.size() > 1 or experts:  # per-layer units: each layer's all-gather/reduce-scatter overlaps compute
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)  # one rank: the root is the only unit (module docstring)
    if dp.size() == 1 and not experts:
        fast_one_rank_unshard(model)  # one foreach cast-copy instead of a walk over the parameters
        fast_one_rank_reduce(model)  # the gradients' flat buffer is the reduce-scatter's output: no copy
    return model
