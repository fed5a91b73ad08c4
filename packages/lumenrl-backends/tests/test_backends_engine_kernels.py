"""The native engine's decode kernels: packed GQA attention against float64 references, the ``sdpa``
routing of :func:`engine_attention` (threads, nesting), the Triton split-KV attention kernel (bounded rows,
FP8 cache with scales, V stored by columns, FP8 output codes) and the fused sampler, in Triton's CPU
interpreter and on CUDA. Split from ``test_backends_engine_speed.py``; the interpreted scripts import their
inputs from this module."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from lumenrl_backends.engines.attention import engine_attention, packed_decode_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

HAS_TRITON = importlib.util.find_spec("triton") is not None


def reference_attention(q, k, v, allowed, scale):
    """float64 grouped attention: q (B, H, 1, D), k/v (B, Hkv, L, D), allowed (B, L) -> (B, 1, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v64).transpose(1, 2)


def fp8_bounded_case(seed: int):
    """An FP8 cache (E4M3 codes, one scale each for K and V) with rows ending at their write columns
    ``last`` (the engine's bounded walk), batch 3, 2 KV heads x 4 queries, head dim 64, 130 columns, and
    float64 attention over the dequantized values for a half-precision query."""
    torch.manual_seed(seed)
    q, k, v, allowed = random_decode_inputs(dim=64, length=130)
    last = torch.tensor([129, 70, 3])
    cols = torch.arange(130)
    allowed = (allowed & (cols[None, :] < last[:, None])) | (cols[None, :] == last[:, None])
    k_scale, v_scale = k.abs().max() / 448, v.abs().max() / 448
    qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    scales = dict(k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1), last=last)
    ref = reference_attention(q.half(), qk.double() * k_scale.double(), qv.double() * v_scale.double(), allowed, 0.125)
    return q, k, v, qk, qv, allowed, last, scales, ref


class _Module(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def random_decode_inputs(batch=3, heads=8, kv_heads=2, dim=32, length=70):
    q = torch.randn(batch, heads, 1, dim)
    cache_k, cache_v = torch.randn(batch + 2, kv_heads, length + 30, dim), torch.randn(batch + 2, kv_heads, length + 30, dim)
    k, v = cache_k[:batch, :, :length], cache_v[:batch, :, :length]  # strided prefix views, like the slot cache
    allowed = torch.rand(batch, length) > 0.4
    allowed[:, -1] = True
    return q, k, v, allowed


def test_packed_decode_attention_matches_float64_reference():
    torch.manual_seed(0)
    q, k, v, allowed = random_decode_inputs()
    scale = q.shape[-1] ** -0.5
    out, _ = packed_decode_attention(_Module(), q, k, v, allowed[:, None, None, :], scaling=scale)
    ref = reference_attention(q, k, v, allowed, scale)
    assert out.shape == (3, 1, 8, 32)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_packed_attention_falls_back_to_sdpa_for_prefill():
    torch.manual_seed(1)
    q = torch.randn(2, 8, 5, 16)
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None].expand(2, 1, 5, 5)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = packed_decode_attention(_Module(), q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.25)
    assert torch.allclose(out, ref, atol=1e-6)


