"""The decode GEMM kernel (``engines/triton_linear.py``): numerics against float64, its routing in the
fused modules, and the engine with it against the engine without it.

* CPU: launch parameters, refusals, where the fusion routes (and why not);
* Triton's interpreter (one subprocess): the kernel against a float64 GEMM on fresh random inputs
  (bias, SwiGLU, M from 1 to 128, bf16 and fp16), and a tiny bf16 Qwen3 engine with and without it;
* CUDA (skipped elsewhere): the kernel at Qwen3-8B's decode shapes with PDL, a PDL chain captured in
  a CUDA graph against the same chain launched plainly, and an engine under ``compile="full"``.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine
from lumenrl_backends.engines import triton_linear as tlin
from lumenrl_backends.engines.fusion import fuse_projections, unfuse_projections
from lumenrl_backends.models import build_tiny_model, load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA_TRITON = HAS_TRITON and torch.cuda.is_available()
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def float64_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool,
                      norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The exact function: ``residual + (RMSNorm(x) @ w.T + b)`` (each part optional) in float64."""
    x64 = x.double()
    if norm is not None:
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0].double()
    out = x64 @ weight.double().T + (bias.double() if bias is not None else 0.0)
    if swiglu:  # the kernel rounds gate and up to the model dtype first, as the unfused GEMM's outputs are
        gate, up = out.to(x.dtype).double().chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out if residual is None else out + residual.double()


def kernel_errors(m: int, n: int, k: int, dtype: torch.dtype, *, bias: bool, swiglu: bool, device: str = "cpu",
                  pdl: bool = False, seed: int = 0, norm: bool = False, residual: bool = False,
                  config: dict | None = None) -> dict:
    """The kernel on fresh random operands: relative error against float64, and elements further from
    the float32 torch reference than summation order explains: one output ulp, or for SwiGLU three (a
    gate or up value that rounds to its other neighbour moves ``silu(gate) * up`` by up to ~2 ulps); with a
    residual, one more ulp of the GEMM's part (rounded before the add). ``norm``: an RMSNorm of x (weight
    around 1, eps 1e-6) inside the GEMM, x at a scale far from 1 (the norm matters); ``residual``: + a residual.
    ``config``: these launch parameters (a K ``split`` among them), launched twice: whether the bits repeat and the
    split-K counters are back at zero; with ``"tma": 1`` also whether the bits equal the pointer loads'."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * (7.0 if norm else 1.0)).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    g = (1 + 0.3 * torch.randn(k, generator=gen)).to(device, dtype) if norm else None
    r = torch.randn(m, n // 2 if swiglu else n, generator=gen).to(device, dtype) if residual else None
    reason = tlin.supported(x, weight, b, swiglu, g, r)
    extra = {}
    if config is None:
        out = tlin.decode_linear(x, weight, b, swiglu=swiglu, pdl=pdl, norm_weight=g, eps=1e-6, residual=r)
    else:
        out = tlin._launch(x, weight, b, swiglu, pdl, tlin.PDL_PREFETCH, config, g, 1e-6, r)
        again = tlin._launch(x, weight, b, swiglu, pdl, tlin.PDL_PREFETCH, config, g, 1e-6, r)
        extra = {"repeats": bool(torch.equal(out, again)),
                 "counters_zero": all(int(c.abs().sum()) == 0 for c in tlin._COUNTERS.values())}
        if config.get("tma"):  # the same tiles in the same order as pointer loads: the same bits
            plain = tlin._launch(x, weight, b, swiglu, pdl, tlin.PDL_PREFETCH, {**config, "tma": 0}, g, 1e-6, r)
            extra.update(tma_reason=tlin.tma_reason(x, weight), equals_pointer_loads=bool(torch.equal(out, plain)))
    ref64 = float64_reference(x, weight, b, swiglu, None if g is None else (g, 1e-6), r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order for the float32 reference, whatever the runner's thread count
    try:
        ref = tlin.reference_decode_linear(x, weight, b, swiglu, g, 1e-6, r)
        part = tlin.reference_decode_linear(x, weight, b, swiglu, g, 1e-6) if residual else ref
    finally:
        torch.set_num_threads(threads)
    scale = ref.double().abs() + (part.double().abs() if residual else 0.0)
    ulp = torch.finfo(dtype).eps * scale.clamp_min(torch.finfo(dtype).tiny) * (3 if swiglu else 1)
    hf = tlin.torch_linear(x, weight, b, swiglu, g, 1e-6, r)  # transformers' sequence: norm, GEMM, add
    return {"reason": reason, "shape": list(out.shape), "finite": bool(torch.isfinite(out).all()),
            "rel_error": float((out.double() - ref64).norm() / ref64.norm()),
            "hf_rel_error": float((hf.double() - ref64).norm() / ref64.norm()),
            "beyond_tolerance": int(((out.double() - ref.double()).abs() > ulp * 1.01).sum()), **extra}


# ------------------------------------------------------------------ CPU: parameters, refusals, routing
def test_config_rule_and_table():
    cpu = torch.device("cpu")  # 132 multiprocessors assumed off CUDA (the H200's count); the table is CUDA-only
    assert tlin.config_for(6144, 4096, cpu)["block_n"] == 32  # narrow tiles: 192 programs
    assert tlin.config_for(12288, 4096, cpu, swiglu=True)["block_k"] == 64  # two tiles per stage
    assert tlin.config_for(151936, 4096, cpu)["block_n"] == 128  # an lm head: 1187 programs
    shapes = [(6144, 4096, False), (4096, 12288, False), (12288, 4096, True), (64, 64, False), (96, 48, False)]
    for n, k, swiglu in shapes + list(tlin.TUNED):
        cfg = tlin.TUNED.get((n, k, swiglu)) or tlin.config_for(n, k, cpu, swiglu=swiglu)
        operands = 2 if swiglu else 1
        assert k % cfg["block_k"] == 0 and n % cfg["block_n"] == 0 or (n, k) == (96, 48)
        assert cfg["num_stages"] * (tlin.TILE_M + operands * cfg["block_n"]) * cfg["block_k"] * 2 <= 220_000


def test_refusals_name_the_argument():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="swiglu=True needs weight"):
        tlin.decode_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w[:63], swiglu=True)
    with pytest.raises(ValueError, match="prefetch=-1"):
        tlin.decode_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w, prefetch=-1)
    with pytest.raises(ValueError, match="min_m=0"):
        tlin.decode_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w, min_m=0)
    for bad in (0, 129):
        with pytest.raises(ValueError, match=f"max_m={bad}; allowed: an int in min_m..128"):
            tlin.decode_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w, max_m=bad)
    assert "M=129" in tlin.supported(torch.zeros(129, 64, dtype=torch.bfloat16), w)
    assert "float32" in tlin.weight_reason(w.float())
    assert "contiguous" in tlin.weight_reason(torch.zeros(64, 128, dtype=torch.bfloat16)[:, ::2])
    if not tlin.INTERPRETED:
        assert "device cpu" in tlin.weight_reason(w)


def test_without_the_kernel_the_op_computes_the_same_function():
    """Off CUDA (no interpreter) the op runs torch's linear: same function, checked against float64."""
    if tlin.INTERPRETED:
        pytest.skip("this process interprets Triton")
    row = kernel_errors(5, 64, 128, torch.bfloat16, bias=True, swiglu=True)
    assert row["reason"] is not None and row["shape"] == [5, 32] and row["beyond_tolerance"] == 0
    assert row["rel_error"] < 4e-3  # one bf16 rounding (2^-8 relative) of the output


