"""Route recording for the ``native`` engine (R3; capability ``route_recording``).

The engine's MoE routers are patched by :func:`lumenrl_moe.install_routing`; this module owns
the per-slot record buffers, shaped like the KV cache: ``routes`` (S, L, L_moe, k) int16
(int32 past 32767 experts) and, with ``record_router_logits``, ``probs`` (S, L, L_moe, E)
float32. Each forward writes the routes of its input tokens at their (slot, cache column):
prefill at ``(rows, 0..W-1)`` of its left-padded block, decode at ``(rows, columns)`` of slots
0..b-1 (static tensors, so the writes are part of a captured CUDA-graph step). When a request
finishes (or is interrupted) its rows ``[start, end)`` are copied out on the device (no host
sync; the rows of every request that finishes in one step in one gather): one row per context token that
was fed to the model, i.e. every token but the last.
:func:`routes_column` lays them out as ``routed_experts`` (B, P+T, L_moe, k) aligned with
``input_ids``; rows of padding and of the last token hold ``0..k-1`` (no repeated expert).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["EngineRoutes", "NoRoutes", "carry_routes", "engine_routes", "r3_engine_kwargs", "record_generate_routes", "routes_column",
           "row_ranges"]


class EngineRoutes:
    enabled = True
    def __init__(self, model: nn.Module, *, max_slots: int, max_len: int, device: torch.device,
                 record_probs: bool, router: str = "") -> None:
        from lumenrl_moe import RecordTarget, install_routing

        self._target_cls = RecordTarget
        self.ctl = install_routing(model, router_cls=router or None)
        layers, k, experts = self.ctl.num_layers, self.ctl.top_k, self.ctl.num_experts
        dtype = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
        self.routes = torch.zeros(max_slots, max_len, layers, k, dtype=dtype, device=device)
        self.probs = (torch.zeros(max_slots, max_len, layers, experts, dtype=torch.float32, device=device)
                      if record_probs else None)
        self.max_len = max_len
        self.start: dict[int, int] = {}  # slot -> first cache column of its request
        self._pending: list[tuple[Any, int, int]] = []  # (request, flat first row, rows): copies :meth:`flush` makes
        self._rows = torch.arange(max_slots, device=device)

    def prefill(self, rows: torch.Tensor, width: int, starts: list[int]) -> None:
        """Record the next forward: a left-padded (n, W) block into slots ``rows``."""
        n = rows.shape[0]
        cols = torch.arange(width, device=rows.device)
        index = (rows[:, None].expand(n, width).reshape(-1), cols.expand(n, width).reshape(-1))
        self.ctl.record(self._target_cls(routes=self.routes, index=index, probs=self.probs))
        for slot, start in zip(rows.tolist(), starts):
            self.start[slot] = start

    def decode(self, batch: int, columns: torch.Tensor) -> None:
        """Record the next forward: one token per slot 0..batch-1 at ``columns`` (b,) (graph-safe)."""
        index = (self._rows[:batch], columns.clamp(max=self.max_len - 1))
        self.ctl.record(self._target_cls(routes=self.routes, index=index, probs=self.probs))

    def done(self) -> None:
        self.ctl.record(None)

    def finish(self, requests: list[Any], batch: Any, meta: dict[str, Any]) -> None:
        """After a generate call: rows that were finished on entry keep the routes they came with."""
        carry_routes(requests, batch)
        meta["num_experts"] = self.ctl.num_experts

    def take_all(self, active: dict[int, Any], host_columns: list[int], lag: int) -> None:
        """Interrupted rows: the routes of what they generated so far."""
        for slot, request in active.items():
            self.take(request, slot, host_columns[slot] - lag)
        self.flush()

    def take(self, request: Any, slot: int, end: int) -> None:
        """Queue the copy of the slot's rows [start, end) to ``request.routes``; :meth:`flush` makes it. The
        engine flushes before the slot can be written again (after each step's finishes), so the rows are
        the request's."""
        start = self.start.get(slot, 0)
        self._pending.append((request, slot * self.max_len + start, max(0, min(end, self.max_len) - start)))

    def flush(self) -> None:
        """The queued copies as one gather on the device (no host sync): a step where 64 rows finish makes one
        index copy and one ``index_select`` per buffer, not 64 clones; each request holds a view of its rows."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        counts = [p[2] for p in pending]
        first = pending[0][1]
        index = None if len(pending) == 1 else row_ranges([p[1] for p in pending], counts).to(self.routes.device,
                                                                                            non_blocking=True)

        def rows(buffer: torch.Tensor | None) -> list[torch.Tensor | None]:  # one request: a slice copy, no index
            if buffer is None:
                return [None] * len(pending)
            flat = buffer.view(-1, *buffer.shape[2:])
            return [flat[first:first + counts[0]].clone()] if index is None else list(flat.index_select(0, index).split(counts))

        for (request, _, _), routes, probs in zip(pending, rows(self.routes), rows(self.probs)):
            request.routes, request.route_probs = routes, probs


class NoRoutes:
    """R3 off: every engine call is a no-op."""

    enabled = False

    def __getattr__(self, name: str) -> Any:
        if name in ("prefill", "decode", "done", "finish", "take", "take_all", "flush"):
            return _noop
        raise AttributeError(name)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def engine_routes(model: nn.Module, enabled: bool, device: torch.device, record_probs: bool, router: str,
                  cache: Any) -> EngineRoutes | NoRoutes:
    """The engine's R3 route recorder, sized like its KV ``cache`` (slots x columns), or a no-op one."""
    if not enabled:
        return NoRoutes()
    return EngineRoutes(model, max_slots=cache.max_slots, max_len=cache.max_len, device=device,
                        record_probs=record_probs, router=router)


def r3_engine_kwargs(r3: Any) -> dict[str, Any]:
    """Engine constructor arguments from ``moe.r3``."""
    return {"record_routes": r3.enabled, "record_router_logits": r3.enabled and r3.record_router_logits,
            "moe_router": r3.router}


def routes_column(requests: list[Any], prompt_width: int, width: int) -> dict[str, torch.Tensor]:
    """``routed_experts`` (B, P+T, L_moe, k) (+ ``router_probs`` (B, P+T, L_moe, E)) on the host, from the
    requests' recorded rows; prompts are left-padded to ``prompt_width``, responses right-padded.
    The grid is laid out where the rows are (the engine's device: one gather and one scatter per column, no
    host loop over rows) and copied to the host once; rows on several devices are laid out on the host."""
    owners = [r for r in requests if getattr(r, "routes", None) is not None]
    if not owners:
        return {}
    layers, k = owners[0].routes.shape[-2:]
    row_width = prompt_width + width
    # every owner's first min(recorded, context + response - 1) rows (the last token was never fed) go to
    # row r.index, columns lo .. lo + n of the (B, P+T) grid, lo = prompt_width - len(prompt)
    counts = [min(r.routes.shape[0], len(r.prompt) + len(r.response) - 1) for r in owners]
    firsts = [r.index * row_width + prompt_width - len(r.prompt) for r in owners]  # flat (B * (P+T)) row of lo
    pad = torch.arange(k, dtype=owners[0].routes.dtype)  # padding rows: experts 0..k-1 (no repeated expert)
    out = {"routed_experts": _laid_out([r.routes for r in owners], counts, firsts, (len(requests), row_width), pad)}
    keep = [i for i, r in enumerate(owners) if getattr(r, "route_probs", None) is not None]
    if keep:
        parts = [owners[i].route_probs for i in keep]
        p_counts = [min(counts[i], part.shape[0]) for i, part in zip(keep, parts)]
        zero = torch.zeros(parts[0].shape[-1], dtype=torch.float32)
        out["router_probs"] = _laid_out(parts, p_counts, [firsts[i] for i in keep], (len(requests), row_width), zero)
    return out


def _laid_out(parts: list[torch.Tensor], counts: list[int], firsts: list[int], grid: tuple[int, int],
              fill: torch.Tensor) -> torch.Tensor:
    """A host tensor ``(*grid, *parts[0].shape[1:])`` of ``fill``'s dtype holding ``fill`` everywhere but at
    flat grid rows ``firsts[i] .. firsts[i] + counts[i]``, which hold the first ``counts[i]`` rows of
    ``parts[i]``; built on the parts' device when they share one."""
    devices = {part.device for part in parts}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    rows = _rows(parts, counts, device)
    out = torch.empty(*grid, *parts[0].shape[1:], dtype=fill.dtype, device=device)
    out.copy_(fill.to(device))
    out.view(-1, *parts[0].shape[1:]).index_copy_(0, row_ranges(firsts, counts).to(device), rows.to(fill.dtype))
    return out.cpu()


def row_ranges(starts: list[int], counts: list[int]) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, counts))`` as one int64 tensor, without a Python loop
    over rows. Host bookkeeping on the rollout's path, so built in numpy: no torch CPU operator (and none of its
    intra-op thread pool) between two GPU launches."""
    counts_a = np.asarray(counts, dtype=np.int64)
    total = int(counts_a.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = np.cumsum(counts_a) - counts_a  # position of each block's first row in the output
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - first, counts_a)
    return torch.from_numpy(np.arange(total, dtype=np.int64) + shift)


def _rows(parts: list[torch.Tensor], counts: list[int], device: torch.device) -> torch.Tensor:
    """The first ``counts[i]`` rows of each of ``parts``, concatenated on ``device``: one copy per device the
    parts are on (not one per request), no gather when every part is taken whole."""
    stacked = _stacked(parts, device)
    lengths = [part.shape[0] for part in parts]
    if counts == lengths:
        return stacked
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0).tolist()
    return stacked.index_select(0, row_ranges(starts, counts).to(device))


def _stacked(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``parts`` (each (n_i, ...)) concatenated along rows on ``device``: one copy per device they are on."""
    by_device: dict[torch.device, list[int]] = {}
    for i, part in enumerate(parts):
        by_device.setdefault(part.device, []).append(i)
    if len(by_device) == 1:
        return torch.cat(parts).to(device)
    moved: list[torch.Tensor | None] = [None] * len(parts)
    for index in by_device.values():
        flat = torch.cat([parts[i] for i in index]).to(device)
        for i, chunk in zip(index, flat.split([parts[i].shape[0] for i in index])):
            moved[i] = chunk
    return torch.cat(moved)