def test_engine_attention_routes_only_the_engines_model():
    """The engine's attention is reached by name from the model it was set on, never through transformers' ``sdpa``
    entry: a second model (a trainer's) runs ``sdpa`` inside an engine forward too, and the routed model computes
    what ``sdpa`` does (float64, fresh weights and inputs)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.modeling_utils import AttentionInterface

    from lumenrl_backends.engines import attention

    def tiny():  # each model its own config object, as every loaded checkpoint has
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            attn_implementation="sdpa")).double().eval()

    engine_model, trainer_model = tiny(), tiny()
    trainer_model.load_state_dict(engine_model.state_dict())
    before = AttentionInterface._global_mapping["sdpa"]
    assert attention.use_engine_attention(engine_model)
    assert {m.config._attn_implementation for m in engine_model.modules() if hasattr(m, "config")} == {
        attention.ENGINE_ATTENTION}
    assert trainer_model.config._attn_implementation == "sdpa"
    calls = []
    original = attention.packed_decode_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape[2])  # query length
        return original(*args, **kwargs)

    AttentionInterface.register(attention.ENGINE_ATTENTION, counted)
    try:
        ids = torch.randint(0, 64, (3, 7))
        with torch.no_grad(), engine_attention():
            assert AttentionInterface._global_mapping["sdpa"] is before
            theirs = trainer_model(ids).logits
            assert calls == []  # the trainer's model never reaches the engine's function
            ours = engine_model(ids).logits
            assert calls == [7, 7]  # one call per layer of the routed model
        assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    finally:
        AttentionInterface.register(attention.ENGINE_ATTENTION, original)
    assert attention.use_engine_attention(engine_model)  # idempotent: a model an earlier engine routed


def test_engine_attention_forwards_take_turns_across_threads_and_nest():
    import threading

    from lumenrl_backends.engines import attention

    cache_a, cache_b, inner = object(), object(), object()
    a_inside, a_release, b_entered = threading.Event(), threading.Event(), threading.Event()

    def engine_a():
        with engine_attention(cache_a):
            a_inside.set()
            a_release.wait(5)
            assert attention._ACTIVE_CACHE[0] is cache_a  # B did not replace it meanwhile

    def engine_b():
        a_inside.wait(5)
        with engine_attention(cache_b):
            b_entered.set()
            assert attention._ACTIVE_CACHE[0] is cache_b

    threads = [threading.Thread(target=engine_a), threading.Thread(target=engine_b)]
    for t in threads:
        t.start()
    assert a_inside.wait(5)
    assert not b_entered.wait(0.3)  # B waits while A's forward runs
    a_release.set()
    for t in threads:
        t.join(5)
    assert b_entered.is_set() and attention._ACTIVE_CACHE[0] is None
    with engine_attention(cache_a):  # a forward inside a forward restores the outer one's cache
        with engine_attention(inner):
            assert attention._ACTIVE_CACHE[0] is inner
        assert attention._ACTIVE_CACHE[0] is cache_a


_INTERPRETED_CHECK = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import random_decode_inputs, reference_attention
torch.manual_seed(2)
q, k, v, allowed = random_decode_inputs(dim=64, length=150)
allowed[1, :] = False
allowed[1, 149] = True  # a row with a single visible key
out = triton_attention._run(q.reshape(3, 2, 4, 64), k, v, allowed, 0.125, splits={splits})
ref = reference_attention(q, k, v, allowed, 0.125)
assert torch.isfinite(out).all()
print(float((out.reshape(3, 1, 8, 64).double() - ref).norm() / ref.norm()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_split_kv_kernel_matches_float64_reference(interpreted, splits):
    # TRITON_INTERPRET is read when triton is imported: the kernel ran in a fresh interpreter process
    done = interpreted[f"split_kv_{splits}"]
    assert float(done.strip().splitlines()[-1]) < 1e-5


@pytest.fixture(scope="module")
def interpreted(triton_interpreted):
    """Every interpreted script of this file, in one Triton-interpreter process: name -> what it printed."""
    return triton_interpreted({
        **{f"split_kv_{n}": _INTERPRETED_CHECK.format(splits=n) for n in (1, 3)},
        "bounded": _INTERPRETED_BOUNDED, "big_rows": _INTERPRETED_BIG_ROWS,
        **{f"sampler_{g}": _INTERPRETED_SAMPLER.format(greedy_only=g) for g in (False, True)},
        "fp8": _INTERPRETED_FP8, "v_columns": _INTERPRETED_V_COLUMNS, "v_tiles": _INTERPRETED_V_TILES,
        "fp8_out": _INTERPRETED_FP8_OUT,
    })


_INTERPRETED_BOUNDED = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import random_decode_inputs, reference_attention
torch.manual_seed(6)
q, k, v, allowed = random_decode_inputs(batch=4, dim=64, length=200)
last = torch.tensor([199, 40, 0, 130])  # rows end in different splits (one at the very first column)
cols = torch.arange(200)
allowed = (allowed & (cols[None, :] < last[:, None])) | (cols[None, :] == last[:, None])
for row, end in enumerate(last.tolist()):  # poison the tail: a column past ``last`` that is read gives NaN
    k[row, :, end + 1:] = float("nan")
    v[row, :, end + 1:] = float("nan")
ref = reference_attention(q, k.nan_to_num(), v.nan_to_num(), allowed, 0.125)
tuned = {"block_n": 32, "chunk": 64, "num_warps": 2, "num_stages": 2, "k_trans": 1}  # 4 splits of 64 columns
for splits, config in ((1, None), (3, None), (None, tuned), (None, {"chunk": 256})):  # the last: one split
    out = triton_attention._run(q.reshape(4, 2, 4, 64), k, v, allowed, 0.125, splits=splits, last=last, config=config)
    assert torch.isfinite(out).all(), splits
    print(float((out.reshape(4, 1, 8, 64).double() - ref).norm() / ref.norm()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_stops_at_each_rows_last_column(interpreted):
    errors = [float(x) for x in interpreted["bounded"].strip().splitlines()[-4:]]
    assert len(errors) == 4 and max(errors) < 1e-5


@pytest.mark.parametrize(("config", "named"), [
    ({"block_n": 48}, "block_n=48"), ({"block_n": 8}, "block_n=8"), ({"chunk": 96}, "chunk=96"),
    ({"num_stages": 0}, "num_stages=0"), ({"warps": 4}, "['warps']"), ({"k_trans": 2}, "k_trans=2"),
    ({"fp8_dots": 1, "block_n": 16}, "block_n=16"), ({"fp8_dots": 3}, "fp8_dots=3"),
])
def test_triton_attention_config_errors_name_the_bad_value(config, named):
    from lumenrl_backends.engines import triton_attention

    with pytest.raises(ValueError, match=re.escape(named)):
        triton_attention._config(config)


_INTERPRETED_BIG_ROWS = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import random_decode_inputs, reference_attention
torch.manual_seed(8)
q, k, v, allowed = random_decode_inputs(batch=3, dim=64, length=64)  # k, v: (3, 2, 64, 64)
# row 2 of K/V starts past 2**31 elements with an int32 row stride (a long cache), lazily backed memory
stride = 2**30 + 4096
views = []
for t in (k, v):
    base = torch.empty(2 * stride + 2 * 64 * 64, dtype=t.dtype)
    view = base.as_strided(t.shape, (stride, 64 * 64, 64, 1))
    view.copy_(t)
    views.append((base, view))
out = triton_attention._run(q.reshape(3, 2, 4, 64), views[0][1], views[1][1], allowed, 0.125, splits=1)
ref = reference_attention(q, k, v, allowed, 0.125)
print(float((out.reshape(3, 1, 8, 64).double() - ref).norm() / ref.norm()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_addresses_cache_rows_past_int32_range(interpreted):
    assert float(interpreted["big_rows"].strip().splitlines()[-1]) < 1e-5


def test_write_columns_come_from_the_decode_view_only():
    from lumenrl_backends.engines.attention import _write_columns
    from lumenrl_backends.engines.kv_cache import CacheView, SlotKVCache

    cache = SlotKVCache(num_layers=1, max_slots=4, max_len=16, device=torch.device("cpu"))
    columns = torch.tensor([[5], [9], [0]])
    assert _write_columns(3) is None  # no engine forward in progress
    with engine_attention(cache):
        cache.set_view(CacheView(rows=torch.arange(3), columns=columns, decode=True, kv_len=16))
        assert _write_columns(3).tolist() == [5, 9, 0]
        assert _write_columns(2) is None  # another batch than the view's
        cache.set_view(CacheView(rows=torch.arange(3), columns=columns, decode=False, kv_len=3))
        assert _write_columns(3) is None  # prefill


_INTERPRETED_SAMPLER = """
import torch
from lumenrl_backends.engines import triton_sampling
from lumenrl_backends.engines.sampling import sample_tokens
torch.manual_seed(4)
batch, vocab = 6, 5000
logits = torch.randn(batch, vocab) * 3
temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 0.0])
seeds = torch.tensor([1, 2**40 + 7, 3, 4, 2**62, 5])
counters = torch.tensor([0, 5, 9, 100, 3, 1])
greedy_only = {greedy_only}
if greedy_only:
    temperature = torch.zeros(batch)
