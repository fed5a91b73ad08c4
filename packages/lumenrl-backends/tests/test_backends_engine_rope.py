"""The fused decode q/k-norm + RoPE + KV-write op (``lumenrl::decode_qk_rope_kv_write``, ``fused_qk_rope``).

* the torch reference against a float64 norm + RoPE (relative error) and, bit for bit, against the
  engine's unfused sequence (HF q/k norms, ``apply_rotary_pos_emb``, ``SlotKVCache.update``);
* the Triton kernel in Triton's CPU interpreter (one subprocess: ``TRITON_INTERPRET`` is read at
  import) against the reference, and inside the engine;
* engines with ``fused_qk_rope`` against engines without (tiny Qwen3 and Llama, bf16 and FP8 KV,
  eager and ``compile="full"``), the op running on every decode step;
* ``torch.compile`` of the op: same results, and the cache written in place (no cache copy);
* on CUDA: the kernel against the reference, and under CUDA-graph capture / replay.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine, triton_rope
from lumenrl_backends.engines.kv_cache import CacheView, SlotKVCache, value_rows, value_tiles
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA_TRITON = HAS_TRITON and torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@dataclass
class Case:
    """One decode step's inputs, laid out as the engine passes them."""

    query: torch.Tensor  # (b, H, D) slice of the fused q/k/v output (strided, no copy)
    key: torch.Tensor  # (b, H_kv, D)
    value: torch.Tensor
    q_weight: torch.Tensor | None  # (D,) q_norm weight (None: no q/k norms, e.g. Llama)
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor  # (b, D) slices of HF's (b, 1, D)
    sin: torch.Tensor
    key_cache: torch.Tensor  # (S, H_kv, L, D), random contents: untouched positions are checkable
    value_cache: torch.Tensor
    columns: torch.Tensor  # (b,) int64
    k_scale: torch.Tensor | None  # () float32, FP8 caches only
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        """Positional arguments of the op / reference / kernel launch, with fresh copies of the caches."""
        return (self.query, self.key, self.value, self.q_weight, self.k_weight, self.eps, self.cos, self.sin,
                self.key_cache.clone(), self.value_cache.clone(), self.columns, self.k_scale, self.v_scale)


def random_case(batch: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16, *,
                norm: bool = True, fp8: bool = False, length: int = 13, device: str = "cpu", seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    qkv = rand(batch, 1, (heads + 2 * kv_heads) * dim, scale=2.0)  # (b, 1, N): one fused projection output
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.randint(0, 4096, (batch,), generator=gen).double()
    angles = positions[:, None] * 1e6 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = (f(emb).to(dtype).to(device)[:, None] for f in (torch.cos, torch.sin))  # (b, 1, D), as HF's rotary
    weights = [(1 + rand(dim, scale=0.5, dtype=torch.float32)).to(dtype) if norm else None for _ in range(2)]
    caches = [rand(batch + 2, kv_heads, length, dim, dtype=torch.float32).to(FP8 if fp8 else dtype) for _ in range(2)]
    columns = torch.randint(0, length, (batch,), generator=gen).to(device)
    scales = [torch.tensor(s, device=device) for s in (2.5 / 448, 4.0 / 448)] if fp8 else [None, None]  # K saturates
    return Case(q.view(batch, 1, heads, dim)[:, 0], k.view(batch, 1, kv_heads, dim)[:, 0],
                v.view(batch, 1, kv_heads, dim)[:, 0], *weights, 1e-6, cos[:, 0], sin[:, 0], *caches, columns, *scales)


def float64_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm then RoPE in float64, written out (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x = x.double()
    if weight is not None:
        x = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[:, None], sin.double()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]], dim=-1)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)])
@pytest.mark.parametrize("norm", [True, False])
def test_reference_against_float64_norm_rope(dtype, bound, norm):
    case = random_case(6, 8, 2, 128, dtype, norm=norm, seed=int(norm))
    args = case.args()
    q = triton_rope.reference_decode_qk_rope_kv_write(*args)
    rows = torch.arange(6)
    k = args[8][rows, :, case.columns]  # what the reference wrote, (b, H_kv, D)
    assert relative_error(q[:, :, 0], float64_norm_rope(case.query, case.q_weight, 1e-6, case.cos, case.sin)) < bound
    assert relative_error(k, float64_norm_rope(case.key, case.k_weight, 1e-6, case.cos, case.sin)) < bound
    assert torch.equal(args[9][rows, :, case.columns], case.value)


