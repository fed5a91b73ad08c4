"""GPU clocks, power and clock-limit reasons sampled while a benchmark runs.

A ratio taken side by side in one process is safe from a slow machine, but not from a GPU whose clocks move
between the two sides: a power-capped GEMM phase, a thermal slowdown during one round of interleaved calls.
:class:`GpuSampler` reads the GPU's state in a background thread while a block runs; each sample carries the
host's wall time, so a benchmark can split one sampling run into its phases (:func:`summarize` with
``since``/``until``). The suite samples every full GPU entry as a whole and records the summary beside its
numbers (``telemetry`` in ``history.jsonl``).

Reads go through NVML with ``pynvml`` (``nvidia-ml-py``) where it imports, else through ``nvidia-smi``
(one query per sample, no long-running child whose buffered output could be lost); without either (a CPU
machine) the sampler records nothing and summaries are empty. Nothing here changes the GPU's settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuSample", "GpuSampler", "parse_smi_line", "summarize"]

# clock-limit reasons (NVML's nvmlClocksEventReason* bits; nvidia-smi's clocks_event_reasons.* fields)
POWER_CAP = 0x4  # SW power cap
HW_SLOWDOWN = 0x8  # HW slowdown (thermal or power brake)
SW_THERMAL = 0x20  # SW thermal slowdown
HW_THERMAL = 0x40  # HW thermal slowdown
_SMI_REASONS = (("sw_power_cap", POWER_CAP), ("hw_slowdown", HW_SLOWDOWN), ("sw_thermal_slowdown", SW_THERMAL),
                ("hw_thermal_slowdown", HW_THERMAL))
_SMI_FIELDS = ("index", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu", "utilization.gpu")
SMI_INTERVAL_S = 0.25  # the shortest interval between nvidia-smi reads (each starts a process)
BUSY_UTIL = 50  # percent: samples at or above it are "busy" (idle phases drop the clocks and would bias medians)


@dataclass(frozen=True, slots=True)
class GpuSample:
    t: float  # host wall time (time.time()) when the read began
    gpu: int
    sm_mhz: float
    max_sm_mhz: float
    power_w: float
    power_limit_w: float
    temp_c: float
    util_pct: float
    reasons: int  # bit set of the clock-limit reasons above (0: none reported)
    t_end: float = 0.0  # ... and when it returned (a window holds a sample only if it holds the whole read)


def parse_smi_line(line: str, t: float, reason_prefix: str | None) -> GpuSample | None:
    """One ``nvidia-smi --format=csv,noheader,nounits`` line of :data:`_SMI_FIELDS` (+ the reason fields
    when ``reason_prefix``) -> a sample (a value the GPU does not report, ``[N/A]``, is NaN); None for a line of
    other fields or without the GPU index or SM clock."""
    cells = [c.strip() for c in line.split(",")]
    want = len(_SMI_FIELDS) + (len(_SMI_REASONS) if reason_prefix else 0)
    if len(cells) != want:
        return None
    index, sm, max_sm, power, limit, temp, util = (_number(c) for c in cells[:len(_SMI_FIELDS)])
    if not (math.isfinite(index) and math.isfinite(sm)):  # a field this GPU does not report is NaN; these two must be there
        return None
    reasons = 0
    for (_, bit), cell in zip(_SMI_REASONS, cells[len(_SMI_FIELDS):]):
        if cell.lower() == "active":
            reasons |= bit
    return GpuSample(t=t, gpu=int(index), sm_mhz=sm, max_sm_mhz=max_sm, power_w=power, power_limit_w=limit,
                     temp_c=temp, util_pct=util, reasons=reasons)


def _number(cell: str) -> float:
    """A numeric cell, NaN for what nvidia-smi prints when a GPU does not report it (``[N/A]``, ``[Not Supported]``)."""
    try:
        return float(cell)
    except ValueError:
        return math.nan


class _Smi:
    """Samples through ``nvidia-smi`` queries."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.prefix: str | None = None
        for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):  # newer drivers, then older names
            if self._run(self._fields(prefix)) is not None:
                self.prefix = prefix
                break

    def _fields(self, prefix: str | None) -> str:
        return ",".join([*_SMI_FIELDS, *(f"{prefix}.{name}" for name, _ in _SMI_REASONS)] if prefix else _SMI_FIELDS)

    def _run(self, fields: str) -> str | None:
        try:
            done = subprocess.run([self.binary, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    def read(self) -> list[GpuSample]:
        t = time.time()
        out = self._run(self._fields(self.prefix))
        samples = [parse_smi_line(line, t, self.prefix) for line in (out or "").splitlines() if line.strip()]
        end = time.time()
        return [dataclasses.replace(s, t_end=end) for s in samples if s is not None]


class _Nvml:
    """Samples through NVML (``pynvml``)."""

    def __init__(self, pynvml: Any) -> None:
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)  # newer name, then the older one

    def _get(self, read: Any, *args: Any, scale: float = 1.0) -> float:
        """One NVML query as a float; NaN where this GPU or driver does not support it."""
        try:
            return float(read(*args)) * scale
        except self.nvml.NVMLError:
            return math.nan

    def read(self) -> list[GpuSample]:
        n, t, out = self.nvml, time.time(), []
        for i, h in enumerate(self.handles):
            reasons = self._get(self.reasons, h) if self.reasons is not None else math.nan
            out.append(GpuSample(
                t=t, gpu=i, sm_mhz=self._get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
                max_sm_mhz=self._get(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM),
                power_w=self._get(n.nvmlDeviceGetPowerUsage, h, scale=1e-3),
                power_limit_w=self._get(n.nvmlDeviceGetEnforcedPowerLimit, h, scale=1e-3),
                temp_c=self._get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                util_pct=self._get(lambda handle: n.nvmlDeviceGetUtilizationRates(handle).gpu, h),
                reasons=int(reasons) if math.isfinite(reasons) else 0, t_end=time.time()))
        return out


def _reader(smi: str | None) -> Any | None:
    """NVML through pynvml, else nvidia-smi (``smi``: its path; None: look it up), else None."""
    if smi is None:
        try:
            import pynvml

            reader = _Nvml(pynvml)
            if any(math.isfinite(sample.sm_mhz) for sample in reader.read()):
                return reader
        except Exception:  # noqa: BLE001 - not installed, or no driver: try the command line tool
            pass
    binary = smi or shutil.which("nvidia-smi")
    if binary is None:
        return None
    reader = _Smi(binary)
    return reader if reader.read() else None


class GpuSampler:
    """``with GpuSampler() as s: ...``, then ``s.samples`` / ``s.summary()``: every ``interval_s`` the state of
    each visible GPU (through nvidia-smi at most every :data:`SMI_INTERVAL_S`, or as fast as it answers).
    ``smi``: the ``nvidia-smi`` to use instead of NVML, at ``interval_s`` (tests pass a stand-in). Without a
    reader the block runs unsampled (``available`` is False)."""

    def __init__(self, interval_s: float = 0.05, *, smi: str | None = None) -> None:
        self.samples: list[GpuSample] = []
        self._reader = _reader(smi)
        # a query process per sample costs a core's worth of CPU at NVML's rate: nvidia-smi reads 4 times a second
        self.interval_s = max(interval_s, SMI_INTERVAL_S) if isinstance(self._reader, _Smi) and smi is None else interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._reader is not None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):  # the first read was __enter__'s
            with contextlib.suppress(Exception):  # a failed read must not break the benchmark it watches
                self.samples.extend(self._reader.read())

    def __enter__(self) -> GpuSampler:
        if self._reader is not None:
            with contextlib.suppress(Exception):  # one read now: a block shorter than a busy machine's thread start
                self.samples.extend(self._reader.read())  # still has a sample from its start
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self, since: float | None = None, until: float | None = None) -> dict[str, float]:
        return summarize(self.samples, since=since, until=until)


