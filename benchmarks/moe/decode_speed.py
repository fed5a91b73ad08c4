"""MoE decode speed of the ``native`` engine on a Qwen3-30B-A3B-shaped model (issue #17 goal).

Full shape (``smoke=False``, CUDA): hidden 2048, 128 experts, top-8, expert width 768, 32/4 heads
of 128, 12 of the 48 layers, vocab 151936, bf16 random init; batch 64, 256 prompt + 128 new
tokens, greedy, EOS ignored. Reported, each the median of three whole generate calls after a warm-up call (the
bf16 rate: of the fifteen plain calls of the recording-cost rounds), all
engines ``compile="full"`` over the same model, in this order (the FP8 engines quantize it in place):

* ``native_decode_tok_s``: batch x (new - 1) / (seconds - prefill seconds), experts on the fused
  Triton kernel (``fused_moe="on"``, lumenrl-quant ``fused_moe``);
* ``roofline_pct``: that rate over the HBM roofline when every expert is read each step (all
  weights but the input embedding + the mean KV, over the measured copy bandwidth);
* ``record_overhead_pct``: decode time with R3 recording on vs off, fused experts (goal <= 3%): two engines
  built side by side, three rounds of five interleaved calls each (:func:`_record_cost`), the median round;
  ``record_overhead_spread_pct`` is the spread of the rounds; where NVML answers, the GPU's median SM clock
  during each engine's calls and each round (``plain_sm_mhz``, ``recording_sm_mhz``, ``round_sm_mhz``:
  whether the clock moved when the rounds disagree); ``record_overhead_loop_pct``: the same rounds timed to the
  engine's final sync (the decode loop alone), ``plain_post_ms`` / ``recording_post_ms``: each engine's host
  time after it (building the returned batch, the routes' layout included);
* ``grouped_mm_decode_tok_s``: the same engine with ``fused_moe="off"`` (transformers' ``grouped_mm``);
* ``hf_decode_tok_s``: HF ``generate`` (dynamic cache), prefill timed separately;
* ``fp8_experts_decode_tok_s`` / ``fp8_experts_vs_bf16``: FP8 expert weights (``fp8_block`` with the
  attention linears skipped, so only the experts are FP8: 128 x 128 blocks, w8a16 in the fused
  kernel), over ``native_decode_tok_s`` (goal >= 1.3); ``fp8_experts_roofline_pct`` against the
  roofline of the FP8-expert weight bytes;
* ``fp8_rollout_vs_bf16``: the whole ``fp8_block`` rollout scheme (attention linears FP8 too).

The recording engine patches the model's routers (R3); they are restored (``uninstall_routing``) before
the next engine, so every other engine runs the model's own routers.

Smoke (CPU, seconds): a hidden-64 / 8-expert version of the same engines (fused experts on
lumenrl-quant's torch path; no roofline).
GPU: ``python -m benchmarks run gpu --only moe_decode_speed``.
Profile (where the recording and FP8-expert time goes): ``python -m benchmarks.moe.decode_speed --profile``.
Recording cost per ``KernelOptions`` variant, side by side in one process:
``python -m benchmarks.moe.decode_speed --record-cost "pdl=on;pdl=off"`` (``--smoke``: the CPU shape).
"""

from __future__ import annotations

import statistics
import time

import torch
from benchmarks.telemetry import GpuSampler, summarize
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.engines import KernelOptions, NativeEngine
from lumenrl_core.data_proto import DataProto
from lumenrl_moe import uninstall_routing
from lumenrl_quant import get_quant_scheme

__all__ = ["moe_decode_speed"]

FULL = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            intermediate_size=6144, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            vocab_size=151936, norm_topk_prob=True, max_position_embeddings=4096)
SMOKE = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             norm_topk_prob=True, max_position_embeddings=512)


class _Tok:  # the engine only decodes response text with it
    eos_token_id, pad_token_id = None, 0

    def batch_decode(self, rows, **_):
        return ["" for _ in rows]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(shape: dict, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **shape), dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model.eval()


def _engine(model, batch, new: int, *, device: str, compile: str, record: bool = False, fused_moe: str = "on",
            quant_scheme=None, kernels: dict | None = None) -> tuple[NativeEngine, dict]:
    """A native engine over ``model``, warmed up (compiled, graphs captured), and its sampling params;
    ``kernels``: further ``KernelOptions`` overrides."""
    torch._dynamo.reset()
    rows, prompt = batch.batch["input_ids"].shape
    engine = NativeEngine(model, _Tok(), device=device, max_batch_size=rows, max_seq_len=prompt + new,
                          compile=compile, record_routes=record,
                          kernels=KernelOptions(**{"fused_moe": fused_moe, **(kernels or {})}),
                          quant_scheme=quant_scheme)
    if fused_moe == "on":
        assert engine.moe.report.fused and not engine.moe.report.skipped, engine.moe.report
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new}
    engine.generate(batch, params)  # compile + capture
    return engine, params


