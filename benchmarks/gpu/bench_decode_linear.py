"""Decode GEMMs: the engine's Triton decode kernel (``engines/triton_linear.py``) against cuBLAS.

At the fused Qwen3-8B decode shapes, M = 64: q/k/v (N 6144, K 4096), o (4096, 4096), gate/up with
SwiGLU (2 x 12288, 4096; cuBLAS side: the GEMM plus ``silu(gate) * up``, as the engine ran it before)
and down (4096, 12288). Each shape is timed over enough distinct weights that the working set is
several times the L2, every rotation inside one CUDA graph (as in a decode step):

* ``cublas``: ``F.linear`` (+ the SwiGLU elementwise op for gate/up);
* ``triton``: :func:`~lumenrl_backends.engines.triton_linear.decode_linear` with its default launch
  parameters (``--tune``: also every configuration of a sweep; the best is reported per shape);
* ``chain``: one layer's four GEMMs in order over 36 layers' distinct weights, each reading the
  previous output (a decode step's GEMMs without attention and norms), by cuBLAS, by the kernel,
  and by the kernel with PDL (``pdl=True``): what the launches cost between kernels; then the same
  chain with the layer's two residual adds and RMSNorms, as compiled kernels between the PDL GEMMs
  (``triton_pdl_norms``: the engine's default layer) and inside them (``triton_pdl_fused``:
  ``KernelOptions.fused_norm``, norm in q/k/v and gate/up, residual in o and down).

GB/s counts weight bytes. Checked first: the kernel against cuBLAS (relative error <= 1e-2).

    python benchmarks/gpu/bench_decode_linear.py --tune
    python benchmarks/gpu/bench_decode_linear.py --tune --splits 1,2,4   # also split-K (the chain A/Bs the best)
    python benchmarks/gpu/bench_decode_linear.py --tune --tma 0,1        # also tiles copied by TMA descriptors
    python benchmarks/gpu/bench_decode_linear.py --tune --tune-chain 3   # parameters chosen inside the chain
    python benchmarks/gpu/bench_decode_linear.py --persistent 3          # the chain as one persistent launch
    python benchmarks/gpu/bench_decode_linear.py --persistent 1 --persistent-stages "6,8,12,8;5,6,8,6"

``--shapes 0.6b --m 128``: Qwen3-0.6B's shapes at the GRPO benchmark's rollout batch (two 64-row tiles
per weight tile; ``--layers 28``).

Smoke (``run(True)``): M = 4, one tiny shape per kind, on the CPU (the op's torch reference path).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import benchmarks.gpu._common as C  # noqa: E402
from lumenrl_backends.engines import triton_linear as tlin  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (24576, 4096, True),
          "down": (4096, 12288, False)}
# Qwen3-0.6B (hidden 1024, 16 + 8 + 8 heads of 128, intermediate 3072): the GRPO benchmark's rollout, batch 128
SHAPES_06B = {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (6144, 1024, True),
              "down": (1024, 3072, False)}
TINY = {"qkv": (128, 64, False), "o": (64, 64, False), "gate_up": (256, 64, True), "down": (64, 128, False)}
PRESETS = {"8b": SHAPES, "0.6b": SHAPES_06B, "tiny": TINY}


def _cublas(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    out = F.linear(x, w)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def _sweep(n: int, k: int, swiglu: bool, splits: tuple[int, ...] = (1,), tmas: tuple[int, ...] = (0,)) -> list[dict[str, int]]:
    out = []
    for bn, bk, stages, warps, split, tma in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 5, 6), (4, 8),
                                                               splits, tmas):
        operands = 2 if swiglu else 1
        if (n // 2 if swiglu else n) % bn or k % (bk * split) or stages * (tlin.TILE_M + operands * bn) * bk * 2 > 220_000:
            continue
        if (warps == 8) != (bn * operands >= 128) or k // split < stages * bk:  # a split shorter than the pipeline
            continue
        out.append({"block_n": bn, "block_k": bk, "num_stages": stages, "num_warps": warps, "split": split,
                    **({"tma": 1} if tma else {})})
    return out


def _ints(flag: str, value: str, low: int, high: int | None) -> tuple[int, ...]:
    parts = value.split(",")
    out = tuple(int(v) for v in parts if v.strip().isdigit())
    if not out or len(out) != len(parts) or min(out) < low or (high is not None and max(out) > high):
        raise SystemExit(f"{flag} {value!r}: allowed comma-separated ints in {low}..{high if high is not None else ''}")
    return out


def bench_shape(name: str, n: int, k: int, swiglu: bool, m: int, tune: bool,
                splits: tuple[int, ...] = (1,), tmas: tuple[int, ...] = (0,)) -> list[dict]:
    dev = C.DEVICE
    copies = max(2, math.ceil(400e6 / (n * k * 2))) if dev == "cuda" else 2
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    gb = n * k * 2 / 1e9
    ref = _cublas(x, weights[0], swiglu).float()
    rows = []
    ms, how = C.time_graph_ms([lambda w=w: _cublas(x, w, swiglu) for w in weights])
    rows.append({"shape": name, "path": "cublas", "us": ms * 1e3, "gbs": gb / ms * 1e3, "timing": how})
    configs = [None] + (_sweep(n, k, swiglu, splits, tmas) if tune and dev == "cuda" else [])
    best, ranked = None, []
    for cfg in configs:
        if dev == "cuda":
            calls = [lambda w=w, c=cfg: tlin._launch(x, w, None, swiglu, False, 0, c) for w in weights]
        else:  # smoke: the op (torch reference off CUDA)
            calls = [lambda w=w: tlin.decode_linear(x, w, swiglu=swiglu) for w in weights]
        try:
            err = float((calls[0]().float() - ref).norm() / ref.norm())
            if not err <= 1e-2:
                raise AssertionError(f"relative error {err:.3g} against cuBLAS")
            ms, how = C.time_graph_ms(calls)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit: report, go on
            rows.append({"shape": name, "path": "triton", "config": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        row = {"shape": name, "path": "triton" if cfg is None else "triton-tuned", "config": cfg or "default",
               "us": ms * 1e3, "gbs": gb / ms * 1e3, "rel_err": err, "timing": how}
        if cfg is None:
            rows.append(row)
            continue
        ranked.append((row["us"], cfg))
        if best is None or row["us"] < best["us"]:
            best = row
    if best is not None:  # the sweep's fastest, with its next fastest (the chain tuner's candidates)
        best["ranked"] = [{"us": us, "config": cfg} for us, cfg in sorted(ranked, key=lambda t: t[0])[:8]]
        rows.append(best)
    return rows


# the persistent chain's deeper pipelines (q/k/v, o, gate/up, down at the 8B shapes: 192-216 KB each, one program
# per multiprocessor); the decode kernel's table gives gate/up 4 stages (64 KB), as three of its programs share one
DEEP_STAGES = (6, 8, 12, 8)
TWO_PER_SM = 113_000  # shared memory per program that leaves room for a second one (H100 / H200: 228 KB per SM)


def smem_bytes(cfg: dict[str, int], swiglu: bool) -> int:
    """The pipeline's shared memory: ``num_stages`` x (x tile + weight tile(s)) of 16-bit elements."""
    return cfg["num_stages"] * (tlin.TILE_M + (2 if swiglu else 1) * cfg["block_n"]) * cfg["block_k"] * 2


