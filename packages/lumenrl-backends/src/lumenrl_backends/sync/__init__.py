"""Trainer -> rollout-engine weight sync: in process (streamed, in place) and across processes."""

from lumenrl_backends.sync.filesystem import apply_latest_snapshot, publish_snapshot
from lumenrl_backends.sync.inprocess import SyncStats, sync_to_engine, trainer_weights

__all__ = ["SyncStats", "apply_latest_snapshot", "publish_snapshot", "sync_to_engine", "trainer_weights"]