def carry_routes(requests: list[Any], batch: Any) -> None:
    """Continuing an interrupted batch: rows already finished keep the routes they were returned with."""
    routes, probs = batch.batch.get("routed_experts"), batch.batch.get("router_probs")
    if routes is None:
        return
    prompt_width = batch.batch["prompts"].shape[1] if "prompts" in batch.batch else 0
    for r in requests:
        if r.done and r.routes is None:  # finished before this call (none recorded now)
            lo = prompt_width - len(r.prompt)
            hi = lo + len(r.prompt) + len(r.response) - 1
            r.routes = routes[r.index, lo:hi]
            r.route_probs = probs[r.index, lo:hi] if probs is not None else None


@contextmanager
def record_generate_routes(model: nn.Module, ctl: Any, shape: tuple[int, int], max_new: int):
    """HF ``generate`` (``hf`` engine): record into (n, W + max_new, L_moe, k) by a forward
    pre-hook that points the routers at the columns of each forward: the (n, W) prefill, then
    one column per decode step. Yields the buffer (None when ``ctl`` is None)."""
    if ctl is None:
        yield None
        return
    from lumenrl_moe import RecordTarget

    n, width = shape
    device = next(model.parameters()).device
    routes = torch.arange(ctl.top_k, dtype=torch.int16, device=device).expand(
        n, width + max_new, ctl.num_layers, ctl.top_k).clone()
    column = [0]
    rows = torch.arange(n, device=device)

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        s = ids.shape[1]
        cols = torch.arange(column[0], column[0] + s, device=device).clamp(max=width + max_new - 1)
        ctl.record(RecordTarget(routes=routes, index=(rows[:, None].expand(n, s).reshape(-1),
                                                      cols.expand(n, s).reshape(-1))))
        column[0] += s

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield routes
    finally:
        handle.remove()
        ctl.record(None)
