"""Rollout worker: one engine replica behind ``dp_compute_proto``, and the data-parallel clients.

Data-parallel rollout splits the rows of a generation call over R replicas (rows are contiguous,
so whole groups stay on one replica when the group count divides evenly; uneven shards are padded
by the dispatch and the padding rows dropped). Results do not depend on R: before the split every
row gets its own sampling seed ``seed + global row index`` (the ``sampling_seed`` column the
engine reads), and the native engine's sampler draws from (row seed, position) only, so a row
samples the same tokens on any replica. Each replica right-pads its responses to
``max_new_tokens`` so shards concatenate; the client trims the columns no row uses, giving the
layout a single engine would have returned.

:class:`GroupRollout` drives a worker group (Ray replicas, colocated or in their own pool);
:class:`RankShardedRollout` is the torchrun form: each rank generates its shard with its own
engine and the shards are all-gathered, so every rank trains on the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from lumenrl_backends.controllers.dispatch import plan_dispatch, register
from lumenrl_core.data_proto import DataProto

__all__ = ["RolloutWorker", "GroupRollout", "RankShardedRollout", "with_row_seeds", "trim_responses"]

SEED_COLUMN = "sampling_seed"


def with_row_seeds(batch: DataProto, seed: int | None) -> DataProto:
    """A shallow copy of ``batch`` whose rows carry ``sampling_seed = seed + row`` (unless set)."""
    out = batch[:]
    if seed is not None and SEED_COLUMN not in out.non_tensor_batch:
        out.non_tensor_batch[SEED_COLUMN] = np.arange(len(out), dtype=np.int64) + int(seed)
    return out


def trim_responses(batch: DataProto) -> DataProto:
    """Drop trailing response columns that no row uses (mask all 0) from every (B, P+T)/(B, T) key."""
    mask = batch.batch["response_mask"]
    T = mask.shape[1]
    used = int(mask.any(0).nonzero().max().item()) + 1 if mask.any() else 0
    cut = T - used
    batch.non_tensor_batch.pop(SEED_COLUMN, None)
    if cut == 0:
        return batch
    for key, t in list(batch.batch.items()):
        if t.dim() >= 2 and key != "prompts" and t.shape[1] >= T:
            batch.batch[key] = t[:, : t.shape[1] - cut]
    return batch


def _pad_responses(out: DataProto, width: int, pad_token_id: int) -> DataProto:
    from lumenrl_backends.trainers.rollout import _align

    return _align(out, out.batch["prompts"].shape[1], width, pad_token_id)


class RolloutWorker:
    """One rollout engine replica (the engine holds its own copy of the policy)."""

    role = "rollout"

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    @classmethod
    def from_config(cls, cfg: Any, *, model_path: str, engine_cls: Any) -> RolloutWorker:
        from lumenrl_backends.models import load_model_and_tokenizer
        from lumenrl_backends.training import distributed as dist_utils

        model, tokenizer = load_model_and_tokenizer(
            model_path, dtype=cfg.policy.dtype, device=dist_utils.resolve_device(cfg.cluster.device),
            tokenizer_name=cfg.policy.tokenizer_name, trust_remote_code=cfg.policy.trust_remote_code,
        )
        return cls(engine_cls.from_config(cfg, model=model, tokenizer=tokenizer), tokenizer)

    @register(dispatch="dp_compute_proto")
    def generate(self, batch: DataProto, sampling: Mapping[str, Any]) -> DataProto:
        out = self.engine.generate(batch, dict(sampling))
        width = int(sampling.get("max_new_tokens") or out.batch["responses"].shape[1])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = _pad_responses(out, max(width, out.batch["responses"].shape[1]), pad)
        out.meta_info = {k: v for k, v in out.meta_info.items() if not isinstance(v, torch.Tensor)}
        return out

    @register(dispatch="one_to_all")
    def release_memory(self) -> int:
        """Free the engine's KV cache (and CUDA graphs captured on it) while training runs.

        The cache is lazily re-allocated by the next prefill. Returns the bytes freed."""
        cache, freed = getattr(self.engine, "cache", None), 0
        for layer in getattr(cache, "layers", []):
            if getattr(layer, "is_initialized", False):
                freed += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
                del layer.keys, layer.values
                layer.is_initialized = False
        graphs = getattr(self.engine, "graphs", None)
        if freed and graphs is not None and hasattr(graphs, "graphs"):
            graphs.graphs.clear()
        if freed and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return freed

    @register(dispatch="one_to_all")
    def weight_version(self) -> int:
        return int(getattr(self.engine, "weight_version", -1))


class GroupRollout:
    """Data-parallel rollout over a worker group of :class:`RolloutWorker` (any controller)."""

    def __init__(self, group: Any, *, release: bool = False, dispatch: str = "dp_compute_proto") -> None:
        self.group = group
        self.release = release
        self.dispatch = dispatch  # controller.ray.roles.rollout.dispatch_mode: dp_compute_proto or rank_zero

    @property
    def replicas(self) -> int:
        return self.group.world_size

    def generate(self, batch: DataProto, sampling: Mapping[str, Any]) -> DataProto:
        params = dict(sampling)
        rows = with_row_seeds(batch, params.get("seed"))
        return trim_responses(self.group.call("generate", rows, params, dispatch=self.dispatch))

    def release_memory(self) -> dict[str, float]:
        if not self.release:
            return {}
        freed = self.group.call("release_memory")
        return {"rollout/kv_cache_freed_gb": sum(freed) / 1e9}


class RankShardedRollout:
    """torchrun form: rank r generates shard r with its own engine; shards are all-gathered."""

    def __init__(self, engine: Any, *, pad_token_id: int, rank: int, world: int,
                 gather: Callable[[Any], list[Any]] | None = None) -> None:
        self.engine = engine
        self.pad_token_id = pad_token_id
        self.rank, self.world = rank, world
        self.gather = gather or _all_gather_object

    @property
    def replicas(self) -> int:
        return self.world

    def generate(self, batch: DataProto, sampling: Mapping[str, Any]) -> DataProto:
        params = dict(sampling)
        rows = with_row_seeds(batch, params.get("seed"))
        plan = plan_dispatch("dp_compute_proto", (rows,), {}, self.world)
        out = self.engine.generate(plan.calls[self.rank].args[0], params)
        width = max(int(params.get("max_new_tokens") or 0), out.batch["responses"].shape[1])
        out = _pad_responses(out, width, self.pad_token_id)
        out.meta_info = {k: v for k, v in out.meta_info.items() if not isinstance(v, torch.Tensor)}
        shards = self.gather({"batch": {k: v.cpu() for k, v in out.batch.items()}, "non_tensor": out.non_tensor_batch,
                              "meta": out.meta_info, "rows": len(out)})
        parts = [DataProto(s["batch"], s["non_tensor"], s["meta"], batch_size=s["rows"]) for s in shards]
        return trim_responses(plan.collect(parts))

    def release_memory(self) -> dict[str, float]:
        return {}


def _all_gather_object(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
