"""Fully asynchronous RL training for LumenRL: staleness control and weight sync."""

from lumenrl_async.__about__ import __version__
from lumenrl_async.channel import ProcessChannel
from lumenrl_async.queue import AccountingError, SampleGroup, SampleQueue, lag_of, versions_metrics
from lumenrl_async.staleness import StalenessConfig, StalenessController
from lumenrl_async.weight_sync import FilesystemWeightSync, InProcessWeightSync, SnapshotError

__all__ = [
    "__version__",
    "InProcessWeightSync",
    "FilesystemWeightSync",
    "SnapshotError",
    "AccountingError",
    "ProcessChannel",
    "SampleGroup",
    "SampleQueue",
    "lag_of",
    "versions_metrics",
    "StalenessConfig",
    "StalenessController",
]
