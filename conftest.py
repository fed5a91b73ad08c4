"""Every test session starts from an empty LumenRL model cache (a fresh machine), never ``~/.cache``.

``LUMENRL_CACHE`` points at a temporary directory made for the session (shared by pytest-xdist
workers, which inherit it from the controller) and removed at the end, whatever the caller's
environment holds; built-in models and warm starts are then built once per session. To reuse a
cache across sessions on purpose (faster local iterations), set ``LUMENRL_TEST_CACHE=<dir>``: the
cache keys hash the building code, so a reused entry is still the current code's.

Only the standard library and pytest here: every package's isolated env loads this file.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile

import pytest

_OWNED = "_LUMENRL_TEST_CACHE_OWNED"


def _share_cores_among_workers() -> None:
    """pytest-xdist workers split the machine's cores: torch (and subprocesses) get cores // workers
    threads each, not every core each (oversubscribed OpenMP threads spin against each other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch = sys.modules.get("torch")  # imported already by a package's conftest.py
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config: pytest.Config) -> None:
    # Every Python process a test starts (ranks, servers, examples) prints its threads' stacks when a signal
    # kills it (an abort in C++, a segfault): a crash in a child names its place in the test's output.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _share_cores_among_workers()
        return  # the controller set it up; workers share its cache
    explicit = os.environ.get("LUMENRL_TEST_CACHE")
    if explicit:
        os.environ["LUMENRL_CACHE"] = explicit
        return
    path = tempfile.mkdtemp(prefix="lumenrl-test-cache-")
    os.environ["LUMENRL_CACHE"] = path
    os.environ[_OWNED] = path


# Test files that each keep one worker busy for a minute or more on 2 cores, longest first. pytest-xdist's
# ``--dist loadfile`` hands files out in collection order; these go first, so the run ends on short files
# (longest-first scheduling) rather than one worker finishing a long file while the other idles.
_LONG_FILES = (  # ranked by wall time alone (OMP_NUM_THREADS=1)
    "test_benchmarks_smoke.py", "test_backends_sddd.py", "test_backends_ray_trainer.py",
    "test_backends_fsdp2_mesh_dist.py", "test_integration_rl_ranks.py", "test_integration_rl_learning.py",
    "test_integration_async.py", "test_backends_engine_rope.py", "test_quant_triton_interpret.py",
    "test_integration_outputs_resume.py", "test_backends_megatron_dist.py", "test_quant_training_lm.py",
    "test_backends_engine_kernels.py", "test_backends_parallel_dist.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every other file keeps its order


def _pin_torch_threads() -> None:
    """torch's intra-op threads back to this process's share (``OMP_NUM_THREADS``: a worker's share of the cores, or
    the caller's value). A test module that calls ``torch.set_num_threads`` at import sets it for every test of the
    worker, since each worker imports every module while collecting; a test that builds a trainer sets it
    (``trainer.cpu_threads``) and leaves it. Two workers of two threads each on 2 cores spin in OpenMP barriers
    against each other: the sddd fixture took 288-520 s instead of 8-26 s in loaded full runs (decision 0008)."""
    torch, threads = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test is set up (module- and session-scoped ones included)."""
    _pin_torch_threads()


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for a test (``pytestmark = pytest.mark.usefixtures("one_thread")`` for a module):
    small tensors on a shared CPU run faster than with a thread per core fighting for it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every test module and what it imports: torch, transformers, triton, ray, ...) moves to
    the collector's permanent generation: a full collection then visits only what the tests make. Without it the
    tests' own allocations (a training loop's autograd graphs) set off full collections over millions of imported
    objects: test_backends_sddd.py's fixture took 58 s instead of 8 s with the whole suite collected in one process
    (2026-12-07; decision 0008). Garbage made by collection is collected first."""
    gc.collect()
    gc.freeze()
    _pin_torch_threads()  # what the test modules' imports set


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = os.environ.pop(_OWNED, None)
    if path and os.environ.get("LUMENRL_CACHE") == path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _forget_modules_imported_from_test_dirs(request: pytest.FixtureRequest):
    """A module a test imports from its temporary directory (a fake ``vllm``, a user reward file) leaves
    ``sys.modules`` when the test ends. Left there, it would outlive its ``sys.path`` entry and answer later
    imports in the same worker: e.g. TRL's ``is_vllm_available`` finds the fake ``vllm`` and fails on its
    missing version, so which tests pass would depend on the order xdist hands them out."""
    before = set(sys.modules)
    yield
    factory = getattr(request.config, "_tmp_path_factory", None)  # pytest's own, made at configure
    base = getattr(factory, "_basetemp", None)
    if base is None:  # no test has made a temporary directory yet
        return
    base = str(base)
    for name in set(sys.modules) - before:
        if any(str(place).startswith(base) for place in _module_places(sys.modules.get(name))):
            del sys.modules[name]


def _module_places(module: object) -> list[str]:
    """Where a module was loaded from: its file and its package path. Some modules are not plain
    (``torch.classes`` answers every attribute with a namespace object), so anything odd counts as nowhere."""
    places = []
    try:
        file, path = getattr(module, "__file__", None), getattr(module, "__path__", None)
        if isinstance(file, str):
            places.append(file)
        if path is not None and not isinstance(path, str):
            places.extend(str(p) for p in list(path))
    except Exception:  # noqa: BLE001 - a module object that does not behave as one is not from a test dir
        pass
    return places
