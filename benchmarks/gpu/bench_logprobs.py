"""The training step's log-prob kernels (``training/triton_logprobs.py``): launch parameters side by side.

A compiled training step on CUDA turns the (rows, vocabulary) logits into token log-probs and entropies in one
pass (forward) and writes their gradient in one more (backward). Both only stream memory, so each is timed
against the bytes it must move: the forward reads the logits once, the backward reads them and writes the
gradient. Shapes (bf16 logits, Qwen3's 151936-token vocabulary):

* ``train``: the ``train`` entry's step, 8 x 1023 response positions;
* ``grpo``: one micro-batch of the GRPO entry's update, 64 x 256 positions.

For each shape the defaults (``FORWARD`` / ``BACKWARD``) are timed first and last, and every variant of the sweep
between them; each variant's log-probs and entropies must equal the defaults' within 2e-5 and its gradient
within one bf16 ulp of it (else an ``ERROR`` row). ``us`` is the median of ``--iters`` timed calls (CUDA events),
``pct_copy`` the bytes moved per second over the measured device copy bandwidth.

    python benchmarks/gpu/bench_logprobs.py [--shapes train,grpo] [--no-sweep] [--smoke]

``--smoke`` runs a tiny shape and two variants of each sweep in Triton's CPU interpreter. Writes ``logprobs.json``; prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from benchmarks.gpu._common import command_line, copy_bandwidth_gbs, environment, print_table, write_json  # noqa: E402
from benchmarks.quant._common import run_interpreted, time_ms  # noqa: E402
from lumenrl_backends.training import triton_logprobs as tk  # noqa: E402

VOCAB = 151936
SHAPES = {"train": (8, 1023), "grpo": (64, 256), "smoke": (2, 3)}
# every variant names all its launch parameters (they do not depend on the current defaults)
FORWARD_SWEEP: list[dict[str, Any]] = [
    {"block": b, "num_warps": w, "stages": st, "prefetch": pf} for b, w, st, pf in (
        (4096, 8, 1, False),  # the default before the prefetching loop
        (4096, 8, 1, True), (4096, 8, 2, False), (4096, 8, 3, False), (2048, 8, 1, True), (8192, 16, 1, True),
        (2048, 4, 3, False), (8192, 4, 1, True), (8192, 8, 1, False), (8192, 16, 1, False), (16384, 16, 1, False),
        (4096, 2, 1, True), (2048, 4, 1, True))
]
BACKWARD_SWEEP: list[dict[str, Any]] = [
    {"block": b, "chunks": c, "num_warps": w, "stages": st} for b, c, w, st in (
        (4096, 1, 8, 1), (8192, 1, 8, 1), (8192, 1, 16, 1), (2048, 4, 8, 1), (2048, 4, 8, 2), (2048, 8, 8, 3),
        (4096, 2, 8, 2), (4096, 4, 8, 3), (1024, 8, 4, 3), (2048, 8, 4, 2))
]


def _bench_shape(shape: str, sweep: bool, iters: int, copy_gbs: float) -> list[dict[str, Any]]:
    device = "cuda" if torch.cuda.is_available() and shape != "smoke" else "cpu"  # smoke: the interpreter
    rows, cols = SHAPES[shape]
    vocab = VOCAB if shape != "smoke" else 5000
    g = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(rows, cols, vocab, device=device, generator=g)).bfloat16()
    tokens = torch.randint(0, vocab, (rows, cols), device=device, generator=g)
    g_lp, g_ent = (torch.randn(rows, cols, device=device, generator=g) for _ in range(2))
    nbytes = logits.numel() * logits.element_size()
    base = tk.token_log_probs_forward(logits, tokens, 1.0, True)
    base_grad = tk.token_log_probs_backward(logits, tokens, base[0], base[2], g_lp, g_ent, 1.0)
    out: list[dict[str, Any]] = []

    def record(kernel: str, name: str, cfg: dict[str, Any]) -> None:
        row: dict[str, Any] = {"shape": shape, "kernel": kernel, "variant": name}
        try:
            if kernel == "forward":
                lse, lp, ent = tk.token_log_probs_forward(logits, tokens, 1.0, True, config=cfg)
                err = max(float((lp - base[1]).abs().max()), float((ent - base[2]).abs().max()))
                if err > 2e-5:
                    raise AssertionError(f"log-probs/entropies differ from the defaults' by {err:.2e}")
                us = 1e3 * time_ms(lambda: tk.token_log_probs_forward(logits, tokens, 1.0, True, config=cfg), warmup=1,
                                  iters=iters)
                moved = nbytes
            else:
                grad = tk.token_log_probs_backward(logits, tokens, base[0], base[2], g_lp, g_ent, 1.0, config=cfg)
                ulps = float(((grad.float() - base_grad.float()).abs()
                              / base_grad.float().abs().clamp_min(1e-30).mul(2**-7)).max())
                if ulps > 1.0:
                    raise AssertionError(f"gradient differs from the defaults' by {ulps:.2f} bf16 ulps")
                us = 1e3 * time_ms(lambda: tk.token_log_probs_backward(logits, tokens, base[0], base[2], g_lp, g_ent,
                                                                       1.0, config=cfg), warmup=1, iters=iters)
                moved = 2 * nbytes
            row.update(us=us, gbs=moved / us / 1e3, pct_copy=100 * moved / us / 1e3 / copy_gbs)
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(f"ERROR {shape} {kernel} {name}: {row['error']}", flush=True)
        out.append(row)

    for kernel, variants in (("forward", FORWARD_SWEEP), ("backward", BACKWARD_SWEEP)):
        record(kernel, "default", {})
        for cfg in (variants[:2] if shape == "smoke" else variants) if sweep else []:
            record(kernel, ",".join(f"{k}={v}" for k, v in cfg.items()), cfg)
        record(kernel, "default (again)", {})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="comma separated, of train, grpo (default train,grpo; not with "
                    "--smoke, which runs its tiny shape)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke and args.shapes is not None:
        ap.error(f"--shapes {args.shapes!r} with --smoke: the smoke run times only its tiny shape in Triton's CPU "
                 "interpreter; drop one of them")
    shapes = ["smoke"] if args.smoke else [s for s in (args.shapes or "train,grpo").split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; allowed: {', '.join(k for k in SHAPES if k != 'smoke')}")
    copy_gbs = copy_bandwidth_gbs() if torch.cuda.is_available() and not args.smoke else float("nan")
    rows = [r for shape in shapes for r in _bench_shape(shape, not args.no_sweep, args.iters, copy_gbs)]
    payload = {"command": command_line(), "env": environment(), "copy_gbs": copy_gbs,
               "defaults": {"forward": tk.FORWARD, "backward": tk.BACKWARD}, "rows": rows}
    write_json("logprobs.json", payload)
    print_table(rows, ["shape", "kernel", "variant", "us", "gbs", "pct_copy", "error"])
    return payload


def smoke() -> dict[str, Any]:
    """The ``--smoke`` run (tiny shape, Triton's interpreter), as a target of ``run_interpreted``."""
    return main(["--smoke"])


def run(smoke: bool) -> dict:
    """Suite entry: the default kernels' share of the copy bandwidth at the train shape (smoke: the interpreter's
    tiny shape, timing only), and the best variant of the sweep where one beats the default."""
    if smoke:  # on a GPU too: the suite's smoke mode is the CPU code path
        rows = run_interpreted("benchmarks.gpu.bench_logprobs:smoke")["rows"]
    else:
        rows = main(["--shapes", "train"])["rows"]
    errors = [r["error"] for r in rows if "error" in r]
    if errors:
        raise RuntimeError(f"log-prob kernel variants failed: {errors}")
    shape = "smoke" if smoke else "train"
    numbers: dict[str, Any] = {}
    for kernel in ("forward", "backward"):
        mine = [r for r in rows if r["shape"] == shape and r["kernel"] == kernel]
        default = min(r["us"] for r in mine if r["variant"].startswith("default"))
        best = min(mine, key=lambda r: r["us"])
        numbers.update({f"{kernel}_us": default, f"{kernel}_best_us": best["us"], f"{kernel}_best": best["variant"]})
        if not smoke:
            numbers[f"{kernel}_pct_copy"] = max(r["pct_copy"] for r in mine if r["variant"].startswith("default"))
    return numbers


if __name__ == "__main__":
    main()
