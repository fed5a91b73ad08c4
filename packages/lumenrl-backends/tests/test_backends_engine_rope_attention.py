"""q/k norm + RoPE + KV write folded into decode attention (``engines/triton_rope_attention.py``).

* CPU: refusals, and where the fusion turns it on;
* Triton's interpreter (one subprocess): the folded kernel against the two-kernel path (the RoPE kernel, then
  the attention kernel) on fresh random inputs, bit for bit: output and both caches; 16-bit and FP8 caches,
  FP8 output codes, with and without q/k norms, one split and several (merge kernel); and a tiny Qwen3 / Llama
  engine (head dim 32) with and without the fold;
* CUDA (skipped elsewhere): the same comparison at Qwen3-8B's heads, within one ulp-level bound.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine
from lumenrl_backends.engines import triton_attention as ta
from lumenrl_backends.models import build_tiny_model, load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

HAS_CUDA_TRITON = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def fold_against_two_kernels(*, batch: int = 3, heads: int = 8, kv_heads: int = 2, dim: int = 64, length: int = 48,
                             kv_len: int = 40, norm: bool = True, fp8: bool = False, fp8_out: bool = False,
                             splits: int | None = None, device: str = "cpu", seed: int = 0,
                             dtype: str = "float16") -> dict:
    """Both paths on the same fresh inputs, and the error of each one's output (``rel_error``: the fold's,
    ``rel_error_two``: the two kernels') against float64 attention over the HF sequence's query
    (``reference_decode_qk_rope_kv_write``) and cache; ``splits`` forces the split count
    (the CPU has no multiprocessor count to derive it from). The interpreter takes fp16 (its bf16 ``tl.dot``
    multiplies raw bits, decision 0023), CUDA either."""
    from lumenrl_backends.engines.triton_rope import (
        decode_qk_rope_kv_write,
        reference_decode_qk_rope_kv_write,
    )
    from lumenrl_backends.engines.triton_rope_attention import decode_rope_attention

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    qkv = rand(batch, (heads + 2 * kv_heads) * dim, scale=3.0)  # one fused GEMM output: q/k/v are strided slices
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
    angles = torch.rand(batch, dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(device, dt), torch.cat([angles.sin()] * 2, -1).to(device, dt)
    q_w, k_w = (rand(dim, scale=0.3) + 1.0, rand(dim, scale=0.3) + 1.0) if norm else (None, None)
    columns = torch.randint(0, kv_len, (batch,), generator=gen).to(device)
    columns[0] = kv_len - 1  # one row ends at the view's last column
    cache_dtype = torch.float8_e4m3fn if fp8 else dt
    k_cache = (torch.randn(batch + 1, kv_heads, length, dim, generator=gen) * (20 if fp8 else 1)).to(device,
                                                                                                    cache_dtype)
    v_cache = (torch.randn(batch + 1, kv_heads, length, dim, generator=gen) * (20 if fp8 else 1)).to(device,
                                                                                                    cache_dtype)
    scales = (torch.tensor([0.05], device=device), torch.tensor([0.04], device=device)) if fp8 else (None, None)
    cols = torch.arange(kv_len, device=device)
    allowed = (torch.rand(batch, kv_len, generator=gen).to(device) > 0.3) & (cols <= columns[:, None])
    allowed[torch.arange(batch, device=device), columns] = True
    scale = dim ** -0.5
    out_dtype = torch.float8_e4m3fn if fp8_out else None
    saved = ta._splits
    if splits is not None:
        ta._splits = lambda *args: splits
    try:
        kc1, vc1 = k_cache.clone(), v_cache.clone()
        roped = decode_qk_rope_kv_write(q, k, v, cos, sin, kc1, vc1, columns, q_weight=q_w, k_weight=k_w,
                                        k_scale=scales[0], v_scale=scales[1])
        packed = roped.reshape(batch, kv_heads, heads // kv_heads, dim)
        view_k, view_v = kc1[:batch, :, :kv_len], vc1[:batch, :, :kv_len]
        if fp8_out:
            two = ta.gqa_decode_attention_fp8(packed, view_k, view_v, allowed, scale, *scales, last=columns,
                                              out_dtype=out_dtype)
        else:
            two = ta.gqa_decode_attention(packed, view_k, view_v, allowed, scale, *scales, last=columns)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        one = decode_rope_attention(q, k, v, cos, sin, kc2, vc2, columns, allowed, kv_len, scale, q_weight=q_w,
                                    k_weight=k_w, k_scale=scales[0], v_scale=scales[1], out_dtype=out_dtype)
    finally:
        ta._splits = saved

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.element_size() == 1 else t.float()

    kc3, vc3 = k_cache.clone(), v_cache.clone()
    q64 = reference_decode_qk_rope_kv_write(q, k, v, q_w, k_w, 1e-6, cos, sin, kc3, vc3, columns, *scales).double()
    q64 = q64.reshape(batch, kv_heads, heads // kv_heads, dim)

    def rel_error(out: torch.Tensor, k64: torch.Tensor, v64: torch.Tensor) -> float:
        k64, v64 = k64[:batch, :, :kv_len].double(), v64[:batch, :, :kv_len].double()
        if fp8:
            k64, v64 = k64 * scales[0].double(), v64 * scales[1].double()
        scores = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(~allowed[:, None, None, :], float("-inf"))
        ref = torch.softmax(scores, dim=-1) @ v64
        got = out.double() * (scales[1].double() if fp8_out else 1.0)
        return float((got - ref).norm() / ref.norm())

    # an FP8 cache: each path against float64 attention over the cache it wrote (the interpreter's float32 -> FP8
    # casts differ from torch's, and on CUDA FMA contraction may move a key code one step, so each path's own codes
    # are its input); a 16-bit cache: over the reference's cache
    errors = ((rel_error(one, kc2, vc2), rel_error(two, kc1, vc1)) if fp8
              else (rel_error(one, kc3, vc3), rel_error(two, kc3, vc3)))
    diff = (one.float() - two.float()).abs()
    return {"same_out": bool(torch.equal(bits(one), bits(two))), "same_keys": bool(torch.equal(bits(kc1), bits(kc2))),
            "same_values": bool(torch.equal(bits(vc1), bits(vc2))), "shape": list(one.shape),
            "out_dtype": str(one.dtype), "max_diff_over_max": float(diff.max() / two.float().abs().max()),
            "written": bool(not torch.equal(bits(kc2), bits(k_cache))), "finite": bool(torch.isfinite(one.float()).all()),
            "rel_error": errors[0], "rel_error_two": errors[1]}


def engines_with_and_without(tmp: str, family: str, device: str = "cpu", compile: str = "none") -> dict:
    path = build_tiny_model(family, tmp, seed=0, initializer_range=0.2, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32)  # a head dim the attention kernel takes
    model, tokenizer = load_model_and_tokenizer(path, dtype="float16")  # fp16: see fold_against_two_kernels
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    from lumenrl_backends.engines import triton_rope_attention as tra

    outs, calls, folded, impl = [], [0], 0, tra._op_impl  # what an eager engine calls (not the registered op)
    for on in (False, True):
        def counted(*args, _on=on):  # noqa: ANN002, ANN202
            calls[0] += _on
            return impl(*args)

        tra._op_impl = counted
        try:
            engine = NativeEngine(model, tokenizer, device=device, max_batch_size=8, max_seq_len=40, compile=compile,
                                  kernels=KernelOptions(rope_in_attention=on))
            outs.append(engine.generate(batch, GREEDY).batch)
        finally:
            tra._op_impl = impl
        folded = len(engine.fusion_report.attention_rope_folded) if on else folded
    plain, fold = outs
    return {"same_tokens": bool(torch.equal(plain["responses"], fold["responses"])),
            "log_prob_diff_max": float((plain["rollout_log_probs"] - fold["rollout_log_probs"]).abs().max()),
            "folded": folded, "calls": calls[0]}


# ------------------------------------------------------------------ CPU
def test_refusals_and_option(tmp_path):
    from lumenrl_backends.engines.fusion import fuse_projections, unfuse_projections
    from lumenrl_backends.engines.triton_rope_attention import decode_rope_attention, fold_supported

    assert KernelOptions().rope_in_attention is False  # opt-in until measured
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, 16, 64, dtype=torch.bfloat16)
    allowed = torch.ones(2, 16, dtype=torch.bool)
    if not ta._INTERPRETED:
        assert not fold_supported(q, cache, cache, allowed)  # CPU without the interpreter: the two-kernel path
    assert not fold_supported(q, cache[:, :1].expand(3, 8, 16, 64), cache, allowed)  # no GQA: H_kv == H
    with pytest.raises(ValueError, match="cos"):
        decode_rope_attention(q, q[:, :2], q[:, :2], torch.zeros(2, 32, dtype=torch.bfloat16),
                              torch.zeros(2, 64, dtype=torch.bfloat16), cache, cache.clone(),
                              torch.zeros(2, dtype=torch.int64), allowed, 16, 0.125)
    model, _ = load_model_and_tokenizer(str(build_tiny_model("qwen3", tmp_path / "m", seed=0)), dtype="bfloat16")
    try:
        on = fuse_projections(model, rope_in_attention=True)
        assert on.attention_rope_folded == on.attention_fused_rope and len(on.attention_rope_folded) == 2
        off = fuse_projections(model, rope_in_attention=True, fused_qk_rope=False)  # the fold needs the fused op's checks
        assert not off.attention_rope_folded
    finally:
        unfuse_projections(model)


# ------------------------------------------------------------------ Triton's interpreter (one subprocess)
_INTERPRETED = """
import json, tempfile
from test_backends_engine_rope_attention import engines_with_and_without, fold_against_two_kernels

