"""Quantize an HF-style model's decoder linears for rollout, and requantize them on weight sync.

Design
------
:func:`quantize_model` swaps ``nn.Linear`` modules *inside decoder layers* for
:class:`~lumenrl_quant.linear.QuantizedLinear`. Decoder layers are found generically:
``model.model.layers`` / ``model.layers`` / ``model.transformer.h`` when present, otherwise the
longest ``nn.ModuleList`` of same-class blocks that contain linears. Never quantized: anything
outside the decoder layers (embeddings, ``lm_head``, final norm), names in ``skip_modules``
(matched against any dotted component or the full name), MoE routers (``gate``, ``router``,
``shared_expert_gate`` components, or classes named ``*Router*``), and non-``nn.Linear`` modules
(norms, fused 3-D expert weights). ``skip_first_n_layers`` / ``skip_last_n_layers`` keep the
most sensitive layers in high precision. ``quantize_lm_head=True`` also swaps the output projection
(the model's ``get_output_embeddings()``, else ``lm_head``): at decode it is the largest single
GEMM of a model with a big vocabulary (Qwen3-8B: 1.2 GB of 16.4 GB of bf16 weights read per step),
at the cost of FP8 rounding in the logits: a last-bit difference in the final hidden state (another
batch composition, a teacher-forced recompute) can move an activation across an E4M3 rounding
boundary, which shows directly in the logits, so recomputed log-probs agree per token in the
median but not to float rounding everywhere. Opt-in, and refused for a head tied to the input
embeddings: weight sync sends the shared tensor under the embedding's name only, so a quantized
copy of the head would go stale.

:func:`reload_quantized_weights_` takes the *original* parameter names (e.g.
``model.layers.0.mlp.up_proj.weight``), requantizes quantized weights in place through
:meth:`QuantizedLinear.reload_`, and copies every other tensor in place (``copy_``): no storage is
reallocated, so engines holding pointers (CUDA graphs) stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from lumenrl_quant.linear import QuantizedLinear, _check_fp8_dtype, _scheme_name

__all__ = ["QuantizationReport", "ReloadReport", "find_decoder_layers", "quantize_model", "reload_quantized_weights_"]

_ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})
_KNOWN_LAYER_PATHS = ("model.layers", "layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")


@dataclass(kw_only=True, slots=True)
class QuantizationReport:
    """What :func:`quantize_model` did.

    scheme: the scheme name. num_layers: decoder layers found. layers_path: where they live.
    quantized: names of swapped linears. skipped: linear name -> reason it stayed high precision.
    bytes_before / bytes_after: bytes of the swapped linears' weights before and after.
    """

    scheme: str
    num_layers: int
    layers_path: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 0.0
        return (f"{self.scheme}: quantized {len(self.quantized)} linears in {self.num_layers} layers "
                f"({self.layers_path}), skipped {len(self.skipped)}; weight bytes x{ratio:.3f}")


@dataclass(kw_only=True, slots=True)
class ReloadReport:
    """What :func:`reload_quantized_weights_` did: requantized / copied / unknown tensor names."""

    requantized: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _get(model: nn.Module, path: str) -> nn.Module | None:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def _has_linear(block: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in block.modules())


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, ModuleList)`` of the model's decoder layers (see module doc for the search)."""
    for path in _KNOWN_LAYER_PATHS:
        layers = _get(model, path)
        if isinstance(layers, nn.ModuleList) and len(layers) and _has_linear(layers[0]):
            return path, layers
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or not len(mod):
            continue
        if len({type(b) for b in mod}) == 1 and _has_linear(mod[0]) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        raise ValueError(f"no decoder layers found in {type(model).__name__}: no ModuleList of blocks with linears")
    return best


def _skip_reason(name: str, module: nn.Module, skip_modules: Iterable[str]) -> str | None:
    parts = name.split(".")
    for pattern in skip_modules:
        if pattern == name or pattern in parts or name.endswith("." + pattern):
            return f"skip_modules ({pattern})"
    if _ROUTER_NAMES.intersection(parts) or "router" in type(module).__name__.lower():
        return "moe router"
    return None


