"""``fully_shard`` on a one-rank mesh: the unshard's per-parameter casts as one foreach copy.

On one rank FSDP2 has no all-gather; its ``FSDPParamGroup.wait_for_unshard`` instead walks the
parameters one by one: cast the fp32 shard to the compute dtype (a new tensor), allocate the
unsharded storage, copy the cast tensor into it: a Python iteration and two kernels per parameter
at the start of every step, while the GPU has nothing else queued (the previous step ended with
the metrics' host copy).

:func:`fast_one_rank_unshard` replaces that walk, for a root-only unit on a one-rank mesh, with
the same storage set-up and ONE ``torch._foreach_copy_`` from the fp32 shards into the bf16
unsharded storages (the cast happens in the copy; same values: round to nearest even), then
torch's own ``init_unsharded_param`` / ``_to_unsharded`` bookkeeping. It is installed only where
the group has the attributes it relies on, none of its parameters uses an FSDP tensor extension
or CPU offload, and the mesh has one rank; at call time, any parameter not in the plain sharded
state sends the call to torch's method. Tested: forward, backward and optimizer steps equal to
torch's path bit for bit, on the CPU (gloo) in CI and on the GPU.

:func:`fast_one_rank_reduce` does the same for the other end of the step. After backward FSDP2 packs every
gradient into one flat reduce-scatter input of the reduce dtype (fp32: 4 bytes per parameter), and on one
rank, where the reduce-scatter is the identity, copies that whole buffer into a second one of the same size
that the sharded gradients then view: one extra read and write of every gradient (about 3 ms per step at
1.7B on an H200) and a second fp32 gradient buffer alive at once. Through FSDP2's public hook for a custom
reduce-scatter (``FSDPModule.set_custom_reduce_scatter``), :class:`OneRankReduceScatter` hands back the input
buffer as the output, so the copy is a copy of a tensor onto itself, which ATen skips. The pairing is kept to
where it is known: armed only while the unit's ``post_backward`` runs (one ``foreach_reduce``: its input is
allocated, then its output of the same size, dtype and device); every other allocation is fresh. Tested: equal
to torch's path bit for bit over steps with gradient accumulation, no whole-gradient copy.

The packing itself (FSDP2's ``foreach_reduce_scatter_copy_in``: one ``chunk_cat`` of the bf16 gradients into the
fp32 buffer) is cheap on the GPU (about 5 ms at 1.7B) but not on the host: ATen's CUDA ``chunk_cat`` builds an
index entry for every 2 KiB block of its output and copies that table through pinned memory, about 27 MB and
35 ms of CPU at 1.7B, on the critical path between the end of backward and the optimizer, so the GPU waits. On
one rank the chunk layout is the plain concatenation (one chunk, no padding), so while our ``post_backward``
runs, the copy-in is one ``torch._foreach_copy_`` into views of the flat buffer (the cast happens in the copy,
round to nearest even as in ``chunk_cat``). Everywhere else (other units, more ranks) torch's function runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch import nn

__all__ = ["OneRankReduceScatter", "fast_one_rank_reduce", "fast_one_rank_unshard"]

_GROUP_ATTRS = ("fsdp_params", "_all_gather_result", "_training_state", "comm_ctx", "device",
                "_to_unsharded", "_wait_all_gather_streams_on_event", "device_handle", "wait_for_unshard")
_PARAM_ATTRS = ("_sharded_param_data", "init_all_gather_outputs", "all_gather_outputs", "init_unsharded_param",
                "sharded_state", "offload_to_cpu", "_sharded_local_tensor")  # param_dtype: set at lazy init


def _group(model: nn.Module) -> Any | None:
    state = getattr(model, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    return group


def _supported(group: Any) -> str | None:
    if group is None:
        return "no FSDP parameter group on the module"
    missing = [a for a in _GROUP_ATTRS if not hasattr(group, a)]
    if missing:
        return f"FSDPParamGroup lacks {missing}"
    pg = getattr(group, "_all_gather_process_group", None)
    if pg is None or pg.size() != 1:
        return "not a one-rank all-gather group"
    for fp in group.fsdp_params:
        missing = [a for a in _PARAM_ATTRS if not hasattr(fp, a)]
        if missing:
            return f"FSDPParam lacks {missing}"
        if fp.offload_to_cpu or hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "CPU offload or an FSDP tensor extension"
    return None


def fast_one_rank_unshard(model: nn.Module) -> str | None:
    """Install the one-copy unshard on ``model``'s (root) FSDP unit; returns why not, or None."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage
    except ImportError as e:  # another torch layout: keep torch's method
        return f"torch's FSDP2 internals moved ({e})"
    group = _group(model)
    problem = _supported(group)
    if problem is not None:
        return problem

    torch_wait = group.wait_for_unshard

    def wait_for_unshard() -> None:
        if not group._all_gather_result:
            return  # no preceding unshard
        params = group.fsdp_params
        if any(fp.sharded_state != ShardedState.SHARDED or not hasattr(fp, "param_dtype") for fp in params):
            return torch_wait()
        if group._training_state == TrainingState.FORWARD:
            prev = group.comm_ctx.all_gather_state
            if prev:
                group._wait_all_gather_streams_on_event(prev.event)
                group.comm_ctx.all_gather_state = None
        sources, outputs = [], []
        for fp in params:
            src = fp._sharded_param_data
            fp.init_all_gather_outputs([src.numel()], [fp.param_dtype or src.dtype], 1, group.device)
            out = fp.all_gather_outputs[0]
            alloc_storage(out)
            sources.append(src)
            outputs.append(out)
        with contextlib.ExitStack() as stack:  # as torch's loop: the copy does not bump version counters
            for out in outputs:
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(out))
            torch._foreach_copy_(outputs, sources)
        for fp in params:
            fp.init_unsharded_param()
        group._to_unsharded()
        event = group.device_handle.Event()
        event.record()
        group._wait_all_gather_streams_on_event(event)
        group._all_gather_result = None

    group.wait_for_unshard = wait_for_unshard
    return None


