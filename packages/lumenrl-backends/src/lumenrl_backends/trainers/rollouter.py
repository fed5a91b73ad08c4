"""The rollouter of ``async_rl``: keeps the engine generating into the sample queue.

Loop (one thread, or the main thread of its own process)::

    new weights published? -> apply (between generate calls) -> start a staleness window
    budget left? -> take whole groups of fresh rows (prompt batch r: uid ``s{r}r0-i``, seeds
    sampling_seed(seed, r, 0) + row, as the synchronous trainer's step r) -> generate
    (leftover partial rows + fresh rows in one call) -> tag new tokens with the engine's
    weight version -> complete groups -> sink; groups with unfinished rows -> leftover

Interrupts (``partial_rollout``; engine capability ``interrupt_resume``): a watcher thread
interrupts the running call when a newer policy is published (the leftover continues under the
new weights: one sequence may mix versions, recorded per token in ``token_versions``) and, to
keep the engine full under long-tail lengths, when fewer than ``refill_below`` of the call's
rows are still running while budget is left (continuous refill: the leftover is resumed in the
next call together with fresh rows; without a weight change the continuation is bit-identical).
Without ``partial_rollout`` weights change only between calls and no call is cut short.

Staleness: :class:`lumenrl_async.StalenessController` grants samples per sync window; stale
samples still outstanding (produced, not yet taken by the trainer) are charged to the window, and
those the trainer then drops as too stale are refunded to it (the trainer needs replacements, and
only this window can grant them: without the refund both sides wait for each other).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lumenrl_async import SampleGroup, StalenessController
from lumenrl_backends.trainers.rollout import concat_rounds, expand_groups, generate, sampling_seed
from lumenrl_core.data_proto import DataProto

__all__ = ["Rollouter", "RolloutHooks", "as_continuation", "carry_token_columns", "engine_stats", "tag_token_versions"]


def engine_stats(engine: Any) -> dict[str, float]:
    """The engine's CUDA graph captures so far (decode and prefill), the host seconds they took and how many of them
    were recorded, then replayed (``graph_recorded``), its prefills at
    their own shape (``prefill_eager``, and their host seconds; ``prefill_packed`` of them packed), the host's wait for admitted rows' first tokens
    (``prefill_wait_s``), and the interrupted rows it continued
    in their kept slots (``kept_reclaimed``; ``kept_across_updates``: after a weight update, on the old weights'
    cache), and the rows it admitted by a prefill of their own or by a copy of another row's (``prefill_rows``,
    ``shared_prefill_rows``). Empty for an engine without any of these."""
    out: dict[str, float] = {}
    graphs = getattr(engine, "graphs", None)
    if graphs is not None and hasattr(graphs, "captures"):
        prefill = getattr(engine, "prefill", None)
        own = [graphs, *([prefill.graphs] if hasattr(prefill, "graphs") else [])]  # decode's, and the prefill's
        out.update(graph_captures=float(sum(g.captures for g in own)), graph_capture_s=float(sum(g.capture_s for g in own)),
                   graph_recorded=float(sum(getattr(g, "recorded", 0) for g in own)))  # of the captures: record + replay
    eager = getattr(getattr(engine, "prefill", None), "eager", None)
    if isinstance(eager, dict):  # prefills at their own shape, not from a graph (engines/prefill.py)
        out.update(prefill_eager=float(eager["calls"]), prefill_eager_s=float(eager["seconds"]))
        out["prefill_packed"] = float(getattr(engine.prefill, "packed_calls", 0))  # of them: packed (no padding)
    if hasattr(engine, "prefill_wait_s"):  # the host's wait for admissions' first tokens (engines/native.py)
        out["prefill_wait_s"] = float(engine.prefill_wait_s)
    kept = getattr(engine, "kept_slots", None)
    if isinstance(kept, dict):
        out.update(kept_reclaimed=float(kept.get("reclaimed", 0)), kept_across_updates=float(kept.get("across_updates", 0)))
    rows = getattr(engine, "prefill_rows", None)
    if isinstance(rows, dict):
        out.update(prefill_rows=float(rows.get("prefilled", 0)), shared_prefill_rows=float(rows.get("shared", 0)))
    return out


@dataclass(kw_only=True)
class RolloutHooks:
    """How a rollouter talks to its trainer (thread: direct calls; process: a channel)."""

    sink: Callable[[SampleGroup], None]  # a finished group -> the queue
    ledger: Callable[[], tuple[int, int]]  # (samples produced, not yet taken; the trainer's stale drops so far), read together
    newest_version: Callable[[], int | None]  # newest published policy version (cheap)
    load_weights: Callable[[Any], int | None]  # apply the newest weights to the engine; its version
    stop: threading.Event = field(default_factory=threading.Event)


def as_continuation(rows: DataProto) -> DataProto:
    """Fresh prompt rows in the engine's rollout layout with empty responses (``interrupted``),
    so they can share one generate call with continued partial rows."""
    ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    B = len(rows)
    empty = torch.zeros(B, 0, dtype=torch.int64)
    out = DataProto.from_dict(
        tensors={"prompts": ids, "attention_mask": mask, "input_ids": ids, "responses": empty,
                 "response_mask": empty.clone(), "rollout_log_probs": torch.zeros(B, 0),
                 "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                 "token_versions": torch.zeros(B, 0, dtype=torch.int64)},
        non_tensors={k: v for k, v in rows.non_tensor_batch.items()},
        meta_info={"interrupted": True},
    )
    out["finish_reason"] = np.array(["interrupted"] * B, dtype=object)
    out["seed"] = np.asarray(rows.non_tensor_batch["sampling_seed"], dtype=np.int64)
    return out


def carry_token_columns(left: DataProto, fresh: DataProto) -> None:
    """Keep the leftover's per-token columns (B, P+T, ...) through its concatenation with fresh rows:
    R3 ``routed_experts`` / ``router_probs`` of rows that finished before the interrupt are what the
    engine hands back for them (``carry_routes``), so fresh rows get placeholders of their width
    (routes ``0..k-1``, zeros) that the engine overwrites; other extra keys are produced anew."""
    width = left.batch["prompts"].shape[1] + left.batch["responses"].shape[1]
    B, P = len(fresh), fresh.batch["prompts"].shape[1]
    for key in set(left.batch) - set(fresh.batch):
        t = left.batch[key]
        if t.dim() < 2 or t.shape[1] != width:
            left.batch.pop(key)
        elif key == "routed_experts":  # (B, P+T, L_moe, k): a pad row lists experts 0..k-1
            fresh.batch[key] = torch.arange(t.shape[-1], dtype=t.dtype).expand(B, P, *t.shape[2:]).clone()
        else:
            fresh.batch[key] = torch.zeros(B, P, *t.shape[2:], dtype=t.dtype)


def _concat_prompts(parts: list[DataProto], pad_id: int) -> DataProto:
    """Concatenate prompt batches of different widths, left-padding ``input_ids``/``attention_mask``."""
    width = max(p.batch["input_ids"].shape[1] for p in parts)
    padded = []
    for p in parts:
        p = p[:]
        extra = width - p.batch["input_ids"].shape[1]
        if extra:
            p.batch["input_ids"] = torch.nn.functional.pad(p.batch["input_ids"], (extra, 0), value=pad_id)
            p.batch["attention_mask"] = torch.nn.functional.pad(p.batch["attention_mask"], (extra, 0), value=0)
        padded.append(p)
    return DataProto.concat(padded)


def tag_token_versions(before: DataProto, after: DataProto, version: int) -> torch.Tensor:
    """(B, T) policy version of every response token of ``after``: tokens present in ``before``
    keep their tag, tokens generated by this call get ``version``."""
    mask = after.batch["response_mask"]
    tv = torch.full_like(mask, int(version))
    if "token_versions" in before.batch:
        old, old_mask = before.batch["token_versions"], before.batch["response_mask"]
        width = min(old.shape[1], tv.shape[1])
        keep = old_mask[:, :width].bool()
        tv[:, :width] = torch.where(keep, old[:, :width], tv[:, :width])
    return tv * mask


class Rollouter:
    """Drives one engine; see the module docstring. ``run()`` returns when ``hooks.stop`` is set."""

    def __init__(
        self, *, engine: Any, next_prompts: Callable[[], DataProto], sampling: dict[str, Any], n: int,
        run_seed: int, budget: StalenessController, hooks: RolloutHooks, partial_rollout: bool,
        max_rows: int, start_round: int = 0, refill_below: float = 0.5, loader_state: Callable[[], Any] | None = None,
    ) -> None:
        self.engine, self.next_prompts, self.sampling, self.n = engine, next_prompts, sampling, n
        self.run_seed, self.budget, self.hooks = run_seed, budget, hooks
        self.partial_rollout, self.refill_below = partial_rollout, refill_below
        self.max_rows = max(max_rows, n)
        self.round = start_round
        self.loader_state = loader_state
        self._fresh: DataProto | None = None  # expanded prompt rows not yet started
        self._leftover: DataProto | None = None  # rows of groups with unfinished sequences
        self._granted = 0  # samples granted by the budget, not yet started
        self.window_version = -1
        self._stale_seen = 0  # the trainer's stale drops already accounted for in this window
        self.stats = {"idle_s": 0.0, "busy_s": 0.0, "partial_rollouts": 0, "interrupts": 0, "refills": 0,
                      "samples": 0, "tokens": 0, "budget_refunds": 0, "calls": 0, "prefill_s": 0.0}
        self._call_rows = 0
        self._interrupt_reason: str | None = None
        self.lock = threading.Lock()  # held while this rollouter uses the engine (others: interrupt, then take it)

    # ------------------------------------------------------------------ windows
    def _maybe_new_window(self) -> None:
        newest = self.hooks.newest_version()
        if newest is None or newest <= self.window_version:
            return
        if self._leftover is not None and not self.partial_rollout:
            return  # without partial rollout, unfinished sequences finish under their weights first
        version = self.hooks.load_weights(self.engine)
        if version is None or version <= self.window_version:
            return  # nothing newer was loaded: the window (and its budget) goes on
        outstanding, self._stale_seen = self.hooks.ledger()
        self.budget.start_window(version, [version - 1] * outstanding)  # every outstanding sample is stale
        self._granted = 0
        self.window_version = version

    def _refund_stale_drops(self) -> None:
        """Samples charged to this window that the trainer has since dropped as stale go back to its budget.
        Drops seen while a newer version waits to be loaded are left to that window's start, which
        charges only what is still outstanding then."""
        newest = self.hooks.newest_version()
        if self.window_version < 0 or (newest is not None and newest > self.window_version):
            return
        _, stale = self.hooks.ledger()
        if stale > self._stale_seen:
            self.stats["budget_refunds"] += self.budget.refund(stale - self._stale_seen)
            self._stale_seen = stale

    def _take_fresh(self, rows: int) -> DataProto | None:
        groups = rows // self.n
        if groups <= 0:
            return None
        self._refund_stale_drops()
        groups = self.budget.acquire(groups * self.n) // self.n
        if groups <= 0:
            return None
        parts, need = [], groups * self.n
        while need > 0:
            if self._fresh is None or not len(self._fresh):
                self._fresh = self._next_round()
            take = min(need, len(self._fresh))
            parts.append(self._fresh[:take])
            self._fresh = self._fresh[take:]
            need -= take
        return parts[0] if len(parts) == 1 else _concat_prompts(parts, self._pad_id())

    def _pad_id(self) -> int:
        return int(getattr(self.engine, "pad_token_id", 0) or 0)

    def _next_round(self) -> DataProto:
        self.round += 1
        rows = expand_groups(self.next_prompts(), self.n, group_tag=f"s{self.round}r0")
        base = sampling_seed(self.run_seed, self.round, 0)
        rows["sampling_seed"] = np.arange(base, base + len(rows), dtype=np.int64)
        rows["rollout_round"] = np.full(len(rows), self.round, dtype=np.int64)
        return rows

    # ------------------------------------------------------------------ one call
    def _call_batch(self) -> DataProto | None:
        left = self._leftover
        room = self.max_rows - (len(left) if left is not None else 0)
        fresh = self._take_fresh(room)
        self._leftover = None
        if left is None:
            return fresh
        if fresh is None:
            return left
        fresh = as_continuation(fresh)
        for key, values in left.non_tensor_batch.items():  # e.g. response_text: refreshed by the engine
            if key not in fresh.non_tensor_batch:
                fresh[key] = np.array([""] * len(fresh), dtype=object) if values.dtype == object else np.zeros(len(fresh), values.dtype)
        carry_token_columns(left, fresh)
        return concat_rounds([left, fresh], pad_token_id=self._pad_id())

    def step(self) -> bool:
        """One generate call (or nothing to do); returns whether work was done."""
        with self.lock:
            return self._step()

    def _step(self) -> bool:
        self._maybe_new_window()
        batch = self._call_batch()
        if batch is None:
            return False
        version = int(getattr(self.engine, "weight_version", 0))
        self._call_rows = len(batch)
        self._interrupt_reason = None
        sampling = dict(self.sampling)
        start = time.perf_counter()
        out = generate(self.engine, batch, sampling, seed=int(batch.non_tensor_batch["sampling_seed"][0]))
        self.stats["busy_s"] += time.perf_counter() - start
        if hasattr(self.engine, "resume"):
            self.engine.resume()
        out["token_versions"] = tag_token_versions(batch, out, version)
        perf = out.meta_info.get("perf", {})
        self.stats["tokens"] += int(perf.get("tokens", 0))
        self.stats["prefill_s"] += float(perf.get("prefill_seconds", 0.0))  # engines that time their prefill
        self.stats["calls"] += 1
        self._split(out)
        return True

    def _split(self, out: DataProto) -> None:
        """Complete groups -> sink; groups with an unfinished row -> leftover (in row order)."""
        uids = out.non_tensor_batch["uid"]
        unfinished = {u for u, r in zip(uids, out.non_tensor_batch["finish_reason"]) if r == "interrupted"}
        order: dict[Any, list[int]] = {}
        for row, uid in enumerate(uids):
            order.setdefault(uid, []).append(row)
        left_rows = [row for uid, rows in order.items() if uid in unfinished for row in rows]
        if left_rows:
            left = out[np.asarray(left_rows)]
            left.meta_info = {**out.meta_info, "interrupted": True}
            self._leftover = left
        for uid, rows in order.items():
            if uid in unfinished:
                continue
            group = out[np.asarray(rows)]
            group.meta_info = {"temperature": out.meta_info.get("temperature", 1.0)}
            tv, mask = group.batch["token_versions"], group.batch["response_mask"].bool()
            big = torch.iinfo(torch.int64).max
            oldest = torch.where(mask, tv, torch.full_like(tv, big)).min(dim=1).values
            oldest = torch.where(oldest == big, torch.full_like(oldest, self.window_version), oldest)
            newest = int(torch.where(mask, tv, torch.zeros_like(tv)).max())
            mixed = int((torch.where(mask, tv, oldest[:, None]) != oldest[:, None]).any(dim=1).sum())
            self.stats["partial_rollouts"] += mixed
            self.stats["samples"] += len(rows)
            meta = {"round": int(group.non_tensor_batch["rollout_round"][0]), "partial": mixed,
                    "reader_round": self.round}
            if self.loader_state is not None:
                meta["loader_state"] = self.loader_state()
            self.hooks.sink(SampleGroup(uid=str(uid), payload=group, versions=tuple(int(v) for v in oldest),
                                        newest_version=newest, meta=meta))

    # ------------------------------------------------------------------ interrupts
    def _watch(self, done: threading.Event) -> None:
        """Interrupt the running call for a sync (partial rollout) or a refill (engine underfull)."""
        slots = getattr(getattr(self.engine, "slots", None), "host_columns", None)
        peak = 0
        while not done.is_set() and not self.hooks.stop.is_set():
            time.sleep(0.002)
            if self.engine.interrupted:
                continue
            newest = self.hooks.newest_version()
            if newest is not None and newest > self.window_version and self._call_rows:
                self._interrupt("sync")
                continue
            if slots is None or not self._call_rows:
                peak = 0
                continue
            active = len(slots) - len(self.engine.slots.free)
            peak = max(peak, active)
            if peak and active <= self.refill_below * peak and self.budget.remaining >= self.n:
                self._interrupt("refill")
                peak = 0

    def _interrupt(self, reason: str) -> None:
        self._interrupt_reason = reason
        self.stats["interrupts"] += 1
        if reason == "refill":
            self.stats["refills"] += 1
        self.engine.interrupt()

    def run(self) -> None:
        done = threading.Event()
        watcher = None
        if self.partial_rollout:
            watcher = threading.Thread(target=self._watch, args=(done,), daemon=True, name="rollouter-watch")
            watcher.start()
        try:
            while not self.hooks.stop.is_set():
                if not self.step():
                    tick = time.perf_counter()
                    self.hooks.stop.wait(0.002)
                    self.stats["idle_s"] += time.perf_counter() - tick
                self._call_rows = 0
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
