"""Multi-query decode: speculative decoding's verify forward (Q = k + 1 query tokens per row at consecutive
cache columns) on the engine's fused decode path.

* ``decode_qk_rope_kv_write`` with (b, Q, H, D) queries: the torch reference equals Q one-token steps and the
  engine's unfused HF sequence (q/k norms, ``apply_rotary_pos_emb``, ``SlotKVCache.update`` in a Q-column
  decode view) bit for bit; the Triton kernel (CPU interpreter) equals the reference;
* packed multi-query attention (G heads x Q queries per KV head, a mask row per query) against float64
  attention: SDPA on CPU, the split-KV Triton kernel in the interpreter (bf16 and FP8 caches, bounded rows);
* the engine's verify forward through the fused path against the unfused one (HF q/k norms, RoPE and
  ``cache.update``; transformers' ``sdpa`` with ``repeat_kv``) and against the HF model over whole sequences;
* on CUDA: the kernels against their references, the fused verify forward against the unfused one, and
  speculative greedy output equal to plain greedy output with the Triton kernels on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

from lumenrl_backends.engines import NativeEngine, attention, triton_rope
from lumenrl_backends.engines.attention import engine_attention, packed_decode_attention
from lumenrl_backends.engines.kv_cache import CacheView, SlotKVCache, prefill_mask
from lumenrl_backends.engines.requests import left_pad
from lumenrl_backends.engines.speculative import target_forward
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_sddd.lossless import divergence_gaps

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA_TRITON = HAS_TRITON and torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")]


def multi_case(batch: int, n_q: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16, *,
               norm: bool = True, fp8: bool = False, length: int = 24, device: str = "cpu", seed: int = 0) -> dict:
    """One verify forward's inputs as the engine passes them: q/k/v slices of one fused projection output
    (b, Q, heads, D), HF's cos/sin (b, Q, D), caches with random contents, columns ``start + arange(Q)``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    qkv = rand(batch, n_q, (heads + 2 * kv_heads) * dim, scale=2.0)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.randint(0, 4096, (batch, 1), generator=gen) + torch.arange(n_q)
    angles = positions[..., None].double() * 1e6 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = (f(emb).to(dtype).to(device) for f in (torch.cos, torch.sin))  # (b, Q, D)
    weights = [(1 + rand(dim, scale=0.5, dtype=torch.float32)).to(dtype) if norm else None for _ in range(2)]
    caches = [rand(batch + 2, kv_heads, length, dim, dtype=torch.float32).to(FP8 if fp8 else dtype) for _ in range(2)]
    start = torch.randint(0, length - n_q + 1, (batch, 1), generator=gen)
    columns = (start + torch.arange(n_q)).to(device)  # (b, Q): consecutive, as the verify forward writes
    scales = [torch.tensor(s, device=device) for s in (2.5 / 448, 4.0 / 448)] if fp8 else [None, None]
    return {"query": q.view(batch, n_q, heads, dim), "key": k.view(batch, n_q, kv_heads, dim),
            "value": v.view(batch, n_q, kv_heads, dim), "cos": cos, "sin": sin, "key_cache": caches[0],
            "value_cache": caches[1], "columns": columns, "q_weight": weights[0], "k_weight": weights[1], "eps": 1e-6,
            "k_scale": scales[0], "v_scale": scales[1]}


def fresh(case: dict) -> dict:
    return {**case, "key_cache": case["key_cache"].clone(), "value_cache": case["value_cache"].clone()}