def chain_candidates(table: dict[str, int], ranked: list[dict], swiglu: bool, top: int = 4) -> list[dict[str, int]]:
    """Configurations of one shape worth timing inside the chain: the table's, the isolated sweep's ``top``
    fastest (``ranked``: rows of {"us", "config"}, fastest first), and each of those with as many stages as leave
    room for a second program per multiprocessor (:data:`TWO_PER_SM`), where that keeps 2 or more. In the chain a
    PDL launch's programs start, prefetch and wait on multiprocessors the previous kernel still runs on only where
    its shared memory leaves room; the isolated sweep, one kernel after another without PDL, cannot see that."""
    out: list[dict[str, int]] = []
    for cfg in [dict(table)] + [dict(r["config"]) for r in ranked[:top]]:
        lean = dict(cfg)
        while smem_bytes(lean, swiglu) > TWO_PER_SM and lean["num_stages"] > 2:
            lean["num_stages"] -= 1
        for c in (cfg, lean):
            if not any(same_config(c, o) for o in out) and (c is cfg or smem_bytes(c, swiglu) <= TWO_PER_SM):
                out.append(c)
    return out


def same_config(a: dict[str, int], b: dict[str, int]) -> bool:
    """Whether two launch configurations are the same launch: the table's leave ``split`` (1) and ``tma`` (0) out,
    the sweep's name ``split`` always."""
    defaults = {"split": 1, "tma": 0}
    return {**defaults, **a} == {**defaults, **b}