def _decode_s(engine: NativeEngine, batch, params: dict, device: str, parts: dict | None = None) -> float:
    """Seconds of one generate call less its prefill; ``parts`` (optional) gets ``loop`` (the engine's own
    time up to its final sync, less prefill) and ``post`` (building the returned batch after that sync)."""
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(batch, params)
    _sync(device)
    wall, perf = time.perf_counter() - start, out.meta_info["perf"]
    if parts is not None:
        parts["loop"], parts["post"] = perf["seconds"] - perf["prefill_seconds"], wall - perf["seconds"]
    return wall - perf["prefill_seconds"]


def _native(model, batch, new: int, *, device: str, compile: str, fused_moe: str = "on",
            quant_scheme=None) -> tuple[float, float]:
    """(decode tok/s, decode seconds): the median of three generate calls after a warm-up call."""
    engine, params = _engine(model, batch, new, device=device, compile=compile, fused_moe=fused_moe,
                             quant_scheme=quant_scheme)
    decode_s = statistics.median(_decode_s(engine, batch, params, device) for _ in range(3))
    return batch.batch["input_ids"].shape[0] * (new - 1) / decode_s, decode_s


def _record_cost(model, batch, new: int, *, device: str, compile: str, runs: int = 3, calls: int = 5,
                 kernels: dict | None = None) -> dict:
    """R3 recording cost, robust to drift: a plain and a recording engine over the same model, both warmed
    up, then ``runs`` rounds of ``calls`` generate calls each, interleaved (plain, recording, plain, ...);
    per round the cost is median(recording) / median(plain) - 1; reported: the median round, the spread
    of the rounds, the plain engine's decode rate over all its calls, and each engine's spread of call times
    over all rounds ((max - min) / median: which of the two jitters when the rounds disagree). The plain engine is built (and
    its decode graphs captured) before the recording engine patches the routers."""
    plain, params = _engine(model, batch, new, device=device, compile=compile, kernels=kernels)
    recording, _ = _engine(model, batch, new, device=device, compile=compile, record=True, kernels=kernels)
    rounds, every = [], {False: [], True: []}
    loops, posts, loop_rounds = {False: [], True: []}, {False: [], True: []}, []  # where a round's cost is
    spans: dict[bool, list[tuple[float, float]]] = {False: [], True: []}  # wall-clock windows of each engine's calls
    round_spans = []
    with GpuSampler() as sampler:  # did the GPU's clock move between the calls or the rounds?
        for _ in range(runs):
            times: dict[bool, list[float]] = {False: [], True: []}
            loop: dict[bool, list[float]] = {False: [], True: []}
            round_from = time.time()
            for _ in range(calls):
                for record, engine in ((False, plain), (True, recording)):
                    call_from, parts = time.time(), {}
                    times[record].append(_decode_s(engine, batch, params, device, parts))
                    spans[record].append((call_from, time.time()))
                    loop[record].append(parts["loop"])
                    posts[record].append(parts["post"])
            round_spans.append((round_from, time.time()))
            rounds.append(100.0 * (statistics.median(times[True]) / statistics.median(times[False]) - 1.0))
            loop_rounds.append(100.0 * (statistics.median(loop[True]) / statistics.median(loop[False]) - 1.0))
            for record in loop:
                loops[record] += loop[record]
            for record in times:
                every[record] += times[record]
    uninstall_routing(model)  # the model's own routers for the next engines
    rows = batch.batch["input_ids"].shape[0]

    def spread_pct(values: list[float]) -> float:  # which engine's calls jitter: (max - min) / median
        return 100.0 * (max(values) - min(values)) / statistics.median(values)

    return {"native_decode_tok_s": rows * (new - 1) / statistics.median(every[False]),
            "record_overhead_pct": statistics.median(rounds), "record_overhead_spread_pct": max(rounds) - min(rounds),
            "record_overhead_rounds": ", ".join(f"{r:.2f}" for r in rounds),
            "plain_call_spread_pct": spread_pct(every[False]), "recording_call_spread_pct": spread_pct(every[True]),
            # the same split at the engine's final sync: the decode loop's cost, and each engine's host time
            # after it (the returned batch; the recording engine's includes laying out the routes)
            "record_overhead_loop_pct": statistics.median(loop_rounds),
            "record_overhead_loop_rounds": ", ".join(f"{r:.2f}" for r in loop_rounds),
            "plain_loop_spread_pct": spread_pct(loops[False]), "recording_loop_spread_pct": spread_pct(loops[True]),
            "plain_post_ms": 1e3 * statistics.median(posts[False]),
            "recording_post_ms": 1e3 * statistics.median(posts[True]),
            **_clocks(sampler, spans, round_spans)}


