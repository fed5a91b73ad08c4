"""Parallelism mesh and tensor + sequence parallel plans for HF decoder families.

Design (torchtitan's composition, applied to the transformers modules):

* Mesh: ``world = dp_shard * tp`` ranks as a 2-D :class:`DeviceMesh` with named dims
  ``("dp_shard", "tp")``; ``tp`` is the fast (innermost) dim so a TP group is neighbouring ranks
  (one NVLink island on a GPU host).
* Tensor parallel (Megatron layout) with sequence parallel between the blocks, per family
  (:data:`TP_PLANS`): attention ``q/k/v_proj`` colwise, ``o_proj`` rowwise; MLP ``gate/up_proj``
  colwise, ``down_proj`` rowwise; RMSNorms ``SequenceParallel`` (the residual stream is a DTensor
  ``Shard(1)`` over the sequence); embeddings rowwise (vocab-sharded) -> ``Shard(1)``; ``lm_head``
  colwise with a replicated output (full logits on every TP rank: the log-prob/entropy code reads
  full rows). Qwen3's per-head ``q_norm``/``k_norm`` run on the local heads as ``SequenceParallel``
  over dim 2 (the head dim of ``(B, S, H_local, D)``) so their weight gradient is summed over TP.
* Local head counts: q/k/v outputs are local tensors (``use_local_output=True``) holding
  ``heads / tp`` heads; HF attention reshapes with ``(*input_shape, -1, head_dim)`` so the local
  count follows from the tensor, and the GQA repeat factor ``heads / kv_heads`` is unchanged.
* FSDP2 ``fully_shard(mesh=mesh["dp_shard"])`` is applied LAST (per decoder layer, then the root):
  TP DTensor parameters become 2-D DTensors, the rest 1-D over ``dp_shard``.

Refusals carry the numbers: tp must divide the world size, the query heads, the KV heads, the
intermediate size and the vocabulary (:func:`check_tp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = ["MeshDims", "TP_PLANS", "check_tp", "build_mesh", "apply_tensor_parallel", "parallelize"]


@dataclass(kw_only=True, slots=True)
class MeshDims:
    """Sizes of the mesh dims; ``dp_shard`` is what remains of the world."""

    world: int
    tp: int = 1

    @property
    def dp_shard(self) -> int:
        return self.world // self.tp


def _dense_block_plan(family: str) -> Callable[[], dict[str, Any]]:
    def plan() -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        block: dict[str, Any] = {
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
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        if family == "qwen3":  # per-head RMSNorm on (B, S, H_local, D): shard dim 2 = heads
            block["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            block["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return block

    return plan


def _root_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    }


# model_type -> per-decoder-layer plan factory (keys relative to the layer). Families share the
# Llama layout; Qwen3 adds its per-head q/k norms.
TP_PLANS: dict[str, Callable[[], dict[str, Any]]] = {
    "llama": _dense_block_plan("llama"),
    "mistral": _dense_block_plan("mistral"),
    "qwen2": _dense_block_plan("qwen2"),
    "qwen3": _dense_block_plan("qwen3"),
}


def check_tp(config: Any, tp: int, world: int) -> None:
    """Refuse a tensor-parallel degree the model or the world cannot meet (one line, with numbers)."""
    if tp < 1 or world % tp:
        raise ValueError(f"policy.parallel.tp={tp} must divide the world size {world}")
    if tp == 1:
        return
    family = getattr(config, "model_type", "?")
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
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"policy.parallel.tp={tp} does not divide {', '.join(bad)} of {family}")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"policy.parallel.tp={tp}: tied embeddings ({family}) are not planned; untie or use tp=1")


def build_mesh(dims: MeshDims, device_type: str):
    """2-D ``("dp_shard", "tp")`` mesh over the initialized process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dims.dp_shard, dims.tp), mesh_dim_names=("dp_shard", "tp"))


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """TP + SP in place on an HF causal LM (``model.model.layers``); returns ``model``."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tp(model.config, tp_mesh.size(), tp_mesh.size())
    block_plan = TP_PLANS[model.config.model_type]
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, block_plan())
    parallelize_module(model, tp_mesh, _root_plan())
    return model


def parallelize(model: nn.Module, mesh, *, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """TP + SP over ``mesh["tp"]`` (when > 1), then FSDP2 over ``mesh["dp_shard"]`` (last)."""
    from torch.distributed.fsdp import fully_shard

    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    kwargs: dict[str, Any] = {"mesh": mesh["dp_shard"], "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
