"""Per-step metrics: batch statistics, phase timings and throughput.

Names follow the run-output contract: ``response_length/mean``, ``perf/step_s``,
``perf/rollout_tokens_per_s`` (generated tokens / generation wall time),
``perf/train_tokens_per_s`` (prompt + response tokens through the actor update / update wall
time, all PPO epochs), ``timing/<phase>_s`` for every phase of the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from lumenrl_core.data_proto import DataProto

__all__ = ["PhaseTimer", "batch_metrics", "throughput_metrics", "train_tokens"]


class PhaseTimer:
    """Accumulates wall time per named phase: ``with timer("generate"): ...``. Each phase is also a
    ``lumenrl/<phase>`` range in a ``torch.profiler`` trace (a no-op without an active profiler), so a profiled
    step shows where each phase begins and ends."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"lumenrl/{phase}"):
                yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def metrics(self, reported: Mapping[str, float] | None = None) -> dict[str, float]:
        """``timing/<phase>_s`` per phase; given the step's ``reported`` metrics, also ``timing/other_s``: the
        time since the timer started that neither a phase nor a ``timing/*`` key of ``reported`` covers."""
        out = {f"timing/{phase}_s": s for phase, s in self.seconds.items()}
        if reported is not None:
            covered = sum(out.values()) + sum(v for k, v in reported.items() if k.startswith("timing/") and k not in out)
            out["timing/other_s"] = max(0.0, self.elapsed() - covered)
        return out


def batch_metrics(batch: DataProto, max_new_tokens: int) -> dict[str, float]:
    """Response/prompt lengths of the train batch and the share of responses cut at the limit."""
    response_len = batch.batch["response_mask"].float().sum(dim=-1)  # (B,)
    prompt_len = batch.batch["attention_mask"].float().sum(dim=-1) - response_len
    metrics = {
        "response_length/mean": response_len.mean().item(),
        "response_length/max": response_len.max().item(),
        "response_length/min": response_len.min().item(),
        "response_length/clip_ratio": (response_len >= max_new_tokens).float().mean().item(),
        "prompt_length/mean": prompt_len.mean().item(),
        "batch/rows": float(len(batch)),
        "batch/groups": float(len(set(batch.non_tensor_batch["uid"].tolist()))),
    }
    if "finish_reason" in batch.non_tensor_batch:
        reasons = np.asarray(batch.non_tensor_batch["finish_reason"])
        metrics["response_length/stop_frac"] = float(np.mean(reasons == "stop"))
    return metrics


def throughput_metrics(
    *, generated_tokens: int, generate_s: float, train_tokens: int, train_s: float, step_s: float
) -> dict[str, float]:
    return {
        "perf/step_s": step_s,
        "perf/rollout_tokens_per_s": generated_tokens / max(generate_s, 1e-9),
        "perf/train_tokens_per_s": train_tokens / max(train_s, 1e-9),
        "perf/generated_tokens": float(generated_tokens),
    }


def train_tokens(batch: DataProto, epochs: int) -> int:
    """Prompt + response tokens the update processes (all PPO epochs)."""
    return int(batch.batch["attention_mask"].sum().item()) * max(epochs, 1)


def moe_step_metrics(batch: Any) -> dict[str, float]:
    """``moe/*`` of an R3 step (lumenrl_moe.routing_step_metrics): the fed tokens are every valid
    token but each row's last (whose route row is padding)."""
    from lumenrl_moe import routing_step_metrics

    t = batch.batch
    mask = t["attention_mask"].bool()
    last = mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)  # (B, P+T): the last valid token
    fed = mask & ~last
    return routing_step_metrics(
        logp_train=t["old_log_probs"], logp_infer=t["rollout_log_probs"], response_mask=t["response_mask"],
        routes=t["routed_experts"], route_mask=fed, route_flips=t.get("route_flips"),
        num_experts=batch.meta_info.get("num_experts"),
    )
