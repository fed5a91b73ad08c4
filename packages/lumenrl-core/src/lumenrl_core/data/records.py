"""Dataset records and local file sources (jsonl, parquet).

A *record* is a plain JSON-able dict:

- ``prompt``: the user prompt, a string or a list of chat messages (``[{"role", "content"}]``);
- ``ground_truth``: what the reward compares against (a string, number or dict);
- ``extra``: the remaining fields of the source row (passed through to the reward).

Files are read with ``prompt_key`` / ``answer_key``, which may be dotted paths into nested
rows (``reward_model.ground_truth``, the verl parquet layout). Parquet needs ``pyarrow``
(``pip install 'lumenrl-core[parquet]'``); it is imported only when a parquet file is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["get_field", "load_records", "read_jsonl", "read_parquet", "rows_to_records"]

_MISSING = object()


def get_field(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``, following dots into nested mappings; KeyError naming the row's keys."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        value = value.get(part, _MISSING) if isinstance(value, Mapping) else _MISSING
        if value is _MISSING:
            raise KeyError(f"key {key!r} not found; the row has keys {sorted(row)}")
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped); errors name the line."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a parquet file as Python dicts (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"reading parquet file {str(path)!r} needs pyarrow: pip install 'lumenrl-core[parquet]' "
            "(or convert the file to jsonl)"
        ) from exc
    return pq.read_table(path).to_pylist()


def rows_to_records(
    rows: list[dict[str, Any]], *, prompt_key: str, answer_key: str, source: str
) -> list[dict[str, Any]]:
    """Map raw rows to records; errors name the source, the row and the missing key."""
    records = []
    for index, row in enumerate(rows):
        try:
            prompt, truth = get_field(row, prompt_key), get_field(row, answer_key)
        except KeyError as exc:
            raise KeyError(
                f"{source} row {index}: {exc.args[0]} (dataset.prompt_key / dataset.answer_key)"
            ) from None
        extra = {k: v for k, v in row.items() if k != prompt_key}
        records.append({"prompt": prompt, "ground_truth": truth, "extra": extra})
    return records


def load_records(
    path: str | Path, *, fmt: str = "", prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[dict[str, Any]]:
    """Records from a local ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file.

    ``fmt`` ("jsonl" or "parquet") overrides the suffix.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"dataset.path={str(path)!r} does not exist or is not a file")
    kind = fmt or {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "")
    if kind == "jsonl":
        rows = read_jsonl(path)
    elif kind == "parquet":
        rows = read_parquet(path)
    else:
        raise ValueError(
            f"dataset file {str(path)!r}: unknown format {fmt or path.suffix!r}; allowed: jsonl, parquet"
        )
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} has no rows")
    return rows_to_records(rows, prompt_key=prompt_key, answer_key=answer_key, source=str(path))
