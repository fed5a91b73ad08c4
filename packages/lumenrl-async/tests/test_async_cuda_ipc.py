"""CUDA IPC weight sync (GPU): a reader process racing the writer never applies a torn snapshot."""

from __future__ import annotations

import pytest
import torch

from lumenrl_async.cuda_ipc import CudaIpcReader, CudaIpcWeightSync

pytestmark = pytest.mark.gpu


def _weights(v: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((1024, 1024), float(v), device="cuda"), "b": torch.full((4096,), float(v), device="cuda")}


class _Engine:
    def __init__(self) -> None:
        self.weight_version, self.store = -1, {}

    def update_weights(self, tensors, version):
        self.store = {k: t.clone() for k, t in tensors.items()}
        self.weight_version = version


def _reader(handle, out) -> None:
    reader, engine, seen = CudaIpcReader(handle), _Engine(), []
    while not seen or seen[-1] < 40:
        version = reader.load_into(engine)
        if version is None or (seen and version == seen[-1]):
            continue
        values = {float(t.unique().item()) for t in engine.store.values() if t.unique().numel() == 1}
        torn = any(t.unique().numel() != 1 for t in engine.store.values()) or values != {float(version)}
        seen.append(version)
        out.put((version, torn))
    out.put(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reader_process_never_keeps_a_torn_snapshot():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    sync = CudaIpcWeightSync()
    sync.publish(_weights(0), 0)
    out = ctx.Queue()
    proc = ctx.Process(target=_reader, args=(sync.reader_handle(), out))
    proc.start()
    _publish_and_check(sync, out, proc)


def _publish_and_check(sync: CudaIpcWeightSync, out, proc) -> None:
    """Publish versions 1..40 while the reader process reads; it must never keep a torn snapshot, see the
    versions in order and end on the last."""
    for v in range(1, 41):
        sync.publish(_weights(v), v)
    got = []
    while (item := out.get(timeout=120)) is not None:
        got.append(item)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and got and not any(torn for _, torn in got)
    versions = [v for v, _ in got]
    assert versions == sorted(versions) and versions[-1] == 40


def _late_reader(conn, out) -> None:
    _reader(conn.recv(), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reader_spawned_before_the_first_publish_gets_the_handle_through_a_pipe():
    """The async trainer spawns its rollouter before it publishes: the handle (IPC buffers and the
    seqlock) arrives in the start message, through a pipe, not as a spawn argument."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    out = ctx.Queue()
    proc = ctx.Process(target=_late_reader, args=(child, out))
    proc.start()
    sync = CudaIpcWeightSync()
    sync.publish(_weights(0), 0)
    parent.send(sync.reader_handle())
    _publish_and_check(sync, out, proc)
