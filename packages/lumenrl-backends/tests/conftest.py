"""Shared fixtures of lumenrl-backends' tests: tiny checkpoints built once per session, the small
Qwen3 of the training-backend tests, and one simulated two-node Ray cluster per session.

``tiny_model_dir(family, seed=0, **overrides)`` builds ``build_tiny_model(family, seed=seed, **overrides)``
the first time a (family, seed, overrides) triple is asked for and returns the same directory afterwards
(seconds each on 2 cores); tests read these directories, never write into them. The named fixtures are
the checkpoints several files share.

``spawn_ranks(fn, args, nprocs)`` is ``torch.multiprocessing.spawn`` for the gloo-rank tests, through a
forkserver that imports torch, transformers and the backends once (see its docstring).
``triton_interpreted({name: code, ...})`` runs test scripts under Triton's CPU interpreter (see its docstring).

``tiny_qwen3_lm(seed=0, narrow=False, **overrides)`` makes a fresh float32 Qwen3 from
``AutoConfig.for_model`` (``TINY_QWEN3``, or ``NARROW_QWEN3`` over it), initialised after
``torch.manual_seed(seed)`` (the global generator, as the backend tests always did);
``tiny_qwen3_path(**overrides)`` saves the seed-0 one with ``save_pretrained``, once per overrides.
Imports only what lumenrl-backends declares (its iso env runs these tests).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.models import build_tiny_model

TINY_QWEN3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 64}
NARROW_QWEN3 = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                "max_position_embeddings": 32}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    built: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, **overrides) -> Path:
        key = (family, seed, repr(sorted(overrides.items())))  # values may be lists (layer_types)
        if key not in built:
            built[key] = Path(build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=seed,
                                               **overrides))
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_qwen3_lm():
    def make(seed: int = 0, narrow: bool = False, **overrides) -> torch.nn.Module:
        config = AutoConfig.for_model("qwen3", **{**TINY_QWEN3, **(NARROW_QWEN3 if narrow else {}), **overrides})
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).float()

    return make


@pytest.fixture
def inductor_kernel_calls():
    """``calls(code)``: the kernel and extern calls in the ``call`` function of a wrapper inductor generated
    (``torch._inductor.utils.run_and_get_code``; on the CPU, C++ kernels). Skips without a C++ compiler."""
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler")
    pattern = re.compile(r"^\s+(?:buf\d+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", re.M)
    return lambda code: len(pattern.findall(code[code.index("def call("):]))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tiny_qwen3_lm, tmp_path_factory):
    saved: dict[str, str] = {}

    def get(**overrides) -> str:
        key = repr(sorted(overrides.items()))
        if key not in saved:
            path = tmp_path_factory.mktemp("tiny_qwen3")
            tiny_qwen3_lm(0, **overrides).save_pretrained(path)
            saved[key] = str(path)
        return saved[key]

    return get


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_dir) -> Path:
    """Qwen3, 2 layers; init scale 0.2 (above HF's default) so next-token distributions are not flat."""
    return tiny_model_dir("qwen3", initializer_range=0.2)


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", initializer_range=0.2)


@pytest.fixture(scope="session")
def qwen3_128_dir(tiny_model_dir) -> Path:
    """128-wide layers so FP8 128x128 weight blocks are exercised whole."""
    return tiny_model_dir("qwen3", initializer_range=0.1, hidden_size=128, intermediate_size=256, head_dim=32)


# What a spawned gloo rank of these tests imports before its first line runs (seconds of CPU per rank when
# each rank imports them afresh); a module that is not installed is skipped by the forkserver.
_RANK_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
                 "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                 "lumenrl_core.data_proto", "lumenrl_backends.models", "lumenrl_backends.training.fsdp2"]


@pytest.fixture(scope="session")
def spawn_ranks(request):
    """``spawn_ranks(fn, args, nprocs)``: ``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` with the
    ``forkserver`` start method. The forkserver (one per test process, started at the first call) imports
    ``_RANK_PRELOAD`` once and forks every rank from that state, so a rank pays no import of torch,
    transformers or the backends (spawn: each rank imports them afresh). Like spawn, each rank gets the
    caller's ``sys.path`` (``fn`` is unpickled by its module's importlib-mode name, hence the repository
    root on it) and starts from a single-threaded process; unlike spawn, its environment is the
    forkserver's (the session's), not the caller's at the time of the call: pass settings as arguments.
    ``start_method="spawn"``: plain spawn (the CUDA tests keep it)."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(_RANK_PRELOAD)
    root = str(request.config.rootpath)

    def spawn(fn, args, nprocs: int, start_method: str = "forkserver", attempts: int = 3) -> None:
        """``args``: a tuple, or ``args(port)`` -> tuple for ranks that rendezvous on a free local port: the port is
        found free here but bound later by rank 0, and another process (an xdist worker's test, an outgoing
        connection) can take it in between; then the ranks fail with EADDRINUSE and run again on a new port."""
        for attempt in range(attempts):
            try:
                with pytest.MonkeyPatch.context() as monkeypatch:
                    monkeypatch.syspath_prepend(root)
                    mp.start_processes(fn, args=args(_free_port()) if callable(args) else args, nprocs=nprocs,
                                       join=True, start_method=start_method)
                return
            except mp.ProcessRaisedException as err:
                if not callable(args) or "EADDRINUSE" not in str(err) or attempt == attempts - 1:
                    raise

    return spawn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The scripts of one ``triton_interpreted`` call, each as ``__main__`` with fresh globals and the generator
# state of a fresh process; what each prints, or its traceback, comes back in one JSON line after ``_MARK``.
_MARK = "@@lumenrl-interpreted@@"
_RUNNER = f"""
import contextlib, io, json, sys, traceback
import torch
seed = torch.initial_seed()
results = {{}}
for name, code in json.loads(sys.stdin.read()).items():
    torch.manual_seed(seed)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<" + name + ">", "exec"), {{"__name__": "__main__"}})
        results[name] = {{"stdout": out.getvalue()}}
    except BaseException:
        results[name] = {{"stdout": out.getvalue(), "error": traceback.format_exc()}}
print({_MARK!r} + json.dumps(results))
"""


class InterpretedRuns(dict):
    """name -> what the script printed; reading a script that raised fails with its traceback."""

    def __getitem__(self, name: str) -> str:
        run = super().__getitem__(name)
        assert "error" not in run, f"interpreted script {name!r} failed:\n{run['error'][-3000:]}"
        return run["stdout"]

    def json_rows(self, name: str, key: str = "case") -> dict[str, dict]:
        """The JSON object lines script ``name`` printed, by their ``key`` field."""
        rows = [json.loads(line) for line in self[name].splitlines() if line.startswith("{")]
        return {row.pop(key): row for row in rows}


@pytest.fixture(scope="session")
def triton_interpreted():
    """``run({name: code, ...}) -> InterpretedRuns``: the scripts in ONE fresh process with Triton's CPU
    interpreter on (``TRITON_INTERPRET`` is read when triton is imported, hence a process) and this
    directory importable, so a test file pays the process start and imports once, not once per script."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (runs in its interpreter on CPU)")

    def run(scripts: dict[str, str], timeout: int = 600) -> InterpretedRuns:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(scripts), env=env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(line for line in done.stdout.splitlines() if line.startswith(_MARK))
        return InterpretedRuns(json.loads(line[len(_MARK):]))

    return run


# read when ray is imported: a local test cluster needs no auth token set-up and sends no usage stats
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")  # slow agent start on a busy 2-core box
# Ray starts its workers (every actor: roles, rollouter, trainer) at niceness 15, below the driver and raylets; on a
# machine busy with other work at niceness 0 (the suite's other xdist worker, anything else) they get a small share of
# the CPU and a test that takes 9 s took 450 s. The test cluster's workers run at the same priority as everything else.
os.environ.setdefault("RAY_worker_niceness", "0")


def _start_cluster(node: dict):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """Two Ray "nodes" (2 CPUs each) on this machine (``ray.cluster_utils.Cluster``), driver attached.

    One cluster for the whole session: Ray start-up costs seconds. Tests release what they
    take (actors, placement groups) so the next test finds the 4 CPUs free."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("LUMENRL_CACHE", str(tmp_path_factory.mktemp("lumenrl_cache")))
    node = {"num_cpus": 2, "object_store_memory": 96 << 20}
    try:
        cluster = _start_cluster(node)
    except Exception:  # Ray gives a raylet 30 s to register: a loaded machine can miss that once
        cluster = _start_cluster(node)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
