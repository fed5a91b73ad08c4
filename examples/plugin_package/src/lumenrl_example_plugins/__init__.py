"""Example LumenRL plugins shipped by a separate distribution (``lumenrl-example-plugins``).

Selected by name in a run config once installed: ``algorithm.adv_estimator: rank`` (or
``mc_value`` with ``critic.enabled: true``) and ``reward.name: concise``. Importing this package
imports no torch; the classes load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

from lumenrl_example_plugins.__about__ import __version__

__all__ = [
    "__version__",
    "RankAdvantage",
    "MonteCarloValueAdvantage",
    "ConciseReward",
    "rank_outcome_advantage",
    "mc_value_advantage",
    "concise_score",
]

_EXPORTS = {
    "RankAdvantage": "lumenrl_example_plugins.advantages",
    "MonteCarloValueAdvantage": "lumenrl_example_plugins.advantages",
    "rank_outcome_advantage": "lumenrl_example_plugins.advantages",
    "mc_value_advantage": "lumenrl_example_plugins.advantages",
    "ConciseReward": "lumenrl_example_plugins.rewards",
    "concise_score": "lumenrl_example_plugins.rewards",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lumenrl_example_plugins' has no attribute {name!r}")
