"""Issue #16 run-time guards: non-finite steps skipped and counted, a streak stops the run, no
non-finite weights written; KL estimators finite for -inf log-probs; config commands torch-free."""

from __future__ import annotations

import math
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.nonfinite import NonFiniteError
from lumenrl_core.algorithms.kl import kl_estimate
from lumenrl_core.config import load_config
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

P, T, V = 4, 5, 64


@pytest.fixture
def backend(tiny_qwen3_lm):
    """``backend(single)``: an FSDP2 actor on the narrow tiny Qwen3 that stops after 2 skipped steps."""

    def make(single: str) -> FSDP2Backend:
        model = tiny_qwen3_lm(0, narrow=True, vocab_size=V, tie_word_embeddings=True)
        train = PolicyTrainConfig(micro_batch_size=2, single_device=single, max_consecutive_nonfinite_steps=2)
        return FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-2), train=train, num_training_steps=10,
                            device=torch.device("cpu"))

    return make


def _batch(rows: int = 4) -> DataProto:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (rows, P + T), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": torch.ones(rows, P + T, dtype=torch.long), "responses": ids[:, P:],
        "response_mask": torch.ones(rows, T), "advantages": torch.randn(rows, T, generator=g)})


def _loss(scale: float):
    def fn(outputs, micro):
        mask = micro.batch["response_mask"]
        loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
        return loss * scale, {}
    return fn


def _state(b: FSDP2Backend) -> list[torch.Tensor]:
    weights = [t.detach().clone() for t in b.weights_module.state_dict().values()]
    moments = [v.detach().clone() for s in b.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return weights + moments


@pytest.mark.parametrize("single", ["on", "off"])
def test_nonfinite_step_skipped_counted_and_streak_stops(single, tmp_path, backend):
    b = backend(single)
    m = b.train_step(_batch(), _loss(1.0))  # one real step creates the optimizer moments
    assert m["actor/nonfinite_skipped"] == 0.0
    before = _state(b)
    m = b.train_step(_batch(), _loss(float("nan")))
    assert m["actor/nonfinite_skipped"] == 1.0
    after = _state(b)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # no update of weights or moments
    b.train_step(_batch(), _loss(1.0))  # a finite step resets the streak
    assert not all(torch.equal(x, y) for x, y in zip(after, _state(b)))
    b.train_step(_batch(), _loss(float("inf")))
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        b.train_step(_batch(), _loss(float("nan")))


def test_nonfinite_weights_never_written(tmp_path, backend):
    b = backend("on")
    with torch.no_grad():
        next(iter(b.weights_module.parameters())).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match="not finite"):
        b.save_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(NonFiniteError):
        b.save_hf(str(tmp_path / "hf"))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_finite_for_neg_inf_logprobs_matches_float64_reference(kind):
    g = torch.Generator().manual_seed(7)
    lp = torch.randn(4, 16, generator=g, dtype=torch.float64) * 3 - 2
    ref = torch.randn(4, 16, generator=g, dtype=torch.float64) * 3 - 2
    lp[0, :3], ref[1, :3], lp[2, :2], ref[2, :2] = -math.inf, -math.inf, -math.inf, -math.inf
    out = kl_estimate(lp.float(), ref.float(), kind)
    assert torch.isfinite(out).all()
    d = torch.nan_to_num(lp - ref, nan=0.0).clamp(-20, 20)  # float64 reference, verl's clamps
    want = {"k1": d, "k2": 0.5 * d * d}.get(kind, (torch.exp(-d) + d - 1).clamp(-10, 10))
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-4)


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = ("import sys; from lumenrl_backends.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_config_commands_torch_free_and_fast():
    proc, cpu = _cli("config", "show", "policy.optim.lr=inf", "policy.rollout.n=1")
    assert proc.returncode == 2 and "NO-TORCH" in proc.stdout
    assert len(proc.stderr.splitlines()) == 2 and "Traceback" not in proc.stderr
    assert cpu < 1.5, f"rejected config took {cpu:.2f} s of CPU"  # CPU time: robust to a loaded machine
    proc, _ = _cli("config", "show")
    assert proc.returncode == 0 and "NO-TORCH" in proc.stdout
    proc, _ = _cli("--version")
    assert proc.returncode == 0 and "NO-TORCH" in proc.stdout


_PRESETS = sorted((Path(__file__).resolve().parents[3] / "configs").rglob("*.yaml"))


def _runs_on_cpu(preset: Path) -> bool:
    cluster = load_config(preset, machine=False).cluster
    return cluster.device != "cuda" and cluster.gpus_per_node == 0


@pytest.mark.parametrize("preset", _PRESETS, ids=lambda p: p.stem)
def test_config_check_of_every_preset_is_torch_free(preset):
    """Plugins are checked from their specs: no plugin class, hence no torch, is imported. A GPU preset is
    checked with --skip-machine-checks (this machine may lack its GPUs) and must be torch-free as well."""
    skip = [] if _runs_on_cpu(preset) else ["--skip-machine-checks"]
    proc, cpu = _cli("config", "check", "--config", str(preset), *skip)
    if proc.returncode != 0:  # only what this environment lacks: an optional extra, an older transformers
        assert proc.returncode == 2 and ("is not installed (pip install" in proc.stderr
                                         or "needs transformers>=" in proc.stderr), proc.stderr
    else:
        assert "ok: assembly policy" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "NO-TORCH"
    assert cpu < 2.5, f"config check of {preset.name} took {cpu:.2f} s of CPU"  # CPU time: robust to a loaded machine


def test_train_refuses_config_mistakes_in_lines():
    proc, _ = _cli("train", "policy.train.mini_batch_size=3", "algorithm.overlong_buffer_len=100")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 2
