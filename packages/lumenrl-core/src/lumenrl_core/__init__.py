"""Core of LumenRL: DataProto, config, plugin registry, strict assembly, RL algorithm math, rewards, datasets, metrics."""

from lumenrl_core.__about__ import __version__

__all__ = ["__version__"]
