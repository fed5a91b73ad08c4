"""Shared fixtures of lumenrl-backends' tests: tiny checkpoints built once per session.

``tiny_model_dir(family, **overrides)`` builds ``build_tiny_model(family, seed=0, **overrides)`` the
first time a (family, overrides) pair is asked for and returns the same directory afterwards
(seconds each on 2 cores). The named fixtures are the checkpoints several files share.
Imports only what lumenrl-backends declares (its iso env runs these tests).
"""

from __future__ import annotations

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
