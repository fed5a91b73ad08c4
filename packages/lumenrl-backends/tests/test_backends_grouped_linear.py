"""Grouped q/k/v and gate/up GEMMs (training/grouped_linear.py): float64 references, the unfused model, the
single-device backend, and where a group is refused."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.grouped_linear import (
    GroupedLinear,
    GroupedSwiGLU,
    group_projections,
    swiglu_backward,
    ungroup_projections,
    use_grouping,
)
from lumenrl_backends.training.single_device import SingleDeviceWeights
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

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


def test_compiled_backward_of_a_swiglu_mlp_is_one_swiglu_backward_pass(tiny_qwen3_lm):
    """Inductor's backward of a grouped layer: the MLP's activation gradient is the one swiglu_backward op (gate's
    and up's halves in one pass), and no compiled kernel sums zero-padded slices of the grouped width (which reads
    the activation's inputs once per half)."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    model, _ = _flat_model(tiny_qwen3_lm)
    report = group_projections(model)
    assert "model.layers.0.mlp: gate_proj+up_proj (SwiGLU)" in report.grouped
    model.model.layers[0].compile(fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))

    def step():
        model(ids).logits.float().square().mean().backward()

    with fresh_inductor_cache():
        _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "lumenrl.swiglu_backward" in code  # the backward graph was captured, with the op
    kernels = {name for name in re.findall(r"\b(\w*fused\w*)\(", code)}
    assert not [k for k in kernels if "silu_backward" in k], sorted(kernels)


def _swiglu_reference(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    h64 = h.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(dy.double())
    return h64.grad


def test_swiglu_backward_against_float64():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    dy = torch.randn(3, 5, 24, generator=g)
    h = torch.randn(3, 5, 48, generator=g) * 3
    got = swiglu_backward(dy, h)
    assert got.shape == h.shape and got.dtype == h.dtype
    assert (got.double() - _swiglu_reference(dy, h)).abs().max() < 1e-5 * 10  # float32 math, |values| up to ~30
    half = swiglu_backward(dy.bfloat16(), h.bfloat16())
    ref = _swiglu_reference(dy.bfloat16(), h.bfloat16())
    assert half.dtype == torch.bfloat16 and ((half.double() - ref).abs() <= 2**-7 * ref.abs() + 1e-6).all()
    with pytest.raises(ValueError, match=r"h must be \(\.\.\., 2 x dy's last\)"):
        swiglu_backward(dy, h[..., :40])


SWIGLU_INTERPRETED = """
import torch
from lumenrl_backends.training.grouped_linear import _swiglu_backward_torch, _swiglu_backward_triton
g = torch.Generator().manual_seed(int(torch.seed() % 2**31))
for dtype in (torch.float32, torch.bfloat16):
    dy = torch.randn(7, 300, generator=g).to(dtype)  # 2100 elements: two blocks, the second partly masked
    h = (torch.randn(7, 600, generator=g) * 3).to(dtype)
    got, want = _swiglu_backward_triton(dy, h), _swiglu_backward_torch(dy, h)
    assert got.dtype == dtype and got.shape == h.shape
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-6).all(), dtype
print("ok")
"""


def test_swiglu_backward_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SWIGLU_INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_grouped_swiglu_against_float64():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(4, 6, 32, generator=g)
    flat = torch.randn(2 * 40 * 32, generator=g) * 0.2
    w_gate, w_up = (nn.Parameter(flat[i * 1280 : (i + 1) * 1280].view(40, 32)) for i in range(2))
    xg = x.clone().requires_grad_()
    y = GroupedSwiGLU.apply(xg, flat.view(80, 32), w_gate, w_up)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    x64 = x.double().requires_grad_()
    g64, u64 = (w.detach().double().requires_grad_() for w in (w_gate, w_up))
    y64 = F.silu(F.linear(x64, g64)) * F.linear(x64, u64)
    y64.backward(dy.double())
    bound = 1e-5  # float32 against float64: K = 32 products, |values| ~ 1
    assert (y.double() - y64).abs().max() < bound
    assert (xg.grad.double() - x64.grad).abs().max() < 10 * bound
    assert (w_gate.grad.double() - g64.grad).abs().max() < 10 * bound
    assert (w_up.grad.double() - u64.grad).abs().max() < 10 * bound


def test_an_mlp_that_is_not_swiglu_keeps_the_member_groups(tiny_qwen3_lm):
    model, reference = _flat_model(tiny_qwen3_lm)
    for m in (model, reference):
        for layer in m.model.layers:
            layer.mlp.act_fn = nn.GELU()
    report = group_projections(model)
    assert "model.layers.0.mlp: gate_proj+up_proj" in report.grouped  # the generic path, not "(SwiGLU)"
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


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
    for how in ({"group_projections": True}, {}):  # the argument, or the config key
        train = PolicyTrainConfig(single_device=single, group_projections="off" if how else "on")
        with pytest.raises(ValueError, match=r"group_projections='on' needs the one-rank path and exact_logprobs off"):
            FSDP2Backend(tiny_qwen3_lm(), role="actor", optim=OptimConfig(lr=1e-3), train=train,
                         num_training_steps=1, device=CPU, **how, **kw)
    # auto: where grouping cannot run, the backend builds without it
    backend = FSDP2Backend(tiny_qwen3_lm(), role="actor", optim=OptimConfig(lr=1e-3),
                           train=PolicyTrainConfig(single_device=single), num_training_steps=1, device=CPU, **kw)
    assert backend.grouping is None


def test_the_config_key_chooses_grouping_and_auto_groups_on_cuda_only(tiny_qwen3_lm, monkeypatch):
    """policy.train.group_projections: on groups (CPU too), off does not, auto groups where the one-rank path
    runs on CUDA (measured there, decision 0006); a bad value is named."""
    def build(mode):
        return FSDP2Backend(tiny_qwen3_lm(), role="actor", optim=OptimConfig(lr=1e-3),
                            train=PolicyTrainConfig(group_projections=mode), num_training_steps=1, device=CPU)

    assert build("on").grouping.grouped and build("off").grouping is None and build("auto").grouping is None
    # the rule itself for a CUDA device (nothing runs on it)
    cuda = torch.device("cuda", 0)
    assert use_grouping("auto", single=True, exact=False, device=cuda)
    assert not use_grouping("auto", single=False, exact=False, device=cuda)
    assert not use_grouping("auto", single=True, exact=True, device=cuda)
    assert not use_grouping("off", single=True, exact=False, device=cuda)
    assert use_grouping(True, single=True, exact=False, device=CPU) and not use_grouping(False, single=True,
                                                                                         exact=False, device=cuda)
    with pytest.raises(ValueError, match=r"policy\.train\.group_projections='sometimes' is not allowed; allowed: auto, on, off"):
        build("sometimes")


@pytest.mark.parametrize("override, reason", [
    ("policy.train.single_device=off", "single_device='off'"),
    ("quantization.training.precision=fp8", "precision='fp8'"),
    ("policy.rollout.exact_logprobs=true", "exact_logprobs"),
])
def test_the_config_refuses_on_where_the_one_rank_path_cannot_group(override, reason):
    from lumenrl_core.config import load_config
    from lumenrl_core.config.loader import ConfigError

    with pytest.raises(ConfigError, match=rf"policy\.train\.group_projections.*{reason}.*allowed: auto, off"):
        load_config(None, ["policy.train.group_projections=on", override])
    assert load_config(None, ["policy.train.group_projections=auto", override]).policy.train.group_projections == "auto"
