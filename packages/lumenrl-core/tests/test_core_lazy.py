"""lazy_exports: names resolve from their submodule on first use, then live in the namespace."""

from __future__ import annotations

import pytest

from lumenrl_core.lazy import lazy_exports


def test_lazy_exports_resolve_once_and_refuse_unknown_names():
    namespace = {"__name__": "lumenrl_core", "__version__": "9"}
    public, getattr_, dir_ = lazy_exports(namespace, {"builtins": ("BUILTIN_MODELS", "is_builtin_name")})
    assert public == ["__version__", "BUILTIN_MODELS", "is_builtin_name"]
    from lumenrl_core.builtins import BUILTIN_MODELS

    assert getattr_("BUILTIN_MODELS") is BUILTIN_MODELS and namespace["BUILTIN_MODELS"] is BUILTIN_MODELS
    assert {"__version__", "is_builtin_name"} <= set(dir_())
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr_("nope")