def hf_cache(case: Case, fp8: bool) -> SlotKVCache:
    """A one-layer engine cache holding ``case``'s cache contents, in its decode view."""
    from lumenrl_quant import KVScales

    slots, kv_heads, length, _ = case.key_cache.shape
    cache = SlotKVCache(num_layers=1, max_slots=slots, max_len=length, device=torch.device("cpu"),
                        kv_dtype=FP8 if fp8 else None)
    layer = cache.layers[0]
    layer.lazy_initialization(case.key[:, :, None], case.value[:, :, None])
    layer.keys.copy_(case.key_cache)
    layer.values.copy_(case.value_cache)
    if fp8:
        layer.codec.scales = KVScales(k_scale=case.k_scale, v_scale=case.v_scale, dtype=FP8)
    batch = case.query.shape[0]
    cache.set_view(CacheView(rows=torch.arange(batch), columns=case.columns[:, None], decode=True, kv_len=length))
    return cache


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_reference_is_the_engines_unfused_sequence_bit_for_bit(family, fp8):
    """HF's q/k norms + ``apply_rotary_pos_emb`` + ``SlotKVCache.update`` (decode view) against the op's
    reference through ``decode_write_target`` / ``decode_read``: query, cache and what attention gets."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    case = random_case(5, 8, 2, 64, norm=family == "qwen3", fp8=fp8, seed=7)
    query, key, value = case.query[:, :, None], case.key[:, :, None], case.value[:, :, None]  # (b, H, 1, D)
    hf = qwen3 if family == "qwen3" else llama
    if family == "qwen3":
        q_norm, k_norm = qwen3.Qwen3RMSNorm(64, eps=1e-6), qwen3.Qwen3RMSNorm(64, eps=1e-6)
        q_norm.weight.data, k_norm.weight.data = case.q_weight, case.k_weight
        with torch.no_grad():
            query, key = q_norm(query.transpose(1, 2)).transpose(1, 2), k_norm(key.transpose(1, 2)).transpose(1, 2)
    query, key = hf.apply_rotary_pos_emb(query, key, case.cos[:, None], case.sin[:, None])
    unfused = hf_cache(case, fp8)
    unfused.raw_fp8_decode = True
    k_read, v_read = unfused.update(key, value, 0)

    fused = hf_cache(case, fp8)
    fused.raw_fp8_decode = True
    target = fused.decode_write_target(0, case.key[:, :, None], case.value[:, :, None])
    assert target.columns.shape == (5, 1) and target.keys is fused.layers[0].keys
    out = triton_rope.decode_qk_rope_kv_write(
        case.query, case.key, case.value, case.cos, case.sin, target.keys, target.values, target.columns[:, 0],
        q_weight=case.q_weight, k_weight=case.k_weight, eps=1e-6, k_scale=target.k_scale, v_scale=target.v_scale)
    assert torch.equal(out, query) and out.is_contiguous()
    for a, b in ((unfused.layers[0].keys, fused.layers[0].keys), (unfused.layers[0].values, fused.layers[0].values),
                 (k_read, fused.decode_read(0)[0]), (v_read, fused.decode_read(0)[1])):
        assert torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b)
    assert (fused.current_scales is None) == (unfused.current_scales is None) == (not fp8)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_writes_v_tiles_as_rows(fp8):
    case = random_case(5, 8, 2, 64, norm=True, fp8=fp8, seed=9)
    by_rows, by_tiles = case.args(), list(case.args())
    by_tiles[9] = value_tiles(by_tiles[9], 4)
    q_rows = triton_rope.reference_decode_qk_rope_kv_write(*by_rows)
    q_tiles = triton_rope.decode_qk_rope_kv_write(
        case.query, case.key, case.value, case.cos, case.sin, by_tiles[8], by_tiles[9], case.columns,
        q_weight=case.q_weight, k_weight=case.k_weight, eps=case.eps, k_scale=case.k_scale, v_scale=case.v_scale)
    assert torch.equal(q_rows, q_tiles) and torch.equal(as_bits(by_rows[8]), as_bits(by_tiles[8]))
    assert torch.equal(as_bits(by_rows[9]), as_bits(value_rows(by_tiles[9], by_rows[9].shape[2])))


def test_write_target_falls_back_where_update_must_write():
    from lumenrl_quant import KVScales

    case = random_case(3, 4, 2, 16, fp8=True)
    cache = hf_cache(case, fp8=True)
    k, v = case.key[:, :, None], case.value[:, :, None]
    assert cache.decode_write_target(0, k, v) is not None
    cache.layers[0].codec.scales = KVScales(k_scale=torch.ones(2), v_scale=torch.ones(2), dtype=FP8)  # per head
    assert cache.decode_write_target(0, k, v) is None
    cache.layers[0].codec.scales = None  # not calibrated yet: the first prefill's update does it
    assert cache.decode_write_target(0, k, v) is None
    cache.set_view(CacheView(rows=torch.arange(3), columns=torch.zeros(3, 2, dtype=torch.int64), decode=False, kv_len=2))
    assert cache.decode_write_target(0, k, v) is None


def test_op_checks_its_arguments():
    case = random_case(3, 4, 2, 16, fp8=True)
    kwargs = {"q_weight": case.q_weight, "k_weight": case.k_weight, "k_scale": case.k_scale, "v_scale": case.v_scale}
    tensors = (case.query, case.key, case.value, case.cos, case.sin, case.key_cache, case.value_cache, case.columns)
    with pytest.raises(ValueError, match="head dim 12"):
        triton_rope.decode_qk_rope_kv_write(*(t[..., :12] for t in tensors[:5]), *tensors[5:], **{
            **kwargs, "q_weight": None, "k_weight": None})
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        triton_rope.decode_qk_rope_kv_write(*tensors, **{**kwargs, "k_scale": None, "v_scale": None})
    with pytest.raises(ValueError, match="one element"):
        triton_rope.decode_qk_rope_kv_write(*tensors, **{**kwargs, "k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="give both"):
        triton_rope.decode_qk_rope_kv_write(*tensors, **{**kwargs, "k_weight": None})


def test_hf_mismatch_names_what_differs():
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    norms = qwen3.Qwen3RMSNorm(16), qwen3.Qwen3RMSNorm(16)
    assert triton_rope.hf_mismatch(qwen3.apply_rotary_pos_emb, *norms, 16) is None
    assert "head_dim 24" in triton_rope.hf_mismatch(qwen3.apply_rotary_pos_emb, *norms, 24)
    no_rotation = lambda q, k, cos, sin: (q * cos[:, None], k * cos[:, None])  # noqa: E731
    assert "apply_rotary_pos_emb" in triton_rope.hf_mismatch(no_rotation, *norms, 16)
    assert "RMSNorm" in triton_rope.hf_mismatch(qwen3.apply_rotary_pos_emb, torch.nn.LayerNorm(16), norms[1], 16)


# ------------------------------------------------------------------ engines with and without the op
@contextlib.contextmanager
def counting_op_runs() -> Iterator[dict[str, int]]:
    """Count runs of the op's two implementations (the registered op calls them by name)."""
    runs = {"kernel": 0, "reference": 0}
    originals = triton_rope._launch, triton_rope.reference_decode_qk_rope_kv_write

    def counted(fn, kind):  # noqa: ANN001, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            runs[kind] += 1
            return fn(*args)
        return run

    triton_rope._launch, triton_rope.reference_decode_qk_rope_kv_write = (
        counted(originals[0], "kernel"), counted(originals[1], "reference"))
    try:
        yield runs
    finally:
        triton_rope._launch, triton_rope.reference_decode_qk_rope_kv_write = originals


