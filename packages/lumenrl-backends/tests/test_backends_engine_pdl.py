"""Programmatic dependent launch of the decode RoPE and attention kernels (``engines/triton_pdl.py``).

* CPU: the fusion marks the attentions it fuses (and only under ``pdl``), the mark reaches the RoPE op and
  the attention function, and the attention function takes the keyword without passing it on to SDPA;
* CUDA (skipped elsewhere): one decode layer's kernel chain (RoPE + KV write -> attention -> o GEMM, and
  the FP8 cache's variant) captured in a CUDA graph with PDL edges equals the same chain launched
  plainly, bit for bit, on fresh inputs; and an engine under ``compile="full"`` decodes the same tokens with
  and without PDL.
"""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine, triton_rope
from lumenrl_backends.engines.attention import packed_decode_attention
from lumenrl_backends.engines.fusion import fuse_projections, unfuse_projections
from lumenrl_backends.models import build_tiny_model, load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

HAS_CUDA_TRITON = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc"]


def _tiny(tmp: str, device: str = "cpu"):
    model, tokenizer = load_model_and_tokenizer(build_tiny_model("qwen3", tmp, seed=7), dtype="bfloat16")
    return model.to(device), tokenizer


def _prompts(tokenizer, n: int = len(PROMPTS)) -> DataProto:
    enc = tokenizer(PROMPTS[:n], padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def _attentions(model) -> list:
    return [m for m in model.modules() if type(m).__name__.startswith("Qwen3Attention")]


@pytest.mark.parametrize("pdl", [True, False])
def test_fusion_marks_attentions_for_pdl(pdl):
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = _tiny(tmp)
        report = fuse_projections(model, pdl=pdl)
        attentions = _attentions(model)
        assert len(attentions) == len(report.attention) > 0
        assert all(m.__dict__["_lumenrl_pdl"] is pdl for m in attentions)
        unfuse_projections(model)
        assert not any("_lumenrl_pdl" in m.__dict__ for m in _attentions(model))


def test_engine_passes_pdl_to_the_rope_op(monkeypatch):
    """An engine whose attentions are marked hands ``pdl=True`` to the fused RoPE op on every decode step
    (on CPU the op runs its torch reference, so the tokens are those of an unmarked engine)."""
    seen: list[bool] = []
    original = triton_rope.decode_qk_rope_kv_write

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pdl"))
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_rope, "decode_qk_rope_kv_write", spy)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = _tiny(tmp)
        engine = NativeEngine(model, tokenizer, device="cpu", max_batch_size=4, max_seq_len=48, cuda_graphs=False)
        batch = _prompts(tokenizer, 3)
        plain = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
        assert seen and not any(seen)  # CPU: pdl_supported is False, so the engine never asks for it
        for module in _attentions(engine.model):
            module.__dict__["_lumenrl_pdl"] = True
        seen.clear()
        marked = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
    assert seen and all(seen)
    assert torch.equal(plain.batch["responses"], marked.batch["responses"])