class Chain:
    """One decode step's GEMMs over ``layers`` layers of distinct weights (q/k/v -> o -> gate/up+SwiGLU -> down,
    each reading the previous output): :meth:`step` alone, :meth:`with_norms` with the layer's residual adds and
    RMSNorms between them as compiled kernels (the engine's layer) or inside them (``fused``)."""

    def __init__(self, shapes: dict, m: int, layers: int) -> None:
        dev = C.DEVICE
        self.weights = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                         for name, (n, k, _) in shapes.items()} for _ in range(layers)]
        hidden = shapes["qkv"][1]  # the model width: q/k/v's K, o's N
        self.q_width = shapes["o"][1]  # the attention output o reads: the q heads (stands in for attention here)
        self.x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        self.norms = [(torch.rand(hidden, device=dev) + 0.5).to(torch.bfloat16) for _ in range(2)]
        options = tlin.inductor_pdl_options(dev == "cuda" and tlin.pdl_supported(torch.device(dev)))
        self.add_norm = torch.compile(lambda r, h, g: (r + h, tlin.rms_norm(r + h, g, 1e-6)), options=options)

    def step(self, kind: str, tma: bool = False) -> torch.Tensor:
        h, qw = self.x, self.q_width
        for w in self.weights:
            if kind == "cublas":
                h = F.linear(_cublas(F.linear(F.linear(h, w["qkv"])[:, :qw], w["o"]), w["gate_up"], True), w["down"])
            else:
                pdl = kind == "triton_pdl"
                h = tlin.decode_linear(tlin.decode_linear(tlin.decode_linear(h, w["qkv"], pdl=pdl, tma=tma)[:, :qw],
                                                          w["o"], pdl=pdl, tma=tma), w["gate_up"], swiglu=True, pdl=pdl,
                                       tma=tma)
                h = tlin.decode_linear(h, w["down"], pdl=pdl, tma=tma)
        return h

    def with_norms(self, fused: bool = False) -> torch.Tensor:
        h, d, qw, g0, g1 = self.x, torch.zeros_like(self.x), self.q_width, *self.norms  # d: the last down output
        for w in self.weights:
            if fused:
                a = tlin.decode_linear(h, w["qkv"], pdl=True, norm_weight=g0)[:, :qw]
                h = tlin.decode_linear(a, w["o"], pdl=True, residual=h)
                g = tlin.decode_linear(h, w["gate_up"], swiglu=True, pdl=True, norm_weight=g1)
                h = tlin.decode_linear(g, w["down"], pdl=True, residual=h)
            else:  # each residual add with the norm after it: one compiled kernel, as in the engine's layer
                h, n = self.add_norm(h, d, g0)
                a = tlin.decode_linear(n, w["qkv"], pdl=True)[:, :qw]
                h, n = self.add_norm(h, tlin.decode_linear(a, w["o"], pdl=True), g1)
                d = tlin.decode_linear(tlin.decode_linear(n, w["gate_up"], swiglu=True, pdl=True), w["down"], pdl=True)
        return h if fused else h + d

    def persistent(self, prefetch: int = tlin.PDL_PREFETCH, num_warps: int = 4,
                   stages: tuple[int, int, int, int] | None = None, dataflow: bool = False, segments: bool = True,
                   trace: bool = False) -> dict:
        """The chain of :meth:`step` as one persistent launch (:mod:`benchmarks.gpu.persistent_chain`): ms per step,
        checked first against the per-GEMM chain (``equal``: the same bits; else the relative error). ``segments``:
        under dataflow, K in segments by the producer's waves (else one flag wait per tile); ``trace``: also where
        the launch spends its time (``timeline``: :func:`persistent_chain.timeline`)."""
        from benchmarks.gpu.persistent_chain import PersistentChain, timeline

        if getattr(self, "_persistent", None) is None:  # its stacked copy of the weights is made once
            self._persistent = PersistentChain(self.weights, self.q_width)
        chain = self._persistent
        chain.prefetch, chain.num_warps, chain.dataflow, chain.flow_segments = prefetch, num_warps, dataflow, segments
        chain.set_stages(stages)
        ref, out = self.step("triton"), chain(self.x)
        # bits compared as integers: 36 layers of random weights without norms may overflow to inf / NaN, alike
        equal = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        finite = ref.isfinite()
        err = 0.0 if equal else float((out.float() - ref.float())[finite].norm() / ref.float()[finite].norm())
        if not equal and not (err <= 1e-2 and torch.equal(out.isfinite(), finite)):
            raise AssertionError(f"persistent chain: relative error {err:.3g} against the per-GEMM chain")
        row = {"ms": self.time(lambda: chain(self.x)), "equal": equal, "rel_err": err, "programs": chain.programs,
               "prefetch": prefetch, "num_warps": num_warps}
        if trace:
            row["timeline"] = timeline(chain, self.x)
        return row

    def time(self, fn: Callable[[], torch.Tensor], table: dict | None = None) -> float:
        """ms of ``fn`` replayed in a CUDA graph, with ``table`` ({(N, K, swiglu): launch parameters}) in place of
        the measured table's entries for that time."""
        saved = dict(tlin.TUNED)
        try:
            tlin.TUNED.update(table or {})
            fn()  # compile outside the capture
            ms, _ = C.time_graph_ms([fn], iters=10)
        finally:
            tlin.TUNED.clear()
            tlin.TUNED.update(saved)
        return ms


