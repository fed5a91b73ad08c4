"""Shared fixtures of the backends tests: one simulated two-node Ray cluster per session."""

from __future__ import annotations

import os

import pytest

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