def test_norm_and_residual_fall_back_to_transformers_sequence():
    """Where the kernel does not run (prefill rows, CPU), ``norm_weight``/``residual`` compute what the decoder
    layer computes: its RMSNorm module, the linear, then ``residual + out``, bit for bit."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(200, 64, generator=gen) * 5).to(torch.bfloat16)
    w, r = torch.randn(96, 64, generator=gen).to(torch.bfloat16), torch.randn(200, 96, generator=gen).to(torch.bfloat16)
    norm = Qwen3RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=gen))
        expected = r + torch.nn.functional.linear(norm(x), w)
        got = tlin.decode_linear(x, w, norm_weight=norm.weight, eps=norm.variance_epsilon, residual=r, max_m=64)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match=r"norm_weight shape \(32,\); allowed: \(64,\)"):
        tlin.decode_linear(x, w, norm_weight=norm.weight[:32])
    with pytest.raises(ValueError, match=r"residual shape \(200, 32\); allowed: \(200, 96\)"):
        tlin.decode_linear(x, w, residual=r[:, :32])
    with pytest.raises(ValueError, match="eps=-1.0; allowed: a float >= 0"):
        tlin.decode_linear(x, w, norm_weight=norm.weight, eps=-1.0)
    assert "residual" in tlin.supported(x[:4], w, residual=r[:4].float())


def test_fused_norm_is_opt_in_and_needs_the_decode_gemms(tmp_path):
    model, _ = load_model_and_tokenizer(str(build_tiny_model("qwen3", tmp_path / "m", seed=0)), dtype="bfloat16")
    try:
        assert not KernelOptions().fused_norm
        report = fuse_projections(model, decode_linear="off", fused_norm=True)
        assert not report.layers_fused_norm and len(report.layers_fused_norm_skipped) == 2
        assert all("decode kernel" in r for r in report.layers_fused_norm_skipped.values())
        layer = model.model.layers[0]  # a norm handed to modules whose GEMMs are not on the op is refused, not dropped
        with torch.no_grad(), pytest.raises(RuntimeError, match="needs gate/up and down on the decode kernel"):
            layer.mlp(torch.zeros(2, 1, 64, dtype=torch.bfloat16),
                      lumenrl_norm=(layer.post_attention_layernorm.weight, 1e-6))
        if tlin.INTERPRETED:
            return
        # asked for with decode_linear="on": on the CPU the GEMMs stay on torch, so the norms stay separate too
        report = fuse_projections(model, decode_linear="on", fused_norm=True)
        assert not report.layers_fused_norm and len(report.layers_fused_norm_skipped) == 2
        assert all(m.__dict__.get("_lumenrl_layer_mode") is None for m in model.modules())
    finally:
        unfuse_projections(model)


def test_a_compiled_caller_is_not_specialised_on_the_row_count():
    """The op picks kernel or cuBLAS by M itself: one dynamic compile serves 5, 40 and 100 rows."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    w = torch.randn(128, 64).to(torch.bfloat16)
    f = torch.compile(lambda x: tlin.decode_linear(x, w, swiglu=True, min_m=33, max_m=64), backend=counter,
                      dynamic=True)
    for rows in (5, 40, 100):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(f(x), tlin.decode_linear(x, w, swiglu=True, min_m=33, max_m=64))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_fusion_routes_decode_gemms_and_says_why_not(tmp_path):
    model, _ = load_model_and_tokenizer(str(build_tiny_model("qwen3", tmp_path / "m", seed=0)), dtype="bfloat16")
    try:
        report = fuse_projections(model, decode_linear="on")
        if tlin.INTERPRETED:
            assert len(report.decode_linear) == 4 and not report.decode_linear_skipped  # 2 layers x (attention, MLP)
        else:  # on the CPU without the interpreter: asked for, refused with the reason
            assert not report.decode_linear and all("device cpu" in r for r in report.decode_linear_skipped.values())
            assert len(report.decode_linear_skipped) == 4
        off = fuse_projections(model, decode_linear="off")  # refusing again switches it off on the fused modules
        assert not off.decode_linear and not off.decode_linear_skipped
        assert all(m.__dict__.get("_lumenrl_decode_linear") is None for m in model.modules())
    finally:
        unfuse_projections(model)


