"""Grouped q/k/v and gate/up GEMMs (training/grouped_linear.py): float64 references, the unfused model, the
single-device backend, and where a group is refused."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.grouped_linear import GroupedLinear, group_projections, ungroup_projections
from lumenrl_backends.training.single_device import SingleDeviceWeights
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

torch.set_num_threads(2)
CPU = torch.device("cpu")


def test_grouped_linear_against_float64():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(3, 7, 48, generator=g)
    flat = torch.randn(40 * 48, generator=g) * 0.1
    weights = [nn.Parameter(flat[a * 48 : b * 48].view(b - a, 48)) for a, b in ((0, 16), (16, 24), (24, 40))]
    fused = flat.view(40, 48)
    xg = x.clone().requires_grad_()
    outs = GroupedLinear.apply(xg, fused, *weights)
    assert [o.shape[-1] for o in outs] == [16, 8, 16]  # one output per member
    y = torch.cat(outs, -1)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    x64 = x.double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    y64 = torch.cat([F.linear(x64, w) for w in w64], -1)
    y64.backward(grad.double())
    bound = 1e-5  # float32 against float64: K = 48 products, |values| ~ 1
    assert (y.double() - y64).abs().max() < bound
    assert (xg.grad.double() - x64.grad).abs().max() < 10 * bound  # sum over 40 output columns
    for w, ref in zip(weights, w64, strict=True):
        assert w.grad.shape == w.shape
        assert (w.grad.double() - ref.grad).abs().max() < 10 * bound  # sum over 21 rows


def test_grouped_linear_with_an_unused_member_output():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    flat = torch.randn(24 * 32, generator=g, dtype=torch.float64)
    weights = [nn.Parameter(flat[a * 32 : b * 32].view(b - a, 32)) for a, b in ((0, 8), (8, 24))]
    xg = x.clone().requires_grad_()
    _, second = GroupedLinear.apply(xg, flat.view(24, 32), *weights)
    grad = torch.randn(second.shape, generator=g, dtype=torch.float64)
    second.backward(grad)
    assert torch.equal(weights[0].grad, torch.zeros_like(weights[0]))  # no gradient reached the unused output
    torch.testing.assert_close(weights[1].grad, grad.t() @ x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xg.grad, grad @ weights[1].detach(), rtol=1e-12, atol=1e-12)


def _flat_model(tiny_qwen3_lm, dtype=torch.float32):
    """A tiny Qwen3 whose weights are views of one flat buffer, as on the single-device path."""
    model = tiny_qwen3_lm(seed=torch.seed() % 2**31)
    reference = copy.deepcopy(model)
    SingleDeviceWeights(model, dtype)
    return model, reference


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_model_matches_unfused(tiny_qwen3_lm, compiled):
    model, reference = _flat_model(tiny_qwen3_lm)
    report = group_projections(model)
    layers = len(model.model.layers)
    assert len(report.grouped) == 2 * layers and not report.skipped
    assert all(isinstance(m, nn.Linear) for m in model.modules() if "proj" in type(m).__name__.lower())
    if compiled:
        for layer in model.model.layers:
            layer.compile(fullgraph=True)  # grouping adds no graph break
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    for _ in range(2):  # the second call reuses the compiled layers and the groups' state
        loss = model(ids).logits.float().square().mean()
        ref = reference(ids).logits.float().square().mean()
        loss.backward()
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and (p.grad - q.grad).norm() <= 1e-4 * q.grad.norm() + 1e-9, name
            p.grad = q.grad = None
    assert ungroup_projections(model) == 5 * layers
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_compiled_backward_writes_gate_and_up_gradients_into_the_concatenation(tiny_qwen3_lm):
    """Inductor's backward of a grouped layer: the SwiGLU backward is one kernel over the intermediate width that
    writes gate's and up's gradient blocks, not a kernel over the grouped width summing zero-padded slices (which
    reads the SwiGLU inputs once per half)."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    model, _ = _flat_model(tiny_qwen3_lm)
    group_projections(model)
    model.model.layers[0].compile(fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))

    def step():
        model(ids).logits.float().square().mean().backward()

    with fresh_inductor_cache():
        _, codes = run_and_get_code(step)
    kernels = {name for code in codes for name in re.findall(r"\b(\w*fused\w*)\(", code)}
    swiglu = [k for k in kernels if "silu_backward" in k]
    assert swiglu, sorted(kernels)  # the backward graph was captured
    assert not [k for k in swiglu if "slice_backward" in k], swiglu


