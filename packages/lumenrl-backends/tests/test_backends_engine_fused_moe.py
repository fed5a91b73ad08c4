"""Fused MoE experts in the native engine (``policy.rollout.fused_moe``), tiny Qwen3-MoE (8 experts, top-2).

In process (CPU, lumenrl-quant's torch path): modes and reports, names and state dict unchanged, an
unrecognised layout refused under ``on``, FP8 expert buffers requantized in place by ``update_weights``
(equal to a fresh quantization, pointers kept), ``from_config`` reads the key. In a subprocess under
Triton's interpreter (``TRITON_INTERPRET`` must be set before the kernels are decorated): the engine on
the Triton kernel against the unfused engine (HF ``grouped_mm``): fp32 greedy tokens equal; bf16 equal up
to the first position where the reference's top-2 logits are a near-tie at bf16 resolution; FP8 experts:
the engine's log-probs are its own model's and stay close to the full-precision model's (the bound of the
FP8 linear tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.engines import KernelOptions, NativeEngine
from lumenrl_backends.models.tiny import tiny_config
from lumenrl_backends.models.tokenizer import build_char_tokenizer
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.data_proto import DataProto
from lumenrl_quant import quantize_experts_fp8

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
EXPERTS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def tiny_moe(dtype: torch.dtype = torch.float32, seed: int = 0):
    config = tiny_config("qwen3_moe", num_local_experts=8, initializer_range=0.2)  # (the tiny family sets this name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def prompts(tokenizer) -> DataProto:
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("1+2=", "13+4=", "7=", "9+9+9=")]
    width = max(len(i) for i in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for r, i in enumerate(ids):
        input_ids[r, width - len(i):], mask[r, width - len(i):] = torch.tensor(i), 1
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask})


def engine(model, mode: str, **kwargs) -> NativeEngine:
    # fused_qk_rope off: under the interpreter its Triton kernel would dominate the test's time
    return NativeEngine(model, build_char_tokenizer(), max_batch_size=4, max_seq_len=32,
                        kernels=KernelOptions(fused_moe=mode, fused_qk_rope=False), **kwargs)


def response_logits(model, out: DataProto) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) of ``model`` at the response positions of ``out``."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"]).logits
    width = out.batch["prompts"].shape[1]
    return logits[:, width - 1:-1].float()


def test_modes_keep_names_and_state_dict_and_switch_the_forward():
    model, pristine = tiny_moe(), tiny_moe()
    names = {n for n, _ in model.named_parameters()}
    keys = set(model.state_dict())
    auto = engine(model, "auto")  # CPU: HF's experts
    assert auto.moe.report.fused == [] and set(auto.moe.report.skipped) == set(EXPERTS)
    on = engine(model, "on")
    assert on.moe.report.fused == list(EXPERTS) and on.moe.report.backend == "torch"
    assert {n for n, _ in model.named_parameters()} == names and set(model.state_dict()) == keys
    assert all("forward" in model.get_submodule(n).__dict__ for n in EXPERTS)
    fused = on.generate(prompts(on.tokenizer), GREEDY)
    engine(model, "off")  # a model fused by an earlier engine runs HF's forward again
    assert not any("forward" in model.get_submodule(n).__dict__ for n in EXPERTS)
    plain = engine(pristine, "off").generate(prompts(on.tokenizer), GREEDY)
    assert torch.equal(fused.batch["responses"], plain.batch["responses"])
    torch.testing.assert_close(fused.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], rtol=0, atol=1e-5)


def test_unrecognised_layout_is_refused_under_on_and_left_to_hf_otherwise():
    model = tiny_moe()
    model.get_submodule(EXPERTS[1]).has_bias = True
    with pytest.raises(ValueError, match=r"experts \(Qwen3MoeExperts\) has has_bias=True"):
        engine(model, "on")
    with pytest.raises(ValueError, match="fused_moe='on' with exact_logprobs"):
        engine(tiny_moe(), "on", exact_logprobs=True)


def test_fp8_experts_requantize_in_place_on_update_weights():
    model = tiny_moe()
    eng = engine(model, "on", quant_scheme="fp8_block")
    assert eng.moe.report.fp8 == list(EXPERTS)
    experts = model.get_submodule(EXPERTS[0])
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and "gate_up_proj" in dict(experts.named_buffers())
    pointers = [experts.gate_up_proj.data_ptr(), experts.gate_up_proj_scale.data_ptr(), experts.down_proj.data_ptr()]
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in tiny_moe().named_parameters()}
    assert eng.update_weights(new.items(), version=3) == len(new)
    assert [experts.gate_up_proj.data_ptr(), experts.gate_up_proj_scale.data_ptr(),
            experts.down_proj.data_ptr()] == pointers
    for name in ("gate_up_proj", "down_proj"):
        codes, scales = quantize_experts_fp8(new[f"{EXPERTS[0]}.{name}"])
        assert torch.equal(getattr(experts, name).view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(getattr(experts, f"{name}_scale"), scales)
    fresh = tiny_moe()
    fresh.load_state_dict(new, strict=False)
    expected = engine(fresh, "on", quant_scheme="fp8_block")
    a, b = eng.generate(prompts(eng.tokenizer), GREEDY), expected.generate(prompts(eng.tokenizer), GREEDY)
    assert torch.equal(a.batch["responses"], b.batch["responses"])


FAMILY_EXPERTS = {"qwen3_moe": {"num_local_experts": 8}, "mixtral": {"num_local_experts": 8},
                  "deepseek_v3": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
                  "glm4_moe": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5}}


@pytest.mark.parametrize("family", sorted(FAMILY_EXPERTS))
def test_every_r3_family_fuses_and_records_the_same_routes(family):
    """The four R3 families' experts are recognised; route recording (the gate patch) is unchanged."""
    config = tiny_config(family, num_hidden_layers=3, initializer_range=0.2, **FAMILY_EXPERTS[family])
    outs = []
    for mode in ("off", "on"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        eng = engine(model, mode, record_routes=True)
        assert not eng.share_prefill  # R3 records routes per prefilled row: no shared prefill
        assert len(eng.moe.report.fused) == (eng.routes.ctl.num_layers if mode == "on" else 0)
        outs.append(eng.generate(prompts(eng.tokenizer), GREEDY))
    assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
    assert torch.equal(outs[0].batch["routed_experts"], outs[1].batch["routed_experts"])


def test_from_config_reads_fused_moe():
    from lumenrl_core.config.schema import RunConfig

    config = RunConfig()
    config.cluster.device = "cpu"
    config.policy.rollout.max_batch_size = 4
    for mode, fused in (("on", list(EXPERTS)), ("off", [])):
        config.policy.rollout.fused_moe = mode
        built = NativeEngine.from_config(config, model=tiny_moe(), tokenizer=build_char_tokenizer())
        assert built.moe.report.fused == fused


SCRIPT = textwrap.dedent(
    """
    import torch
    from test_backends_engine_fused_moe import GREEDY, engine, prompts, response_logits, tiny_moe
    from lumenrl_backends.models.tokenizer import build_char_tokenizer

    batch, GREEDY = prompts(build_char_tokenizer()), {**GREEDY, "max_new_tokens": 5}  # interpreted: short
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_moe(dtype)
        plain = engine(tiny_moe(dtype), "off").generate(batch, GREEDY)
        fused_engine = engine(tiny_moe(dtype), "on")
        assert fused_engine.moe.report.backend == "triton"
        fused = fused_engine.generate(batch, GREEDY)
        a, b = plain.batch["responses"], fused.batch["responses"]
        if dtype == torch.float32:
            assert torch.equal(a, b), (a, b)
            assert (plain.batch["rollout_log_probs"] - fused.batch["rollout_log_probs"]).abs().max() < 1e-4
            continue
        # bf16: the two round differently (the fused kernel once per product, HF per GEMM): equal tokens up to
        # a position where the reference's top-2 logits are within 4 bf16 ulps (~0.06 at these logits)
        top2 = response_logits(model, plain).topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]
        for row in range(a.shape[0]):
            diff = (a[row] != b[row]).nonzero()
            if diff.numel():
                j = int(diff[0])
                assert margin[row, j] <= 0.0625, (row, j, margin[row])
        assert (a == b).float().mean() >= 0.5, (a, b)
    # FP8 experts on the kernel (fp8_block linears too): self-consistent, close to the full-precision model
    model = tiny_moe()
    fp8 = engine(tiny_moe(), "on", quant_scheme="fp8_block")
    assert fp8.moe.report.fp8 and fp8.moe.report.backend == "triton"
    out = fp8.generate(batch, {**GREEDY, "temperature": 1.0, "seed": 0})
    lp = lambda m: torch.log_softmax(response_logits(m, out), -1).gather(2, out.batch["responses"][..., None])[..., 0]
    own = (lp(fp8.model) - out.batch["rollout_log_probs"]).abs()
    gap = (lp(model) - out.batch["rollout_log_probs"]).abs().mean()
    assert own.median() < 1e-5 and 1e-4 < gap < 0.25, (own, gap)  # measured gap ~0.15 (0.13 with bf16 experts)
    # compile="full" traces the patched experts whole (the kernel is one opaque op)
    experts = fp8.model.get_submodule("model.layers.0.mlp.experts")
    assert experts.gate_up_proj.shape[0] == 8
    args = (torch.randn(5, 64), torch.randint(0, 8, (5, 2)), torch.rand(5, 2))
    with torch.no_grad():
        traced = torch.compile(experts.forward, backend="aot_eager", fullgraph=True)(*args)
        assert torch.equal(traced, experts(*args))
    """
)


def test_engine_on_the_triton_kernel_matches_the_unfused_engine_in_the_interpreter():
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_capture_in_cuda_graphs(dtype):
    """On the GPU the fused experts capture in every dtype (HF's grouped_mm only in bf16): graphs on == eager."""
    outs = []
    for graphs in (True, False):
        eng = NativeEngine(tiny_moe(dtype), build_char_tokenizer(), device="cuda", max_batch_size=4,
                           max_seq_len=48, kernels=KernelOptions(fused_moe="on"), cuda_graphs=graphs)
        assert eng.graphs.enabled == graphs and eng.moe.report.backend == "triton"
        outs.append(eng.generate(prompts(eng.tokenizer), {**GREEDY, "max_new_tokens": 16}))
    assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
    assert outs[0].meta_info["perf"]["cuda_graphs"]  # captured, not fallen back to eager
