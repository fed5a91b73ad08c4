"""GPU telemetry of benchmark runs (:mod:`benchmarks.telemetry`), read through a stand-in ``nvidia-smi`` that
answers like the real one: two GPUs, a clock and power read from a file the test changes between phases."""

from __future__ import annotations

import json
import math
import stat
import time

import pytest
from benchmarks import history, telemetry
from benchmarks.suite import Entry
from benchmarks.telemetry import POWER_CAP, GpuSampler, parse_smi_line, summarize


def test_parse_a_line_with_and_without_reason_fields():
    line = "0, 1755, 1980, 652.31, 700.00, 61, 100, Active, Not Active, Not Active, Active"
    s = parse_smi_line(line, 5.0, "clocks_event_reasons")
    assert (s.gpu, s.sm_mhz, s.max_sm_mhz, s.power_w, s.power_limit_w, s.temp_c, s.util_pct, s.t) == \
        (0, 1755.0, 1980.0, 652.31, 700.0, 61.0, 100.0, 5.0)
    assert s.reasons == POWER_CAP | telemetry.HW_THERMAL
    assert parse_smi_line("1, 345, 1980, 80.1, 700, 30, 0", 1.0, None).reasons == 0
    assert parse_smi_line("0, [N/A], 1980, 80, 700, 30, 0", 1.0, None) is None  # no SM clock: no sample
    unpowered = parse_smi_line("0, 1500, 1980, [N/A], [Not Supported], 30, 90", 1.0, None)  # power not reported
    assert unpowered.sm_mhz == 1500 and math.isnan(unpowered.power_w)
    summary = summarize([unpowered])
    assert summary["sm_mhz_median"] == 1500 and "power_w_median" not in summary and "power_limit_w" not in summary
    assert parse_smi_line("0, 345, 1980", 1.0, None) is None  # a line of other fields


@pytest.fixture
def fake_smi(tmp_path):
    """An ``nvidia-smi`` that answers ``--query-gpu`` for GPUs 0 and 1 from ``state`` (clock power util reason)."""
    state = tmp_path / "state"
    state.write_text("1980 400 100 Not Active\n")
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in --query-gpu=*) ;; *) exit 2 ;; esac
read clock power util reason < {state}
case "$1" in *reasons*) tail=", $reason, Not Active, Not Active, Not Active" ;; *) tail="" ;; esac
for i in 0 1; do echo "$i, $clock, 1980, $power, 700.00, 55, $util$tail"; done
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, state


def _wait_for(sampler: GpuSampler, count: int) -> None:
    deadline = time.time() + 30  # a busy machine answers slowly; the test waits for samples, not a time
    while len(sampler.samples) < count and time.time() < deadline:
        time.sleep(0.01)
    assert len(sampler.samples) >= count


def test_sampler_splits_a_run_into_phases(fake_smi):
    script, state = fake_smi
    with GpuSampler(0.01, smi=str(script)) as sampler:
        assert sampler.available
        _wait_for(sampler, 6)
        capped_before = time.time()
        state.write_text("1500 700 100 Active\n")  # a power-capped phase
        capped_from = time.time()
        _wait_for(sampler, len(sampler.samples) + 6)
        idle_before = time.time()
        state.write_text("345 60 0 Not Active\n")  # idle: not counted as busy
        idle_from = time.time()
        _wait_for(sampler, len(sampler.samples) + 4)
    # a window holds the reads that began and ended inside it: each saw one state, however slow the machine
    first, second = sampler.summary(until=capped_before), sampler.summary(since=capped_from, until=idle_before)
    assert first["sm_mhz_median"] == 1980 and first["power_w_max"] == 400 and first["power_capped_frac"] == 0
    assert second["sm_mhz_median"] == 1500 and second["power_w_median"] == 700 and second["power_capped_frac"] == 1
    assert second["busy_samples"] % 2 == 0 and second["max_sm_mhz"] == 1980  # both GPUs, every read
    assert sampler.summary(since=idle_from) == {}  # no busy sample: nothing to say
    whole = sampler.summary()
    assert whole["sm_mhz_min"] == 1500 and whole["samples"] > whole["busy_samples"]
    assert summarize(sampler.samples, gpu=1)["busy_samples"] == whole["busy_samples"] // 2


def test_no_reader_means_no_samples(tmp_path):
    with GpuSampler(0.01, smi=str(tmp_path / "missing-nvidia-smi")) as sampler:
        time.sleep(0.03)
    assert not sampler.available and sampler.samples == [] and sampler.summary() == {}


def test_a_gpu_entry_records_its_telemetry_and_results_show_it(tmp_path, monkeypatch, fake_smi):
    script, state = fake_smi
    state.write_text("1620 690 100 Active\n")
    monkeypatch.setattr(history, "HISTORY", tmp_path / "history.jsonl")
    monkeypatch.delenv("LUMENRL_BENCH_OUT", raising=False)
    monkeypatch.setattr(telemetry, "_reader", lambda smi, _real=telemetry._reader: _real(str(script)))
    goal = next(e for e in history.ENTRIES if e.goal and e.device == "cuda")

    def fake_run(entry: Entry) -> dict:
        time.sleep(1.0)  # long enough for the 0.25 s sampler to read
        return {goal.metric: 1.0}

    monkeypatch.setattr(history, "run_isolated", fake_run)
    numbers, seen = history.run_sampled(goal)
    assert numbers == {goal.metric: 1.0} and seen["sm_mhz_median"] == 1620 and seen["power_capped_frac"] == 1
    history.append(goal, numbers, command="c", seconds=1.0, telemetry=seen)
    (rec,) = history.read_history(tmp_path / "history.jsonl")
    assert rec["telemetry"] == json.loads(json.dumps(seen))
    row = next(line for line in history.render_results([rec]).splitlines() if f"`{goal.name}`" in line)
    assert "(SM 1620 MHz, 690 W, power-capped 100%)" in row
    cpu = Entry(name="cpu", target="x:y", suites=(), device="cpu")
    monkeypatch.setattr(history, "run_isolated", lambda entry: {"v": 1.0})
    assert history.run_sampled(cpu) == ({"v": 1.0}, {})  # a CPU entry is not sampled


def test_nvml_reader_through_a_stand_in_pynvml():
    """The NVML path (what the GPU machine takes with nvidia-ml-py): every field read per GPU, a query the GPU
    does not support left out of the summary, the clock-limit reasons as NVML's bits."""
    from types import SimpleNamespace

    class NVMLError(Exception):
        pass

    def unsupported(handle):
        raise NVMLError("Not Supported")

    fake = SimpleNamespace(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetClockInfo=lambda h, kind: 1700 + h, nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetPowerUsage=lambda h: 650_000, nvmlDeviceGetEnforcedPowerLimit=unsupported,
        nvmlDeviceGetTemperature=lambda h, kind: 60, nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=100),
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: POWER_CAP if h == 1 else 0)
    samples = telemetry._Nvml(fake).read()
    assert [(s.gpu, s.sm_mhz, s.power_w, s.reasons) for s in samples] == [(0, 1700.0, 650.0, 0), (1, 1701.0, 650.0, POWER_CAP)]
    summary = summarize(samples)
    assert summary["sm_mhz_min"] == 1700 and summary["power_capped_frac"] == 0.5 and "power_limit_w" not in summary
