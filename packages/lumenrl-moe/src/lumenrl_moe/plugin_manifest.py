"""lumenrl-moe's routers as :class:`~lumenrl_core.plugins.PluginSpec`: the entry points in
``pyproject.toml`` name these (one spec per router family, registered under each HF ``model_type``
it serves), so listing and planning them imports no torch. Each class reads its ``capabilities``
from here and its ``probe()`` returns its spec's ``unavailable_reason()``.
"""

from __future__ import annotations

from lumenrl_core.plugins import PluginSpec

__all__ = ["SOFTMAX_TOPK", "SIGMOID_GROUP_TOPK"]

_R3 = {"route_recording", "route_replay"}

# lumenrl.moe_routers: pure tensor math, runnable everywhere
SOFTMAX_TOPK = PluginSpec("lumenrl_moe.routers:SoftmaxTopKRouter", _R3)  # qwen3_moe, mixtral
SIGMOID_GROUP_TOPK = PluginSpec("lumenrl_moe.routers:SigmoidGroupTopKRouter", _R3)  # deepseek_v3, glm4_moe