def _clocks(sampler: GpuSampler, spans: dict[bool, list[tuple[float, float]]],
            round_spans: list[tuple[float, float]]) -> dict:
    """The GPU's median SM clock during each engine's calls (``plain_sm_mhz``, ``recording_sm_mhz``) and per
    round (``round_sm_mhz``); nothing without NVML (a CPU run)."""
    def clock(windows: list[tuple[float, float]]) -> float | None:
        inside = [s for a, b in windows for s in sampler.samples if s.t >= a and max(s.t, s.t_end) <= b]
        return summarize(inside).get("sm_mhz_median")

    plain, recording, per_round = clock(spans[False]), clock(spans[True]), [clock([w]) for w in round_spans]
    if plain is None or recording is None:
        return {}
    return {"plain_sm_mhz": plain, "recording_sm_mhz": recording,
            "round_sm_mhz": ", ".join("-" if c is None else f"{c:.0f}" for c in per_round)}


def _hf(model, batch, new: int, device: str) -> float:
    ids, mask = batch.batch["input_ids"].to(device), batch.batch["attention_mask"].to(device)

    def run(n):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        return time.perf_counter() - start

    run(2)
    prefill, total = run(1), run(new)
    return ids.shape[0] * (new - 1) / max(total - prefill, 1e-9)


def _setup(smoke: bool) -> tuple:
    """(device, shape, (rows, prompt, new), model, batch, compile mode) of the full or the smoke run."""
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    shape, (rows, prompt, new) = (SMOKE, (4, 16, 8)) if smoke else (FULL, (64, 256, 128))
    model = _model(shape, device, torch.float32 if device == "cpu" else torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, shape["vocab_size"] - 1, (rows, prompt), generator=g)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return device, shape, (rows, prompt, new), model, batch, "full" if device == "cuda" else "none"


def record_cost_variants(specs: str, smoke: bool) -> dict[str, dict]:
    """``--record-cost "pdl=on;pdl=off"``: the R3 recording cost (:func:`_record_cost`) per ``KernelOptions``
    variant (``NAME=VALUE,...``, ';'-separated, as ``bench_decode.py --kernels``), one variant after another
    in one process; the variants' rounds are printed side by side."""
    from benchmarks.gpu.bench_decode import kernel_overrides

    device, _, (_, _, new), model, batch, compile = _setup(smoke)
    results = {}
    for spec in specs.split(";"):
        results[spec] = _record_cost(model, batch, new, device=device, compile=compile, kernels=kernel_overrides(spec))
        print(f"{spec or 'default':24s} {results[spec]}", flush=True)
    return results


def moe_decode_speed(smoke: bool) -> dict:
    device, shape, (rows, prompt, new), model, batch, compile = _setup(smoke)
    out = {"device": device, "shape": "smoke" if smoke else "qwen3-30b-a3b x12 layers", "batch": rows,
           "prompt": prompt, "new": new, "compile": compile,
           "experts_implementation": model.config._experts_implementation}
    out.update(_record_cost(model, batch, new, device=device, compile=compile))
    fused = out["native_decode_tok_s"]
    out["grouped_mm_decode_tok_s"] = _native(model, batch, new, device=device, compile=compile, fused_moe="off")[0]
    out["fused_vs_grouped_mm"] = fused / out["grouped_mm_decode_tok_s"]
    out["hf_decode_tok_s"] = _hf(model, batch, new, device)
    out["native_vs_hf"] = fused / out["hf_decode_tok_s"]
    if device == "cuda":
        out["roofline_tok_s"] = _roofline(model, rows, prompt, new)
        out["roofline_pct"] = 100.0 * fused / out["roofline_tok_s"]
    # FP8 experts only (attention linears skipped), then the whole fp8_block scheme; both quantize the model
    experts_only = get_quant_scheme("fp8_block", skip_modules=("lm_head", "self_attn"))
    fp8, _ = _native(model, batch, new, device=device, compile=compile, quant_scheme=experts_only)
    out["fp8_experts_decode_tok_s"] = fp8
    out["fp8_experts_vs_bf16"] = fp8 / fused
    if device == "cuda":
        out["fp8_experts_roofline_pct"] = 100.0 * fp8 / _roofline(model, rows, prompt, new)
    out["fp8_rollout_vs_bf16"] = _native(model, batch, new, device=device, compile=compile,
                                         quant_scheme="fp8_block")[0] / fused
    return out


