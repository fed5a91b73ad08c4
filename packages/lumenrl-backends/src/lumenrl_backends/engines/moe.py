"""Fused MoE experts in the ``native`` engine (:func:`lumenrl_quant.fused_moe`; ``policy.rollout.fused_moe``).

Each experts module whose layout the kernel implements gets its ``forward`` replaced *per instance*
by :func:`lumenrl_quant.fused_moe` over its own parameters: the class, the parameter names and the
state dict stay the model's, so weight sync is unchanged. The MoE block still calls
``self.gate(...)`` then ``self.experts(hidden, top_k_index, top_k_weights)``, so R3 route recording
(which patches the gate, :mod:`~lumenrl_backends.engines.routes`) works the same with either forward.

Modes: ``auto`` fuses on CUDA with Triton when the experts are bf16 (else HF's own
``config._experts_implementation``, ``grouped_mm`` by default); ``on`` fuses every recognised experts
module on any device: the Triton kernels on CUDA (and on CPU under Triton's interpreter, as the tests
run them), lumenrl-quant's torch path on a plain CPU (float32 emulation, one host sync per layer), and
an experts class of another layout raises naming why; ``off`` restores HF's forward (a model fused by an
earlier engine runs its original modules again).

Recognised layout (transformers 5.x ``@use_experts_implementation`` defaults: Qwen3-MoE, Mixtral,
DeepSeek-V3, GLM-4-MoE, ...): a class named ``*Experts`` with ``gate_up_proj`` (E, 2I, H) =
[gate; up] and ``down_proj`` (E, H, I), no bias, not transposed, no post-expert norm, the default gate
``act_fn(gate) * up`` with SiLU, not expert-parallel.

FP8 experts: with the ``fp8_block`` rollout scheme and the fused path on, ``gate_up_proj`` and
``down_proj`` become float8 buffers of the same names with 128 x 128 block scales
``gate_up_proj_scale`` / ``down_proj_scale`` (as :class:`~lumenrl_quant.QuantizedLinear` does with
``weight``), run W8A8 as the scheme defines it for every linear (each GEMM input quantized per token in
1 x 128 groups, FP8 dots: ``fused_moe(..., fp8_activations=True)``); the scheme's ``skip_first_n_layers`` / ``skip_last_n_layers``
keep those layers' experts in high precision. :attr:`FusedExperts.reloaders` requantize incoming
high-precision tensors into those buffers in place at ``update_weights`` (same storage: captured CUDA
graphs stay valid). Other schemes leave the experts in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["FUSED_MOE_MODES", "FusedExperts", "FusedExpertsReport", "install_fused_experts", "layout_problem"]

FUSED_MOE_MODES = ("auto", "on", "off")
FUSED_ATTR = "_lumenrl_fused_moe"  # instance attribute: the backend ("triton" / "torch") of a fused experts module
_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(kw_only=True, slots=True)
class FusedExpertsReport:
    """What :func:`install_fused_experts` did: ``fused`` / ``fp8`` module names, ``skipped`` name -> reason."""

    mode: str
    backend: str = "none"
    fused: list[str] = field(default_factory=list)
    fp8: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"fused_moe={self.mode}: {len(self.fused)} experts modules on {self.backend}, {len(self.fp8)} in FP8, "
                f"{len(self.skipped)} left to HF")


@dataclass(kw_only=True, slots=True)
class FusedExperts:
    """The engine's handle: the report, and ``reloaders`` (full parameter name -> in-place requantizer)
    for :func:`~lumenrl_backends.engines.weights.copy_weights_`."""

    report: FusedExpertsReport
    reloaders: dict[str, Callable[[torch.Tensor], None]] = field(default_factory=dict)


def layout_problem(module: nn.Module) -> str | None:
    """None when :func:`lumenrl_quant.fused_moe` computes what ``module`` computes, else why not."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, want in flags.items():
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)!r} (the kernel implements {flag}={want!r})"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__qualname__", "") != "_default_apply_gate":
        return f"a custom _apply_gate ({gate.__qualname__})"
    act = type(getattr(module, "act_fn", None)).__name__
    if act not in ("SiLU", "SiLUActivation"):
        return f"activation {act} (the kernel implements SiLU)"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return "no 3-D gate_up_proj / down_proj tensors"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, H), (E, H, I)"
    return None


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]


def _is_fp8(module: nn.Module) -> bool:
    return "gate_up_proj_scale" in module._buffers


def _backend(mode: str, device: torch.device, dtypes: set[torch.dtype]) -> str:
    """``triton`` / ``torch`` for a fusing mode, ``none`` when the experts stay HF's."""
    from lumenrl_quant import triton_moe_available

    triton = triton_moe_available(device)
    if mode == "off":
        return "none"
    if mode == "auto":
        return "triton" if device.type == "cuda" and triton and dtypes <= {torch.bfloat16} else "none"
    if device.type == "cuda" and not triton:
        raise ValueError("policy.rollout.fused_moe='on' needs Triton on CUDA (pip install lumenrl-quant[triton]); "
                         "allowed without it: auto, off")
    return "triton" if triton else "torch"