def run_op(case: dict) -> torch.Tensor:
    c = case
    return triton_rope.decode_qk_rope_kv_write(
        c["query"], c["key"], c["value"], c["cos"], c["sin"], c["key_cache"], c["value_cache"], c["columns"],
        q_weight=c["q_weight"], k_weight=c["k_weight"], eps=c["eps"], k_scale=c["k_scale"], v_scale=c["v_scale"])


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize("norm,fp8", [(True, False), (False, False), (True, True)])
def test_multi_query_op_is_q_one_token_steps(norm, fp8):
    """(b, Q) queries in one call == Q calls with one query per row, each at its own column, bit for bit."""
    case = multi_case(3, 4, 8, 2, 32, norm=norm, fp8=fp8, seed=1 + norm + 2 * fp8)
    multi, steps = fresh(case), fresh(case)
    out = run_op(multi)  # (b, H, Q, D)
    assert out.shape == (3, 8, 4, 32) and out.is_contiguous()
    for j in range(4):
        one = {**steps, **{name: case[name][:, j] for name in ("query", "key", "value", "cos", "sin", "columns")}}
        assert torch.equal(run_op(one)[:, :, 0], out[:, :, j])
    for name in ("key_cache", "value_cache"):
        assert torch.equal(bits(multi[name]), bits(steps[name]))
    assert not torch.equal(bits(multi["key_cache"]), bits(case["key_cache"]))  # something was written


def hf_cache(case: dict) -> SlotKVCache:
    """A one-layer engine cache holding ``case``'s cache contents, in a Q-column decode view."""
    from lumenrl_quant import KVScales

    slots, _, length, _ = case["key_cache"].shape
    fp8 = case["k_scale"] is not None
    cache = SlotKVCache(num_layers=1, max_slots=slots, max_len=length, device=torch.device("cpu"),
                        kv_dtype=FP8 if fp8 else None)
    layer = cache.layers[0]
    layer.lazy_initialization(case["key"].transpose(1, 2), case["value"].transpose(1, 2))
    layer.keys.copy_(case["key_cache"])
    layer.values.copy_(case["value_cache"])
    if fp8:
        layer.codec.scales = KVScales(k_scale=case["k_scale"], v_scale=case["v_scale"], dtype=FP8)
    cache.raw_fp8_decode = True
    batch = case["query"].shape[0]
    cache.set_view(CacheView(rows=torch.arange(batch), columns=case["columns"], decode=True, kv_len=length))
    return cache


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_multi_query_op_is_the_engines_unfused_sequence_bit_for_bit(family, fp8):
    """HF q/k norms + ``apply_rotary_pos_emb`` + ``SlotKVCache.update`` over Q columns per row against the op
    through ``decode_write_target`` / ``decode_read``: query, both caches and what attention reads."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    case = multi_case(5, 3, 8, 2, 64, norm=family == "qwen3", fp8=fp8, seed=7)
    query, key, value = case["query"], case["key"], case["value"]  # (b, Q, H, D), as the projection gives them
    hf = qwen3 if family == "qwen3" else llama
    if family == "qwen3":
        q_norm, k_norm = qwen3.Qwen3RMSNorm(64, eps=1e-6), qwen3.Qwen3RMSNorm(64, eps=1e-6)
        q_norm.weight.data, k_norm.weight.data = case["q_weight"], case["k_weight"]
        with torch.no_grad():
            query, key = q_norm(query), k_norm(key)
    query, key = hf.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), case["cos"], case["sin"])
    unfused = hf_cache(case)
    k_read, v_read = unfused.update(key, value.transpose(1, 2), 0)

    fused = hf_cache(case)
    target = fused.decode_write_target(0, case["key"].transpose(1, 2), case["value"].transpose(1, 2))
    assert target.columns.shape == (5, 3)
    out = run_op({**case, "key_cache": target.keys, "value_cache": target.values, "columns": target.columns})
    assert torch.equal(out, query)
    for a, b in ((unfused.layers[0].keys, fused.layers[0].keys), (unfused.layers[0].values, fused.layers[0].values),
                 (k_read, fused.decode_read(0)[0]), (v_read, fused.decode_read(0)[1])):
        assert torch.equal(bits(a), bits(b))


def test_multi_query_op_checks_its_columns():
    case = multi_case(2, 3, 4, 2, 16)
    with pytest.raises(ValueError, match=r"columns: \(2,\) or \(2, 3\)"):
        run_op({**case, "columns": case["columns"][:, :2]})
    with pytest.raises(ValueError, match=r"cos: \(2, 3, 16\)"):
        run_op({**case, "cos": case["cos"][:, :1]})


# ------------------------------------------------------------------ attention
def reference_multi_attention(q, k, v, allowed, scale):
    """float64: q (B, H, Q, D), k/v (B, H_kv, L, D), allowed (B, Q, L) -> (B, Q, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v64).transpose(1, 2)


