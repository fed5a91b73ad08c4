"""Transfer engines: in-process, POSIX shared memory (across processes), Mooncake (when installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from lumenrl_core.config.schema import RunConfig
from lumenrl_core.protocols import TransferEngine
from lumenrl_sddd import (
    InProcessTransferEngine,
    MooncakeTransferEngine,
    SharedMemoryTransferEngine,
    namespace_of,
)


def hidden_states(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_low": torch.randn(2, 5, 16, generator=g).to(torch.bfloat16),
        "hidden_high": torch.randn(2, 5, 16, generator=g),
        "input_ids": torch.randint(0, 100, (2, 5), generator=g),
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture
def shm():
    engine = SharedMemoryTransferEngine(f"t{uuid.uuid4().hex[:12]}")
    yield engine
    engine.close()


def test_inprocess_roundtrip_copy_and_missing():
    engine = InProcessTransferEngine()
    assert isinstance(engine, TransferEngine)
    tensors = hidden_states(0)
    engine.put("step0/rank0", tensors)
    tensors["hidden_high"].zero_()
    assert_same(engine.get("step0/rank0"), hidden_states(0))
    assert engine.keys() == ["step0/rank0"]
    assert_same(engine.pop("step0/rank0"), hidden_states(0))
    with pytest.raises(KeyError, match="'step0/rank0' not found"):
        engine.get("step0/rank0")


def test_shm_roundtrip_replace_pop(shm):
    assert isinstance(shm, TransferEngine)
    shm.put("k", hidden_states(1))
    assert_same(shm.get("k"), hidden_states(1))
    shm.put("k", hidden_states(2))  # replacing a key
    assert_same(shm.get("k"), hidden_states(2))
    assert_same(shm.pop("k"), hidden_states(2))
    with pytest.raises(KeyError, match=f"'k' not found in shared-memory namespace '{shm.namespace}'"):
        shm.get("k")


def test_shm_close_frees_unconsumed(shm):
    shm.put("a", {"x": torch.ones(3)})
    other = SharedMemoryTransferEngine(shm.namespace)
    assert torch.equal(other.get("a")["x"], torch.ones(3))
    shm.close()
    with pytest.raises(KeyError):
        other.get("a")


def test_shm_namespace_validation_and_from_config():
    with pytest.raises(ValueError, match=r"namespace='bad/name'"):
        SharedMemoryTransferEngine("bad/name")
    cfg = RunConfig()
    cfg.trainer.experiment_name = "sddd-llama 8b"
    assert namespace_of(cfg) == "lumenrl_sddd_llama_8b"
    assert SharedMemoryTransferEngine.from_config(cfg).namespace == "lumenrl_sddd_llama_8b"
    assert SharedMemoryTransferEngine.probe() is None


CHILD = """
import sys, torch
from lumenrl_sddd import SharedMemoryTransferEngine
engine = SharedMemoryTransferEngine(sys.argv[1])
got = engine.pop("from_parent")
engine.put("from_child", {k: v * 2 for k, v in got.items()})
g = torch.Generator().manual_seed(7)
engine.put("child_only", {"h": torch.randn(4, 8, generator=g)})
"""


def test_shm_across_processes(shm):
    shm.put("from_parent", hidden_states(3))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), shm.namespace],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "leaked shared_memory" not in result.stderr  # the child's exit did not unlink or warn
    doubled = shm.pop("from_child")  # written by a process that has exited
    expected = {k: v * 2 for k, v in hidden_states(3).items()}
    assert_same(doubled, expected)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(shm.pop("child_only")["h"], torch.randn(4, 8, generator=g))
    with pytest.raises(KeyError):
        shm.get("from_parent")  # the child consumed it


def test_mooncake_probe_reports_reason_or_none(monkeypatch):
    reason = MooncakeTransferEngine.probe()
    assert reason is None or "mooncake" in reason
    monkeypatch.setattr(MooncakeTransferEngine, "probe", classmethod(lambda cls: "module 'mooncake.engine' is not installed"))
    with pytest.raises(RuntimeError, match="MooncakeTransferEngine unavailable: module 'mooncake.engine' is not installed"):
        MooncakeTransferEngine()


class _FakeMooncake:
    """Stand-in for ``mooncake.engine.TransferEngine`` (one address space for every engine of the
    process): exercises the index logic where Mooncake is not installed."""

    memory: dict[int, bytearray] = {}
    _next = [4096]

    def initialize(self, hostname, metadata_server, protocol, device_name):
        return 0

    def get_rpc_port(self):
        return 12345

    def allocate_managed_buffer(self, length):
        addr, self._next[0] = self._next[0], self._next[0] + length + 64
        self.memory[addr] = bytearray(length)
        return addr

    def write_bytes_to_buffer(self, addr, payload, length):
        self.memory[addr][:length] = payload
        return 0

    def transfer_sync_read(self, session, local, remote, length):
        self.memory[local][:length] = self.memory[remote][:length]
        return 0

    def read_bytes_from_buffer(self, addr, length):
        return bytes(self.memory[addr][:length])

    def free_managed_buffer(self, addr, length):
        del self.memory[addr]


@pytest.fixture
def fake_mooncake(monkeypatch):
    import types

    package, engine = types.ModuleType("mooncake"), types.ModuleType("mooncake.engine")
    engine.TransferEngine, package.engine = _FakeMooncake, engine
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    monkeypatch.setattr(MooncakeTransferEngine, "probe", classmethod(lambda cls: None))


def test_mooncake_namespace_counts_with_index_dir(tmp_path, fake_mooncake):
    """Two runs sharing one ``index_dir`` under different namespaces never read each other's keys."""
    run_a = MooncakeTransferEngine(index_dir=tmp_path, namespace="run_a")
    run_b = MooncakeTransferEngine(index_dir=tmp_path, namespace="run-b.2")
    try:
        assert run_a.index_dir == tmp_path / "run_a" and run_b.index_dir == tmp_path / "run-b.2"
        run_a.put("hs", hidden_states(6))
        run_b.put("hs", hidden_states(7))
        assert_same(MooncakeTransferEngine(index_dir=tmp_path, namespace="run_a").get("hs"), hidden_states(6))
        assert_same(MooncakeTransferEngine(index_dir=tmp_path, namespace="run-b.2").pop("hs"), hidden_states(7))
        assert_same(run_a.get("hs"), hidden_states(6))  # run_b's pop left run_a's key alone
        with pytest.raises(KeyError, match="'hs' not found in mooncake index"):
            MooncakeTransferEngine(index_dir=tmp_path).get("hs")  # the default namespace: its own directory
    finally:
        run_a.close()
        run_b.close()
    cfg = RunConfig()
    cfg.trainer.output_dir, cfg.trainer.experiment_name = str(tmp_path / "out"), "exp 1"
    engine = MooncakeTransferEngine.from_config(cfg)
    assert engine.namespace == namespace_of(cfg) and engine.index_dir == tmp_path / "out" / "mooncake_index" / namespace_of(cfg)
    assert MooncakeTransferEngine.index_path(None, "run_a").name == "lumenrl_mooncake_run_a"  # no index_dir: as before


