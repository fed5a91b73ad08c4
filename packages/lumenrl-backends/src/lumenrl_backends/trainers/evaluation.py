"""Greedy evaluation on a fixed held-out prompt set.

The eval prompts are drawn once (``eval.num_examples``, a seed disjoint from training) and
kept, so every evaluation of a run scores the same questions. Generation uses
``eval.temperature`` (0 = greedy) with the run's response length; a row counts as correct
when its reward reaches ``correct_score`` (1.0 for the bundled verifiable rewards).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lumenrl_backends.trainers.rollout import generate
from lumenrl_backends.trainers.scoring import Scorer
from lumenrl_core.data_proto import DataProto

__all__ = ["Evaluator"]


@dataclass(kw_only=True, slots=True)
class Evaluator:
    """Scores the policy (through the rollout engine) on ``prompts``; see the module docstring."""

    prompts: DataProto
    scorer: Scorer
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    correct_score: float = 1.0

    def __call__(self, engine: Any) -> dict[str, float]:
        start = time.perf_counter()
        sampling = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}
        batch = generate(engine, self.prompts[:], sampling, self.seed)
        mask = batch.batch["response_mask"]
        raw = torch.as_tensor(self.scorer.raw_rewards(batch)[1], dtype=torch.float32)
        return {
            "eval/accuracy": (raw >= self.correct_score).float().mean().item(),
            "eval/reward_mean": raw.mean().item(),
            "eval/response_length_mean": mask.float().sum(dim=-1).mean().item(),
            "eval/num_examples": float(len(batch)),
            "timing/eval_s": time.perf_counter() - start,
        }