def test_member_called_with_another_input_runs_its_own_gemm(tiny_qwen3_lm):
    model, _ = _flat_model(tiny_qwen3_lm)
    group_projections(model)
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(2, 5, model.config.hidden_size), torch.randn(2, 5, model.config.hidden_size)
    q = attn.q_proj(x)
    k_other = attn.k_proj(other)  # not the grouped input: its own GEMM
    v = attn.v_proj(x)
    assert torch.allclose(q, F.linear(x, attn.q_proj.weight), atol=1e-6)
    assert torch.allclose(k_other, F.linear(other, attn.k_proj.weight), atol=1e-6)
    assert torch.allclose(v, F.linear(x, attn.v_proj.weight), atol=1e-6)
    assert torch.allclose(attn.k_proj(x), F.linear(x, attn.k_proj.weight), atol=1e-6)  # alone: its own GEMM


def test_refused_groups_are_named(tiny_qwen3_lm):
    separate = tiny_qwen3_lm()  # weights in their own allocations
    report = group_projections(separate)
    assert not report.grouped and set(report.skipped.values()) == {"weights not adjacent in one storage"}
    frozen, _ = _flat_model(tiny_qwen3_lm)
    frozen.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    assert group_projections(frozen).skipped == {"model.layers.0.mlp: gate_proj+up_proj": "frozen weight"}
    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    qwen2 = AutoModelForCausalLM.from_config(cfg).float()
    SingleDeviceWeights(qwen2, torch.float32)
    skipped = group_projections(qwen2).skipped
    assert skipped["model.layers.0.self_attn: q_proj+k_proj+v_proj"] == "has a bias"  # gate/up has none
    assert "model.layers.0.mlp: gate_proj+up_proj" not in skipped


def _batch(vocab: int) -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (4, 11), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": torch.ones(4, 11, dtype=torch.long), "responses": ids[:, 5:],
        "response_mask": torch.ones(4, 6), "advantages": torch.randn(4, 6, generator=g)})


def _pg_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {}


def test_backend_train_steps_match_ungrouped(tiny_qwen3_lm):
    runs = {}
    for grouped in (False, True):
        model = tiny_qwen3_lm(seed=5)
        backend = FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-2, grad_clip=0.5),
                               train=PolicyTrainConfig(micro_batch_size=2, single_device="on"),
                               num_training_steps=4, device=CPU, group_projections=grouped)
        assert (backend.grouping is not None) == grouped
        metrics = [backend.train_step(_batch(model.config.vocab_size), _pg_loss) for _ in range(2)]
        runs[grouped] = (metrics, {n: w.clone() for n, w in backend.named_weights()})
    (m0, w0), (m1, w1) = runs[False], runs[True]
    for a, b in zip(m0, m1, strict=True):
        assert abs(a["actor/loss"] - b["actor/loss"]) <= 1e-5 * abs(a["actor/loss"]) + 1e-7
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) <= 1e-4 * a["actor/grad_norm"]
    for name in w0:  # Adam divides by sqrt(v): float32 rounding of near-zero gradients moves updates most
        assert (w0[name] - w1[name]).norm() <= 1e-4 * w0[name].norm() + 1e-7, name


@pytest.mark.parametrize("kw", [{"exact_logprobs": True, "single_device": "on"}, {"single_device": "off"}],
                         ids=["exact", "fully_shard"])
def test_backend_refuses_grouping_off_the_single_device_path(tiny_qwen3_lm, kw):
    single = kw.pop("single_device")
    with pytest.raises(ValueError, match=r"group_projections=True needs the single-device path .*exact_logprobs"):
        FSDP2Backend(tiny_qwen3_lm(), role="actor", optim=OptimConfig(lr=1e-3),
                     train=PolicyTrainConfig(single_device=single), num_training_steps=1, device=CPU,
                     group_projections=True, **kw)
