"""Core of LumenRL: DataProto, config, plugin registry, strict assembly, RL algorithm math, rewards, datasets.

``DataProto`` (and with it torch) is imported on first use, so that config commands
(``lumenrl config show``, ``lumenrl --version``) start without importing torch.
"""

from typing import Any

from lumenrl_core.__about__ import __version__
from lumenrl_core.config import ConfigError, RunConfig, config_to_dict, dump_config, load_config

__all__ = [
    "__version__",
    "DataProto",
    "RunConfig",
    "load_config",
    "dump_config",
    "config_to_dict",
    "ConfigError",
]


def __getattr__(name: str) -> Any:
    if name == "DataProto":
        from lumenrl_core.data_proto import DataProto

        return DataProto
    raise AttributeError(f"module 'lumenrl_core' has no attribute {name!r}")
