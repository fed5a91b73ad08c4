"""DataProto: the batch that crosses every worker boundary.

A ``DataProto`` holds

* ``batch``: ``dict[str, Tensor]``; every tensor has the same leading (batch) dim ``B``;
* ``non_tensor_batch``: ``dict[str, np.ndarray]``; per-row values (``dtype=object`` allowed),
  leading dim ``B``;
* ``meta_info``: ``dict`` of batch-level values (temperature, global step, metrics, ...).

Row operations (indexing, ``select``, ``split``/``chunk``, ``concat``, ``repeat``,
``pad_to_divisor``/``unpad``, ``reorder``) act on every tensor and non-tensor entry together, so
rows never fall out of step. Operations that build a new set of rows return a new DataProto
(slices give views of the tensors, index lists give copies); ``union``, ``reorder`` and ``to``
update the DataProto in place and return it, so ``batch.union(out)`` and
``batch = batch.union(out)`` both read naturally. ``meta_info`` is shallow-copied into results.

Persistence: ``save`` writes ONE safetensors file (written to a temporary file, then
``os.replace``d, so readers never see a partial file): tensors in the body, non-tensors and
``meta_info`` as JSON in the header metadata. There is no pickle anywhere: non-tensor values and
``meta_info`` must be JSON-serialisable (str, int, float, bool, None, list, dict with str keys),
anything else is refused with the offending key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lumenrl_core.storage import atomic_write

__all__ = ["DataProto", "RowIndex"]

RowIndex = int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor

_FORMAT_KEY = "lumenrl.data_proto"
_FORMAT_VERSION = 1
_JSON_SCALARS = (str, int, float, bool, type(None))
_SAVABLE_ARRAY_KINDS = "biufUO"  # bool, int, uint, float, unicode str, object


class DataProto:
    """Tensors and per-row non-tensor values sharing one batch dim, plus batch-level ``meta_info``."""

    __slots__ = ("batch", "non_tensor_batch", "meta_info", "_batch_size")

    def __init__(
        self,
        batch: Mapping[str, torch.Tensor] | None = None,
        non_tensor_batch: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        self.batch: dict[str, torch.Tensor] = {k: _check_tensor(k, v) for k, v in (batch or {}).items()}
        self.non_tensor_batch: dict[str, np.ndarray] = {
            k: _as_row_array(k, v) for k, v in (non_tensor_batch or {}).items()
        }
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self._batch_size = _infer_batch_size(self.batch, self.non_tensor_batch, batch_size)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> DataProto:
        """Build from tensors, per-row non-tensors (arrays or lists, one element per row) and meta_info."""
        return cls(tensors, non_tensors, meta_info, batch_size=batch_size)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return self._batch_size or 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def __contains__(self, key: object) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def __repr__(self) -> str:
        tensors = {
            k: f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')} {v.device}"
            for k, v in self.batch.items()
        }
        arrays = {k: f"{a.shape} {a.dtype}" for k, a in self.non_tensor_batch.items()}
        return (
            f"DataProto(batch_size={len(self)}, batch={tensors}, non_tensor_batch={arrays}, "
            f"meta_info_keys={list(self.meta_info)})"
        )

    def __getitem__(self, item: str | RowIndex) -> Any:
        """``dp["key"]`` -> tensor or array; ``dp[rows]`` -> DataProto of those rows.

        Rows: an int (a 1-row DataProto, batch dim kept), a slice, a list / array / tensor of int
        indices (negative allowed), or a bool mask of length ``len(dp)``.
        """
        if isinstance(item, str):
            if item in self.batch:
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            raise KeyError(f"DataProto has no key {item!r}; keys: {self._all_keys()}")
        return self._take(_row_index(item, len(self)))

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace one entry: a tensor goes to ``batch``, anything else to ``non_tensor_batch``."""
        if isinstance(value, torch.Tensor):
            entry, target, other = _check_tensor(key, value), self.batch, self.non_tensor_batch
        else:
            entry, target, other = _as_row_array(key, value), self.non_tensor_batch, self.batch
        self._check_rows(key, entry.shape[0])
        other.pop(key, None)
        target[key] = entry

    def pop(self, key: str) -> Any:
        """Remove and return one tensor or non-tensor entry."""
        if key in self.batch:
            return self.batch.pop(key)
        if key in self.non_tensor_batch:
            return self.non_tensor_batch.pop(key)
        raise KeyError(f"DataProto has no key {key!r}; keys: {self._all_keys()}")

    def select(
        self,
        keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A DataProto with only the named entries (``None`` keeps all of that kind; tensors not copied)."""
        batch = _pick(self.batch, keys, "tensor")
        non_tensors = _pick(self.non_tensor_batch, non_tensor_keys, "non-tensor")
        meta = _pick(self.meta_info, meta_info_keys, "meta_info")
        return DataProto(batch, non_tensors, meta, batch_size=len(self))

    # ------------------------------------------------------------ row groups
    def split(self, size: int) -> list[DataProto]:
        """Consecutive parts of ``size`` rows (the last may be shorter); an empty DataProto gives one part."""
        _check_positive_int("split", "size", size)
        if len(self) == 0:
            return [self[0:0]]
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[DataProto]:
        """Exactly ``n`` consecutive parts whose sizes differ by at most one (larger parts first).

        For equal parts (data-parallel dispatch), ``pad_to_divisor(n)`` first.
        """
        _check_positive_int("chunk", "n", n)
        base, extra = divmod(len(self), n)
        parts, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            parts.append(self[start:stop])
            start = stop
        return parts

    @staticmethod
    def concat(parts: Iterable[DataProto]) -> DataProto:
        """Stack the rows of several DataProtos with the same keys, dtypes and trailing shapes.

        Blank parts (``DataProto()``: no entries, no rows) are skipped, so ``concat([acc, new])``
        works from an empty accumulator. ``meta_info`` is the first part's, plus keys that only
        later parts have.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("DataProto.concat: got an empty list of parts; need at least one")
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise TypeError(f"DataProto.concat: part {i} is a {type(part).__name__}, expected DataProto")
        meta: dict[str, Any] = {}
        for part in reversed(parts):
            meta.update(part.meta_info)
        kept = [(i, p) for i, p in enumerate(parts) if p.batch or p.non_tensor_batch or len(p)] or [
            (0, parts[0])
        ]
        for i, part in kept:
            _check_same_keys(kept[0], (i, part))
        parts = [p for _, p in kept]
        batch = {k: _cat_tensors(k, [p.batch[k] for p in parts]) for k in parts[0].batch}
        arrays = {
            k: _cat_arrays(k, [p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch
        }
        return DataProto(batch, arrays, meta, batch_size=sum(len(p) for p in parts))

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s entries (same rows) to this DataProto in place and return it.

        Keys present in both must hold equal values (tensors: same dtype, shape and values;
        meta_info: ``==``); a conflict raises before anything is changed.
        """
        if self._batch_size is not None and other._batch_size is not None and len(self) != len(other):
            raise ValueError(f"DataProto.union: batch sizes differ: {len(self)} rows vs {len(other)} rows")
        for key, tensor in other.batch.items():
            if key in self.batch and not _tensors_equal(self.batch[key], tensor):
                raise ValueError(f"DataProto.union: tensor {key!r} differs between the two DataProtos")
        for key, array in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _arrays_equal(self.non_tensor_batch[key], array):
                raise ValueError(f"DataProto.union: non-tensor {key!r} differs between the two DataProtos")
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise ValueError(
                    f"DataProto.union: meta_info[{key!r}] conflicts: {self.meta_info[key]!r} vs {value!r}"
                )
        self.batch.update(other.batch)
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        if self._batch_size is None:
            self._batch_size = other._batch_size
        return self

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Each row ``n`` times: interleaved ``[a, a, b, b]`` (GRPO groups) or tiled ``[a, b, a, b]``."""
        _check_positive_int("repeat", "n", n)
        rows = np.arange(len(self), dtype=np.int64)
        return self._take(np.repeat(rows, n) if interleave else np.tile(rows, n))

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pad rows (cycling from the first row) so ``len`` divides by ``divisor``; returns (padded, pad_size)."""
        _check_positive_int("pad_to_divisor", "divisor", divisor)
        pad_size = (-len(self)) % divisor
        if pad_size == 0:
            return self[:], 0
        rows = np.arange(len(self), dtype=np.int64)
        return self._take(np.concatenate([rows, np.arange(pad_size, dtype=np.int64) % len(self)])), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows added by ``pad_to_divisor``."""
        if (
            isinstance(pad_size, bool)
            or not isinstance(pad_size, (int, np.integer))
            or not 0 <= pad_size <= len(self)
        ):
            raise ValueError(
                f"DataProto.unpad: pad_size must be an int in [0, {len(self)}], got {pad_size!r}"
            )
        return self[: len(self) - int(pad_size)]

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Permute rows in place (row ``i`` becomes old row ``indices[i]``) and return self."""
        rows = _row_index(indices, len(self))
        if isinstance(rows, slice) or not np.array_equal(np.sort(rows), np.arange(len(self))):
            raise ValueError(
                f"DataProto.reorder: indices must be a permutation of range({len(self)}), got {indices!r}"
            )
        reordered = self._take(rows)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DataProto:
        """Move every tensor to ``device`` in place and return self."""
        self.batch = {k: v.to(device, non_blocking=non_blocking) for k, v in self.batch.items()}
        return self

    # ----------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write one safetensors file atomically (temporary file in the same folder, then ``os.replace``)."""
        header = {
            "version": _FORMAT_VERSION,
            "batch_size": len(self),
            "tensor_keys": list(self.batch),
            "non_tensor_batch": {k: _encode_array(k, a) for k, a in self.non_tensor_batch.items()},
            "meta_info": _check_json(self.meta_info, "meta_info"),
        }
        metadata = {_FORMAT_KEY: json.dumps(header)}
        _atomic_save(_cpu_unshared(self.batch), Path(path), metadata)

    def to_bytes(self) -> bytes:
        """The ``save`` format as bytes (for a pipe or queue between processes)."""
        from safetensors.torch import save

        return save(_cpu_unshared(self.batch), metadata={_FORMAT_KEY: json.dumps(self._header())})

    @classmethod
    def from_bytes(cls, data: bytes) -> DataProto:
        """Inverse of :meth:`to_bytes`."""
        import struct

        from safetensors.torch import load

        (n,) = struct.unpack("<Q", data[:8])  # safetensors: u64 header length, then the JSON header
        header = json.loads(json.loads(data[8 : 8 + n])["__metadata__"][_FORMAT_KEY])
        tensors = load(data)
        arrays = {k: _decode_array(v) for k, v in header["non_tensor_batch"].items()}
        return cls({k: tensors[k] for k in header["tensor_keys"]}, arrays, header["meta_info"],
                   batch_size=header["batch_size"])

    def _header(self) -> dict[str, Any]:
        return {
            "version": _FORMAT_VERSION,
            "batch_size": len(self),
            "tensor_keys": list(self.batch),
            "non_tensor_batch": {k: _encode_array(k, a) for k, a in self.non_tensor_batch.items()},
            "meta_info": _check_json(self.meta_info, "meta_info"),
        }

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: torch.device | str = "cpu") -> DataProto:
        """Read a file written by ``save``; tensors are placed on ``device``."""
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            if _FORMAT_KEY not in metadata:
                raise ValueError(
                    f"DataProto.load: {str(path)!r} is a safetensors file without DataProto metadata"
                )
            header = json.loads(metadata[_FORMAT_KEY])
            if header.get("version") != _FORMAT_VERSION:
                raise ValueError(
                    f"DataProto.load: {str(path)!r} has format version {header.get('version')!r}, "
                    f"this reader supports {_FORMAT_VERSION}"
                )
            tensors = {k: f.get_tensor(k).to(device) for k in header["tensor_keys"]}
        arrays = {k: _decode_array(v) for k, v in header["non_tensor_batch"].items()}
        return cls(tensors, arrays, header["meta_info"], batch_size=header["batch_size"])

    # -------------------------------------------------------------- internals
    def _all_keys(self) -> list[str]:
        return [*self.batch, *self.non_tensor_batch]

    def _check_rows(self, key: str, rows: int) -> None:
        if not self.batch and not self.non_tensor_batch and self._batch_size is None:
            self._batch_size = rows
        elif rows != len(self):
            raise ValueError(f"DataProto: {key!r} has {rows} rows, but the batch has {len(self)} rows")

    def _take(self, rows: slice | np.ndarray) -> DataProto:
        if isinstance(rows, slice):
            size = len(range(*rows.indices(len(self))))
            batch = {k: v[rows] for k, v in self.batch.items()}
        else:
            size = len(rows)
            batch = {
                k: v.index_select(0, torch.as_tensor(rows, device=v.device)) for k, v in self.batch.items()
            }
        arrays = {k: a[rows] for k, a in self.non_tensor_batch.items()}
        return DataProto(batch, arrays, self.meta_info, batch_size=size)


# ---------------------------------------------------------------- validation
def _check_tensor(key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"DataProto: batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}; "
            "put per-row non-tensor values in non_tensor_batch"
        )
    if value.dim() == 0:
        raise ValueError(f"DataProto: batch[{key!r}] is a 0-dim tensor; entries need a leading batch dim")
    return value


def _as_row_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(
                f"DataProto: non_tensor_batch[{key!r}] is a 0-dim array; entries need a batch dim"
            )
        return value
    if isinstance(value, (list, tuple)):
        array = np.empty(len(value), dtype=object)
        for i, element in enumerate(value):
            array[i] = element
        return array
    raise TypeError(
        f"DataProto: non_tensor_batch[{key!r}] must be a numpy array or a list with one value per row, "
        f"got {type(value).__name__}"
    )


def _infer_batch_size(
    batch: Mapping[str, torch.Tensor], arrays: Mapping[str, np.ndarray], batch_size: int | None
) -> int | None:
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0
    ):
        raise ValueError(f"DataProto: batch_size must be an int >= 0, got {batch_size!r}")
    sizes = [(k, v.shape[0]) for k, v in batch.items()] + [(k, a.shape[0]) for k, a in arrays.items()]
    if batch_size is None and sizes:
        batch_size = sizes[0][1]
    for key, rows in sizes:
        if rows != batch_size:
            first = (
                f"{sizes[0][0]!r} has {sizes[0][1]} rows"
                if sizes[0][1] == batch_size
                else f"batch_size={batch_size}"
            )
            raise ValueError(f"DataProto: batch size mismatch: {key!r} has {rows} rows, but {first}")
    return batch_size


def _check_positive_int(op: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"DataProto.{op}: {name} must be an int >= 1, got {value!r}")


def _row_index(item: Any, n: int) -> slice | np.ndarray:
    """Normalise a row selector to a forward slice or an int64 index array within ``[0, n)``."""
    if isinstance(item, bool):
        raise TypeError("DataProto: a bare bool is not a row index; use a bool mask with one entry per row")
    if isinstance(item, (int, np.integer)):
        if not -n <= item < n:
            raise IndexError(f"DataProto: row {item} is out of range for a batch of {n} rows")
        start = int(item) % n
        return slice(start, start + 1)
    if isinstance(item, slice):
        if item.step is None or item.step > 0:
            return item
        return np.arange(n, dtype=np.int64)[item].copy()
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    if not isinstance(item, (list, tuple, np.ndarray)):
        raise TypeError(
            f"DataProto: cannot index rows with {type(item).__name__}; use int, slice, index list or bool mask"
        )
    return _index_array(np.asarray(item), n)


def _index_array(index: np.ndarray, n: int) -> np.ndarray:
    if index.ndim != 1:
        raise IndexError(f"DataProto: row indices must be 1-D, got shape {index.shape}")
    if index.dtype == np.bool_:
        if index.shape[0] != n:
            raise IndexError(f"DataProto: bool mask has {index.shape[0]} entries, the batch has {n} rows")
        return np.flatnonzero(index).astype(np.int64)
    if index.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(index.dtype, np.integer):
        raise IndexError(f"DataProto: row indices must be integers or bools, got dtype {index.dtype}")
    if index.min() < -n or index.max() >= n:
        raise IndexError(f"DataProto: row indices {index.tolist()} out of range for a batch of {n} rows")
    return np.where(index < 0, index + n, index).astype(np.int64)


def _pick(entries: Mapping[str, Any], keys: Iterable[str] | None, kind: str) -> dict[str, Any]:
    if keys is None:
        return dict(entries)
    keys = [keys] if isinstance(keys, str) else list(keys)
    missing = [k for k in keys if k not in entries]
    if missing:
        raise KeyError(f"DataProto.select: no {kind} key(s) {missing}; available: {list(entries)}")
    return {k: entries[k] for k in keys}


def _check_same_keys(first: tuple[int, DataProto], part: tuple[int, DataProto]) -> None:
    (ref_index, ref_part), (index, got_part) = first, part
    for kind, ref, got in (
        ("tensor", ref_part.batch, got_part.batch),
        ("non-tensor", ref_part.non_tensor_batch, got_part.non_tensor_batch),
    ):
        if set(ref) != set(got):
            missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
            raise ValueError(
                f"DataProto.concat: part {index} {kind} keys differ from part {ref_index}: "
                f"missing {missing}, extra {extra}"
            )


def _cat_tensors(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    ref = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype:
            raise TypeError(
                f"DataProto.concat: tensor {key!r} is {ref.dtype} in part 0 but {t.dtype} in part {i}"
            )
        if t.shape[1:] != ref.shape[1:]:
            raise ValueError(
                f"DataProto.concat: tensor {key!r} has shape {tuple(ref.shape)} in part 0 but "
                f"{tuple(t.shape)} in part {i}; trailing dims must match"
            )
        if t.device != ref.device:
            raise ValueError(
                f"DataProto.concat: tensor {key!r} is on {ref.device} in part 0 but {t.device} in part {i}"
            )
    return torch.cat(tensors, dim=0)


def _cat_arrays(key: str, arrays: list[np.ndarray]) -> np.ndarray:
    for i, a in enumerate(arrays):
        if a.shape[1:] != arrays[0].shape[1:]:
            raise ValueError(
                f"DataProto.concat: non-tensor {key!r} has shape {arrays[0].shape} in part 0 but {a.shape} in part {i}"
            )
    return np.concatenate(arrays, axis=0)


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return bool(a == b)


# --------------------------------------------------------------- persistence
def _check_json(value: Any, where: str) -> Any:
    """Return ``value`` if it is plain JSON data (str/int/float/bool/None/list/dict[str, ...]); raise otherwise."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, list):
        return [_check_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(
                    f"DataProto.save: {where} has a non-str dict key {k!r}; JSON keys must be str"
                )
        return {k: _check_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    hint = " (use .item() / .tolist())" if isinstance(value, (np.generic, np.ndarray, torch.Tensor)) else ""
    raise TypeError(
        f"DataProto.save: {where} has type {type(value).__name__}, which is not JSON-serialisable{hint}; "
        "allowed: str, int, float, bool, None, list, dict with str keys"
    )


def _encode_array(key: str, array: np.ndarray) -> dict[str, Any]:
    if array.dtype.kind not in _SAVABLE_ARRAY_KINDS:
        raise TypeError(
            f"DataProto.save: non_tensor_batch[{key!r}] has dtype {array.dtype}; "
            "allowed: bool, int, uint, float, str or object arrays of JSON values"
        )
    if array.dtype.kind == "O":
        values = [_check_json(v, f"non_tensor_batch[{key!r}][{i}]") for i, v in enumerate(array.ravel())]
    else:
        values = array.ravel().tolist()
    return {"dtype": array.dtype.str, "shape": list(array.shape), "values": values}


def _decode_array(encoded: Mapping[str, Any]) -> np.ndarray:
    dtype, shape, values = np.dtype(encoded["dtype"]), tuple(encoded["shape"]), encoded["values"]
    if dtype.kind != "O":
        return np.array(values, dtype=dtype).reshape(shape)
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array.reshape(shape)


def _cpu_unshared(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies; tensors that share storage (views of one buffer) are cloned apart."""
    out, seen = {}, set()
    for key, tensor in batch.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