def multi_attention_inputs(batch=3, heads=8, kv_heads=2, n_q=4, dim=32, length=70, seed=0):
    """A verify forward's attention inputs: query (B, H, Q, D), a strided K/V prefix of a slot cache, write
    columns ``c_i + arange(Q)`` (rows ending in different places), allowed = valid & key column <= the
    query's own column (B, Q, L)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_q, dim, generator=gen)
    cache_k, cache_v = (torch.randn(batch + 2, kv_heads, length + 30, dim, generator=gen) for _ in range(2))
    k, v = cache_k[:batch, :, :length], cache_v[:batch, :, :length]
    valid = torch.rand(batch, length, generator=gen) > 0.4
    columns = torch.randint(0, length - n_q + 1, (batch, 1), generator=gen) + torch.arange(n_q)
    columns[0] = length - n_q + torch.arange(n_q)  # one row at the very end
    valid[torch.arange(batch)[:, None], columns] = True
    allowed = valid[:, None, :] & (torch.arange(length)[None, None, :] <= columns[..., None])  # (B, Q, L)
    return q, k, v, allowed, columns


@pytest.mark.parametrize("fp8", [False, True])
def test_packed_multi_query_attention_matches_float64(fp8):
    """CPU (SDPA over packed rows) in the engine's Q-column decode view: (B, Q, H, D) against float64."""
    from lumenrl_quant import KVScales

    q, k, v, allowed, columns = multi_attention_inputs(seed=3)
    cache = SlotKVCache(num_layers=1, max_slots=5, max_len=70, device=torch.device("cpu"))
    cache.set_view(CacheView(rows=torch.arange(3), columns=columns, decode=True, kv_len=70))
    if fp8:  # the cache's FP8 codes as stored, with one scale each (dequantized before SDPA on CPU)
        scales = KVScales(k_scale=k.abs().max() / 448, v_scale=v.abs().max() / 448, dtype=FP8)  # per tensor: ()
        k, v = (k / scales.k_scale).to(FP8), (v / scales.v_scale).to(FP8)
        cache.current_scales = scales
        k_ref, v_ref = k.double() * scales.k_scale.double(), v.double() * scales.v_scale.double()
    else:
        k_ref, v_ref = k, v
    calls = []
    with engine_attention(cache), counting(attention, "_original_sdpa", calls):
        out, _ = packed_decode_attention(torch.nn.Module(), q, k, v, allowed[:, None], scaling=0.2)
    ref = reference_multi_attention(q, k_ref, v_ref, allowed, 0.2)
    assert out.shape == (3, 4, 8, 32) and not calls  # packed, not transformers' sdpa
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


