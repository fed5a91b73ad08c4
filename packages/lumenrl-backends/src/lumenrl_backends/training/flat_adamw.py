"""AdamW in two Triton kernels over every parameter at once: clip norm, then update (and bf16 copy).

torch's fused AdamW walks the hundreds of parameter tensors of a model in chunks of a multi-tensor launch;
the single-device path (:mod:`.single_device`) also ran a foreach copy of the bf16 gradients into
fp32, a foreach norm, and a cast-copy of the updated masters back to the bf16 compute weights. Here,
over one table of blocks (each block lies in one parameter) and flat moment buffers:

* ``norm``: one program per block sums the squares of its gradient slice (fp32), a torch sum of
  the per-block partials gives the squared norm (fixed order: deterministic; summed over the ranks that
  hold other shards, for FSDP2's local shards);
* ``update``: one program per block reads gradient, master, ``exp_avg`` and ``exp_avg_sq``, writes
  the three back and, on the single-device path, the master rounded to the compute dtype (the copy-back,
  fused).

The masters are either the single-device path's flat fp32 buffer or, for FSDP2 (:mod:`.local_shards`), the
fp32 local shards where they lie, through a table of their addresses.
The gradients are read where they are, through a per-step table of their addresses: the bf16 module
gradients when one micro-batch made them (an fp32 copy of a bf16 number is exact, so reading the
bf16 value is the same math), or the fp32 master gradients (views of one flat buffer) when several
micro-batches were summed in fp32.

The math is torch's fused AdamW (``_fused_adamw_``, AdamW mode) with the clip coefficient as its
``grad_scale`` and a non-finite norm or loss as its ``found_inf``: ``g = grad / scale``,
``p *= 1 - lr * wd``, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``; a skipped step changes nothing
(weights, moments, step counts). The bias corrections ``1 - b^t`` are taken in float64 on the device (in
float32, ``1 - 0.999^t`` loses three of its seven digits to cancellation), of the betas as the kernel holds
them (float32), so that they match the moments' decay.

The optimizer stays a ``torch.optim.AdamW``: its state entries become views of the flat moment
buffers and one flat step vector, so ``state_dict``/DCP checkpoints, ``load_state_dict`` (values are
copied back into the flat buffers on the next step) and a fallback ``optimizer.step()`` all see the
same state. :func:`unsupported` names what this path does not do (several groups, amsgrad,
maximize, tensor learning rates, step hooks, frozen parameters); those keep ``optimizer.step()``.
"""

from __future__ import annotations

import weakref

import torch

from lumenrl_backends.training.distributed import clip_scale_and_skip
from lumenrl_backends.training.local_shards import _local

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: the single-device path keeps torch's fused AdamW
    triton = None

__all__ = ["BLOCK", "FlatAdamW", "available", "unsupported", "usable_grad"]

