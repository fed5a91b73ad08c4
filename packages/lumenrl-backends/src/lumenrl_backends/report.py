"""``lumenrl report RUN_DIR``: one PNG of a run's curves from its ``metrics.jsonl``.

Panels: reward (train mean +- std, eval accuracy), KL, entropy, response length, throughput.
A panel whose metrics the run never logged is left out. Rendered with matplotlib's Agg
backend, so it works headless.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lumenrl_backends.loggers import read_metrics

__all__ = ["PANELS", "series", "write_report"]

# (title, metric keys drawn in it)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "eval/accuracy", "eval/reward_mean")),
    ("KL", ("actor/kl", "rollout_correction/kl_k3")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean", "response_length/max")),
    ("throughput (tokens/s)", ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s")),
    ("losses", ("actor/pg_loss", "critic/vf_loss")),
    ("async idle ratio", ("async/trainer_idle_ratio", "async/rollouter_idle_ratio")),
    ("async queue / staleness", ("async/queue_depth", "async/staleness_mean", "async/staleness_max",
                                 "async/partial_rollouts")),
    ("samples/s", ("perf/samples_per_s",)),
)


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have a finite value for it."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and value == value:  # not None, not NaN
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def _draw_panel(ax: Any, records: Sequence[dict[str, Any]], title: str, keys: Sequence[str]) -> None:
    for key in keys:
        steps, values = series(records, key)
        if not steps:
            continue
        dashed = key.startswith("eval/") and key != "eval/accuracy"
        marker = "o" if len(steps) < 30 or key.startswith("eval/") else None
        ax.plot(steps, values, marker=marker, markersize=3, linestyle="--" if dashed else "-", label=key)
        if key == "reward/mean":
            _, std = series(records, "reward/std")
            if len(std) == len(values):
                low = [v - s for v, s in zip(values, std)]
                high = [v + s for v, s in zip(values, std)]
                ax.fill_between(steps, low, high, alpha=0.12, label="reward/std band")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Render ``run_dir/metrics.jsonl`` to a PNG (default ``run_dir/report.png``); return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"run_dir={str(run_dir)!r}: metrics.jsonl has no records yet")
    panels = [(t, keys) for t, keys in PANELS if any(series(records, k)[0] for k in keys)]
    cols = 3
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        _draw_panel(ax, records, title, keys)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"LumenRL run: {Path(run_dir).resolve().name}")
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
