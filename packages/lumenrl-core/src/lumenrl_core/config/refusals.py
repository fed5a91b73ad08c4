"""Keys of features that are not built yet: accepted at their default, refused with the reason otherwise.

:data:`NOT_YET_BUILT` maps a dotted key to the reason. A config that sets such a key to anything
but its schema default fails at load with one line per key (``config show``, ``config check`` and
``train`` alike), instead of running without the feature. When a feature lands, its helper deletes
the entries (and the test ``test_every_key_read_or_refused`` then requires a reader of the key).
"""

from __future__ import annotations

from typing import Any

from lumenrl_core.config.errors import ConfigError

__all__ = ["NOT_YET_BUILT", "refusal_errors"]

# dotted key -> why a non-default value is refused (delete an entry when its feature lands)
NOT_YET_BUILT: dict[str, str] = {
}


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def refusal_errors(cfg: Any, default: Any, source: Any) -> list[ConfigError]:
    """One ConfigError per :data:`NOT_YET_BUILT` key whose value in ``cfg`` differs from ``default``."""
    out = []
    for key, reason in NOT_YET_BUILT.items():
        try:
            value, base = _get(cfg, key), _get(default, key)
        except AttributeError:  # a key removed from the schema with its entry still here
            continue
        if value != base:
            out.append(ConfigError(key, value, problem=reason, allowed=f"{base!r} (the default)", source=source(key)))
    return out
