"""Collective weight sync across two spawned CPU processes (gloo): the rollouter's engine holds the
trainer's weights bit for bit after every sync, versions only go up, a version is never applied torn,
and the writer's stream survives idle stretches (readers wait on the store, not in a collective)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from lumenrl_async import CollectiveReader, CollectiveWeightSync, WeightReceiveError
from lumenrl_core.config.schema import RunConfig

BUCKET = 4096  # bytes: several buckets per version, and one tensor larger than a bucket


class _Engine(torch.nn.Module):
    """What a rollout engine does with weights: copy in place, keep a version."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.proj = torch.nn.Linear(16, 64).to(torch.bfloat16)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("flags", torch.zeros(5, dtype=torch.bool))
        self.register_buffer("big", torch.zeros(3000))
        self.weight_version = -1

    @torch.no_grad()
    def update_weights(self, tensors, version: int) -> int:
        state = self.state_dict(keep_vars=True)
        for name, t in dict(tensors).items():
            state[name].copy_(t)
        self.weight_version = int(version)
        return len(tensors)


def _weights(version: int) -> dict[str, torch.Tensor]:
    """Fresh random weights (fp32, bf16 incl. a non-contiguous view, int64, bool, a 0-dim scale)."""
    g = torch.Generator().manual_seed(1000 + version)
    proj = torch.randn(16, 64, generator=g).to(torch.bfloat16).t()  # (64, 16), non-contiguous
    return {"embed.weight": torch.randn(40, 16, generator=g),  # 2560 B: shares buckets
            "proj.weight": proj, "proj.bias": torch.randn(64, generator=g).to(torch.bfloat16),
            "steps": torch.tensor([version, -version, 7], dtype=torch.int64),
            "flags": torch.rand(5, generator=g) > 0.5}


def _big(version: int) -> dict[str, torch.Tensor]:
    return {**_weights(version), "big": torch.full((3000,), float(version))}  # 12000 B > one bucket


def _reader(handle, out, mode: str) -> None:
    torch.set_num_threads(1)
    reader = CollectiveWeightSync.reader(handle, device="cpu")
    engine = _Engine()
    seen: list[int] = []
    while True:  # ends at the writer's close; a dead writer fails load_into; the test's out.get(timeout=...) guards hangs
        closed = reader.closed  # read before applying: the last version is applied after the close
        version = reader.load_into(engine)
        if closed and (version is None or (seen and version == seen[-1])):
            break
        if version is None or (seen and version == seen[-1]):
            time.sleep(0.001)
            continue
        seen.append(version)
        if mode == "exact":
            out.put((version, {k: v.clone() for k, v in engine.state_dict().items()}))
        else:  # the engine holds one whole version: every tensor says the same version
            out.put((version, bool((engine.big == version).all()) and int(engine.steps[0]) == version))
    out.put(("done", seen, reader.closed))


def _start(mode: str, writer: CollectiveWeightSync):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_reader, args=(writer.reader_handle(), out, mode), daemon=True)
    proc.start()
    return proc, out


def test_engine_equals_the_trainer_bit_for_bit_after_every_sync():
    writer = CollectiveWeightSync(device="cpu", bucket_bytes=BUCKET)
    proc, out = _start("exact", writer)
    try:
        for version in (0, 1, 2, 5):
            stats = writer.publish(_weights(version), version)
            assert stats["weight_sync/tensors"] == 5.0 and stats["weight_sync/gb"] > 0
            got_version, state = out.get(timeout=120)
            assert got_version == version
            sent = _weights(version)
            for name, t in sent.items():
                assert state[name].dtype == t.dtype and torch.equal(state[name], t), (version, name)
        time.sleep(0.5)  # idle: the reader waits on the store, not inside a collective
        writer.publish(_weights(9), 9)
        assert out.get(timeout=120)[0] == 9
        with pytest.raises(ValueError, match="version=9 must be greater than the last published version 9"):
            writer.publish(_weights(9), 9)
        writer.close()
        done, seen, closed = out.get(timeout=60)
        assert done == "done" and seen == [0, 1, 2, 5, 9] and closed
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_fast_publishes_are_never_torn_and_versions_only_go_up():
    """The writer publishes as fast as it can (a tensor larger than a bucket included): the reader
    may skip versions, but every version it applies is whole and they only increase."""
    writer = CollectiveWeightSync(device="cpu", bucket_bytes=BUCKET)
    proc, out = _start("race", writer)
    try:
        for version in range(1, 31):
            writer.publish(_big(version), version)
        time.sleep(0.5)
        writer.close()
        results = []
        while (item := out.get(timeout=120))[0] != "done":
            results.append(item)
        _, seen, closed = item
        assert closed and seen and seen == sorted(set(seen)) and seen[-1] == 30
        assert all(whole for _, whole in results)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_config_and_misuse():
    cfg = RunConfig()
    cfg.cluster.device, cfg.weight_sync.bucket_size_mb = "cpu", 3
    writer = CollectiveWeightSync.from_config(cfg)
    assert writer.backend == "gloo" and writer.bucket_bytes == 3 << 20 and writer.readers == 1
    assert CollectiveWeightSync.probe() is None
    assert {"cross_process", "cross_node", "collective"} <= CollectiveWeightSync.capabilities
    with pytest.raises(RuntimeError, match="reader_handle"):
        writer.publish(_weights(0), 0)
    handle = writer.reader_handle()
    assert handle["backend"] == "gloo" and handle["size"] == 2 and handle["port"] > 0
    with pytest.raises(ValueError, match="member=2: readers are 1..1"):
        CollectiveReader(handle, member=2)
    with pytest.raises(ValueError, match="the writer's group is gloo"):
        CollectiveReader(handle, device="cuda")


