"""CUDA graphs for the native engine's decode step, and KV-cache sizing from a memory budget.

Decode graphs
-------------
One graph per key ``(batch bucket, kv_len, sampling mode)``. The step function reads and writes
only preallocated tensors (slot state, the slot KV cache, the validity map), so a captured graph
replays with fresh values at the same addresses. The first call for a key runs the step eagerly
on a side stream (the real step: its result is returned; lazy initialisation such as cuBLAS
workspaces or ``torch.compile`` happens here, outside capture), then the step is *captured*
(recorded, not executed), so state advances exactly once per call. Later calls replay.

Once one key went that way (the lazy initialisation is done), a new key is *recorded first and then replayed*: the
step's Python runs once (the capture pass) instead of twice (eager, then capture), and the replay is the call's real
step. A recording that fails (an op that initialises lazily per shape with a host sync, say) is a failed capture
like any other: the step runs eagerly, now and from then on. No second capture is tried: in torch 2.11 a failed
capture leaves the caching allocator routing the stream's allocations to the graphs' pool ("beginAllocateToPool:
already recording") and the default CUDA generator registered to it ("Offset increment outside graph capture"),
seen on an H100. On that card the engine's later keys recorded with no failure, Triton loads of new kernel variants
included (:attr:`DecodeGraphs.recorded`). What a step creates lazily inside a recording is created from the graphs' pool
and filled by the graph's replays, so a step must not create *state* (a buffer whose contents carry over between
steps) on its first call for a key; state is allocated before the first decode (the engine's slots and KV cache). Graphs whose
step can compile on a new key (``torch.compile`` recompiling for a new shape) do not record (``record=False``: the
engine's ``compile="full"`` decode graphs, the speculative rounds with their compiled draft): a compile inside a
capture was never tried, and a failure there would leave the engine eager.

All graphs share one memory pool (graphs are replayed one at a time, and each step's outputs
are copied to the host before the next replay). Weight updates copy into existing storage and
FP8 KV scales are updated in place, so graphs stay valid across weight syncs. If capture fails
(an op that syncs with the host, say), the error is kept in :attr:`DecodeGraphs.error` and the
engine keeps decoding eagerly: a slower but correct fallback.

Capture and Python's garbage collector: ``torch.cuda.graph`` no longer runs ``gc.collect()``
before capture (torch >= 2.6), so a dead engine held by a reference cycle (an engine's
``DecodeGraphs`` holds its bound step) could be collected *during* another engine's capture;
its destructors (CUDA graphs, events, pinned buffers) then invalidate that capture
(``cudaErrorStreamCaptureInvalidated``, seen with two engines built one after the other in a
process). :func:`gc_paused` collects once before an engine's first capture (dead engines free
their memory outside capture) and disables the collector for the duration of every capture. The graphs of
the first engine of a process skip that collection (:func:`engine_ordinal`): no engine came before it to leave garbage, and a full
collection of a process holding torch and a model took 0.28 s of an H100 rollouter's first step (2026-12-07).

Capture cost: ``torch.cuda.graph`` synchronizes the whole device and empties the caching allocator's device and
pinned-host caches before each capture. A capture needs neither (it records, it does not run), and inside a run
they are what a capture costs most: the device-wide wait takes in whatever another thread of the process has queued
(the async trainer's training step, beside a rollouter thread), and the emptied caches make the next steps'
allocations go back to the driver. The rollouter captures its graphs inside the run (20% of its generate time on an
H100 in ``async_long_tail_gpu``, 2026-12-07). So only an engine's first capture goes through ``torch.cuda.graph``;
the later ones begin and end the capture themselves on a side stream (:func:`lean_capture`), as vLLM skips the cache
emptying after its first capture.

Capture and other threads: the capture mode is ``thread_local``. In the async trainer the rollouter's
engine captures while the trainer thread of the same process keeps training; under CUDA's default
(``global``) mode the trainer's host syncs and allocations during that window fail the *trainer*
(``operation not permitted when stream is capturing``, seen on an H200). Thread-local mode checks only
the capturing thread's own calls; the other thread's work runs on its own streams, outside the graph.
One limit stays: a capture registers the default CUDA generator, so another thread drawing from it
(``torch.randn`` on CUDA, dropout) during a capture fails ("Offset increment outside graph capture"); the
trainers draw no CUDA random numbers in their steps (the engine's sampling noise is counter-based).

Memory budget
-------------
:func:`kv_bytes_per_token` reads the per-token K/V size from an HF config (GQA and DeepSeek MLA
layouts); :func:`slots_for_budget` turns ``gpu_memory_utilization`` x free device memory into the
number of KV slots of ``max_seq_len`` columns.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
import traceback
import warnings
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["DecodeGraphs", "engine_ordinal", "gc_paused", "graph_blocker", "kv_bytes_per_token", "lean_capture", "slots_for_budget"]


def graph_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model``'s decode step cannot be captured, known before trying; None if nothing is known.

    HF MoE experts run ``torch._grouped_mm``; on CUDA only its bf16 kernel keeps the offsets on the
    device, other dtypes take a fallback that copies them to the host (not capturable). Experts running the
    fused Triton kernel (:mod:`~lumenrl_backends.engines.moe`) capture in every dtype."""
    from lumenrl_backends.engines.moe import FUSED_ATTR

    experts = [m for m in model.modules()
               if type(m).__name__.endswith("Experts") and m.__dict__.get(FUSED_ATTR) != "triton"]
    if not experts:
        return None
    dtypes = {p.dtype for m in experts for p in m.parameters(recurse=False)}
    if dtypes and dtypes != {torch.bfloat16}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return f"MoE experts in {names}: torch._grouped_mm captures only in bfloat16 (load the model in bf16)"
    return None