@contextlib.contextmanager
def counting(owner, name: str, calls: list) -> Iterator[None]:
    """Record the arguments of every call of ``owner.name`` (called through the module attribute)."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


# ------------------------------------------------------------------ the engine's verify forward
def verify_logits(engine: NativeEngine, prompts: list[list[int]], drafted: torch.Tensor) -> torch.Tensor:
    """Prefill ``prompts`` (left-padded, slots 0..b-1), then one verify forward over ``drafted`` (b, Q) at
    columns ``width + arange(Q)``, masked as speculative rounds mask it -> logits (b, Q, V)."""
    device = engine.device
    ids, mask = left_pad(prompts, engine.pad_token_id, device)
    n, width = ids.shape
    rows = torch.arange(n, device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    engine.cache.clear_slots(rows)
    engine.cache.valid[rows, :width] = mask.bool()
    with torch.no_grad():
        target_forward(engine, ids, positions, torch.arange(width, device=device).expand(n, width), decode=False,
                       kv_len=width, allowed=prefill_mask(mask), layer_ids=[0])
        steps = torch.arange(drafted.shape[1], device=device)
        vcols, vpos = width + steps.expand(n, -1), positions[:, -1:] + 1 + steps
        engine.cache.valid[:n].scatter_(1, vcols, True)
        kv_len = width + drafted.shape[1] + 5  # past the written columns: unwritten columns are masked
        key_cols = torch.arange(kv_len, device=device)
        allowed = (engine.cache.valid[:n, None, :kv_len] & (key_cols[None, None] <= vcols[..., None]))[:, None]
        logits, _ = target_forward(engine, drafted.to(device), vpos, vcols, decode=True, kv_len=kv_len,
                                   allowed=allowed, layer_ids=[0])
    engine.cache.clear_slots(rows)
    return logits.float()


def hf_logits(model, prompts: list[list[int]], drafted: torch.Tensor) -> torch.Tensor:
    """The HF model over each whole sequence (no cache, no padding): logits of the last Q positions."""
    out = []
    with torch.no_grad():
        for prompt, tail in zip(prompts, drafted.tolist()):
            ids = torch.tensor([prompt + tail], device=model.device)
            out.append(model(input_ids=ids).logits[0, -len(tail):].float())
    return torch.stack(out)


PROMPTS = [[5, 9, 11, 3, 7, 21, 4], [8, 2, 30], [17, 6, 6, 12, 40]]


def unfused_verify(engine: NativeEngine, prompts, drafted) -> torch.Tensor:
    """The same verify forward with the HF sequence (no fused op) and transformers' ``sdpa`` (``repeat_kv``)."""
    from lumenrl_backends.engines import fusion

    saved = {name: m.__dict__.get(fusion._QK_ROPE_ATTR) for name, m in engine.model.named_modules()}
    for m in engine.model.modules():
        if fusion._QK_ROPE_ATTR in m.__dict__:
            m.__dict__[fusion._QK_ROPE_ATTR] = False
    original = attention._view_columns
    attention._view_columns = lambda batch: None  # q > 1 is then not packable: transformers' sdpa
    try:
        return verify_logits(engine, prompts, drafted)
    finally:
        attention._view_columns = original
        for name, m in engine.model.named_modules():
            if saved[name] is not None:
                m.__dict__[fusion._QK_ROPE_ATTR] = saved[name]


def compare_verify(path, kv: str, dtype: str, device: str = "cpu", n_q: int = 6) -> dict:
    model, tokenizer = load_model_and_tokenizer(str(path), dtype=dtype)
    model.to(device)
    engine = NativeEngine(model, tokenizer, device=torch.device(device), max_batch_size=4, max_seq_len=48,
                          kv_cache_dtype=kv)
    drafted = torch.randint(3, model.config.vocab_size, (len(PROMPTS), n_q), generator=torch.Generator().manual_seed(1))
    ops, sdpa = [], []
    with counting(triton_rope, "_launch", ops), counting(triton_rope, "reference_decode_qk_rope_kv_write", ops), \
            counting(attention, "_original_sdpa", sdpa):
        fused = verify_logits(engine, PROMPTS, drafted)
    multi_ops = sum(1 for args in ops if args[0].dim() == 4 and args[0].shape[1] == n_q)
    unfused = unfused_verify(engine, PROMPTS, drafted)
    ref = hf_logits(model, PROMPTS, drafted)
    return {"fused_vs_unfused": float((fused - unfused).norm() / unfused.norm()),
            "fused_vs_hf": float((fused - ref).norm() / ref.norm()),
            "same_argmax": float((fused.argmax(-1) == unfused.argmax(-1)).float().mean()),
            "multi_ops": multi_ops, "layers": model.config.num_hidden_layers,
            "prefill_sdpa_calls": len(sdpa)}


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_verify_forward_fused_equals_unfused(qwen3_dir, llama_dir, family, kv):
    """float32 tiny models: the fused verify forward (one op per layer for all Q queries, packed attention)
    against the HF sequence with transformers' sdpa, and (16-bit cache) against the HF model itself."""
    result = compare_verify(qwen3_dir if family == "qwen3" else llama_dir, kv, "float32")
    assert result["multi_ops"] == result["layers"]  # the fused op ran once per layer over all Q queries
    assert result["prefill_sdpa_calls"] == result["layers"]  # only the prefill went to transformers' sdpa
    assert result["fused_vs_unfused"] < 1e-5, result
    if kv == "auto":  # an FP8 cache quantizes K/V: not the HF model's numbers
        assert result["fused_vs_hf"] < 1e-4, result


