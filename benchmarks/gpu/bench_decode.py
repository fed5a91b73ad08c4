"""Decode throughput: ``native`` engine vs HF ``generate`` (dynamic / static cache) vs the HBM roofline.

Random-init Qwen3 shapes, full-length random prompts of ``--prompt`` tokens, ``--new`` new tokens
(greedy, EOS ignored), measured side by side in one process on one GPU.

* e2e tok/s: ``batch * new / seconds`` of one whole generate call (prefill included);
* decode tok/s: ``batch * (new - 1) / (seconds - prefill seconds)``; the native engine times its
  prefill itself, for HF the prefill is a separate ``max_new_tokens=1`` call;
* roofline: bytes one decode step must read (every weight except the input embedding, plus the KV
  of every row at its mean context) over the measured copy bandwidth.

``--fuse on,off`` measures every native mode with and without projection fusion (one q/k/v and
one gate/up GEMM per layer, the engine default) side by side, ``--overlap on,off`` likewise the
overlapped host sync (speculative next step); before timing, each fused model is checked on the GPU
(``fusion_check``: fused vs unfused graph engine on 8 x 64-token prompts, log-probs of both vs a
teacher-forced forward of the original unfused modules).

``--kernels`` runs each native mode once per :class:`KernelOptions` variant, side by side (``;``-separated
sets of ``NAME=on|off``, an empty set being the defaults), and reports each variant's decode tok/s over the
first's (``decode_kernels_over_first``).

``--validate`` first checks correctness on the GPU (1.7B shape, bf16): native greedy tokens vs HF
greedy tokens, native graph vs eager (identical tokens and log-probs), and the engine's log-probs
vs a teacher-forced forward of the same model. ``--profile`` profiles every timed native engine as
timed (graphs replayed, compiled or not; ``_common.profile_engine``): per decode step the kernel busy
time, the idle time between kernels, busy time by kernel class (GEMM, attention, inductor, copy) with
the GB/s the GEMMs reach over the weight bytes, the same by each kernel's marginal time (what it adds to
the busy union: under PDL a kernel starts early and waits, so durations overlap), the top kernels by
marginal time, and one step's kernels in order (start, duration, marginal time).

    python benchmarks/gpu/bench_decode.py --models 8b --batches 64 --validate --profile
    python benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes graph,full --fuse on,off --hf ''
    python benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes full --hf '' --kernels "decode_linear=off,pdl=off;"
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

import benchmarks.gpu._common as C  # noqa: E402
from lumenrl_backends.engines import KernelOptions, NativeEngine  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def teacher_forced_log_probs(model, out, rows_per_chunk: int = 8, max_rows: int | None = None) -> torch.Tensor:
    """log_softmax of the model's logits at each response token, (B, T) float32 (first ``max_rows`` rows)."""
    rows = slice(0, max_rows)
    ids, mask = out.batch["input_ids"][rows].to(C.DEVICE), out.batch["attention_mask"][rows].to(C.DEVICE)
    positions = out.batch["position_ids"][rows].to(C.DEVICE)
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
    graph = NativeEngine(model, tok, device=C.DEVICE, max_batch_size=8, max_seq_len=96)
    eager = NativeEngine(model, tok, device=C.DEVICE, max_batch_size=8, max_seq_len=96, cuda_graphs=False)
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
        hf = model.generate(input_ids=batch.batch["input_ids"].to(C.DEVICE), attention_mask=batch.batch["attention_mask"].to(C.DEVICE),
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


def fusion_check(model) -> dict:
    """Fused vs unfused graph engines (bf16, greedy + sampled) and both vs the unfused forward
    (the unfused engine, built last, restores the model's original modules for the reference)."""
    batch, new = C.prompt_batch(8, 64, seed=1), 32
    res: dict = {}
    outs = {}
    for fuse in (True, False):  # the last engine built decides the model's state: unfused
        engine = NativeEngine(model, C.StubTokenizer(), device=C.DEVICE, max_batch_size=8, max_seq_len=96,
                              kernels=KernelOptions(fuse_projections=fuse))
        sampled = {"temperature": 1.0, "max_new_tokens": new, "seed": 7, "ignore_eos": True}
        outs[fuse] = (engine.generate(batch, {**GREEDY, "max_new_tokens": new}), engine.generate(batch, sampled))
        res[f"{'fused' if fuse else 'unfused'}_groups"] = engine.fusion_report.fused if fuse else 0
        res[f"{'fused' if fuse else 'unfused'}_graph_error"] = engine.graphs.error
        del engine  # no gc.collect(): the next engine's capture must survive this one's deferred collection
    for fuse in (False, True):
        ref = teacher_forced_log_probs(model, outs[fuse][1])
        diff = (ref - outs[fuse][1].batch["rollout_log_probs"]).abs()
        name = "fused" if fuse else "unfused"
        res[f"{name}_logprob_vs_forward_mean_absdiff"] = float(diff.mean())
        res[f"{name}_logprob_vs_forward_max_absdiff"] = float(diff.max())
    greedy_same = outs[True][0].batch["responses"] == outs[False][0].batch["responses"]
    res["greedy_fused_vs_unfused_token_match"] = float(greedy_same.float().mean())
    res["ok"] = bool(res["fused_groups"] > 0 and res["fused_graph_error"] is None and res["unfused_graph_error"] is None
                     and res["fused_logprob_vs_forward_mean_absdiff"]
                     <= 2 * res["unfused_logprob_vs_forward_mean_absdiff"] + 0.01)
    gc.collect()
    torch.cuda.empty_cache()
    return res


def native_label(mode: str, fuse: bool, overlap: bool, kernels: str = "") -> str:
    """Row name of a native variant, e.g. ``native-graph``, ``native-full-unfused-sync``,
    ``native-full[decode_linear=off]``."""
    return f"native-{mode}" + ("" if fuse else "-unfused") + ("" if overlap else "-sync") + (f"[{kernels}]" if kernels else "")


def kernel_overrides(spec: str) -> dict[str, bool | str]:
    """``"decode_linear=off,pdl=on"`` -> KernelOptions keyword overrides: on/off for the boolean options,
    an int for digits (``pdl_prefetch=4096``), the value itself for the others (``decode_linear``,
    ``fused_moe``: the engine checks it)."""
    switch = {"on": True, "off": False}
    kinds = {f.name: f.type for f in dataclasses.fields(KernelOptions)}
    out: dict[str, bool | str] = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        boolean = kinds.get(name) in (bool, "bool")
        if name not in kinds or not value or (boolean and value not in switch):
            raise SystemExit(f"--kernels item {item!r}: give NAME=VALUE with NAME one of {sorted(kinds)} "
                             "(on|off for the boolean ones)")
        out[name] = switch[value] if boolean else int(value) if value.isdigit() else value
    return out


def run_native(model, batch_size: int, args, mode: str, fuse: bool = True, overlap: bool = True, kernels: str = "") -> dict:
    if mode == "full":
        torch._dynamo.reset()  # the model's modules change with ``fuse``: compile afresh, never reuse a variant
    options = KernelOptions(fuse_projections=fuse, overlap_sync=overlap, **kernel_overrides(kernels))
    engine = NativeEngine(model, C.StubTokenizer(), device=C.DEVICE, max_batch_size=batch_size,
                          max_seq_len=args.prompt + args.new, cuda_graphs=mode != "eager",
                          compile="full" if mode == "full" else "none", kernels=options)
    batch = C.prompt_batch(batch_size, args.prompt, seed=2)
    params = {**GREEDY, "max_new_tokens": args.new}
    _, warm_s = C.timed(lambda: engine.generate(batch, params))  # captures graphs / compiles
    out, total = C.timed(lambda: engine.generate(batch, params))
    perf = out.meta_info["perf"]
    decode_s = total - perf["prefill_seconds"]
    label = native_label(mode, fuse, overlap, kernels)
    row = {"engine": label, "fuse": fuse, "overlap": overlap, "kernels": kernels,
           "fused_groups": engine.fusion_report.fused if engine.fusion_report else 0,
           "speculation": dict(engine.speculation), "e2e_tok_s": batch_size * args.new / total,
           "decode_tok_s": batch_size * (args.new - 1) / decode_s, "prefill_s": perf["prefill_seconds"],
           "total_s": total, "warmup_s": warm_s, "graphs": len(engine.graphs.graphs),
           "graph_error": engine.graphs.error}
    # numerics of the timed run itself (bounded Triton attention, compiled kernels): first 8 rows
    # vs a teacher-forced forward of the same weights
    diff = (teacher_forced_log_probs(model, out, max_rows=8) - out.batch["rollout_log_probs"][:8]).abs()
    row["logprob_vs_forward_mean_absdiff"], row["logprob_vs_forward_max_absdiff"] = float(diff.mean()), float(diff.max())
    if not row["logprob_vs_forward_mean_absdiff"] < 0.1:
        print(f"ERROR {label} b{batch_size}: log-probs off the forward by {row['logprob_vs_forward_mean_absdiff']:.3g} "
              "(mean |d|)", flush=True)
    if engine.graphs.error is not None:
        print(f"ERROR {label} b{batch_size}: CUDA graph capture failed, timed eagerly: {engine.graphs.error}", flush=True)
    if args.profile:
        steps = 32
        roof = C.decode_roofline(model, batch=batch_size, prompt_len=args.prompt, new_tokens=steps + 1, bandwidth_gbs=1.0)
        row["profile"] = C.profile_engine(engine, batch, params, steps=steps, weight_bytes=roof["weight_gb"] * 1e9,
                                          kv_bytes=roof["kv_gb_mean"] * 1e9)
        C.print_profile(row["profile"], f"{label} b{batch_size}")
    return row


def run_hf(model, batch_size: int, args, cache: str) -> dict:
    batch = C.prompt_batch(batch_size, args.prompt, seed=2, device=C.DEVICE)
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1.7b,8b")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="graph", help="native modes: eager, graph, full (torch.compile + graphs)")
    ap.add_argument("--fuse", default="on", help="projection fusion variants of each native mode: on, off, on,off")
    ap.add_argument("--overlap", default="on", help="overlapped host sync variants: on, off, on,off")
    ap.add_argument("--kernels", default="", help="KernelOptions variants, ';'-separated, each NAME=on|off[,...] "
                    "(e.g. 'decode_linear=off,pdl=off;' : without and with the defaults), side by side")
    ap.add_argument("--hf", default="dynamic,static", help="HF caches to compare ('' or none: no HF)")
    ap.add_argument("--hf-batches", default="64", help="batches at which HF runs (it is slow)")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="decode.json")
    args = ap.parse_args(argv)
    for flag, value, allowed in (("--modes", args.modes, ("eager", "graph", "full")),
                                 ("--hf", "" if args.hf == "none" else args.hf, ("dynamic", "static"))):
        bad = [v for v in value.split(",") if v not in allowed and (v or flag == "--modes")]
        if bad:
            ap.error(f"{flag}={value!r}: {bad} not known; give a comma-separated subset of {', '.join(allowed)}"
                     + (" ('' or none: no HF)" if flag == "--hf" else ""))
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
    switch = {"on": True, "off": False}
    for name, value in (("--fuse", args.fuse), ("--overlap", args.overlap)):
        if not value or any(v not in switch for v in value.split(",")):
            raise SystemExit(f"{name}={value!r}: give on, off or on,off")
    kernel_sets = args.kernels.split(";")
    for spec in kernel_sets:
        kernel_overrides(spec)  # bad input fails before any model loads
    variants = [(switch[f], switch[o], ks) for f in args.fuse.split(",") for o in args.overlap.split(",")
                for ks in kernel_sets]
    for shape in args.models.split(","):
        model = C.random_model(shape)
        if any(fuse for fuse, _, _ in variants):
            try:
                check = fusion_check(model)
            except Exception as err:  # noqa: BLE001 - report and keep measuring the rest
                check = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
            result.setdefault("fusion_check", {})[shape] = check
            print(f"fusion check {shape}:", check, flush=True)
            if not check["ok"]:
                print(f"ERROR fusion check failed for {shape}: fused numerics off (see fusion_check); timing anyway")
            C.write_json(args.out, result)
        for batch_size in (int(b) for b in args.batches.split(",")):
            roof = C.decode_roofline(model, batch=batch_size, prompt_len=args.prompt, new_tokens=args.new,
                                     bandwidth_gbs=bandwidth)
            found = []
            for mode in args.modes.split(","):
                for fuse, overlap, kernels in variants:
                    try:
                        found.append(run_native(model, batch_size, args, mode, fuse, overlap, kernels))
                    except Exception as err:  # noqa: BLE001 - report and keep measuring the rest
                        label = native_label(mode, fuse, overlap, kernels)
                        print(f"ERROR {shape} b{batch_size} {label}: {type(err).__name__}: {err}", flush=True)
                        found.append({"engine": label, "error": f"{type(err).__name__}: {err}"[:300]})
                    gc.collect()
                    torch.cuda.empty_cache()
            if batch_size in hf_batches:
                for cache in (c for c in args.hf.split(",") if c and c != "none"):  # dynamic / static (checked)
                    try:
                        found.append(run_hf(model, batch_size, args, cache))
                    except Exception as err:  # noqa: BLE001 - report and keep measuring the rest
                        print(f"ERROR {shape} b{batch_size} hf-{cache}: {type(err).__name__}: {err}", flush=True)
                        found.append({"engine": f"hf-{cache}", "error": f"{type(err).__name__}: {err}"[:300]})
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
                                  "x_hf_dynamic", "prefill_s", "total_s", "logprob_vs_forward_mean_absdiff", "error"])
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
    fused_gain = {}
    for r in rows:
        if r.get("fuse") is False and "decode_tok_s" in r:
            twin = next((f for f in rows if f.get("fuse") is True and f["model"] == r["model"] and f["batch"] == r["batch"]
                         and f["overlap"] == r["overlap"] and f["engine"].split("-")[1] == r["engine"].split("-")[1]
                         and "decode_tok_s" in f), None)
            if twin:
                fused_gain[f"{r['model']}_b{r['batch']}_{twin['engine']}"] = twin["decode_tok_s"] / r["decode_tok_s"]
    if fused_gain:
        summary["decode_fused_over_unfused"] = fused_gain
    if len(kernel_sets) > 1:  # each --kernels variant over the first, same model / batch / mode / fuse / overlap
        first = {}
        for r in rows:
            if "decode_tok_s" in r and "kernels" in r:
                key = (r["model"], r["batch"], r["engine"].split("[")[0])
                first.setdefault(key, r)
                if first[key] is not r:
                    summary.setdefault("decode_kernels_over_first", {})[f"{r['model']}_b{r['batch']}_{r['engine']}"] = (
                        r["decode_tok_s"] / first[key]["decode_tok_s"])
    result["summary"] = summary
    C.write_json(args.out, result)
    print("\nsummary:", summary)
    C.print_table(rows, ["model", "batch", "engine", "e2e_tok_s", "decode_tok_s", "roofline_frac", "x_hf_dynamic",
                         "warmup_s", "error"])
    return result


