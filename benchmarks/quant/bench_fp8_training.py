"""FP8 vs BF16 training step on Qwen3-8B-shaped decoder layers, eager and torch.compile, one run.

Model (self-contained, no transformers): 4 Qwen3-8B decoder layers (hidden 4096, intermediate
12288, 32 query / 8 KV heads, head_dim 128, q/k RMSNorm, RoPE, causal SDPA, SwiGLU MLP), a
4096-token vocabulary (embedding + untied LM head, kept bf16), bf16 parameters, fused AdamW.
A step is forward + cross-entropy + backward + ``optimizer.step()`` + ``zero_grad`` on 8 x 1024
tokens; step time is the median of ``--steps`` timed steps after ``--warmup`` steps.

Variants (``--variants``, comma separated): ``bf16``, ``bf16+compile``, ``fp8`` (tensorwise, hybrid
E4M3/E5M2, eager), ``fp8+compile`` (decoder layers compiled, quantization fused by inductor),
``fp8+compile-tq`` (compiled, Triton quantize+transpose as an opaque custom op),
``fp8-rowwise`` / ``fp8-blockwise`` (eager). ``+compile`` = ``layer.compile()`` per decoder layer.

Self-checks, printed as ``ERROR ...`` lines (the run continues with the other variants):

* GPU kernels: the fused Triton quantize+transpose is bit-identical to the torch path (E4M3, E5M2);
* every variant's first step (before its optimizer step) is compared with a bf16 eager reference
  on the same weights and batch: loss within 2 % (0.5 % for bf16+compile), gradients of three
  weights (first / last layer, embedding) above an SQNR floor, and the gradient of every linear of
  the first and last layer (+ embedding, LM head, a norm) above 3 dB (0 dB = zero or wrong); each
  per-parameter SQNR is printed;
* a compiled variant run after the eager variant of its recipe (``fp8`` before ``fp8+compile``)
  also compares its first-step gradients with that eager run's, per parameter (floor 15 dB);
* compiled variants: ``torch._dynamo`` graph count after warm-up must not grow while timing
  (no recompiles), and graph breaks are reported.

    python benchmarks/quant/bench_fp8_training.py --variants bf16,bf16+compile,fp8,fp8+compile \\
        --out fp8_train_8b.json        # JSON under $LUMENRL_BENCH_OUT (else benchmarks/results)
    python benchmarks/quant/bench_fp8_training.py --smoke   # tiny shapes, CPU check of the script
    python benchmarks/quant/bench_fp8_training.py --linear  # quantize kernel GB/s + per-linear fwd+bwd
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.quant._common import environment, sqnr, table, time_ms  # noqa: E402
from lumenrl_quant import sqnr_db, triton_training  # noqa: E402  (sqnr_db: 0 dB = zero or wrong gradient)
from lumenrl_quant.training import (  # noqa: E402
    Fp8TrainingConfig,
    Fp8TrainingLinear,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
)

# hidden, intermediate, layers, heads, kv heads, head_dim, vocab, rows, seq
SHAPES = {"8b-layers": (4096, 12288, 4, 32, 8, 128, 4096, 8, 1024), "smoke": (128, 256, 2, 4, 2, 32, 256, 2, 64)}
# name: (fp8 recipe or None, compile, compiled quantize backend)
VARIANTS = {
    "bf16": (None, False, None),
    "fp8": ("tensorwise", False, None),
    "fp8-rowwise": ("rowwise", False, None),
    "fp8-blockwise": ("blockwise", False, None),
    "bf16+compile": (None, True, None),
    "fp8+compile": ("tensorwise", True, "inductor"),
    "fp8+compile-tq": ("tensorwise", True, "triton"),
}
DEFAULT_VARIANTS = "bf16,fp8,bf16+compile,fp8+compile"
PEAK_BF16 = 989e12


# ---------------------------------------------------------------- model


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DecoderLayer(nn.Module):
    """One Qwen3 decoder layer (pre-norm attention with q/k norm and RoPE, SwiGLU MLP)."""

    def __init__(self, hidden: int, inter: int, heads: int, kv: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv, self.head_dim = heads, kv, head_dim
        self.input_norm, self.post_norm = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = self.q_norm(self.q_proj(h).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(h).view(b, t, self.kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        v = v[:, :, None].expand(b, self.kv, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyQwen3(nn.Module):
    def __init__(self, hidden, inter, layers, heads, kv, head_dim, vocab, seq) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, inter, heads, kv, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build(shape: str, dev: torch.device, recipe: str | None, compiled: bool) -> TinyQwen3:
    hidden, inter, layers, heads, kv, head_dim, vocab, _rows, seq = SHAPES[shape]
    torch.manual_seed(0)
    with dev:
        model = TinyQwen3(hidden, inter, layers, heads, kv, head_dim, vocab, seq).to(torch.bfloat16)
    if recipe is not None:  # decoder linears only: embedding and LM head stay bf16
        report = convert_to_fp8_training(model.layers, recipe=recipe, fp8_format="hybrid")
        if len(report.converted) != 7 * layers and shape != "smoke":  # smoke: k/v too narrow for blockwise
            raise RuntimeError(f"expected {7 * layers} FP8 linears: {report}")
    if compiled:  # inductor on GPU; the CPU smoke run only checks tracing (no C++ toolchain needed)
        for layer in model.layers:
            layer.compile(backend="inductor" if dev.type == "cuda" else "aot_eager")
    return model


def make_batch(shape: str, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    *_, vocab, rows, seq = SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return ids[:, :-1].to(dev), ids[:, 1:].to(dev)


def linear_flops(shape: str) -> float:
    hidden, inter, layers, heads, kv, head_dim, vocab, rows, seq = SHAPES[shape]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter
    attn = 2 * 2 * rows * heads * seq * seq * head_dim / 2  # causal QK^T and PV, forward
    return 6 * (per_layer * layers + hidden * vocab) * rows * seq + 3 * attn * layers


_GATE_PARAMS = ("layers.0.down_proj", "layers.-1.q_proj", "embed")  # the bf16-reference SQNR floor applies here
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_params(model: TinyQwen3) -> dict[str, torch.Tensor]:
    """Weights whose first-step gradients are compared: every linear of the first and last layer, more."""
    params = {"embed": model.embed.weight, "lm_head": model.lm_head.weight,
              "layers.0.input_norm": model.layers[0].input_norm.weight}
    for idx in (0, -1):
        for name in _LINEARS:
            params[f"layers.{idx}.{name}"] = getattr(model.layers[idx], name).weight
    return params


# ---------------------------------------------------------------- checks


def kernel_checks(dev: torch.device) -> list[str]:
    """The fused Triton quantize+transpose vs the torch path, bit for bit (GPU with triton only)."""
    errors = []
    if dev.type != "cuda" or not triton_training.triton_importable():
        return errors
    x = torch.randn(1000, 4096, device=dev, dtype=torch.bfloat16) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        try:
            q, qt, s = triton_training.fp8_quantize_with_transpose_triton(x, dtype)
        except Exception as exc:  # the eager path then falls back to torch (warned); keep going
            errors.append(f"fused quantize+transpose {dtype} raised {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rq, rqt, rs = triton_training.quantize_with_transpose_torch(x, dtype)
        same = (torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
                and torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)))
        if not same:
            errors.append(f"fused quantize+transpose {dtype} differs from the torch path")
    return errors


def reference_grads(shape: str, dev: torch.device, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(shape, dev, None, False)
    loss = model(*batch)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in _check_params(model).items()}
    out = loss.item()
    del model, loss
    return out, grads


# ---------------------------------------------------------------- one variant


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_variant(name: str, shape: str, dev: torch.device, batch, ref, steps: int, warmup: int,
                profile_dir: Path | None, same_recipe_eager: dict) -> dict:
    """Time one variant; ``same_recipe_eager`` holds eager first-step grads by recipe (filled here)."""
    from torch._dynamo.utils import counters

    recipe, compiled, quant_backend = VARIANTS[name]
    torch._dynamo.reset()
    counters.clear()
    triton_training.set_compiled_backend(quant_backend or "inductor")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build(shape, dev, recipe, compiled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    if recipe is not None:
        attach_weight_cache_invalidation(opt, model)
    row: dict = {"variant": name, "recipe": recipe or "bf16", "compile": compiled}

    # first step: compile (if any) + numerics vs the bf16 eager reference, before the optimizer step
    t0 = time.perf_counter()
    loss = model(*batch)
    loss.backward()
    _sync(dev)
    row["first_step_s"] = time.perf_counter() - t0
    ref_loss, ref_grads = ref
    row["loss"], row["loss_rel_err"] = loss.item(), abs(loss.item() - ref_loss) / abs(ref_loss)
    grads = {k: p.grad for k, p in _check_params(model).items()}
    row["grad_sqnr_db"] = {k: round(sqnr_db(ref_grads[k], grads[k]), 2) for k in ref_grads}
    print(f"[{name}] first-step grad SQNR vs bf16 eager (dB): {json.dumps(row['grad_sqnr_db'])}", flush=True)
    loss_tol, sqnr_floor = (0.005, 25.0) if recipe is None else (0.02, 10.0)
    bad = [k for k in _GATE_PARAMS if not row["grad_sqnr_db"][k] >= sqnr_floor]
    bad += [k for k, v in row["grad_sqnr_db"].items() if not v >= 3.0]  # 0 dB: zero / wrong gradient
    eager_grads = same_recipe_eager.get(recipe) if compiled else None
    if eager_grads is not None:  # compiled vs eager, same recipe: catches a broken compiled backward directly
        row["grad_sqnr_vs_eager_db"] = {k: round(sqnr_db(eager_grads[k], grads[k]), 2) for k in eager_grads}
        print(f"[{name}] first-step grad SQNR vs eager {recipe or 'bf16'} (dB): "
              f"{json.dumps(row['grad_sqnr_vs_eager_db'])}", flush=True)
        bad += [f"{k} (vs eager)" for k, v in row["grad_sqnr_vs_eager_db"].items() if not v >= 15.0]
    elif not compiled and recipe is not None:  # (bf16 eager: that is the reference itself)
        same_recipe_eager[recipe] = {k: g.detach().clone() for k, g in grads.items()}
    row["numerics_ok"] = row["loss_rel_err"] <= loss_tol and not bad
    if not row["numerics_ok"]:
        print(f"ERROR {name}: numerics: loss rel err vs bf16 eager {row['loss_rel_err']:.4f} (tol {loss_tol}); "
              f"grads below floor ({sqnr_floor} dB vs bf16 for {list(_GATE_PARAMS)}, 3 dB for all, "
              f"15 dB compiled vs eager): {bad}", flush=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss

    def step() -> None:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(0, warmup - 1)):
        step()
    _sync(dev)
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    row["step_s"] = statistics.median(times)
    row["step_s_min"] = min(times)
    row["graphs"] = counters["stats"]["unique_graphs"]
    row["recompiles_while_timing"] = row["graphs"] - graphs_after_warmup
    row["graph_breaks"] = sum(counters["graph_break"].values())
    if compiled and row["recompiles_while_timing"]:
        print(f"ERROR {name}: {row['recompiles_while_timing']} recompiles while timing", flush=True)
    _, _, _, _, _, _, _, rows, seq = SHAPES[shape]
    row["tokens_per_s"] = rows * seq / row["step_s"]
    row["mfu_bf16_peak"] = linear_flops(shape) / row["step_s"] / PEAK_BF16
    if dev.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile_dir is not None:
        row["profile"] = str(profile_step(name, step, dev, profile_dir))
    return row


def profile_step(name: str, step, dev: torch.device, out_dir: Path) -> Path:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=35, max_name_column_width=70)
    path = out_dir / f"profile_fp8_train_{name.replace('+', '_')}.txt"
    path.write_text(text)
    print("\n".join(text.splitlines()[:20]), flush=True)
    return path


# ---------------------------------------------------------------- per-linear view (older benchmark)


def bench_linears(dev: torch.device, smoke: bool) -> list[dict]:
    shapes = [(256, 256, 512)] if smoke else [(8192, 4096, 4096), (8192, 4096, 12288), (8192, 12288, 4096)]
    rows = []
    for m, k, n in shapes:
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        xr, wr = x.detach().double().requires_grad_(True), base.weight.detach().double().requires_grad_(True)
        yr = xr @ wr.t()
        yr.backward(grad.double())

        def fwd_bwd(layer, x=x, grad=grad):
            def call():
                x.grad = layer.weight.grad = None
                layer(x).backward(grad)
            return call

        base_ms = time_ms(fwd_bwd(base), iters=10)
        rows.append({"shape": f"{m}x{k}x{n}", "recipe": "bf16", "ms": base_ms, "speedup": 1.0})
        for recipe in ("tensorwise", "rowwise", "blockwise"):
            layer = Fp8TrainingLinear(k, n, bias=False, device=dev, dtype=torch.bfloat16,
                                      config=Fp8TrainingConfig(recipe=recipe, fp8_format="hybrid"))
            layer.load_state_dict(base.state_dict())
            ms = time_ms(fwd_bwd(layer), iters=10)
            x.grad = layer.weight.grad = None
            y = layer(x)
            y.backward(grad)
            rows.append({"shape": f"{m}x{k}x{n}", "recipe": recipe, "ms": ms, "speedup": base_ms / ms,
                         "sqnr_y": sqnr(yr, y.detach()), "sqnr_dx": sqnr(xr.grad, x.grad),
                         "sqnr_dw": sqnr(wr.grad, layer.weight.grad)})
    return rows


def bench_quantize(dev: torch.device, smoke: bool) -> list[dict]:
    """Fused quantize+transpose (amax pass + one cast pass writing q and q^T) vs the torch ops."""
    rows = []
    for m, k in [(256, 512)] if smoke else [(8192, 4096), (8192, 12288)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        paths = {"torch": triton_training.quantize_with_transpose_torch}
        if dev.type == "cuda" and triton_training.triton_importable():
            paths["triton"] = triton_training.fp8_quantize_with_transpose_triton
        for name, fn in paths.items():
            ms = time_ms(lambda fn=fn, x=x: fn(x, torch.float8_e4m3fn), iters=20)
            # traffic: amax read (2 B) + cast read (2 B) + q and q^T writes (1 + 1 B) per element
            rows.append({"shape": f"{m}x{k}", "path": name, "ms": ms, "GB/s": 6 * m * k / ms / 1e6})
    return rows


# ---------------------------------------------------------------- main


def _out_path(name: str) -> Path:
    path = Path(name)
    if path.is_absolute():
        return path
    base = os.environ.get("LUMENRL_BENCH_OUT")  # on the GPU machine: $OUT (benchmarks/gpu_env.sh)
    return (Path(base) if base else Path(__file__).resolve().parents[1] / "results") / path


def _summary(rows: list[dict]) -> dict:
    by = {r["variant"]: r for r in rows if "step_s" in r}
    out = {}
    for fp8, base in [("fp8", "bf16"), ("fp8+compile", "bf16+compile"), ("fp8+compile", "bf16"),
                      ("fp8+compile-tq", "bf16+compile"), ("fp8-blockwise", "bf16"), ("fp8-rowwise", "bf16")]:
        if fp8 in by and base in by:
            out[f"{fp8} vs {base}"] = round(by[base]["step_s"] / by[fp8]["step_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma separated, of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=140.0, help="skip variants not started by then")
    parser.add_argument("--profile", default="", help="comma separated variants to profile one step of")
    parser.add_argument("--out", default="fp8_train_8b.json", help="JSON file (relative: under $LUMENRL_BENCH_OUT)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--linear", action="store_true", help="per-linear forward+backward table instead")
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.linear:  # the per-linear table runs no training step: refuse the step options
        step_flags = [f"--{k.replace('_', '-')}={getattr(args, k)!r}" for k in ("variants", "steps", "warmup",
                                                                                "budget_s", "profile")
                      if getattr(args, k) != parser.get_default(k)]
        if step_flags:
            parser.error(f"{', '.join(step_flags)}: --linear times single linears and the quantize kernel, no "
                         "training step; drop these (allowed with --linear: --smoke, --out)")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    profiled = {v.strip() for v in args.profile.split(",") if v.strip()}
    if profiled - set(names):
        parser.error(f"--profile={args.profile!r}: {sorted(profiled - set(names))} not among --variants "
                     f"({','.join(names)}); profile only variants that run")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = _out_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.linear:
        quant = bench_quantize(dev, args.smoke)
        print(table(f"FP8 quantize + transpose, bf16 -> e4m3 ({dev})", quant, ["shape", "path", "ms", "GB/s"]))
        rows = bench_linears(dev, args.smoke)
        print(table(f"FP8 training linear, forward + backward ({dev})", rows,
                    ["shape", "recipe", "ms", "speedup", "sqnr_y", "sqnr_dx", "sqnr_dw"]))
        out.write_text(json.dumps({"environment": environment(), "quantize": quant, "rows": rows},
                                  indent=1, default=str))
        return 0
    start = time.perf_counter()
    shape = "smoke" if args.smoke else "8b-layers"
    errors = kernel_checks(dev)
    for e in errors:
        print(f"ERROR {e}", flush=True)
    batch = make_batch(shape, dev)
    ref = reference_grads(shape, dev, batch)
    rows: list[dict] = []
    same_recipe_eager: dict = {}  # recipe -> eager first-step grads, compared with the compiled variant's
    for name in names:
        if time.perf_counter() - start > args.budget_s:
            print(f"ERROR {name}: skipped, --budget-s {args.budget_s} spent", flush=True)
            rows.append({"variant": name, "error": "skipped: budget"})
            continue
        t0 = time.perf_counter()
        try:
            row = run_variant(name, shape, dev, batch, ref, args.steps, args.warmup,
                              out.parent if name in profiled else None, same_recipe_eager)
        except Exception as exc:  # report and continue with the other variants
            traceback.print_exc()
            print(f"ERROR {name}: {type(exc).__name__}: {exc}", flush=True)
            row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:  # a failed "+compile-tq" variant must not leave the Triton quantizer on for the next ones
            triton_training.set_compiled_backend("inductor")
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"[{name}] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items() if k != "variant" and not k.startswith("grad_")),
              flush=True)  # (per-parameter grad SQNRs were printed by run_variant)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    summary = _summary(rows)
    payload = {"environment": environment(), "shape": shape, "dims": SHAPES[shape], "steps": args.steps,
               "warmup": args.warmup, "kernel_check_errors": errors,
               "triton_quant_fallback": list(triton_training._TRITON_FAILED), "speedups": summary, "rows": rows,
               "wall_s": round(time.perf_counter() - start, 1)}
    out.write_text(json.dumps(payload, indent=1, default=str))
    cols = ["variant", "step_s", "tokens_per_s", "mfu_bf16_peak", "peak_gib", "first_step_s", "loss_rel_err",
            "numerics_ok", "graphs", "recompiles_while_timing", "graph_breaks", "error"]
    print(table(f"Training step, {shape} ({dev}), median of {args.steps}", rows, cols))
    print("speedups (step-time ratio):", json.dumps(summary), f"goal >= 1.25: fp8+compile vs bf16+compile = "
          f"{summary.get('fp8+compile vs bf16+compile', math.nan)}")
    print(f"wrote {out}")
    return 0


def run(smoke: bool) -> dict:
    """Suite entry: compiled FP8 (tensorwise) vs compiled BF16 train step seconds, 8B-shaped layers
    (smoke: eager, tiny shapes on the CPU)."""
    bf16, fp8 = ("bf16", "fp8") if smoke else ("bf16+compile", "fp8+compile")
    out = "fp8_train_smoke.json" if smoke else "fp8_train_8b.json"
    main(["--variants", f"{bf16},{fp8}", "--out", out, *(["--smoke", "--steps", "1", "--warmup", "1"] if smoke else [])])
    rows = {r["variant"]: r for r in json.loads(_out_path(out).read_text())["rows"]}
    failed = {k: r["error"] for k, r in rows.items() if "error" in r}
    if failed:
        raise RuntimeError(f"fp8 training variants failed: {failed}")
    return {"bf16_step_s": rows[bf16]["step_s"], "fp8_step_s": rows[fp8]["step_s"],
            "speedup": rows[bf16]["step_s"] / rows[fp8]["step_s"]}


if __name__ == "__main__":
    sys.exit(main())
