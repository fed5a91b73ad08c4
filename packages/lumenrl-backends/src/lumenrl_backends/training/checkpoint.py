"""Atomic, sharded training checkpoints for FSDP2 models.

Layout of a checkpoint directory::

    PATH/
      model_optim/            torch.distributed.checkpoint (DCP) of {"model", "optim"}:
                              every rank writes its own shards; reshardable across world sizes
      rank_{r}.pt             per-rank RNG states (python, numpy, torch CPU, CUDA) +
                              the LR scheduler state (tensors and plain types only:
                              loaded with weights_only=True)
      extra.json              caller-owned JSON (e.g. the trainer's dataloader position)
      COMPLETE                written last

Fused MoE expert tensors ``*.experts.gate_up_proj`` (E, 2I, H) = [gate; up] are stored as their
(E, 2, I, H) view (model and optimizer state; :func:`~lumenrl_backends.training.expert_parallel.checkpoint_view`):
under tensor parallel each rank holds [gate_t; up_t], not one box of (E, 2I, H), which DCP cannot
save; every layout goes through the same view, so a checkpoint reloads on any other mesh.

A backend whose modules are not laid out for ``get_state_dict`` (Megatron-Core's TP/PP shards) passes
``tree``: a :class:`DcpTree` that makes the ``{"model", "optim"}`` tree and takes it back after loading.

Atomicity: everything is written into ``PATH.tmp``; after a barrier rank 0 moves an existing
``PATH`` aside, renames ``PATH.tmp`` to ``PATH`` and deletes the old one. A reader only
trusts a directory containing ``COMPLETE``. Assumes a filesystem shared by all ranks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lumenrl_backends.training import distributed as dist_utils

__all__ = ["DcpTree", "save_training_state", "load_training_state", "rng_state", "set_rng_state", "is_complete"]

_MARKER = "COMPLETE"


class DcpTree(Protocol):
    """The model/optimizer part of a checkpoint as a DCP state tree (saved, then filled in place by load)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as tensors and plain Python values."""
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_gauss, np_cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    py_state = state["python"]
    random.setstate((py_state[0], tuple(py_state[1]), py_state[2]))
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _MARKER))


def _model_optim_state(model, optimizer) -> dict[str, Any]:
    optims = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optims, options=StateDictOptions())
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


def _stored_layout(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every fused ``gate_up_proj`` tensor (model and optimizer state) as its checkpoint
    view (shares storage: loading into the view fills the original)."""
    from lumenrl_backends.training.expert_parallel import checkpoint_view

    def fused(name: str) -> bool:
        return name.endswith("experts.gate_up_proj")

    out = dict(state)
    out["model"] = {k: checkpoint_view(v) if fused(k) else v for k, v in state["model"].items()}
    if isinstance(state.get("optim"), Mapping) and isinstance(state["optim"].get("state"), Mapping):
        optim_state = {k: ({n: checkpoint_view(t) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
                            for n, t in v.items()} if fused(k) and isinstance(v, Mapping) else v)
                       for k, v in state["optim"]["state"].items()}
        out["optim"] = {**state["optim"], "state": optim_state}
    return out


def _fused_views_stored(checkpoint_id: str) -> bool:
    """False for a checkpoint written before fused ``gate_up_proj`` was stored as its (E, 2, I, H) view
    (3-D entries): it loads as it was saved (on layouts without the tensor-parallel split)."""
    meta = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    sizes = [m.size for k, m in meta.items() if k.endswith("experts.gate_up_proj") and hasattr(m, "size")]
    return not sizes or len(sizes[0]) == 4


def _publish(tmp: str, path: str) -> None:
    """Rank 0: replace ``path`` by ``tmp`` (old copy moved aside, then removed)."""
    with open(os.path.join(tmp, _MARKER), "w") as fh:
        fh.write("ok\n")
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_training_state(
    path: str,
    *,
    model,
    optimizer=None,
    scheduler=None,
    extra: Mapping[str, Any] | None = None,
    files: Callable[[str], None] | None = None,
    tree: DcpTree | None = None,
) -> None:
    """Collective: every rank calls it. Writes ``path`` atomically (see module docstring).

    ``files(tmp_dir)``, when given, runs on rank 0 before publishing: more files that belong to the
    checkpoint (e.g. a LoRA adapter in peft's format) land in it atomically with the rest.
    """
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = dist_utils.rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist_utils.barrier()
    state = tree.state_dict() if tree is not None else _stored_layout(_model_optim_state(model, optimizer))
    dcp.save(state, checkpoint_id=os.path.join(tmp, "model_optim"))
    local = {"rng": rng_state(), "scheduler": scheduler.state_dict() if scheduler is not None else None}
    torch.save(local, os.path.join(tmp, f"rank_{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, "extra.json"), "w") as fh:
            json.dump(dict(extra or {}), fh, indent=1, sort_keys=True)
        if files is not None:
            files(tmp)
    dist_utils.barrier()
    if rank == 0:
        _publish(tmp, path)
    dist_utils.barrier()


def load_training_state(path: str, *, model, optimizer=None, scheduler=None, tree: DcpTree | None = None) -> dict[str, Any]:
    """Collective: restores model, optimizer, scheduler and this rank's RNG; returns ``extra``."""
    path = os.path.abspath(path)
    if not is_complete(path):
        raise FileNotFoundError(f"checkpoint path={path!r} is missing or incomplete (no {_MARKER} marker)")
    state = tree.state_dict() if tree is not None else _model_optim_state(model, optimizer)
    checkpoint_id = os.path.join(path, "model_optim")
    dcp.load(state if tree is not None or not _fused_views_stored(checkpoint_id) else _stored_layout(state),
             checkpoint_id=checkpoint_id)
    if tree is not None:
        tree.load_state_dict(state)
    else:
        optims = [optimizer] if optimizer is not None else []
        set_state_dict(model, optims, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}))
    rank_file = os.path.join(path, f"rank_{dist_utils.rank()}.pt")
    if not os.path.isfile(rank_file):  # resumed with more ranks than saved: reuse rank 0's scheduler
        rank_file = os.path.join(path, "rank_0.pt")
    local = torch.load(rank_file, weights_only=True)
    if scheduler is not None and local["scheduler"] is not None:
        scheduler.load_state_dict(local["scheduler"])
    set_rng_state(local["rng"])
    with open(os.path.join(path, "extra.json")) as fh:
        return json.load(fh)
