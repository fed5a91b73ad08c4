"""BF16 vs FP8 rollout on the same ``native`` engine, and the train/infer log-prob KL of each.

Random-init Qwen3-8B shape, batch 64, prompt 256 + 256 new tokens, temperature 1 (EOS ignored).
Engines (``--engines``, comma separated): ``bf16`` (the model as is), any lumenrl-quant FP8
scheme name as the engine's ``quant_scheme``: ``fp8_row`` (per-channel weight scales, dynamic
per-token activation scales; decode GEMM = cuBLAS tensorwise with unit scales + scale epilogue),
``fp8_block`` (128x128 weight blocks, 1x128 activation groups), ``fp8_tensor``; ``fp8`` is an alias
of ``fp8_block``; a ``+kv`` suffix adds the FP8 KV cache (per-layer scales recalibrated at each
prefill after an update), ``+head`` quantizes the output head too (``quantize_lm_head``; off in
the plain variants), ``+fusedmlp`` runs lumenrl-quant's fused SwiGLU MLP (``quantization.rollout.fuse_mlp``;
1 x 128 group scales on the down projection's input, quantized in the gate/up GEMM's epilogue), ``+tokmlp``
the unfused one (per-token scales between separate kernels), which is the default since session 5's
measurements (during session 5's calls 1-4 the fused MLP was the default: engine names without
``+tokmlp`` there ran it). Since session 6 the per-token MLP runs SiLU * up and the down input's
quantization as one lumenrl-quant kernel (``KernelOptions(fp8_act_kernel=True)``, the default);
``+inductmlp`` keeps inductor's kernels there (the path before). With the FP8 KV cache, decode attention
hands ``o_proj`` its output as FP8 codes in V's units (``fp8_attn_out``, default since session 6);
``+tokattn`` quantizes it per token instead (the path before). The RMSNorms hand their ``fp8_row``
consumers FP8 input in one pass (``fp8_norm_quant``, default since session 6); ``+tokln`` normalises first
and quantizes the normalised rows (the path before). Each decode step's q/k norms, RoPE and
KV-cache write (FP8 quantize included) run as one Triton kernel (``KernelOptions(fused_qk_rope=True)``, the
default since session 7; ``+qkrope`` names it explicitly, as call 3 of session 7 did); ``+unfusedrope`` runs
the norm modules, RoPE and the cache update instead (the path before; any base, ``bf16+unfusedrope`` too).
``+vtiles`` stores V in (D, 128) tiles (``KernelOptions(kv_v_tiles=True)``; the default in session 8 calls 5-7,
opt-in since, as the whole step measured no faster); ``+vrows`` names rows, the default, explicitly (call 7). ``+nopdl``
launches without programmatic dependent launch (``KernelOptions(pdl=False)``), ``+pf<bytes>`` prefetches that many
bytes of each weight row before the PDL wait (``KernelOptions(pdl_prefetch=...)``, e.g. ``+pf2048``; ``+pfs<bytes>`` for
the o and down projections only, ``pdl_prefetch_second``); ``+cublasod`` runs the o and down
projections on cuBLAS tensorwise + the scale epilogue (the path before they joined the Triton rowwise kernel);
``+ropeattn`` runs the q/k norms, RoPE and K/V write inside the attention kernel
(``KernelOptions(rope_in_attention=True)``), ``+fusednorm`` the norms inside the decode GEMMs (bf16 layers only:
``bf16+fusednorm``), ``+tma`` copies the decode GEMMs' tiles with the tensor memory accelerator
(``KernelOptions(tma=True)``; any base). ``--persistent-rnumel N`` lets inductor
hold reductions of up to N columns in registers (persistent) instead of looping (its default limit is
1024; the FP8 engine's RMSNorm + quantize kernels reduce 4096). ``--attn-fp8-config`` overrides the FP8-cache attention launch
configuration, ``--mlp-config`` the fused MLP's (a ``bench_fused_mlp.py --tune`` JSON).
Modes (``--modes``): ``graph`` (CUDA graphs) and ``full`` (``torch.compile`` + CUDA graphs, ~56 s
of compilation per 8B engine): every engine runs in every mode, one engine at a time, with identical settings; ``x_bf16`` is against the bf16 row of the
same mode. The trainer is the BF16 model itself: ``p_train`` comes from a teacher-forced forward
over each rollout's prompt + response. Before timing, each quantized engine checks one of its
linears against the float32 emulation on the GPU (``linear_check``); a failing variant prints an
``ERROR`` line and the run continues with the others.

KL, per response position, averaged over positions:

* sample-based, from the engine's own log-probs of the sampled tokens
  (``lumenrl_quant.correction.rollout_correction_metrics``: k1, k3 of KL(rollout || train));
* exact over the vocabulary, with ``p_roll`` from a teacher-forced forward of the engine's
  (quantized) model: ``KL(p_roll || p_train)`` before correction, and after token-level TIS
  (cap C = 2): importance weights ``w = min(p_train / p_roll, C)`` turn sampling from ``p_roll``
  into sampling from ``q = min(p_train, C p_roll) / Z``; the table gives ``KL(q || p_train)``.

Exact KLs do not depend on the mode (same weights, teacher-forced eager forward), so they are
computed in the first mode an engine runs in (``--kl-every-mode`` to repeat).

    python benchmarks/gpu/bench_fp8_rollout.py --engines bf16,fp8_row,fp8_block --modes graph
    python benchmarks/gpu/bench_fp8_rollout.py --engines bf16,fp8_row --modes full --out fp8_rollout_full.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from pathlib import Path

import torch

import benchmarks.gpu._common as C  # noqa: E402
from lumenrl_backends.engines import KernelOptions, NativeEngine  # noqa: E402
from lumenrl_quant import gemm, get_quant_scheme  # noqa: E402

TIS_CAP = 2.0


def full_log_probs(model, ids: torch.Tensor, width: int, rows: slice) -> torch.Tensor:
    """(rows, width, V) float32 log-softmax predicting the last ``width`` tokens (full prompts: no padding)."""
    with torch.no_grad():  # on the model's device (CPU runs: benchmarks/quant/bench_rollout_kl_trained.py)
        logits = model(input_ids=ids[rows].to(next(model.parameters()).device)).logits[:, -width - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def exact_kl(roll_model, train_model, ids: torch.Tensor, width: int, chunk: int = 4) -> dict[str, float]:
    """Mean over positions of KL(p_roll || p_train) and KL(q_TIS || p_train) (see module docstring)."""
    before, after, count = 0.0, 0.0, 0
    for s in range(0, ids.shape[0], chunk):
        rows = slice(s, s + chunk)
        lp_roll, lp_train = full_log_probs(roll_model, ids, width, rows), full_log_probs(train_model, ids, width, rows)
        p_roll = lp_roll.exp()
        before += float((p_roll * (lp_roll - lp_train)).sum(-1).sum())
        log_q = torch.minimum(lp_train, lp_roll + torch.log(torch.tensor(TIS_CAP)))  # unnormalised
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
        after += float((log_q.exp() * (log_q - lp_train)).sum(-1).sum())
        count += lp_roll.shape[0] * lp_roll.shape[1]
        del lp_roll, lp_train, p_roll, log_q
    return {"kl_exact_before": before / count, "kl_exact_after_tis": after / count}


def sampled_metrics(train_model, out) -> dict[str, float]:
    from lumenrl_quant.correction import rollout_correction_metrics, tis_token_weights

    ids, width = out.batch["input_ids"], out.batch["responses"].shape[1]
    train_lp = []
    for s in range(0, ids.shape[0], 4):
        lp = full_log_probs(train_model, ids, width, slice(s, s + 4))
        train_lp.append(lp.gather(-1, out.batch["responses"][s:s + 4, :, None].to(lp.device)).squeeze(-1).cpu())
        del lp
    old = torch.cat(train_lp)
    rollout, mask = out.batch["rollout_log_probs"], out.batch["response_mask"]
    weights = tis_token_weights(old, rollout, mask, clip=TIS_CAP)
    return rollout_correction_metrics(old, rollout, mask, is_weights=weights,
                                      clipped=(weights >= TIS_CAP) & (mask != 0))


SCHEME_ALIASES = {"fp8": "fp8_block"}
# +cublasod: the fused Qwen3-8B o (4096 x 4096) and down (4096 x 12288) shapes back on cuBLAS tensorwise + scale
# epilogue (the path before lumenrl-quant gave them Triton rowwise launch parameters)
CUBLAS_OD = ((4096, 4096), (4096, 12288))


def prefetch_bytes(flags: frozenset[str], prefix: str = "pf") -> int | None:
    """``+pf4096`` -> ``KernelOptions.pdl_prefetch`` 4096 (bytes of each weight row a PDL GEMM prefetches); None
    without the suffix (each kernel's default). ``prefix="pfs"``: ``+pfs8192`` -> ``pdl_prefetch_second`` (o and down)."""
    return next((int(f[len(prefix):]) for f in flags if f.startswith(prefix) and f[len(prefix):].isdigit()), None)


def variant(name: str) -> tuple[str, frozenset[str]]:
    """``fp8_row+kv+head`` -> ``("fp8_row", {"kv", "head"})``; suffixes: ``kv`` (FP8 KV cache), ``head``
    (the output head quantized too, ``quantize_lm_head``)."""
    base, *flags = name.split("+")
    unknown = {f for f in flags if not (f.startswith(("pf", "pfs")) and f.lstrip("pfs").isdigit())} - {"kv", "head", "fusedmlp", "tokmlp", "inductmlp", "tokattn", "tokln", "qkrope", "unfusedrope",
                            "vrows", "vtiles", "nopdl", "cublasod", "ropeattn", "fusednorm", "tma"}
    if unknown:
        raise SystemExit(f"--engines {name!r}: unknown suffix(es) {sorted(unknown)}; allowed: +kv, +head, +fusedmlp, "
                         "+tokmlp, +inductmlp, +tokattn, +tokln, +qkrope, +unfusedrope, +vrows, +vtiles, +nopdl, +cublasod, +ropeattn, "
                         "+fusednorm, +tma, +pf<bytes>, +pfs<bytes>")
    if len({"fusedmlp", "tokmlp", "inductmlp"} & set(flags)) > 1:
        raise SystemExit(f"--engines {name!r}: +fusedmlp, +tokmlp and +inductmlp exclude each other")
    if {"qkrope", "unfusedrope"} <= set(flags):
        raise SystemExit(f"--engines {name!r}: +qkrope and +unfusedrope exclude each other")
    return base, frozenset(flags)


def scheme_of(name: str) -> str | None:
    base = variant(name)[0]
    return None if base == "bf16" else SCHEME_ALIASES.get(base, base)


def attention_override(spec: str) -> dict:
    """``--attn-fp8-config``: a JSON object, or a ``bench_attention.py --tune`` output whose fastest
    default-accuracy FP8 row is taken (among the (D, 128)-tile rows, the engine's layout, where it has them)."""
    import json

    from lumenrl_backends.engines import triton_attention as ta

    path = Path(spec)
    if path.is_file():
        best = json.loads(path.read_text())["best"]
        fp8 = [k for k in best if k.startswith("fp8_L") and "dots" not in k]
        tiled = [k for k in fp8 if "_vblocks128" in k]  # the engine's FP8 layout, where the sweep had it
        row = min((best[k] for k in tiled or fp8), key=lambda r: r["us"])
        cfg = {k: row[k] for k in ta.DEFAULT_CONFIG}
    else:
        cfg = json.loads(spec)
    ta._config(cfg, fp8=True)  # validated before any model is built
    ta.FP8_CONFIG.update(cfg)
    return dict(ta.FP8_CONFIG)


def mlp_override(path: str) -> dict:
    """``--mlp-config``: a ``bench_fused_mlp.py --tune`` JSON; its ``best`` launch configurations are
    installed in ``lumenrl_quant.fused_mlp`` for their shapes (validated before any model is built)."""
    import json

    from lumenrl_quant import fused_mlp
    from lumenrl_quant import triton_gemm as tg

    best = json.loads(Path(path).read_text())["best"]
    for entry in best.values():
        k, inter = entry["shape"]["K"], entry["shape"]["I"]
        up = {**entry["up"], "group": entry["group"]}
        tg._swiglu_config(up)
        tg._config(entry["down"])
        fused_mlp.SWIGLU_CONFIGS[(inter, k)] = up
        fused_mlp.DOWN_CONFIGS[(k, inter)] = dict(entry["down"])
    return {"swiglu": {str(k): v for k, v in fused_mlp.SWIGLU_CONFIGS.items()},
            "down": {str(k): v for k, v in fused_mlp.DOWN_CONFIGS.items()}}


def check_linear(model) -> dict:
    """One QuantizedLinear of the engine's model vs the float32 emulation, on the GPU, at decode M = 64."""
    from lumenrl_quant.error import sqnr_db
    from lumenrl_quant.fp8 import quantize_fp8
    from lumenrl_quant.gemm import run_gemm_path
    from lumenrl_quant.linear import _FP8_LAYOUTS, QuantizedLinear

    lin = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    x = torch.randn(64, lin.in_features, device=lin.weight.device, dtype=torch.bfloat16)
    with torch.no_grad():
        out = lin(x).float()
        if lin.scheme not in _FP8_LAYOUTS:
            return {"path": "emulated", "sqnr_db": None}
        _, w_block, a_gran, a_block = _FP8_LAYOUTS[lin.scheme]
        if a_gran is None:  # weight-only (fp8_w8a16): bf16 x times the dequantized weight
            ref = x.float() @ lin.dequantized_weight(torch.float32).t()
            ref = ref if lin.bias is None else ref + lin.bias.float()
            return {"path": lin.gemm_path_for(64), "sqnr_db": sqnr_db(ref, out)}
        a_q, a_s = quantize_fp8(x, dtype=lin.fp8_dtype, granularity=a_gran, block_size=a_block, backend="torch")
        ref = run_gemm_path("emulated", a_q, a_s, lin.weight, lin.weight_scale, out_dtype=torch.float32,
                            bias=lin.bias, a_block_size=a_block, b_block_size=w_block)
    return {"path": lin.gemm_path_for(64), "sqnr_db": sqnr_db(ref, out)}


def measure(name: str, mode: str, train_model, batch, params: dict, args, with_kl: bool) -> dict:
    row = {"engine": name, "mode": mode}
    scheme = scheme_of(name)
    engine, removed = None, {}
    try:
        # every engine gets its own copy: the trainer model stays untouched (engines attach fusion state
        # to the model they run, which deepcopy cannot copy), and all variants start from identical weights
        model = copy.deepcopy(train_model)
        flags = variant(name)[1]
        quant = None if scheme is None else get_quant_scheme(
            scheme, skip_first_n_layers=args.skip_first, skip_last_n_layers=args.skip_last,
            quantize_lm_head="head" in flags)
        # +cublasod: o and down without Triton launch parameters (their GEMM path is chosen when the layers are
        # built, and the parameters are read at each call): removed while this engine runs, restored after it
        removed = {shape: gemm.TRITON_ROWWISE_CONFIGS.pop(shape) for shape in CUBLAS_OD
                   if shape in gemm.TRITON_ROWWISE_CONFIGS} if "cublasod" in flags else {}
        engine = NativeEngine(model, C.StubTokenizer(), device=C.DEVICE, max_batch_size=args.batch,
                              max_seq_len=args.prompt + args.new, compile="full" if mode == "full" else "none",
                              quant_scheme=quant, kv_cache_dtype="fp8" if "kv" in flags else "auto",
                              kernels=KernelOptions(
                                  fuse_fp8_mlp="fusedmlp" in flags, fp8_act_kernel="inductmlp" not in flags,
                                  fp8_attn_out="tokattn" not in flags, fp8_norm_quant="tokln" not in flags,
                                  fused_qk_rope="unfusedrope" not in flags, kv_v_tiles="vtiles" in flags,
                                  pdl="nopdl" not in flags, pdl_prefetch=prefetch_bytes(flags),
                                  pdl_prefetch_second=prefetch_bytes(flags, "pfs"),
                                  rope_in_attention="ropeattn" in flags, fused_norm="fusednorm" in flags,
                                  tma="tma" in flags))
        if engine.fusion_report is not None:
            row["fused_fp8_mlps"] = len(engine.fusion_report.mlp_fp8)
            row["act_kernel_mlps"] = len(engine.fusion_report.mlp_fp8_token)
            row["fused_rope_attentions"] = len(engine.fusion_report.attention_fused_rope)
        if scheme is not None:
            report = engine.quant_report
            row.update(quantized_linears=len(report.quantized), skipped_linears=len(report.skipped),
                       lm_head=type(getattr(engine.model, "lm_head", None)).__name__)
            check = check_linear(engine.model)
            row.update(linear_path=check["path"], linear_check_sqnr_db=check["sqnr_db"])
            o_proj = engine.model.model.layers[-1].self_attn.o_proj  # +cublasod: its path at the batch's M
            row["o_proj_path"] = o_proj.gemm_path_for(args.batch) if hasattr(o_proj, "gemm_path_for") else "bf16"
            if check["sqnr_db"] is not None and check["sqnr_db"] < 30.0:
                raise RuntimeError(f"linear_check: GPU QuantizedLinear vs emulation SQNR {check['sqnr_db']:.1f} dB "
                                   "< 30 dB; not timing this variant")
        t0 = time.perf_counter()
        engine.generate(batch, params)  # warm-up: graphs, compilation, kernels, KV scales
        row["warmup_s"] = time.perf_counter() - t0
        out, total = C.timed(lambda: engine.generate(batch, params))
        decode_s = total - out.meta_info["perf"]["prefill_seconds"]
        row.update(e2e_tok_s=args.batch * args.new / total, decode_tok_s=args.batch * (args.new - 1) / decode_s,
                   prefill_s=out.meta_info["perf"]["prefill_seconds"], graph_error=engine.graphs.error)
        if args.profile:
            steps = 32
            roof = C.decode_roofline(engine.model, batch=args.batch, prompt_len=args.prompt, new_tokens=steps + 1,
                                     bandwidth_gbs=1.0, kv_element=1 if "kv" in flags else 2)
            row["profile"] = C.profile_engine(engine, batch, params, steps=steps, weight_bytes=roof["weight_gb"] * 1e9,
                                              kv_bytes=roof["kv_gb_mean"] * 1e9)
            C.print_profile(row["profile"], f"{name}/{mode}")
        metrics = sampled_metrics(train_model, out)
        row.update(kl_k3_sampled=metrics.get("rollout_correction/kl_k3"),
                   kl_k1_sampled=metrics.get("rollout_correction/kl_k1"), sampled_metrics=metrics)
        if with_kl:
            row.update(exact_kl(engine.model, train_model, out.batch["input_ids"], args.new))
    except Exception as err:  # noqa: BLE001 - keep the other engines' numbers
        row["error"] = f"{type(err).__name__}: {err}"[:400]
        print(f"ERROR {name}/{mode}: {row['error']}", flush=True)
    finally:
        gemm.TRITON_ROWWISE_CONFIGS.update(removed)  # +cublasod: back for the next engine
    engine = None  # free the engine (and its model copy) before the next variant
    return row


def summarize(rows: list[dict], command: str) -> dict:
    for r in rows:
        base = next((b for b in rows if b["engine"] == "bf16" and b["mode"] == r["mode"] and "decode_tok_s" in b), None)
        if base and "decode_tok_s" in r:
            r["x_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
    for r in rows:  # exact KLs are mode independent: show them on every row of the engine
        src = next((s for s in rows if s["engine"] == r["engine"] and "kl_exact_after_tis" in s), None)
        if src and "kl_exact_after_tis" not in r:
            r.update(kl_exact_before=src["kl_exact_before"], kl_exact_after_tis=src["kl_exact_after_tis"])
    fp8 = [r for r in rows if scheme_of(r["engine"]) is not None and "x_bf16" in r]  # not bf16+qkrope / bf16+unfusedrope
    summary = {}
    if fp8:
        best = max(fp8, key=lambda r: r["x_bf16"])
        summary["fp8_rollout_speedup_8b_b64"] = {"value": best["x_bf16"], "engine": best["engine"],
                                                 "mode": best["mode"], "command": command}
        if "kl_exact_after_tis" in best:
            summary["fp8_rollout_kl_after_tis"] = {
                "value": best["kl_exact_after_tis"], "before_tis": best["kl_exact_before"], "engine": best["engine"],
                "definition": "mean over response positions of KL(q_TIS || p_train), q_TIS = min(p_train, 2 p_roll)/Z",
                "command": command}
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--engines", default="bf16,fp8_row,fp8_block")
    ap.add_argument("--modes", default=None, help="comma separated: graph (CUDA graphs), full (torch.compile + graphs)")
    ap.add_argument("--mode", default="graph", help="single mode (kept for old command lines; --modes wins)")
    ap.add_argument("--skip-first", type=int, default=0, help="decoder layers kept bf16 at the start")
    ap.add_argument("--skip-last", type=int, default=0, help="decoder layers kept bf16 at the end")
    ap.add_argument("--kl-every-mode", action="store_true", help="recompute the exact KLs in every mode")
    ap.add_argument("--no-exact-kl", action="store_true", help="skip the exact (full-vocabulary) KLs (saves ~5 s/engine)")
    ap.add_argument("--profile", action="store_true", help="profile each engine's decode steps as timed (see bench_decode)")
    ap.add_argument("--attn-fp8-config", default="", help="FP8-cache decode attention launch config: a JSON "
                    "object, or a bench_attention.py --tune JSON (its best FP8 row)")
    ap.add_argument("--mlp-config", default="", help="fused FP8 MLP launch configs: a bench_fused_mlp.py --tune JSON")
    ap.add_argument("--persistent-rnumel", type=int, default=0,
                    help="inductor: persistent (in-register) inner reductions up to this many columns (0: its default)")
    ap.add_argument("--out", default="fp8_rollout.json")
    args = ap.parse_args(argv)
    if args.persistent_rnumel:
        C.persistent_reductions_up_to(args.persistent_rnumel)
    modes = (args.modes or args.mode).split(",")
    for mode in modes:
        if mode not in ("graph", "full"):
            ap.error(f"--modes: {mode!r} is not a mode; allowed: graph, full")
    for name in args.engines.split(","):
        variant(name)  # bad suffixes fail before the model is built
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args)}
    if args.attn_fp8_config:
        result["attention_fp8_config"] = attention_override(args.attn_fp8_config)
        print(f"FP8-cache attention config: {result['attention_fp8_config']}")
    if args.mlp_config:
        result["mlp_config"] = mlp_override(args.mlp_config)
        print(f"fused FP8 MLP configs: {result['mlp_config']}")
    train_model = C.random_model(args.model)
    batch = C.prompt_batch(args.batch, args.prompt, seed=4)
    params = {"temperature": 1.0, "max_new_tokens": args.new, "seed": 11, "ignore_eos": True}
    rows, kl_done = [], set()
    for mode in modes:
        for name in args.engines.split(","):
            with_kl = not args.no_exact_kl and (args.kl_every_mode or name not in kl_done)
            rows.append(measure(name, mode, train_model, batch, params, args, with_kl))
            if "kl_exact_after_tis" in rows[-1]:  # a failed variant gets its exact KLs in the next mode
                kl_done.add(name)
            gc.collect()
            torch.cuda.empty_cache()
            if mode == "full":
                torch._dynamo.reset()  # each engine compiles its own model; drop the last one's graphs
            result["rows"] = rows
            C.write_json(args.out, result)
    result["summary"] = summarize(rows, result["command"])
    C.write_json(args.out, result)
    print("summary:", result["summary"])
    C.print_table(rows, ["engine", "mode", "e2e_tok_s", "decode_tok_s", "x_bf16", "kl_exact_before",
                         "kl_exact_after_tis", "kl_k3_sampled", "lm_head", "fused_fp8_mlps", "act_kernel_mlps", "fused_rope_attentions", "linear_path", "linear_check_sqnr_db", "warmup_s",
                         "prefill_s", "error"])
    return result