tokens, log_probs = triton_sampling.fused_sample(logits, temperature=temperature, seeds=seeds, counters=counters,
                                                 greedy_only=greedy_only, block_v=1024)
ref_tokens, ref_log_probs = sample_tokens(logits, temperature=temperature, top_k=torch.zeros_like(seeds),
                                          top_p=torch.ones(batch), seeds=seeds, counters=counters, restrict=False)
assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)
print(float((log_probs - ref_log_probs).abs().max()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
@pytest.mark.parametrize("greedy_only", [False, True])
def test_triton_fused_sampler_matches_torch_sampler(interpreted, greedy_only):
    done = interpreted[f"sampler_{greedy_only}"]
    assert float(done.strip().splitlines()[-1]) < 1e-5


_INTERPRETED_FP8 = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import random_decode_inputs, reference_attention
torch.manual_seed(5)
q, k, v, allowed = random_decode_inputs(dim=64, length=130)
k_scale, v_scale = k.abs().max() / 448, v.abs().max() / 448
qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
out = triton_attention._run(q.reshape(3, 2, 4, 64), qk, qv, allowed, 0.125, splits=2,
                            k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1))
ref = reference_attention(q, qk.double() * k_scale.double(), qv.double() * v_scale.double(), allowed, 0.125)
# a bf16 query (the engine's case) runs the dots in fp16: bounded by bf16's rounding of q and out
out16 = triton_attention._run(q.reshape(3, 2, 4, 64).bfloat16(), qk, qv, allowed, 0.125, splits=2,
                              k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1))
