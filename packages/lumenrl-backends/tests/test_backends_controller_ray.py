"""RayController: every dispatch mode over a group of Ray actors (uneven batches, padding)."""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray")

from lumenrl_backends.controllers.dispatch import register  # noqa: E402
from lumenrl_backends.controllers.ray import RayController  # noqa: E402
from lumenrl_core.data_proto import DataProto  # noqa: E402


def rank_class():
    """Defined in a function so Ray ships it by value (test modules are not importable in workers)."""

    class Rank:
        def __init__(self) -> None:
            import os

            self.rank = int(os.environ["RANK"])
            self.world = int(os.environ["WORLD_SIZE"])

        @register(dispatch="dp_compute_proto")
        def double(self, batch):
            rows = torch.full((len(batch),), self.rank)
            return DataProto.from_dict(tensors={"y": batch.batch["x"] * 2, "r": rows})

        def apply(self, fn, batch):
            return DataProto.from_dict(tensors={"y": fn(batch.batch["x"])})

        @register(dispatch="dp_compute_metric")
        def stats(self, batch):
            return {"sum": float(batch.batch["x"].sum()), "rows": len(batch), "tag": f"r{self.rank}"}

        @register(dispatch="one_to_all")
        def whoami(self, suffix=""):
            return f"{self.rank}/{self.world}{suffix}"

        def add(self, a, b=0):
            return self.rank * 100 + a + b

        def tensors(self, batch):
            return batch.batch["x"][:, 0], {"r": torch.full((len(batch),), self.rank)}

    return Rank


@pytest.fixture(scope="module")
def group(ray_cluster):
    controller = RayController(num_cpus_per_worker=1)
    g = controller.spawn(rank_class(), 2, name="toy")
    yield g
    controller.shutdown(g)


def test_dp_compute_proto_pads_uneven_batches_and_unpads(group):
    x = torch.randn(5, 2, dtype=torch.float64)
    out = group.call("double", DataProto.from_dict(tensors={"x": x}))  # declared: dp_compute_proto
    assert torch.equal(out.batch["y"], x * 2)
    assert out.batch["r"].tolist() == [0, 0, 0, 1, 1]  # 5 rows padded to 6: 3 + 3, the pad row dropped
    first, by_rank = group.call("tensors", DataProto.from_dict(tensors={"x": x}), dispatch="dp_compute_proto")
    assert torch.equal(first, x[:, 0]) and by_rank["r"].tolist() == [0, 0, 0, 1, 1]


def test_dp_compute_proto_with_func_ships_the_function(group):
    x = torch.randn(3, 4, dtype=torch.float64)
    out = group.call("apply", torch.tanh, DataProto.from_dict(tensors={"x": x}), dispatch="dp_compute_proto_with_func")
    assert torch.allclose(out.batch["y"], torch.tanh(x), atol=0, rtol=0)


def test_dp_compute_metric_reduces_per_rank_dicts(group):
    x = torch.arange(7.0, dtype=torch.float64)[:, None]  # 7 rows -> 8: rank 0 rows 0..3, rank 1 rows 4..6 + row 0
    out = group.call("stats", DataProto.from_dict(tensors={"x": x}))
    assert out["sum"] == pytest.approx(((0 + 1 + 2 + 3) + (4 + 5 + 6 + 0)) / 2)
    assert out["rows"] == 4 and out["tag"] == "r0"


def test_per_rank_and_broadcast_modes(group):
    assert group.call("whoami") == ["0/2", "1/2"]  # declared one_to_all
    assert group.call("whoami", "!", dispatch="broadcast") == ["0/2!", "1/2!"]  # legacy alias
    assert group.call("add", [1, 2], b=[10, 20], dispatch="dp_compute") == [11, 122]
    assert group.call("add", [3, 4], dispatch="all_to_all") == [3, 104]
    assert group.call("add", 5, dispatch="rank_zero") == 5
    with pytest.raises(ValueError, match="one value per rank"):
        group.call("add", [1, 2, 3], dispatch="dp_compute")
    with pytest.raises(ValueError, match="direct_rollout_method.*refused"):
        group.call("add", 1, dispatch="direct_rollout_method")


@pytest.mark.parametrize(("address", "env", "want"), [
    ("", {}, "0"),  # a Ray it may start: its workers (the run's roles) at the driver's priority
    ("", {"RAY_worker_niceness": "7"}, "7"),  # the user's choice wins
    ("ray://head:10001", {}, None),  # an existing cluster: its own settings
    ("", {"RAY_ADDRESS": "head:6379"}, None),
])
def test_a_ray_the_controller_starts_runs_its_workers_unniced(monkeypatch, address, env, want):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    started = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.update(kwargs, niceness=os.environ.get("RAY_worker_niceness")))  # noqa: SIM112 - Ray spells it so
    RayController(address=address)
    assert started["address"] == (address or None) and started["niceness"] == want