def test_auto_takes_only_measured_shapes_and_bad_modes_are_refused(tmp_path):
    model, tokenizer = load_model_and_tokenizer(str(build_tiny_model("qwen3", tmp_path / "m", seed=0)), dtype="bfloat16")
    try:
        report = fuse_projections(model, decode_linear="auto")  # the tiny shapes have no measured parameters
        assert not report.decode_linear and len(report.decode_linear_skipped) == 4
        assert all("measured" in r or "device cpu" in r for r in report.decode_linear_skipped.values())
        with pytest.raises(ValueError, match="decode_linear='fast'; allowed: auto, on, off"):
            fuse_projections(model, decode_linear="fast")
    finally:
        unfuse_projections(model)
    with pytest.raises(ValueError, match="kernels.decode_linear=True; allowed: auto, on, off"):
        NativeEngine(model, tokenizer, max_batch_size=2, max_seq_len=16, kernels=KernelOptions(decode_linear=True))
    # the table holds the 8B and 0.6B decode shapes, for 132-multiprocessor CUDA devices only
    assert (6144, 4096, False) in tlin.TUNED and not tlin.tuned(6144, 4096, torch.device("cpu"))
    assert (4096, 1024, False) in tlin.TUNED


# ------------------------------------------------------------------ Triton's interpreter (one subprocess)
_INTERPRETED = """
import json, tempfile, torch
from test_backends_engine_decode_linear import (auto_launches_by_rows, engines_fused_norm, engines_tma,
                                               engines_with_and_without, kernel_errors, routed_mlps_against_original)

for m, n, k, dt, bias, swiglu in ((1, 64, 256, "bfloat16", False, False), (5, 96, 512, "bfloat16", True, False),
                                  (17, 128, 256, "bfloat16", False, True), (64, 64, 128, "bfloat16", True, True),
                                  (33, 128, 1024, "float16", False, False), (3, 64, 128, "float16", True, True),
                                  (100, 64, 256, "bfloat16", True, False), (128, 64, 128, "bfloat16", False, True),
                                  (65, 128, 128, "float16", True, True)):
    row = kernel_errors(m, n, k, getattr(torch, dt), bias=bias, swiglu=swiglu, seed=m)
    print(json.dumps({"case": f"{m}x{n}x{k}_{dt}_bias{int(bias)}_swiglu{int(swiglu)}", "dtype": dt, **row}))
for m, n, k, dt, bias, swiglu, norm, res in ((1, 64, 256, "bfloat16", False, False, True, False),
                                             (5, 96, 512, "bfloat16", True, False, False, True),
                                             (17, 128, 256, "bfloat16", False, True, True, False),
                                             (64, 64, 128, "float16", True, False, True, True),
                                             (100, 64, 256, "bfloat16", False, False, True, True),
                                             (128, 64, 128, "bfloat16", True, True, True, True)):
    row = kernel_errors(m, n, k, getattr(torch, dt), bias=bias, swiglu=swiglu, seed=m + 1, norm=norm, residual=res)
    print(json.dumps({"case": f"{m}x{n}x{k}_{dt}_norm{int(norm)}_res{int(res)}", "dtype": dt, **row}))
for m, n, k, dt, bias, swiglu, res, split in ((1, 64, 256, "bfloat16", False, False, False, 2),
                                              (17, 96, 512, "float16", True, False, True, 4),
                                              (64, 64, 384, "bfloat16", False, True, False, 3),
                                              (100, 64, 256, "bfloat16", True, True, True, 2)):
    cfg = {"block_n": 32, "block_k": 64, "num_stages": 2, "num_warps": 4, "split": split}
    row = kernel_errors(m, n, k, getattr(torch, dt), bias=bias, swiglu=swiglu, seed=m + 2, residual=res, config=cfg)
    print(json.dumps({"case": f"{m}x{n}x{k}_{dt}_split{split}", "dtype": dt, **row}))
for m, n, k, dt, bias, swiglu, norm, res, split in ((1, 64, 256, "bfloat16", False, False, False, False, 1),
                                                   (17, 96, 512, "float16", True, False, True, True, 1),
                                                   (64, 64, 256, "bfloat16", False, True, True, False, 1),
                                                   (100, 64, 256, "bfloat16", True, True, False, True, 2)):
    cfg = {"block_n": 32, "block_k": 64, "num_stages": 2, "num_warps": 4, "split": split, "tma": 1}
    row = kernel_errors(m, n, k, getattr(torch, dt), bias=bias, swiglu=swiglu, seed=m + 3, norm=norm, residual=res,
                        config=cfg)
    print(json.dumps({"case": f"{m}x{n}x{k}_{dt}_tma_split{split}", "dtype": dt, **row}))
for family in ("qwen3", "llama"):
    print(json.dumps({"case": f"fused_norm_{family}", **engines_fused_norm(tempfile.mkdtemp(), family=family)}))
print(json.dumps({"case": "auto_rows", **auto_launches_by_rows(tempfile.mkdtemp())}))
print(json.dumps({"case": "engine_tma", **engines_tma(tempfile.mkdtemp())}))
for family in ("qwen3", "llama"):
    print(json.dumps({"case": f"engine_{family}", **engines_with_and_without(tempfile.mkdtemp(), family=family)}))
for family in ("qwen3", "llama", "deepseek_v3"):
    print(json.dumps({"case": f"modules_{family}", **routed_mlps_against_original(tempfile.mkdtemp(), family)}))
"""


