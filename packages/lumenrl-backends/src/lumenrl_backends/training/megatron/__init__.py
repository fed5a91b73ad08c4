"""Megatron-Core training backend: see :mod:`.backend` (seam), :mod:`.families` (HF<->Megatron
conversion), :mod:`.sharding` (which rank holds which slice), :mod:`.parallel` (process groups,
gradient reductions), :mod:`.model` (GPTModel construction), :mod:`.vocab_parallel` (log-probs from
TP-split logits), :mod:`.pipeline` (Megatron's schedule), :mod:`.weights` (export, checkpoints)."""

from lumenrl_backends.training.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