# ------------------------------------------------------------------ Triton's interpreter (one subprocess)
_INTERPRETED = """
import json, torch
from lumenrl_backends.engines import triton_attention, triton_rope
from test_backends_engine_multiquery import (bits, fresh, multi_attention_inputs, multi_case,
                                             reference_multi_attention, run_op)

for name, case in (("rope_qwen3", multi_case(3, 4, 8, 2, 32, seed=11)),
                   ("rope_llama", multi_case(2, 6, 4, 2, 16, norm=False, seed=12)),
                   ("rope_fp8", multi_case(3, 3, 8, 2, 32, fp8=True, seed=13))):
    kernel, ref, steps = fresh(case), fresh(case), fresh(case)
    q = run_op(kernel)  # the kernel (interpreted)
    q_ref = triton_rope.reference_decode_qk_rope_kv_write(
        *(ref[n] for n in ("query", "key", "value", "q_weight", "k_weight", "eps", "cos", "sin", "key_cache",
                           "value_cache", "columns", "k_scale", "v_scale")))
    q_steps = torch.stack([run_op({**steps, **{n: case[n][:, j] for n in ("query", "key", "value", "cos", "sin",
                                                                         "columns")}})[:, :, 0] for j in range(
        case["query"].shape[1])], 2)
    print(json.dumps({"case": name, "q_differ": float((q != q_ref).float().mean()),
                      "k_differ": float((bits(kernel["key_cache"]) != bits(ref["key_cache"])).float().mean()),
                      "v_equal": torch.equal(bits(kernel["value_cache"]), bits(ref["value_cache"])),
                      "steps_equal": torch.equal(q, q_steps) and torch.equal(bits(kernel["key_cache"]),
                                                                             bits(steps["key_cache"]))}))

q, k, v, allowed, columns = multi_attention_inputs(n_q=3, dim=32, length=80, seed=5)
for row, end in enumerate(columns[:, -1].tolist()):  # poison the tail: a column past the last one read gives NaN
    k[row, :, end + 1:] = float("nan")
    v[row, :, end + 1:] = float("nan")
ref = reference_multi_attention(q, k.nan_to_num(), v.nan_to_num(), allowed, 0.2)
for splits in (1, 2):
    out = triton_attention._run(q.reshape(3, 2, 12, 32), k, v, allowed, 0.2, splits=splits, last=columns[:, -1])
    out = out.reshape(3, 8, 3, 32).transpose(1, 2)
    print(json.dumps({"case": f"attention_splits{splits}", "finite": bool(torch.isfinite(out).all()),
                      "error": float((out.double() - ref).norm() / ref.norm())}))
k, v = k.nan_to_num(), v.nan_to_num()
k_scale, v_scale = (k.abs().max() / 448).reshape(1), (v.abs().max() / 448).reshape(1)
qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
ref = reference_multi_attention(q.bfloat16(), qk.double() * k_scale.double(), qv.double() * v_scale.double(), allowed,
                                0.2)
out = triton_attention.gqa_decode_attention(q.bfloat16().reshape(3, 2, 12, 32), qk, qv, allowed, 0.2, k_scale, v_scale,
                                            last=columns[:, -1]).reshape(3, 8, 3, 32).transpose(1, 2)
codes = triton_attention.gqa_decode_attention_fp8(q.bfloat16().reshape(3, 2, 12, 32), qk, qv, allowed, 0.2, k_scale,
                                                  v_scale, last=columns[:, -1]).reshape(3, 8, 3, 32).transpose(1, 2)
print(json.dumps({"case": "attention_fp8", "error": float((out.double() - ref).norm() / ref.norm()),
                  "codes_error": float((codes.double() * v_scale.double() - ref).norm() / ref.norm())}))
"""