def auto_launches_by_rows(tmp: str) -> dict:
    """``decode_linear="auto"`` with every shape taken as measured (the routing's ``tuned_only`` check
    patched away): kernel launches of a fused MLP's forward at 5, 40 and 100 rows (auto routes 33..64 rows,
    the measured tile; the attention's forward applies the same row gate)."""
    model, _ = load_model_and_tokenizer(build_tiny_model("qwen3", tmp, seed=0), dtype="bfloat16")
    launch, reason, count = tlin._launch, tlin.weight_reason, [0]

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        count[0] += 1
        return launch(*args, **kwargs)

    tlin._launch = counted
    tlin.weight_reason = lambda weight, bias=None, swiglu=False, tuned_only=False: reason(weight, bias, swiglu)
    out, auto_rows = {}, tlin.auto_rows
    try:
        for prefix, rows_of_shape in (("", auto_rows), ("two_tiles_", lambda n, k, swiglu=False: (65, 128))):
            tlin.auto_rows = rows_of_shape  # the second pass: shapes measured at two row tiles (65..128 rows)
            out[f"{prefix}routed"] = len(fuse_projections(model, decode_linear="auto").decode_linear)
            mlp = model.model.layers[0].mlp
            with torch.no_grad():
                for rows in (5, 40, 100):
                    count[0] = 0
                    mlp(torch.randn(rows, 1, model.config.hidden_size).to(torch.bfloat16))
                    out[f"{prefix}launches_{rows}"] = count[0]
            unfuse_projections(model)
    finally:
        tlin._launch, tlin.weight_reason, tlin.auto_rows = launch, reason, auto_rows
        unfuse_projections(model)
    return out


