"""A plugin package made outside LumenRL (examples/plugin_package) is installed for real and used by name.

``pip install --no-deps --target <tmp> examples/plugin_package`` (its dependencies, lumenrl-core and
torch, are this environment's; with hatchling installed here the wheel is built offline), then:
the CLI in a child process with ``PYTHONPATH=<tmp>`` lists its plugins with the package's name and
version and checks configs with them; in this process a fresh registry over ``sys.path + <tmp>``
discovers the same entry points, a two-step GRPO run of the tiny demo model selects the ``rank``
estimator and the ``concise`` reward by name, and what they computed on those rows is checked
against references written here. No file of LumenRL names the package.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lumenrl_core.plugins import PluginRegistry

PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "plugin_package"
CONFIG = PACKAGE / "configs" / "grpo_rank_concise.yaml"
DIST = "lumenrl-example-plugins"
VERSION = "0.1.0"
STEPS = 2
FAST = (f"num_training_steps={STEPS}", "trainer.warm_start_sft_steps=0", "eval.enabled=false",
        "checkpointing.enabled=false", "dataset.train_batch_size=4", "policy.rollout.n=4",
        "policy.train.micro_batch_size=16", "logger.backends=[jsonl]", "logger.progress_bar=false",
        # an untrained model rarely answers right: a well-formed wrong answer scores 0.5, none 0, so the
        # groups hold unequal rewards and the ranks are not all 0
        "reward.format_score=0.5")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory the example distribution is pip-installed into (not on this process's sys.path)."""
    target = tmp_path_factory.mktemp("third-party-site")
    offline = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                           *offline, "--target", str(target), str(PACKAGE)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "lumenrl_example_plugins" / "plugin_manifest.py").is_file()
    return target


