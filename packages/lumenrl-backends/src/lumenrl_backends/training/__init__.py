"""Training backends: FSDP2 (default) and Megatron-Core (probe only in this release)."""

from lumenrl_backends.training.schedules import SCHEDULES, LRSchedule, build_lr_scheduler, lr_multiplier

__all__ = ["SCHEDULES", "LRSchedule", "build_lr_scheduler", "lr_multiplier"]
