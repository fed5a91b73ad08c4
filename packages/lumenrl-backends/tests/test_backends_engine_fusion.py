"""Projection fusion (q/k/v, gate/up) and the overlapped host sync of the native engine.

Fused engines must generate what unfused engines generate (tokens exactly, log-probs to fp32
rounding) and what the training forward scores; weight sync through the existing path must land
in the fused storage; FP8 rollout must fuse the quantized linears and requantize into them; the
speculative next step (overlapped host sync) must keep tokens and log-probs bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine, fusion
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc", "x+y", "hello there", "42"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 10, "seed": 3, "ignore_eos": True}


def prompt_batch(tokenizer, prompts=PROMPTS) -> DataProto:
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def forward_log_probs(model, out: DataProto) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    return torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(2, out.batch["responses"][..., None]).squeeze(-1)


def engine(path, **kwargs) -> NativeEngine:
    model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32")
    return NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=48, **kwargs)


def assert_same(a: DataProto, b: DataProto, atol: float = 1e-5) -> None:
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert (a.batch["rollout_log_probs"] - b.batch["rollout_log_probs"]).abs().max() <= atol


def perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def fused_calls(monkeypatch) -> dict[str, int]:
    calls = {"dense": 0, "quantized": 0}
    for kind, cls in (("dense", fusion._FusedDense), ("quantized", fusion._FusedQuantized)):
        original = cls.__call__

        def counted(self, x, _original=original, _kind=kind):
            calls[_kind] += 1
            return _original(self, x)

        monkeypatch.setattr(cls, "__call__", counted)
    return calls


FAMILIES = {
    "llama": {"attention_bias": True, "mlp_bias": True},  # biases are fused too
    "qwen3": {},
    "qwen3_moe": {},  # MoE experts: attention fused only
    "mixtral": {},
    "deepseek_v3": {},  # MLA attention left alone; dense and shared-expert MLPs fused
}
# family -> (fused attentions, fused MLPs) per layer of the 2-layer tiny model
EXPECTED_ATTENTION = {"llama": 2, "qwen3": 2, "qwen3_moe": 2, "mixtral": 2}


def gated_mlps(model: torch.nn.Module) -> int:
    """Modules holding gate_proj and up_proj linears: dense MLPs, and per-expert MLPs where the installed
    transformers keeps experts as modules (fused expert tensors in transformers 5 have none)."""
    return sum(
        isinstance(getattr(m, "gate_proj", None), torch.nn.Linear) and isinstance(getattr(m, "up_proj", None), torch.nn.Linear)
        for m in model.modules()
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_equals_unfused_and_training_forward(family, tiny_model_dir, monkeypatch):
    path = tiny_model_dir(family, initializer_range=0.2, **FAMILIES[family])
    plain = engine(path, kernels=KernelOptions(fuse_projections=False))
    fused = engine(path)
    layers = plain.model.config.num_hidden_layers
    report = fused.fusion_report
    assert not report.skipped
    if family in EXPECTED_ATTENTION:
        assert len(report.attention) == EXPECTED_ATTENTION[family] and layers == 2
        assert len(report.mlp) == gated_mlps(plain.model)
    else:
        assert not report.attention and report.mlp  # deepseek_v3
    # names, shapes and values unchanged; q/k/v share one storage
    assert list(fused.model.state_dict()) == list(plain.model.state_dict())
    for name, value in plain.model.state_dict().items():
        assert torch.equal(fused.model.state_dict()[name], value), name
    for name in report.attention + report.mlp:
        module = fused.model.get_submodule(name)
        members = [getattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if hasattr(module, p)]
        storages = {m.weight.untyped_storage().data_ptr() for m in members}
        assert storages == {module._lumenrl_fused.weight.untyped_storage().data_ptr()}
    calls = fused_calls(monkeypatch)
    tokenizer = fused.tokenizer
    for params in (GREEDY, SAMPLED):
        a = fused.generate(prompt_batch(tokenizer), params)
        b = plain.generate(prompt_batch(tokenizer), params)
        assert_same(a, b)
        mask = a.batch["response_mask"].bool()
        assert (forward_log_probs(plain.model, a) - a.batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    # fused GEMMs every forward runs (per-expert MLPs, where transformers keeps them, run only when routed to)
    groups = len(report.attention) + sum(".experts." not in name for name in report.mlp)
    assert calls["dense"] >= groups * 2 * GREEDY["max_new_tokens"]  # every prefill and decode step, both runs


def test_gradients_reach_fused_parameters(qwen3_dir):
    """A gradient-enabled forward of the fused model runs the original modules on the views."""
    path = qwen3_dir
    fused = engine(path)
    model = fused.model
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids).logits.sum().backward()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.grad is not None and mlp.up_proj.weight.grad is not None
    assert attn.q_proj.weight.grad.abs().sum() > 0


def test_weight_update_writes_the_fused_storage(qwen3_dir):
    path = qwen3_dir
    fused = engine(path)
    batch = prompt_batch(fused.tokenizer)
    before = fused.generate(batch, GREEDY)
    new = perturbed(fused.model, 0.05, seed=1)
    assert fused.update_weights(new, version=1) == len(new)
    attn, mlp = fused.model.model.layers[1].self_attn, fused.model.model.layers[1].mlp
    q, k, v = (new[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(attn._lumenrl_fused.weight, torch.cat([q, k, v]))
    gate, up = new["model.layers.1.mlp.gate_proj.weight"], new["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(mlp._lumenrl_fused.weight, torch.cat([gate, up]))
    fresh_model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32")
    fresh_model.load_state_dict(new, strict=False)
    fresh = NativeEngine(fresh_model, tokenizer, max_batch_size=8, max_seq_len=48)
    for params in (GREEDY, SAMPLED):
        after = fused.generate(batch, params)
        assert_same(after, fresh.generate(batch, params), atol=0.0)
    assert not torch.equal(fused.generate(batch, GREEDY).batch["responses"], before.batch["responses"])


@pytest.fixture(scope="module")
def quant_dir(tiny_model_dir):
    # 128-wide q/k/v and gate/up so whole 128x128 FP8 blocks are fused (k/v: 4 heads x 32)
    return tiny_model_dir("qwen3", initializer_range=0.1, hidden_size=128, intermediate_size=256, head_dim=32,
                          num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_row", "fp8_w8a16", "mxfp8"])
def test_fp8_fusion_matches_unfused_and_requantizes_in_place(quant_dir, scheme, monkeypatch):
    """Projection fusion alone changes no number (the FP8 SwiGLU MLP, which does, is tested below)."""
    plain = engine(quant_dir, quant_scheme=scheme, kernels=KernelOptions(fuse_projections=False))
    fused = engine(quant_dir, quant_scheme=scheme, kernels=KernelOptions(fuse_fp8_mlp=False, fp8_norm_quant=False))
    layers = plain.model.config.num_hidden_layers
    assert len(fused.fusion_report.attention) == layers and len(fused.fusion_report.mlp) == layers
    assert not fused.fusion_report.mlp_fp8
    calls = fused_calls(monkeypatch)
    batch = prompt_batch(fused.tokenizer)
    for params in (GREEDY, SAMPLED):
        assert_same(fused.generate(batch, params), plain.generate(batch, params), atol=1e-5)
    assert calls["quantized"] > 0 and calls["dense"] == 0
    new = perturbed(plain.model, 0.05, seed=2)
    new = {n: t for n, t in new.items() if "weight_scale" not in n}
    fused.update_weights(new, version=1)  # requantize-on-sync lands in the fused buffers
    plain.update_weights(new, version=1)
    attn = fused.model.model.layers[0].self_attn
    member = plain.model.model.layers[0].self_attn
    assert torch.equal(attn._lumenrl_fused.linear.weight.float(),
                       torch.cat([member.q_proj.weight, member.k_proj.weight, member.v_proj.weight]).float())
    for params in (GREEDY, SAMPLED):
        assert_same(fused.generate(batch, params), plain.generate(batch, params), atol=1e-5)


def test_fp8_row_swiglu_mlp_runs_at_decode_and_follows_weight_sync(quant_dir, monkeypatch):
    """``fp8_row`` MLPs take lumenrl-quant's fused SwiGLU (1 x 128 group scales on the down
    input): its log-probs stay within FP8 noise of the per-token engine and of the float32 model, and
    after a weight sync it generates exactly what an engine built from the new weights generates."""
    from lumenrl_quant import fused_mlp

    per_token = engine(quant_dir, quant_scheme="fp8_row")  # the default: per-token scales
    assert not per_token.fusion_report.mlp_fp8
    assert len(per_token.fusion_report.mlp_fp8_token) == per_token.model.config.num_hidden_layers
    fused = engine(quant_dir, quant_scheme="fp8_row", kernels=KernelOptions(fuse_fp8_mlp=True))
    layers = fused.model.config.num_hidden_layers
    assert len(fused.fusion_report.mlp_fp8) == layers and not fused.fusion_report.mlp_fp8_skipped
    calls = []
    original = fused_mlp.swiglu_mlp_fp8
    monkeypatch.setattr(fused_mlp, "swiglu_mlp_fp8", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    batch = prompt_batch(fused.tokenizer)
    a = fused.generate(batch, GREEDY)
    assert len(calls) >= layers * GREEDY["max_new_tokens"]  # prefill and every decode step, every layer
    b = per_token.generate(batch, GREEDY)
    mask = a.batch["response_mask"].bool()
    model32, _ = load_model_and_tokenizer(str(quant_dir), dtype="float32")
    gap_fused = (forward_log_probs(model32, a) - a.batch["rollout_log_probs"])[mask].abs().mean()
    gap_token = (forward_log_probs(model32, b) - b.batch["rollout_log_probs"])[mask].abs().mean()
    assert 0 < gap_fused < 1.25 * gap_token + 1e-2, (gap_fused, gap_token)  # same FP8 noise as per-token scales
    new = {n: t for n, t in perturbed(model32, 0.05, seed=2).items()}
    fused.update_weights(new, version=1)
    model32.load_state_dict(new)
    fresh_dir = quant_dir.parent / "fresh_swiglu"
    model32.save_pretrained(fresh_dir)
    fused.tokenizer.save_pretrained(fresh_dir)
    fresh = engine(fresh_dir, quant_scheme="fp8_row", kernels=KernelOptions(fuse_fp8_mlp=True))
    for params in (GREEDY, SAMPLED):
        assert_same(fused.generate(batch, params), fresh.generate(batch, params), atol=1e-5)


def test_fp8_row_mlp_activation_kernel_is_the_unfused_math(quant_dir, monkeypatch):
    """The default ``fp8_row`` MLP (SiLU * up and the per-token quantization of the down input in one
    lumenrl-quant kernel) computes what the plain modules compute (float32 model: the same numbers),
    at prefill and every decode step; ``fp8_act_kernel=False`` keeps the modules' own ops."""
    from lumenrl_quant import fused_mlp

    kernel = engine(quant_dir, quant_scheme="fp8_row", kernels=KernelOptions(fp8_norm_quant=False))
    plain = engine(quant_dir, quant_scheme="fp8_row", kernels=KernelOptions(fp8_act_kernel=False))
    layers = kernel.model.config.num_hidden_layers
    assert len(kernel.fusion_report.mlp_fp8_token) == layers and not plain.fusion_report.mlp_fp8_token
    calls = []
    original = fused_mlp.swiglu_mlp_fp8_tokenwise
    monkeypatch.setattr(fused_mlp, "swiglu_mlp_fp8_tokenwise",
                        lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    batch = prompt_batch(kernel.tokenizer)
    for params in (GREEDY, SAMPLED):
        out = kernel.generate(batch, params)
        assert_same(out, plain.generate(batch, params), atol=1e-5)
    assert len(calls) >= 2 * layers * GREEDY["max_new_tokens"]  # only the kernel engine calls it
    mixed = engine(quant_dir, quant_scheme="fp8_block")  # not per-token activations: left alone
    assert not mixed.fusion_report.mlp_fp8_token


def test_fp8_attention_output_feeds_o_proj_as_codes(quant_dir, monkeypatch):
    """FP8 cache + ``fp8_row``: decode attention hands ``o_proj`` FP8 codes scaled by the layer's V
    scale (``fp8_attn_out``, default on). Its log-probs stay within FP8 noise of the engine that
    requantizes the output per token, and of the float32 model."""
    from lumenrl_quant import QuantizedLinear
    engines = {}
    for fp8_out in (True, False):
        engines[fp8_out] = engine(quant_dir, kv_cache_dtype="fp8", quant_scheme="fp8_row", kernels=KernelOptions(fp8_attn_out=fp8_out))
    layers = engines[True].model.config.num_hidden_layers
    assert len(engines[True].fusion_report.attention_fp8_out) == layers
    assert not engines[False].fusion_report.attention_fp8_out
    o_projs = {id(layer.self_attn.o_proj) for e in engines.values() for layer in e.model.model.layers}
    calls = {True: 0, False: 0}
    original = QuantizedLinear.forward_quantized

    def counted(self, a_q, a_scale, out_dtype):
        if id(self) in o_projs:
            calls[current] += 1
        return original(self, a_q, a_scale, out_dtype)

    monkeypatch.setattr(QuantizedLinear, "forward_quantized", counted)
    batch = prompt_batch(engines[True].tokenizer)
    params = {"temperature": 0.0, "max_new_tokens": 8}
    current = True
    out = engines[True].generate(batch, params)
    current = False
    ref = engines[False].generate(batch, params)
    assert calls[True] >= layers * (params["max_new_tokens"] - 1) and calls[False] == 0  # every decode step
    model32, _ = load_model_and_tokenizer(str(quant_dir), dtype="float32")
    mask = out.batch["response_mask"].bool()
    gap = (forward_log_probs(model32, out) - out.batch["rollout_log_probs"])[mask].abs().mean()
    gap_ref = (forward_log_probs(model32, ref) - ref.batch["rollout_log_probs"])[mask].abs().mean()
    assert 0 < gap < 1.5 * gap_ref + 1e-2, (gap, gap_ref)  # 0.144 vs 0.152 measured (MHA model: SDPA path)


def test_fp8_norms_hand_their_consumers_fp8_input(quant_dir, monkeypatch):
    """``fp8_norm_quant`` (default): each decoder layer's RMSNorms emit the per-token FP8 input of
    q/k/v and gate/up (lumenrl-quant ``rmsnorm_quantize_fp8``) at prefill and every decode step. The
    log-probs stay within FP8 noise of the engine that quantizes the normalised rows (the same
    quantization up to float32 rounding), and training-mode forwards run the HF layer unchanged."""
    import lumenrl_quant

    on = engine(quant_dir, quant_scheme="fp8_row")
    off = engine(quant_dir, quant_scheme="fp8_row", kernels=KernelOptions(fp8_norm_quant=False))
    layers = on.model.config.num_hidden_layers
    assert len(on.fusion_report.layers_fp8_norm) == layers and not off.fusion_report.layers_fp8_norm
    assert not engine(quant_dir, quant_scheme="fp8_block").fusion_report.layers_fp8_norm  # 1 x 128 groups: no
    calls = []
    original = lumenrl_quant.rmsnorm_quantize_fp8
    monkeypatch.setattr(lumenrl_quant, "rmsnorm_quantize_fp8", lambda *a, **k: calls.append(1) or original(*a, **k))
    batch = prompt_batch(on.tokenizer)
    a = on.generate(batch, GREEDY)
    assert len(calls) >= 2 * layers * GREEDY["max_new_tokens"]
    b = off.generate(batch, GREEDY)
    mask = a.batch["response_mask"].bool()
    model32, _ = load_model_and_tokenizer(str(quant_dir), dtype="float32")
    gap_on = (forward_log_probs(model32, a) - a.batch["rollout_log_probs"])[mask].abs().mean()
    gap_off = (forward_log_probs(model32, b) - b.batch["rollout_log_probs"])[mask].abs().mean()
    assert 0 < gap_on < 1.25 * gap_off + 1e-2, (gap_on, gap_off)
    # a gradient-enabled forward of the same (fused) model is the HF layer: the trainer's numbers
    ids = batch.batch["input_ids"][:2]
    with torch.enable_grad():
        fused_logits = on.model(input_ids=ids).logits
    calls.clear()
    with torch.no_grad():
        plain_logits = on.model(input_ids=ids).logits  # no engine cache: the HF forward as well
    assert not calls and torch.allclose(fused_logits, plain_logits, atol=1e-5)


def test_per_tensor_fp8_is_left_unfused(quant_dir):
    fused = engine(quant_dir, quant_scheme="fp8_tensor")
    assert fused.fusion_report.fused == 0
    assert all("not row-aligned" in why for why in fused.fusion_report.skipped.values())
    out = fused.generate(prompt_batch(fused.tokenizer), GREEDY)
    assert out.batch["responses"].shape == (len(PROMPTS), GREEDY["max_new_tokens"])


def test_block_fp8_with_unaligned_heads_is_left_unfused(tiny_model_dir):
    path = tiny_model_dir("qwen3", initializer_range=0.1, hidden_size=128, intermediate_size=256, head_dim=32,
                          num_attention_heads=4, num_key_value_heads=2)
    fused = engine(path, quant_scheme="fp8_block")
    assert not fused.fusion_report.attention and len(fused.fusion_report.mlp) == 2  # k/v: 64 rows of 128-blocks


@pytest.mark.parametrize("rows", [64, 192])
def test_block_fp8_members_with_partial_blocks_are_not_fused(rows):
    """Members of equal N that is not a multiple of 128 (e.g. q/k/v of 64 rows each) have equal
    rows-per-scale-row, but their partial 128-row blocks cannot be concatenated."""
    from torch import nn

    from lumenrl_quant import QuantizedLinear

    torch.manual_seed(0)
    members = [QuantizedLinear.from_linear(nn.Linear(256, rows, bias=False), "fp8_block") for _ in range(3)]
    assert isinstance(fusion._fuse_group(members), str)
    aligned = [QuantizedLinear.from_linear(nn.Linear(256, 128 * n, bias=False), "fp8_block") for n in (2, 1, 1)]
    x = torch.randn(4, 256)
    expected = [m(x) for m in aligned]
    fused = fusion._fuse_group(aligned)
    assert not isinstance(fused, str)
    for got, want in zip(fused(x), expected):
        assert torch.equal(got, want)


def test_speculative_step_keeps_results_bit_identical(qwen3_dir):
    """Rows stop at different steps (stop tokens, max_seq_len): the overlapped loop discards
    over-generated tokens and rolls back steps whose shape changed; results equal the synchronous loop."""
    path = qwen3_dir
    sync = engine(path, kernels=KernelOptions(overlap_sync=False))
    overlap = engine(path)
    batch = prompt_batch(sync.tokenizer)
    probe = sync.generate(batch, {**SAMPLED, "max_new_tokens": 24})
    tokens = probe.batch["responses"][:, 2:].flatten().tolist()
    stops = sorted(set(tokens), key=tokens.count)[-3:]  # frequent tokens: rows finish at scattered steps
    for params in (
        {**SAMPLED, "max_new_tokens": 24, "stop_token_ids": stops},
        {**GREEDY, "max_new_tokens": 24, "stop_token_ids": stops[:1]},
        {**SAMPLED, "max_new_tokens": 40},  # hits max_seq_len=48 for the longer prompts
    ):
        a, b = overlap.generate(batch, params), sync.generate(batch, params)
        assert_same(a, b, atol=0.0)
        assert list(a.non_tensor_batch["finish_reason"]) == list(b.non_tensor_batch["finish_reason"])
    assert overlap.speculation["launched"] > 0 and overlap.speculation["rolled_back"] > 0
    assert sync.speculation["launched"] == 0


def test_no_step_is_speculated_past_every_rows_last_token(qwen3_dir):
    """Every row stops at its length cap: the overlapped loop queues a step ahead on every decode step but the
    last (that step would only be discarded and waited for), with results equal to the synchronous loop;
    a per-row cap (``max_new_tokens`` column) shorter than the sampling's counts as the row's last token."""
    sync, overlap = engine(qwen3_dir, kernels=KernelOptions(overlap_sync=False)), engine(qwen3_dir)
    batch = prompt_batch(sync.tokenizer)
    for new in (2, 9):
        before = overlap.speculation["launched"]
        params = {**SAMPLED, "max_new_tokens": new, "ignore_eos": True}
        assert_same(overlap.generate(batch, params), sync.generate(batch, params), atol=0.0)
        assert overlap.speculation["launched"] - before == new - 2  # decode steps 2..new-1 ran queued ahead
    batch["max_new_tokens"] = np.full(len(batch), 5, dtype=np.int64)  # each row's own cap
    before = overlap.speculation["launched"]
    out = overlap.generate(batch, {**SAMPLED, "max_new_tokens": 9, "ignore_eos": True})
    assert (out.batch["response_mask"].sum(1) == 5).all() and overlap.speculation["launched"] - before == 3


def test_interrupt_from_another_thread_with_a_speculative_step_in_flight(qwen3_dir):
    """interrupt() from a second thread while the overlapped loop has a step queued: the queued
    step is dropped, kept tokens are unchanged, and resuming gives the uninterrupted result."""
    import threading

    path = qwen3_dir
    overlap = engine(path)
    batch = prompt_batch(overlap.tokenizer)
    params = {**SAMPLED, "max_new_tokens": 20}
    full = engine(path, kernels=KernelOptions(overlap_sync=False)).generate(batch, params)
    original, steps = overlap._decode, []
    in_flight = []

    def decode_then_interrupt_from_a_thread(*args, **kwargs):
        original(*args, **kwargs)
        steps.append(1)
        if len(steps) == 6:
            in_flight.append(overlap._inflight is not None)
            worker = threading.Thread(target=overlap.interrupt)
            worker.start()
            worker.join()

    overlap._decode = decode_then_interrupt_from_a_thread
    partial = overlap.generate(batch, params)
    assert in_flight == [True] and overlap._inflight is None  # a queued step existed, and was dropped
    assert partial.meta_info["interrupted"] is True
    kept = partial.batch["response_mask"].bool()
    assert int(kept.sum(1).max()) == 7  # prefill token + 6 decode steps
    assert torch.equal(partial.batch["responses"][kept], full.batch["responses"][kept])
    overlap._decode = original
    overlap.resume()
    assert_same(overlap.generate(partial, params), full, atol=1e-5)
    # the rows continued in their kept slots, the queued step's state advance undone first
    assert overlap.kept_slots["reclaimed"] == len(batch)


def test_engines_sharing_a_model_apply_their_own_fusion_setting(qwen3_dir, monkeypatch):
    path = qwen3_dir
    model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32")
    fused = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=48)
    again = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=48)  # already fused: kept, counted
    assert again.fusion_report.fused == fused.fusion_report.fused == 4
    calls = fused_calls(monkeypatch)
    first = again.generate(prompt_batch(tokenizer), GREEDY)
    assert calls["dense"] > 0
    plain = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=48, kernels=KernelOptions(fuse_projections=False))
    calls["dense"] = 0
    assert_same(plain.generate(prompt_batch(tokenizer), GREEDY), first)
    assert calls["dense"] == 0 and type(model.model.layers[0].self_attn).forward is not fusion._attention_forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_fused_and_overlapped_match_reference(qwen3_dir):
    """On the GPU (fp32, CUDA graphs): fused == unfused and overlapped == synchronous decode."""
    path = qwen3_dir

    def gpu_engine(**kwargs) -> NativeEngine:
        model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32")
        return NativeEngine(model, tokenizer, device="cuda", max_batch_size=8, max_seq_len=48, **kwargs)

    reference = gpu_engine(kernels=KernelOptions(fuse_projections=False, overlap_sync=False))
    fused, overlapped = gpu_engine(kernels=KernelOptions(overlap_sync=False)), gpu_engine()
    batch = prompt_batch(reference.tokenizer)
    stops = {"stop_token_ids": [5, 6, 7]}
    for params in (GREEDY, SAMPLED, {**SAMPLED, "max_new_tokens": 24, **stops}):
        ref = reference.generate(batch, params)
        assert_same(fused.generate(batch, params), ref, atol=1e-4)
        assert_same(overlapped.generate(batch, params), fused.generate(batch, params), atol=0.0)
    assert fused.graphs.error is None and overlapped.graphs.error is None and overlapped.graphs.graphs
    assert overlapped.speculation["launched"] > 0
