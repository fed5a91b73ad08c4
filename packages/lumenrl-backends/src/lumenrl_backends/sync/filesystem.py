"""Cross-process weight sync through ``lumenrl_async.FilesystemWeightSync`` snapshots.

The trainer side (:func:`publish_snapshot`) hands ``FilesystemWeightSync.publish`` a *lazy*
mapping: each tensor is gathered (FSDP2 ``DTensor``), cast to the snapshot dtype (default
bf16: the engine's dtype, half the bytes of fp32 master weights) and copied to host memory only
when the writer reads it, so the accelerator never holds more than one extra tensor. The
snapshot is a safetensors file plus a checksummed manifest, switched atomically.

The engine side (:func:`apply_latest_snapshot`) loads the newest complete snapshot (checksum
verified) and, if it is newer than the engine's ``weight_version``, applies it with
``engine.update_weights`` (in place; FP8 rollout linears are requantized there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lumenrl_backends.sync.inprocess import full_view, trainer_tensors
from lumenrl_backends.training.lora import is_lora_model, merged_tensors

__all__ = ["LazyWeights", "apply_latest_snapshot", "publish_snapshot"]


class LazyWeights(Mapping):
    """Read-only name -> full tensor view of a trainer model; gathers and casts on access."""

    def __init__(self, source: Any, dtype: torch.dtype | None = torch.bfloat16) -> None:
        self._tensors = trainer_tensors(source)
        model = getattr(source, "model", source)
        if is_lora_model(model):  # merged LoRA weights under HF names (computed once, here)
            self._tensors = dict(merged_tensors(model, ((n, full_view(t)) for n, t in self._tensors.items())))
        self.dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        full = full_view(self._tensors[name])
        if self.dtype is not None and full.is_floating_point():
            full = full.to(self.dtype)
        return full

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def publish_snapshot(source: Any, sync: Any, version: int, *, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Write ``source``'s weights as snapshot ``version`` through ``sync`` (a FilesystemWeightSync)."""
    sync.publish(LazyWeights(source, dtype), version)


def apply_latest_snapshot(sync: Any, engine: Any) -> int | None:
    """Apply the newest snapshot if newer than ``engine.weight_version``; returns the applied version."""
    current = getattr(engine, "weight_version", None)
    newest = sync.latest_version()
    if newest is None or (current is not None and newest <= current):
        return None
    loaded = sync.latest()
    if loaded is None:
        return None
    version, tensors = loaded
    engine.update_weights(tensors, version)
    return version
