"""quantize_model on tiny HF Llama / Qwen3 / Qwen3-MoE models; weight-sync reload in place; schemes."""

from __future__ import annotations

import copy
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from lumenrl_quant import (
    QUANT_SCHEMES,
    QuantizedLinear,
    find_decoder_layers,
    get_quant_scheme,
    quantize_model,
    reload_quantized_weights_,
)

transformers = pytest.importorskip("transformers")

# KL(bf16/fp32 || quantized) per token, averaged; measured ~2e-4 (fp8/mxfp8), ~2e-3 (mxfp4)
KL_BARS = {"fp8_block": 2e-3, "fp8_row": 2e-3, "fp8_tensor": 2e-3, "mxfp8": 2e-3, "mxfp4": 2e-2}


def tiny_qwen3(layers: int = 4) -> nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )
    torch.manual_seed(torch.seed() % 2**31)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def tiny_llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = ref_logits.double().log_softmax(-1)
    q = logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3()


@pytest.mark.parametrize("scheme", sorted(KL_BARS))
def test_quantized_qwen3_logits_stay_close(qwen3, scheme):
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = qwen3(ids).logits
        model = copy.deepcopy(qwen3)
        report = quantize_model(model, scheme)
        out = model(ids).logits
    assert report.num_layers == 4 and len(report.quantized) == 4 * 7
    assert report.bytes_after < 0.3 * report.bytes_before
    divergence = kl(ref, out)
    print(f"{scheme}: KL(fp32 || quantized) = {divergence:.2e}")
    assert 0 < divergence < KL_BARS[scheme]


def test_skips_layers_embeddings_lm_head_and_norms(qwen3):
    model = copy.deepcopy(qwen3)
    report = quantize_model(model, "fp8_block", skip_first_n_layers=1, skip_last_n_layers=1)
    assert {int(n.split(".")[2]) for n in report.quantized} == {1, 2}
    assert all(r == "skip_first/last_n_layers" for r in report.skipped.values())
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert not any(isinstance(m, QuantizedLinear) for m in model.model.layers[0].modules())
    report = quantize_model(copy.deepcopy(qwen3), "fp8_row", skip_modules=("lm_head", "o_proj"))
    assert len(report.quantized) == 4 * 6 and all("o_proj" in n for n in report.skipped)


def test_llama_found_and_tied_lm_head_untouched():
    model = tiny_llama()
    path, layers = find_decoder_layers(model)
    assert path == "model.layers" and len(layers) == 3
    quantize_model(model, "mxfp8")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_moe_router_and_fused_experts_are_not_quantized():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    report = quantize_model(model, "fp8_block")
    assert report.quantized and not any(".mlp.gate" in n or "router" in n for n in report.quantized)
    for layer in model.model.layers:
        assert not isinstance(layer.mlp.gate, QuantizedLinear)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (1, 8))).logits).all()


def test_generic_layer_search_and_router_named_linear():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.router, self.norm = nn.Linear(32, 32), nn.Linear(32, 4), nn.LayerNorm(32)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(32, 8)

    net = Net()
    report = quantize_model(net, "fp8_tensor")
    assert report.layers_path == "blocks" and len(report.quantized) == 3
    assert all(report.skipped[f"blocks.{i}.router"] == "moe router" for i in range(3))
    assert type(net.head) is nn.Linear
    with pytest.raises(ValueError, match="no decoder layers"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "fp8_block")


@pytest.mark.parametrize("scheme", ["fp8_block", "mxfp4"])
def test_weight_sync_reload_in_place_matches_fresh_quantization(qwen3, scheme):
    trained = copy.deepcopy(qwen3)
    with torch.no_grad():  # one "policy update"
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine = copy.deepcopy(qwen3)
    quantize_model(engine, scheme)
    ptrs = {n: t.data_ptr() for n, t in engine.state_dict().items()}
    report = reload_quantized_weights_(engine, ((n, t.to(torch.bfloat16)) for n, t in trained.state_dict().items()))
    assert len(report.requantized) == 28 and report.copied and not report.unknown
    assert {n: t.data_ptr() for n, t in engine.state_dict().items()} == ptrs
    fresh = copy.deepcopy(trained).to(torch.bfloat16).float()
    quantize_model(fresh, scheme)
    for (name, a), (_, b) in zip(engine.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b), name
    with pytest.raises(KeyError, match="nope"):
        reload_quantized_weights_(engine, {"nope.weight": torch.zeros(1)})


