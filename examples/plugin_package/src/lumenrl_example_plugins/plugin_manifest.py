"""The plugins of lumenrl-example-plugins as torch-free :class:`~lumenrl_core.plugins.PluginSpec`:
``lumenrl plugins`` and ``lumenrl config check`` read these without importing the classes.

``capabilities``: what a plugin offers a config (none of these needs to offer any: no config
setting demands a capability of an estimator or a reward). ``requires``: run features the plugin
needs the config to provide; strict assembly refuses a config that lacks one.
"""

from __future__ import annotations

from lumenrl_core.plugins import PluginSpec

__all__ = ["RANK", "MC_VALUE", "CONCISE"]

_ADVANTAGES = "lumenrl_example_plugins.advantages"

# lumenrl.advantage_estimators
RANK = PluginSpec(f"{_ADVANTAGES}:RankAdvantage")  # critic-free: group ranks of the outcome scores
MC_VALUE = PluginSpec(f"{_ADVANTAGES}:MonteCarloValueAdvantage", requires={"critic"})  # the critic's values

# lumenrl.rewards: the penalty counts characters beyond the bare answer the arithmetic task asks for
CONCISE = PluginSpec("lumenrl_example_plugins.rewards:ConciseReward", requires={"task:arithmetic"})
