"""The root conftest's guard: a module a test imports from its temporary directory is gone from
``sys.modules`` when the next test starts (``--dist loadfile`` runs this file's tests in order on one
worker). Without it, a fake ``vllm`` left by an adapter test broke TRL's imports in a later test."""

from __future__ import annotations

import importlib
import importlib.util
import sys

_NAME = "lumenrl_isolation_fake_vllm"


def test_a_test_imports_a_fake_package_from_its_temporary_directory(tmp_path, monkeypatch):
    (tmp_path / _NAME).mkdir()
    (tmp_path / _NAME / "__init__.py").write_text("VERSION = 'fake'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.import_module(_NAME).VERSION == "fake"


def test_the_next_test_no_longer_sees_it():
    assert _NAME not in sys.modules
    assert importlib.util.find_spec(_NAME) is None


class _OddModule:
    """As ``torch.classes``: every attribute is answered, ``__path__`` included, with a non-iterable object."""

    def __getattr__(self, name):
        return object()


def test_a_module_that_answers_every_attribute_does_not_break_the_guard():
    sys.modules["lumenrl_isolation_odd"] = _OddModule()  # imported during this test: the guard inspects it


def test_the_odd_module_stays_where_it_was_put():
    assert isinstance(sys.modules.pop("lumenrl_isolation_odd"), _OddModule)  # not from a test dir: kept
