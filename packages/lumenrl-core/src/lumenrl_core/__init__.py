"""Core of LumenRL: DataProto, config, plugin registry, strict assembly, RL algorithm math, rewards, datasets."""

from lumenrl_core.__about__ import __version__
from lumenrl_core.config import ConfigError, RunConfig, config_to_dict, dump_config, load_config
from lumenrl_core.data_proto import DataProto

__all__ = [
    "__version__",
    "DataProto",
    "RunConfig",
    "load_config",
    "dump_config",
    "config_to_dict",
    "ConfigError",
]
