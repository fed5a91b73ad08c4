"""``lumenrl report RUN_DIR``: a run-health report (PNG + self-contained HTML) from ``metrics.jsonl``.

What decides whether an RL run is healthy, one panel each, drawn only when the run logged it:
reward (mean with its mean +- std band, clipped to the batch's [min, max]) and eval; the train/infer
log-prob gap and KL before/after rollout correction; the IS-weight quantiles (p5/p50/p95), IS ratios
and the clipped/masked fractions; entropy; lengths and truncation; grad norm; throughput and seconds
per phase; and by prefix ``moe/``, ``async/``, ``quant/``, ``sddd/`` when present. Metric names are
read from the file: each key goes to the first panel whose patterns match it, so no series is drawn
twice; a series equal to one already in its panel (``eval/reward_mean`` when the reward is the
accuracy) is named in the legend instead of drawn again. The HTML page embeds the PNG (base64), a
verdict list (:func:`verdicts`) and a table of the latest values.
"""

from __future__ import annotations

import base64
import fnmatch
import html
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lumenrl_backends.loggers import read_metrics

__all__ = ["PANELS", "Verdict", "assign_panels", "plan_panels", "series", "verdicts", "write_html", "write_report"]

# (title, key patterns): a key belongs to the first panel with a matching pattern
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (mean, band = mean +- std within [min, max])", ("reward/mean",)),
    ("eval", ("eval/accuracy", "eval/reward_mean", "eval/*reward*", "eval/*acc*")),
    ("train/infer log-prob gap |log p_train - log p_rollout|", ("rollout/logprob_abs_diff_*",)),
    ("KL (policy: actor/*; rollout vs train: k1/k3)", ("actor/kl", "actor/ppo_kl", "rollout_correction/kl_*")),
    ("IS weight quantiles (p5, p50, p95 over kept tokens)", ("rollout_correction/is_weight_p*",)),
    ("IS ratio / weight", ("rollout_correction/is_*",)),
    ("clipped / masked fraction", ("rollout_correction/*_frac", "actor/clip_frac", "actor/pg_clipfrac*",
                                   "critic/vf_clipfrac")),
    ("entropy", ("actor/entropy",)),
    ("lengths", ("response_length/mean", "response_length/max", "response_length/min", "prompt_length/mean",
                 "eval/response_length_mean")),
    ("truncation (clip_ratio: hit max_new_tokens)", ("response_length/clip_ratio", "response_length/stop_frac")),
    ("grad norm", ("*/grad_norm",)),
    ("throughput (tokens/s, samples/s)", ("perf/*tokens_per_s", "perf/samples_per_s")),
    ("seconds per phase", ("timing/*", "perf/step_s")),
    ("losses", ("actor/pg_loss", "critic/vf_loss", "actor/*loss*", "sft/loss")),
    ("MoE routing", ("moe/*",)),
    ("async idle ratios (trainer, rollouter)", ("async/*idle_ratio",)),
    ("async staleness (version lag of trained samples)", ("async/staleness*", "async/policy_version")),
    ("async queue depth and partial rollouts", ("async/queue_depth", "async/in_transit", "async/partial_rollouts")),
    ("async seconds (rollouter process start-up, trainer wait)", ("async/rollouter_*_s", "async/startup_overlap_s",
                                                                   "async/trainer_wait_s")),
    ("async ledger (produced = consumed + dropped + queued)", ("async/*",)),
    ("quantization", ("quant/*",)),
    ("SDDD", ("sddd/*",)),
)

# verdict thresholds (documented in the verdict text)
LOGPROB_GAP_WARN = 0.1  # mean |log p_train - log p_rollout| per token
KL_AFTER_CORRECTION_WARN = 1e-3
TRUNCATION_WARN = 0.2  # fraction of responses that hit max_new_tokens
ENTROPY_COLLAPSE = 0.1  # latest entropy below this fraction of the first


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    check: str
    detail: str


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have a finite value for it."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def _numeric_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for record in records:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k)
    return list(keys)