def routed_mlps_against_original(tmp: str, family: str) -> dict:
    """Each MLP the fusion routes to the kernel, decode-sized input: its output against the module's
    original (unfused, torch) forward, as the largest difference over the output's largest magnitude."""
    model, _ = load_model_and_tokenizer(build_tiny_model(family, tmp, seed=0, initializer_range=0.2), dtype="bfloat16")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 1, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        mlps = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("MLP")}
        before = {n: m(x).float() for n, m in mlps.items()}
        report = fuse_projections(model, decode_linear="on")
        worst = max(float((m(x).float() - before[n]).abs().max() / before[n].abs().max()) for n, m in mlps.items())
    return {"routed_mlps": len([n for n in report.decode_linear if n in mlps]), "mlps": len(mlps), "worst": worst}


def generate_pair(tmp: str, device: str, compile: str, family: str, variants: list[dict],
                  count: Callable[[dict], dict[str, int]]) -> tuple[list[dict], list[dict[str, int]], NativeEngine]:
    """Greedy generation of a tiny bf16 ``family`` model by one engine per ``variants`` entry (its KernelOptions
    overrides): the batches, and per engine ``count``'s tallies summed over its decode-kernel launches (``count``
    gets each launch's keyword arguments); also the last engine. Interpreted (CPU): RoPE in torch, the decode GEMMs
    are what differs; the interpreted RoPE kernel costs seconds a step and has its own engine tests
    (test_backends_engine_rope.py)."""
    path = build_tiny_model(family, tmp, seed=0, initializer_range=0.2)
    model, tokenizer = load_model_and_tokenizer(path, dtype="bfloat16")
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    outs, tallies, launch = [], [], tlin._launch
    for options in variants:
        tally: dict[str, int] = defaultdict(int)

        def counted(*args, _tally=tally, **kwargs):  # noqa: ANN002, ANN003, ANN202
            for key, value in count(kwargs).items():
                _tally[key] += value
            return launch(*args, **kwargs)

        tlin._launch = counted
        try:
            engine = NativeEngine(model, tokenizer, device=device, max_batch_size=8, max_seq_len=40, compile=compile,
                                  kernels=KernelOptions(fused_qk_rope=device != "cpu", **options))
            outs.append(engine.generate(batch, GREEDY).batch)
        finally:
            tlin._launch = launch
        tallies.append(dict(tally))
    return outs, tallies, engine


def engines_with_and_without(tmp: str, device: str = "cpu", compile: str = "none", family: str = "qwen3") -> dict:
    """Greedy generation of a tiny bf16 ``family`` model by an engine without and then with the decode
    GEMMs: how far apart tokens and log-probs are, how often the kernel ran, and how many fused modules
    the engine has and routes to it."""
    (plain, fast), (off, on), engine = generate_pair(tmp, device, compile, family, [{"decode_linear": "off"},
                                                                                   {"decode_linear": "on"}],
                                                     lambda kwargs: {"launches": 1})
    return {"same_tokens": bool(torch.equal(plain["responses"], fast["responses"])),
            "compile_fallback": getattr(engine._model_forward, "fallback", None),  # compile="full": one graph
            "log_prob_diff_max": float((plain["rollout_log_probs"] - fast["rollout_log_probs"]).abs().max()),
            "launches_without": off.get("launches", 0), "launches_with": on.get("launches", 0),
            "routed": len(engine.fusion_report.decode_linear), "fused": engine.fusion_report.fused}


def engines_tma(tmp: str, device: str = "cpu", compile: str = "none", family: str = "qwen3") -> dict:
    """Greedy generation of a tiny bf16 ``family`` model with every decode GEMM on the kernel, by engines with
    ``KernelOptions.tma`` off and on: whether tokens and log-probs are the same bits, and the kernel launches
    that asked for TMA tile copies."""
    (plain, tma), (off, on), engine = generate_pair(
        tmp, device, compile, family, [{"decode_linear": "on", "tma": False}, {"decode_linear": "on", "tma": True}],
        lambda kwargs: {"tma": int(bool(kwargs.get("tma")))})
    return {"same_tokens": bool(torch.equal(plain["responses"], tma["responses"])),
            "same_log_probs": bool(torch.equal(plain["rollout_log_probs"], tma["rollout_log_probs"])),
            "tma_launches_off": off.get("tma", 0), "tma_launches_on": on.get("tma", 0),
            "compile_fallback": getattr(engine._model_forward, "fallback", None)}


def engines_fused_norm(tmp: str, device: str = "cpu", compile: str = "none", family: str = "qwen3") -> dict:
    """Greedy generation of a tiny bf16 ``family`` model with every decode GEMM on the kernel, without and then with
    ``fused_norm``: how far apart the log-probs are, the layers that fused their norms, and the kernel launches
    that carried a norm and a residual add."""
    (plain, fused), (_, seen), engine = generate_pair(
        tmp, device, compile, family, [{"decode_linear": "on", "fused_norm": False},
                                       {"decode_linear": "on", "fused_norm": True}],
        lambda kwargs: {"norm": int(kwargs.get("norm_weight") is not None),
                        "residual": int(kwargs.get("residual") is not None)})
    same = plain["responses"] == fused["responses"]
    agree = same.cumprod(dim=1).bool()  # positions before a row's first different token: same context
    return {"layers": len(engine.fusion_report.layers_fused_norm), "norm_launches": seen.get("norm", 0),
            "residual_launches": seen.get("residual", 0), "tokens_same_frac": float(same.float().mean()),
            "compile_fallback": getattr(engine._model_forward, "fallback", None),
            "log_prob_diff_max": float((plain["rollout_log_probs"] - fused["rollout_log_probs"])[agree].abs().max())}