def run(smoke: bool) -> dict:
    """Suite entry: FP8 (fp8_row + FP8 KV + FP8 head) vs BF16 decode tok/s, compiled, 8B batch 64 (smoke:
    a tiny model, batch 2, on the CPU: the emulated FP8 path, its speed means nothing)."""
    fp8 = "fp8_row+kv" if smoke else "fp8_row+kv+head"  # the tiny model ties its head to the embeddings
    rows = main(["--model", "tiny", "--batch", "2", "--prompt", "8", "--new", "6", "--engines", f"bf16,{fp8}",
                 "--modes", "graph", "--out", "fp8_rollout_smoke.json"] if smoke else
                ["--engines", f"bf16,{fp8}", "--modes", "full", "--no-exact-kl", "--profile"])["rows"]
    failed = {r["engine"]: r["error"] for r in rows if "error" in r}
    if failed:
        raise RuntimeError(f"fp8 rollout engines failed: {failed}")
    tok = {r["engine"]: r["decode_tok_s"] for r in rows if "decode_tok_s" in r}
    profiles = {}
    for r in rows:  # the full run profiles both engines' decode steps: where the FP8 step's time goes
        profiles.update(C.profile_numbers(r.get("profile"), f"profile_{'fp8' if r['engine'] == fp8 else 'bf16'}/"))
    return {"bf16_decode_tok_s": tok["bf16"], "fp8_decode_tok_s": tok[fp8], "speedup": tok[fp8] / tok["bf16"],
            **profiles}


if __name__ == "__main__":
    main()