def _roofline(model, rows: int, prompt: int, new: int) -> float:
    """Decode tokens/s at the measured copy bandwidth when every weight (as now stored) is read per step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import _common as C

    roof = C.decode_roofline(model, batch=rows, prompt_len=prompt, new_tokens=new, bandwidth_gbs=C.copy_bandwidth_gbs())
    return roof["tokens_per_s"]


def profile(new: int = 64) -> None:
    """Kernel tables of one decode call per variant (bf16; R3 router patched but not writing; R3 recording;
    FP8 experts): decode ms/step side by side, then the top kernels by CUDA time of each variant."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lumenrl_moe import RecordTarget

    model = _model(FULL, "cuda", torch.bfloat16)
    ids = torch.randint(10, FULL["vocab_size"] - 1, (64, 256), generator=torch.Generator().manual_seed(1))
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    write = RecordTarget.write
    variants = {"bf16": {}, "r3_no_write": {"record": True}, "r3_record": {"record": True},
                "fp8_experts": {"quant_scheme": get_quant_scheme("fp8_block", skip_modules=("lm_head", "self_attn"))}}
    rows, tables = [], {}
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new}
    for name, kwargs in variants.items():
        RecordTarget.write = (lambda *a, **k: None) if name == "r3_no_write" else write
        torch._dynamo.reset()
        counters.clear()
        engine = NativeEngine(model, _Tok(), device="cuda", max_batch_size=64, max_seq_len=256 + new, compile="full",
                              record_routes=kwargs.get("record", False), kernels=KernelOptions(fused_moe="on"),
                              quant_scheme=kwargs.get("quant_scheme"))
        engine.generate(batch, params)  # compile + capture
        timed = {}
        for steps in (new // 4, new):  # per decode step by difference: prefill and per-call costs cancel
            engine.generate(batch, {**params, "max_new_tokens": steps})
            _sync("cuda")
            start = time.perf_counter()
            out = engine.generate(batch, {**params, "max_new_tokens": steps})
            _sync("cuda")
            timed[steps] = time.perf_counter() - start
        decode_s = timed[new] - out.meta_info["perf"]["prefill_seconds"]
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(batch, params)
            _sync("cuda")
        print(f"{name}: cuda_graphs={out.meta_info['perf']['cuda_graphs']} graph_error={engine.graphs.error!r} "
              f"graph_breaks={sum(counters['graph_break'].values())} prefill_s={out.meta_info['perf']['prefill_seconds']:.4f} "
              f"call_s={timed[new]:.4f} per-step by difference "
              f"{1e3 * (timed[new] - timed[new // 4]) / (new - new // 4):.3f} ms")
        if engine.routes.enabled:
            uninstall_routing(model)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        tables[name] = sorted(kernels, key=lambda e: -e.device_time_total)[:8]
        rows.append((name, 1e3 * decode_s / (new - 1), sum(e.count for e in kernels),
                     sum(e.device_time_total for e in kernels) / 1e3))
    RecordTarget.write = write
    for name, events in tables.items():
        print(f"-- {name}: top kernels (name, calls, total ms)")
        for e in events:
            print(f"   {e.key[:70]:70s} {e.count:7d} {e.device_time_total / 1e3:9.2f}")
    print(f"{'variant':14s} {'ms/step':>8s} {'kernels':>8s} {'kernel ms':>10s}  (one generate: prefill + {new - 1} steps)")
    for name, ms, count, total in rows:
        print(f"{name:14s} {ms:8.3f} {count:8d} {total:10.2f}")


if __name__ == "__main__":
    import sys

    if "--profile" in sys.argv:
        profile()
    elif "--record-cost" in sys.argv:  # python -m benchmarks.moe.decode_speed --record-cost "pdl=on;pdl=off" [--smoke]
        record_cost_variants(sys.argv[sys.argv.index("--record-cost") + 1], smoke="--smoke" in sys.argv)
    else:
        for key, value in moe_decode_speed(smoke="--full" not in sys.argv).items():
            print(f"{key:28s} {value}")
