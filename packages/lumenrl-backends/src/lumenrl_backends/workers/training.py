"""Actor, reference and critic workers: a training backend behind dispatch-annotated methods.

Each worker is rank-local (one per process / Ray actor) and wraps one backend
(``FSDP2Backend`` by default). Inputs and outputs are DataProtos so ``dp_compute_proto`` can
split and concatenate them (a chunk split over W > 1 ranks is marked as that rank's shard, so
the backend does not slice it again); updates return metric dicts for ``dp_compute_metric``;
collective methods (checkpoints, export, weight streaming) run on every rank (``one_to_all``).
Under torchrun each process's group holds its one worker, the batch arrives whole and the
backend takes its own DP slice.

Output keys follow the batch contract: ``old_log_probs`` (+ ``entropys``), ``ref_log_probs``,
``values``, each (B, T) float32. The log-prob temperature is ``batch.meta_info["temperature"]``
(default 1.0), the same key the backend's ``train_step`` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lumenrl_backends.controllers.dispatch import register
from lumenrl_core.data_proto import DataProto

__all__ = ["ActorWorker", "RefWorker", "CriticWorker"]


def _backend_cls(name: str | None):
    if name is None:
        from lumenrl_backends.training.fsdp2 import FSDP2Backend

        return FSDP2Backend
    return name


class _TrainingWorker:
    role = "actor"

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @classmethod
    def from_config(cls, cfg: Any, *, model_path: str, backend_cls: Any = None):
        return cls(_backend_cls(backend_cls).from_config(cfg, role=cls.role, model_path=model_path))

    @register(dispatch="one_to_all")
    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        self.backend.save_checkpoint(path, extra=extra)

    @register(dispatch="one_to_all")
    def load_checkpoint(self, path: str) -> dict:
        return self.backend.load_checkpoint(path)


class ActorWorker(_TrainingWorker):
    """The policy: old log-probs, PPO updates, weight streaming, HF export, SFT warm start."""

    role = "actor"

    @register(dispatch="dp_compute_proto")
    def compute_log_prob(self, batch: DataProto, with_entropy: bool = False) -> DataProto:
        temperature = float(batch.meta_info.get("temperature", 1.0))
        log_probs, entropy = self.backend.compute_log_probs(
            batch, temperature=temperature, with_entropy=with_entropy
        )
        tensors = {"old_log_probs": log_probs}
        flips = getattr(getattr(self.backend, "routes", None), "last_flips", None)
        if flips is not None:  # R3: tokens whose live routes differ from the replayed ones (B, P+T)
            tensors["route_flips"] = flips
        if entropy is not None:
            tensors["entropys"] = entropy
        return DataProto.from_dict(tensors=tensors)

    @register(dispatch="dp_compute_proto")
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """The reference of a LoRA policy: this actor's base, adapters disabled (no second model copy)."""
        from lumenrl_backends.training.lora import AdapterFreeReference

        temperature = float(batch.meta_info.get("temperature", 1.0))
        log_probs, _ = AdapterFreeReference(self.backend).compute_log_probs(batch, temperature=temperature)
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})

    @register(dispatch="dp_compute_metric")
    def update_actor(self, batch: DataProto, loss_fn: Callable) -> dict[str, float]:
        """PPO epochs over this rank's shard; metrics are already all-reduced by the backend."""
        return self.backend.train_step(batch, loss_fn)

    @register(dispatch="one_to_all")
    def sft_step(self, batch: DataProto, lr: float | None = None) -> dict[str, float]:
        return self.backend.sft_step(batch, lr=lr)

    @register(dispatch="one_to_all")
    def named_weights(self) -> list[tuple[str, Any]]:
        return list(self.backend.named_weights())

    @register(dispatch="one_to_all")
    def save_hf(self, path: str, tokenizer: Any = None) -> None:
        self.backend.save_hf(path, tokenizer=tokenizer)


class RefWorker(_TrainingWorker):
    """The frozen reference policy for the KL term."""

    role = "ref"

    @register(dispatch="dp_compute_proto")
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        temperature = float(batch.meta_info.get("temperature", 1.0))
        log_probs, _ = self.backend.compute_log_probs(batch, temperature=temperature)
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})


class CriticWorker(_TrainingWorker):
    """The value model (HF backbone + scalar value head)."""

    role = "critic"

    @register(dispatch="dp_compute_proto")
    def compute_values(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"values": self.backend.compute_values(batch)})

    @register(dispatch="dp_compute_metric")
    def update_critic(self, batch: DataProto, loss_fn: Callable) -> dict[str, float]:
        return self.backend.train_step(batch, loss_fn)
