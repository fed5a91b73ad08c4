"""The SFT warm-start step of the training backends (a mixin of :class:`~.fsdp2.FSDP2Backend`, inherited by
the Megatron backend): token-mean next-token cross-entropy with its own AdamW, data-parallel rows.

The loss is HF's logits + ``cross_entropy`` on an unsharded vocabulary (the demo's warm start), or, where the
logits are split (context parallel, Megatron's vocab-parallel output), the RL log-prob forward of the labels
as a "response": the same sum, reduced where the shards are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.batching import dp_slice_bounds, pad_rows, position_ids_from_mask
from lumenrl_backends.training.modeling import set_training

__all__ = ["SFTSteps"]


class SFTSteps:
    """``sft_step`` for a backend with the FSDP2 backend's attributes (model, optimizer builder, dp ranks)."""

    def _sft_uses_log_probs(self) -> bool:
        """The loss through the log-prob forward (split logits) instead of HF's full logits."""
        return self.dims.cp > 1

    def sft_step(self, batch: Any, *, lr: float | None = None) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on ``labels`` (-100 ignored).

        Uses its own AdamW (``lr``, default the policy lr; constant) so the RL optimizer state
        and LR schedule are untouched by a warm start.
        """
        self._check_trainable()
        if self.is_critic:
            raise RuntimeError("sft_step needs an LM head; the critic backend has a value head instead")
        if self._sft_optimizer is None:
            self._sft_optimizer = self._build_optimizer(lr if lr is not None else self.optim_cfg.lr)
        if lr is not None:
            for group in self._sft_optimizer.param_groups:
                group["lr"] = lr
        set_training(self.model, True)
        tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "labels")}
        tensors, pad = pad_rows(tensors, self.dp_size)
        if pad:  # padded copies must not count
            tensors["labels"][-pad:] = -100
        lo, hi = dp_slice_bounds(tensors["input_ids"].shape[0], self.dp_rank, self.dp_size)
        local = {k: v[lo:hi].to(self.device) for k, v in tensors.items()}
        n_tokens = dist_utils.all_reduce_sum(float((local["labels"][:, 1:] != -100).sum()), self.device, self.dp_group)
        collected: dict[str, list[float]] = defaultdict(list)
        self._zero_grad(self._sft_optimizer)
        total_loss = self._sft_accumulate(local, max(n_tokens, 1.0))
        self._clip_and_step(self._sft_optimizer, None, collected, "sft")
        return {
            "sft/loss": dist_utils.all_reduce_sum(dist_utils.as_float(total_loss), self.device, self.dp_group),
            "sft/grad_norm": dist_utils.as_float(collected["sft/grad_norm"][0]),
            "sft/lr": collected["sft/lr"][0],
            "sft/tokens": n_tokens,
        }

    def _sft_accumulate(self, local: Mapping[str, torch.Tensor], n_tokens: float) -> Any:
        """Forward and backward every micro-batch of this rank's SFT rows; returns the summed loss."""
        micro = max(self.train_cfg.micro_batch_size, 1)
        starts = list(range(0, local["input_ids"].shape[0], micro))
        total_loss = 0.0
        for i, s in enumerate(starts):
            self._grad_sync(i == len(starts) - 1)
            loss = self._sft_loss({k: v[s : s + micro] for k, v in local.items()}) / n_tokens
            self._backward(loss)
            total_loss += loss.detach()
        return total_loss

    def _sft_loss(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Summed next-token cross-entropy over the micro-batch's valid labels. Under context parallel: the
        sharded forward's gathered log-probs of ``labels[:, 1:]`` as a (b, L-1) "response" (same sum)."""
        labels = micro["labels"][:, 1:]  # (b, L-1)
        position_ids = position_ids_from_mask(micro["attention_mask"])
        if self._sft_uses_log_probs():
            inputs = {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"],
                      "position_ids": position_ids, "responses": labels.clamp(min=0)}
            log_probs, _ = self._forward_padded(inputs, 1.0, with_entropy=False)  # (b, L-1)
            return -(log_probs * (labels != -100)).sum()
        out = self.model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], position_ids=position_ids,
                         use_cache=False)
        logits = out.logits[:, :-1].float()  # (b, L-1, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