def summarize(samples: list[GpuSample], *, since: float | None = None, until: float | None = None,
              gpu: int | None = None) -> dict[str, float]:
    """What the GPU(s) did while busy, over the samples read within ``[since, until]`` (host wall times) of ``gpu``
    (None: every GPU): ``sm_mhz_median`` / ``sm_mhz_min`` (SM clock), ``max_sm_mhz`` (its ceiling),
    ``power_w_median`` / ``power_w_max`` / ``power_limit_w``, ``temp_c_max``, ``power_capped_frac`` and
    ``thermal_frac`` (share of busy samples with the power cap / a thermal or hardware slowdown limiting the
    clock), ``busy_samples`` and ``samples``. Busy: utilization >= :data:`BUSY_UTIL` percent. Empty dict
    without a busy sample."""
    chosen = [s for s in samples if (since is None or s.t >= since) and (until is None or max(s.t, s.t_end) <= until)
              and (gpu is None or s.gpu == gpu)]
    busy = [s for s in chosen if not s.util_pct < BUSY_UTIL]  # an unreported utilization (NaN) counts as busy
    if not busy:
        return {}
    out: dict[str, float] = {}
    for key, field, reduce in (("sm_mhz_median", "sm_mhz", statistics.median), ("sm_mhz_min", "sm_mhz", min),
                               ("max_sm_mhz", "max_sm_mhz", max), ("power_w_median", "power_w", statistics.median),
                               ("power_w_max", "power_w", max), ("power_limit_w", "power_limit_w", max),
                               ("temp_c_max", "temp_c", max)):
        values = [getattr(s, field) for s in busy if math.isfinite(getattr(s, field))]
        if values:  # a field no sample reported is left out, not NaN
            out[key] = round(reduce(values), 1)
    out["power_capped_frac"] = round(sum(bool(s.reasons & POWER_CAP) for s in busy) / len(busy), 3)
    out["thermal_frac"] = round(sum(bool(s.reasons & (HW_SLOWDOWN | SW_THERMAL | HW_THERMAL)) for s in busy)
                                / len(busy), 3)
    out["busy_samples"], out["samples"] = len(busy), len(chosen)
    return out
