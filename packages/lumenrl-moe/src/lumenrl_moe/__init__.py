"""MoE rollout routing replay (R3) for LumenRL."""

from lumenrl_moe.__about__ import __version__

__all__ = ["__version__"]
