"""The rollouter server (a forkserver that has imported the rollouter's modules), on the CPU.

A rollouter forked from it starts with torch and transformers imported and takes its caller's
environment and ``sys.path`` of the moment, not the server's; ``lumenrl train`` starts it for a run
with a rollouter process only; the server's imports leave CUDA alone; a forked child that finds CUDA
unusable is replaced by a spawned one and the run goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lumenrl_backends import cli_train
from lumenrl_backends import rollouter_server as rs
from lumenrl_backends.loggers import read_metrics
from lumenrl_backends.trainers import rollouter_process as rp
from lumenrl_core.assembly import plan_run
from lumenrl_core.config import load_config

REPO = Path(__file__).resolve().parents[3]
ARGS = ("num_training_steps=2", "trainer.warm_start_sft_steps=0", "dataset.train_batch_size=4", "policy.rollout.n=4",
        "policy.rollout.max_new_tokens=6", "logger.progress_bar=false", "logger.backends=[jsonl]",
        "eval.enabled=false", "checkpointing.enabled=false", "checkpointing.export_hf=false",
        "weight_sync.method=filesystem")

needs_forkserver = pytest.mark.skipif(rs.start_method() != "forkserver", reason="no forkserver on this platform")


_FORKED_CHILD = """
import json, os, runpy, sys
from pathlib import Path
from lumenrl_backends import rollouter_server as rs