@pytest.fixture(scope="module")
def interpreted(triton_interpreted) -> dict[str, dict]:
    return triton_interpreted({"multiquery": _INTERPRETED}).json_rows("multiquery")


@pytest.mark.parametrize("name", ["rope_qwen3", "rope_llama", "rope_fp8"])
def test_interpreted_multi_query_rope_kernel_matches_the_reference(interpreted, name):
    row = interpreted[name]
    assert row["steps_equal"]  # Q queries in one launch == Q one-query launches, bit for bit
    assert row["q_differ"] < 2e-3
    if name == "rope_llama":  # no norm: every step correctly rounded, as torch's
        assert row["q_differ"] == 0.0 and row["k_differ"] == 0.0 and row["v_equal"]
    elif name == "rope_qwen3":  # the norm's reduction order and rsqrt: a rare K value one ulp off
        assert row["k_differ"] < 2e-3 and row["v_equal"]
    # rope_fp8: the interpreter's FP8 cast is not CUDA's or torch's (it can land a binade low), so its codes are
    # compared with the one-query launches only (steps_equal); test_backends_engine_rope checks Q = 1 codes


@pytest.mark.parametrize("splits", [1, 2])
def test_interpreted_multi_query_attention_matches_float64(interpreted, splits):
    row = interpreted[f"attention_splits{splits}"]
    assert row["finite"] and row["error"] < 1e-5  # no column past a row's last write column was read


def test_interpreted_multi_query_attention_reads_fp8_cache(interpreted):
    row = interpreted["attention_fp8"]
    assert row["error"] < 4e-3  # bf16 query/output rounding
    assert row["codes_error"] < 0.1  # one E4M3 rounding of the output codes (the interpreter's cast)


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_multi_query_kernels_match_their_references(fp8):
    """The SDDD profile shape (16 heads over 8 KV heads, D 64, k = 5: Q = 6) and the 8B one (32/8, D 128)."""
    os.environ.pop("TRITON_INTERPRET", None)
    for shape in ((8, 6, 16, 8, 64), (64, 6, 32, 8, 128)):
        case = multi_case(*shape, fp8=fp8, length=300, device="cuda", seed=sum(shape))
        kernel, ref = fresh(case), fresh(case)
        q = run_op(kernel)
        q_ref = triton_rope.reference_decode_qk_rope_kv_write(
            *(ref[n] for n in ("query", "key", "value", "q_weight", "k_weight", "eps", "cos", "sin", "key_cache",
                               "value_cache", "columns", "k_scale", "v_scale")))
        assert float((q != q_ref).float().mean()) < 2e-3
        assert float((bits(kernel["key_cache"]) != bits(ref["key_cache"])).float().mean()) < 2e-3
        assert torch.equal(bits(kernel["value_cache"]), bits(ref["value_cache"]))
    from lumenrl_backends.engines import triton_attention

    batch, heads, kv_heads, n_q, dim = 64, 32, 8, 6, 128
    q, k, v, allowed, columns = (t.cuda() for t in multi_attention_inputs(batch, heads, kv_heads, n_q, dim, 400, 4))
    q = q.bfloat16()
    scales = (None, None)
    if fp8:
        scales = (k.abs().max() / 448).reshape(1), (v.abs().max() / 448).reshape(1)
        k, v = (k / scales[0]).to(FP8), (v / scales[1]).to(FP8)
        k_ref, v_ref = k.double() * scales[0].double(), v.double() * scales[1].double()
    else:
        k, v = k.bfloat16(), v.bfloat16()
        k_ref, v_ref = k, v
    out = triton_attention.gqa_decode_attention(q.reshape(batch, kv_heads, heads // kv_heads * n_q, dim), k, v,
                                                allowed, dim**-0.5, *scales, last=columns[:, -1])
    out = out.reshape(batch, heads, n_q, dim).transpose(1, 2)
    ref = reference_multi_attention(q, k_ref, v_ref, allowed, dim**-0.5)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 2e-2), ("float32", 5e-3)])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
