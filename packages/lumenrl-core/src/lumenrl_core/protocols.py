"""The seams of LumenRL: one ``typing.Protocol`` per plugin kind.

Plugins in other distributions satisfy these structurally (no inheritance, no import of core
needed: ``lumenrl-quant`` never imports ``lumenrl_core``). Every plugin *class* also carries two
class-level attributes:

- ``capabilities: frozenset[str]`` -- what it can do (``fp8_weights``, ``route_recording``, ...);
- ``probe() -> str | None`` (a classmethod or staticmethod) -- ``None`` when it can run here,
  otherwise a one-line reason (library missing, namesake package, no GPU, wrong GPU arch).

LumenRL's own plugins declare both in a torch-free :class:`~lumenrl_core.plugins.PluginSpec` that
their entry point names and the registry reads without importing the class; the class reads them
from that spec (decision 0019). An entry point may also name the class itself.

Batches crossing a seam are ``DataProto`` objects (see :mod:`lumenrl_core.data_proto`).
Tensor shapes use B = batch rows, T = response tokens, P = prompt tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "PluginClass",
    "RolloutEngine",
    "TrainingBackend",
    "AdvantageEstimator",
    "PolicyLoss",
    "RolloutCorrection",
    "RewardFn",
    "WeightSync",
    "TransferEngine",
    "Controller",
    "Logger",
]


@runtime_checkable
class PluginClass(Protocol):
    """What the registry needs from any registered plugin class."""

    capabilities: frozenset[str]

    @classmethod
    def probe(cls) -> str | None:
        """``None`` if usable here, else the reason it is not."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of prompts.

    ``generate`` takes a DataProto with ``input_ids`` (B, P) left-padded and ``attention_mask``
    (B, P) and returns one with ``responses`` (B, T) right-padded, ``response_mask`` (B, T),
    ``rollout_log_probs`` (B, T) float32 and, where capable, ``routed_experts`` and hidden states.
    """

    capabilities: frozenset[str]

    def generate(self, batch: Any, sampling: Mapping[str, Any]) -> Any: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def interrupt(self) -> None: ...

    def resume(self) -> None: ...


@runtime_checkable
class TrainingBackend(Protocol):
    """Owns a (sharded) model and its optimizer."""

    capabilities: frozenset[str]

    def compute_log_probs(self, batch: Any) -> torch.Tensor: ...

    def train_step(self, batch: Any, loss_fn: Callable[..., Any]) -> dict[str, float]: ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


@runtime_checkable
class AdvantageEstimator(Protocol):
    """``(batch) -> (advantages, returns)``, both (B, T), zero outside the response mask."""

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PolicyLoss(Protocol):
    """``(log_probs, old_log_probs, advantages, mask, is_weights) -> (loss, metrics)``.

    The trainer also passes the keywords ``global_tokens`` / ``global_seqs`` (the mini-batch totals) and, where
    ``__call__`` names it, ``sync_metrics=False``: the metrics may then be 0-dim device tensors, which the
    backend reads back once per optimizer step instead of once per micro-batch. Floats are always accepted.
    """

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]: ...


@runtime_checkable
class RolloutCorrection(Protocol):
    """``(old_log_probs, rollout_log_probs, mask) -> (is_weights, keep_mask, metrics)``."""

    def __call__(
        self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]: ...


@runtime_checkable
class RewardFn(Protocol):
    """``(prompts, responses, extra) -> scores``: one float per row."""

    def __call__(self, prompts: list[str], responses: list[str], extra: list[dict]) -> list[float]: ...


@runtime_checkable
class WeightSync(Protocol):
    """The trainer ``publish``es ``(named_tensors, version)`` (versions strictly increase); the
    rollout side reads the newest with ``latest()`` (``None`` before the first publish)."""

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None: ...

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None: ...


@runtime_checkable
class TransferEngine(Protocol):
    """Named tensors by key from a producer to a consumer (SDDD teacher hidden states); ``get`` of
    a missing key raises ``KeyError``."""

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def get(self, key: str) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class Controller(Protocol):
    """Runs ``method`` on the ranks of a worker group; ``dispatch`` names how the arguments are split
    and the results collected (``dp_compute_proto``: DataProtos chunked per rank, concatenated back)."""

    def call(self, group: Any, method: str, *args: Any, dispatch: str = "dp_compute_proto", **kwargs: Any) -> Any: ...


@runtime_checkable
class Logger(Protocol):
    """Writes namespaced metrics (``rollout_correction/is_ratio_mean``, ...) at a step."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...
