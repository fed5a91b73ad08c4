"""In-place weight updates for engines that hold their own copy of the policy.

Every incoming tensor is copied into the existing parameter or buffer storage (``copy_`` under
``no_grad``), so data pointers never change: CUDA graphs captured on those addresses stay valid
and no memory is reallocated. Tied parameters (``lm_head.weight`` sharing ``embed_tokens``) are
found under every name they are reachable by, so a trainer may send either name. The
``weight`` of a quantized layer (any module with ``reload_``, e.g. lumenrl-quant's
``QuantizedLinear``) is requantized in place from the incoming high-precision tensor, and so is
any tensor named in ``reloaders`` (the engine's FP8 MoE experts, :mod:`~lumenrl_backends.engines.moe`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

__all__ = ["WEIGHT_NAME_PREFIXES", "named_targets", "normalise_name", "copy_weights_"]

# Wrappers that add a prefix to parameter names: torch.compile, DDP, FSDP1, activation checkpointing.
WEIGHT_NAME_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def normalise_name(name: str) -> str:
    """Strip wrapper prefixes anywhere in a dotted parameter name."""
    for prefix in WEIGHT_NAME_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by every name (tied weights appear under each name)."""
    targets = {normalise_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    targets.update({normalise_name(n): b for n, b in model.named_buffers(remove_duplicate=False)})
    return targets


def _unknown(name: str, targets: Mapping[str, torch.Tensor]) -> KeyError:
    close = difflib.get_close_matches(name, list(targets), n=3)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return KeyError(f"update_weights: no parameter named {name!r} in the engine model{hint}")


@torch.no_grad()
def copy_weights_(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    reloaders: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> int:
    """Copy ``named_tensors`` into ``model`` in place; returns the number of tensors copied.

    Shapes must match exactly; dtype and device are converted on the fly. ``reloaders``: normalised
    name -> a function that stores the incoming tensor itself (requantizing in place).
    """
    reloaders = reloaders or {}
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    targets = named_targets(model)
    modules = {normalise_name(n): m for n, m in model.named_modules(remove_duplicate=False)}
    count = 0
    for name, tensor in items:
        key = normalise_name(name)
        if hasattr(tensor, "full_tensor"):  # a DTensor shard from FSDP2: gather it
            tensor = tensor.full_tensor()
        if key in reloaders:
            reloaders[key](tensor.detach())
            count += 1
            continue
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight" and hasattr(modules.get(owner), "reload_"):
            modules[owner].reload_(tensor.detach())  # requantize in place
            count += 1
            continue
        if key not in targets:
            raise _unknown(key, targets)
        target = targets[key]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"update_weights: {key!r} has shape {tuple(tensor.shape)}, the engine model expects {tuple(target.shape)}"
            )
        target.copy_(tensor.detach())
        count += 1
    return count
