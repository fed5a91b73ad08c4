"""RayController over 2 CPU actors (runs only where ray is importable)."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from lumenrl_backends.controllers.ray import RayController  # noqa: E402
from lumenrl_core.data_proto import DataProto  # noqa: E402


def test_ray_actors_follow_the_dispatch_modes():
    class Rank:
        def __init__(self) -> None:
            import os

            self.rank = int(os.environ["RANK"])
            self.world = int(os.environ["WORLD_SIZE"])

        def double(self, batch):
            return DataProto.from_dict(
                tensors={"y": batch.batch["x"] * 2, "r": torch.full((len(batch),), self.rank)}
            )

        def whoami(self):
            return (self.rank, self.world)

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        controller = RayController(num_cpus_per_worker=1)
        group = controller.spawn(Rank, 2, name="toy")
        x = torch.randn(3, 2)
        out = group.call("double", DataProto.from_dict(tensors={"x": x}))
        assert torch.equal(out.batch["y"], x * 2) and out.batch["r"].tolist() == [0, 0, 1]
        assert group.call("whoami", dispatch="one_to_all") == [(0, 2), (1, 2)]
        assert group.call("whoami", dispatch="rank_zero") == (0, 2)
    finally:
        ray.shutdown()
