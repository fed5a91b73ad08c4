"""Weight sync: the trained policy -> the rollout engine, once per step.

Colocated (one process), the engine keeps its own copy of the model; the actor's full tensors
are streamed into it in place, a bucket at a time (:func:`lumenrl_backends.sync.sync_to_engine`,
``weight_sync.bucket_size_mb``); an FP8/MX rollout engine re-quantizes inside
``update_weights``. The version is the training step whose update produced the weights, so
every rollout batch records the policy version that generated it
(``meta_info["weight_version"]``).
"""

from __future__ import annotations

from typing import Any

from lumenrl_backends.sync.inprocess import sync_to_engine

__all__ = ["sync_weights"]


def sync_weights(actor: Any, engine: Any, version: int, *, bucket_size_mb: int = 512) -> dict[str, float]:
    """Push the actor's weights into ``engine`` as ``version``; returns sync metrics."""
    stats = sync_to_engine(actor, engine, int(version), bucket_bytes=int(bucket_size_mb) << 20)
    return {
        "timing/sync_s": stats.seconds,
        "weight_sync/version": float(stats.version),
        "weight_sync/tensors": float(stats.tensors),
        "weight_sync/gb": stats.bytes_read / 1e9,
    }
