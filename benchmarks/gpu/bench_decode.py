"""Decode throughput: ``native`` engine vs HF ``generate`` (dynamic / static cache) vs the HBM roofline.

Random-init Qwen3 shapes, full-length random prompts of ``--prompt`` tokens, ``--new`` new tokens
(greedy, EOS ignored), measured side by side in one process on one GPU.

* e2e tok/s: ``batch * new / seconds`` of one whole generate call (prefill included);
* decode tok/s: ``batch * (new - 1) / (seconds - prefill seconds)``; the native engine times its
  prefill itself, for HF the prefill is a separate ``max_new_tokens=1`` call;
* roofline: bytes one decode step must read (every weight except the input embedding, plus the KV
  of every row at its mean context) over the measured copy bandwidth.

``--validate`` first checks correctness on the GPU (1.7B shape, bf16): native greedy tokens vs HF
greedy tokens, native graph vs eager (identical tokens and log-probs), and the engine's log-probs
vs a teacher-forced forward of the same model. ``--profile`` prints the top CUDA kernels of a few
eager decode steps (where time goes without graphs).

    python benchmarks/gpu/bench_decode.py --models 8b --batches 64 --validate --profile
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from lumenrl_backends.engines import NativeEngine  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def teacher_forced_log_probs(model, out, rows_per_chunk: int = 8) -> torch.Tensor:
    """log_softmax of the model's logits at each response token, (B, T) float32."""
    ids, mask = out.batch["input_ids"].cuda(), out.batch["attention_mask"].cuda()
    positions = out.batch["position_ids"].cuda()
    width = out.batch["responses"].shape[1]
    chunks = []
    with torch.no_grad():
        for s in range(0, ids.shape[0], rows_per_chunk):
            logits = model(input_ids=ids[s:s + rows_per_chunk], attention_mask=mask[s:s + rows_per_chunk],
                           position_ids=positions[s:s + rows_per_chunk]).logits[:, -width - 1:-1].float()
            target = ids[s:s + rows_per_chunk, -width:]
            lp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            chunks.append(lp)
    return torch.cat(chunks).cpu()


def validate(shape: str) -> dict:
    model = C.random_model(shape)
    tok = C.StubTokenizer()
    batch = C.prompt_batch(8, 64, seed=1)
    new = 32
    res = {}
    graph = NativeEngine(model, tok, device="cuda", max_batch_size=8, max_seq_len=96)
    eager = NativeEngine(model, tok, device="cuda", max_batch_size=8, max_seq_len=96, cuda_graphs=False)
    g = graph.generate(batch, {**GREEDY, "max_new_tokens": new})
    e = eager.generate(batch, {**GREEDY, "max_new_tokens": new})
    res["graph_used"] = bool(g.meta_info["perf"]["cuda_graphs"]) and graph.graphs.error is None
    res["graph_error"] = graph.graphs.error
    res["graph_vs_eager_tokens_equal"] = bool(torch.equal(g.batch["responses"], e.batch["responses"]))
    res["graph_vs_eager_logprob_maxdiff"] = float((g.batch["rollout_log_probs"] - e.batch["rollout_log_probs"]).abs().max())
    sampled = {"temperature": 1.0, "max_new_tokens": new, "seed": 7, "ignore_eos": True}
    gs, es = graph.generate(batch, sampled), eager.generate(batch, sampled)
    res["sampled_graph_vs_eager_tokens_equal"] = bool(torch.equal(gs.batch["responses"], es.batch["responses"]))
    with torch.no_grad():
        hf = model.generate(input_ids=batch.batch["input_ids"].cuda(), attention_mask=batch.batch["attention_mask"].cuda(),
                            max_new_tokens=new, min_new_tokens=new, do_sample=False)[:, 64:].cpu()
    same = hf == g.batch["responses"]
    res["greedy_vs_hf_token_match"] = float(same.float().mean())
    first_diff = [int((~row).nonzero()[0]) if (~row).any() else new for row in same]
    res["greedy_vs_hf_first_divergence_mean"] = sum(first_diff) / len(first_diff)
    ref = teacher_forced_log_probs(model, gs)
    diff = (ref - gs.batch["rollout_log_probs"]).abs()
    res["logprob_vs_forward_mean_absdiff"] = float(diff.mean())
    res["logprob_vs_forward_max_absdiff"] = float(diff.max())
    del graph, eager, model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def run_native(model, batch_size: int, args, mode: str) -> dict:
    engine = NativeEngine(model, C.StubTokenizer(), device="cuda", max_batch_size=batch_size,
                          max_seq_len=args.prompt + args.new, cuda_graphs=mode != "eager",
                          compile="full" if mode == "full" else "none")
    batch = C.prompt_batch(batch_size, args.prompt, seed=2)
    params = {**GREEDY, "max_new_tokens": args.new}
    _, warm_s = C.timed(lambda: engine.generate(batch, params))  # captures graphs / compiles
    out, total = C.timed(lambda: engine.generate(batch, params))
    perf = out.meta_info["perf"]
    decode_s = total - perf["prefill_seconds"]
    row = {"engine": f"native-{mode}", "e2e_tok_s": batch_size * args.new / total,
           "decode_tok_s": batch_size * (args.new - 1) / decode_s, "prefill_s": perf["prefill_seconds"],
           "total_s": total, "warmup_s": warm_s, "graphs": len(engine.graphs.graphs),
           "graph_error": engine.graphs.error}
    return row


