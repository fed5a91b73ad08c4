"""Online SDDD during RL: after each weight sync, the rollout engine's draft trains on the step's own
rollouts, with hidden states captured by the engine under the *new* policy weights, so the draft keeps up
with the policy (``policy.rollout.speculative.online_sddd_steps`` steps, ``online_sddd_lr``).

The optimizer lives on the engine (``engine.sddd_optimizer``, created on first use); the draft trains in
the engine's dtype. Metrics: ``sddd/online_loss`` (last step), ``sddd/online_steps``, ``timing/online_sddd_s``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lumenrl_backends.engines.speculative import capture_hidden
from lumenrl_backends.trainers.sddd import draft_loss

__all__ = ["online_sddd"]


def online_sddd(engine: Any, batch: Any, spec: Any) -> dict[str, float]:
    draft = getattr(engine, "draft", None)
    if draft is None or spec.online_sddd_steps == 0 or len(batch) == 0:
        return {}
    start = time.perf_counter()
    capture = capture_hidden(engine, batch.batch["input_ids"], batch.batch["attention_mask"], draft.layer_ids)
    dtype = next(draft.parameters()).dtype
    capture = {k: (v.to(engine.device, dtype) if v.is_floating_point() else v.to(engine.device)) for k, v in capture.items()}
    optimizer = getattr(engine, "sddd_optimizer", None)
    if optimizer is None:
        optimizer = engine.sddd_optimizer = torch.optim.AdamW(
            [p for p in draft.parameters() if p.requires_grad], lr=spec.online_sddd_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(engine.weight_version)
    draft.train()
    try:
        for _ in range(spec.online_sddd_steps):
            with torch.enable_grad():
                loss, _ = draft_loss(draft, capture, generator)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
    finally:
        draft.eval()
    return {"sddd/online_loss": float(loss.detach()), "sddd/online_steps": float(spec.online_sddd_steps),
            "timing/online_sddd_s": time.perf_counter() - start}
