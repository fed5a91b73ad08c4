"""The clip norm and fused AdamW step of DTensor parameters, run on their local shards.

Under ``fully_shard`` every parameter, gradient and Adam moment is a DTensor. The kernels a step needs
(``_foreach_norm``, ``_fused_adamw_``) are the same either way, but through DTensor each list op pays
sharding propagation and wrapping on the host: at 1.7B (311 parameters) about 25 ms of CPU per step on
an H200 host, spent between the end of backward and the optimizer's kernels, while the GPU waits.

* :func:`sharded_grad_norm`: the total 2-norm of gradients that are all ``Shard`` on one mesh (FSDP2's
  1-D layout): the norm of the local shards, squared, summed over the mesh ranks (skipped on one rank),
  rooted, which is what DTensor's partial-norm reduction computes. Other layouts return None (the caller
  keeps DTensor's path).
* :func:`step_on_local_shards`: torch's own fused Adam/AdamW (the functional ``torch.optim.adam.adam``
  with ``fused=True``: step count, ``grad_scale``, ``found_inf`` handling included) on the local tensors
  of the parameters, gradients and moments that the optimizer holds, so its state stays the DTensors that
  checkpoints save. It applies only where nothing is lost: a torch ``Adam``/``AdamW`` with ``fused=True``
  and no amsgrad, capturable, differentiable or tensor betas; every parameter with a gradient already has
  its state (the first step goes through ``optimizer.step()``, which creates it); no step hooks. Otherwise
  it returns False and the caller runs ``optimizer.step()``. Tested: bit for bit equal to
  ``optimizer.step()`` over steps with clipping and a skipped step.
* :func:`flat_stepper`: the flat AdamW kernels (:mod:`.flat_adamw`) over the local shards where they apply: one
  launch for the clip norm and one for the update over every parameter (fused AdamW walks them in dozens of
  multi-tensor chunks and the norm is another foreach pass), the fp32 shards read and written where they lie.
  Same conditions as the single-device path's flat step (one-group AdamW over every parameter, no hooks, no
  amsgrad or tensor hyper-parameters) plus fp32 shards, all ``Shard`` on one mesh (or plain tensors); shards at
  addresses off a 16-byte boundary are read without vector accesses. The moments move into the stepper's flat buffers; the optimizer's state stays DTensors (views of
  them), so checkpoints and a later ``optimizer.step()`` see the same values.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["flat_grads", "flat_stepper", "flat_steps", "sharded_grad_norm", "step_on_local_shards"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _all_shard_mesh(tensors: list[torch.Tensor]) -> Any | None:
    """The one mesh over which every tensor of ``tensors`` is a DTensor ``Shard`` on every mesh dim, else None."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Shard
    except ImportError:
        return None
    mesh = getattr(tensors[0], "device_mesh", None) if tensors else None
    if mesh is None or not all(isinstance(t, DTensor) and t.device_mesh == mesh for t in tensors):
        return None
    return mesh if all(isinstance(p, Shard) for t in tensors for p in t.placements) else None