BLOCK = 4096  # elements per program (the block table's unit)
SUB = 1024  # elements per inner iteration (4 per thread at 8 warps: one 16-byte fp32 vector)
NUM_WARPS = 8  # the fastest launch setting of those timed on an H200 (4 and 8 warps, SUB 512..4096)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _table_ptr(addrs, idx, BF16: tl.constexpr, ALIGNED: tl.constexpr):
        addr = tl.load(addrs + idx)
        if ALIGNED:  # every address of the table is 16-byte aligned (checked on the host): vector accesses
            addr = tl.multiple_of(addr, 16)
        if BF16:
            return addr.to(tl.pointer_type(tl.bfloat16))
        else:
            return addr.to(tl.pointer_type(tl.float32))

    @triton.jit
    def _load(ptr, local, n, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptr + local, mask=local < n, other=0.0).to(tl.float32)
        else:
            return tl.load(ptr + local).to(tl.float32)

    @triton.jit
    def _store(ptr, local, n, value, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptr + local, value, mask=local < n)
        else:
            tl.store(ptr + local, value)

    @triton.jit
    def _sumsq_block(gp, start, n, MASKED: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
        acc = tl.zeros((SUB,), dtype=tl.float32)
        for s in tl.static_range(0, BLOCK, SUB):
            g = _load(gp, start + s + tl.arange(0, SUB), n, MASKED)
            acc += g * g
        return tl.sum(acc, axis=0)

    @triton.jit
    def _sumsq_kernel(grad_addrs, blk_param, blk_start, numels, partial,
                      GRAD_BF16: tl.constexpr, GRAD_ALIGNED: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
        pid = tl.program_id(0)
        idx = tl.load(blk_param + pid)
        start = tl.multiple_of(tl.load(blk_start + pid).to(tl.int64), BLOCK)
        n = tl.load(numels + idx)
        gp = _table_ptr(grad_addrs, idx, GRAD_BF16, GRAD_ALIGNED)
        if start + BLOCK <= n:  # a whole block: unmasked, vectorized accesses
            total = _sumsq_block(gp, start, n, False, BLOCK, SUB)
        else:  # the parameter's ragged last block
            total = _sumsq_block(gp, start, n, True, BLOCK, SUB)
        tl.store(partial + pid, total)

    @triton.jit
    def _adamw_block(gp, mp, ep, vp, cp, start, n, scale, lr, beta1, beta2, eps, weight_decay, step_size, bias2_sqrt,
                     MASKED: tl.constexpr, HAS_COMPUTE: tl.constexpr, COMPUTE_BF16: tl.constexpr,
                     BLOCK: tl.constexpr, SUB: tl.constexpr):
        for s in tl.static_range(0, BLOCK, SUB):
            local = start + s + tl.arange(0, SUB)
            g = _load(gp, local, n, MASKED) / scale
            p = _load(mp, local, n, MASKED)
            m = _load(ep, local, n, MASKED)
            v = _load(vp, local, n, MASKED)
            p = p - lr * weight_decay * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
            _store(mp, local, n, p, MASKED)
            _store(ep, local, n, m, MASKED)
            _store(vp, local, n, v, MASKED)
            if HAS_COMPUTE:
                if COMPUTE_BF16:  # rounded to nearest even in integers (as torch's copy_), then an exact conversion
                    bits = p.to(tl.uint32, bitcast=True)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                    rounded = tl.where(p != p, p, bits.to(tl.float32, bitcast=True))
                    _store(cp, local, n, rounded.to(tl.bfloat16), MASKED)
                else:
                    _store(cp, local, n, p.to(cp.dtype.element_ty), MASKED)

    @triton.jit
    def _adamw_kernel(grad_addrs, master_addrs, blk_param, blk_start, numels, offsets, master, exp_avg, exp_avg_sq,
                      compute, scalars, lr, beta1, beta2, eps, weight_decay,
                      GRAD_BF16: tl.constexpr, GRAD_ALIGNED: tl.constexpr, MASTER_TABLE: tl.constexpr,
                      MASTER_ALIGNED: tl.constexpr, HAS_COMPUTE: tl.constexpr,
                      COMPUTE_BF16: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
        skip = tl.load(scalars + 1)  # found_inf: a skipped step stores nothing
        if skip == 0:
            pid = tl.program_id(0)
            idx = tl.load(blk_param + pid)
            start = tl.multiple_of(tl.load(blk_start + pid).to(tl.int64), BLOCK)
            n = tl.load(numels + idx)
            base = tl.multiple_of(tl.load(offsets + idx), 64)  # slices start at multiples of 64 elements
            gp = _table_ptr(grad_addrs, idx, GRAD_BF16, GRAD_ALIGNED)
            if MASTER_TABLE:  # fp32 masters where they lie (local shards), through their address table
                mp = _table_ptr(master_addrs, idx, False, MASTER_ALIGNED)
            else:
                mp = master + base
            scale = tl.load(scalars)  # the clip divisor, as fused AdamW's grad_scale
            step_size = tl.load(scalars + 2)  # lr / (1 - beta1^t), from float64 on the device
            bias2_sqrt = tl.load(scalars + 3)  # sqrt(1 - beta2^t)
            if start + BLOCK <= n:
                _adamw_block(gp, mp, exp_avg + base, exp_avg_sq + base, compute + base, start, n, scale, lr, beta1,
                             beta2, eps, weight_decay, step_size, bias2_sqrt, False, HAS_COMPUTE, COMPUTE_BF16,
                             BLOCK, SUB)
            else:
                _adamw_block(gp, mp, exp_avg + base, exp_avg_sq + base, compute + base, start, n, scale, lr, beta1,
                             beta2, eps, weight_decay, step_size, bias2_sqrt, True, HAS_COMPUTE, COMPUTE_BF16,
                             BLOCK, SUB)


def _aligned(tensors: list[torch.Tensor]) -> bool:
    """Every tensor with elements starts at a 16-byte boundary (the kernels' vector accesses)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())


def usable_grad(grad: torch.Tensor, master: torch.Tensor, device: torch.device) -> bool:
    """The kernels read ``grad`` as a flat, 16-byte aligned array of ``master``'s shape on ``device``."""
    return (grad.shape == master.shape and grad.is_contiguous() and grad.device == device
            and grad.data_ptr() % 16 == 0)


def unsupported(optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter]) -> str | None:
    """Why ``optimizer`` cannot step through :class:`FlatAdamW` over ``masters``, or None."""
    if triton is None:
        return "no triton"
    if type(optimizer) is not torch.optim.AdamW:
        return f"{type(optimizer).__name__} is not torch.optim.AdamW"
    if len(optimizer.param_groups) != 1:
        return f"{len(optimizer.param_groups)} parameter groups"
    group = optimizer.param_groups[0]
    if len(group["params"]) != len(masters) or any(a is not b for a, b in zip(group["params"], masters)):
        return "the optimizer does not step every master parameter in order (frozen parameters)"
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            return f"{key}=True"
    if any(isinstance(group[k], torch.Tensor) for k in ("lr", "weight_decay", "eps")) or any(
            isinstance(b, torch.Tensor) for b in group["betas"]):
        return "tensor hyper-parameters"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "optimizer step hooks"
    from torch.optim import optimizer as optim_mod

    if optim_mod._global_optimizer_pre_hooks or optim_mod._global_optimizer_post_hooks:
        return "global optimizer step hooks"
    return None


def _state_tensor(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """An optimizer state entry of ``param``'s layout whose values are ``local``: a DTensor of the same mesh,
    placements and global shape for a DTensor parameter (what checkpoints save), else ``local`` itself."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


class FlatAdamW:
    """Steps ``optimizer`` (a one-group ``torch.optim.AdamW`` over every master) through the flat kernels.

    Two layouts of the masters:

    * ``master_flat``/``compute_flat`` given: the single-device path's flat buffers; ``slices``: per master
      ``(offset, numel, shape)`` in them. The update also writes the compute-dtype copy.
    * neither given: the masters' local tensors (a DTensor's ``_local_tensor``: FSDP2's fp32 shards) are
      stepped where they lie, read and written through a table of their addresses; no compute copy (FSDP2
      casts its shards when it gathers them). ``reduce_groups``: the process groups over which the squared
      gradient norm of the local shards is summed (FSDP's mesh dims; none on one rank).

    The moments live in two flat fp32 buffers (one slice per master, at multiples of 64 elements), the step
    counts in one fp32 vector; the optimizer's state entries are views of them (DTensors over the local views
    for DTensor masters).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter],
                 slices: list[tuple[int, int, torch.Size]] | None = None, master_flat: torch.Tensor | None = None,
                 compute_flat: torch.Tensor | None = None, reduce_groups: tuple = ()):
        # a proxy: a stepper kept per optimizer (local_shards' weak-keyed cache) must not keep it alive
        self.optimizer = optimizer if isinstance(optimizer, weakref.ProxyType) else weakref.proxy(optimizer)
        self.masters = masters
        self.master_flat, self.compute_flat = master_flat, compute_flat
        self.reduce_groups = tuple(reduce_groups)
        self.locals = [_local(m) for m in masters]  # what the kernels read and write (the masters on one device)
        if master_flat is None:
            slices, offset = [], 0
            for t in self.locals:
                slices.append((offset, t.numel(), t.shape))
                offset += -(-t.numel() // 64) * 64
            device = self.locals[0].device
            moments = torch.zeros(max(offset, 1), dtype=torch.float32, device=device)
        else:
            device, moments = master_flat.device, torch.zeros_like(master_flat)
        self.device = device
        blk_param, blk_start = [], []
        for i, (_, n, _) in enumerate(slices):
            starts = range(0, n, BLOCK)
            blk_param.extend([i] * len(starts))
            blk_start.extend(starts)
        self.blocks = len(blk_param)
        self.blk_param = torch.tensor(blk_param, dtype=torch.int32, device=device)
        self.blk_start = torch.tensor(blk_start, dtype=torch.int32, device=device)
        self.numels = torch.tensor([n for _, n, _ in slices], dtype=torch.int64, device=device)
        self.offsets = torch.tensor([o for o, _, _ in slices], dtype=torch.int64, device=device)
        self.exp_avg, self.exp_avg_sq = moments, torch.zeros_like(moments)
        self.steps = torch.zeros(len(masters), dtype=torch.float32, device=device)
        self._local_views = [(self.exp_avg[o: o + n].view(s), self.exp_avg_sq[o: o + n].view(s))
                             for o, n, s in slices]
        self._views = [(_state_tensor(m, ea), _state_tensor(m, eas), self.steps[i])
                       for i, (m, (ea, eas)) in enumerate(zip(masters, self._local_views))]
        self._partial = torch.empty(max(self.blocks, 1), dtype=torch.float32, device=device)
        self._ptrs: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}  # the last addresses and their device copy
        self.steps_taken = 0  # clip_and_step calls (host count)

    # ----------------------------------------------------------------- optimizer state

    def _owns_state(self) -> bool:
        state = self.optimizer.state
        for m, (ea, eas, st) in zip(self.masters, self._views):
            s = state.get(m)
            if s is None or s.get("exp_avg") is not ea or s.get("exp_avg_sq") is not eas or s.get("step") is not st:
                return False
        return True

    @torch.no_grad()
    def adopt_state(self) -> bool:
        """Make the optimizer's state views of the flat buffers (copying any state it holds); False when
        its parameters' step counts differ (then ``optimizer.step()`` keeps stepping them)."""
        state = self.optimizer.state
        held = [state.get(m) for m in self.masters]
        if any(held) and not all(held):
            return False
        if all(held):
            steps = torch.stack([torch.as_tensor(s["step"], dtype=torch.float32).to(self.steps.device)
                                 for s in held])
            if bool((steps != steps[0]).any()):
                return False
            for s, (ea, eas) in zip(held, self._local_views):
                ea.copy_(_local(s["exp_avg"]))
                eas.copy_(_local(s["exp_avg_sq"]))
            self.steps.copy_(steps)
        else:
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            self.steps.zero_()
        for m, (ea, eas, st) in zip(self.masters, self._views):
            state[m] = {"step": st, "exp_avg": ea, "exp_avg_sq": eas}
        return True

    # ----------------------------------------------------------------- the step

    def _addresses(self, tensors: list[torch.Tensor], kind: str = "grad") -> torch.Tensor:
        """The tensors' addresses as a device int64 tensor. The caching allocator hands a training loop the
        same gradient buffers step after step, so the last step's device copy is reused while the addresses
        match: no pinning and no copy on the host's path in the steady state."""
        ptrs = tuple(t.data_ptr() for t in tensors)
        last = self._ptrs.get(kind)
        if last is not None and last[0] == ptrs:
            return last[1]
        addresses = torch.tensor(ptrs, dtype=torch.int64)
        if self.device.type == "cuda":  # pinned + async: no host sync, the allocator guards reuse
            addresses = addresses.pin_memory().to(self.device, non_blocking=True)
        self._ptrs[kind] = (ptrs, addresses)
        return addresses

    def _check(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, bool, bool]:
        """(device address table, bf16?, all 16-byte aligned?) of ``grads``; refuses other shapes and dtypes."""
        if len(grads) != len(self.masters):
            raise ValueError(f"flat AdamW: {len(grads)} gradients for {len(self.masters)} parameters")
        dtypes = {g.dtype for g in grads}
        if dtypes not in ({torch.bfloat16}, {torch.float32}):
            raise ValueError(f"flat AdamW: gradients must be all bfloat16 or all float32, got {sorted(map(str, dtypes))}")
        bad = [i for i, (g, m) in enumerate(zip(grads, self.locals))
               if g.shape != m.shape or not g.is_contiguous() or g.device != self.device]
        if bad:
            raise ValueError(f"flat AdamW: gradient {bad[0]} is not a contiguous "
                             f"{tuple(self.locals[bad[0]].shape)} tensor on {self.device}")
        return self._addresses(grads), dtypes == {torch.bfloat16}, _aligned(grads)

    @torch.no_grad()
    def clip_and_step(self, grads: list[torch.Tensor], max_norm: float,
                      loss: torch.Tensor | float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One AdamW step of every master with ``grads`` (one per master, the local tensor for a DTensor master;
        contiguous, all bf16 or all fp32) clipped to total norm ``max_norm``; returns (grad norm, skipped 0/1)
        as device scalars. A non-finite norm or ``loss`` skips the step: weights, moments and step counts
        unchanged. With ``reduce_groups`` every rank of them calls this at the same point (one all-reduce)."""
        if not self._owns_state() and not self.adopt_state():
            raise RuntimeError("flat AdamW: the optimizer's parameters have different step counts")
        addrs, bf16, aligned = self._check(grads)
        if self.blocks:
            _sumsq_kernel[(self.blocks,)](addrs, self.blk_param, self.blk_start, self.numels, self._partial,
                                          GRAD_BF16=bf16, GRAD_ALIGNED=aligned, BLOCK=BLOCK, SUB=SUB,
                                          num_warps=NUM_WARPS)
            square = self._partial.sum()
        else:  # this rank holds no element (a shard past the end of every parameter)
            square = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in self.reduce_groups:
            torch.distributed.all_reduce(square, op=torch.distributed.ReduceOp.SUM, group=group)
        norm = square.sqrt()
        scale, skipped = clip_scale_and_skip(norm, torch.as_tensor(loss, device=norm.device).float(), max_norm)
        self.steps.add_(1.0 - skipped)
        if self.blocks:
            self._update(addrs, bf16, aligned, scale, skipped)
        self.optimizer._opt_called = True  # what the LR scheduler's wrapper of optimizer.step() records
        self.steps_taken += 1
        return norm, skipped

    def _update(self, addrs: torch.Tensor, bf16: bool, aligned: bool, scale: torch.Tensor, skipped: torch.Tensor) -> None:
        group = self.optimizer.param_groups[0]
        # the betas as the kernel holds them (float32: 0.999 is 0.99900001), so that the bias corrections match the
        # moments' decay; the corrections of this step's count t in float64: 1 - beta^t cancels (1e-3 at t = 1)
        beta1, beta2 = (float(torch.tensor(float(b), dtype=torch.float32)) for b in group["betas"])
        t = self.steps[0].double()
        scalars = torch.stack([scale, skipped, (group["lr"] / (1.0 - beta1 ** t)).float(),
                               (1.0 - beta2 ** t).sqrt().float()])
        table = self.master_flat is None
        master_addrs = self._addresses(self.locals, "master") if table else addrs
        master = self.exp_avg if table else self.master_flat  # unused in the table layout
        compute = self.compute_flat if self.compute_flat is not None else self.exp_avg  # unused without one
        _adamw_kernel[(self.blocks,)](
            addrs, master_addrs, self.blk_param, self.blk_start, self.numels, self.offsets, master,
            self.exp_avg, self.exp_avg_sq, compute, scalars, float(group["lr"]), beta1, beta2,
            float(group["eps"]), float(group["weight_decay"]),
            GRAD_BF16=bf16, GRAD_ALIGNED=aligned, MASTER_TABLE=table, MASTER_ALIGNED=table and _aligned(self.locals),
            HAS_COMPUTE=self.compute_flat is not None,
            COMPUTE_BF16=self.compute_flat is not None and self.compute_flat.dtype == torch.bfloat16,
            BLOCK=BLOCK, SUB=SUB, num_warps=NUM_WARPS)
