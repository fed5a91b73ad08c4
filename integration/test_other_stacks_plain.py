"""examples/other_stacks: the plain-PyTorch GRPO loop with lumenrl-quant only, and R3 on an HF MoE model."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lumenrl_quant import Fp8TrainingLinear, QuantizedLinear

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "other_stacks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plain():
    return _load("plain_grpo_quant")


def _fp8_codes(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (m.weight.clone(), m.weight_scale.clone()) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def test_plain_loop_trains_with_fp8_and_requantizes_on_sync(plain):
    steps = 3
    history, policy, rollout = plain.train(steps=steps)
    assert [row["step"] for row in history] == list(range(steps))
    for row in history:
        assert math.isfinite(row["loss"]) and 0 <= row["reward"] <= 1
        assert row["rollout/logprob_abs_diff_mean"] > 1e-4  # the FP8 copy samples from another distribution
        assert math.isfinite(row["rollout_correction/kl_k3"]) and 0 < row["rollout_correction/is_weight_mean"] <= 2
    assert sum(isinstance(m, Fp8TrainingLinear) for m in policy.modules()) >= 14  # decoder linears train in FP8
    assert not isinstance(policy.lm_head, Fp8TrainingLinear)
    # weight sync: every FP8 buffer is exactly the quantization of the updated master weight, not of the initial one
    _, initial_rollout, _ = plain.build()
    synced, initial = _fp8_codes(rollout), _fp8_codes(initial_rollout)
    assert synced and set(synced) == set(initial)
    moved = 0
    for name, (codes, scale) in synced.items():
        fresh = QuantizedLinear.from_linear(policy.get_submodule(name), rollout.get_submodule(name).scheme)
        assert torch.equal(codes.view(torch.uint8), fresh.weight.view(torch.uint8)) and torch.equal(scale, fresh.weight_scale)
        moved += not torch.equal(codes.view(torch.uint8), initial[name][0].view(torch.uint8))
    assert moved == len(synced)


def test_plain_loop_imports_no_lumenrl_package_but_lumenrl_quant():
    probe = (f"import runpy, sys; runpy.run_path({str(EXAMPLES / 'plain_grpo_quant.py')!r}); "
             "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('lumenrl')}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['lumenrl_quant']"


def test_r3_replay_reproduces_the_rollout_routes():
    result = _load("plain_r3_moe").main()
    assert result["replay_logits_max_abs_diff_same_weights"] == 0.0  # replay with the same weights: same forward
    assert result["route_agreement_with_replay"] == 1.0
    assert result["route_agreement_without_replay"] < 1.0  # perturbed weights route some tokens elsewhere
    assert result["moe/route_flip_frac"] == pytest.approx(1.0 - result["route_agreement_without_replay"])
    assert result["train_vs_replay_logits_max_abs_diff"] > 0  # the routes changed the logits
    assert result["router_grad_norm"] > 0  # replayed gates stay differentiable