def bench_chain(shapes: dict, m: int, layers: int, best: dict | None = None, tma_rounds: int = 0,
                persistent_rounds: int = 0, persistent_stages: tuple[tuple[int, int, int, int], ...] = (),
                persistent_trace: bool = False, persistent_prefetch: tuple[int, ...] = ()) -> dict:
    """The :class:`Chain` of one decode step: ms per step by cuBLAS, the kernel, the kernel with PDL; ``best``
    ({(N, K, swiglu): launch parameters}, a sweep's best): also the kernel with PDL at those parameters
    (``triton_pdl_best``), then at the table's again (``triton_pdl_again``); ``tma_rounds``: that many rounds of the
    kernel with PDL at the table's parameters by pointer loads and by TMA copies (lists of ms, alternating); then
    the layers with their norms between the GEMMs (``triton_pdl_norms``) and inside them (``triton_pdl_fused``);
    ``persistent_rounds``: that many rounds of the chain as one persistent launch (``persistent_pf<bytes>_w<warps>``:
    with and without the next GEMM's L2 prefetch before each grid barrier, 4 and 8 warps, ``_deep``: the pipelines of
    :data:`DEEP_STAGES`, ``_flow``: per-tile flags instead of grid barriers) and of the PDL chain (``triton_pdl_ab``),
    then the cost of one grid barrier alone; ``persistent_stages``: the dataflow chain at each of these pipeline
    depths (q/k/v, o, gate/up, down), one timing each (``persistent_flow_stages``); ``persistent_trace``: the
    timelines of the deep-pipelined chain with barriers, with flags and K segments, and with one flag wait per tile
    (``persistent_timeline``: each variant's ms and :func:`persistent_chain.timeline`); ``persistent_prefetch``: the
    deep-pipelined chain with barriers at each of these L2 prefetches (weight columns per row of the next GEMM's
    first tile, before each barrier), each with its timeline (``persistent_timeline``, ``barrier_pf<columns>``)."""
    chain = Chain(shapes, m, layers)
    out = {kind: chain.time(lambda k=kind: chain.step(k)) for kind in ("cublas", "triton", "triton_pdl")}
    if best:  # the sweep's best launch parameters in place of the table's, side by side with the table's
        out["triton_pdl_best"] = chain.time(lambda: chain.step("triton_pdl"), best)
        out["triton_pdl_again"] = chain.time(lambda: chain.step("triton_pdl"))
    for _ in range(tma_rounds):  # the table's launch parameters with pointer loads, then TMA copies, alternating
        for tma in (False, True):
            ms = chain.time(lambda t=tma: chain.step("triton_pdl", t))
            out.setdefault("triton_pdl_tma" if tma else "triton_pdl_pointers", []).append(ms)
    out["triton_pdl_norms"] = chain.time(lambda: chain.with_norms(False))
    out["triton_pdl_fused"] = chain.time(lambda: chain.with_norms(True))
    for _ in range(persistent_rounds):  # the chain as one persistent launch, against the PDL chain, alternating
        for prefetch, warps, stages, flow in ((tlin.PDL_PREFETCH, 4, None, False), (0, 4, None, False),
                                              (tlin.PDL_PREFETCH, 8, None, False),
                                              (tlin.PDL_PREFETCH, 4, DEEP_STAGES, False),
                                              (tlin.PDL_PREFETCH, 4, DEEP_STAGES, True)):
            name = f"persistent_pf{prefetch}_w{warps}{'_deep' if stages else ''}{'_flow' if flow else ''}"
            try:
                row = chain.persistent(prefetch, warps, stages, flow)
            except Exception as exc:  # noqa: BLE001 - a variant that fails its check: report it, time the others
                out.setdefault(name, []).append(f"{type(exc).__name__}: {exc}"[:160])
                continue
            out.setdefault(name, []).append(row["ms"])
            out.setdefault("persistent_equal", []).append(row["equal"])
        out.setdefault("triton_pdl_ab", []).append(chain.time(lambda: chain.step("triton_pdl")))
    if persistent_rounds:
        from benchmarks.gpu.persistent_chain import barrier_us

        out["grid_barrier_us"] = barrier_us(torch.device(C.DEVICE))
    if persistent_trace:
        for name, flow, segments in (("barrier", False, True), ("flow", True, True), ("flow_one_wait", True, False)):
            row = chain.persistent(tlin.PDL_PREFETCH, 4, DEEP_STAGES, flow, segments, trace=True)
            out.setdefault("persistent_timeline", {})[name] = {"ms": row["ms"], "equal": row["equal"],
                                                                **row["timeline"]}
    for prefetch in persistent_prefetch:
        row = chain.persistent(prefetch, 4, DEEP_STAGES, False, trace=True)
        out.setdefault("persistent_timeline", {})[f"barrier_pf{prefetch}"] = {"ms": row["ms"], "equal": row["equal"],
                                                                               **row["timeline"]}
    for stages in persistent_stages:  # the dataflow chain at other pipeline depths (one timing each)
        try:
            out.setdefault("persistent_flow_stages", {})[",".join(map(str, stages))] = chain.persistent(
                tlin.PDL_PREFETCH, 4, stages, True)["ms"]
        except Exception as exc:  # noqa: BLE001 - stages that do not fit the shared memory: report, go on
            out.setdefault("persistent_flow_stages", {})[",".join(map(str, stages))] = f"{type(exc).__name__}: {exc}"[:160]
    return out