def test_attention_function_takes_the_pdl_keyword():
    """``lumenrl_pdl`` is consumed, never handed to SDPA (which would refuse it), and changes no value."""
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 8, 1, 16, generator=gen)
    key, value = torch.randn(2, 2, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    mask = torch.rand(2, 1, 1, 12, generator=gen) > 0.2
    mask[..., -1] = True
    module = torch.nn.Module()
    module.is_causal = False
    plain, _ = packed_decode_attention(module, query, key, value, mask)
    marked, _ = packed_decode_attention(module, query, key, value, mask, lumenrl_pdl=True)
    assert torch.equal(plain, marked)


# ------------------------------------------------------------------ CUDA
def _layer_chain(fp8: bool, layers: int = 4, seed: int = 0):
    """Inputs of ``layers`` decode layers at Qwen3-8B's head shapes (batch 64, 32 / 8 heads, D 128, 320 of 512
    cache columns) and a function running each layer's RoPE + KV write -> attention -> o GEMM chain."""
    from lumenrl_backends.engines import triton_attention as ta
    from lumenrl_backends.engines import triton_linear as tlin

    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(seed)
    b, heads, kv_heads, dim, cols, length = 64, 32, 8, 128, 512, 320
    cache_dtype = torch.float8_e4m3fn if fp8 else bf16
    k_scale = v_scale = torch.full((1,), 0.05, device=dev) if fp8 else None
    state = {
        "qkv": torch.randn(b, (heads + 2 * kv_heads) * dim, device=dev, generator=gen, dtype=bf16),
        "cos": torch.randn(b, dim, device=dev, generator=gen, dtype=bf16),
        "sin": torch.randn(b, dim, device=dev, generator=gen, dtype=bf16),
        "q_w": torch.rand(dim, device=dev, generator=gen, dtype=bf16) + 0.5,
        "k_w": torch.rand(dim, device=dev, generator=gen, dtype=bf16) + 0.5,
        "o": [torch.randn(heads * dim, heads * dim, device=dev, generator=gen, dtype=bf16) / 64 for _ in range(layers)],
        "caches": [tuple((torch.randn(b, kv_heads, cols, dim, device=dev, generator=gen) * 0.5).to(cache_dtype)
                         for _ in range(2)) for _ in range(layers)],
        "columns": torch.full((b,), length - 1, device=dev, dtype=torch.int64),
    }
    allowed = torch.arange(cols, device=dev)[None, :] < length
    allowed = allowed.expand(b, cols).contiguous()

    def run(pdl: bool) -> torch.Tensor:
        h = state["qkv"]
        out = None
        for (k_cache, v_cache), o_weight in zip(state["caches"], state["o"]):
            q, k, v = h.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            query = triton_rope.decode_qk_rope_kv_write(
                q.view(b, heads, dim), k.view(b, kv_heads, dim), v.view(b, kv_heads, dim), state["cos"], state["sin"],
                k_cache, v_cache, state["columns"], q_weight=state["q_w"], k_weight=state["k_w"], k_scale=k_scale,
                v_scale=v_scale, pdl=pdl)
            attended = ta.gqa_decode_attention(query.view(b, kv_heads, heads // kv_heads, dim), k_cache, v_cache,
                                               allowed, dim ** -0.5, k_scale, v_scale, last=state["columns"], pdl=pdl)
            out = tlin.decode_linear(attended.reshape(b, heads * dim), o_weight, pdl=pdl)
            h = torch.cat([out, h[:, heads * dim:]], dim=-1)  # the next layer's q from this layer's o
        return out

    return state, run


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_layer_chain_with_pdl_in_a_graph_equals_plain_launches(fp8):
    from lumenrl_backends.engines.triton_pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    state, run = _layer_chain(fp8)
    gen = torch.Generator(device="cuda").manual_seed(11)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(True)
    first = None
    for _ in range(3):
        state["qkv"].copy_(torch.randn(state["qkv"].shape, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        assert torch.equal(replayed, run(False))  # the cache writes are idempotent: same column, same values
        assert first is None or not torch.equal(replayed, first)  # the inputs did change
        first = replayed


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs CUDA and Triton")
def test_cuda_engine_with_and_without_pdl():
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pdl in (False, True):
            torch._dynamo.reset()
            model, tokenizer = _tiny(tmp, device="cuda")
            engine = NativeEngine(model, tokenizer, device="cuda", max_batch_size=8, max_seq_len=64, compile="full",
                                  kernels=KernelOptions(pdl=pdl))
            assert all(m.__dict__["_lumenrl_pdl"] is pdl for m in _attentions(engine.model))
            batch = _prompts(tokenizer)
            rows[pdl] = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    assert torch.equal(rows[False].batch["responses"], rows[True].batch["responses"])
    diff = (rows[False].batch["rollout_log_probs"] - rows[True].batch["rollout_log_probs"]).abs().max()
    assert float(diff) < 1e-3  # the same kernels in the same order: PDL changes when they start, not what they do


def test_quantized_linears_join_the_pdl_chain(monkeypatch):
    """Every lumenrl-quant linear of an FP8 engine gets the engine's PDL choice, the fused q/k/v and gate/up
    ones too (held by their modules, not registered submodules); it reaches the GEMM call."""
    from lumenrl_backends.engines.quant import set_quantized_pdl
    from lumenrl_quant import QuantizedLinear, gemm

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = _tiny(tmp)
        engine = NativeEngine(model, tokenizer, device="cpu", max_batch_size=4, max_seq_len=48, cuda_graphs=False,
                              quant_scheme="fp8_row")
        layers = engine.model.config.num_hidden_layers
        registered = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
        assert registered and not any(m.pdl for m in registered)  # CPU: the engine's choice is off
        assert set_quantized_pdl(engine.model, True) == len(registered) + 2 * layers  # + fused q/k/v, gate/up
        assert all(m.pdl for m in registered)
        seen: list[bool] = []
        original = gemm.run_gemm_path

        def spy(*args, **kwargs):
            seen.append(kwargs.get("pdl"))
            return original(*args, **kwargs)

        import lumenrl_quant.linear as qlinear

        monkeypatch.setattr(qlinear, "run_gemm_path", spy)
        linear = registered[0]
        linear(torch.randn(3, linear.in_features, dtype=torch.bfloat16))
        assert seen == [True]
        assert set_quantized_pdl(engine.model, True, 2048) == len(registered) + 2 * layers
        assert all(m.pdl_prefetch == 2048 for m in registered)
        prefetches: list[int] = []
        monkeypatch.setattr(qlinear, "run_gemm_path", lambda *a, **k: prefetches.append(k["pdl_prefetch"]) or original(*a, **k))
        linear(torch.randn(3, linear.in_features, dtype=torch.bfloat16))
        assert prefetches == [2048]
        assert not any(m.tma for m in registered)  # KernelOptions.tma: off unless asked
        assert set_quantized_pdl(engine.model, True, tma=True) == len(registered) + 2 * layers
        assert all(m.tma for m in registered)
        asked: list[bool] = []
        monkeypatch.setattr(qlinear, "run_gemm_path", lambda *a, **k: asked.append(k["tma"]) or original(*a, **k))
        linear(torch.randn(3, linear.in_features, dtype=torch.bfloat16))
        assert asked == [True]


def test_pdl_prefetch_reaches_every_decode_gemm_and_bad_values_are_refused(monkeypatch):
    """``KernelOptions.pdl_prefetch`` (bytes per weight row): an FP8 engine's quantized linears get it, the fused
    modules' 16-bit decode GEMMs get it in weight columns (their default without it); a negative or non-int
    value is refused before the model is touched, naming the key."""
    from lumenrl_backends.engines import triton_linear
    from lumenrl_quant import QuantizedLinear

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = _tiny(tmp)
        for key in ("pdl_prefetch", "pdl_prefetch_second"):
            for bad in (-1, 1.5, "4k"):
                with pytest.raises(ValueError, match=rf"kernels.{key}=.*allowed: None or an int >= 0"):
                    NativeEngine(model, tokenizer, device="cpu", max_batch_size=2, max_seq_len=16,
                                 kernels=KernelOptions(**{key: bad}))
        engine = NativeEngine(model, tokenizer, device="cpu", max_batch_size=2, max_seq_len=16, cuda_graphs=False,
                              quant_scheme="fp8_row", kernels=KernelOptions(pdl_prefetch=4096))
        quantized = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
        assert quantized and all(m.pdl_prefetch == 4096 for m in quantized)
    with tempfile.TemporaryDirectory() as tmp:  # the second GEMMs (o_proj, down_proj) take their own amount
        model, tokenizer = _tiny(tmp)
        engine = NativeEngine(model, tokenizer, device="cpu", max_batch_size=2, max_seq_len=16, cuda_graphs=False,
                              quant_scheme="fp8_row", kernels=KernelOptions(pdl_prefetch=1024, pdl_prefetch_second=8192))
        named = dict(engine.model.named_modules())
        second = {n for n in named if n.rsplit(".", 1)[-1] in ("o_proj", "down_proj")}
        fused = [m.__dict__["_lumenrl_fused"].linear for m in named.values() if "_lumenrl_fused" in m.__dict__]
        assert second and all(named[n].pdl_prefetch == 8192 for n in second)
        assert len(fused) == 2 * model.config.num_hidden_layers and all(m.pdl_prefetch == 1024 for m in fused)
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = _tiny(tmp)
        monkeypatch.setattr(triton_linear, "weight_reason", lambda *a, **k: None)  # CPU: let the fusion route them
        try:
            default = triton_linear.PDL_PREFETCH
            for given, columns in ((None, (default, default)), (4096, (2048, 2048)), (0, (0, 0)),
                                   ((None, 8192), (default, 4096)), ((2048, 0), (1024, 0))):
                fuse_projections(model, decode_linear="on", pdl=True, pdl_prefetch=given)
                routed = [m.__dict__["_lumenrl_decode_linear"] for m in model.modules()
                          if m.__dict__.get("_lumenrl_decode_linear") is not None]
                assert len(routed) == 2 * model.config.num_hidden_layers
                assert all(d.pdl and d.prefetch == columns for d in routed)
            calls: list[tuple[bool, int]] = []  # the MLP's forward: gate/up (SwiGLU) takes the first, down the second
            monkeypatch.setattr(triton_linear, "decode_linear", lambda x, w, b, **k: calls.append((k["swiglu"], k["prefetch"]))
                                or triton_linear.reference_decode_linear(x, w, b, swiglu=k["swiglu"]))
            with torch.no_grad():
                model.model.layers[0].mlp(torch.randn(3, model.config.hidden_size, dtype=next(model.parameters()).dtype))
            assert calls == [(True, 1024), (False, 0)]
        finally:
            unfuse_projections(model)


def test_engine_ops_run_their_implementation_eagerly_and_the_registered_op_under_compile(monkeypatch):
    """Eager and under CUDA graph capture the decode ops call their implementation directly: torch.library's
    dispatch took more host time than the launch (~0.3 ms a call in a capture pass on an H100), and an engine
    pays a pass per captured graph. Registered ops that raise change nothing in an eager engine's tokens or a
    direct call's result (float64); ``torch.compile`` still traces the registered op (opaque, with its fake)."""
    from lumenrl_backends.engines import triton_attention, triton_linear

    def refuse(*args, **kwargs):
        raise AssertionError("the registered op was called outside torch.compile")

    torch.manual_seed(11)
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = _tiny(tmp)
        engine = NativeEngine(model, tokenizer, device="cpu", max_batch_size=4, max_seq_len=48, cuda_graphs=False)
        batch, params = _prompts(tokenizer, 3), {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
        plain = engine.generate(batch, params)
        for module, name in ((triton_rope, "_OP"), (triton_linear, "_OP"), (triton_attention, "_OP"),
                             (triton_attention, "_OP_FP8")):
            monkeypatch.setattr(module, name, refuse)
        direct = engine.generate(batch, params)
        assert torch.equal(plain.batch["responses"], direct.batch["responses"])
        assert torch.allclose(triton_linear.decode_linear(x, w), x @ w.T, rtol=1e-12, atol=1e-12)
    monkeypatch.undo()
    graphs = []

    def backend(gm, inputs):  # noqa: ANN001, ANN202 - a torch.compile backend that keeps the traced graph
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda a, b: triton_linear.decode_linear(a, b), backend=backend, fullgraph=True)(x, w)
    assert torch.allclose(out, x @ w.T, rtol=1e-12, atol=1e-12)
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.lumenrl.decode_linear.default in targets
