"""Tensor parallel for LoRA adapters: peft's ``lora.Linear`` around a linear the TP plan shards.

Design (the Megatron/torchtitan layout of a low-rank pair): peft wraps a target linear ``X`` as
``X.base_layer`` (the frozen linear) plus ``X.lora_A.<adapter>`` (r, in) and ``X.lora_B.<adapter>``
(out, r); the forward is ``base(x) + B(A(dropout(x))) * scaling``. :func:`expand_lora_plan`
rewrites a plan entry ``X: style`` into styles for the three linears so that both terms come out
in the layout the base produces:

* colwise base (q/k/v, gate/up; output sharded over its out features): ``A`` replicated (its
  (B, S, r) output whole on every TP rank), ``B`` colwise like the base (out features sharded);
* rowwise base (o_proj, down_proj; input sharded over its in features, output reduced): ``A``
  rowwise with its small (B, S, r) output all-reduced, ``B`` replicated with its output laid out
  as the base's (sequence-sharded under SP: a local slice, no communication).

Replicated A/B are DTensors ``Replicate`` on the TP mesh; their gradients arrive as partial sums
over tp and FSDP2 reduces them to the parameter's placement (an all-reduce over tp), as for the
sequence-parallel norms. Adapters on embeddings or on a linear whose output stays a partial sum
(shared experts inside an MoE block) are refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

__all__ = ["expand_lora_plan", "replicated"]


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _replicated_style():
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class Replicated(ParallelStyle):
        """Parameters ``Replicate`` on the TP mesh; a local input becomes a replicated DTensor; the
        output is redistributed to ``output_layout`` (None: kept) and made local on request."""

        def __init__(self, *, output_layout=None, use_local_output: bool = False) -> None:
            super().__init__()
            self.output_layout, self.use_local_output = output_layout, use_local_output

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            from torch.distributed.tensor import distribute_module

            def partition(_name, mod, mesh):
                for pname, p in list(mod.named_parameters(recurse=False)):
                    local = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
                    mod.register_parameter(pname, nn.Parameter(local, requires_grad=p.requires_grad))

            def inputs(_mod, args, mesh):
                x = args[0]
                x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                return (x, *args[1:])

            def outputs(_mod, out, _mesh):
                if self.output_layout is not None and tuple(out.placements) != (self.output_layout,):
                    out = out.redistribute(placements=[self.output_layout])
                return out.to_local() if self.use_local_output else out

            return distribute_module(module, device_mesh, partition, inputs, outputs)

    return Replicated


def replicated(**kwargs: Any):
    """A ``Replicated`` parallel style (the class is built on first use: torch's TP module imported lazily)."""
    return _replicated_style()(**kwargs)


def expand_lora_plan(plan: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """``plan`` (keys relative to ``root``) with every entry that names a peft LoRA layer split into
    its base layer and adapters (module docstring); other entries unchanged."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, Any] = {}
    for key, style in plan.items():
        module = root.get_submodule(key)
        if not _is_lora_layer(module):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        layout = style.output_layouts[0] if isinstance(style, RowwiseParallel) else None
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or isinstance(module.base_layer, nn.Embedding) \
                or isinstance(layout, Partial):
            raise ValueError(f"policy.lora.target_modules: LoRA on {key} ({type(module.base_layer).__name__} under "
                             f"{type(style).__name__}) has no tensor-parallel plan; leave it out of the targets or "
                             "use tp=1")
        for name in module.lora_A:
            if isinstance(style, ColwiseParallel):
                out[f"{key}.lora_A.{name}"] = replicated()
                out[f"{key}.lora_B.{name}"] = copy.copy(style)
            else:
                out[f"{key}.lora_A.{name}"] = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
                out[f"{key}.lora_B.{name}"] = replicated(output_layout=layout, use_local_output=style.use_local_output)
    return out
