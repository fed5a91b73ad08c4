"""Weight sync: the trained policy -> the rollout engine, once per step.

Colocated (one process), the engine keeps its own copy of the model and
``engine.update_weights(named_tensors, version)`` copies the actor's full (unsharded) tensors
into it in place; an FP8/MX rollout engine re-quantizes inside ``update_weights``. The version
is the training step whose update produced the weights, so every rollout batch records the
policy version that generated it (``meta_info["weight_version"]``).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["sync_weights"]


def sync_weights(actor: Any, engine: Any, version: int) -> dict[str, float]:
    """Push ``actor.named_weights()`` into ``engine`` as ``version``; returns timing metrics."""
    start = time.perf_counter()
    engine.update_weights(actor.named_weights(), int(version))
    return {"timing/sync_s": time.perf_counter() - start, "weight_sync/version": float(version)}