def test_a_failed_receiver_is_raised_not_ignored():
    """The writer announces a publish, then never forms the group (it died): the reader's thread
    times out and the rollouter's next ``latest_version()`` raises."""
    writer = CollectiveWeightSync(device="cpu", timeout_s=1.0)
    reader = CollectiveReader(writer.reader_handle()).start()
    writer.wait_for_readers()
    writer.store.set("publish/1", "0")
    reader._thread.join(timeout=60)
    with pytest.raises(WeightReceiveError, match="weight receiver failed"):
        reader.latest_version()


def test_close_returns_after_the_readers_stopped_polling_the_writers_store():
    """The store lives in the writer: a close that returned at once let the writer drop it before a slow reader's
    next poll, which then failed (a network error, raised by its next ``latest_version()``). The reader here polls
    every 0.5 s, so without the wait it would still be polling when ``close`` returns."""
    writer = CollectiveWeightSync(device="cpu")
    reader = CollectiveReader(writer.reader_handle(), poll_s=0.5).start()
    writer.wait_for_readers()
    writer.close()
    assert reader.closed  # no waiting here: close waited for it
    writer.store = None  # the store goes; the reader is not polling it any more
    assert reader.latest_version() is None


def test_close_waits_a_bounded_time_for_a_reader_that_never_stops():
    """A reader that registered and then hung (no receive thread here): close gives up after ``wait_s``."""
    writer = CollectiveWeightSync(device="cpu")
    writer.reader_handle()
    writer.store.set("reader/1", "1")
    start = time.monotonic()
    writer.close(wait_s=0.3)
    assert 0.3 <= time.monotonic() - start < 30  # the upper bound only guards a hang


def test_waiting_for_a_reader_that_died_fails_fast():
    """The first poll that finds the reader dead raises (no waiting out ``timeout_s``): counted in
    polls, not wall-clock seconds, so a loaded machine cannot fail it."""
    writer = CollectiveWeightSync(device="cpu")
    writer.reader_handle()
    polls = []

    def reader_alive() -> bool:
        polls.append(1)
        return False  # dead at the first look

    with pytest.raises(RuntimeError, match="reader ended before joining"):
        writer.wait_for_readers(reader_alive)
    assert len(polls) == 1


def test_timeout_reaches_the_nccl_group(monkeypatch):
    """``timeout_s`` bounds the NCCL group as it does the gloo one: the writer's first publish and a
    reader (``handle["timeout_s"]``) build ``ProcessGroupNCCL`` with ``Options._timeout`` set (a
    stand-in class here: this CPU build of torch has no NCCL)."""
    import torch.distributed as dist

    from lumenrl_async import collective

    made = []

    class Formed(Exception):
        pass

    class FakeNCCL:
        class Options:
            def __init__(self) -> None:
                self._timeout = None

        def __init__(self, store, member, size, options=None) -> None:
            made.append((member, size, None if options is None else options._timeout))
            raise Formed  # stop the publish here: no CUDA tensors on this machine

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    writer = CollectiveWeightSync(device="cuda", timeout_s=7.5)
    assert writer.backend == "nccl" and writer.reader_handle()["timeout_s"] == 7.5
    with pytest.raises(Formed):
        writer.publish({}, 0)
    with pytest.raises(Formed):  # the reader side opens its group the same way
        collective._open_group(dist.HashStore(), 1, 2, torch.device("cuda"), 3.0)
    assert made == [(0, 2, timedelta(seconds=7.5)), (1, 2, timedelta(seconds=3.0))]
