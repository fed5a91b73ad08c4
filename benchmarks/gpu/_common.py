"""Shared helpers for the rollout/GRPO GPU benchmarks: environment, random Qwen3 shapes, roofline, output.

Models are random-initialised from ``AutoConfig.for_model("qwen3", ...)`` with the real dims of
Qwen3-0.6B / 1.7B / 8B (no download). The tokenizer is a stub (ids only, empty texts): speed and
log-prob numbers do not depend on text.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
OUT_DIR = Path(os.environ.get("LUMENRL_BENCH_OUT") or RESULTS_DIR)  # the device tool's $OUT on the GPU machine

__all__ = [
    "RESULTS_DIR", "SHAPES", "StubTokenizer", "environment", "qwen3_config", "random_model", "prompt_batch",
    "copy_bandwidth_gbs", "decode_roofline", "write_json", "print_table", "command_line",
]

# hidden, intermediate, layers, heads, kv heads, head_dim, tied embeddings
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (64, 128, 2, 4, 2, 16, True),  # CPU smoke runs of the scripts
    "0.6b": (1024, 3072, 28, 16, 8, 128, True),
    "1.7b": (2048, 6144, 28, 16, 8, 128, True),
    "8b": (4096, 12288, 36, 32, 8, 128, False),
}
VOCAB = 151936
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # smoke runs (tiny shapes) go to the CPU


class StubTokenizer:
    """What the engines need from a tokenizer when the model is random: ids, pad/eos, empty texts."""

    pad_token_id = 0
    eos_token_id = 151645
    padding_side = "left"

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = True) -> list[str]:
        return ["" for _ in sequences]


def command_line() -> str:
    return "python " + " ".join(sys.argv)


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return env


def qwen3_config(shape: str) -> Any:
    from transformers import AutoConfig

    hidden, inter, layers, heads, kv, head_dim, tied = SHAPES[shape]
    return AutoConfig.for_model(
        "qwen3", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=VOCAB,
        tie_word_embeddings=tied, max_position_embeddings=40960, rope_theta=1_000_000.0,
        attn_implementation="sdpa", pad_token_id=0, eos_token_id=StubTokenizer.eos_token_id,
    )


def random_model(shape: str, *, device: str = DEVICE, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """Random-init causal LM of ``shape`` directly on ``device`` (bf16 on CUDA, else float32)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or (torch.bfloat16 if device != "cpu" else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=dtype)
    model.generation_config.eos_token_id = None  # fixed lengths: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompt_batch(batch: int, prompt_len: int, *, seed: int = 0, device: str = "cpu") -> Any:
    """DataProto with ``input_ids``/``attention_mask`` of random non-special ids (full-length prompts)."""
    from lumenrl_core.data_proto import DataProto

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 150000, (batch, prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(tensors={"input_ids": ids.to(device), "attention_mask": mask.to(device)})


def copy_bandwidth_gbs(size_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of ``iters`` copies."""
    if DEVICE == "cpu":  # smoke runs: a small host copy
        src = torch.randn(1 << 22)
        _, seconds = timed(lambda: src.clone())
        return 2 * src.numel() * 4 / seconds / 1e9
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return 2 * size_bytes / times[len(times) // 2] / 1e9


def decode_roofline(model: Any, *, batch: int, prompt_len: int, new_tokens: int, bandwidth_gbs: float,
                    weight_bytes: int | None = None, kv_element: int = 2) -> dict[str, float]:
    """Bytes one decode step must read (weights except the input embedding + the KV of every row at
    its mean context length over the run) and the tokens/s that bandwidth allows."""
    from lumenrl_backends.engines.graphs import kv_bytes_per_token

    if weight_bytes is None:
        embed = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        total += sum(b.numel() * b.element_size() for b in model.buffers() if b.dim() >= 2)
        weight_bytes = total - (0 if tied else embed.numel() * embed.element_size())
    mean_context = prompt_len + (new_tokens - 1) / 2  # decode steps see prompt+1 .. prompt+new-1 tokens
    kv = batch * mean_context * kv_bytes_per_token(model.config, kv_element)
    step_s = (weight_bytes + kv) / (bandwidth_gbs * 1e9)
    return {"weight_gb": weight_bytes / 1e9, "kv_gb_mean": kv / 1e9, "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[Any, float]:
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Detail rows to ``$LUMENRL_BENCH_OUT/<name>`` (default ``benchmarks/results/``, git-ignored)."""
    out_dir = Path(os.environ.get("LUMENRL_BENCH_OUT") or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return path


def time_graph_ms(fns: list[Any], iters: int = 20) -> tuple[float, str]:
    """Median ms per call of ``fns`` captured in one CUDA graph and replayed (eager on the CPU)."""
    from benchmarks.quant._common import time_graph_ms as timer

    return timer(fns, iters=iters)


KERNEL_CLASSES = (  # first match wins; names of cuBLAS / CUTLASS / Triton / inductor kernels
    ("inductor", ("triton_poi", "triton_per", "triton_red")),  # fused elementwise (names may say _scaled_mm)
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul", "swiglu", "_decode_linear_kernel")),
    ("attention", ("_split_kernel", "_merge_kernel", "attn", "attention", "flash", "sdpa")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
)


def persistent_reductions_up_to(limit: int) -> None:
    """Make inductor hold inner reductions of up to ``limit`` columns in registers (one read, no loop)
    for the rest of the process. Its own limit is 1024 columns (``InductorChoices.should_use_persistent_reduction``);
    installed through the documented extension point ``V.set_choices_handler``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Choices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if (inductor_config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, limit)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    V.set_choices_handler(Choices())
    print(f"inductor: persistent inner reductions up to {limit} columns")


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def marginal_us(intervals: list[tuple[float, float]]) -> list[float]:
    """Per interval (in the given order), how much it extends the union of the intervals that start before it:
    ``end - max(start, latest earlier end)``, at least 0. Under PDL a kernel starts early and waits inside,
    so its duration counts time the previous kernel owns; its marginal time does not. The marginal times
    sum to :func:`covered_us` of the same intervals."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    out, reach = [0.0] * len(intervals), float("-inf")
    for i in order:
        start, end = intervals[i]
        out[i] = max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return out


def profile_engine(engine: Any, batch: Any, params: dict[str, Any], *, steps: int = 32,
                   weight_bytes: float | None = None, kv_bytes: float | None = None) -> dict[str, Any]:
    """Where a decode step's time goes, from the CUDA kernels of the engine as timed (graphs replayed,
    compiled or not). Two profiled ``generate`` calls, ``max_new_tokens`` 1 (prefill + first token) and
    ``1 + steps``; the first call's kernels (identical prefix) are dropped from the second, leaving the
    decode steps. Per step: kernel busy time, kernel span (first start .. last end), idle = span - busy
    (launch gaps, host syncs), busy time by kernel class, and the top kernels. CUPTI tracing adds some
    host overhead per replay, so wall times here are a little above the unprofiled run.

    Under programmatic dependent launch kernels overlap: a kernel starts while its predecessor drains and
    waits inside for it. Busy is therefore the union of the kernels' intervals (the time the GPU runs at
    least one), ``overlap_ms_per_step`` the sum of kernel durations beyond it, and the per-class and
    per-kernel times (sums of durations) include such waits."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(n_new: int) -> tuple[list[Any], float]:
        engine.generate(batch, {**params, "max_new_tokens": n_new})  # same length warm (graph buckets)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(batch, {**params, "max_new_tokens": n_new})
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
               and not getattr(e, "is_user_annotation", False)]  # kernels only, not GPU-side annotation ranges
        evs.sort(key=lambda e: e.time_range.start)
        return evs, wall

    head, wall_head = kernels(1)
    full, wall_full = kernels(1 + steps)
    decode = full[len(head):]
    if not decode:
        return {"error": "no decode kernels recorded"}
    total = sum(e.time_range.elapsed_us() for e in decode)
    spans = [(e.time_range.start, e.time_range.end) for e in decode]
    busy = covered_us(spans)
    marginal = marginal_us(spans)
    span = max(e.time_range.end for e in decode) - decode[0].time_range.start
    by_class: dict[str, float] = {}
    by_class_marginal: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e, own in zip(decode, marginal):
        us, cls = e.time_range.elapsed_us(), kernel_class(e.name)
        by_class[cls] = by_class.get(cls, 0.0) + us
        by_class_marginal[cls] = by_class_marginal.get(cls, 0.0) + own
        slot = by_name.setdefault(e.name, [0, 0.0, 0.0])
        slot[0] += 1
        slot[1] += us
        slot[2] += own
    per = 1e3 * steps  # us -> ms per step
    per_step = len(decode) // steps
    middle = steps // 2 * per_step  # one whole decode step (graphs replay the same kernels every step)
    sequence = [{"name": e.name[:60], "start_us": round(e.time_range.start - decode[middle].time_range.start, 2),
                 "us": round(e.time_range.elapsed_us(), 2), "marginal_us": round(own, 2)}
                for e, own in zip(decode[middle:middle + per_step], marginal[middle:middle + per_step])]
    out: dict[str, Any] = {
        "steps": steps, "kernels_per_step": len(decode) / steps, "busy_ms_per_step": busy / per,
        "span_ms_per_step": span / per, "idle_ms_per_step": (span - busy) / per,
        "overlap_ms_per_step": (total - busy) / per,
        "wall_ms_per_step_profiled": (wall_full - wall_head) * 1e3 / steps,
        "busy_ms_by_class": {k: v / per for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        # the same per class, each kernel counted by its marginal time (:func:`marginal_us`): sums to busy
        "marginal_ms_by_class": {k: v / per for k, v in sorted(by_class_marginal.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:90], "class": kernel_class(n), "per_step": c / steps, "ms_per_step": us / per,
                         "marginal_ms_per_step": own / per, "share": us / total}
                        for n, (c, us, own) in sorted(by_name.items(), key=lambda kv: -kv[1][2])[:15]],
        "step_sequence": sequence,
    }
    if weight_bytes is not None and by_class.get("gemm"):
        out["gemm_weight_gbs"] = weight_bytes / (by_class["gemm"] / per * 1e-3) / 1e9
    if kv_bytes is not None and by_class.get("attention"):
        out["attention_kv_gbs"] = kv_bytes / (by_class["attention"] / per * 1e-3) / 1e9
    return out


def profile_numbers(prof: dict[str, Any] | None, prefix: str = "profile/") -> dict[str, Any]:
    """A decode profile (:func:`profile_engine`) as flat suite numbers: ms per step busy / idle / by kernel
    class, the GB/s the GEMMs and attention reach, kernels per step, and the top three kernels' names."""
    if not prof or "error" in prof:
        return {}
    out: dict[str, Any] = {f"{prefix}{k}": round(prof[k], 4) for k in
                           ("kernels_per_step", "busy_ms_per_step", "idle_ms_per_step", "span_ms_per_step",
                            "overlap_ms_per_step", "gemm_weight_gbs", "attention_kv_gbs") if k in prof}
    out.update({f"{prefix}{cls}_ms_per_step": round(ms, 4) for cls, ms in prof["busy_ms_by_class"].items()})
    out.update({f"{prefix}{cls}_marginal_ms_per_step": round(ms, 4)
                for cls, ms in prof.get("marginal_ms_by_class", {}).items()})
    for i, k in enumerate(prof["top_kernels"][:3]):
        out[f"{prefix}top{i + 1}"] = f"{k['name'][:120]} ({k['ms_per_step']:.3f} ms/step)"
    return out


def print_profile(prof: dict[str, Any], label: str, verbose: bool = True) -> None:
    if "error" in prof:
        print(f"profile {label}: {prof['error']}")
        return
    print(f"profile {label}: {prof['kernels_per_step']:.0f} kernels/step, busy {prof['busy_ms_per_step']:.3f} ms, "
          f"span {prof['span_ms_per_step']:.3f} ms, idle {prof['idle_ms_per_step']:.3f} ms, wall(profiled) "
          f"{prof['wall_ms_per_step_profiled']:.3f} ms per step; gemm {prof.get('gemm_weight_gbs', 0):.0f} GB/s of "
          f"weights, attention {prof.get('attention_kv_gbs', 0):.0f} GB/s of KV")
    print("  by class (ms/step): " + ", ".join(f"{k} {v:.3f}" for k, v in prof["busy_ms_by_class"].items()))
    if "marginal_ms_by_class" in prof:
        print("  by class, marginal (ms/step): "
              + ", ".join(f"{k} {v:.3f}" for k, v in prof["marginal_ms_by_class"].items()))
    print_table(prof["top_kernels"], ["name", "class", "per_step", "ms_per_step", "marginal_ms_per_step", "share"])
    if prof.get("step_sequence") and verbose:
        print(f"  one decode step, kernel by kernel ({label}):")
        print_table(prof["step_sequence"], ["name", "start_us", "us", "marginal_us"])


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    sys.stdout.flush()