def lumenrl(site: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-m", "lumenrl_backends.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_lumenrl_plugins_lists_them_with_package_and_version(site, child_env):
    rows = {}
    for kind in ("advantage_estimators", "rewards"):  # only these kinds: listing probes every plugin listed
        proc = lumenrl(site, child_env, "plugins", "--kind", kind, "--format", "json")
        assert proc.returncode == 0, proc.stderr
        rows.update({(r["kind"], r["name"]): r for r in map(json.loads, proc.stdout.splitlines())})
    ours = {key: row for key, row in rows.items() if row["package"] == f"{DIST} {VERSION}"}
    assert set(ours) == {("advantage_estimators", "rank"), ("advantage_estimators", "mc_value"), ("rewards", "concise")}
    assert all(row["status"] == "available" for row in ours.values())
    assert ours["advantage_estimators", "mc_value"]["requires"] == "critic"
    assert ours["rewards", "concise"]["requires"] == "task:arithmetic"
    assert rows["advantage_estimators", "grpo"]["package"].startswith("lumenrl-core ")  # built-ins still listed


def test_strict_assembly_refuses_a_misfit_plugin_naming_it_and_why(site, child_env):
    ok = lumenrl(site, child_env, "config", "check", "--config", str(CONFIG))
    assert ok.returncode == 0, ok.stderr
    assert re.search(rf"adv_estimator +rank +\({DIST} {VERSION}\)", ok.stdout), ok.stdout
    assert re.search(rf"reward +concise +\({DIST} {VERSION}\)", ok.stdout), ok.stdout
    bad = lumenrl(site, child_env, "config", "check", "--config", str(CONFIG), "algorithm.adv_estimator=mc_value",
                  "dataset.name=countdown", "assembly.strict_policy=true")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    lines = [line for line in bad.stderr.splitlines() if "requires run feature" in line]
    assert len(lines) == 2, bad.stderr
    mc_value, concise = lines
    assert f"algorithm.adv_estimator='mc_value': advantage_estimators plugin 'mc_value' ({DIST} {VERSION}) " \
           "requires run feature 'critic'" in mc_value and "critic.enabled=False; set critic.enabled=true" in mc_value
    assert f"reward.name='concise': rewards plugin 'concise' ({DIST} {VERSION}) requires run feature " \
           "'task:arithmetic'" in concise and "dataset.name='countdown'" in concise
    fits = lumenrl(site, child_env, "config", "check", "--config", str(CONFIG), "algorithm.adv_estimator=mc_value",
                   "critic.enabled=true")
    assert fits.returncode == 0, fits.stderr
    assert re.search(rf"adv_estimator +mc_value +\({DIST} {VERSION}\)", fits.stdout), fits.stdout


# ------------------------------------------------------------------ references, written from the docstrings


def reference_rank(scores: list[float], uid: list) -> list[float]:
    """(#members scored below - #members scored above) / (n - 1) within each uid group; 0 for n = 1."""
    out = []
    for s, u in zip(scores, uid):
        group = [scores[j] for j in range(len(scores)) if uid[j] == u]
        n = len(group)
        out.append(0.0 if n == 1 else (sum(g < s for g in group) - sum(g > s for g in group)) / (n - 1))
    return out


def reference_concise(response: str, ground_truth: str, format_score: float) -> float:
    from lumenrl_core.rewards import extract_final_answer, math_score

    if extract_final_answer(response) is None:
        return 0.0
    if math_score(response, ground_truth) != 1.0:  # LumenRL's answer matching decides correct vs wrong
        return format_score
    return max(format_score, 1.0 - 0.1 * max(0, len(response.strip()) - len(str(ground_truth))))


@pytest.fixture
def recorded_run(site, tmp_path, monkeypatch):
    """Assemble the example config by name with a registry that discovers ``site``, record what the
    estimator and the reward saw and returned, run STEPS GRPO steps."""
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    monkeypatch.syspath_prepend(str(site))  # importlib.metadata now finds the distribution's entry points
    config = load_config(CONFIG, [f"trainer.output_dir={tmp_path}", *FAST])
    plan = plan_run(config, registry=PluginRegistry())
    trainer = plan.trainer_cls.from_plan(plan)
    parts, calls = trainer.parts, {"advantages": [], "rewards": []}
    estimator, reward_fn = parts.estimator, parts.scorer.reward_fn

    def recording_estimator(batch):
        advantages, returns = estimator(batch)
        calls["advantages"].append((batch.batch["token_level_rewards"].clone(), batch.batch["response_mask"].clone(),
                                    list(batch.non_tensor_batch["uid"]), advantages.clone()))
        return advantages, returns

    def recording_reward(prompts, responses, extra):
        scores = reward_fn(prompts, responses, extra)
        calls["rewards"].append((list(responses), [row["ground_truth"] for row in extra], list(scores)))
        return scores

    parts.estimator, parts.scorer.reward_fn = recording_estimator, recording_reward
    threads = torch.get_num_threads()
    try:
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    return plan, estimator, reward_fn, calls, tmp_path


def test_a_grpo_run_uses_the_plugins_selected_by_name(recorded_run):
    from lumenrl_backends.loggers import read_metrics
    from lumenrl_core.algorithms import outcome_scores

    plan, estimator, reward_fn, calls, out = recorded_run
    assert type(estimator).__module__ == "lumenrl_example_plugins.advantages"
    assert type(reward_fn).__module__ == "lumenrl_example_plugins.rewards" and reward_fn.format_score == 0.5
    recorded = json.loads((out / "plugins.json").read_text())
    assert recorded["plugin_versions"]["advantage_estimators/rank"] == f"{DIST} {VERSION}"
    assert recorded["plugin_versions"]["rewards/concise"] == f"{DIST} {VERSION}"
    assert len(calls["rewards"]) == len(calls["advantages"]) == STEPS
    metrics = read_metrics(out)
    spread = 0
    for step, ((responses, truths, scores), (rewards, mask, uid, adv)) in enumerate(
            zip(calls["rewards"], calls["advantages"], strict=True)):
        assert scores == [reference_concise(r, t, 0.5) for r, t in zip(responses, truths)]
        assert math.isclose(metrics[step]["reward/mean"], sum(scores) / len(scores), rel_tol=1e-6)
        outcome = outcome_scores(rewards, mask)  # the reward reached the estimator (no KL in the reward here)
        torch.testing.assert_close(outcome, torch.tensor(scores, dtype=outcome.dtype))
        expected = torch.tensor(reference_rank(scores, uid), dtype=adv.dtype)[:, None] * mask.to(adv.dtype)
        torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
        spread += sum(len({scores[i] for i in range(len(uid)) if uid[i] == u}) > 1 for u in set(uid))
    assert spread > 0, "every group had equal rewards: the ranks were all 0 and the check above was vacuous"


def test_mc_value_is_the_reward_to_go_minus_the_critics_values(site, monkeypatch):
    """``mc_value`` on fresh random rows (ragged masks) vs GAE with lam = 1, unwhitened (the same quantity)."""
    from lumenrl_core.algorithms import gae_advantage

    monkeypatch.syspath_prepend(str(site))
    registry = PluginRegistry()
    estimator = registry.load("advantage_estimators", "mc_value")(gamma=0.9)
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rewards, values = torch.randn(6, 9, generator=generator), torch.randn(6, 9, generator=generator)
    lengths = torch.randint(1, 10, (6,), generator=generator)
    mask = (torch.arange(9)[None, :] < lengths[:, None]).float()  # (B, T)
    batch = type("Batch", (), {"batch": {"token_level_rewards": rewards, "values": values, "response_mask": mask}})
    advantages, returns = estimator(batch)
    reference, reference_returns = gae_advantage(rewards.double(), values.double(), mask, gamma=0.9, lam=1.0,
                                                 whiten=False)
    torch.testing.assert_close(advantages.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), reference_returns, rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="set critic.enabled=true"):
        estimator(type("Batch", (), {"batch": {"token_level_rewards": rewards, "response_mask": mask}}))
