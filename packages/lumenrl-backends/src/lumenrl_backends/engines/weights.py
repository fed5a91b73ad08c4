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
    return _walk(model)[0]


def _walk(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """One pass over the module tree: (name -> parameter or buffer, under every name; name -> module with
    ``reload_``), names normalised."""
    targets: dict[str, torch.Tensor] = {}
    reloadable: dict[str, nn.Module] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = normalise_name(f"{mod_name}.") if mod_name else ""
        if hasattr(module, "reload_"):
            reloadable[prefix[:-1]] = module
        for tensors in (module._parameters, module._buffers):
            targets.update((prefix + leaf, t) for leaf, t in tensors.items() if t is not None)
    return targets, reloadable


_FLUSH_BYTES = 256 << 20  # incoming bytes held for one batched copy (a multi-rank sync gathers them)


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
    targets, reloadable = _walk(model)
    batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    held = count = 0
    for name, tensor in items:
        key = normalise_name(name)
        if hasattr(tensor, "full_tensor"):  # a DTensor shard from FSDP2: gather it
            tensor = tensor.full_tensor()
        owner, _, leaf = key.rpartition(".")
        if key in reloaders or (leaf == "weight" and owner in reloadable):
            (reloaders.get(key) or reloadable[owner].reload_)(tensor.detach())  # requantize in place
            count += 1
            continue
        if key not in targets:
            raise _unknown(key, targets)
        target = targets[key]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"update_weights: {key!r} has shape {tuple(tensor.shape)}, the engine model expects {tuple(target.shape)}"
            )
        batch[0].append(target)
        batch[1].append(tensor.detach())
        held += tensor.numel() * tensor.element_size()
        count += 1
        if held >= _FLUSH_BYTES:
            _copy(*batch)
            batch, held = ([], []), 0
    _copy(*batch)
    return count


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``copy_`` of each pair, as one foreach launch where torch takes the lists (dtype converted on the way)."""
    if targets:
        torch._foreach_copy_(targets, sources)