@pytest.fixture(scope="module")
def interpreted(triton_interpreted) -> dict[str, dict]:
    return triton_interpreted({"decode_linear": _INTERPRETED}).json_rows("decode_linear")


@pytest.mark.parametrize("case", ["1x64x256_bfloat16_bias0_swiglu0", "5x96x512_bfloat16_bias1_swiglu0",
                                  "17x128x256_bfloat16_bias0_swiglu1", "64x64x128_bfloat16_bias1_swiglu1",
                                  "33x128x1024_float16_bias0_swiglu0", "3x64x128_float16_bias1_swiglu1",
                                  # past one 64-row tile: a second program per weight tile
                                  "100x64x256_bfloat16_bias1_swiglu0", "128x64x128_bfloat16_bias0_swiglu1",
                                  "65x128x128_float16_bias1_swiglu1"])
def test_interpreted_kernel_against_float64(interpreted, case):
    row = interpreted[case]
    assert row["reason"] is None and row["finite"]  # the kernel ran (not the torch fallback)
    # one rounding of the output (bf16 2^-8, fp16 2^-11 relative) plus float32 accumulation
    assert row["rel_error"] < (4e-3 if row["dtype"] == "bfloat16" else 6e-4)
    assert row["beyond_tolerance"] == 0  # against the float32 reference: summation order only


@pytest.mark.parametrize("case", ["1x64x256_bfloat16_norm1_res0", "5x96x512_bfloat16_norm0_res1",
                                  "17x128x256_bfloat16_norm1_res0", "64x64x128_float16_norm1_res1",
                                  "100x64x256_bfloat16_norm1_res1", "128x64x128_bfloat16_norm1_res1"])
def test_interpreted_kernel_with_norm_and_residual_against_float64(interpreted, case):
    """fused_norm's GEMMs: RMSNorm of the input inside, the residual add in the epilogue."""
    row = interpreted[case]
    assert row["reason"] is None and row["finite"]
    # the normed input's rounding comes on top of the output's (transformers' own sequence: up to ~5e-3 in bf16)
    assert row["rel_error"] < (8e-3 if row["dtype"] == "bfloat16" else 1.2e-3)
    # x * g rounded once where transformers rounds x * rstd and then g * (.): no further from float64
    assert row["rel_error"] <= 1.25 * row["hf_rel_error"]
    assert row["beyond_tolerance"] == 0  # against its float32 reference: summation order only


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interpreted_engine_with_fused_norms(interpreted, family):
    row = interpreted[f"fused_norm_{family}"]
    assert row["layers"] == 2  # both decoder layers of the tiny model
    # every decode step: each layer's two norms ran inside q/k/v and gate/up, its two adds in o and down
    steps = GREEDY["max_new_tokens"] - 1
    assert row["norm_launches"] >= 2 * row["layers"] * steps and row["residual_launches"] == row["norm_launches"]
    # one rounding of the normed input differs: log-probs of the same context within bf16 noise
    assert row["log_prob_diff_max"] < 0.05 and row["tokens_same_frac"] >= 0.8


def test_interpreted_auto_routes_only_the_measured_row_range(interpreted):
    row = interpreted["auto_rows"]
    assert row["routed"] == 4
    assert row["launches_5"] == 0  # 5 rows: below the measured 64-row tile's range, cuBLAS (torch here)
    assert row["launches_40"] == 2  # 40 rows: gate/up with SwiGLU, then down
    assert row["launches_100"] == 0  # 100 rows: two tiles, not measured: cuBLAS under auto
    # a shape measured at two row tiles (triton_linear.TUNED_ROWS, the 0.6B shapes at 128 rows): 65..128 rows only
    assert row["two_tiles_routed"] == 4
    assert row["two_tiles_launches_5"] == row["two_tiles_launches_40"] == 0 and row["two_tiles_launches_100"] == 2


