"""lumenrl-core's plugins as :class:`~lumenrl_core.plugins.PluginSpec`: the entry points in
``pyproject.toml`` name these, so listing and planning them imports no torch. Each class reads its
``capabilities`` from here and its ``probe()`` returns its spec's ``unavailable_reason()``.
"""

from __future__ import annotations

from lumenrl_core.plugins.spec import PluginSpec

__all__ = ["GRPO", "DRGRPO", "RLOO", "GAE", "PPO_CLIP", "MATH", "COUNTDOWN"]

_ADVANTAGES = "lumenrl_core.algorithms.advantages"

# lumenrl.advantage_estimators: pure tensor math, runnable everywhere
GRPO = PluginSpec(f"{_ADVANTAGES}:GRPOAdvantage")
DRGRPO = PluginSpec(f"{_ADVANTAGES}:DrGRPOAdvantage")
RLOO = PluginSpec(f"{_ADVANTAGES}:RLOOAdvantage")
GAE = PluginSpec(f"{_ADVANTAGES}:GAEAdvantage", requires={"critic"})  # the critic's values (B, T)

# lumenrl.policy_losses
PPO_CLIP = PluginSpec("lumenrl_core.algorithms.policy_loss:PPOClipLoss")

# lumenrl.rewards: string matching, runnable everywhere
MATH = PluginSpec("lumenrl_core.rewards:MathReward")
COUNTDOWN = PluginSpec("lumenrl_core.rewards:CountdownReward")