tmp = Path(sys.argv[1])
assert rs.prestart() and rs.prestart()  # idempotent
# set after the server started: a spawned child would see these, so must a forked one
os.environ["LUMENRL_SERVER_PROBE"] = os.urandom(4).hex()
os.environ.pop("LUMENRL_SERVER_GONE", None)
sys.path.insert(0, str(tmp / "plugins"))
state = rs.caller_state()
(tmp / "state.json").write_text(json.dumps(state))
os.environ["LUMENRL_SERVER_GONE"] = "1"  # in this process only after the state was taken
proc = rs.context().Process(target=runpy.run_path, args=(str(tmp / "child.py"),))
proc.start()
proc.join(120)
print(json.dumps({"exitcode": proc.exitcode, "state": state}))
"""


@needs_forkserver
def test_a_forked_child_has_the_imports_and_the_callers_environment_and_path(tmp_path):
    """In a process of its own: this test session's forkserver may already run with another preload list (the
    gloo ranks' ``spawn_ranks`` starts it), which a later ``prestart`` keeps, by design."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import gc, json, os, sys
        preloaded = "transformers" in sys.modules
        warmed = "lumenrl_backends.rollouter_warmup" in sys.modules and gc.get_freeze_count() > 0
        from lumenrl_backends.rollouter_server import adopt_caller_state
        adopt_caller_state(json.loads(open({str(tmp_path / 'state.json')!r}).read()))
        json.dump({{"preloaded": preloaded, "warmed": warmed, "env": dict(os.environ), "path": sys.path}},
                  open({str(tmp_path / 'out.json')!r}, "w"))
    """))
    done = subprocess.run([sys.executable, "-c", _FORKED_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    state = result["state"]
    assert result["exitcode"] == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["preloaded"] and out["warmed"]  # forked from the server after its imports and warm-up (frozen heap)
    assert out["env"] == state["env"] and "LUMENRL_SERVER_GONE" not in out["env"]
    assert "LUMENRL_SERVER_PROBE" in out["env"]
    assert out["path"] == state["sys_path"] and out["path"][0] == str(tmp_path / "plugins")


@needs_forkserver
def test_the_server_starts_before_this_process_imports_torch():
    """``lumenrl train`` calls :func:`prestart` before planning imports torch: it must not import torch itself."""
    code = ("import sys\nfrom lumenrl_backends.rollouter_server import prestart\n"
            "print(prestart(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


def test_the_warm_up_leaves_cuda_alone_lists_the_plugins_and_freezes_the_heap():
    """What the server runs last (:mod:`lumenrl_backends.rollouter_warmup`), in a fresh interpreter as the server does."""
    code = textwrap.dedent("""
        import gc, json, torch
        from lumenrl_backends import rollouter_warmup as w
        from lumenrl_core.plugins.registry import get_registry
        listed = sorted(k for k, v in get_registry()._entries.items() if v)
        print(json.dumps({"warmed": w.WARMED, "cuda": torch.cuda.is_initialized(), "frozen": gc.get_freeze_count(),
                          "listed": listed, "native": "lumenrl_backends.engines.native" in __import__("sys").modules}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert not got["cuda"] and got["native"] and got["frozen"] > 10_000
    assert {"engine_modules", "plugin_entry_points", "gc_freeze"} <= set(got["warmed"])
    assert {"rollout_engines", "training_backends", "trainers"} <= set(got["listed"])  # listed in the server, inherited


def test_only_a_run_with_a_rollouter_process_starts_the_server(monkeypatch):
    started = []
    monkeypatch.setattr(rs, "prestart", lambda: started.append(True) or True)
    async_cfg = str(REPO / "configs" / "grpo_async_stale.yaml")
    for config, overrides, expected in (
            (async_cfg, ["weight_sync.method=filesystem"], 1),
            (async_cfg, ["weight_sync.method=inprocess"], 0),  # a thread of the trainer's process
            (str(REPO / "configs" / "grpo_dense_bf16.yaml"), [], 0)):  # synchronous
        started.clear()
        cli_train.plan_from_args(config, overrides, start_rollouter_server=True)
        assert len(started) == expected, (config, overrides)
        assert rs.uses_rollouter_process(load_config(config, overrides)) == bool(expected)
    started.clear()
    cli_train.plan_from_args(async_cfg, ["weight_sync.method=filesystem"])  # the default: not asked for
    assert not started


def test_the_servers_imports_leave_cuda_alone():
    """Importing :data:`PRELOAD` calls none of torch's CUDA queries (any of them can initialize CUDA, and a
    fork of a process that did cannot use it)."""
    code = textwrap.dedent("""
        import importlib, sys
        import torch
        calls = []
        for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_capability",
                     "get_device_properties", "get_device_name", "set_device", "mem_get_info", "is_bf16_supported"):
            def spy(*args, _name=name, **kwargs):
                calls.append(_name)
                raise RuntimeError("CUDA queried at import")
            setattr(torch.cuda, name, spy)
        from lumenrl_backends.rollouter_server import PRELOAD
        for module in PRELOAD:
            importlib.import_module(module)
        print(sorted(set(calls)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@needs_forkserver
@pytest.mark.slow  # the spawned replacement imports torch/transformers afresh: ~20 s on 2 loaded cores
def test_a_forked_rollouter_without_cuda_is_replaced_by_a_spawned_one(tmp_path, monkeypatch):
    monkeypatch.setattr(rp.FAULTS, "forked_cuda_fails", True)  # the failure a CUDA-initializing import causes
    children = []
    real = rp.ProcessRollouter.__init__
    monkeypatch.setattr(rp.ProcessRollouter, "__init__", lambda self, *a, **k: real(self, *a, **k) or children.append(self))
    rs.prestart()
    plan = plan_run(load_config(REPO / "configs" / "grpo_async_stale.yaml", [f"trainer.output_dir={tmp_path}", *ARGS]))
    trainer = plan.trainer_cls.from_plan(plan)
    with pytest.warns(RuntimeWarning, match="CUDA is unusable in a process forked from the rollouter server"):
        trainer.fit()
    (child,) = children
    assert child.fell_back_to_spawn
    records = read_metrics(tmp_path)
    assert len(records) == 2 and all(r["async/consumed"] > 0 for r in records[-1:])
    assert records[-1]["async/rollouter_forked"] == 0.0  # the replacement was spawned


def test_a_failing_warm_up_step_is_skipped_and_the_heap_still_frozen(monkeypatch):
    """Python's forkserver survives only an ImportError in a preload: a warm-up step must never raise."""
    import gc

    from lumenrl_backends import rollouter_warmup as w

    def broken() -> None:
        raise RuntimeError("plugin registered twice")

    monkeypatch.setitem(w.STEPS, "plugin_entry_points", broken)
    done = w.warm()
    assert "plugin_entry_points" not in done and {"engine_modules", "gc_freeze"} <= set(done)
    assert gc.get_freeze_count() > 0
    gc.unfreeze()  # this test process keeps collecting its own objects
