"""Training speed of the FSDP2 backend on one GPU: tokens/s and MFU, BF16 vs FP8, packing.

Every variant runs ``FSDP2Backend.train_step`` (the real RL path: fp32 master weights, bf16
mixed precision, fused AdamW, grad clipping, log-probs + entropy of the response tokens and a
policy-gradient loss) on random-initialized Qwen3 shapes, with the rows on the host as the RL trainer
passes them (``--batch-on-device``: already on the GPU):

* ``1.7b``: Qwen3-1.7B (hidden 2048, intermediate 6144, 28 layers, 16/8 heads, head_dim 128,
  vocab 151936, tied embeddings), 8 x 1024 tokens per step (1 prompt + 1023 response tokens per
  row, so the LM head runs on every position, as in a plain LM step). MFU = 6 * params * tokens
  / step time / 989e12 (the issue's convention; params = unique parameters, 1.72e9).
  Variants: eager, ``compile_layers`` (torch.compile per decoder layer), activation
  checkpointing, FP8 training (lumenrl-quant, all decoder linears; LM head stays bf16).
  ``+single``: the one-rank fast path (``single_device="on"``: no fully_shard, bf16 module
  weights, fp32 master weights and gradients in flat buffers, foreach accumulate/clip, fused
  AdamW); the variants without it pin ``single_device="off"`` (fully_shard on one rank), so both
  are measured side by side. ``+16x1024``: 16 rows per optimizer step in 2 micro-batches of 8
  (twice the tokens per optimizer step; the optimizer cost is amortized over them).
  ``+torch_adamw``: torch's fused AdamW instead of the flat Triton AdamW (``training/flat_adamw.py``, the CUDA
  default of both paths), for the side-by-side optimizer cost.
  ``+mix_order`` / ``+mix_split64``: the single-device compiled step with the decoder layers' Inductor options
  (``training.modeling.LAYER_INDUCTOR_OPTIONS``) changed for that variant: Inductor's mix-order reduction back
  on (its own default, which the layers turn off), or on with a 64-row split, to time against the default.
  ``+cdt``: the same with Inductor's coordinate-descent tuning of the compiled kernels' launch parameters.
  ``+ungrouped``: the single-device step with a GEMM per projection; the other single-device variants run q/k/v
  and gate/up as one GEMM each on CUDA (``policy.train.group_projections: auto``, the default).
  ``+flash`` / ``+cudnn`` / ``+efficient``: the compiled step (single-device or fully_shard) with that SDPA
  backend tried first, compile and steps alike, against torch's own choice.
  Before timing any ``+single`` variant, :func:`check_single_vs_sharded` runs one step of both
  paths on a small Qwen3 on the GPU and requires equal losses, grad norms and master updates
  (within bf16 tolerance); its result is in the JSON (``numerics_check``).
* ``1.7b-ragged``: the same model on an RL-shaped batch (random prompt 16..256 and response
  32..768 tokens in a 8 x 1024 grid): packing ``auto`` vs ``none``; tokens/s counts valid tokens.
* ``8b-layers``: Qwen3-8B linear shapes (hidden 4096, intermediate 12288, 32/8 heads) with 4
  decoder layers and a 4096-token vocabulary (so the decoder linears dominate), BF16 vs FP8
  (tensorwise and blockwise recipes), measured side by side in this run.

    python benchmarks/gpu/bench_train.py [--steps 5] [--variants a,b] [--smoke] [--gemm-groups 2]

Writes ``train.json`` (to $LUMENRL_BENCH_OUT or benchmarks/results) and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import statistics
import time
import traceback
from typing import Any
from unittest import mock

import torch

from benchmarks.gpu._common import OUT_DIR, command_line, environment, print_table, write_json  # noqa: E402
from benchmarks.gpu.trace_gaps import format_gaps, profile_gaps  # noqa: E402
from benchmarks.telemetry import GpuSampler  # noqa: E402
from lumenrl_backends.training.fsdp2 import FSDP2Backend  # noqa: E402
from lumenrl_backends.training.local_shards import flat_steps  # noqa: E402
from lumenrl_backends.training.modeling import LAYER_INDUCTOR_OPTIONS  # noqa: E402
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig, TrainingQuantConfig  # noqa: E402
from lumenrl_core.data_proto import DataProto  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet
ROWS, SEQ = 8, 1024

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "1.7b": (2048, 6144, 28, 16, 8, 151936, True),
    "8b-layers": (4096, 12288, 4, 32, 8, 4096, False),
    "smoke": (128, 256, 2, 4, 2, 512, True),
}

# name: (shape, batch kind, backend kwargs, fp8 recipe or None, activation checkpointing)
# backend kwargs may also hold "rows" (per optimizer step) and "micro" (rows per micro-batch)
OFF, ON = {"single_device": "off"}, {"single_device": "on"}
COMPILE = {"compile_layers": True}
VARIANTS: dict[str, tuple[str, str, dict[str, Any], str | None, bool]] = {
    "1.7b/bf16": ("1.7b", "full", {**OFF}, None, False),
    "1.7b/bf16+single": ("1.7b", "full", {**ON}, None, False),
    "1.7b/bf16+ac": ("1.7b", "full", {**OFF}, None, True),
    "1.7b/fp8-tensorwise": ("1.7b", "full", {**OFF}, "tensorwise", False),
    "1.7b-ragged/packed": ("1.7b", "ragged", {"packing": "auto", **OFF}, None, False),
    "1.7b-ragged/padded": ("1.7b", "ragged", {"packing": "none", **OFF}, None, False),
    "8b-layers/bf16": ("8b-layers", "full", {**OFF}, None, False),
    "8b-layers/fp8-tensorwise": ("8b-layers", "full", {**OFF}, "tensorwise", False),
    "8b-layers/fp8-blockwise": ("8b-layers", "full", {**OFF}, "blockwise", False),
    # torch.compile variants last: their first step compiles (time reported as first_step_s)
    "1.7b/bf16+compile": ("1.7b", "full", {**COMPILE, **OFF}, None, False),
    "1.7b/bf16+compile+single": ("1.7b", "full", {**COMPILE, **ON}, None, False),
    "1.7b/bf16+compile+single+torch_adamw": ("1.7b", "full", {**COMPILE, **ON, "flat_optimizer": False}, None, False),
    "1.7b/bf16+compile+torch_adamw": ("1.7b", "full", {**COMPILE, **OFF, "flat_optimizer": False}, None, False),
    "1.7b/bf16+compile+single+16x1024": ("1.7b", "full", {**COMPILE, **ON, "rows": 16, "micro": 8}, None, False),
    "1.7b-ragged/packed+compile+single": ("1.7b", "ragged", {"packing": "auto", **COMPILE, **ON}, None, False),
    "8b-layers/bf16+compile": ("8b-layers", "full", {**COMPILE, **OFF}, None, False),
    "8b-layers/bf16+compile+single": ("8b-layers", "full", {**COMPILE, **ON}, None, False),
    "8b-layers/fp8-tensorwise+compile": ("8b-layers", "full", {**COMPILE, **OFF}, "tensorwise", False),
    # Inductor's mix-order reduction (each RMSNorm backward: one kernel for the input gradient and per-split
    # partial sums of the weight gradient, then an ATen sum over the splits in the wrapper), which the compiled
    # layers turn off (decision 0006): these variants turn it back on, with Inductor's split-size heuristic
    # (rows / (8 x SMs), clamped to 16..128) or a 64-row split, for the side-by-side timing.
    **{f"1.7b/bf16+compile+single+{tag}": ("1.7b", "full", {**COMPILE, **ON, "inductor": patch}, None, False)
       for tag, patch in (("mix_order", {"triton.mix_order_reduction": True}),
                          ("mix_split64", {"triton.mix_order_reduction": True,
                                           "triton.mix_order_reduction_split_size": 64}))},
    # Inductor's coordinate-descent tuning of the layers' compiled (elementwise/reduction) kernels' launch parameters
    "1.7b/bf16+compile+single+cdt": ("1.7b", "full", {**COMPILE, **ON, "inductor": {"coordinate_descent_tuning": True}},
                                     None, False),
    # a GEMM per projection: the default groups q/k/v and gate/up on CUDA (training/grouped_linear.py)
    "1.7b/bf16+compile+single+ungrouped": ("1.7b", "full", {**COMPILE, **ON, "group_projections": "off"}, None, False),
    # SDPA backend priority for the whole variant (compile and steps): one backend tried first, for the
    # side-by-side timing against torch's own choice (cuDNN's fused attention on the GPU image's torch 2.11, H100/H200;
    # FlashAttention-2 measured 3.5% slower per step there, decision 0006)
    **{f"1.7b/bf16+compile{mode}+{tag}": ("1.7b", "full", {**COMPILE, **flags, "sdpa": tag}, None, False)
       for tag in ("flash", "cudnn", "efficient") for mode, flags in (("+single", ON), ("", OFF))},
}

# the SDPA backends a "sdpa" variant key puts first (the rest keep torch's order behind them)
SDPA_FIRST = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION"}


@contextlib.contextmanager
def sdpa_priority(tag: str | None):
    """The SDPA backend ``tag`` tried first while the block runs (nothing for None).

    The backend is chosen when a layer is traced and is not part of dynamo's guards or the compile caches' keys, so
    a layer compiled earlier in the process (or on this machine) would run its old choice silently: the block runs
    with dynamo reset and the on-disk caches off, and resets dynamo again after it."""
    if tag is None:
        yield
        return
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = getattr(SDPBackend, SDPA_FIRST[tag])
    order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                   SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH) if b != first]
    torch._dynamo.reset()
    try:
        with sdpa_kernel(order, set_priority=True), inductor_config.patch(force_disable_caches=True):
            yield
    finally:
        torch._dynamo.reset()


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    cfg = AutoConfig.for_model(
        "qwen3", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128 if shape != "smoke" else 32,
        vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=40960,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_batch(kind: str, vocab: int, rows: int, seq: int, device: torch.device) -> DataProto:
    """``full``: 1 prompt + (seq-1) response tokens per row; ``ragged``: RL-like random lengths."""
    g = torch.Generator().manual_seed(1)
    prompt = seq // 4 if kind == "ragged" else 1
    resp = seq - prompt
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    attn = torch.ones(rows, seq, dtype=torch.long)
    if kind == "ragged":
        for i in range(rows):
            p = int(torch.randint(prompt // 16, prompt + 1, (1,), generator=g))
            r = int(torch.randint(resp // 24, resp + 1, (1,), generator=g))
            attn[i] = 0
            attn[i, prompt - p : prompt + r] = 1
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "responses": ids[:, prompt:],
        "response_mask": attn[:, prompt:].float(),
        "advantages": torch.randn(rows, resp, generator=g),
    }
    return DataProto.from_dict(tensors={k: v.to(device) for k, v in tensors.items()})


def pg_loss(outputs: dict, micro: Any):
    mask = micro.batch["response_mask"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {"actor/entropy": (outputs["entropy"].detach() * mask).sum() / mask.sum()}


# training kernels by class (first match wins): attention before gemm (cuDNN's SDPA kernels say "sm90_")
TRAIN_KERNEL_CLASSES = (
    ("optimizer", ("multi_tensor_apply", "fused_adam", "adamw", "sumsq")),  # AdamW (torch's or flat), copies, norms
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("inductor", ("triton_poi", "triton_per", "triton_red")),  # compiled norms, RoPE, SwiGLU, log-probs
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
)


def _train_kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in TRAIN_KERNEL_CLASSES if any(k in low for k in keys)), "other")


def profile_step(name: str, backend: FSDP2Backend, batch: DataProto) -> dict[str, Any]:
    """One profiled step: top kernels by device time to <out>/profile_<variant>.txt (and stdout); returns
    where the step's GPU time goes: ms by kernel class, kernel busy time, span and idle (launch gaps, host
    syncs), wall of the profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        backend.train_step(batch, pg_loss)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"profile_{name.replace('/', '_').replace('+', '_')}.txt").write_text(table)
    print("\n".join(table.splitlines()[:22]), flush=True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
               and not getattr(e, "is_user_annotation", False)]  # GPU-side ranges (Optimizer.step, FSDP::...) overlap kernels
    if not kernels:
        return {}
    by_class: dict[str, float] = {}
    for e in kernels:
        cls = _train_kernel_class(e.name)
        by_class[cls] = by_class.get(cls, 0.0) + e.time_range.elapsed_us() / 1e3
    busy = sum(by_class.values())
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    out = {f"{cls}_ms": round(ms, 2) for cls, ms in sorted(by_class.items(), key=lambda kv: -kv[1])}
    out.update(busy_ms=round(busy, 2), span_ms=round(span, 2), idle_ms=round(span - busy, 2),
               wall_ms_profiled=round(wall * 1e3, 2))
    print(f"profile {name}: " + ", ".join(f"{k} {v}" for k, v in out.items()), flush=True)
    gaps = profile_gaps(prof, top=3)  # the largest idle gaps and the host work that covered them
    print(format_gaps(gaps), flush=True)
    for i, g in enumerate(gaps, 1):
        out[f"gap{i}"] = f"{g['gap_us'] / 1e3:.2f} ms before {g['after']} (host: {g['host']})"
    return out


