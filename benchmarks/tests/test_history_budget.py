"""``python -m benchmarks run ... --budget-s S``: an entry whose recorded time does not fit in what is left of the
call is skipped and said so, instead of being started and killed midway (an entry killed midway records nothing)."""

from __future__ import annotations

import benchmarks.history as history
import pytest
from benchmarks.__main__ import main
from benchmarks.suite import ENTRIES


def _entry(name: str):
    return next(e for e in ENTRIES if e.name == name)


def _rec(entry: str, seconds: float, hardware: str = "NVIDIA H200") -> dict:
    return {"entry": entry, "seconds": seconds, "hardware": hardware, "numbers": {}}


def test_expected_seconds_is_the_median_of_the_last_three_records_on_the_entrys_kind_of_hardware():
    records = [_rec("decode", 900.0), _rec("decode", 60.0), _rec("decode", 1.0, "CPU x86_64"),
               _rec("decode", 80.0), _rec("decode", 70.0), _rec("train", 55.0)]
    assert history.expected_seconds(_entry("decode"), records) == 70.0  # 60, 80, 70; not 900 (older), not the CPU's
    assert history.expected_seconds(_entry("r3_mismatch"), [_rec("r3_mismatch", 12.0, "CPU x86_64")]) == 12.0
    assert history.expected_seconds(_entry("lora"), records) is None


def test_an_entry_that_does_not_fit_is_skipped_with_the_reason():
    records = [_rec("async_long_tail_gpu", 215.0)]
    entry = _entry("async_long_tail_gpu")
    reason = history.over_budget(entry, 300.0, 100.0, records)
    assert reason == "skipped: takes about 215 s, 200 s of --budget-s 300 left"
    assert history.over_budget(entry, 300.0, 80.0, records) is None  # 220 s left
    assert history.over_budget(entry, None, 1e9, records) is None  # no budget
    assert history.over_budget(_entry("lora"), 1.0, 0.5, records) is None  # no record: it starts


def test_a_full_run_skips_what_does_not_fit_and_records_nothing_of_it(monkeypatch, capsys):
    monkeypatch.setattr(history, "read_history", lambda path=None: [_rec("r3_mismatch", 50.0, "CPU x86_64")])
    ran: list[str] = []
    monkeypatch.setattr(history, "run_sampled", lambda entry: ran.append(entry.name) or ({}, {}))
    monkeypatch.setattr(history, "append", lambda *a, **k: pytest.fail("a skipped entry was recorded"))
    failed = history.run_entries([_entry("r3_mismatch")], smoke=False, command="test", budget_s=10.0)
    assert failed == 0 and ran == []
    assert "skipped: takes about 50 s, 10 s of --budget-s 10 left" in capsys.readouterr().out


def test_a_budget_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "moe", "--budget-s", "0"])
    assert info.value.code != 0 and "--budget-s 0: allowed > 0" in capsys.readouterr().err
