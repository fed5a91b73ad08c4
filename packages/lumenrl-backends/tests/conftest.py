"""Shared fixtures of lumenrl-backends' tests: tiny checkpoints built once per session, and one
simulated two-node Ray cluster per session.

``tiny_model_dir(family, **overrides)`` builds ``build_tiny_model(family, seed=0, **overrides)`` the
first time a (family, overrides) pair is asked for and returns the same directory afterwards
(seconds each on 2 cores). The named fixtures are the checkpoints several files share.
Imports only what lumenrl-backends declares (its iso env runs these tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lumenrl_backends.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    built: dict[tuple, Path] = {}

    def get(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = Path(build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=0, **overrides))
        return built[key]

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



# read when ray is imported: a local test cluster needs no auth token set-up and sends no usage stats
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")  # slow agent start on a busy 2-core box


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
