"""The algorithm and reward plugins as the rest of LumenRL sees them: entry points, keyword
construction from config fields, DataProto in and (B, T) tensors out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumenrl_core.algorithms import grpo_outcome_advantage
from lumenrl_core.assembly.plan import build_with_keywords
from lumenrl_core.config.schema import AlgorithmConfig
from lumenrl_core.data_proto import DataProto
from lumenrl_core.plugins import PluginRegistry
from lumenrl_core.protocols import AdvantageEstimator, PluginClass, PolicyLoss, RewardFn
from lumenrl_core.rewards import scores_to_token_level

PLUGINS = {
    "advantage_estimators": ("grpo", "drgrpo", "rloo", "gae"),
    "policy_losses": ("ppo_clip",),
    "rewards": ("math", "countdown"),
}


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, names in PLUGINS.items() for n in names])
def test_entry_points_resolve_to_plugin_classes(kind, name):
    cls = PluginRegistry().load(kind, name)
    assert isinstance(cls, PluginClass) and cls.capabilities == frozenset() and cls.probe() is None
    algo = AlgorithmConfig(adv_estimator=name, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-sum-norm")
    instance = build_with_keywords(cls, {f: getattr(algo, f) for f in algo.__slots__} | {"format_score": 0.1})
    protocol = {"advantage_estimators": AdvantageEstimator, "policy_losses": PolicyLoss, "rewards": RewardFn}[
        kind
    ]
    assert isinstance(instance, protocol)
    if name == "ppo_clip":
        assert (instance.clip_ratio_high, instance.loss_agg_mode) == (0.28, "seq-mean-token-sum-norm")


def test_grpo_step_on_a_data_proto():
    """Reward -> token-level scores -> GRPO advantages -> PPO-clip loss, on a real DataProto."""
    g = torch.Generator().manual_seed(0)
    n, prompts, t = 4, 3, 6
    lengths = torch.randint(1, t + 1, (n * prompts,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    truths = ["19", "7", "100"]
    responses = [["19", "18", "x", "19"], ["7", "7", "7", "7"], ["1,00", "100", "99", "100.0"]]
    flat = [r for group in responses for r in group]
    extra = [{"ground_truth": truths[i // n]} for i in range(n * prompts)]
    reward = PluginRegistry().load("rewards", "math")(format_score=0.0)
    scores = reward(["p"] * len(flat), flat, extra)
    batch = DataProto.from_dict(
        {"response_mask": mask, "token_level_rewards": scores_to_token_level(scores, mask)},
        {"uid": np.array([f"u{i // n}" for i in range(n * prompts)], dtype=object)},
    )
    adv, returns = PluginRegistry().load("advantage_estimators", "grpo")(norm_adv_by_std=True)(batch)
    assert adv.shape == (n * prompts, t) and torch.all(adv[mask == 0] == 0)
    assert torch.all(adv[4:8] == 0)  # the all-correct group has no signal
    ref, _ = grpo_outcome_advantage(
        batch.batch["token_level_rewards"], mask, list(batch.non_tensor_batch["uid"])
    )
    torch.testing.assert_close(adv, ref)
    assert adv[0, 0] > 0 > adv[1, 0]  # correct beats wrong within a group
    log_probs = -torch.rand(n * prompts, t, generator=g)
    loss_fn = PluginRegistry().load("policy_losses", "ppo_clip")()
    loss, metrics = loss_fn(log_probs.requires_grad_(True), log_probs.detach(), adv, mask)
    loss.backward()
    assert metrics["actor/clip_frac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0
    # on-policy: d loss / d logp = -A / N_tok on valid tokens
    torch.testing.assert_close(log_probs.grad, -adv * mask / mask.sum())