def assign_panels(keys: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Panels that have at least one of ``keys``, each with its keys (every key in one panel at most)."""
    taken: set[str] = set()
    out = []
    for title, patterns in PANELS:
        mine = [k for p in patterns for k in sorted(keys) if fnmatch.fnmatchcase(k, p) and k not in taken]
        mine = list(dict.fromkeys(mine))
        taken.update(mine)
        if mine:
            out.append((title, mine))
    return out


def plan_panels(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(title, keys) of the panels the report draws: keys with at least one finite value."""
    panels = [(t, [k for k in keys if series(records, k)[0]]) for t, keys in assign_panels(_numeric_keys(records))]
    return [(t, keys) for t, keys in panels if keys]


def _draw_panel(ax: Any, records: Sequence[dict[str, Any]], title: str, keys: Sequence[str]) -> list[str]:
    """Draw ``keys``; return the keys drawn (a series identical to an earlier one is named, not drawn)."""
    drawn: dict[tuple, str] = {}
    for key in keys:
        steps, values = series(records, key)
        if not steps:
            continue
        same = drawn.get((tuple(steps), tuple(values)))
        if same is not None:
            ax.plot([], [], " ", label=f"{key} (= {same})")
            continue
        drawn[(tuple(steps), tuple(values))] = key
        marker = "o" if len(steps) < 30 or key.startswith("eval/") else None
        ax.plot(steps, values, marker=marker, markersize=3, label=key)
        if key == "reward/mean":
            _reward_band(ax, records)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return list(drawn.values())


def _reward_band(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    """mean +- std, clipped to the batch's [reward/min, reward/max] when logged."""
    rows = [r for r in records if all(isinstance(r.get(k), (int, float)) for k in ("reward/mean", "reward/std"))]
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    low = [max(r["reward/mean"] - r["reward/std"], r.get("reward/min", -math.inf)) for r in rows]
    high = [min(r["reward/mean"] + r["reward/std"], r.get("reward/max", math.inf)) for r in rows]
    ax.fill_between(steps, low, high, alpha=0.15, label="mean +- std (within [min, max])")


def verdicts(records: Sequence[dict[str, Any]]) -> list[Verdict]:
    """Health checks on the run's curves; a check whose metrics the run lacks is left out."""
    out = [_nonfinite(records)]
    for check in (_reward_rising, _entropy, _logprob_gap, _kl_after_correction, _truncation, _grad_norm):
        verdict = check(records)
        if verdict is not None:
            out.append(verdict)
    return out


def _nonfinite(records: Sequence[dict[str, Any]]) -> Verdict:
    """Steps with a NaN/inf value (the JSONL logger writes them as null) or a new skipped non-finite update
    (``<prefix>/nonfinite_skipped`` is a running total)."""
    bad, totals = set(), {}
    for r in records:
        for k, v in r.items():
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                bad.add(int(r["step"]))
            elif k.endswith("/nonfinite_skipped") and isinstance(v, (int, float)):
                if v > totals.get(k, 0):
                    bad.add(int(r["step"]))
                totals[k] = v
    bad = sorted(bad)
    return Verdict(not bad, "finite metrics", f"non-finite values or skipped non-finite updates at steps {bad[:10]}"
                   if bad else "every logged value finite, no update skipped")


def _reward_rising(records: Sequence[dict[str, Any]]) -> Verdict | None:
    _, r = series(records, "reward/mean")
    if len(r) < 4:
        return None
    third = max(1, len(r) // 3)
    first, last = statistics.fmean(r[:third]), statistics.fmean(r[-third:])
    return Verdict(last > first, "reward rising", f"mean reward first third {first:.4g} -> last third {last:.4g}")


def _entropy(records: Sequence[dict[str, Any]]) -> Verdict | None:
    _, e = series(records, "actor/entropy")
    if len(e) < 2:
        return None
    ok = e[-1] >= ENTROPY_COLLAPSE * e[0]
    return Verdict(ok, "no entropy collapse", f"entropy {e[0]:.4g} -> {e[-1]:.4g} (collapse: below {ENTROPY_COLLAPSE:g} x first)")


def _logprob_gap(records: Sequence[dict[str, Any]]) -> Verdict | None:
    _, g = series(records, "rollout/logprob_abs_diff_mean")
    if not g:
        return None
    return Verdict(g[-1] <= LOGPROB_GAP_WARN, "train/infer log-prob gap",
                   f"latest mean |log p_train - log p_rollout| {g[-1]:.3g} (warn above {LOGPROB_GAP_WARN:g})")


def _kl_after_correction(records: Sequence[dict[str, Any]]) -> Verdict | None:
    _, k = series(records, "rollout_correction/kl_k3")
    if not k:
        return None
    return Verdict(abs(k[-1]) <= KL_AFTER_CORRECTION_WARN, "rollout KL (k3)",
                   f"latest {k[-1]:.3g} (warn above {KL_AFTER_CORRECTION_WARN:g})")


def _truncation(records: Sequence[dict[str, Any]]) -> Verdict | None:
    _, c = series(records, "response_length/clip_ratio")
    if not c:
        return None
    return Verdict(c[-1] <= TRUNCATION_WARN, "truncation",
                   f"latest fraction at max_new_tokens {c[-1]:.3g} (warn above {TRUNCATION_WARN:g})")


def _grad_norm(records: Sequence[dict[str, Any]]) -> Verdict | None:
    keys = [k for k in _numeric_keys(records) if k.endswith("/grad_norm") and not k.startswith("sft/")]
    values = [v for k in keys for v in series(records, k)[1]]
    if len(values) < 3:
        return None
    med, top = statistics.median(values), max(values)
    return Verdict(top <= 10 * med, "grad norm spikes", f"max {top:.3g} vs median {med:.3g} (warn above 10x)")


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Render ``run_dir/metrics.jsonl`` to a PNG (default ``run_dir/report.png``); return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"run_dir={str(run_dir)!r}: metrics.jsonl has no records yet")
    panels = plan_panels(records)
    cols = 3
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        _draw_panel(ax, records, title, keys)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"LumenRL run: {Path(run_dir).resolve().name}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # room for the suptitle
    path = Path(out) if out is not None else Path(run_dir) / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_html(run_dir: str | os.PathLike[str], png: Path, out: str | os.PathLike[str] | None = None) -> Path:
    """A self-contained page: verdicts, the PNG (base64) and the latest value of every metric."""
    records = read_metrics(run_dir)
    latest: dict[str, tuple[int, Any]] = {}
    for record in records:
        for k, v in record.items():
            if k != "step":
                latest[k] = (int(record["step"]), v)
    items = "".join(
        f"<li class={'ok' if v.ok else 'warn'}>{'OK' if v.ok else 'CHECK'}: <b>{html.escape(v.check)}</b>: "
        f"{html.escape(v.detail)}</li>" for v in verdicts(records))
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td><td>{s}</td></tr>" for k, (s, v) in sorted(latest.items()))
    panels = "".join(f"<li>{html.escape(t)}: {html.escape(', '.join(k))}</li>" for t, k in plan_panels(records))
    image = base64.b64encode(png.read_bytes()).decode()
    name = html.escape(Path(run_dir).resolve().name)
    page = (f"<!doctype html><html><head><meta charset=utf-8><title>LumenRL run {name}</title><style>"
            "body{font-family:sans-serif;margin:1.5em}li.ok{color:#176317}li.warn{color:#a01010}"
            "table{border-collapse:collapse;font-size:13px}td{border:1px solid #ccc;padding:2px 8px}</style></head>"
            f"<body><h1>LumenRL run {name}</h1><p>{len(records)} steps logged.</p><h2>Health</h2><ul>{items}</ul>"
            f"<h2>Curves</h2><img alt=curves src='data:image/png;base64,{image}' style='max-width:100%'>"
            f"<h3>Panels</h3><ul class=panels>{panels}</ul>"
            f"<h2>Latest values</h2><table><tr><th>metric</th><th>value</th><th>step</th></tr>{table}</table>"
            "</body></html>\n")
    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    path.write_text(page)
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.5g}"
    return html.escape(str(value))
