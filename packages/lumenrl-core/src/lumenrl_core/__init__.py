"""Core of LumenRL: DataProto, config, plugin registry, strict assembly, RL algorithm math, rewards, datasets, metrics."""

from lumenrl_core.__about__ import __version__
from lumenrl_core.data_proto import DataProto

__all__ = [
    "__version__",
    "DataProto",
]