def test_cuda_verify_forward_fused_equals_unfused(tiny_model_dir, dtype, bound, kv):
    """Head dim 64 (the Triton attention's range): Triton rope + packed multi-query attention against the HF
    sequence with transformers' sdpa (float32: the kernel's dots are TF32)."""
    os.environ.pop("TRITON_INTERPRET", None)
    path = tiny_model_dir("qwen3", initializer_range=0.2, hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64)
    result = compare_verify(path, kv, dtype, device="cuda")
    assert result["multi_ops"] == result["layers"] and result["prefill_sdpa_calls"] == result["layers"]
    assert result["fused_vs_unfused"] < bound and result["same_argmax"] >= 0.9, result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
def test_cuda_speculative_greedy_equals_plain_with_the_kernels(tiny_model_dir):
    """float32 teacher with head dim 64 (Triton attention for Q = 1 and Q = k + 1, Triton rope), untrained
    Eagle3 draft, CUDA graphs on: speculative greedy output == plain greedy output token for token, up to
    numerical ties (the verify and decode kernels round differently, TF32 dots): a row that differs does so
    first where the two tokens' float64 logits are within 2e-2 of each other (lumenrl_sddd.lossless)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from lumenrl_backends.engines.speculative import attach_draft
    from lumenrl_backends.trainers.sddd_teacher import prompt_batch
    from lumenrl_sddd.capture import eagle3_layer_ids
    from lumenrl_sddd.eagle3 import Eagle3Draft

    path = tiny_model_dir("qwen3", initializer_range=0.2, hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, num_hidden_layers=4)
    model, tok = load_model_and_tokenizer(str(path), dtype="float32")
    model.cuda()
    engine = NativeEngine(model, tok, device=torch.device("cuda"), max_batch_size=8, max_seq_len=96)
    batch = prompt_batch([[5 + i, 9, 11 + 2 * i, 3][: 2 + i % 3] for i in range(6)], tok.pad_token_id)
    params = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    plain = engine.generate(batch, params)
    draft = Eagle3Draft.from_teacher(model, counts=torch.ones(model.config.vocab_size),
                                     draft_vocab_size=model.config.vocab_size, aux_layer_ids=eagle3_layer_ids(4),
                                     ttt_steps=5)
    attach_draft(engine, draft, 5)
    spec = engine.generate(batch, params)
    assert spec.meta_info["perf"]["cuda_graphs"]
    prompts = [[5 + i, 9, 11 + 2 * i, 3][: 2 + i % 3] for i in range(6)]
    reference = load_model_and_tokenizer(str(path), dtype="float32")[0].double()  # a fresh float64 copy on the CPU
    gaps = divergence_gaps(reference, prompts, plain.batch["responses"].cpu(), spec.batch["responses"].cpu())
    assert all(gap < 2e-2 for _, _, gap in gaps), gaps
