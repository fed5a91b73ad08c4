"""In-process weight sync: stream the trainer's full tensors into the engine's own storage.

Design
------
No full copy of the model is ever materialized. :func:`trainer_weights` walks the trainer's
parameters (and persistent buffers) once, in module order, and yields one full tensor at a
time:

* an FSDP2 parameter is a ``DTensor``; on a 1-rank mesh its local shard *is* the full tensor,
  so it is yielded as a view (no gather, no copy); on W ranks ``full_tensor()`` all-gathers it.
  Gathers are issued a bucket (``bucket_bytes``) ahead of consumption: functional collectives
  stay asynchronous until their result is read, so the all-gathers of a bucket overlap the
  copies of the previous one, and peak extra memory is one bucket, not the model;
* tied parameters appear once (the engine resolves tied names to the same storage);
* a LoRA policy (``policy.lora``) is merged on the way: ``W + scaling * B @ A`` under the HF
  name, adapters not sent (:func:`lumenrl_backends.training.lora.merged_tensors`);
* a one-rank backend on the single-device path (``training/single_device.py``) holds plain
  compute-dtype parameters (its fp32 master weights rounded after every step): they are
  yielded as they are (bf16 on CUDA, half the bytes read of the fp32 masters).

:func:`sync_to_engine` hands that stream to ``engine.update_weights(named_tensors, version)``
(``NativeEngine`` copies each tensor into the existing parameter with ``copy_``, converting
dtype in the same kernel, and requantizes FP8/MX rollout linears in place through
lumenrl-quant), so every engine data pointer, and any CUDA graph captured on it, stays valid.
Bytes moved per parameter: read once at the trainer's dtype, written once at the engine's
dtype (e.g. 4 + 2 bytes per parameter for fp32 master weights into a bf16 engine).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lumenrl_backends.training.lora import is_lora_model, merged_tensors

__all__ = ["SyncStats", "full_view", "sync_to_engine", "trainer_tensors", "trainer_weights"]


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What one sync moved and how long it took (seconds include a device synchronize)."""

    version: int
    tensors: int
    bytes_read: int
    seconds: float


def _module_of(source: Any) -> nn.Module:
    model = getattr(source, "model", source)  # FSDP2Backend -> its (sharded or single-device) module
    if not isinstance(model, nn.Module):
        raise TypeError(f"source must be an nn.Module or a training backend with .model; got {type(source).__name__}")
    return model


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def trainer_tensors(source: Any) -> dict[str, torch.Tensor]:
    """Name -> parameter or persistent buffer of the trainer model (sharded as stored), module order.

    A backend whose module is not laid out under HF names (Megatron-Core) provides
    ``engine_tensors()``: the same mapping, converted to HF names.
    """
    if hasattr(source, "engine_tensors"):
        return source.engine_tensors()
    model = _module_of(source)
    return {**dict(model.named_parameters()), **dict(_persistent_buffers(model))}


def full_view(t: torch.Tensor) -> torch.Tensor:
    """The full tensor: the local shard itself on a 1-rank mesh, an all-gather otherwise."""
    if not hasattr(t, "full_tensor"):
        return t.detach()
    if t.device_mesh.size() == 1:
        return t.to_local().detach()
    return t.full_tensor().detach()


def trainer_weights(source: Any, *, bucket_bytes: int = 512 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter and persistent buffer, gathered a bucket ahead."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    model = _module_of(source)
    if is_lora_model(model):  # the engine holds a plain HF model: send merged weights, HF names
        yield from merged_tensors(model, _gathered(source, bucket_bytes))
        return
    yield from _gathered(source, bucket_bytes)


def _gathered(source: Any, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    pending: deque[tuple[str, torch.Tensor, int]] = deque()
    in_flight = 0
    for name, tensor in trainer_tensors(source).items():
        size = tensor.numel() * tensor.element_size()
        pending.append((name, full_view(tensor), size))  # async gather (multi-rank) is issued here
        in_flight += size
        while in_flight > bucket_bytes and len(pending) > 1:
            done, full, done_size = pending.popleft()
            in_flight -= done_size
            yield done, full
    while pending:
        done, full, _ = pending.popleft()
        yield done, full


def sync_to_engine(
    source: Any, engine: Any, version: int, *, bucket_bytes: int = 512 << 20, synchronize: bool = True
) -> SyncStats:
    """Stream ``source``'s weights into ``engine.update_weights`` in place; returns what it moved."""
    start = time.perf_counter()
    moved = {"bytes": 0}

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in trainer_weights(source, bucket_bytes=bucket_bytes):
            moved["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor

    count = engine.update_weights(counted(), version)
    if synchronize and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return SyncStats(
        version=int(version), tensors=int(count), bytes_read=moved["bytes"], seconds=time.perf_counter() - start
    )