def test_scheme_plugins_registered_and_usable(qwen3):
    names = {e.name: e for e in entry_points(group="lumenrl.quant_schemes")}
    assert set(QUANT_SCHEMES) <= set(names)
    for name, cls in QUANT_SCHEMES.items():
        spec = names[name].load()  # the torch-free spec in lumenrl_quant.plugin_manifest
        assert spec is cls.plugin_spec and spec.target == f"lumenrl_quant.schemes:{cls.__name__}"
        assert cls.probe() is None and isinstance(cls.capabilities, frozenset)
        assert ("fp8_weights" if name.startswith("fp8") else "mx_weights") in cls.capabilities
        assert cls.fast_path("cpu") == "emulated" and not cls.has_fast_path("cpu")
    scheme = get_quant_scheme("fp8_block", skip_last_n_layers=2)
    model = copy.deepcopy(qwen3)
    assert len(scheme.quantize_model(model).quantized) == 2 * 7
    assert scheme.reload_weights_(model, qwen3.state_dict()).requantized
    with pytest.raises(ValueError, match="fp8_row"):
        get_quant_scheme("fp8_rows")


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4"])
def test_mx_schemes_refuse_an_fp8_dtype_before_swapping_anything(qwen3, scheme):
    model = copy.deepcopy(qwen3)
    with pytest.raises(ValueError, match=f"fp8_dtype=torch.float8_e4m3fn has no effect with scheme='{scheme}'"):
        quantize_model(model, scheme, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype"):  # nothing to swap: refused all the same
        quantize_model(nn.Sequential(), scheme, fp8_dtype=torch.float8_e4m3fn)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="fp8_dtype=torch.float8_e5m2"):
        QUANT_SCHEMES[scheme](fp8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="fp8_dtype"):
        get_quant_scheme(scheme, fp8_dtype=torch.float8_e4m3fn)
    report = QUANT_SCHEMES[scheme]().quantize_model(model)  # unset: quantized as before
    assert len(report.quantized) == 4 * 7 and all(model.get_submodule(n).fp8_dtype is None for n in report.quantized)
    fp8_model = copy.deepcopy(qwen3)
    fp8 = get_quant_scheme("fp8_row", fp8_dtype=torch.float8_e5m2).quantize_model(fp8_model)
    assert {fp8_model.get_submodule(n).weight.dtype for n in fp8.quantized} == {torch.float8_e5m2}  # FP8 reads it


def test_quantize_lm_head_untied_swaps_the_head_and_reloads_it_in_place(qwen3):
    from lumenrl_quant.error import sqnr_db

    model = copy.deepcopy(qwen3)
    report = quantize_model(model, "fp8_row", quantize_lm_head=True)
    assert report.quantized[-1] == "lm_head" and isinstance(model.lm_head, QuantizedLinear)
    assert len(report.quantized) == 4 * 7 + 1 and type(model.model.embed_tokens) is nn.Embedding
    x = torch.randn(6, 128)
    w = qwen3.lm_head.weight.detach()
    with torch.no_grad():
        assert sqnr_db(x.double() @ w.double().t(), model.lm_head(x).double()) >= 25.0  # fp8 scaled_mm bar
        ids = torch.randint(0, 256, (2, 12))
        assert 0 < kl(qwen3(ids).logits, model(ids).logits) < KL_BARS["fp8_row"]
    storage = model.lm_head.weight.data_ptr()
    w2 = torch.randn_like(w) * 0.05  # a new policy's head: requantized into the same buffers
    assert reload_quantized_weights_(model, {"lm_head.weight": w2}).requantized == ["lm_head.weight"]
    assert model.lm_head.weight.data_ptr() == storage
    with torch.no_grad():
        assert sqnr_db(x.double() @ w2.double().t(), model.lm_head(x).double()) >= 25.0


def test_quantize_lm_head_refuses_a_tied_head_before_swapping_anything():
    model = tiny_llama()
    with pytest.raises(ValueError, match="quantize_lm_head=True.*tie_word_embeddings.*Allowed: quantize_lm_head=False"):
        quantize_model(model, "fp8_row", quantize_lm_head=True)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # nothing half-done
    scheme = get_quant_scheme("fp8_row", quantize_lm_head=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        scheme.quantize_model(model)
    report = get_quant_scheme("fp8_row").quantize_model(model)  # the default leaves the head alone
    assert "lm_head" not in report.quantized and type(model.lm_head) is nn.Linear