def run_engines(path, kv: str, dtype: str, *, compile: str = "none", max_new_tokens: int = 8) -> dict:
    """Greedy generation on one tiny model by an engine without and then with ``fused_qk_rope``: how far
    apart they are, how often each implementation of the op ran (per engine), and the fused engine's
    decode forwards x layers (one op run each)."""
    model, tokenizer = load_model_and_tokenizer(str(path), dtype=dtype)
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    outs, runs, forwards = [], [], [0]
    for fused in (False, True):  # one after the other: both engines drive the same model
        engine = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=40, kv_cache_dtype=kv, compile=compile,
                              kernels=KernelOptions(fused_qk_rope=fused))
        decode_forward = engine._decode_forward

        def counted(*args, _forward=decode_forward, _fused=fused):  # noqa: ANN002, ANN202
            forwards[0] += _fused
            return _forward(*args)

        engine._decode_forward = counted
        with counting_op_runs() as engine_runs:
            outs.append(engine.generate(batch, {**GREEDY, "max_new_tokens": max_new_tokens}))
        runs.append(engine_runs)
    plain, with_op = (out.batch for out in outs)
    return {"same_tokens": torch.equal(plain["responses"], with_op["responses"]),
            "log_prob_diff": float((plain["rollout_log_probs"] - with_op["rollout_log_probs"]).abs().max()),
            "plain_runs": sum(runs[0].values()), "kernel_runs": runs[1]["kernel"],
            "reference_runs": runs[1]["reference"], "expected_runs": forwards[0] * model.config.num_hidden_layers,
            "fused_attentions": len(engine.fusion_report.attention_fused_rope)}


