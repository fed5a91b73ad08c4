"""Low-precision library for RL: FP8 / MXFP8 / MXFP4 rollout, FP8 KV cache, FP8 training, TIS/MIS rollout correction. Depends on torch only."""

from lumenrl_quant.__about__ import __version__

__all__ = ["__version__"]
