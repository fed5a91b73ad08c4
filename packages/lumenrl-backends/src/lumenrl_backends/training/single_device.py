"""One-rank fast path of the FSDP2 backend: compute weights in the module, fp32 master weights aside.

On one rank ``fully_shard`` only costs: every step it casts the fp32 shards to bf16 (one copy
per parameter), copies gradients between its flat buffers and the parameters, and runs Python
hooks around every layer. :class:`SingleDeviceWeights` holds the same state without it:

* **compute weights**: the module's own parameters, in the compute dtype (bf16 on CUDA with
  ``mixed_precision`` auto/bf16, else fp32), as views of one flat buffer (``compute_flat``);
* **master weights**: fp32 ``nn.Parameter`` views of one flat buffer (``master_flat``), one per
  module parameter, same shapes; the optimizer steps these;
* **master gradients**: fp32 views of one flat buffer. After each micro-batch backward,
  :meth:`accumulate_grads` adds the module's compute-dtype gradients into them with two
  ``torch._foreach_*`` calls (copy on the first micro-batch of an optimizer step, add after)
  and frees the module gradients; a master parameter whose module parameter got no gradient
  keeps ``grad = None`` (the optimizer skips it, as with FSDP2);
* after the optimizer step :meth:`copy_back` refreshes the compute weights with one
  ``compute_flat.copy_(master_flat)`` (rounding to bf16 as FSDP2's per-step cast does).

With ``flat_optimizer`` (default on CUDA), :meth:`fused_clip_and_step` steps a one-group AdamW over
every master through :mod:`.flat_adamw` (norm, update and copy-back in two Triton kernels over the
flat buffers), and the first micro-batch's module gradients are kept as they are (``stash``) instead
of copied to fp32: with one micro-batch per optimizer step the kernels read the bf16 gradients (an
exact fp32 copy would hold the same numbers); a second micro-batch first moves them into the fp32
master gradients. Readers of the master gradients call :meth:`materialize_grads` (``master_grads``
does). Optimizers the flat kernels do not cover keep ``optimizer.step()`` + :meth:`copy_back`.

This is the FSDP2 one-rank computation (bf16 forward/backward, fp32 gradient accumulation,
clipping and AdamW on fp32 master weights) with fewer, larger kernels. Every slice starts at a
multiple of 64 elements (aligned views for compiled kernels); the gaps stay zero.

:attr:`master_module` mirrors the module's state-dict names (tied parameters share one master,
persistent buffers are the module's own) so ``get_state_dict``/DCP checkpoints, HF export and
``named_weights`` see fp32 master weights under HF names, in the same layout as the FSDP2 path.
Weight sync (``trainer_tensors(backend)``) reads ``backend.model``: the compute weights, i.e. the
master weights rounded to the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training import flat_adamw

__all__ = ["SINGLE_DEVICE_MODES", "SingleDeviceWeights", "check_single_device_mode"]

SINGLE_DEVICE_MODES = ("auto", "on", "off")
_ALIGN = 64  # elements


def check_single_device_mode(mode: str) -> str:
    if mode not in SINGLE_DEVICE_MODES:
        raise ValueError(
            f"policy.train.single_device={mode!r} is not allowed; allowed: {', '.join(SINGLE_DEVICE_MODES)}"
        )
    return mode


def _mirror(model: nn.Module, master_of: dict[int, nn.Parameter]) -> nn.Module:
    """Plain modules with ``model``'s state-dict names: master parameters, the model's buffers."""
    root = nn.Module()
    for name, tensor in model.state_dict(keep_vars=True).items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        if isinstance(tensor, nn.Parameter):
            mod.register_parameter(leaf, master_of[id(tensor)])
        else:
            mod.register_buffer(leaf, tensor)
    return root


class SingleDeviceWeights:
    """Compute-dtype module parameters plus fp32 master parameters and gradients (flat buffers)."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        params = list(model.parameters())  # unique: a tied weight appears once
        if not params:
            raise ValueError(f"model of type {type(model).__name__} has no parameters to train")
        device = params[0].device
        bad = sorted({str(p.device) for p in params} - {str(device)}) + sorted(
            {str(p.dtype) for p in params if not p.is_floating_point()}
        )
        if bad:
            raise ValueError(
                f"model parameters must be floating point and on one device ({device}); also found {bad}"
            )
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() // _ALIGN) * _ALIGN
        self.compute_dtype = compute_dtype
        self.master_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.grad_flat: torch.Tensor | None = None  # allocated by the first accumulate_grads (not for ref)
        self.compute_flat = torch.zeros(total, dtype=compute_dtype, device=device)
        self.params: list[nn.Parameter] = params
        self.masters: list[nn.Parameter] = []
        self._slices: list[tuple[int, int, torch.Size]] = []
        self._grad_views: list[torch.Tensor] = []
        master_of: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for p, off in zip(params, offsets):
                n, shape = p.numel(), p.shape
                self.master_flat[off : off + n].copy_(p.detach().reshape(-1))
                master = nn.Parameter(self.master_flat[off : off + n].view(shape), requires_grad=p.requires_grad)
                self.masters.append(master)
                self._slices.append((off, n, shape))
                master_of[id(p)] = master
                p.data = self.compute_flat[off : off + n].view(shape)
                p.grad = None
        self.copy_back()
        self.master_module = _mirror(model, master_of)
        self.flat_optimizer = device.type == "cuda" and flat_adamw.available()
        self._stash: list[torch.Tensor | None] | None = None  # first micro-batch's module grads, per param
        # per optimizer (an RL and an SFT optimizer may alternate): its flat stepper, or None where unsupported
        self._flats: dict[int, tuple[torch.optim.Optimizer, flat_adamw.FlatAdamW | None]] = {}
        self._dirty: set[int] = set()  # optimizer.step() stepped their flat state: re-adopt before a flat step
        self._last_flat: flat_adamw.FlatAdamW | None = None

    @property
    def trainable(self) -> list[nn.Parameter]:
        """The master parameters the optimizer steps (those whose module parameter requires grad)."""
        return [m for m in self.masters if m.requires_grad]

    def zero_grad(self) -> None:
        """Drop module gradients and mark every master gradient unset (no kernel launched)."""
        self._stash = None
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """master.grad (fp32) += module grad (compute dtype) for every parameter that got one; frees them.

        With ``flat_optimizer``, the first micro-batch of an optimizer step only moves the module
        gradients aside (no kernel); the next one, or :meth:`materialize_grads`, adds them in fp32."""
        if self.flat_optimizer and self._stash is None and all(m.grad is None for m in self.masters):
            self._stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
            return
        self.materialize_grads()
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self._add_grads(grads)

    @torch.no_grad()
    def materialize_grads(self) -> None:
        """Move the stashed first micro-batch gradients (if any) into the fp32 master gradients."""
        stash, self._stash = self._stash, None
        if stash is not None:
            self._add_grads(stash)

    def _add_grads(self, grads: list[torch.Tensor | None]) -> None:
        """master.grad (fp32) += grads[i] (one per parameter, None: none) with two foreach launches."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.master_flat)
            self._grad_views = [self.grad_flat[o : o + n].view(shape) for o, n, shape in self._slices]
        fresh_dst, fresh_src, acc_dst, acc_src = [], [], [], []
        for g, m, view in zip(grads, self.masters, self._grad_views):
            if g is None:
                continue
            if m.grad is None:
                m.grad = view
                fresh_dst.append(view)
                fresh_src.append(g)
            else:
                acc_dst.append(m.grad)
                acc_src.append(g)
        if fresh_dst:
            torch._foreach_copy_(fresh_dst, fresh_src)
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)

    def master_grads(self) -> list[torch.Tensor]:
        self.materialize_grads()
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def copy_back(self) -> None:
        """Compute weights := master weights (one cast-copy kernel)."""
        self.compute_flat.copy_(self.master_flat)

    @torch.no_grad()
    def fused_clip_and_step(self, optimizer: torch.optim.Optimizer, max_norm: float, loss: torch.Tensor | float = 0.0):
        """Clip and step without a host sync; returns the (grad norm, skipped 0/1) device tensors.

        Through the flat kernels where they cover ``optimizer`` (:mod:`.flat_adamw`), else through
        :func:`~lumenrl_backends.training.distributed.fused_clip_and_step` (the clip coefficient and a
        non-finite norm or ``loss`` as fused AdamW's ``grad_scale``/``found_inf``) and :meth:`copy_back`
        (a no-op change when skipped).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm} must be > 0 (float('inf') disables clipping)")
        flat = self._flat_stepper(optimizer)
        grads = self._flat_grads() if flat is not None else None
        if grads is not None:
            self._stash = None
            norm, skipped = flat.clip_and_step(grads, max_norm, loss)
            for m in self.masters:
                m.grad = None
            return norm, skipped
        if flat is not None:
            self._dirty.add(id(optimizer))
        self.materialize_grads()
        norm, skipped = dist_utils.fused_clip_and_step(optimizer, [m for m in self.masters if m.grad is not None],
                                                       max_norm, loss, flat=False)  # this path's own stepper refused
        self.copy_back()
        return norm, skipped

    @property
    def flat_active(self) -> bool:
        """True when the last optimizer stepped steps through the flat kernels."""
        return self._last_flat is not None

    def _flat_stepper(self, optimizer: torch.optim.Optimizer) -> flat_adamw.FlatAdamW | None:
        """The flat AdamW stepper of ``optimizer`` when it covers it (built once per optimizer)."""
        if not self.flat_optimizer:
            self._last_flat = None
            return None
        key = id(optimizer)
        entry = self._flats.get(key)
        if entry is None or entry[0] is not optimizer:
            ok = flat_adamw.unsupported(optimizer, self.masters) is None
            entry = (optimizer, flat_adamw.FlatAdamW(optimizer, self.masters, self._slices, self.master_flat,
                                                     self.compute_flat) if ok else None)
            self._flats[key] = entry
        flat = entry[1]
        if flat is not None and key in self._dirty:  # a fallback step may have left unequal step counts
            self._dirty.discard(key)
            if not flat.adopt_state():
                self._flats[key] = (optimizer, None)
                flat = None
        self._last_flat = flat
        return flat

    def _flat_grads(self) -> list[torch.Tensor] | None:
        """Every master's gradient, as the flat kernels read it (stashed module grads or fp32 masters);
        None when one is missing or not contiguous (then the optimizer.step() path runs)."""
        if self._stash is not None:
            grads = self._stash if all(m.grad is None for m in self.masters) else None
        else:
            grads = [m.grad for m in self.masters]
        device = self.master_flat.device
        if grads is None or any(g is None or not flat_adamw.usable_grad(g, m, device) for g, m in zip(grads, self.masters)):
            return None
        if len({g.dtype for g in grads}) != 1 or grads[0].dtype not in (torch.bfloat16, torch.float32):
            return None
        return grads

    def named_master_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 master tensor or buffer) in state-dict order, tied names included."""
        for name, tensor in self.master_module.state_dict().items():
            yield name, tensor.detach()
