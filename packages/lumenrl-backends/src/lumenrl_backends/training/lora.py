"""LoRA adapters on the policy (``policy.lora.rank > 0``), through ``peft``.

Design:

* the actor's HF model is wrapped by ``peft.get_peft_model`` before the backend shards it (or
  takes the one-rank fast path): only the adapters (``lora_A``/``lora_B``) require gradients,
  so the optimizer holds adapter state only; the frozen base weights stay in the module;
* **reference = the base without adapters**: the KL term's reference log-probs come from the
  actor's own module under ``PeftModel.disable_adapter()`` (:class:`AdapterFreeReference`), so
  no second copy of the model is loaded. Exact: with adapters disabled a LoRA layer computes
  its base layer alone, bit for bit the initial policy (the base is frozen; see
  :func:`adapters_disabled`);
* **weight sync sends merged weights**: the rollout engine holds a plain HF model, so
  :func:`merged_tensors` yields every weight under its HF name, a LoRA target as
  ``W + scaling * B @ A`` (computed in float32, stored in W's dtype), everything else as is;
* **export**: ``final/`` is the merged model (``save_pretrained``, loads anywhere) and
  ``final/adapter/`` the adapter in peft's own format (``PeftModel.from_pretrained(base, path)``);
  every training checkpoint carries ``adapter/`` too.

Dropout (``policy.lora.dropout``) is active in the update's forward only (old log-probs run in
eval mode), as in peft.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "PEFT_PREFIX",
    "lora_unavailable_reason",
    "apply_lora",
    "is_lora_model",
    "hf_name",
    "merged_tensors",
    "adapter_writer",
    "adapters_disabled",
    "AdapterFreeReference",
]

PEFT_PREFIX = "base_model.model."  # PeftModel state-dict prefix in front of the HF names
_ADAPTER = "default"


def lora_unavailable_reason() -> str | None:
    """None when peft is importable; else why LoRA cannot run here."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return "policy.lora needs peft, which is not installed (pip install 'lumenrl-backends[lora]')"
    return None


def apply_lora(model: nn.Module, lora: Any) -> nn.Module:
    """Wrap ``model`` with LoRA adapters per ``lora`` (a ``LoraConfig`` section of the run config)."""
    reason = lora_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    from peft import LoraConfig, get_peft_model

    leaves = {name.rpartition(".")[2] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    targets = [t for t in lora.target_modules if t in leaves]
    if not targets:
        raise ValueError(
            f"policy.lora.target_modules={list(lora.target_modules)} matches no linear layer of "
            f"{type(model).__name__}; its linear layers are {sorted(leaves)}"
        )
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none"
    )
    return get_peft_model(model, config)


def is_lora_model(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def hf_name(peft_name: str) -> str | None:
    """``base_model.model.X.base_layer.weight`` -> ``X.weight``; adapter tensors -> None."""
    if ".lora_" in peft_name:
        return None
    name = peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def _scalings(model: nn.Module) -> dict[str, float]:
    """Module path (state-dict form) -> LoRA scaling (alpha / r) of every adapted layer."""
    out = {}
    for name, mod in model.named_modules():
        scaling = getattr(mod, "scaling", None)
        if isinstance(scaling, dict) and _ADAPTER in scaling and hasattr(mod, "lora_A"):
            out[name] = float(scaling[_ADAPTER])
    return out


def merged_tensors(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model from a stream of (peft state-dict name, full tensor).

    A LoRA target ``X`` gives ``X.weight = W + scaling * B @ A`` (float32 math, W's dtype), yielded
    once W, A and B have all arrived (peft registers them next to each other, so at most one
    layer's tensors wait); adapter tensors are consumed, never yielded; every other tensor passes
    under its HF name.
    """
    scalings = _scalings(model)
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        path, part = _lora_part(name, scalings)
        if path is None:
            target = hf_name(name)
            if target is not None:
                yield target, tensor
            continue
        parts = waiting.setdefault(path, {})
        parts[part] = tensor
        if len(parts) == 3:
            del waiting[path]
            w, a, b = parts["W"], parts["A"], parts["B"]  # (out, in), (r, in), (out, r)
            merged = w.float() + (b.float() @ a.float()) * scalings[path]
            yield hf_name(f"{path}.base_layer.weight"), merged.to(w.dtype)
    if waiting:
        raise RuntimeError(f"LoRA layers missing their weight or adapters in the stream: {sorted(waiting)}")


def _lora_part(name: str, scalings: Mapping[str, float]) -> tuple[str | None, str]:
    """(adapted module path, "W" | "A" | "B") for the tensors that merge; (None, "") otherwise."""
    markers = ((".base_layer.weight", "W"), (f".lora_A.{_ADAPTER}.weight", "A"), (f".lora_B.{_ADAPTER}.weight", "B"))
    for marker, part in markers:
        if name.endswith(marker):
            path = name[: -len(marker)]
            if path in scalings:
                return path, part
    return None, ""


def adapter_writer(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Callable[[str], None]:
    """``write(dir)``: the adapter of ``model`` in peft's format under ``dir/adapter``
    (``adapter_config.json`` + ``adapter_model.safetensors``) from ``state`` (peft state-dict
    names: the fp32 masters)."""

    def write(directory: str) -> None:
        model.save_pretrained(os.path.join(directory, "adapter"), state_dict=dict(state))

    return write


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer alone inside the block.

    Flips peft's per-layer ``_disable_adapters`` flag directly: ``PeftModel.disable_adapter()``
    also toggles ``requires_grad`` of the adapters, which under FSDP2 lands on the unsharded
    parameters and leaves the adapters frozen for the next update.
    """
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters") and hasattr(m, "lora_A")]
    previous = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, previous):
            m._disable_adapters = flag


class AdapterFreeReference:
    """The reference policy of a LoRA run: the actor's module with its adapters disabled.

    Offers the backend calls a ``RefWorker`` makes (``compute_log_probs``); checkpoints are
    the actor's (the base is frozen, so the reference never changes).
    """

    def __init__(self, actor_backend: Any) -> None:
        if not is_lora_model(actor_backend.model):
            raise TypeError("AdapterFreeReference needs a LoRA actor backend (policy.lora.rank > 0)")
        self.actor = actor_backend
        self.role = "ref"

    @contextlib.contextmanager
    def _base(self) -> Iterator[None]:
        with adapters_disabled(self.actor.model):
            yield

    def compute_log_probs(self, batch: Any, *, temperature: float = 1.0, with_entropy: bool = False):
        with self._base():
            return self.actor.compute_log_probs(batch, temperature=temperature, with_entropy=with_entropy)

    def save_checkpoint(self, path: str, *, extra: Mapping[str, Any] | None = None) -> None:
        return None  # nothing of its own: the frozen base is saved with the actor

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return {}
