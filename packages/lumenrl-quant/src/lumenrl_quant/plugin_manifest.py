"""lumenrl-quant's plugins, declared without importing torch: the entry points in ``pyproject.toml``
name these, so the LumenRL plugin registry lists and plans them without importing their code. Each
class reads its ``capabilities`` from here and its ``probe()`` returns its spec's
``unavailable_reason()``. No spec has a probe: every scheme has an exact emulation path and every
correction is plain tensor math, on any device torch supports.

This package depends on torch only, so :class:`Spec` is lumenrl-core's ``PluginSpec`` by shape
(``target``, ``capabilities``, ``probe``), which is how the registry reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Spec", "FP8_BLOCK", "FP8_ROW", "FP8_TENSOR", "FP8_W8A16", "MXFP8", "MXFP4", "TIS_TOKEN",
           "TIS_SEQ", "MIS_TOKEN", "MIS_SEQ", "MIS_GEO", "SEQ_MIS"]


@dataclass(frozen=True, slots=True)
class Spec:
    """A plugin before its code is imported: ``target`` is the ``"module:Class"`` of the plugin class."""

    target: str
    capabilities: frozenset[str] = frozenset()
    probe: Callable[[], str | None] | None = None  # None when usable here, else the reason

    def unavailable_reason(self) -> str | None:
        return self.probe() if self.probe is not None else None


_SCHEMES = "lumenrl_quant.schemes"
_W8A8 = frozenset({"fp8_weights", "fp8_activations", "inplace_reload"})

# lumenrl.quant_schemes
FP8_BLOCK = Spec(f"{_SCHEMES}:Fp8Block", _W8A8)
FP8_ROW = Spec(f"{_SCHEMES}:Fp8Row", _W8A8)
FP8_TENSOR = Spec(f"{_SCHEMES}:Fp8Tensor", _W8A8)
FP8_W8A16 = Spec(f"{_SCHEMES}:Fp8W8A16", frozenset({"fp8_weights", "weight_only", "inplace_reload"}))
MXFP8 = Spec(f"{_SCHEMES}:MXFP8", frozenset({"mx_weights", "mx_activations", "inplace_reload"}))
MXFP4 = Spec(f"{_SCHEMES}:MXFP4", frozenset({"mx_weights", "weight_only", "inplace_reload"}))

_CORRECTION = "lumenrl_quant.correction"

# lumenrl.rollout_corrections
TIS_TOKEN = Spec(f"{_CORRECTION}:TISToken")
TIS_SEQ = Spec(f"{_CORRECTION}:TISSequence")
MIS_TOKEN = Spec(f"{_CORRECTION}:MISToken")
MIS_SEQ = Spec(f"{_CORRECTION}:MISSequence")
MIS_GEO = Spec(f"{_CORRECTION}:MISGeometric")
SEQ_MIS = Spec(f"{_CORRECTION}:SeqMIS")
