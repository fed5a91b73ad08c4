"""Rollouter process -> trainer process: sample groups over a one-way ``multiprocessing`` pipe
(:class:`ProcessChannel`), or polled out of an :class:`Outbox` (a Ray actor's method).

A group travels as one message ``("group", uid, versions, newest_version, meta, payload_bytes)``
(the payload is ``DataProto.to_bytes()``: safetensors bytes, no pickle of tensors). Shared
counters make the cross-process ledger exact: the producer adds a group's samples to
``produced`` *before* sending it, and the trainer's pump reads ``produced`` only *after*
receiving a message, so ``produced - received`` (in transit) is never negative. The trainer
writes its ledger back (``taken``: samples consumed or dropped, and how many of those were
dropped as ``stale``, written together) so the rollouter can charge outstanding stale samples to
its staleness budget and replace the ones the trainer dropped. If the producer dies, whatever it counted but never
delivered is dropped with reason ``rollouter_crash`` (:meth:`settle`). The parent closes its
copy of the pipe's sending end once the child started (:meth:`started`), so a producer that dies
mid-message gives the reader an end-of-file instead of a hang; a torn message is never decoded.

An :class:`Outbox` is the same protocol for a transport the consumer polls (an RPC): the producer
counts a group in ``produced`` when it queues it; one ``poll(ledger)`` returns the queued messages
and ``produced`` read under the same lock (so again never fewer produced than delivered) and
records the consumer's ledger (:meth:`SampleQueue.ledger`). :func:`deliver` is the consumer's side of both.
"""

from __future__ import annotations

import threading
from typing import Any

from lumenrl_async.queue import SampleGroup, SampleQueue

__all__ = ["ProcessChannel", "Outbox", "STAT_KEYS", "deliver", "encode"]

STAT_KEYS = ("idle_s", "busy_s", "partial_rollouts", "interrupts", "refills", "budget_refunds", "samples", "tokens",
             "round", "graph_captures", "graph_capture_s", "graph_recorded",  # the producer engine's CUDA graphs
             "calls", "prefill_s",  # generate calls, and the engine's prefill seconds within them
             "kept_reclaimed", "kept_across_updates",  # interrupted rows continued in their kept slots (across updates)
             "prefill_rows", "shared_prefill_rows",  # rows admitted by their own prefill / by a copy of another's
             "prefill_eager", "prefill_eager_s",  # prefills at their own shape (no CUDA graph), their host seconds
             "prefill_packed",  # of them: packed, contexts back to back
             "prefill_wait_s")  # the host's wait for admitted rows' first tokens


def encode(group: SampleGroup) -> tuple[Any, ...]:
    """The message of one group (payload as ``DataProto.to_bytes()`` when it has that method)."""
    payload = group.payload.to_bytes() if hasattr(group.payload, "to_bytes") else group.payload
    return ("group", group.uid, list(group.versions), group.newest_version, group.meta, payload)


def deliver(sample_queue: SampleQueue, msg: tuple[Any, ...], produced: int, decode: Any, *,
            closing: bool = False, stop: threading.Event | None = None) -> None:
    """Consumer side: one received message into ``sample_queue``; ``produced`` is the producer's
    count read after receiving it (so it includes it). ``closing``: received, never trained. While the queue is
    full, waits for room until the queue closes or ``stop`` is set (the pump stopping: a consumer that no longer
    takes would otherwise leave it waiting for ever); then the group is dropped (``shutdown``)."""
    kind, uid, versions, newest, meta, payload = msg
    sample_queue.note_produced(produced - sample_queue.produced)
    group = SampleGroup(uid=uid, payload=decode(payload), versions=tuple(versions), newest_version=newest, meta=meta)
    if closing:
        sample_queue.drop(group.size, "shutdown", counted=True)
        return
    while not sample_queue.put(group, counted=True, timeout=0.1):
        if sample_queue.closed or (stop is not None and stop.is_set()):
            sample_queue.drop(group.size, "shutdown", counted=True)
            return


