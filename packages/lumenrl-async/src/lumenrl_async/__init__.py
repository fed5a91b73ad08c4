"""Fully asynchronous RL training for LumenRL: staleness control, partial rollout, weight sync."""

from lumenrl_async.__about__ import __version__

__all__ = ["__version__"]
