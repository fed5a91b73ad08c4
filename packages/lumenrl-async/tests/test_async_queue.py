"""Sample queue accounting (threads and a real producer process that may crash) and the staleness bound."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lumenrl_async import (
    AccountingError,
    Outbox,
    ProcessChannel,
    SampleGroup,
    SampleQueue,
    StalenessConfig,
    StalenessController,
    lag_of,
    versions_metrics,
)
from lumenrl_async.channel import deliver


def _group(uid: str, version: int, n: int = 2) -> SampleGroup:
    return SampleGroup(uid=uid, payload=uid.encode(), versions=(version,) * n)


def test_groups_are_taken_whole_fifo_and_stale_ones_are_dropped_with_a_reason():
    q = SampleQueue(capacity=8, sync_step=2)
    for i, v in enumerate([0, 0, 2, 4]):
        assert q.put(_group(f"g{i}", v))
    got = q.get(2, current_version=4, max_lag=1)  # lag(4, 0) = 2 syncs > 1: g0, g1 dropped
    assert [g.uid for g in got] == ["g2", "g3"]
    assert q.dropped["stale"] == 4 and q.consumed == 4 and q.queued == 0
    q.check()
    assert q.metrics()["async/dropped_stale"] == 4.0


def test_a_resumed_group_lags_from_the_weights_that_finished_it_or_from_its_oldest_token():
    """Partial rollout: at version 6 (a sync every 2 steps), a group started under v0 and finished under v6
    is 3 syncs behind by its oldest token and 0 by its finish: ``start`` drops it, ``finish`` trains it. A
    group generated under one version lags the same either way."""
    def groups():
        return [SampleGroup(uid="resumed", payload=b"r", versions=(0, 4), newest_version=6),
                SampleGroup(uid="old", payload=b"o", versions=(2, 2), newest_version=2),
                SampleGroup(uid="fresh", payload=b"f", versions=(6, 6), newest_version=6)]

    resumed, old, fresh = groups()
    assert (resumed.oldest, resumed.finished) == (0, 6) and old.finished == 2
    assert [resumed.lag(6, 2, f) for f in ("start", "finish")] == [3, 0]
    assert [old.lag(6, 2, f) for f in ("start", "finish")] == [2, 2]
    legacy = SampleGroup(uid="x", payload=b"", versions=(3, 5))  # no newest recorded: its newest sample's version
    assert legacy.finished == 5
    taken = {}
    for lag_from in ("start", "finish"):
        q = SampleQueue(sync_step=2)
        for g in groups():
            q.put(g)
        got = q.get(1, current_version=6, max_lag=1, lag_from=lag_from)
        taken[lag_from] = ([g.uid for g in got], dict(q.dropped))
        q.check()
    assert taken["start"] == (["fresh"], {"stale": 4})  # the resumed group and the old one dropped
    assert taken["finish"] == (["resumed"], {})  # the first in line, trained
    with pytest.raises(ValueError, match="lag_from='newest'.*start, finish"):
        SampleQueue().get(1, current_version=0, lag_from="newest")


def test_bounded_queue_blocks_the_producer_until_the_trainer_takes():
    q = SampleQueue(capacity=4)
    assert q.put(_group("a", 0)) and q.put(_group("b", 0))
    assert not q.put(_group("c", 0), timeout=0.05)  # full: nothing counted
    assert q.produced == 4
    q.get(1, current_version=0)
    assert q.put(_group("c", 0), timeout=0.05)
    q.check()


def test_a_group_is_never_consumed_twice_and_a_broken_ledger_is_detected():
    q = SampleQueue()
    q.put(_group("a", 0))
    q.get(1, current_version=0)
    q.put(_group("a", 0))
    with pytest.raises(AccountingError, match="twice"):
        q.get(1, current_version=0)
    q2 = SampleQueue()
    q2.put(_group("x", 0))
    q2.consumed += 1  # simulated silent loss
    with pytest.raises(AccountingError):
        q2.check()


def test_ledger_survives_a_restart_in_flight_samples_dropped_as_restart():
    q = SampleQueue()
    for i in range(3):
        q.put(_group(f"g{i}", 0))
    q.get(1, current_version=0)
    q.note_produced(2)  # one group still in transit
    state = q.state_dict()
    fresh = SampleQueue()
    fresh.load_state_dict(state)
    fresh.check()
    assert fresh.dropped["restart"] == 6 and fresh.consumed == 2 and fresh.produced == 8
    fresh.put(_group("g0", 0))
    with pytest.raises(AccountingError, match="twice"):
        fresh.get(1, current_version=0)


def test_a_delivery_waiting_for_room_ends_when_its_pump_stops():
    """The consumer stopped taking while the queue is full: the pump's delivery waited for room for ever, so
    joining the pump hung (seen under load, where a producer can end with its groups still in the pipe). Now the
    pump's stop event ends the wait and the group is dropped (``shutdown``); the ledger still balances."""
    from lumenrl_async.channel import encode

    q = SampleQueue(capacity=2)
    assert q.put(_group("held", 0))  # full
    stop = threading.Event()
    worker = threading.Thread(target=deliver, args=(q, encode(_group("late", 0)), 4, bytes), kwargs={"stop": stop})
    worker.start()
    worker.join(0.3)
    assert worker.is_alive()  # waiting for room, as it should while the pump runs
    stop.set()
    worker.join(30)  # the bound only guards a hang: the wait re-checks every 0.1 s
    assert not worker.is_alive()
    assert q.dropped["shutdown"] == 2 and q.queued == 2 and q.produced == 4
    q.check()


