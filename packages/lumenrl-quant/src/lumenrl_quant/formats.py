"""FP8 number formats and the device-dependent choice between OCP and AMD "fnuz" variants.

Design
------
Four FP8 formats exist in torch:

=============  ==========================  ========  =============================================
name           torch dtype                 max       where
=============  ==========================  ========  =============================================
``e4m3``       ``torch.float8_e4m3fn``     448       OCP FP8 (NVIDIA Hopper/Blackwell, CPU, MI350)
``e5m2``       ``torch.float8_e5m2``       57344     OCP FP8
``e4m3fnuz``   ``torch.float8_e4m3fnuz``   240       AMD MI300 (gfx940/941/942) hardware format
``e5m2fnuz``   ``torch.float8_e5m2fnuz``   57344     AMD MI300 hardware format
=============  ==========================  ========  =============================================

E4M3 is the forward format (weights, activations); E5M2 has the range for gradients. The
"fnuz" variants have no negative zero and a single NaN, and a different exponent bias, so
their E4M3 max is 240 rather than 448. :func:`fp8_dtypes_for` picks fnuz on MI300-class GPUs
(``gcnArchName`` starting with ``gfx94``) and OCP everywhere else; callers may override.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FP8_FORMATS",
    "FP8Dtypes",
    "FP8Format",
    "fp8_dtypes_for",
    "fp8_format",
    "fp8_max",
    "is_fnuz_device",
]


@dataclass(frozen=True, slots=True)
class FP8Format:
    """One FP8 format: its name, torch dtype and largest finite magnitude."""

    name: str
    dtype: torch.dtype
    max: float
    fnuz: bool


E4M3 = FP8Format(name="e4m3", dtype=torch.float8_e4m3fn, max=448.0, fnuz=False)
E5M2 = FP8Format(name="e5m2", dtype=torch.float8_e5m2, max=57344.0, fnuz=False)
E4M3FNUZ = FP8Format(name="e4m3fnuz", dtype=torch.float8_e4m3fnuz, max=240.0, fnuz=True)
E5M2FNUZ = FP8Format(name="e5m2fnuz", dtype=torch.float8_e5m2fnuz, max=57344.0, fnuz=True)

FP8_FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ)}
_BY_DTYPE: dict[torch.dtype, FP8Format] = {f.dtype: f for f in FP8_FORMATS.values()}


class FP8Dtypes(NamedTuple):
    """The forward (E4M3-like) and gradient (E5M2-like) FP8 dtypes for one device."""

    e4m3: torch.dtype
    e5m2: torch.dtype


def fp8_format(spec: str | torch.dtype | FP8Format) -> FP8Format:
    """Resolve a format name (``"e4m3"``...), a torch float8 dtype, or a format object."""
    if isinstance(spec, FP8Format):
        return spec
    if isinstance(spec, torch.dtype):
        if spec in _BY_DTYPE:
            return _BY_DTYPE[spec]
        raise ValueError(f"dtype={spec} is not an FP8 dtype; allowed: {sorted(str(d) for d in _BY_DTYPE)}")
    key = str(spec).lower().replace("float8_", "").replace("_", "")
    aliases = {"e4m3fn": "e4m3"}
    key = aliases.get(key, key)
    if key not in FP8_FORMATS:
        raise ValueError(f"format={spec!r} is not an FP8 format; allowed: {sorted(FP8_FORMATS)}")
    return FP8_FORMATS[key]


def fp8_max(dtype: str | torch.dtype | FP8Format) -> float:
    """Largest finite magnitude of an FP8 format (448, 57344, 240 or 57344)."""
    return fp8_format(dtype).max


def is_fnuz_device(device: torch.device | str | int | None = None) -> bool:
    """True on AMD MI300-class GPUs (gfx94x), whose FP8 hardware uses the fnuz formats."""
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return False
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return False
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
    return arch.startswith("gfx94")


def fp8_dtypes_for(
    device: torch.device | str | int | None = None, *, fnuz: bool | None = None
) -> FP8Dtypes:
    """FP8 dtypes to use on ``device``: fnuz on MI300 (gfx94x), OCP elsewhere.

    ``fnuz=True/False`` overrides the detection (e.g. to emulate MI300 numerics on CPU).
    """
    use_fnuz = is_fnuz_device(device) if fnuz is None else bool(fnuz)
    if use_fnuz:
        return FP8Dtypes(e4m3=E4M3FNUZ.dtype, e5m2=E5M2FNUZ.dtype)
    return FP8Dtypes(e4m3=E4M3.dtype, e5m2=E5M2.dtype)