def _forward(module: nn.Module, backend: str) -> Callable[..., torch.Tensor]:
    """The fused forward of ``module``; its FP8 scales (if any) are bound here: reloads write into them."""
    from lumenrl_quant import fused_moe

    gate_up_scale, down_scale = module._buffers.get("gate_up_proj_scale"), module._buffers.get("down_proj_scale")

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights,
                         w_gate_up_scale=gate_up_scale, w_down_scale=down_scale, backend=backend,
                         fp8_activations=gate_up_scale is not None)  # fp8_block: W8A8, 1 x 128 activation groups

    return forward


def _layer_index(name: str) -> int | None:
    """The decoder layer index in a module name (``model.layers.3.mlp.experts`` -> 3), if any."""
    match = re.search(r"\.(\d+)\.", f".{name}.")
    return int(match.group(1)) if match else None


def _fp8_wanted(scheme: Any, index: int | None, num_layers: int) -> bool:
    if getattr(scheme, "name", scheme) != "fp8_block":
        return False
    if index is None:
        return True
    first, last = getattr(scheme, "skip_first_n_layers", 0), getattr(scheme, "skip_last_n_layers", 0)
    return first <= index < num_layers - last


@torch.no_grad()
def _quantize_(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace the expert weights by FP8 buffers of the same names plus their block scales."""
    from lumenrl_quant import quantize_experts_fp8

    for name in _WEIGHTS:
        codes, scales = quantize_experts_fp8(getattr(module, name).detach(), dtype=dtype)
        delattr(module, name)
        module.register_buffer(name, codes)
        module.register_buffer(f"{name}_scale", scales)


def _reloader(module: nn.Module, name: str) -> Callable[[torch.Tensor], None]:
    from lumenrl_quant import quantize_experts_fp8

    def reload_(tensor: torch.Tensor) -> None:
        codes, scales = module._buffers[name], module._buffers[f"{name}_scale"]
        if tuple(tensor.shape) != tuple(codes.shape):
            raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the engine's FP8 experts "
                             f"expect {tuple(codes.shape)}")
        with torch.no_grad():
            quantize_experts_fp8(tensor.detach().to(codes.device), out=(codes, scales))

    return reload_


def install_fused_experts(model: nn.Module, mode: str, device: torch.device, quant_scheme: Any = None) -> FusedExperts:
    """Fuse (or, with ``off``, unfuse) the experts modules of ``model`` in place (see module doc);
    ``quant_scheme``: the engine's rollout scheme, a name or object (``fp8_block`` quantizes the fused
    experts, in its ``fp8_dtype`` if set)."""
    if mode not in FUSED_MOE_MODES:
        raise ValueError(f"fused_moe={mode!r}; allowed: {', '.join(FUSED_MOE_MODES)}")
    modules = _experts_modules(model)
    dtypes = {m.gate_up_proj.dtype for _, m in modules if not _is_fp8(m)}
    backend = _backend(mode, device, dtypes) if modules else "none"
    handle = FusedExperts(report=FusedExpertsReport(mode=mode, backend=backend))
    num_layers = getattr(model.config, "num_hidden_layers", 0)
    for name, module in modules:
        module.__dict__.pop("forward", None)  # HF's forward, unless fused below
        module.__dict__.pop(FUSED_ATTR, None)
        problem = layout_problem(module)
        if backend == "none" or problem is not None:
            if _is_fp8(module):  # quantized by an earlier engine: only the fused kernel reads it
                raise ValueError(f"{name}: FP8 experts from an earlier engine need the fused kernel; "
                                 f"policy.rollout.fused_moe={mode!r} leaves them to HF")
            if problem is not None and mode == "on":
                raise ValueError(f"policy.rollout.fused_moe='on': {name} ({type(module).__name__}) has {problem}")
            handle.report.skipped[name] = problem or f"fused_moe={mode}"
            continue
        if not _is_fp8(module) and _fp8_wanted(quant_scheme, _layer_index(name), num_layers):
            _quantize_(module, getattr(quant_scheme, "fp8_dtype", None) or _e4m3(device))
        if _is_fp8(module):
            handle.report.fp8.append(name)
            handle.reloaders.update({f"{name}.{w}": _reloader(module, w) for w in _WEIGHTS})
        module.__dict__["forward"] = _forward(module, backend)
        module.__dict__[FUSED_ATTR] = backend
        handle.report.fused.append(name)
    return handle


def _e4m3(device: torch.device) -> torch.dtype:
    from lumenrl_quant import fp8_dtypes_for

    return fp8_dtypes_for(device).e4m3
