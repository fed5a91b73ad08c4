"""Weight synchronizers: in-process copies, atomic versioned filesystem snapshots."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import lumenrl_async.weight_sync as ws
from lumenrl_async import FilesystemWeightSync, InProcessWeightSync, SnapshotError
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.protocols import WeightSync


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layers.0.mlp.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_inprocess_copies_and_versions():
    sync = InProcessWeightSync()
    assert isinstance(sync, WeightSync) and sync.latest() is None
    w = weights(1)
    sync.publish(w, 1)
    w["embed.weight"].add_(1.0)  # an optimizer step after publishing must not leak
    version, got = sync.latest()
    assert version == 1 and not torch.equal(got["embed.weight"], w["embed.weight"])
    assert_same(got, {**weights(1)})
    with pytest.raises(ValueError, match="version=1 must be greater than the last published version 1"):
        sync.publish(w, 1)
    assert isinstance(InProcessWeightSync.from_config(RunConfig()), InProcessWeightSync)
    assert InProcessWeightSync.probe() is None and "in_process" in InProcessWeightSync.capabilities


def test_filesystem_roundtrip_manifest_and_checksum(tmp_path):
    sync = FilesystemWeightSync(tmp_path)
    assert isinstance(sync, WeightSync) and sync.latest() is None
    sync.publish(weights(3), 3)
    version, got = sync.latest()
    assert version == 3
    assert_same(got, weights(3))
    manifest = json.loads((tmp_path / "LATEST.json").read_text())
    assert manifest == json.loads((tmp_path / "v00000003.json").read_text())
    assert manifest["file"] == "v00000003.safetensors" and manifest["num_tensors"] == 3
    assert manifest["sha256"] == ws._sha256(tmp_path / manifest["file"])
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


def test_filesystem_keeps_last_n_and_rejects_old_versions(tmp_path):
    sync = FilesystemWeightSync(tmp_path, keep_last=2)
    for v in (1, 2, 5):
        sync.publish(weights(v), v)
    assert sync.versions() == [2, 5]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["v00000002.safetensors", "v00000005.safetensors"]
    with pytest.raises(ValueError, match="greater than the last published version 5"):
        sync.publish(weights(4), 4)
    with pytest.raises(ValueError, match="keep_last=0"):
        FilesystemWeightSync(tmp_path, keep_last=0)


def test_filesystem_detects_corruption(tmp_path):
    sync = FilesystemWeightSync(tmp_path)
    sync.publish(weights(1), 1)
    path = tmp_path / "v00000001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="sha256 does not match"):
        sync.latest()


def test_failed_write_leaves_previous_snapshot_visible(tmp_path, monkeypatch):
    sync = FilesystemWeightSync(tmp_path)
    sync.publish(weights(1), 1)

    def crash_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ws, "save_file", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        sync.publish(weights(2), 2)
    version, got = sync.latest()
    assert version == 1 and not list(tmp_path.glob(".*"))
    assert_same(got, weights(1))


def test_tied_weights_are_saved(tmp_path):
    shared = torch.randn(4, 4)
    sync = FilesystemWeightSync(tmp_path)
    sync.publish({"embed.weight": shared, "lm_head.weight": shared}, 0)
    _, got = sync.latest()
    assert torch.equal(got["embed.weight"], shared) and torch.equal(got["lm_head.weight"], shared)


def test_concurrent_reader_never_sees_partial_snapshot(tmp_path):
    writer, reader = FilesystemWeightSync(tmp_path, keep_last=2), FilesystemWeightSync(tmp_path)
    seen, failures, done = [], [], threading.Event()

    def read_loop():
        try:
            while not done.is_set():
                try:
                    got = reader.latest()
                except SnapshotError:  # pruned on every retry (a reader starved on a loaded machine): read again
                    continue
                if got is not None:
                    version, tensors = got
                    assert int(tensors["step"].item()) == version  # tensors belong to the announced version
                    seen.append(version)
        except BaseException as exc:  # an assertion or error in the thread must fail the test, not end the thread
            failures.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    for v in range(1, 16):
        writer.publish({**weights(v), "big": torch.full((256, 256), float(v))}, v)
    done.set()
    thread.join()
    assert not failures, failures
    version, tensors = reader.latest(retries=0)  # the writer is done: nothing left to race
    assert version == 15 and int(tensors["step"].item()) == 15
    assert seen == sorted(seen)


@pytest.mark.parametrize("window", ["before_checksum", "after_checksum"])
def test_a_snapshot_pruned_mid_read_is_retried(tmp_path, monkeypatch, window):
    """The writer prunes the announced snapshot while a reader is reading it (``keep_last=1``: the
    next publish removes it), before the checksum pass or between it and safetensors' open: the
    read reports SnapshotError, and ``latest`` retries on the newer LATEST."""
    writer, reader = FilesystemWeightSync(tmp_path, keep_last=1), FilesystemWeightSync(tmp_path)
    writer.publish(weights(1), 1)
    sha256, publishing = ws._sha256, []

    def publish_next(path) -> None:
        announced = int(path.stem[1:])
        if announced < 3 and not publishing:  # not inside the writer's own checksum of a new snapshot
            publishing.append(announced)
            writer.publish(weights(announced + 1), announced + 1)
            publishing.clear()

    def checksum_racing_the_writer(path):
        if window == "before_checksum":
            publish_next(path)
        digest = sha256(path)
        if window == "after_checksum":
            publish_next(path)
        return digest

    monkeypatch.setattr(ws, "_sha256", checksum_racing_the_writer)
    with pytest.raises(SnapshotError, match="v00000001.safetensors of version 1 is gone"):
        reader.latest(retries=0)
    version, got = reader.latest()  # v2 is pruned mid-read as well; the retry reads v3
    assert version == 3 and writer.versions() == [3]
    assert_same(got, weights(3))


def test_from_config_uses_snapshot_dir(tmp_path):
    cfg = RunConfig()
    cfg.weight_sync.snapshot_dir = str(tmp_path / "snap")
    assert FilesystemWeightSync.from_config(cfg).root == tmp_path / "snap"
    cfg.weight_sync.snapshot_dir, cfg.trainer.output_dir = "", str(tmp_path / "run")
    assert FilesystemWeightSync.from_config(cfg).root == tmp_path / "run" / "weight_sync"


def _writer_process(root: str, versions: int) -> None:
    writer = FilesystemWeightSync(root, keep_last=2)
    for v in range(1, versions + 1):
        writer.publish({"a": torch.full((128, 256), float(v)), "b": torch.full((300,), float(v)),
                        "step": torch.tensor([v])}, v)


def test_reader_racing_a_writer_process_never_loads_a_torn_snapshot(tmp_path):
    """A separate writer process publishes while this process reads: every snapshot loaded is
    whole (all tensors of one version, checksum verified), versions never go back."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_writer_process, args=(str(tmp_path), 25))
    proc.start()
    reader, seen = FilesystemWeightSync(tmp_path), []

    def read() -> None:
        got = reader.latest(retries=0)
        if got is not None:
            version, tensors = got
            assert all(float(t.float().unique().item()) == version for t in tensors.values())
            seen.append(version)

    while proc.is_alive():
        try:
            read()
        except SnapshotError:  # the writer pruned the file while it was read: the next loop reads the newer one
            continue
    proc.join()
    assert proc.exitcode == 0
    read()  # the writer is done: its last snapshot, nothing left to race
    assert seen == sorted(seen) and seen[-1] == 25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inprocess_cuda_copies_stay_on_the_device_and_are_ordered_for_a_reader_stream():
    """A CUDA publish copies on the device in the publisher's stream order; a reader on another stream sees the
    published values (its stream waits for the copies), not a later in-place update, and a newer publish dropping
    the copies does not hand their memory to other work while the reader's copies are queued."""
    sync = InProcessWeightSync()
    big = torch.randn(4096, 4096, device="cuda")
    expected = big.clone()
    sync.publish({"w": big}, 1)
    big.mul_(3.0)  # the next optimizer step, queued after the publish on the same stream
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        torch.cuda._sleep(50_000_000)  # the reader's stream is busy: its copy runs well after the publish
        version, got = sync.latest()
        assert got["w"].device.type == "cuda" and got["w"].data_ptr() != big.data_ptr()
        into = torch.empty_like(got["w"]).copy_(got["w"])
    del got
    sync.publish({"w": big}, 2)  # drops version 1's copy while the reader's copy may still be queued
    scratch = [torch.full((4096, 4096), -1.0, device="cuda") for _ in range(4)]  # would reuse a freed block
    reader.synchronize()
    assert version == 1 and torch.equal(into, expected)
    assert torch.equal(sync.latest()[1]["w"], big) and len(scratch) == 4