_ONE_RANK = threading.local()  # .active: inside one of our units' post_backward (the thread that runs it)


def _install_one_rank_copy_in() -> bool:
    """Route FSDP2's reduce-scatter copy-in through :func:`_one_rank_copy_in` while one of our units reduces;
    returns False where torch's module has no such function (then its own copy-in runs)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    except ImportError:
        return False
    torch_copy_in = getattr(coll, "foreach_reduce_scatter_copy_in", None)
    if torch_copy_in is None:
        return False
    if getattr(torch_copy_in, "_lumenrl_one_rank", False):
        return True

    def copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
        if world_size == 1 and getattr(_ONE_RANK, "active", False):
            _one_rank_copy_in(unsharded_grads, reduce_scatter_input)
        else:
            torch_copy_in(unsharded_grads, reduce_scatter_input, world_size)

    copy_in._lumenrl_one_rank = True  # type: ignore[attr-defined]
    coll.foreach_reduce_scatter_copy_in = copy_in
    return True


def _one_rank_copy_in(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``chunk_cat(grads, dim=0, num_chunks=1, out=flat)``: each gradient, flattened, one after another."""
    sizes = [g.numel() for g in grads]
    if sum(sizes) != flat.numel():
        raise RuntimeError(f"one-rank copy-in: {sum(sizes)} gradient elements for a buffer of {flat.numel()}")
    outs = [view.view(g.shape) for view, g in zip(torch.split(flat, sizes), grads, strict=True)]
    torch._foreach_copy_(outs, grads)


class OneRankReduceScatter:
    """A reduce-scatter for a one-rank group whose output is its input (see the module doc). While armed, the
    first allocation is remembered and a second one of the same shape, dtype and device returns it; ``calls``
    counts the outputs handed back that way."""

    def __init__(self) -> None:
        self._armed = False
        self._input: torch.Tensor | None = None
        self.calls = 0

    @contextlib.contextmanager
    def armed(self):  # noqa: ANN201 - a context manager
        self._armed, self._input = True, None
        try:
            yield
        finally:
            self._armed, self._input = False, None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        held = self._input
        if held is not None and tuple(held.shape) == tuple(size) and held.dtype == dtype and held.device == device:
            self._input = None
            self._armed = False  # one pair per post_backward
            self.calls += 1
            return held
        out = torch.empty(*size, dtype=dtype, device=device)
        if self._armed:
            self._input = out
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        """One rank: the sum over the group is the input itself (FSDP2 copies on one rank without calling this)."""
        if output_tensor is not input_tensor:
            output_tensor.copy_(input_tensor)
        return None


def fast_one_rank_reduce(model: nn.Module) -> str | None:
    """Install :class:`OneRankReduceScatter` on ``model``'s (root) FSDP unit on a one-rank mesh; returns why
    not, or None."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError as e:  # another torch layout: keep torch's reduce-scatter
        return f"torch's FSDP2 internals moved ({e})"
    group = _group(model)
    if group is None or not hasattr(group, "post_backward") or not hasattr(model, "set_custom_reduce_scatter"):
        return "no FSDP parameter group with post_backward, or no set_custom_reduce_scatter"
    pg = getattr(group, "_reduce_scatter_process_group", None)
    if pg is None or pg.size() != 1:
        return "not a one-rank reduce-scatter group"
    if any(fp.offload_to_cpu for fp in group.fsdp_params):
        return "CPU offload"
    comm = OneRankReduceScatter()
    ReduceScatter.register(OneRankReduceScatter)  # the interface is an ABC; this class implements its two methods
    model.set_custom_reduce_scatter(comm)
    torch_post_backward = group.post_backward

    copy_in = _install_one_rank_copy_in()

    def post_backward(*args: Any) -> Any:
        _ONE_RANK.active = copy_in
        try:
            with comm.armed():
                return torch_post_backward(*args)
        finally:
            _ONE_RANK.active = False

    group.post_backward = post_backward
    group._lumenrl_reduce_scatter = comm
    return None