class Outbox:
    """Producer side of a polled channel: groups wait here until the consumer's next ``poll``."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._messages: list[tuple[Any, ...]] = []
        self.produced = 0
        self.taken = 0
        self.stale = 0

    def send(self, group: SampleGroup) -> None:
        msg = encode(group)
        with self._lock:
            self.produced += group.size
            self._messages.append(msg)
            self._lock.notify_all()

    def ledger(self) -> tuple[int, int]:
        """``(outstanding, stale)``: samples sent and not yet taken, and the consumer's stale drops so far."""
        with self._lock:
            return self.produced - self.taken, self.stale

    def poll(self, ledger: tuple[int, int], wait_s: float = 0.0) -> tuple[list[tuple[Any, ...]], int]:
        """``(messages, produced)``: everything queued (waiting up to ``wait_s`` for something);
        ``ledger``: the consumer's :meth:`SampleQueue.ledger`."""
        with self._lock:
            self.taken, self.stale = (int(x) for x in ledger)
            if not self._messages and wait_s > 0:
                self._lock.wait(wait_s)
            messages, self._messages = self._messages, []
            return messages, self.produced


class ProcessChannel:
    """Built in the parent with a ``multiprocessing`` context (spawn); passed to the child."""

    def __init__(self, ctx: Any) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.eof = False
        self.produced = ctx.Value("q", 0)
        self.consumer_ledger = ctx.Array("q", 2)  # (taken, stale), written and read under its lock
        self.stats = ctx.Array("d", len(STAT_KEYS))
        self._stop = ctx.Value("b", 0)  # a flag, not an Event: a waiter dying inside Event.wait hangs set()

    def request_stop(self) -> None:
        self._stop.value = 1

    def stop_requested(self) -> bool:
        return bool(self._stop.value)

    # ------------------------------------------------------------------ producer (child)
    def send(self, group: SampleGroup) -> None:
        msg = encode(group)
        with self.produced.get_lock():
            self.produced.value += group.size
        self.writer.send(msg)

    def ledger(self) -> tuple[int, int]:
        """``(outstanding, stale)``: samples sent and not yet taken, and the consumer's stale drops so far."""
        with self.consumer_ledger.get_lock():
            taken, stale = int(self.consumer_ledger[0]), int(self.consumer_ledger[1])
        return int(self.produced.value) - taken, stale

    def set_stats(self, stats: dict[str, float]) -> None:
        for i, key in enumerate(STAT_KEYS):
            if key in stats:
                self.stats[i] = float(stats[key])

    # ------------------------------------------------------------------ consumer (parent)
    def started(self) -> None:
        """Call in the parent right after the producer process started."""
        self.writer.close()

    def read_stats(self) -> dict[str, float]:
        return {key: float(self.stats[i]) for i, key in enumerate(STAT_KEYS)}

    def _receive(self, sample_queue: SampleQueue, decode: Any, timeout: float, closing: bool = False,
                 stop: threading.Event | None = None) -> bool:
        if self.eof:
            return False
        try:
            if not self.reader.poll(timeout):
                return False
            msg = self.reader.recv()
        except (EOFError, OSError):  # the producer exited (a torn last message is discarded)
            self.eof = True
            return False
        deliver(sample_queue, msg, int(self.produced.value), decode, closing=closing, stop=stop)  # read after receiving
        return True

    def pump(self, sample_queue: SampleQueue, decode: Any, done: threading.Event) -> threading.Thread:
        """A thread moving messages into ``sample_queue`` until ``done``; also mirrors its ledger."""

        def loop() -> None:
            while not done.is_set():
                self._receive(sample_queue, decode, 0.02, stop=done)
                taken, stale = sample_queue.ledger()
                with self.consumer_ledger.get_lock():
                    self.consumer_ledger[0], self.consumer_ledger[1] = taken, stale

        thread = threading.Thread(target=loop, daemon=True, name="async-pump")
        thread.start()
        return thread

    def drain(self, sample_queue: SampleQueue, decode: Any, *, closing: bool = False) -> None:
        """Receive every message still in the pipe; ``closing``: count them dropped (``shutdown``)."""
        while self._receive(sample_queue, decode, 0.05, closing):
            pass

    def settle(self, sample_queue: SampleQueue, reason: str) -> int:
        """Counted by the producer but never delivered: dropped with ``reason``; returns samples."""
        sample_queue.note_produced(int(self.produced.value) - sample_queue.produced)
        return sample_queue.drop_in_transit(reason)