SMOKE_ARGS = ["--models", "tiny", "--batches", "2", "--prompt", "8", "--new", "6", "--modes", "eager",
              "--fuse", "off", "--out", "decode_smoke.json"]  # unfused: no fusion check (two more engines)


def _best_8b_b64(rows: list[dict]) -> dict:
    native = [r for r in rows if r["engine"].startswith("native") and "decode_tok_s" in r]
    return max(native, key=lambda r: r["decode_tok_s"])


def run(smoke: bool) -> dict:
    """Suite entry: native decode tok/s and its fraction of the bandwidth roofline (8B, batch 64; smoke: a
    tiny model, batch 2, eager, on the CPU), with the profile of the timed engine's decode steps (where the
    time goes: ms per step by kernel class, idle time, GB/s of the GEMMs and attention)."""
    best = _best_8b_b64(main([*SMOKE_ARGS, "--hf", "none"] if smoke else
                             ["--models", "8b", "--batches", "64", "--modes", "full", "--hf", "none", "--profile"])["rows"])
    return {"native_decode_tok_s": best["decode_tok_s"], "roofline_tok_s": best["roofline_tok_s"],
            "roofline_frac": best["roofline_frac"], "engine": best["engine"], **C.profile_numbers(best.get("profile"))}


def run_vs_hf(smoke: bool) -> dict:
    """Suite entry: native decode vs HF generate (dynamic cache), same job (8B, batch 64; smoke: tiny, CPU)."""
    rows = main([*SMOKE_ARGS, "--hf", "dynamic", "--hf-batches", "2"] if smoke else
                ["--models", "8b", "--batches", "64", "--modes", "full", "--hf", "dynamic", "--out", "decode_vs_hf.json"])["rows"]
    best = _best_8b_b64(rows)
    hf = next(r["decode_tok_s"] for r in rows if r["engine"] == "hf-dynamic")
    return {"native_decode_tok_s": best["decode_tok_s"], "hf_decode_tok_s": hf, "speedup": best["decode_tok_s"] / hf}


if __name__ == "__main__":
    main()
