"""The run-health report on a synthetic metrics.jsonl: panels follow the logged prefixes, no series
is drawn twice, the HTML page is self-contained, the verdicts flag what they should."""

from __future__ import annotations

import base64
import math
import random
import re

import pytest

from lumenrl_backends.cli import main as lumenrl_main
from lumenrl_backends.loggers import JsonlLogger, read_metrics
from lumenrl_backends.report import assign_panels, plan_panels, verdicts


def _records(n: int, *, moe: bool, collapse: bool) -> list[dict[str, float]]:
    rng = random.Random(0)
    out = []
    for s in range(1, n + 1):
        acc = min(1.0, 0.3 + 0.05 * s)
        rec = {
            "reward/mean": 0.2 + 0.05 * s + rng.random() * 0.01, "reward/std": 0.4, "reward/min": 0.0, "reward/max": 1.0,
            "eval/accuracy": acc, "eval/reward_mean": acc,  # the same series: drawn once
            "rollout/logprob_abs_diff_mean": 0.002, "rollout/logprob_abs_diff_max": 0.05,
            "rollout_correction/kl_k3": 1e-4, "rollout_correction/is_ratio_mean": 1.0,
            "rollout_correction/is_ratio_max": 1.5, "rollout_correction/clipped_frac": 0.01,
            "rollout_correction/masked_frac": 0.0, "actor/kl": 0.01 * s,
            "rollout_correction/is_weight_p5": 0.9, "rollout_correction/is_weight_p50": 1.0,
            "rollout_correction/is_weight_p95": 1.2,
            "actor/entropy": 1.0 * (0.01 if collapse and s == n else 1 - 0.02 * s),
            "response_length/mean": 10 + s, "response_length/clip_ratio": 0.05, "actor/grad_norm": 1 + rng.random(),
            "perf/rollout_tokens_per_s": 100.0, "timing/generate_s": 1.0, "timing/update_actor_s": 2.0,
            "actor/pg_loss": rng.uniform(-0.1, 0.1),
        }
        if moe:
            rec["moe/route_flip_frac"] = 0.02
        if s == 3:
            rec["actor/pg_loss"] = math.nan
        out.append(rec)
    return out


def _write(path, records) -> None:
    logger = JsonlLogger(path)
    for step, record in enumerate(records, start=1):
        logger.log(record, step)
    logger.close()


def test_skipped_nonfinite_update_is_flagged_at_its_step():
    records = [{"step": s, "actor/nonfinite_skipped": float(t), "reward/mean": 0.1} for s, t in ((1, 0), (2, 1), (3, 1))]
    (finite,) = [v for v in verdicts(records) if v.check == "finite metrics"]
    assert not finite.ok and "[2]" in finite.detail


def test_every_key_in_one_panel_at_most():
    keys = list(_records(1, moe=True, collapse=False)[0])
    seen = [k for _, ks in assign_panels(keys) for k in ks]
    assert len(seen) == len(set(seen)) and set(seen) == set(keys) - {"reward/std", "reward/min", "reward/max"}  # the band


@pytest.mark.parametrize("moe", [False, True])
def test_report_png_html_panels_follow_prefixes(tmp_path, moe, capsys):
    _write(tmp_path, _records(8, moe=moe, collapse=True))
    assert lumenrl_main(["report", str(tmp_path)]) == 0
    png, page = tmp_path / "report.png", (tmp_path / "report.html").read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"
    embedded = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert base64.b64decode(embedded) == png.read_bytes()  # self-contained
    titles = [t for t, _ in plan_panels(read_metrics(tmp_path))]
    assert any(t.startswith("MoE") for t in titles) == moe
    assert not any(t.startswith(("async", "quantization", "SDDD")) for t in titles)
    for wanted in ("reward", "eval", "train/infer log-prob gap", "KL", "IS weight quantiles", "IS ratio", "clipped",
                   "entropy", "grad norm"):
        assert any(t.startswith(wanted) for t in titles), wanted
    checks = {v.check: v.ok for v in verdicts(read_metrics(tmp_path))}
    assert checks["finite metrics"] is False  # the NaN loss at step 3
    assert checks["no entropy collapse"] is False and checks["reward rising"] is True
    assert checks["train/infer log-prob gap"] is True
    out = capsys.readouterr().out
    assert "CHECK no entropy collapse" in out and "report.html" in out


def test_identical_series_drawn_once(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lumenrl_backends.report import _draw_panel

    records = [{"step": s, **r} for s, r in enumerate(_records(5, moe=False, collapse=False), start=1)]
    fig, ax = plt.subplots()
    drawn = _draw_panel(ax, records, "eval", ["eval/accuracy", "eval/reward_mean"])
    assert drawn == ["eval/accuracy"] and len(ax.lines) == 2  # one curve + the legend-only entry
    assert sum(1 for line in ax.lines if len(line.get_xdata())) == 1
    plt.close(fig)


def test_async_metrics_get_their_panels(tmp_path):
    """An async run's metrics: idle ratios, staleness, queue depth and the ledger each in a panel of their own
    scale (ratios in [0, 1] are not drawn against sample counts in the thousands)."""
    records = _records(4, moe=False, collapse=False)
    for step, record in enumerate(records, start=1):
        record.update({"async/trainer_idle_ratio": 0.1, "async/rollouter_idle_ratio": 0.05,
                       "async/staleness_mean": 0.5, "async/staleness_max": 1.0, "async/policy_version": float(step),
                       "async/queue_depth": 16.0, "async/in_transit": 0.0, "async/partial_rollouts": 3.0,
                       "async/produced": 64.0 * step + 16, "async/consumed": 64.0 * step, "async/dropped": 0.0,
                       "async/dropped_stale": 0.0, "perf/samples_per_s": 100.0})
    panels = dict(assign_panels(list(records[0])))
    assert set(panels["async idle ratios (trainer, rollouter)"]) == {"async/trainer_idle_ratio",
                                                                     "async/rollouter_idle_ratio"}
    assert "async/staleness_max" in panels["async staleness (version lag of trained samples)"]
    assert "async/queue_depth" in panels["async queue depth and partial rollouts"]
    assert {"async/produced", "async/consumed", "async/dropped_stale"} <= set(
        panels["async ledger (produced = consumed + dropped + queued)"])
    assert "perf/samples_per_s" in panels["throughput (tokens/s, samples/s)"]
    _write(tmp_path, records)
    assert lumenrl_main(["report", str(tmp_path)]) == 0
    assert sum(t.startswith("async") for t, _ in plan_panels(read_metrics(tmp_path))) == 4
