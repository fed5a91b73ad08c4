"""Rollout engines: ``native`` (embedded), ``hf`` (transformers.generate) and library adapters."""

from lumenrl_backends.engines.native import NativeEngine
from lumenrl_backends.engines.options import KernelOptions
from lumenrl_backends.engines.sampling import SamplingParams, coerce_sampling

__all__ = ["KernelOptions", "NativeEngine", "SamplingParams", "coerce_sampling"]
