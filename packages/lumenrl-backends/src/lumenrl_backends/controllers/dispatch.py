"""Single-controller dispatch modes: how one call fans out to the ranks of a WorkerGroup.

A mode is a pair (split, collect): ``split`` turns the caller's ``(args, kwargs)`` into one
``(args, kwargs)`` per rank (or a subset of ranks), ``collect`` turns the per-rank outputs into
the caller's result. Controllers (local, Ray) share these; they differ only in how a rank runs.

===========================  ==========================================  ======================================
mode                         split                                       collect
===========================  ==========================================  ======================================
dp_compute_proto (default)   every DataProto argument padded to a        outputs concatenated in rank order,
                             multiple of W (cycling its first rows) and  then the padding rows dropped (DataProto,
                             chunked into W equal parts; other           tensors, tuples/lists/dicts of them;
                             arguments go to every rank unchanged        ``None`` stays ``None``)
dp_compute                   each argument is a list of W values; rank   the list of W outputs
                             r gets element r
dp_compute_proto_with_func   first argument a function given to every    as dp_compute_proto
                             rank; the rest as dp_compute_proto
dp_compute_metric            as dp_compute_proto                         per-rank metric dicts reduced: numeric
                                                                         values averaged over the ranks having
                                                                         the key; other values from the first
one_to_all                   the same arguments to every rank            the list of W outputs
all_to_all                   as dp_compute (per-rank lists in)           the list of W outputs
rank_zero                    rank 0 only                                 rank 0's output
===========================  ==========================================  ======================================

Chunks of a DataProto split over W > 1 ranks carry ``meta_info["dispatch_dp_size"] = W`` so a
data-parallel training backend knows the batch is already its shard (under torchrun, where
each process's group has one worker, the backend slices the full batch itself).

``broadcast`` is a legacy alias of ``one_to_all``. ``direct_rollout_method`` (a rollout worker
called outside the controller, as in verl's colocated vLLM path) is refused here.
``dp_compute`` and ``all_to_all`` coincide when every rank is a data-parallel rank (the local
controller); they differ once tensor/pipeline ranks exist (dp_compute addresses DP ranks only).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DISPATCH_DP_SIZE_KEY",
    "DISPATCH_MODES",
    "DEFAULT_DISPATCH",
    "RankCall",
    "DispatchPlan",
    "normalize_dispatch",
    "plan_dispatch",
    "register",
    "declared_dispatch",
    "reduce_metrics",
]

DISPATCH_MODES = (
    "dp_compute_proto",
    "dp_compute",
    "dp_compute_proto_with_func",
    "dp_compute_metric",
    "one_to_all",
    "all_to_all",
    "rank_zero",
)
DEFAULT_DISPATCH = "dp_compute_proto"
_ALIASES = {"broadcast": "one_to_all"}
_REFUSED = {
    "direct_rollout_method": (
        "dispatch='direct_rollout_method' is refused in controller dispatch: it bypasses the controller "
        "(the caller talks to the rollout engine directly); call the engine object itself, or use one of: "
    ),
}
_ATTR = "__lumenrl_dispatch__"
# stamped on each rank's chunk when a DataProto is split over W > 1 ranks: the receiving backend
# then treats the batch as its own shard instead of slicing it again (see training.fsdp2)
DISPATCH_DP_SIZE_KEY = "dispatch_dp_size"


@dataclass(frozen=True, slots=True)
class RankCall:
    rank: int
    args: tuple
    kwargs: dict


@dataclass(slots=True)
class DispatchPlan:
    """Per-rank calls and how to combine their outputs."""

    calls: list[RankCall]
    collect: Callable[[list[Any]], Any]
    meta: dict[str, Any] = field(default_factory=dict)


def normalize_dispatch(mode: str) -> str:
    """Resolve aliases; refuse unknown or refused modes with the allowed list."""
    mode = _ALIASES.get(mode, mode)
    if mode in _REFUSED:
        raise ValueError(_REFUSED[mode] + ", ".join(DISPATCH_MODES))
    if mode not in DISPATCH_MODES:
        raise ValueError(
            f"dispatch={mode!r} is not a dispatch mode; allowed: {', '.join(DISPATCH_MODES)} (or broadcast)"
        )
    return mode


def register(dispatch: str = DEFAULT_DISPATCH) -> Callable[[Callable], Callable]:
    """Declare a worker method's default dispatch mode: ``@register(dispatch="one_to_all")``."""
    mode = normalize_dispatch(dispatch)

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        return fn

    return mark