cases = {"fp16_norm": {}, "fp16_plain": {"norm": False}, "fp16_splits": {"splits": 3},
         "fp8": {"fp8": True}, "fp8_codes": {"fp8": True, "fp8_out": True},
         "fp8_codes_splits": {"fp8": True, "fp8_out": True, "splits": 2, "norm": False},
         "wide_groups": {"heads": 16, "kv_heads": 2, "dim": 32, "seed": 3}}
for name, kwargs in cases.items():
    print(json.dumps({"case": name, **fold_against_two_kernels(**kwargs)}))
for family in ("qwen3", "llama"):
    print(json.dumps({"case": f"engine_{family}", **engines_with_and_without(tempfile.mkdtemp(), family)}))
"""


@pytest.fixture(scope="module")
def interpreted(triton_interpreted) -> dict[str, dict]:
    return triton_interpreted({"rope_attention": _INTERPRETED}).json_rows("rope_attention")


@pytest.mark.parametrize("case", ["fp16_norm", "fp16_plain", "fp16_splits", "fp8", "fp8_codes", "fp8_codes_splits",
                                  "wide_groups"])
def test_interpreted_fold_equals_the_two_kernels(interpreted, case):
    row = interpreted[case]
    assert row["written"] and row["finite"]  # the new column went into the cache; the output is real
    assert row["same_keys"] and row["same_values"] and row["same_out"], row
    # against float64 attention: fp16 output rounding; FP8 output codes: E4M3's 3 mantissa bits, cast by the
    # interpreter, whose float32 -> FP8 casts round coarser than CUDA's (the CUDA test bounds them at 6e-2)
    assert row["rel_error"] < (0.2 if row["out_dtype"] == "torch.float8_e4m3fn" else 4e-3), row


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interpreted_engine_with_the_fold(interpreted, family):
    row = interpreted[f"engine_{family}"]
    assert row["folded"] == 2 and row["calls"] >= 2 * (GREEDY["max_new_tokens"] - 1)  # both layers, every step
    # on the CPU the two-kernel path's attention is SDPA (the Triton attention kernel is CUDA-only in the engine),
    # the fold's is the interpreted kernel: the same function, summed in another order
    assert row["same_tokens"] and row["log_prob_diff_max"] < 0.05


# ------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_fold_at_8b_heads(fp8):
    row = fold_against_two_kernels(batch=64, heads=32, kv_heads=8, dim=128, length=1024, kv_len=600, fp8=fp8,
                                   fp8_out=fp8, device="cuda", seed=1, dtype="bfloat16")
    assert row["written"] and row["finite"] and row["same_values"]
    bound = 6e-2 if fp8 else 8e-3  # FP8 output codes: 3 mantissa bits
    assert row["rel_error"] < bound and row["rel_error_two"] < bound
    # the fold is as accurate as the path it replaces. Not bit for bit here: FMA contraction in the norms and RoPE
    # may move a new key code one step (an e4m3 step is up to 1/8 of a value; equal keys are not required on CUDA),
    # and then the two paths attend over slightly different keys (on an H100 their FP8 outputs differed by up to one
    # output step plus ~1% of the max)
    assert row["rel_error"] <= 1.2 * row["rel_error_two"] + 1e-3
    if not fp8:
        assert row["max_diff_over_max"] < 0.01