def test_measured_row_ranges_cover_only_tuned_shapes():
    assert set(tlin.TUNED_ROWS) <= set(tlin.TUNED)
    assert all(1 <= lo <= hi <= tlin.MAX_M for lo, hi in tlin.TUNED_ROWS.values())
    assert tlin.auto_rows(6144, 4096) == (tlin.AUTO_MIN_M, tlin.AUTO_MAX_M)  # 8B q/k/v: the 64-row tile
    assert tlin.auto_rows(3072, 1024, swiglu=True) == (65, 128)  # 0.6B gate/up: measured at 128 rows


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interpreted_engine_with_the_decode_gemms(interpreted, family):
    row = interpreted[f"engine_{family}"]
    assert row["routed"] == row["fused"] == 4 and row["launches_without"] == 0  # 2 layers x (attention, MLP)
    # every decode step: 2 GEMM launches per routed module at least (prefill rows > 64 stay on torch)
    assert row["launches_with"] >= 2 * row["routed"] * (GREEDY["max_new_tokens"] - 1)
    # dense bf16 model, only the GEMMs' summation order differs: same greedy tokens, log-probs within bf16 noise
    assert row["same_tokens"] and row["log_prob_diff_max"] < 0.05


@pytest.mark.parametrize("family", ["qwen3", "llama", "deepseek_v3"])
def test_interpreted_routed_mlps_match_their_original_forward(interpreted, family):
    """Module by module, so MoE families count too: there an output one bf16 ulp off can flip a top-k expert
    choice of a random tiny router, after which two engines decode different text (DeepSeek-V3: MLA attention
    is not fused; its dense and shared-expert MLPs are)."""
    modules = interpreted[f"modules_{family}"]
    assert modules["routed_mlps"] == modules["mlps"] > 0
    assert modules["worst"] <= 2 ** -7  # two bf16 roundings (gate/up, then the output) apart at most


@pytest.mark.parametrize("case", ["1x64x256_bfloat16_split2", "17x96x512_float16_split4",
                                  "64x64x384_bfloat16_split3", "100x64x256_bfloat16_split2"])
def test_interpreted_split_k_against_float64(interpreted, case):
    """K split over programs, the last program of a tile adding the partial sums in split order: as accurate as
    one program, the same bits on a second launch, and the arrival counters left at zero for the next."""
    row = interpreted[case]
    assert row["reason"] is None and row["finite"] and row["repeats"] and row["counters_zero"]
    assert row["rel_error"] < (4e-3 if row["dtype"] == "bfloat16" else 6e-4)
    assert row["beyond_tolerance"] == 0


@pytest.mark.parametrize("case", ["1x64x256_bfloat16_tma_split1", "17x96x512_float16_tma_split1",
                                  "64x64x256_bfloat16_tma_split1", "100x64x256_bfloat16_tma_split2"])
def test_interpreted_tma_loads_give_the_pointer_loads_bits(interpreted, case):
    """Tiles copied by tensor descriptors (``"tma": 1``; rows past M, of a partial row tile, read as zeros), with a
    norm, a residual, SwiGLU, split-K: the same bits as the pointer loads, as accurate against float64."""
    row = interpreted[case]
    assert row["reason"] is None and row["tma_reason"] is None and row["finite"]
    assert row["equals_pointer_loads"] and row["repeats"] and row["counters_zero"]
    assert row["rel_error"] < (8e-3 if row["dtype"] == "bfloat16" else 1.2e-3)  # with a norm: its rounding too
    assert row["rel_error"] <= 1.25 * row["hf_rel_error"] and row["beyond_tolerance"] == 0


def test_interpreted_engine_with_tma_gives_the_same_bits(interpreted):
    """``KernelOptions.tma`` reaches every decode GEMM launch, and generation is bit for bit the same."""
    row = interpreted["engine_tma"]
    assert row["tma_launches_off"] == 0 and row["tma_launches_on"] > 0
    assert row["same_tokens"] and row["same_log_probs"]


def test_tma_needs_aligned_operands():
    """A base or row stride off 16 bytes is named; the launch then loads with pointers."""
    if tlin.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    x = torch.zeros(4, 72, dtype=torch.bfloat16)
    assert tlin.tma_reason(x, torch.zeros(8, 64, dtype=torch.bfloat16)) is None
    reason = tlin.tma_reason(x[:, 1:65])
    assert reason is not None and "16-byte aligned" in reason
    assert "16-byte aligned" in tlin.tma_reason(torch.zeros(4, 36, dtype=torch.bfloat16)[:, :32])


# ------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k,swiglu", [(6144, 4096, False), (24576, 4096, True), (4096, 12288, False)])
@pytest.mark.parametrize("m", [1, 64, 128])
def test_cuda_tma_loads_at_8b_shapes(n, k, swiglu, m):
    """Tensor-descriptor tile copies on the GPU: the pointer loads' bits, the same accuracy."""
    cfg = {"block_n": 64 if swiglu else 32, "block_k": 128, "num_stages": 4, "num_warps": 4, "tma": 1}
    row = kernel_errors(m, n, k, torch.bfloat16, bias=False, swiglu=swiglu, device="cuda", pdl=True, seed=m + 5,
                        residual=not swiglu, norm=swiglu, config=cfg)
    assert row["reason"] is None and row["tma_reason"] is None and row["finite"] and row["rel_error"] < 8e-3
    assert row["rel_error"] <= 1.25 * row["hf_rel_error"] and row["equals_pointer_loads"] and row["repeats"]


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k,swiglu", [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True),
                                        (4096, 12288, False)])