ref16 = reference_attention(q.bfloat16().double(), qk.double() * k_scale.double(), qv.double() * v_scale.double(),
                            allowed, 0.125)
print(float((out16.reshape(3, 1, 8, 64).double() - ref16).norm() / ref16.norm()))
# opt-in E4M3 dots: q and p rounded to E4M3 as well (the interpreter's own FP8 casts)
for level in (1, 2):
    out8 = triton_attention._run(q.reshape(3, 2, 4, 64).bfloat16(), qk, qv, allowed, 0.125, splits=2,
                                 k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1), config={"fp8_dots": level})
    print(float((out8.reshape(3, 1, 8, 64).double() - ref16).norm() / ref16.norm()))
print(float((out.reshape(3, 1, 8, 64).double() - ref).norm() / ref.norm()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_reads_fp8_cache_with_scales(interpreted):
    lines = interpreted["fp8"].strip().splitlines()[-4:]
    bf16_query, fp8_qk, fp8_both, fp32_query = (float(x) for x in lines)
    assert fp32_query < 1e-5
    assert bf16_query < 4e-3  # bf16 output rounding (2**-9 relative) dominates
    # opt-in E4M3 dots add E4M3 rounding (3 mantissa bits; the interpreter's casts round coarser than CUDA's)
    assert bf16_query < fp8_qk < 5e-2 and fp8_both < 1e-1, (fp8_qk, fp8_both)


_INTERPRETED_V_COLUMNS = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import fp8_bounded_case, reference_attention
q, k, v, qk, qv, allowed, last, scales, ref = fp8_bounded_case(8)
columns = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # V stored (D, L) per head
assert columns(qv).stride(-2) == 1 and torch.equal(columns(qv).float(), qv.float())
for splits, config in ((1, None), (2, {"block_n": 16})):
    rows = triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, qv, allowed, 0.125, splits=splits, config=config,
                                 **scales)
    cols_out = triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, columns(qv), allowed, 0.125, splits=splits,
                                     config=config, **scales)
    assert torch.equal(rows, cols_out), splits  # same values, same order of operations
    print(float((cols_out.reshape(3, 1, 8, 64).double() - ref).norm() / ref.norm()))