_ENGINES = itertools.count()


def engine_ordinal() -> int:
    """0 for the first engine built in this process, then 1, 2, ...: an engine after the first collects before its
    graphs' first capture (an earlier one may be garbage in a reference cycle; module doc)."""
    return next(_ENGINES)


@contextlib.contextmanager
def gc_paused(collect: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside the block (``collect``: one full collection first); the
    collector's previous state is restored on exit, exceptions included."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def lean_capture(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
    """Capture into ``graph`` (memory from ``pool``) on ``stream``, thread-local: ``torch.cuda.graph`` without the
    device-wide ``synchronize`` and the device and pinned-host cache emptying it runs first (module doc)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


class DecodeGraphs:
    """Lazily captured CUDA graphs of ``step(*key)``; eager when disabled or after a failed capture."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, ...]], *, enabled: bool, collect: bool = True,
                 record: bool = True) -> None:
        """``collect``: one full collection before the first capture (False: the process's first engine, module
        doc; :func:`engine_ordinal`). ``record``: a key after the first is recorded, then replayed (module doc); off
        where a new key can compile (``torch.compile`` recompiling for a new shape: not inside a capture)."""
        self.step = step
        self.record = record
        self._collect = collect
        self.enabled = enabled
        self.graphs: dict[Hashable, tuple[Any, tuple[torch.Tensor, ...]]] = {}
        self.error: str | None = None
        self._pool: Any = None
        self._stream: Any = None  # the captures' side stream (after the first: lean_capture)
        self.captures = 0  # graphs captured so far
        self.capture_s = 0.0  # host seconds of their first calls (the eager step and the capture, or record + replay)
        self.recorded = 0  # of those, keys recorded first and replayed (module doc)

    def __call__(self, *key: Hashable) -> tuple[torch.Tensor, ...]:
        if not self.enabled or self.error is not None:
            return self.step(*key)
        entry = self.graphs.get(key)
        if entry is not None:
            graph, outputs = entry
            graph.replay()
            return outputs
        start = time.perf_counter()
        if self.graphs and self.record:  # lazy initialisation done: record, then replay (module doc)
            outputs = self._record(key)
            if outputs is None:  # the recording failed: eager from now on
                return self.step(*key)
            self.recorded += 1
            self.captures += 1
            self.capture_s += time.perf_counter() - start
            return outputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = self.step(*key)  # the real step, eagerly
        torch.cuda.current_stream().wait_stream(side)
        self._capture(key)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return result

    def _record(self, key: tuple[Hashable, ...]) -> tuple[torch.Tensor, ...] | None:
        """Capture ``key``'s step without running it, then replay it once: its outputs; None if the capture failed
        (nothing ran; :attr:`error` is set, module doc)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with gc_paused(), lean_capture(graph, self._pool, self._stream):
                outputs = self.step(*key)
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager decode
            self._failed(err)
            return None
        self.graphs[key] = (graph, outputs)
        graph.replay()
        return outputs

    def _failed(self, err: Exception) -> None:
        self.error = f"{type(err).__name__}: {err}{_where(err)}"
        warnings.warn(f"native engine: CUDA graph capture failed ({self.error}); decoding eagerly", stacklevel=4)
        torch.cuda.synchronize()

    def _capture(self, key: tuple[Hashable, ...]) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        first = not self.graphs  # (a failed capture leaves the graphs eager: no capture follows it)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # every capture on the one side stream: the pool's blocks are reused by later captures of the same stream
        capture = (torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local")
                   if first else lean_capture(graph, self._pool, self._stream))  # module doc: capture cost
        try:
            # no destructor of a dead engine may run inside the capture (see module doc)
            with gc_paused(collect=self._collect and not self.graphs), capture:
                outputs = self.step(*key)
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager decode
            self._failed(err)
            return
        self.graphs[key] = (graph, outputs)


def _where(err: BaseException) -> str:
    """' (at file:line)' of the innermost frame outside torch that raised ``err``, to find the op that broke capture."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def kv_bytes_per_token(config: Any, element_size: int) -> int:
    """Bytes of K + V one token occupies across all layers (GQA/MHA, or DeepSeek MLA's full K/V)."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    if getattr(config, "qk_rope_head_dim", None) is not None and getattr(config, "v_head_dim", None):
        k_dim = heads * (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim))
        v_dim = heads * int(config.v_head_dim)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        k_dim = v_dim = int(kv_heads) * int(head_dim)
    return layers * (k_dim + v_dim) * element_size


def slots_for_budget(
    *, free_bytes: int, utilization: float, max_seq_len: int, bytes_per_token: int, max_slots: int
) -> int:
    """KV slots of ``max_seq_len`` columns that fit in ``utilization * free_bytes`` (capped by ``max_slots``)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={utilization} must be in (0, 1]")
    per_slot = max_seq_len * bytes_per_token
    slots = int(free_bytes * utilization) // per_slot
    if slots < 1:
        raise ValueError(
            f"gpu_memory_utilization={utilization} of {free_bytes / 2**30:.2f} GiB free leaves no room for one "
            f"KV slot of max_seq_len={max_seq_len} ({per_slot / 2**20:.1f} MiB); raise it or shorten sequences"
        )
    return min(slots, max_slots)