def _weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for n, t in module.named_buffers() if n.startswith("weight")) or (
        module.weight.numel() * module.weight.element_size()
    )


def quantize_model(
    model: nn.Module,
    scheme: object = "fp8_block",
    *,
    skip_first_n_layers: int = 0,
    skip_last_n_layers: int = 0,
    skip_modules: Iterable[str] = ("lm_head",),
    fp8_dtype: torch.dtype | None = None,
    quantize_lm_head: bool = False,
) -> QuantizationReport:
    """Swap the decoder linears of ``model`` for :class:`QuantizedLinear` in place; return a report.
    ``quantize_lm_head`` also swaps the output projection (untied heads only; see the module doc)."""
    if skip_first_n_layers < 0 or skip_last_n_layers < 0:
        raise ValueError(f"skip_first_n_layers={skip_first_n_layers} and skip_last_n_layers={skip_last_n_layers} "
                         "must be >= 0")
    _check_fp8_dtype(_scheme_name(scheme), fp8_dtype)  # before anything is swapped (and with nothing to swap)
    head_name = _output_head_name(model) if quantize_lm_head else None  # checked before anything is swapped
    path, layers = find_decoder_layers(model)
    n = len(layers)
    keep = range(skip_first_n_layers, n - skip_last_n_layers)
    name_of = getattr(scheme, "name", scheme)
    report = QuantizationReport(scheme=str(name_of), num_layers=n, layers_path=path)
    for i, layer in enumerate(layers):
        for sub, mod in list(layer.named_modules()):
            if not isinstance(mod, nn.Linear) or isinstance(mod, QuantizedLinear):
                continue
            full = f"{path}.{i}.{sub}"
            reason = "skip_first/last_n_layers" if i not in keep else _skip_reason(full, mod, skip_modules)
            if reason is not None:
                report.skipped[full] = reason
                continue
            new = QuantizedLinear.from_linear(mod, scheme, fp8_dtype=fp8_dtype)
            report.bytes_before += _weight_bytes(mod)
            report.bytes_after += _weight_bytes(new)
            model.set_submodule(full, new)
            report.quantized.append(full)
    if head_name is not None:
        head = model.get_submodule(head_name)
        new = QuantizedLinear.from_linear(head, scheme, fp8_dtype=fp8_dtype)
        report.bytes_before += _weight_bytes(head)
        report.bytes_after += _weight_bytes(new)
        model.set_submodule(head_name, new)
        report.quantized.append(head_name)
    return report


def _output_head_name(model: nn.Module) -> str:
    """The dotted name of the model's output projection, refused unless it is an untied ``nn.Linear``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or isinstance(head, QuantizedLinear):
        raise ValueError(f"quantize_lm_head=True: {type(model).__name__} has no unquantized nn.Linear output head "
                         f"(found {type(head).__name__}); allowed: quantize_lm_head=False")
    getter = getattr(model, "get_input_embeddings", None)
    embed = getter() if callable(getter) else None
    if embed is not None and getattr(embed, "weight", None) is head.weight:
        raise ValueError("quantize_lm_head=True: the output head shares its weight with the input embeddings "
                         "(tie_word_embeddings); weight sync updates the shared tensor under the embedding's name, "
                         "so a quantized head would go stale. Allowed: quantize_lm_head=False for a tied model")
    return next(name for name, module in model.named_modules() if module is head)


@torch.no_grad()
def reload_quantized_weights_(
    model: nn.Module,
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
) -> ReloadReport:
    """Load original-named high-precision tensors into a quantized model, in place.

    ``<linear>.weight`` of a :class:`QuantizedLinear` is requantized into its buffers; any other
    parameter or buffer is ``copy_``-ed. Unknown names raise ``KeyError`` when ``strict``.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    report = ReloadReport()
    for name, tensor in items:
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if isinstance(module, QuantizedLinear) and leaf == "weight":
            module.reload_(tensor)
            report.requantized.append(name)
        elif name in params:
            params[name].copy_(tensor)
            report.copied.append(name)
        else:
            report.unknown.append(name)
    if strict and report.unknown:
        raise KeyError(f"names not in the model: {report.unknown[:5]}{' ...' if len(report.unknown) > 5 else ''}")
    return report