# a 16-bit cache stored by columns too (the public wrapper keeps the layout instead of copying)
out = triton_attention.gqa_decode_attention(q.reshape(3, 2, 4, 64), k, columns(v), allowed, 0.125, last=last)
print(float((out.reshape(3, 1, 8, 64).double() - reference_attention(q, k, v, allowed, 0.125)).norm()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_reads_v_stored_by_columns(interpreted):
    errors = [float(x) for x in interpreted["v_columns"].strip().splitlines()[-3:]]
    assert errors[0] < 4e-3 and errors[1] < 4e-3  # fp16 output rounding, as the row layout
    assert errors[2] < 1e-4


_INTERPRETED_V_TILES = """
import torch
from lumenrl_backends.engines import triton_attention
from lumenrl_backends.engines.kv_cache import value_rows, value_tiles
from test_backends_engine_kernels import fp8_bounded_case
q, k, v, qk, qv, allowed, last, scales, ref = fp8_bounded_case(12)
tiles = value_tiles(qv, 64)  # (B, H_kv, L / 64, D, 64), the last tile partly past the 130 columns
assert tiles.shape == (3, 2, 3, 64, 64) and torch.equal(value_rows(tiles, 130).float(), qv.float())
for splits, config in ((1, None), (2, {"block_n": 16}), (3, {"block_n": 32, "mask_ahead": 0}), (1, {"block_n": 64})):
    rows = triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, qv, allowed, 0.125, splits=splits, config=config,
                                 **scales)
    out = triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, tiles, allowed, 0.125, splits=splits,
                                config=config, **scales)
    assert torch.equal(rows, out), (splits, config)  # same values, same order of operations
    print(float((out.reshape(3, 1, 8, 64).double() - ref).norm() / ref.norm()))
try:
    triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, tiles, allowed, 0.125, config={"block_n": 128}, **scales)
except ValueError as err:
    print("refused:", err)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_reads_v_tiles_as_rows(interpreted):
    """V in (D, 64) tiles (the slot cache's FP8 layout) gives the rows layout's output bit for bit, with the
    mask loaded ahead or not, one split or several; a block wider than a tile is refused by name."""
    lines = interpreted["v_tiles"].strip().splitlines()
    errors = [float(x) for x in lines[-5:-1]]
    assert all(e < 4e-3 for e in errors), errors  # fp16 output rounding, as the row layout
    assert lines[-1].startswith("refused:") and "block_n=128" in lines[-1] and "T=64" in lines[-1]


_INTERPRETED_FP8_OUT = """
import torch
from lumenrl_backends.engines import triton_attention
from test_backends_engine_kernels import random_decode_inputs, reference_attention
torch.manual_seed(9)
q, k, v, allowed = random_decode_inputs(dim=64, length=150)
last = torch.tensor([149, 60, 2])
cols = torch.arange(150)
allowed = (allowed & (cols[None, :] < last[:, None])) | (cols[None, :] == last[:, None])
k_scale, v_scale = (k.abs().max() / 448).reshape(1), (v.abs().max() / 448).reshape(1)
qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
ref = reference_attention(q.half(), qk.double() * k_scale.double(), qv.double() * v_scale.double(), allowed, 0.125)
for splits in (1, 2):  # direct store and the merge kernel
    codes = triton_attention._run(q.reshape(3, 2, 4, 64).half(), qk, qv, allowed, 0.125, splits=splits, k_scale=k_scale,
                                  v_scale=v_scale, last=last, out_dtype=torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn and codes.float().abs().max() <= 448
    out = codes.double() * v_scale.double()  # V's scale is the codes' scale
    print(float((out.reshape(3, 1, 8, 64) - ref).norm() / ref.norm()))
try:
    triton_attention._run(q.reshape(3, 2, 4, 64), k, v, allowed, 0.125, out_dtype=torch.float8_e4m3fn)
    raise SystemExit("a 16-bit cache was accepted")
except ValueError as err:
    assert "needs an FP8 cache" in str(err), err
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_triton_kernel_writes_fp8_codes_in_v_units(interpreted):
    errors = [float(x) for x in interpreted["fp8_out"].strip().splitlines()[-2:]]
    assert max(errors) < 0.1, errors  # E4M3 rounding of the output (the interpreter's cast is coarser than CUDA's)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_triton_decode_attention_matches_reference():
    os.environ.pop("TRITON_INTERPRET", None)
    from lumenrl_backends.engines import triton_attention

    torch.manual_seed(3)
    q, k, v, allowed = (t.cuda() for t in random_decode_inputs(batch=5, dim=128, length=300))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = triton_attention.gqa_decode_attention(q.reshape(5, 2, 4, 128), k, v, allowed, 128**-0.5)
    ref = reference_attention(q, k, v, allowed, 128**-0.5)
    assert float((out.reshape(5, 1, 8, 128).double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_triton_attention_compiles_once_for_every_kv_len():
    """At a batch whose splits are the whole length (64 rows x 8 KV heads >= 2 x SMs), each engine kv_len (a
    multiple of 64 columns) used to be a constexpr chunk, so a kernel compiled per length; the chunk is a run-time
    argument now: lengths after the first add no binary, and each output matches float64."""
    os.environ.pop("TRITON_INTERPRET", None)
    from lumenrl_backends.engines import triton_attention

    kernel = triton_attention._split_kernel
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton's JITFunction keeps no device_caches (the count this test reads)")
    torch.manual_seed(7)
    device = torch.cuda.current_device()
    counts = []
    for length in (128, 192, 320):
        q, k, v, allowed = (t.cuda() for t in random_decode_inputs(batch=64, heads=32, kv_heads=8, dim=128,
                                                                   length=length))
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        out = triton_attention.gqa_decode_attention(q.reshape(64, 8, 4, 128), k, v, allowed, 128**-0.5)
        ref = reference_attention(q, k, v, allowed, 128**-0.5)
        assert float((out.reshape(64, 1, 32, 128).double() - ref).norm() / ref.norm()) < 1e-2, length
        counts.append(len(caches[device][0]))
    assert counts[1] == counts[0] and counts[2] == counts[0], counts


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("batch", [5, 64])
def test_cuda_triton_attention_fp8_codes_match_the_bf16_output(batch):
    os.environ.pop("TRITON_INTERPRET", None)
    from lumenrl_backends.engines import triton_attention

    torch.manual_seed(batch)
    q, k, v, allowed = (t.cuda() for t in random_decode_inputs(batch=batch, dim=128, length=300))
    k_scale, v_scale = (k.abs().max() / 448).reshape(1), (v.abs().max() / 448).reshape(1)
    qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    packed = q.bfloat16().reshape(batch, 2, 4, 128)
    out = triton_attention.gqa_decode_attention(packed, qk, qv, allowed, 128**-0.5, k_scale, v_scale)
    codes = triton_attention.gqa_decode_attention_fp8(packed, qk, qv, allowed, 128**-0.5, k_scale, v_scale)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == out.shape
    deq = codes.double() * v_scale.double()
    assert float((deq - out.double()).norm() / out.double().norm()) < 4e-2  # one E4M3 rounding (~2-3%)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_triton_attention_reads_v_tiles():
    """The engine's FP8 layout on CUDA at the 8B decode shape (64 rows, 8 KV heads of 4 queries, 512
    columns in 128-column tiles, rows of different lengths): against float64 and against V by rows."""
    os.environ.pop("TRITON_INTERPRET", None)
    from lumenrl_backends.engines import triton_attention
    from lumenrl_backends.engines.kv_cache import V_TILE, value_tiles

    assert triton_attention.kernel_agrees(torch.device("cuda"), torch.float8_e4m3fn, v_tile=V_TILE)
    torch.manual_seed(21)
    q, k, v, allowed = (t.cuda() for t in random_decode_inputs(batch=64, heads=32, kv_heads=8, dim=128, length=512))
    last = torch.randint(200, 512, (64,), device="cuda")
    cols = torch.arange(512, device="cuda")
    allowed = (allowed & (cols[None, :] < last[:, None])) | (cols[None, :] == last[:, None])
    k_scale, v_scale = (k.abs().max() / 448).reshape(1), (v.abs().max() / 448).reshape(1)
    qk, qv = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    tiles = value_tiles(qv, V_TILE)
    packed = q.bfloat16().reshape(64, 8, 4, 128)
    rows = triton_attention.gqa_decode_attention(packed, qk, qv, allowed, 128**-0.5, k_scale, v_scale, last=last)
    out = triton_attention.gqa_decode_attention(packed, qk, tiles, allowed, 128**-0.5, k_scale, v_scale, last=last)
    ref = reference_attention(q.bfloat16(), qk.double() * k_scale.double(), qv.double() * v_scale.double(), allowed,
                              128**-0.5)
    assert float((out.reshape(64, 1, 32, 128).double() - ref).norm() / ref.norm()) < 4e-3
    assert float((out.double() - rows.double()).norm() / rows.double().norm()) < 2e-3