def declared_dispatch(worker_cls: type, method: str) -> str:
    """The mode a worker class's method declared with :func:`register`, else the default."""
    return getattr(getattr(worker_cls, method, None), _ATTR, DEFAULT_DISPATCH)


# ------------------------------------------------------------------ DataProto splitting


def _is_proto(x: Any) -> bool:
    return hasattr(x, "pad_to_divisor") and hasattr(x, "chunk") and hasattr(x, "unpad")


def _split_protos(args: Sequence[Any], kwargs: dict[str, Any], world: int) -> tuple[list[RankCall], int]:
    lengths = {len(v) for v in (*args, *kwargs.values()) if _is_proto(v)}
    if len(lengths) > 1:
        raise ValueError(f"dp_compute_proto: DataProto arguments have different lengths {sorted(lengths)}")
    pad = 0

    def parts(value: Any) -> list[Any]:
        nonlocal pad
        if not _is_proto(value):
            return [value] * world
        padded, pad = value.pad_to_divisor(world)
        chunks = padded.chunk(world)
        if world > 1:
            for chunk in chunks:  # each chunk owns a shallow copy of meta_info
                chunk.meta_info[DISPATCH_DP_SIZE_KEY] = world
        return chunks

    arg_parts = [parts(a) for a in args]
    kw_parts = {k: parts(v) for k, v in kwargs.items()}
    calls = [
        RankCall(r, tuple(p[r] for p in arg_parts), {k: p[r] for k, p in kw_parts.items()})
        for r in range(world)
    ]
    return calls, pad


def _concat(outputs: list[Any]) -> Any:
    first = outputs[0]
    if first is None:
        return None
    if _is_proto(first):
        return type(first).concat(outputs)
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outputs]) for k in first}
    raise TypeError(
        f"dp_compute_proto cannot concatenate worker outputs of type {type(first).__name__}; "
        "return a DataProto, a tensor, or a tuple/list/dict of them"
    )


def _unpad(value: Any, pad: int) -> Any:
    if pad == 0 or value is None:
        return value
    if _is_proto(value):
        return value.unpad(pad)
    if isinstance(value, torch.Tensor):
        return value[: value.shape[0] - pad]
    if isinstance(value, (tuple, list)):
        return type(value)(_unpad(v, pad) for v in value)
    return {k: _unpad(v, pad) for k, v in value.items()}


# ------------------------------------------------------------------ per-rank lists


def _split_per_rank(mode: str, args: Sequence[Any], kwargs: dict[str, Any], world: int) -> list[RankCall]:
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != world:
            raise ValueError(
                f"dispatch={mode!r}: {where} must be a list with one value per rank ({world}), got {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
            )
    return [
        RankCall(r, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)
    ]


def reduce_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over ranks of numeric values (per key, over the ranks that report it)."""
    out: dict[str, Any] = {}
    values: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in (metrics or {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                values.setdefault(key, []).append(float(value))
            else:
                out.setdefault(key, value)
    out.update({k: sum(v) / len(v) for k, v in values.items()})
    return out


# ------------------------------------------------------------------ planning


def plan_dispatch(mode: str, args: Sequence[Any], kwargs: dict[str, Any], world: int) -> DispatchPlan:
    """Split a call over ``world`` ranks according to ``mode`` (already normalized or an alias)."""
    mode = normalize_dispatch(mode)
    if world < 1:
        raise ValueError(f"cannot dispatch over an empty worker group (world size {world})")
    if mode in ("dp_compute_proto", "dp_compute_metric"):
        calls, pad = _split_protos(args, kwargs, world)
        collect = reduce_metrics if mode == "dp_compute_metric" else (lambda outs: _unpad(_concat(outs), pad))
        return DispatchPlan(calls, collect, {"pad": pad})
    if mode == "dp_compute_proto_with_func":
        if not args or not callable(args[0]):
            raise ValueError("dispatch='dp_compute_proto_with_func' needs a function as the first argument")
        calls, pad = _split_protos(args[1:], kwargs, world)
        calls = [RankCall(c.rank, (args[0], *c.args), c.kwargs) for c in calls]
        return DispatchPlan(calls, lambda outs: _unpad(_concat(outs), pad), {"pad": pad})
    if mode in ("dp_compute", "all_to_all"):
        return DispatchPlan(_split_per_rank(mode, args, kwargs, world), list)
    if mode == "one_to_all":
        return DispatchPlan([RankCall(r, tuple(args), dict(kwargs)) for r in range(world)], list)
    return DispatchPlan([RankCall(0, tuple(args), dict(kwargs))], lambda outs: outs[0])  # rank_zero