def _producer(channel: ProcessChannel, groups: int, crash_after: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(groups):
        time.sleep(rng.random() * 0.004)
        channel.send(SampleGroup(uid=f"u{i}", payload=b"x" * rng.randint(1, 64),
                                 versions=(0,) * rng.randint(1, 4)))
        if crash_after and i + 1 >= crash_after:
            os._exit(7)  # abrupt: the feeder thread may not have flushed the last messages


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(groups=st.integers(4, 24), crash=st.booleans(), seed=st.integers(0, 2**16), take=st.integers(1, 3),
       capacity=st.integers(0, 12))
def test_accounting_holds_under_random_delays_and_a_producer_crash(groups, crash, seed, take, capacity):
    ctx = mp.get_context("fork")
    channel = ProcessChannel(ctx)
    q = SampleQueue(capacity)
    crash_after = random.Random(seed).randint(1, groups) if crash else 0
    proc = ctx.Process(target=_producer, args=(channel, groups, crash_after, seed))
    proc.start()
    channel.started()
    done = threading.Event()
    pump = channel.pump(q, bytes, done)
    rng, seen = random.Random(seed + 1), []
    while True:
        got = q.get(take, current_version=0, timeout=5.0, alive=proc.is_alive)
        if got is None:
            break
        seen += [g.uid for g in got]
        q.check()
        time.sleep(rng.random() * 0.003)
    proc.join()
    done.set()
    pump.join()  # a pump waiting for room in a full queue stops too (its group: dropped, shutdown)
    channel.drain(q, bytes, closing=True)  # as the trainer's stop: what is left in the pipe is never trained
    lost = channel.settle(q, "rollouter_crash")
    q.drop_queued("shutdown")
    q.check()
    assert len(seen) == len(set(seen))  # no duplicate consumption
    assert q.produced == q.consumed + sum(q.dropped.values())
    if not crash:
        assert lost == 0 and q.produced == channel.produced.value
    assert proc.exitcode == (7 if crash else 0)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(groups=st.integers(4, 24), seed=st.integers(0, 2**16), take=st.integers(1, 3), capacity=st.integers(0, 12))
def test_polled_outbox_keeps_the_ledger_and_reports_taken(groups, seed, take, capacity):
    """A producer thread queues groups in an Outbox; a consumer polls it (as the Ray driver polls
    its rollouter actor): in transit never negative, every group delivered once, ``taken`` mirrored."""
    box, q, rng = Outbox(), SampleQueue(capacity), random.Random(seed)

    def produce() -> None:
        for i in range(groups):
            time.sleep(rng.random() * 0.002)
            box.send(SampleGroup(uid=f"u{i}", payload=b"x" * (i + 1), versions=(0,) * (1 + i % 3)))

    def pump() -> None:  # the driver's polling thread
        while not done.is_set():
            messages, produced = box.poll(q.ledger(), wait_s=0.01)
            for msg in messages:
                deliver(q, msg, produced, bytes)
                assert q.in_transit >= 0

    done = threading.Event()
    threads = [threading.Thread(target=produce), threading.Thread(target=pump)]
    for t in threads:
        t.start()
    seen: list[str] = []
    while len(seen) < groups:
        got = q.get(min(take, groups - len(seen)), current_version=0, timeout=0.01)
        seen += [g.uid for g in got or []]
        q.check()
    done.set()
    for t in threads:
        t.join()
    box.poll(q.ledger())
    assert sorted(seen, key=lambda u: int(u[1:])) == [f"u{i}" for i in range(groups)]
    assert box.taken == box.produced == q.produced == q.consumed and box.ledger() == (0, 0)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(s=st.sampled_from([0.0, 0.5, 1.0, 2.0]), k=st.integers(1, 3), rb=st.integers(1, 2), seed=st.integers(0, 999))
def test_staleness_budget_and_lag_bound_are_never_exceeded(s, k, rb, seed):
    """Rollouter and trainer threads with random delays; the production per window stays within
    (1 + s) * k * rb * mini and no consumed sample is more than ceil(s) syncs old."""
    n, mini = 2, 4
    cfg = StalenessConfig(staleness_threshold=s, trigger_parameter_sync_step=k, require_batches=rb, mini_batch_size=mini)
    ctl, q = StalenessController(cfg), SampleQueue(sync_step=k)
    published, stop, rng = [0], threading.Event(), random.Random(seed)
    per_window: dict[int, int] = {}

    def rollouter() -> None:
        window, made = -1, 0
        while not stop.is_set():
            if published[0] > window:
                window = published[0]
                ctl.start_window(window, [window - 1] * (q.produced - q.taken))
            if ctl.acquire(n) == n:
                time.sleep(rng.random() * 0.001)
                per_window[window] = per_window.get(window, 0) + n
                q.put(_group(f"r{made}", window, n))
                made += 1
            else:
                time.sleep(0.0005)

    thread = threading.Thread(target=rollouter)
    thread.start()
    lags = []
    for step in range(1, 4 * k + 1):
        got = q.get(rb * mini // n, current_version=published[0], max_lag=int(-(-s // 1)), timeout=10)
        assert got is not None
        lags += [lag_of(published[0], v, k) for g in got for v in g.versions]
        time.sleep(rng.random() * 0.002)
        if step % k == 0:
            published[0] = step
        q.check()
    stop.set()
    thread.join()
    assert max(lags) <= int(-(-s // 1))
    assert max(per_window.values()) <= cfg.window_capacity()
    assert versions_metrics(lags)["async/staleness_max"] == max(lags)