@pytest.mark.parametrize("namespace", ["", "../escape", "a/b", ".", "..", ".hidden", "x" * 129])
def test_mooncake_namespace_is_one_path_component(tmp_path, namespace):
    """Refused before Mooncake's availability is checked: no index outside ``index_dir``."""
    with pytest.raises(ValueError, match=r"namespace=.*expected 1-128 characters from \[A-Za-z0-9_.-\]"):
        MooncakeTransferEngine(index_dir=tmp_path, namespace=namespace)


needs_mooncake = pytest.mark.skipif(MooncakeTransferEngine.probe() is not None,
                                    reason=f"mooncake unavailable: {MooncakeTransferEngine.probe()}")

MOONCAKE_CHILD = """
import sys, torch
from lumenrl_sddd import MooncakeTransferEngine
engine = MooncakeTransferEngine(index_dir=sys.argv[1])
got = engine.get("hs")
print(float(got["hidden_high"].double().sum()), got["hidden_low"].dtype)
"""


@needs_mooncake
def test_mooncake_roundtrip_in_process_and_across(tmp_path):
    producer = MooncakeTransferEngine(index_dir=tmp_path)
    consumer = MooncakeTransferEngine(index_dir=tmp_path)
    try:
        producer.put("hs", hidden_states(4))
        assert_same(consumer.get("hs"), hidden_states(4))
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(MOONCAKE_CHILD), str(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        total, dtype = result.stdout.split()[-2:]
        assert float(total) == float(hidden_states(4)["hidden_high"].double().sum()) and dtype == "torch.bfloat16"
        producer.put("hs", hidden_states(5))
        assert_same(consumer.pop("hs"), hidden_states(5))
        with pytest.raises(KeyError, match="'hs' not found in mooncake index"):
            consumer.get("hs")
    finally:
        producer.close()
        consumer.close()