@pytest.fixture(scope="module")
def tiny_models(qwen3_dir, llama_dir) -> dict:
    return {"qwen3": qwen3_dir, "llama": llama_dir}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_with_the_op_generates_what_it_generates_without(tiny_models, family, kv, dtype):
    result = run_engines(tiny_models[family], kv, dtype)
    assert result["same_tokens"] and result["log_prob_diff"] == 0.0  # the reference is the unfused sequence
    assert result["fused_attentions"] == 2 and result["reference_runs"] == result["expected_runs"] > 0
    assert result["plain_runs"] == result["kernel_runs"] == 0


def test_engine_default_runs_the_op_and_the_switch_turns_it_off(tiny_models):
    model, tokenizer = load_model_and_tokenizer(str(tiny_models["qwen3"]), dtype="float32")
    report = NativeEngine(model, tokenizer, max_batch_size=2, max_seq_len=16).fusion_report
    assert len(report.attention_fused_rope) == model.config.num_hidden_layers
    assert not report.attention_fused_rope_skipped
    model, tokenizer = load_model_and_tokenizer(str(tiny_models["qwen3"]), dtype="float32")
    report = NativeEngine(model, tokenizer, max_batch_size=2, max_seq_len=16, kernels=KernelOptions(fused_qk_rope=False)).fusion_report
    assert not report.attention_fused_rope and not report.attention_fused_rope_skipped


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_compile_full_engine_runs_the_op_in_one_graph(tiny_models, kv, monkeypatch):
    """compile="full" (dynamo, eager backend: tracing only): no graph break, one graph, the op on every
    decode step, the same generation as without the op."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    counters.clear()
    result = run_engines(tiny_models["qwen3"], kv, "float32", compile="full", max_new_tokens=5)
    assert sum(counters["graph_break"].values()) == 0
    assert result["same_tokens"] and result["log_prob_diff"] < 1e-6
    assert result["reference_runs"] == result["expected_runs"] > 0


def test_compile_full_computes_the_step_rope_once(monkeypatch, inductor_kernel_calls):
    """compile="full" (inductor on the CPU): the decode step's RoPE tables are computed once, before the forward
    (``fusion.rope_tables``, ``CacheView.rope``), and no kernel of the forward computes cos/sin (without them
    inductor copies the forward's cos/sin for each layer's op, in kernels of four layers); the same tokens and
    log-probs as the engine without the tables, bit for bit, sampling at temperature 1."""
    from torch._inductor.utils import run_and_get_code
    from transformers import AutoConfig, AutoModelForCausalLM

    from lumenrl_backends.engines import native

    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    ids = torch.randint(1, 255, (3, 5), generator=torch.Generator().manual_seed(4))
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    results = {}
    for tables in (True, False):
        if not tables:
            monkeypatch.setattr(native, "rope_tables", lambda *args: None)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        torch._dynamo.reset()
        engine = NativeEngine(model, _NoTokenizer(), max_batch_size=4, max_seq_len=32, compile="full")
        assert (engine._rope is not None) == tables
        out, codes = run_and_get_code(engine.generate, batch,
                                      {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 3})
        forward = max(codes, key=inductor_kernel_calls)  # the model's forward: the graph with the most kernels
        results[tables] = out.batch, "cos" in forward, [c for c in codes if c is not forward and "cos" in c]
    torch._dynamo.reset()
    (with_tables, cos_in_forward, rope_graphs), (without, cos_before, _) = results[True], results[False]
    assert not cos_in_forward and len(rope_graphs) == 1 and inductor_kernel_calls(rope_graphs[0]) == 1
    assert cos_before  # the forward computed them itself
    assert torch.equal(with_tables["responses"], without["responses"])
    assert torch.equal(with_tables["rollout_log_probs"], without["rollout_log_probs"])


class _NoTokenizer:  # the engine only decodes response text with it
    eos_token_id, pad_token_id = None, 0

    def batch_decode(self, rows, **_):  # noqa: ANN001, ANN201
        return ["" for _ in rows]


GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_inductor_writes_the_cache_in_place(device):
    """torch.compile (inductor, fullgraph) of the op followed by reads of the cache: the same results as
    eager, and the cache is not copied. The op mutates ``key_cache``/``value_cache``; functionalization
    turns that into ``auto_functionalized``, which inductor must re-inplace: otherwise the generated code
    clones each cache (a ``clone`` kernel over the whole buffer) and hands the op the copy
    (``reinterpret_tensor(bufN, <cache shape>, ...)``) instead of the graph input."""
    from torch._inductor.utils import run_and_get_code

    case = random_case(3, 4, 2, 16, fp8=True, length=37, device=device, seed=5)
    cache_shape = str(tuple(case.key_cache.shape))

    def step(query, key, value, cos, sin, key_cache, value_cache, columns):
        q = triton_rope.decode_qk_rope_kv_write(query, key, value, cos, sin, key_cache, value_cache, columns,
                                                q_weight=case.q_weight, k_weight=case.k_weight, eps=1e-6,
                                                k_scale=case.k_scale, v_scale=case.v_scale)
        return q * 2, key_cache[:3, :, :20].float().sum(-1), value_cache[:3, :, :20].float().sum()

    args = case.args()
    eager = step(*args[:3], *args[6:11])
    compiled_args = case.args()
    compiled, codes = run_and_get_code(torch.compile(step, fullgraph=True), *compiled_args[:3], *compiled_args[6:11])
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    for a, b in ((args[8], compiled_args[8]), (args[9], compiled_args[9])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    code = "\n".join(codes)
    calls = [line for line in code.splitlines() if "lumenrl.decode_qk_rope_kv_write.default(" in line]
    assert calls and all(cache_shape not in line for line in calls), calls  # caches passed as the inputs
    assert "clone" not in code


# ------------------------------------------------------------------ CUDA
def _op(args: tuple) -> torch.Tensor:
    """The public op on ``Case.args()``-ordered arguments."""
    (query, key, value, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, columns, k_scale, v_scale) = args
    return triton_rope.decode_qk_rope_kv_write(query, key, value, cos, sin, key_cache, value_cache, columns,
                                               q_weight=q_weight, k_weight=k_weight, eps=eps, k_scale=k_scale,
                                               v_scale=v_scale)


def _assert_kernel_matches(case: Case, q: torch.Tensor, got: tuple) -> None:
    """Kernel outputs vs the reference on the same (fresh) caches; on CUDA FP8 codes round as torch's."""
    ref = case.args()
    q_ref = triton_rope.reference_decode_qk_rope_kv_write(*ref)
    assert float((q != q_ref).float().mean()) < 2e-3
    assert relative_error(q, q_ref.double()) <= torch.finfo(q.dtype).eps
    rows = torch.arange(case.query.shape[0], device=q.device)
    written = torch.zeros(case.key_cache.shape[:3], dtype=torch.bool, device=q.device)
    written[rows, :, case.columns] = True
    for cache, cache_ref, before in ((got[8], ref[8], case.key_cache), (got[9], ref[9], case.value_cache)):
        assert torch.equal(cache[~written].view(torch.uint8), before[~written].view(torch.uint8))
        differ = (cache[written].view(torch.uint8) != cache_ref[written].view(torch.uint8)).float().mean()
        assert float(differ) < 2e-3  # a K value one 16-bit ulp off (norm) may move its code; V never
    assert torch.equal(got[9][written].view(torch.uint8), ref[9][written].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("shape,norm,fp8", [((64, 32, 8, 128), True, True), ((64, 32, 8, 128), True, False),
                                            ((64, 32, 8, 128), False, True), ((5, 6, 2, 256), True, True),
                                            ((3, 4, 4, 64), True, False)])
def test_cuda_kernel_matches_the_reference(shape, norm, fp8):
    os.environ.pop("TRITON_INTERPRET", None)
    case = random_case(*shape, norm=norm, fp8=fp8, length=300, device="cuda", seed=sum(shape))
    got = case.args()
    _assert_kernel_matches(case, _op(got), got)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("fp8", [True, False])
def test_cuda_kernel_writes_v_tiles_as_rows(fp8):
    os.environ.pop("TRITON_INTERPRET", None)
    case = random_case(64, 32, 8, 128, fp8=fp8, length=300, device="cuda", seed=31)
    by_rows, by_tiles = case.args(), list(case.args())
    by_tiles[9] = value_tiles(by_tiles[9], 128)
    assert torch.equal(_op(by_rows), _op(by_tiles)) and torch.equal(as_bits(by_rows[8]), as_bits(by_tiles[8]))
    assert torch.equal(as_bits(by_rows[9]), as_bits(value_rows(by_tiles[9], 300)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and triton")
def test_cuda_graph_replay_runs_the_next_step():
    """Captured once, replayed on the next step's inputs copied into the captured tensors (the engine's
    pattern: inputs, columns and recalibrated scales are updated in place)."""
    case = random_case(64, 32, 8, 128, fp8=True, length=64, device="cuda", seed=11)
    step = random_case(64, 32, 8, 128, fp8=True, length=64, device="cuda", seed=12)
    step.k_scale.mul_(1.5)  # a recalibration between capture and replay
    static = case.args()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        _op(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = _op(static)
    fresh = step.args()
    for dst, src in zip(static, fresh):
        if torch.is_tensor(dst):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_kernel_matches(step, q, static)


# ------------------------------------------------------------------ Triton's interpreter (one subprocess)
_INTERPRETED = """
import json, tempfile, torch
from lumenrl_backends.engines import triton_rope
from lumenrl_backends.models import build_tiny_model
from test_backends_engine_rope import (FP8, interpreted_against_reference, interpreted_tiles_against_rows, random_case,
                                      run_engines)

for name, case in (("8b_shape_fp8", random_case(4, 32, 8, 128, fp8=True, seed=1)),
                   ("groups3_no_norm", random_case(3, 6, 2, 64, norm=False, seed=2)),
                   ("fp16_d256", random_case(2, 4, 4, 256, torch.float16, seed=3)),
                   ("fp32_d16_fp8", random_case(5, 4, 2, 16, torch.float32, fp8=True, seed=4))):
    print(json.dumps({"case": name, **interpreted_against_reference(case)}))
for name, case in (("v_tiles_fp8", random_case(4, 32, 8, 128, fp8=True, seed=5)),
                   ("v_tiles_bf16", random_case(3, 8, 2, 64, seed=6))):
    print(json.dumps({"case": name, **interpreted_tiles_against_rows(case)}))
path = build_tiny_model("qwen3", tempfile.mkdtemp(), seed=0, initializer_range=0.2)
print(json.dumps({"case": "engine", **run_engines(path, "auto", "float32", max_new_tokens=4)}))
"""


def interpreted_tiles_against_rows(case: Case) -> dict:
    """The kernel writing V into (D, 8) tiles against writing rows (called in the interpreter)."""
    by_rows, by_tiles = case.args(), list(case.args())
    by_tiles[9] = value_tiles(by_tiles[9], 8)
    q_rows, q_tiles = triton_rope._launch(*by_rows), triton_rope._launch(*by_tiles)
    return {"q_equal": torch.equal(q_rows, q_tiles), "k_equal": torch.equal(as_bits(by_rows[8]), as_bits(by_tiles[8])),
            "v_equal": torch.equal(as_bits(by_rows[9]), as_bits(value_rows(by_tiles[9], by_rows[9].shape[2])))}


def interpreted_against_reference(case: Case) -> dict:
    """Kernel vs reference on ``case`` (called in the interpreter): the fraction of differing query
    values and written cache entries, the largest query difference in 16-bit ulps, and whether every
    cache position the step does not write kept its contents. FP8 codes are compared with the
    reference's scaled values cast by the interpreter itself: its FP8 cast is not CUDA's (it can land a
    binade low where rounding carries into the exponent), so against torch's codes a few percent differ."""
    got, ref = case.args(), case.args()
    q, q_ref = triton_rope._launch(*got), triton_rope.reference_decode_qk_rope_kv_write(*ref)
    rows = torch.arange(case.query.shape[0])
    written = torch.zeros(case.key_cache.shape[:3], dtype=torch.bool)
    written[rows, :, case.columns] = True
    result = {"q_differ": float((q != q_ref).float().mean()),
              "q_error_ulps": relative_error(q, q_ref.double()) / torch.finfo(q.dtype).eps,
              "untouched_equal": all(torch.equal(a[~written].view(torch.uint8), b[~written].view(torch.uint8))
                                     for a, b in ((got[8], case.key_cache), (got[9], case.value_cache)))}
    roped_k = triton_rope.rope(case.key if case.k_weight is None else triton_rope.rms_norm(
        case.key, case.k_weight, case.eps), case.cos, case.sin)
    for name, cache, cache_ref, x, scale in (("k", got[8], ref[8], roped_k, case.k_scale),
                                            ("v", got[9], ref[9], case.value, case.v_scale)):
        stored = cache[rows, :, case.columns]  # (b, H_kv, D)
        expected = cache_ref[rows, :, case.columns]
        if scale is not None:
            expected = _interpreter_fp8((x.float() / scale).clamp(-448, 448))
        result[f"{name}_differ"] = float((stored.float() != expected.float()).float().mean())
    return result


def _interpreter_fp8(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=FP8)
    _fp8_cast_kernel[(1,)](flat, out, flat.numel(), BLOCK=triton.next_power_of_2(flat.numel()))
    return out.view(x.shape)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_cast_kernel(X, Q, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Q + offs, tl.load(X + offs, mask=offs < n).to(Q.dtype.element_ty), mask=offs < n)


@pytest.fixture(scope="module")
def interpreted(triton_interpreted) -> dict[str, dict]:
    return triton_interpreted({"rope": _INTERPRETED}).json_rows("rope")


@pytest.mark.parametrize("name", ["8b_shape_fp8", "groups3_no_norm", "fp16_d256", "fp32_d16_fp8"])
def test_interpreted_kernel_matches_the_reference(interpreted, name):
    row = interpreted[name]
    assert row["untouched_equal"]
    # only the norm's reduction order and rsqrt differ from torch's: in 16 bits a rare value one ulp off,
    # in float32 (no rounding to absorb it) many values an ulp or so off
    assert row["q_error_ulps"] <= 1.0 and row["k_differ"] < 2e-3 and row["v_differ"] == 0.0
    if name != "fp32_d16_fp8":
        assert row["q_differ"] < 2e-3
    if name == "groups3_no_norm":  # no norm: every step is a correctly rounded product or sum, as torch's
        assert row["q_differ"] == 0.0 and row["k_differ"] == 0.0


def test_interpreted_kernel_in_the_engine(interpreted):
    row = interpreted["engine"]
    assert row["same_tokens"] and row["log_prob_diff"] < 1e-5  # float32 model: reduction order only
    assert row["kernel_runs"] == row["expected_runs"] > 0 and row["reference_runs"] == row["plain_runs"] == 0


@pytest.mark.parametrize("name", ["v_tiles_fp8", "v_tiles_bf16"])
def test_interpreted_kernel_writes_v_tiles_as_rows(interpreted, name):
    assert interpreted[name] == {"q_equal": True, "k_equal": True, "v_equal": True}
