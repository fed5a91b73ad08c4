"""Whole tensors out of a sharded GPTModel (export, engine sync) and its DCP checkpoint state.

:class:`GatheredWeights` is a read-only mapping from the *full* Megatron names of
:mod:`.sharding` to whole float32 tensors, gathered when read: on the owning pipeline stage the
TP slices are all-gathered over the TP group and merged (:func:`~.sharding.tp_merge`), an expert
is all-gathered over the EP group, then the owning stage broadcasts the tensor over the pipeline
group. Collective: every rank must read the same names in the same order (the family adapter's
``to_hf`` does, so ``to_hf(config, GatheredWeights(...))`` streams HF tensors on every rank, one
at a time).

:class:`CheckpointState` is the ``torch.distributed.checkpoint`` tree of the model and its AdamW
state under full names, for :mod:`..checkpoint`: TP slices are DTensors ``Shard(dim)`` over a
mesh made from Megatron's TP group (``linear_fc1`` saved as its ``.gate`` and ``.up`` halves, so
each half is a plain row shard), replicated tensors are plain (DCP keeps one copy), pipeline
stages and EP ranks own distinct names. Loading reshards the TP slices (a tp = 2 checkpoint
reloads at tp = 1, tested); pp and ep must match the saved run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lumenrl_backends.training.megatron.parallel import ParallelGroups
from lumenrl_backends.training.megatron.sharding import RankCoords, global_name, placement, tp_merge

__all__ = ["CheckpointState", "GatheredWeights"]

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


class GatheredWeights(Mapping):
    """Full Megatron tensors by full name (see the module docstring); ``shapes`` lists every name."""

    def __init__(self, gpt: nn.Module, coords: RankCoords, groups: ParallelGroups,
                 shapes: Mapping[str, torch.Size], device: torch.device) -> None:
        self.local = {k: v for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        self.coords, self.groups, self.shapes, self.device = coords, groups, shapes, device

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def _on_owner(self, name: str) -> torch.Tensor:
        p, g = placement(name, self.coords), self.groups
        local = self.local[p.local_name].detach()
        if p.split is not None and g.tp > 1:
            local = tp_merge(_all_gather(local, g.tp_group), p.split)
        if p.expert_rank is not None and g.ep > 1:
            local = _all_gather(local, g.ep_group)[p.expert_rank]
        return local

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        stage = placement(name, self.coords).stage
        full = self._on_owner(name) if stage == self.groups.pp_rank else None
        if self.groups.pp == 1:
            return full
        if full is None:
            full = torch.empty(self.shapes[name], dtype=torch.float32, device=self.device)
        full = full.contiguous()
        dist.broadcast(full, src=self.groups.stage_rank(stage), group=self.groups.pp_group)
        return full


class CheckpointState:
    """Model + AdamW state as a DCP tree under full names (see the module docstring)."""

    def __init__(self, gpt: nn.Module, optimizer: torch.optim.Optimizer | None, coords: RankCoords,
                 groups: ParallelGroups, shapes: Mapping[str, torch.Size]) -> None:
        self.gpt, self.optimizer, self.coords, self.groups, self.shapes = gpt, optimizer, coords, groups, shapes
        self._tp_mesh = None

    def _mesh(self):
        if self._tp_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            device_type = next(self.gpt.parameters()).device.type
            self._tp_mesh = DeviceMesh.from_group(self.groups.tp_group, device_type)
        return self._tp_mesh

    def _entries(self, local_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{checkpoint key: tensor or DTensor} for one local tensor of the shape of a model weight."""
        name = global_name(local_name, self.coords)
        split, full = self._split_and_shape(name)
        if split is None or self.groups.tp == 1:
            halves = tensor.chunk(2) if split == "swiglu" else None
            return {name: tensor} if halves is None else {f"{name}.gate": halves[0], f"{name}.up": halves[1]}
        from torch.distributed.tensor import DTensor, Shard

        def shard(key: str, part: torch.Tensor, dim: int, rows: int) -> tuple[str, Any]:
            shape = list(part.shape)
            shape[dim] = rows
            return key, DTensor.from_local(part, self._mesh(), [Shard(dim)], run_check=False,
                                           shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

        if split == "cols":
            return dict([shard(name, tensor, 1, full[1])])
        if split == "rows":
            return dict([shard(name, tensor, 0, full[0])])
        gate, up = tensor.chunk(2)
        return dict([shard(f"{name}.gate", gate, 0, full[0] // 2), shard(f"{name}.up", up, 0, full[0] // 2)])

    def _split_and_shape(self, name: str) -> tuple[str | None, torch.Size | None]:
        if name in self.shapes:
            return placement(name, self.coords).split, self.shapes[name]
        if name == "output_layer.weight":  # the last stage's copy of a tied embedding (pp > 1)
            return "rows", self.shapes["embedding.word_embeddings.weight"]
        return None, None

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.gpt.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        for name, tensor in self.gpt.state_dict().items():
            if isinstance(tensor, torch.Tensor):
                model.update(self._entries(name, tensor))
        state: dict[str, Any] = {"model": model}
        if self.optimizer is not None:
            optim: dict[str, Any] = {}
            for name, param in self._params():
                slot = self.optimizer.state.get(param, {})
                for key in _ADAM_KEYS:
                    value = slot.get(key, torch.zeros_like(param))
                    optim.update({f"{key}/{k}": v for k, v in self._entries(name, value).items()})
                step = slot.get("step", torch.zeros(()))
                optim[f"step/{global_name(name, self.coords)}"] = torch.as_tensor(step, dtype=torch.float32).cpu()
            state["optim"] = optim
            state["optim_lr"] = torch.tensor([float(g["lr"]) for g in self.optimizer.param_groups], dtype=torch.float64)
        return state

    @staticmethod
    def _local(value: Any) -> torch.Tensor:
        return value.to_local() if hasattr(value, "to_local") else value

    def _gathered_local(self, tree: Mapping[str, Any], local_name: str, prefix: str = "") -> torch.Tensor:
        """The local tensor of ``local_name`` back from its checkpoint entries (swiglu halves re-joined)."""
        name = global_name(local_name, self.coords)
        if f"{prefix}{name}.gate" in tree:
            return torch.cat([self._local(tree[f"{prefix}{name}.gate"]), self._local(tree[f"{prefix}{name}.up"])])
        return self._local(tree[f"{prefix}{name}"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy what ``dcp.load`` filled into :meth:`state_dict`'s tree back into the model and optimizer."""
        with torch.no_grad():
            for name, tensor in self.gpt.state_dict().items():
                if isinstance(tensor, torch.Tensor):
                    tensor.copy_(self._gathered_local(state["model"], name))
        if self.optimizer is None:
            return
        optim, slots = state["optim"], {}
        for index, (name, _) in enumerate(self._params()):
            slots[index] = {key: self._gathered_local(optim, name, f"{key}/") for key in _ADAM_KEYS}
            slots[index]["step"] = optim[f"step/{global_name(name, self.coords)}"]
        saved = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": slots, "param_groups": saved["param_groups"]})
        for group, lr in zip(self.optimizer.param_groups, state["optim_lr"].tolist()):
            group["lr"] = lr