def tune_chain(shapes: dict, m: int, layers: int, ranked: dict, top: int = 4, passes: int = 2,
               rounds: int = 3) -> dict:
    """Launch parameters chosen inside the engine-like chain (:meth:`Chain.with_norms`, PDL) instead of one GEMM at a
    time: per shape the :func:`chain_candidates` of its sweep (``ranked``: {(N, K, swiglu): ranked rows}), one
    shape at a time, ``passes`` times over the shapes, keeping a change where the chain got faster; then the
    table's and the chosen parameters alternate for ``rounds`` timings each (the A/B that decides)."""
    chain = Chain(shapes, m, layers)
    run = lambda: chain.with_norms(False)  # noqa: E731 - the timed callable
    keys = [(n // 2 if swiglu else n, k, swiglu) for n, k, swiglu in shapes.values()]
    table = {key: tlin.config_for(key[0], key[1], torch.device(C.DEVICE), swiglu=key[2]) for key in keys}
    current, trials = dict(table), []
    best_ms = chain.time(run, current)
    for _ in range(passes):
        for key in keys:
            for cand in chain_candidates(table[key], ranked.get(key, []), key[2], top):
                if same_config(cand, current[key]):
                    continue
                trial = {**current, key: cand}
                try:
                    ms = chain.time(run, trial)
                except Exception as exc:  # noqa: BLE001 - a candidate that does not compile or fit: skip it
                    trials.append({"shape": list(key), "config": cand, "error": f"{type(exc).__name__}: {exc}"[:160]})
                    continue
                trials.append({"shape": list(key), "config": cand, "ms": ms})
                if ms < best_ms:
                    best_ms, current = ms, trial
    ab: dict[str, list[float]] = {"table_ms": [], "tuned_ms": []}
    for _ in range(rounds):
        ab["table_ms"].append(chain.time(run, table))
        ab["tuned_ms"].append(chain.time(run, current))
    changed = {str(key): cfg for key, cfg in current.items() if not same_config(cfg, table[key])}
    return {**ab, "changed": changed, "trials": trials}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=64, help=f"rows (1..{tlin.MAX_M}; past {tlin.TILE_M}: two row tiles)")
    ap.add_argument("--shapes", choices=sorted(PRESETS), default=None,
                    help="fused decode shapes of this model (default 8b; with --smoke: tiny)")
    ap.add_argument("--tune", action="store_true", help="also sweep the kernel's launch configurations (CUDA)")
    ap.add_argument("--splits", default="1", help="with --tune: K splits the sweep tries, comma-separated (1: no split-K)")
    ap.add_argument("--tma", default="0",
                    help="with --tune: tile loads the sweep tries: 0 pointers, 1 tensor descriptors (TMA)")
    ap.add_argument("--ab-tma", type=int, default=0, help="rounds of the chain with pointer loads vs TMA copies")
    ap.add_argument("--tune-chain", type=int, default=0, metavar="ROUNDS",
                    help="with --tune: choose the launch parameters inside the chain with norms, then ROUNDS A/B rounds")
    ap.add_argument("--persistent", type=int, default=0, metavar="ROUNDS",
                    help="rounds of the chain as one persistent launch (persistent_chain.py) vs the PDL chain")
    ap.add_argument("--persistent-stages", default="", metavar="S1,S2,S3,S4;...",
                    help="pipeline depths (q/k/v, o, gate/up, down) to time the dataflow persistent chain at")
    ap.add_argument("--persistent-trace", action="store_true",
                    help="timelines of the persistent chain (barriers, flags, flags without K segments)")
    ap.add_argument("--persistent-prefetch", default="", metavar="COLS,...",
                    help="L2 prefetches (weight columns per row, 0: none) to time the persistent chain with barriers at")
    ap.add_argument("--layers", type=int, default=None, help="layers of the chain (default 36; with --smoke: 2)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="decode_linear.json")
    args = ap.parse_args(argv)
    if args.shapes is None:  # --smoke's values only where the flag was left out
        args.shapes = "tiny" if args.smoke else "8b"
    if args.layers is None:
        args.layers = 2 if args.smoke else 36
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: allowed 1 or more")
    for flag, value, default in (("--splits", args.splits, "1"), ("--tma", args.tma, "0")):
        if value != default and not args.tune:
            ap.error(f"{flag} {value!r}: sets what the --tune sweep tries; add --tune or drop {flag}")
    if args.tune_chain and not args.tune:
        ap.error(f"--tune-chain {args.tune_chain}: chooses among the --tune sweep's fastest; add --tune")
    if (args.tune or args.tune_chain) and C.DEVICE != "cuda":
        ap.error(f"--tune{'/--tune-chain' if args.tune_chain else ''}: times Triton launch configurations and needs "
                 "CUDA (on the CPU only the op's torch path runs); drop it here")
    if not 1 <= args.m <= tlin.MAX_M:
        raise SystemExit(f"--m {args.m}: allowed 1..{tlin.MAX_M} (the kernel's row range)")
    splits, tmas = _ints("--splits", args.splits, 1, None), _ints("--tma", args.tma, 0, 1)
    stages = tuple(_ints("--persistent-stages", group, 2, 16) for group in args.persistent_stages.split(";") if group)
    if any(len(group) != 4 for group in stages):
        raise SystemExit(f"--persistent-stages {args.persistent_stages!r}: allowed groups of 4 ints in 2..16 "
                         "(q/k/v, o, gate/up, down), separated by ';'")
    prefetches = _ints("--persistent-prefetch", args.persistent_prefetch, 0, 4096) if args.persistent_prefetch else ()
    if any(p & (p - 1) or (p and p < 64) for p in prefetches):
        raise SystemExit(f"--persistent-prefetch {args.persistent_prefetch!r}: allowed 0 or powers of two 64..4096 (the smallest K)")
    shapes = dict(PRESETS[args.shapes])
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args), "rows": []}
    best, ranked = {}, {}
    for name, (n, k, swiglu) in shapes.items():
        result["rows"] += bench_shape(name, n, k, swiglu, args.m, args.tune, splits, tmas)
        tuned = [r for r in result["rows"] if r["shape"] == name and r["path"] == "triton-tuned" and "us" in r]
        if tuned:
            best[(n // 2 if swiglu else n, k, swiglu)] = tuned[-1]["config"]
            ranked[(n // 2 if swiglu else n, k, swiglu)] = tuned[-1]["ranked"]
        C.write_json(args.out, result)
    C.print_table(result["rows"], ["shape", "path", "config", "us", "gbs", "rel_err", "error"])
    result["chain_ms"] = bench_chain(shapes, args.m, args.layers, best, args.ab_tma,
                                     args.persistent, stages, args.persistent_trace, prefetches)
    print("chain (ms per step):", {k: v for k, v in result["chain_ms"].items() if k != "persistent_timeline"})
    for name, row in result["chain_ms"].get("persistent_timeline", {}).items():
        print(f"persistent timeline, {name}:", row)
    if args.tune_chain:  # (checked above: with --tune, on CUDA)
        result["chain_tune"] = tune_chain(shapes, args.m, args.layers, ranked, rounds=args.tune_chain)
        print("chain with norms, table vs chosen in the chain (ms):", {k: v for k, v in result["chain_tune"].items()
                                                                     if k != "trials"})
    C.write_json(args.out, result)
    return result


def run(smoke: bool) -> dict:
    """Suite entry (a measurement, no goal): per-shape GB/s of cuBLAS and the kernel, and the chain of one
    decode step's GEMMs (36 layers) by cuBLAS, the kernel and the kernel with PDL (8B shapes, M = 64;
    smoke: tiny shapes, M = 4, CPU)."""
    res = main(["--smoke", "--m", "4", "--out", "decode_linear_smoke.json"] if smoke else [])
    out = {}
    for row in res["rows"]:
        if "us" in row:
            out[f"{row['shape']}_{row['path']}_gbs"] = row["gbs"]
    chain = res["chain_ms"]
    out.update({f"chain_{k}_ms": v for k, v in chain.items()})
    out["chain_triton_over_cublas"] = chain["cublas"] / chain["triton"]
    out["chain_triton_pdl_over_cublas"] = chain["cublas"] / chain["triton_pdl"]
    out["chain_fused_norm_over_norms"] = chain["triton_pdl_norms"] / chain["triton_pdl_fused"]
    return out


if __name__ == "__main__":
    main()
