"""Fully asynchronous RL training for LumenRL: staleness control and weight sync.

Public names are imported from their modules on first use (PEP 562), so ``import lumenrl_async`` and
its torch-free :mod:`lumenrl_async.plugin_manifest` (what the plugin registry reads) import no torch.
"""

from __future__ import annotations

from lumenrl_async.__about__ import __version__ as __version__
from lumenrl_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the public names it defines
    "weight_sync": ("InProcessWeightSync", "FilesystemWeightSync", "SnapshotError"),
    "queue": ("AccountingError", "LAG_FROM", "SampleGroup", "SampleQueue", "lag_of", "versions_metrics"),
    "channel": ("ProcessChannel", "Outbox", "deliver"),
    "collective": ("CollectiveWeightSync", "CollectiveReader", "WeightReceiveError"),
    "staleness": ("StalenessConfig", "StalenessController"),
}
__all__, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
