"""Every dispatch mode over toy worker groups of 2-4 fake ranks (plain objects with a rank id)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumenrl_backends.controllers import (
    DISPATCH_MODES,
    LocalController,
    WorkerGroup,
    normalize_dispatch,
    reduce_metrics,
    register,
)
from lumenrl_backends.controllers.ray import RayController
from lumenrl_core.data_proto import DataProto


class FakeRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[int] = []

    def double(self, batch: DataProto, *, offset: float = 0.0) -> DataProto:
        """Returns a DataProto stamped with the rank that computed each row."""
        self.seen.append(len(batch))
        rows = len(batch)
        return DataProto.from_dict(
            tensors={"y": batch.batch["x"] * 2 + offset, "rank": torch.full((rows,), self.rank)},
            non_tensors={"tag": np.array([f"r{self.rank}"] * rows, dtype=object)},
        )

    def log_probs(self, batch: DataProto):
        return batch.batch["x"] + self.rank * 0, None

    def apply(self, fn, batch: DataProto) -> torch.Tensor:
        return fn(batch.batch["x"], self.rank)

    def metrics(self, batch: DataProto) -> dict:
        return {"loss": float(batch.batch["x"].sum()), "rank": self.rank, "name": f"w{self.rank}"}

    def whoami(self, suffix: str = "") -> str:
        return f"rank{self.rank}{suffix}"

    def add(self, a: int, b: int = 0) -> int:
        return self.rank * 100 + a + b

    @register(dispatch="one_to_all")
    def ping(self) -> int:
        return self.rank

    @register(dispatch="rank_zero")
    def save(self, path: str) -> str:
        return f"{path}@{self.rank}"


def group(n: int) -> WorkerGroup:
    return WorkerGroup([FakeRank(r) for r in range(n)], name="toy", controller=LocalController())


def proto(rows: int) -> DataProto:
    x = torch.randn(rows, 3)
    return DataProto.from_dict(tensors={"x": x}, non_tensors={"id": np.arange(rows)}, meta_info={"step": 1})


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_dp_compute_proto_pads_splits_concats_and_unpads(world, rows):
    g, batch = group(world), proto(rows)
    out = g.call("double", batch, offset=0.5)  # default mode
    assert len(out) == rows
    assert torch.equal(out.batch["y"], batch.batch["x"] * 2 + 0.5)
    per_rank = -(-rows // world)  # padded rows split evenly
    assert [w.seen for w in g] == [[per_rank]] * world
    expected_rank = (torch.arange(rows) // per_rank).long()
    assert torch.equal(out.batch["rank"].long(), expected_rank)
    assert list(out.non_tensor_batch["tag"]) == [f"r{r}" for r in expected_rank.tolist()]


def test_dp_compute_proto_collects_tuples_of_tensors_and_none():
    batch = proto(7)
    lp, ent = LocalController().call(group(3), "log_probs", batch, dispatch="dp_compute_proto")
    assert torch.equal(lp, batch.batch["x"]) and ent is None


def test_dp_compute_gives_each_rank_its_element():
    assert group(3).call("add", [1, 2, 3], b=[10, 20, 30], dispatch="dp_compute") == [11, 122, 233]
    with pytest.raises(ValueError, match="one value per rank"):
        group(3).call("add", [1, 2], dispatch="dp_compute")
    with pytest.raises(ValueError, match="one value per rank"):
        group(2).call("add", 5, dispatch="dp_compute")


def test_dp_compute_proto_with_func_sends_the_function_to_every_rank():
    batch = proto(6)
    out = group(3).call("apply", lambda x, rank: x * 0 + rank, batch, dispatch="dp_compute_proto_with_func")
    assert torch.equal(out[:, 0], torch.tensor([0.0, 0, 1, 1, 2, 2]))
    with pytest.raises(ValueError, match="function as the first argument"):
        group(2).call("apply", batch, dispatch="dp_compute_proto_with_func")


def test_dp_compute_metric_means_numeric_values_over_ranks():
    batch = proto(4)
    x = batch.batch["x"]
    metrics = group(2).call("metrics", batch, dispatch="dp_compute_metric")
    assert metrics["loss"] == pytest.approx((float(x[:2].sum()) + float(x[2:].sum())) / 2, rel=1e-6)
    assert metrics["rank"] == 0.5 and metrics["name"] == "w0"


def test_reduce_metrics_handles_missing_keys_and_scalar_tensors():
    out = reduce_metrics([{"a": 1.0, "b": torch.tensor(4.0)}, {"a": 3.0}, {"a": 5, "flag": True}])
    assert out == {"a": 3.0, "b": 4.0, "flag": True}


def test_one_to_all_and_broadcast_alias_give_every_rank_the_same_arguments():
    g = group(4)
    assert g.call("whoami", "!", dispatch="one_to_all") == ["rank0!", "rank1!", "rank2!", "rank3!"]
    assert g.call("whoami", suffix="?", dispatch="broadcast") == ["rank0?", "rank1?", "rank2?", "rank3?"]
    assert normalize_dispatch("broadcast") == "one_to_all"


def test_all_to_all_maps_per_rank_lists():
    assert group(2).call("whoami", ["a", "b"], dispatch="all_to_all") == ["rank0a", "rank1b"]


def test_rank_zero_runs_on_rank_zero_only():
    g = group(3)
    assert g.call("double", proto(2), dispatch="rank_zero").batch["rank"].tolist() == [0, 0]
    assert [w.seen for w in g] == [[2], [], []]


def test_declared_dispatch_modes_are_the_default():
    g = group(3)
    assert g.call("ping") == [0, 1, 2]
    assert g.call("save", "/ckpt") == "/ckpt@0"


def test_refused_and_unknown_modes_name_the_allowed_ones():
    with pytest.raises(ValueError, match="direct_rollout_method.*refused.*dp_compute_proto"):
        group(2).call("ping", dispatch="direct_rollout_method")
    with pytest.raises(ValueError, match="dispatch='scatter'.*one_to_all"):
        group(2).call("ping", dispatch="scatter")
    with pytest.raises(AttributeError, match="no method 'missing'"):
        group(2).call("missing", dispatch="one_to_all")
    with pytest.raises(ValueError, match="empty list"):
        WorkerGroup([])
    assert len(DISPATCH_MODES) == 7


def test_mismatched_dataproto_lengths_are_refused():
    with pytest.raises(ValueError, match="different lengths"):
        group(2).call("double", proto(3), offset=proto(4))


def test_local_controller_plugin_surface():
    assert LocalController.probe() is None
    assert isinstance(LocalController.from_config(None), LocalController)
    assert "dispatch_modes" in LocalController.capabilities


def test_ray_probe_matches_importability():
    try:
        import ray  # noqa: F401
    except ImportError:
        assert "ray is not installed" in RayController.probe()
    else:
        assert RayController.probe() is None


class MetaRank(FakeRank):
    def meta(self, batch: DataProto) -> dict:
        return {"split": batch.meta_info.get("dispatch_dp_size", 0), "step": batch.meta_info["step"]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_split_chunks_are_marked_as_shards_without_touching_the_caller(world):
    g = WorkerGroup([MetaRank(r) for r in range(world)], controller=LocalController())
    batch = proto(6)
    metrics = g.call("meta", batch, dispatch="dp_compute_metric")
    assert metrics == {"split": float(world if world > 1 else 0), "step": 1.0}
    assert g.call("meta", batch, dispatch="one_to_all") == [{"split": 0, "step": 1}] * world
    assert "dispatch_dp_size" not in batch.meta_info
