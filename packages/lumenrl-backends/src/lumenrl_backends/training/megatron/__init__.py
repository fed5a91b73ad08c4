"""Megatron-Core training backend: see :mod:`.backend` (seam), :mod:`.families` (HF<->Megatron
conversion), :mod:`.model` (GPTModel construction, process groups)."""

from lumenrl_backends.training.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