def run_hf(model, batch_size: int, args, cache: str) -> dict:
    batch = C.prompt_batch(batch_size, args.prompt, seed=2, device="cuda")
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    kwargs = {"do_sample": False}
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def gen(n: int):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kwargs)

    gen(4)  # warm-up
    _, prefill = C.timed(lambda: gen(1))
    out, total = C.timed(lambda: gen(args.new))
    assert out.shape[1] == args.prompt + args.new
    return {"engine": f"hf-{cache}", "e2e_tok_s": batch_size * args.new / total,
            "decode_tok_s": batch_size * (args.new - 1) / max(total - prefill, 1e-9), "prefill_s": prefill,
            "total_s": total}


def profile_decode(model, batch_size: int, prompt: int) -> list[dict]:
    """Top CUDA kernels of 8 eager decode steps (no graphs)."""
    from torch.profiler import ProfilerActivity, profile

    engine = NativeEngine(model, C.StubTokenizer(), device="cuda", max_batch_size=batch_size,
                          max_seq_len=prompt + 16, cuda_graphs=False)
    batch = C.prompt_batch(batch_size, prompt, seed=3)
    engine.generate(batch, {**GREEDY, "max_new_tokens": 4})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(batch, {**GREEDY, "max_new_tokens": 9})  # 1 prefill + 8 decode steps
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    kernels = sum(e.count for e in events)
    print(f"profile: {kernels} kernel launches, {total / 1e3:.1f} ms device time (1 prefill + 8 decode steps)")
    return [{"name": e.key[:60], "count": e.count, "device_ms": e.device_time_total / 1e3,
             "share": e.device_time_total / total} for e in events[:15]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1.7b,8b")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="graph", help="native modes: eager, graph, full (torch.compile + graphs)")
    ap.add_argument("--hf", default="dynamic,static", help="HF caches to compare ('' for none)")
    ap.add_argument("--hf-batches", default="64", help="batches at which HF runs (it is slow)")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="decode.json")
    args = ap.parse_args()
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args)}
    bandwidth = C.copy_bandwidth_gbs()
    result["copy_bandwidth_gbs"] = bandwidth
    print(f"copy bandwidth {bandwidth:.0f} GB/s; torch {torch.__version__}")
    if args.validate:
        result["validation"] = validate("1.7b")
        print("validation:", result["validation"])
        C.write_json(args.out, result)
    rows, summary = [], {}
    hf_batches = {int(b) for b in args.hf_batches.split(",") if b}
    for shape in args.models.split(","):
        model = C.random_model(shape)
        for batch_size in (int(b) for b in args.batches.split(",")):
            roof = C.decode_roofline(model, batch=batch_size, prompt_len=args.prompt, new_tokens=args.new,
                                     bandwidth_gbs=bandwidth)
            found = []
            for mode in args.modes.split(","):
                try:
                    found.append(run_native(model, batch_size, args, mode))
                except Exception as err:  # noqa: BLE001 - report and keep measuring the rest
                    found.append({"engine": f"native-{mode}", "error": f"{type(err).__name__}: {err}"[:300]})
                torch.cuda.empty_cache()
            if batch_size in hf_batches:
                for cache in (c for c in args.hf.split(",") if c):
                    found.append(run_hf(model, batch_size, args, cache))
                    torch.cuda.empty_cache()
            hf_dyn = next((r["decode_tok_s"] for r in found if r["engine"] == "hf-dynamic"), None)
            for r in found:
                r.update(model=shape, batch=batch_size, roofline_tok_s=roof["tokens_per_s"])
                if "decode_tok_s" in r:
                    r["roofline_frac"] = r["decode_tok_s"] / roof["tokens_per_s"]
                    if hf_dyn:
                        r["x_hf_dynamic"] = r["decode_tok_s"] / hf_dyn
            rows.extend(found)
            result.setdefault("roofline", {})[f"{shape}_b{batch_size}"] = roof
            result["rows"] = rows
            C.write_json(args.out, result)
            C.print_table(found, ["model", "batch", "engine", "e2e_tok_s", "decode_tok_s", "roofline_frac",
                                  "x_hf_dynamic", "prefill_s", "total_s", "error"])
        if args.profile and shape == "8b":
            result["profile_8b_b64_eager"] = profile_decode(model, 64, args.prompt)
            C.print_table(result["profile_8b_b64_eager"], ["name", "count", "device_ms", "share"])
        del model
        gc.collect()
        torch.cuda.empty_cache()
    native_8b = [r for r in rows if r["model"] == "8b" and r["batch"] == 64 and r["engine"].startswith("native")
                 and "decode_tok_s" in r]
    if native_8b:
        best = max(native_8b, key=lambda r: r["decode_tok_s"])
        summary["decode_roofline_frac_8b_b64"] = {"value": best["roofline_frac"], "engine": best["engine"],
                                                  "command": result["command"]}
        if "x_hf_dynamic" in best:
            summary["decode_speedup_vs_hf_8b_b64"] = {"value": best["x_hf_dynamic"], "engine": best["engine"],
                                                      "command": result["command"]}
    result["summary"] = summary
    C.write_json(args.out, result)
    print("\nsummary:", summary)
    C.print_table(rows, ["model", "batch", "engine", "e2e_tok_s", "decode_tok_s", "roofline_frac", "x_hf_dynamic"])


if __name__ == "__main__":
    main()