def run_variant(
    name: str, steps: int, warmup: int, device: torch.device, rows: int, seq: int, profile: bool = False,
    batch_on_device: bool = False,
) -> dict[str, Any]:
    shape, kind, kwargs, recipe, ac = VARIANTS[name]
    kwargs = dict(kwargs)
    rows = kwargs.pop("rows", rows)
    micro = kwargs.pop("micro", rows)
    flat = kwargs.pop("flat_optimizer", None)
    kwargs.pop("inductor", None)  # the layers' Inductor options: set around this call by main
    kwargs.pop("sdpa", None)  # the SDPA backend order: likewise
    model = build_model(shape, device)
    params = sum(p.numel() for p in model.parameters())  # unique (tied counted once)
    vocab = model.config.vocab_size
    fp8 = TrainingQuantConfig(precision="fp8", recipe=recipe) if recipe else None
    backend = FSDP2Backend(
        model, role="actor", optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        train=PolicyTrainConfig(micro_batch_size=micro, gradient_checkpointing=ac),
        num_training_steps=100, device=device, fp8=fp8, **kwargs,
    )
    if flat is not None:  # the single-device path's flat AdamW, or fully_shard's over the local shards
        (backend.single or backend).flat_optimizer = flat
    # the rows on the host, as the RL trainer hands them to train_step (its rollout batches live there); the
    # backend copies them each step. batch_on_device: already on the GPU (the counts and the packing plan then
    # read them back, a wait for the queued work at each step's start)
    batch = make_batch(kind, vocab, rows, seq, device if batch_on_device else torch.device("cpu"))
    tokens = int(batch.batch["attention_mask"].sum())
    times: list[float] = []
    first = 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed_from = 0.0
    with GpuSampler() as sampler:  # the GPU's clock and power over the timed steps (power-capped GEMMs run slower)
        for i in range(warmup + steps):
            sync(device)
            if i == warmup:
                timed_from = time.time()
            t0 = time.perf_counter()
            metrics = backend.train_step(batch, pg_loss)
            sync(device)
            dt = time.perf_counter() - t0
            if i == 0:
                first = dt
            if i >= warmup:
                times.append(dt)
    gpu = sampler.summary(since=timed_from)
    step = statistics.median(times)
    breakdown = profile_step(name, backend, batch) if profile and device.type == "cuda" else {}
    out = {
        "variant": name, "shape": shape, "params": params, "tokens": tokens, "rows": rows, "micro": micro,
        "single_device": backend.single is not None, "batch_on_device": batch_on_device, "step_s": step,
        "flat_adamw": backend.single.flat_active if backend.single is not None else flat_steps(backend.optimizer) > 0,
        "step_s_min": min(times), "step_s_max": max(times), "first_step_s": first,
        "tokens_per_s": tokens / step, "tflops_6n": 6 * params * tokens / step / 1e12,
        "mfu": 6 * params * tokens / step / PEAK_FLOPS, "loss": metrics["actor/loss"],
        "grad_norm": metrics["actor/grad_norm"], "fp8_layers": len(backend.fp8_report.converted) if fp8 else 0,
    }
    if breakdown:
        out["profile"] = breakdown
    if gpu:
        out["gpu"] = gpu
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del backend, model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def check_single_vs_sharded(device: torch.device) -> dict[str, Any]:
    """One train_step of the single-device path vs fully_shard from the same weights (small Qwen3).

    Raises if loss, grad norm or the fp32 master update differ beyond bf16 tolerance.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=2048, tie_word_embeddings=True,
        max_position_embeddings=1024, attn_implementation="sdpa",
    )
    batch = make_batch("ragged", cfg.vocab_size, 4, 256, device)
    runs = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        with device:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        backend = FSDP2Backend(
            model, role="actor", optim=OptimConfig(lr=1e-3, grad_clip=1.0),
            train=PolicyTrainConfig(micro_batch_size=2), num_training_steps=10, device=device, single_device=mode,
        )
        before = {k: v.clone() for k, v in backend.named_weights()}
        metrics = backend.train_step(batch, pg_loss)
        delta = {k: v - before[k] for k, v in backend.named_weights()}
        runs[mode] = (metrics, delta)
    (m_off, d_off), (m_on, d_on) = runs["off"], runs["on"]
    dot = sum(float((d_on[k].double() * d_off[k].double()).sum()) for k in d_off)
    norm_on = sum(float(d_on[k].double().square().sum()) for k in d_on) ** 0.5
    norm_off = sum(float(d_off[k].double().square().sum()) for k in d_off) ** 0.5
    cosine = dot / max(norm_on * norm_off, 1e-30)
    out = {
        "loss": [m_off["actor/loss"], m_on["actor/loss"]],
        "grad_norm": [m_off["actor/grad_norm"], m_on["actor/grad_norm"]],
        "update_cosine": cosine, "update_norm": [norm_off, norm_on],
    }
    ok = (
        abs(m_on["actor/loss"] - m_off["actor/loss"]) <= 1e-3 * abs(m_off["actor/loss"]) + 1e-5
        and abs(m_on["actor/grad_norm"] - m_off["actor/grad_norm"]) <= 1e-2 * m_off["actor/grad_norm"]
        and cosine > 0.99  # Adam's first update is ~lr*sign(g): only near-zero gradients may flip
        and abs(norm_on - norm_off) <= 0.01 * norm_off
    )
    print(f"numerics check single_device on vs off: {'OK' if ok else 'MISMATCH'} {out}", flush=True)
    if not ok:
        raise AssertionError(f"single-device path disagrees with fully_shard: {out}")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gemm_groups(shape: str, tokens: int, device: torch.device, rounds: int = 2, iters: int = 10) -> list[dict[str, Any]]:
    """Forward + backward of a layer's q/k/v and gate/up projections at ``tokens`` rows: each member's own
    ``F.linear`` against one :class:`~lumenrl_backends.training.grouped_linear.GroupedLinear` GEMM over the
    stacked weights (the grouped single-device step's op), alternating ``rounds`` times; microseconds per call. Raises if
    the two disagree beyond the compute dtype's rounding. Both run eagerly, so the grouped backward's concatenation
    of the members' output gradients is a copy here."""
    hidden, inter, _, heads, kv, _, _ = SHAPES[shape]
    head_dim = 128 if shape != "smoke" else 32
    rows: list[dict[str, Any]] = []
    for name, outs in (("qkv", (heads * head_dim, kv * head_dim, kv * head_dim)), ("gate_up", (inter, inter))):
        rows += _time_group(name, outs, hidden, tokens, device, rounds, iters)
    print_table(rows, ["group", "mode", "round", "us"])
    return rows


def _time_group(name: str, outs: tuple[int, ...], hidden: int, tokens: int, device: torch.device, rounds: int,
                iters: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from lumenrl_backends.training.grouped_linear import GroupedLinear

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    flat = torch.randn(sum(outs) * hidden, generator=g, device=device, dtype=dtype) * hidden**-0.5
    bounds = [sum(outs[:i]) for i in range(len(outs) + 1)]
    weights = [torch.nn.Parameter(flat[a * hidden : b * hidden].view(b - a, hidden)) for a, b in zip(bounds, bounds[1:])]
    fused = flat.view(sum(outs), hidden)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(tokens, sum(outs), generator=g, device=device, dtype=dtype)

    def separate() -> list[torch.Tensor]:  # the outputs as the layer uses them: no concatenation in the timing
        ys = [F.linear(x, w) for w in weights]
        torch.autograd.backward(ys, list(grad.split(list(outs), -1)))
        return ys

    def grouped() -> list[torch.Tensor]:
        ys = list(GroupedLinear.apply(x, fused, *weights))
        torch.autograd.backward(ys, list(grad.split(list(outs), -1)))
        return ys

    def clear() -> None:
        x.grad = None
        for w in weights:
            w.grad = None

    modes = (("separate", separate), ("grouped", grouped))
    results = {}
    for mode, fn in modes:
        clear()
        y = torch.cat(fn(), -1)
        results[mode] = (y.detach().float(), x.grad.float(), torch.cat([w.grad for w in weights]).float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(results["separate"], results["grouped"], strict=True):
        if (a - b).norm() > tol * b.norm():
            raise AssertionError(f"{name}: grouped GEMM output or gradient differs from the separate GEMMs")
    rows = []
    for r in range(rounds):
        for mode, fn in modes:
            sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                clear()
                fn()
            sync(device)
            rows.append({"group": name, "mode": mode, "round": r,
                         "us": round((time.perf_counter() - start) / iters * 1e6, 1)})
    return rows


def matmul_tflops(n: int = 8192, iters: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["variant"]: r for r in results if "step_s" in r}
    summary: dict[str, Any] = {}
    cmd = command_line()
    best_17 = max((r for k, r in by.items() if k.startswith("1.7b/bf16")), key=lambda r: r["mfu"], default=None)
    if best_17:
        summary["train_mfu_1p7b"] = {"value": round(best_17["mfu"], 4), "variant": best_17["variant"],
                                     "tokens_per_s": round(best_17["tokens_per_s"]), "command": cmd}
    for mode in ("", "+compile"):
        sharded, single = by.get(f"1.7b/bf16{mode}"), by.get(f"1.7b/bf16{mode}+single")
        if sharded and single:
            summary[f"single_device_speedup_1p7b{mode.replace('+', '_')}"] = {
                "value": round(sharded["step_s"] / single["step_s"], 3),
                "mfu": [round(sharded["mfu"], 4), round(single["mfu"], 4)], "command": cmd}
    ratios = {}
    for mode in ("", "+compile"):
        base = by.get(f"8b-layers/bf16{mode}")
        for recipe in ("tensorwise", "blockwise"):
            fp8 = by.get(f"8b-layers/fp8-{recipe}{mode}")
            if base and fp8:
                ratios[f"{recipe}{mode}"] = base["step_s"] / fp8["step_s"]
    if ratios:
        best = max(ratios, key=ratios.get)
        summary["fp8_train_speedup_8b"] = {"value": round(ratios[best], 3), "recipe": best,
                                           "all": {k: round(v, 3) for k, v in ratios.items()}, "command": cmd}
    return summary


def _on_alarm(signum, frame):
    raise TimeoutError("variant exceeded --variant-timeout-s")


def main(argv: list[str] | None = None) -> dict:
    signal.signal(signal.SIGALRM, _on_alarm)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip remaining variants after this")
    ap.add_argument("--variant-timeout-s", type=int, default=120, help="abort one variant after this")
    ap.add_argument("--profile", default="1.7b/bf16", help="variants to profile one step of")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the code paths")
    ap.add_argument("--gemm-groups", type=int, default=0, metavar="ROUNDS",
                    help="first time the 1.7B projections' separate against grouped GEMMs (forward + backward at "
                         "rows x seq tokens), alternating ROUNDS times")
    ap.add_argument("--batch-on-device", action="store_true",
                    help="hand train_step rows already on the GPU (default: on the host, as the RL trainer does)")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: {unknown} unknown; allowed: {', '.join(VARIANTS)}")
    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    profiled = [v for v in args.profile.split(",") if v]
    if args.profile != ap.get_default("profile"):  # the default profiles 1.7b/bf16 where it runs, on CUDA
        not_run = [v for v in profiled if v not in args.variants.split(",")]
        if not_run:
            ap.error(f"--profile={args.profile!r}: {not_run} not among --variants "
                     f"({args.variants}); profile only variants that run")
        if profiled and device.type != "cuda":
            ap.error(f"--profile={args.profile!r}: the step profile needs CUDA (this run is on the CPU"
                     f"{', --smoke' if args.smoke else ''}); give --profile ''")
    rows, seq = (ROWS, SEQ) if not args.smoke else (2, 64)
    if args.smoke:
        for name, (_, kind, kwargs, recipe, ac) in list(VARIANTS.items()):
            kwargs = {k: ("eager" if k == "compile_layers" else v) for k, v in kwargs.items()}
            VARIANTS[name] = ("smoke", kind, kwargs, recipe, ac)
    env = environment()
    if device.type == "cuda":
        env["bf16_matmul_tflops_8192"] = round(matmul_tflops(), 1)
    if args.gemm_groups:
        env["gemm_groups"] = gemm_groups("smoke" if args.smoke else "1.7b", rows * seq, device, args.gemm_groups,
                                         iters=1 if args.smoke else 10)
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    if any("+single" in v for v in args.variants.split(",")):
        try:
            env["numerics_check"] = check_single_vs_sharded(device)
        except Exception as exc:  # reported; the timings still run (and say the check failed)
            traceback.print_exc()
            env["numerics_check"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    for name in args.variants.split(","):
        if time.perf_counter() - start > args.budget_s:
            results.append({"variant": name, "skipped": "time budget"})
            continue
        signal.alarm(args.variant_timeout_s)
        try:
            # a variant's layer Inductor options hold while its first step compiles the layers
            with mock.patch.dict(LAYER_INDUCTOR_OPTIONS, VARIANTS[name][2].get("inductor", {})), \
                    sdpa_priority(VARIANTS[name][2].get("sdpa")):
                r = run_variant(name, args.steps, args.warmup, device, rows, seq, name in args.profile.split(","),
                                args.batch_on_device)
        except Exception as exc:  # report and go on: one broken variant must not lose the others
            traceback.print_exc()
            r = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
        finally:
            signal.alarm(0)
        results.append(r)
        print(f"[{time.perf_counter() - start:6.1f}s] {r}", flush=True)
    payload = {"environment": env, "command": command_line(), "rows": rows, "seq": seq,
               "results": results, "summary": summarize(results)}
    path = write_json("train_smoke.json" if args.smoke else "train.json", payload)
    print(f"wrote {path}")
    print_table(
        [{**r, "err": (r.get("error") or r.get("skipped") or "")[:40]} for r in results],
        ["variant", "rows", "micro", "tokens_per_s", "mfu", "step_s", "first_step_s", "peak_mem_gib", "err"],
    )
    for k, v in payload["summary"].items():
        print(k, v)
    return payload


def run(smoke: bool) -> dict:
    """Suite entry: MFU and tokens/s of the 1.7B one-rank compiled train step, through the single-device
    path (``mfu``) and through ``fully_shard`` on a one-rank mesh (``mfu_fsdp2``), side by side, each
    step profiled once (smoke: a tiny model on CPU, eager). After them the single-device step with a GEMM per
    projection (``+ungrouped``: the default groups q/k/v and gate/up on CUDA), between two more single-device runs,
    for ``mfu_ungrouped`` and ``grouped_speedup`` (its step over the mean default step of the runs around it)."""
    sharded, single = ("1.7b/bf16", "1.7b/bf16+single") if smoke else ("1.7b/bf16+compile", "1.7b/bf16+compile+single")
    ungrouped = "1.7b/bf16+compile+single+ungrouped"  # eager in the smoke, as every variant there
    order = f"{sharded},{single},{ungrouped},{single}"
    args = ["--smoke", "--steps", "1", "--warmup", "1", "--profile", "", "--variants", order] if smoke \
        else ["--steps", "4", "--warmup", "2", "--budget-s", "300", "--variant-timeout-s", "110",
              "--profile", f"{sharded},{single}", "--variants", order]
    runs = main(args)["results"]
    for r in runs:
        if "error" in r or "skipped" in r:
            raise RuntimeError(f"{r['variant']}: {r.get('error') or r.get('skipped')}")
    f, r, u, again = runs
    return {"mfu": r["mfu"], "tokens_per_s": r["tokens_per_s"], "step_s": r["step_s"], "mfu_fsdp2": f["mfu"],
            "fsdp2_step_s": f["step_s"], "fsdp2_over_single_step": f["step_s"] / r["step_s"],
            "mfu_ungrouped": u["mfu"], "ungrouped_step_s": u["step_s"], "fsdp2_flat_adamw": float(f["flat_adamw"]),
            "grouped_speedup": u["step_s"] / ((r["step_s"] + again["step_s"]) / 2),
            **{f"profile/{k}": v for k, v in r.get("profile", {}).items()},  # where each step's GPU time goes
            **{f"profile_fsdp2/{k}": v for k, v in f.get("profile", {}).items()},
            **_gpu_numbers("single", r), **_gpu_numbers("fsdp2", f),
            **{key: result["peak_mem_gib"] for key, result in (("peak_mem_gib", r), ("fsdp2_peak_mem_gib", f))
               if "peak_mem_gib" in result}}  # CUDA: the step's peak allocated memory of each path


def _gpu_numbers(side: str, result: dict[str, Any]) -> dict[str, float]:
    """The SM clock, power and power-capped share of one variant's timed steps (absent without NVML)."""
    gpu = result.get("gpu", {})
    return {f"gpu/{side}_{key}": gpu[key] for key in ("sm_mhz_median", "power_w_median", "power_capped_frac")
            if key in gpu}


if __name__ == "__main__":
    main()
