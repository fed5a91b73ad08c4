"""Fused sampler kernels: one program per row (before) vs rows x vocab chunks (now), on bf16 logits.

For each batch (vocab 151936, Qwen3) and mode (``plain``: temperature 1 on every row, the decode
profile's case; ``greedy``: ``greedy_only``), times ``fused_sample`` with

* ``torch``: the torch sampler (``sample_tokens``, restrict off), the fallback path;
* ``rowwise``: the previous path, ``impl="rowwise"`` (row keys by ~40 tiny torch ops, then one
  program per row: 64 programs at B 64); ``rowwise_kernel``: its kernel alone (keys precomputed),
  what the decode profile's ``_sample_kernel`` line measured;
* ``chunked``: the default two-stage launch (``default_chunk``), and a small sweep of
  ``chunk`` / ``block_v`` / ``num_warps`` (``--sweep``).

Each variant's tokens are first checked on the GPU: ``chunked`` must equal ``rowwise`` exactly
(same math); against ``torch`` the token mismatches (near-exact Gumbel ties only) and the max
log-prob difference are reported. A variant that fails prints an ``ERROR`` line and is skipped.

Timing: ``--copies`` logits buffers (together > 4x the 60 MB L2, so every call reads from HBM),
one call per buffer, all captured in one CUDA graph and replayed (no launch or Python overhead);
``us`` is the median device time per call, ``gbs`` the logits bytes / time, ``pct_copy`` that
over the measured device copy bandwidth (read + write bytes / s).

    python benchmarks/gpu/bench_sampler.py [--batches 16,64,256] [--sweep] [--smoke]

``--smoke`` runs tiny shapes in Triton's CPU interpreter (eager timing). Writes ``sampler.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from benchmarks.gpu._common import (  # noqa: E402
    VOCAB,
    command_line,
    copy_bandwidth_gbs,
    environment,
    print_table,
    time_graph_ms,
    write_json,
)
from lumenrl_backends.engines import triton_sampling  # noqa: E402
from lumenrl_backends.engines.sampling import sample_tokens  # noqa: E402
from lumenrl_backends.engines.triton_sampling import default_chunk, fused_sample  # noqa: E402

SWEEP = [  # (chunk, block_v, num_warps)
    (2048, 1024, 4), (2048, 2048, 4), (4096, 2048, 4), (4096, 4096, 8),
    (8192, 2048, 4), (8192, 4096, 4), (8192, 4096, 8), (16384, 4096, 8),
]
L2_BYTES = 60 * 2**20


def graph_us(fns: list[Callable[[], Any]], iters: int = 20) -> tuple[float, str]:
    """Median us per call of ``fns`` captured in one CUDA graph and replayed (eager on CPU)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - start) / len(fns) * 1e6, "eager"
    ms, how = time_graph_ms(fns, iters=iters)
    return ms * 1e3, how


def variants(sweep: bool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"torch": {}, "rowwise": {"impl": "rowwise"}, "rowwise_kernel": {}, "chunked": {}}
    if sweep:
        for chunk, block_v, warps in SWEEP:
            out[f"chunked c{chunk}/b{block_v}/w{warps}"] = {"chunk": chunk, "block_v": block_v, "num_warps": warps}
    return out


