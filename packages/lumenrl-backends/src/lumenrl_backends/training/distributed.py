"""Process-group helpers for the training backends.

One process or torchrun ranks: when ``torch.distributed`` is not initialized yet, a backend
initializes it from the torchrun environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/...) or,
without one, as a 1-rank group on a free local port. gloo on CPU, nccl on CUDA.
:func:`release_process_group` destroys that group (only one this module made) at the normal end of
a run, as torch asks of every program: left to interpreter exit, a group's backend is torn down
while Python itself is being finalized.
:func:`as_floats` turns a step's collected metric tensors into floats with one host copy per device.
Reductions and gathers take an optional ``group`` (the data-parallel ranks of a TP/CP mesh); None
is the whole world. :func:`clip_grad_norm_` clips gradients that are DTensors on several meshes.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lumenrl_backends.training.local_shards import (
    flat_grads,
    flat_stepper,
    sharded_grad_norm,
    step_on_local_shards,
)

__all__ = [
    "ensure_process_group",
    "release_process_group",
    "world_size",
    "rank",
    "all_reduce_sum",
    "all_reduce_mean_dict",
    "all_gather_rows",
    "barrier",
    "resolve_device",
    "as_float",
    "as_floats",
    "clip_grad_norm_",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_owned_group: Any = None  # the default group ensure_process_group made (None: none, or the caller's own)


def ensure_process_group(device: torch.device) -> None:
    """Initialize ``torch.distributed`` (gloo on CPU, nccl on CUDA) unless already initialized: from the
    torchrun / Ray environment (``RANK``, ``WORLD_SIZE``, ``MASTER_*``) where it is set, else as a one-rank
    group whose rendezvous address is passed to torch, not written into ``os.environ``: a child process
    (a data loader, a rollouter, a test's subprocess) must not inherit a rank-0-of-1 rendezvous whose port
    this process's store already holds."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is None:  # init_process_group wants an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    dist.init_process_group(backend=backend, **kwargs)
    global _owned_group
    _owned_group = dist.group.WORLD


def release_process_group() -> None:
    """Destroy the process group :func:`ensure_process_group` made, if it is still the current one; a
    group the caller initialized is the caller's to destroy and is left alone. Every rank calls it at the
    same point, after its last collective (the end of a run)."""
    global _owned_group
    owned, _owned_group = _owned_group, None
    if owned is not None and dist.is_initialized() and dist.group.WORLD is owned:
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_sum(value: float | int, device: torch.device, group=None) -> float:
    """Sum a Python scalar over the ranks of ``group`` (returned as float64-exact Python float)."""
    if _size(group) == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t.item())


def all_reduce_mean_dict(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean of each metric over ranks (every rank must hold the same keys)."""
    if world_size() == 1 or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= world_size()
    return dict(zip(keys, t.tolist()))


def all_gather_rows(local: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate equally shaped per-rank tensors of ``group`` along dim 0, in rank order."""
    if _size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def resolve_device(requested: str = "auto") -> torch.device:
    """``auto``/``cuda`` -> ``cuda:LOCAL_RANK`` when CUDA is present; otherwise CPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"cluster.device={requested!r} is not allowed; allowed: auto, cpu, cuda")
    if requested == "cpu" or not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeError("cluster.device='cuda' but torch.cuda.is_available() is False")
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def as_float(value: Any) -> float:
    return float(value.detach().float().item()) if isinstance(value, torch.Tensor) else float(value)


def as_floats(collected: Mapping[str, list]) -> dict[str, list[float]]:
    """Every (scalar) tensor entry as a float: one device->host copy per device, not one per value."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for values in collected.values():
        for v in values:
            if isinstance(v, torch.Tensor):
                by_device[v.device].append(v)
    host: dict[int, float] = {}
    for tensors in by_device.values():
        stacked = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors])
        host.update(zip(map(id, tensors), stacked.tolist()))
    return {k: [host[id(v)] if isinstance(v, torch.Tensor) else float(v) for v in vs] for k, vs in collected.items()}


