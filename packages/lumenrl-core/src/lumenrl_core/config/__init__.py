"""The typed run configuration and its loader.

``load_config(path, overrides)`` reads a YAML file (with ``defaults:`` inheritance) and dotted
``key=value`` overrides into a validated :class:`RunConfig`; every problem is a one-line
:class:`ConfigError`. ``dump_config`` writes YAML that loads back to an equal config.

    cfg = load_config("configs/grpo_dense_bf16.yaml", ["policy.optim.lr=1e-6"])
    print(dump_config(cfg))
"""

from lumenrl_core.config.errors import ConfigError, ConfigProblems
from lumenrl_core.config.loader import (
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
    validate_config,
)
from lumenrl_core.config.schema import (
    AlgorithmConfig,
    AssemblyConfig,
    AsyncTrainingConfig,
    CheckpointingConfig,
    ClusterConfig,
    ControllerConfig,
    CriticConfig,
    DatasetConfig,
    EvalConfig,
    LoggerConfig,
    MoEConfig,
    OptimConfig,
    PolicyConfig,
    PolicyTrainConfig,
    QuantizationConfig,
    R3Config,
    RayConfig,
    RewardConfig,
    RolloutCorrectionConfig,
    RolloutQuantConfig,
    RunConfig,
    SamplingConfig,
    TrainerConfig,
    TrainingQuantConfig,
    WeightSyncConfig,
)

__all__ = [
    "ConfigError",
    "ConfigProblems",
    "load_config",
    "config_from_dict",
    "validate_config",
    "config_to_dict",
    "dump_config",
    "parse_override",
    "RunConfig",
    "ClusterConfig",
    "PolicyConfig",
    "OptimConfig",
    "PolicyTrainConfig",
    "SamplingConfig",
    "AlgorithmConfig",
    "RewardConfig",
    "DatasetConfig",
    "QuantizationConfig",
    "RolloutQuantConfig",
    "TrainingQuantConfig",
    "RolloutCorrectionConfig",
    "MoEConfig",
    "R3Config",
    "CriticConfig",
    "CheckpointingConfig",
    "LoggerConfig",
    "WeightSyncConfig",
    "AsyncTrainingConfig",
    "ControllerConfig",
    "RayConfig",
    "AssemblyConfig",
    "TrainerConfig",
    "EvalConfig",
]