def make_call(name: str, launch: dict[str, Any], args: dict[str, Any], greedy_only: bool) -> Callable:
    if name == "torch":
        def call(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            seeds = args["seeds"]
            return sample_tokens(logits, **args, top_k=torch.zeros_like(seeds), top_p=torch.ones_like(args["temperature"]),
                                 restrict=False, greedy_only=greedy_only)
        return call
    if name == "rowwise_kernel":  # the rowwise kernel alone (keys computed once, outside the timing)
        keys = triton_sampling.row_keys(args["seeds"], args["counters"])
        keys = torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)
        temperature = args["temperature"].float()

        def kernel(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            batch, vocab = logits.shape
            tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
            log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
            triton_sampling._sample_kernel[(batch,)](
                logits, temperature, keys, tokens, log_probs, vocab, logits.stride(0),
                GREEDY_ONLY=greedy_only, BLOCK_V=4096, NUM_BLOCKS=-(-vocab // 4096),
            )
            return tokens, log_probs
        return kernel
    return lambda logits: fused_sample(logits, **args, greedy_only=greedy_only, **launch)


def bench_case(batch: int, vocab: int, mode: str, copies: int, sweep: bool, copy_gbs: float) -> list[dict[str, Any]]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(batch)
    logits = [(torch.randn((batch, vocab), generator=gen, device=dev) * 3).bfloat16() for _ in range(copies)]
    greedy_only = mode == "greedy"
    args = {
        "temperature": torch.full((batch,), 0.0 if greedy_only else 1.0, device=dev),
        "seeds": torch.randint(-2**62, 2**62, (batch,), generator=gen, device=dev),
        "counters": torch.randint(0, 4096, (batch,), generator=gen, device=dev),
    }
    nbytes = batch * vocab * logits[0].element_size()
    rows, ref, rowwise = [], None, None
    for name, launch in variants(sweep).items():
        row: dict[str, Any] = {"batch": batch, "mode": mode, "variant": name}
        try:
            call = make_call(name, launch, args, greedy_only)
            tokens, log_probs = call(logits[0])
            if name == "torch":
                ref = (tokens, log_probs)
            elif name == "rowwise":
                rowwise = tokens
            elif rowwise is not None and not torch.equal(tokens, rowwise):
                bad = int((tokens != rowwise).sum())
                raise AssertionError(f"{bad}/{batch} tokens differ from the rowwise kernel")
            if ref is not None:
                row["token_mismatch_vs_torch"] = int((tokens != ref[0]).sum())
                row["max_logprob_diff"] = float((log_probs - ref[1]).abs().max())
            if name == "chunked":
                row["chunk"] = default_chunk(batch, vocab)
            us, how = graph_us([lambda x=x, f=call: f(x) for x in logits])
            row.update(us=us, gbs=nbytes / us / 1e3, timing=how)
            if copy_gbs:
                row["pct_copy"] = 100 * row["gbs"] / copy_gbs
        except Exception as err:  # noqa: BLE001 - report and go on with the other variants
            print(f"ERROR batch={batch} mode={mode} variant={name}: {type(err).__name__}: {err}", flush=True)
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=None, help="comma separated (default 16,64,256; with --smoke: 2,5)")
    parser.add_argument("--vocab", type=int, default=None, help=f"default {VOCAB}; with --smoke: 3000")
    parser.add_argument("--modes", default="plain,greedy", help="plain, greedy or plain,greedy")
    parser.add_argument("--sweep", action="store_true", help="also time a few chunk/block_v/num_warps settings")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's CPU interpreter")
    parser.add_argument("--out", default="sampler.json")
    args = parser.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in ("plain", "greedy")]
    if bad:
        parser.error(f"--modes {args.modes!r}: {bad} not known; give plain, greedy or plain,greedy")
    # --smoke's tiny shapes only where the flag was left out
    args.batches = args.batches or ("2,5" if args.smoke else "16,64,256")
    args.vocab = args.vocab or (3000 if args.smoke else VOCAB)
    if args.smoke and args.out == "sampler.json":  # never overwrite a GPU result with interpreter timings
        args.out = "sampler_smoke.json"
    cuda = torch.cuda.is_available()
    copy_gbs = copy_bandwidth_gbs() if cuda else 0.0
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        nbytes = batch * args.vocab * 2
        copies = max(2, min(64, math.ceil(4 * L2_BYTES / nbytes))) if cuda else 1
        for mode in args.modes.split(","):
            rows += bench_case(batch, args.vocab, mode, copies, args.sweep, copy_gbs)
    summary = {}
    for row in rows:
        if row["variant"] in ("rowwise", "rowwise_kernel", "chunked") and "us" in row and row["mode"] == "plain":
            summary[f"sampler/{row['variant']}_b{row['batch']}_us"] = {"value": round(row["us"], 2), "command": command_line()}
    payload = {"command": command_line(), "environment": environment(), "copy_gbs": copy_gbs,
               "vocab": args.vocab, "rows": rows, "summary": summary}
    write_json(args.out, payload)
    print_table(rows, ["batch", "mode", "variant", "chunk", "us", "gbs", "pct_copy", "token_mismatch_vs_torch",
                       "max_logprob_diff", "timing", "error"])
    return payload


def run(smoke: bool) -> dict:
    """Suite entry: microseconds of the default sampler kernel (plain and greedy) at batch 64.

    Smoke (no CUDA): batch 5, the torch reference's timing; the Triton variants need a GPU or Triton's
    interpreter (``TRITON_INTERPRET=1`` set before Triton is imported, as ``--smoke`` on the command line)."""
    cuda = torch.cuda.is_available()
    rows = main(["--smoke"] if smoke else ["--batches", "64"])["rows"]
    errors = [r["error"] for r in rows if "error" in r]
    if errors and cuda:
        raise RuntimeError(f"sampler variants failed: {errors}")
    batch, variant = (5 if smoke else 64), ("rowwise_kernel" if cuda else "torch")
    us = {r["mode"]: r["us"] for r in rows if r["batch"] == batch and r["variant"] == variant}
    return {"plain_us": us["plain"], "greedy_us": us["greedy"], "batch": batch}


if __name__ == "__main__":
    main()