def _grad_groups(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        groups[(g.device_mesh, g.placements) if hasattr(g, "device_mesh") else None].append(p)
    return groups


def _total_norm(groups: dict[Any, list[torch.Tensor]]) -> torch.Tensor:
    norms = []
    for group in groups.values():
        grads = [p.grad for p in group]
        norm = sharded_grad_norm(grads)  # FSDP's all-Shard layout: on the local shards, no DTensor dispatch
        if norm is None:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        norms.append(norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_scale_and_skip(norm: torch.Tensor, loss: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_scale, found_inf) of a clipped fused AdamW step: gradients are divided by
    ``max((norm + 1e-6) / max_norm, 1)`` (``clip_grad_norm_``'s clamped coefficient, inverted), and the
    step is skipped (1.0) where the norm or the loss is not finite. Device scalars, no host sync."""
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0), (~torch.isfinite(norm + loss)).float()


def can_step_without_sync(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """True for a fused optimizer whose gradients are plain tensors or DTensors of one (mesh, placements):
    :func:`fused_clip_and_step` can clip and skip inside its kernel (no host sync)."""
    return bool(optimizer.defaults.get("fused")) and len(_grad_groups(params)) <= 1


def fused_clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float,
                        loss: torch.Tensor | float = 0.0, group=None, flat: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip to total norm ``max_norm`` and step a fused optimizer without a host sync; returns the
    (grad norm, skipped 0/1) device tensors.

    The clip coefficient goes in as the fused kernel's ``grad_scale`` (grads are divided by
    ``max((norm + 1e-6) / max_norm, 1)``, i.e. multiplied by ``clip_grad_norm_``'s clamped
    coefficient) and a non-finite norm or loss (``loss`` summed over ``group``) as its ``found_inf``
    (the kernel skips the update and the step count): the attributes ``torch.amp.GradScaler`` sets
    on fused optimizers. Every rank sees the same norm (made whole) and summed loss, so all skip
    together.

    ``flat``: step through the flat AdamW kernels over the local shards where they apply
    (:func:`~.local_shards.flat_stepper`: the same math in two launches); None: on CUDA (on the CPU they run
    only in Triton's interpreter, the tests').
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm} must be > 0 (float('inf') disables clipping)")
    if flat is None:
        flat = bool(params) and params[0].device.type == "cuda"
    stepper = flat_stepper(optimizer, params) if flat and params else None
    grads = flat_grads(stepper, params) if stepper is not None else None
    if grads is not None:
        return stepper.clip_and_step(grads, max_norm, _summed_loss(loss, stepper.device, group))
    norm = _total_norm(_grad_groups(params))
    if not params:  # nothing to step: a zero norm on the optimizer's device
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        norm = torch.zeros((), device=first.device if first is not None else None)
    optimizer.grad_scale, skipped = clip_scale_and_skip(norm, _summed_loss(loss, norm.device, group), max_norm)
    optimizer.found_inf = skipped
    try:
        on_shards = bool(params) and hasattr(params[0], "device_mesh")
        with torch.no_grad():
            done = on_shards and step_on_local_shards(optimizer)  # DTensors: the same kernel on their locals
        if not done:
            optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
    return norm, skipped


def _summed_loss(loss: torch.Tensor | float, device: torch.device, group=None) -> torch.Tensor:
    """``loss`` as a float32 device scalar, summed over the ranks of ``group``."""
    total = torch.as_tensor(loss, device=device).detach().float().reshape(())
    if _size(group) > 1:
        total = total.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that are DTensors on different meshes or
    placements (FSDP2 1-D, TP 2-D, expert slices): one norm per (mesh, placements) group, made whole
    (``full_tensor``: one collective per group), combined, and each group scaled on its own mesh.
    Returns the total norm (a plain tensor)."""
    groups = _grad_groups(params)
    total = _total_norm(groups)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