@pytest.mark.parametrize("m", [1, 64, 128])
def test_cuda_kernel_at_8b_shapes(n, k, swiglu, m):
    row = kernel_errors(m, n, k, torch.bfloat16, bias=False, swiglu=swiglu, device="cuda", pdl=True, seed=m + n)
    assert row["reason"] is None and row["finite"] and row["rel_error"] < 4e-3
    # tl.dot's float32 accumulation against torch's float32 GEMM: rarely more than one ulp apart
    assert row["beyond_tolerance"] <= max(1, m * n // (2 if swiglu else 1) // 1000)


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k,swiglu,split", [(6144, 4096, False, 2), (4096, 4096, False, 4), (24576, 4096, True, 2),
                                              (4096, 12288, False, 4)])
@pytest.mark.parametrize("m", [1, 64, 128])
def test_cuda_split_k_at_8b_shapes(n, k, swiglu, split, m):
    """Split-K on the GPU, where the splits run at once on different multiprocessors: as accurate as one program,
    the same bits on a second launch, the counters back at zero."""
    cfg = {"block_n": 64 if swiglu else 32, "block_k": 128, "num_stages": 4, "num_warps": 4, "split": split}
    row = kernel_errors(m, n, k, torch.bfloat16, bias=False, swiglu=swiglu, device="cuda", pdl=True, seed=m + split,
                        residual=not swiglu, config=cfg)
    assert row["reason"] is None and row["finite"] and row["rel_error"] < 4e-3
    assert row["repeats"] and row["counters_zero"]
    assert row["beyond_tolerance"] <= max(1, m * n // (2 if swiglu else 1) // 1000)


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
def test_cuda_pdl_chain_in_a_graph_equals_plain_launches():
    """A chain of dependent decode GEMMs (each reads the previous output) captured with PDL edges: the
    replayed result equals the same chain launched without PDL, bit for bit, on fresh inputs."""
    if not tlin.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = [torch.randn(4096, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) / 64 for _ in range(8)]
    x = torch.randn(64, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(pdl: bool, prefetch: int = tlin.PDL_PREFETCH) -> torch.Tensor:
        h = x
        for w in weights:
            h = tlin.decode_linear(h, w, pdl=pdl, prefetch=prefetch)
        return h

    plain = chain(False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    for _ in range(3):
        x.copy_(torch.randn(64, 4096, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, chain(False))
        assert torch.equal(chain(True, prefetch=4096), captured) and torch.equal(chain(True, prefetch=0), captured)
    assert not torch.equal(captured, plain)  # the inputs did change


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("compile", ["none", "full"])
def test_cuda_engine_with_the_decode_gemms(compile):
    with tempfile.TemporaryDirectory() as tmp:
        row = engines_with_and_without(tmp, device="cuda", compile=compile)
    assert row["routed"] == row["fused"] == 4 and row["launches_with"] > 0 and row["compile_fallback"] is None
    assert row["same_tokens"] and row["log_prob_diff_max"] < 0.05


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("compile", ["none", "full"])
def test_cuda_engine_with_tma_gives_the_same_bits(compile):
    with tempfile.TemporaryDirectory() as tmp:
        row = engines_tma(tmp, device="cuda", compile=compile)
    assert row["tma_launches_off"] == 0 and row["tma_launches_on"] > 0 and row["compile_fallback"] is None
    assert row["same_tokens"] and row["same_log_probs"]


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k,swiglu,norm", [(6144, 4096, False, True), (24576, 4096, True, True),
                                             (4096, 4096, False, False), (4096, 12288, False, False)])
def test_cuda_fused_norm_gemms_at_8b_shapes(n, k, swiglu, norm):
    """fused_norm's four GEMMs of an 8B layer at the decode batch: norm inside q/k/v and gate/up, + residual after
    o and down."""
    row = kernel_errors(64, n, k, torch.bfloat16, bias=False, swiglu=swiglu, device="cuda", pdl=True, seed=n,
                        norm=norm, residual=not norm)
    assert row["reason"] is None and row["finite"] and row["rel_error"] <= 1.25 * row["hf_rel_error"]
    assert row["beyond_tolerance"] <= max(1, 64 * n // (2 if swiglu else 1) // 1000)


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("compile", ["none", "full"])
def test_cuda_engine_with_fused_norms(compile):
    with tempfile.TemporaryDirectory() as tmp:
        row = engines_fused_norm(tmp, device="cuda", compile=compile)
    assert row["layers"] == 2 and row["norm_launches"] > 0 and row["residual_launches"] > 0
    assert row["compile_fallback"] is None and row["log_prob_diff_max"] < 0.05