def sharded_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Total 2-norm (a plain tensor) of DTensor gradients that are ``Shard`` on every mesh dim of one mesh;
    None for any other layout."""
    mesh = _all_shard_mesh(grads)  # a Replicate or Partial dim would count some elements more than once
    if mesh is None:
        return None
    norm = torch.nn.utils.get_total_norm([_local(g) for g in grads], foreach=True)
    if mesh.size() > 1:
        square = norm.float().square()
        for dim in range(mesh.ndim):
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        norm = square.sqrt().to(norm.dtype)
    return norm


def _functional_adam() -> Any | None:
    try:
        from torch.optim.adam import adam
    except ImportError:
        return None
    params = inspect.signature(adam).parameters
    needed = ("fused", "grad_scale", "found_inf", "decoupled_weight_decay", "beta1", "beta2")
    return adam if all(name in params for name in needed) else None


_ADAM = _functional_adam()


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    hooks = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    globals_ = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    return any(getattr(optimizer, h, None) for h in hooks) or any(getattr(optim_module, h, None) for h in globals_)


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """One fused Adam/AdamW step on the local shards (see the module doc); False where it does not apply
    (nothing was done). Reads ``optimizer.grad_scale`` / ``optimizer.found_inf`` as ``step()`` does."""
    if _ADAM is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or _has_step_hooks(optimizer):
        return False
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return False
        beta1, beta2 = group["betas"]
        if isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
            return False
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state.get(p) for p in params]
        if any(not s or "exp_avg" not in s for s in states) or any(p.grad.is_sparse or p.is_complex() for p in params):
            return False
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        calls.append((params, states, group, beta1, beta2, decoupled))
    for params, states, group, beta1, beta2, decoupled in calls:
        _ADAM(
            [_local(p) for p in params], [_local(p.grad) for p in params],
            [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states], [],
            [s["step"] for s in states], foreach=False, capturable=False, differentiable=False, fused=True,
            grad_scale=getattr(optimizer, "grad_scale", None), found_inf=getattr(optimizer, "found_inf", None),
            has_complex=False, decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )
    return True


# optimizer -> (ids of the parameters it was built for, its flat stepper or None where the flat step does not apply)
_FLAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _build_flat(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Any | None:
    from lumenrl_backends.training import flat_adamw

    if not params or flat_adamw.unsupported(optimizer, params) is not None:
        return None
    sharded = hasattr(params[0], "device_mesh")
    mesh = _all_shard_mesh(params) if sharded else None
    if sharded and mesh is None or not sharded and any(hasattr(p, "device_mesh") for p in params):
        return None
    locals_ = [_local(p) for p in params]
    device = locals_[0].device
    if any(t.dtype != torch.float32 or t.device != device or not t.is_contiguous() for t in locals_):
        return None  # (conditions that hold on every rank alike: the ranks take the same path without a collective)
    groups = () if mesh is None or mesh.size() == 1 else tuple(mesh.get_group(d) for d in range(mesh.ndim))
    return flat_adamw.FlatAdamW(optimizer, list(params), reduce_groups=groups)


def flat_stepper(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Any | None:
    """The :class:`~.flat_adamw.FlatAdamW` that steps ``optimizer`` over ``params`` (their local shards; built once
    per optimizer and parameter list) when it applies and the optimizer's state is its own or can be adopted (equal
    step counts), else None: the caller keeps the fused path. Gradients are checked by :func:`flat_grads`."""
    key = tuple(map(id, params))
    entry = _FLAT.get(optimizer)
    if entry is None or entry[0] != key:
        entry = (key, _build_flat(optimizer, params))
        _FLAT[optimizer] = entry
    stepper = entry[1]
    if stepper is not None and not stepper._owns_state() and not stepper.adopt_state():
        _FLAT[optimizer] = (key, None)  # unequal step counts (a step over some of them): the fused path from now on
        return None
    return stepper


def flat_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many steps of ``optimizer`` its flat stepper took (0: none, or it has none)."""
    entry = _FLAT.get(optimizer)
    return entry[1].steps_taken if entry is not None and entry[1] is not None else 0


def flat_grads(stepper: Any, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The local gradients of ``params`` as ``stepper``'s kernels read them, or None (one is missing, of another
    layout, shape or dtype: the fused path runs). FSDP2 makes them alike on every rank, so the ranks agree; the
    kernels take unaligned addresses too (a shard's offset in the reduce-scatter output is not always 16-byte
    aligned), only without vector accesses."""
    if any(p.grad is None or hasattr(p, "device_mesh") and p.grad.placements != p.placements for p in params):
        return None
    grads = [_local(p.grad) for p in params]
    if any(g.shape != t.shape or not g.is_contiguous() or g.device != stepper.device
           for g, t in zip(grads, stepper.locals)):
        return None
    return grads if len({g.dtype for g in grads}) == 1 and grads[0].dtype in (torch.bfloat16, torch.float32) else None
