"""R3 on the four MoE families (tiny models, CPU): record -> replay reproduces log-probs, other
routes change them, the router gets gradients under hard_assignment, distribution mode too; and
through the real seams: the native engine records ``routed_experts`` while generating
(left-padded prefill, decode, continuous batching), the FSDP2 backend replays them (packed
micro-batches) and reproduces the engine's log-probs; the update pass replays and moves the router."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.engines.native import NativeEngine
from lumenrl_backends.models.tiny import tiny_config
from lumenrl_backends.models.tokenizer import build_char_tokenizer
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig, R3Config
from lumenrl_core.data_proto import DataProto
from lumenrl_moe import RecordTarget, install_routing, validate_routes

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")
# group-limited top-k exercised: 8 experts in 4 groups, 2 groups kept
_OVERRIDES = {
    "qwen3_moe": {"num_experts": 8},
    "mixtral": {"num_local_experts": 8},
    "deepseek_v3": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "glm4_moe": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
}


def _model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    config = tiny_config(family, num_hidden_layers=3, **_OVERRIDES[family])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for module in model.modules():  # routers with a real spread (HF inits some at zero)
            gate = getattr(module, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.05)
            if gate is not None and getattr(gate, "weight", None) is not None and gate.weight.dim() == 2:
                gate.weight.data.normal_(0, 0.5)
    return model.eval()


def _log_probs(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, S-1, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _record(model, ctl, ids, probs=False):
    n = ids.numel()
    routes = torch.zeros(n, ctl.num_layers, ctl.top_k, dtype=torch.int16)
    p = torch.zeros(n, ctl.num_layers, ctl.num_experts) if probs else None
    ctl.record(RecordTarget(routes=routes, index=(torch.arange(n),), probs=p))
    with torch.no_grad():
        lp = _log_probs(model, ids)
    ctl.record(None)
    return lp, routes, p


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_reproduces_and_trains_the_router(family):
    model = _model(family)
    ctl = install_routing(model, replay_mode="hard_assignment")
    dense = getattr(model.config, "first_k_dense_replace", 0)
    assert ctl.num_layers == model.config.num_hidden_layers - dense  # leading dense layers have no router
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = _log_probs(model, ids)  # unpatched-equivalent routing (mode off)
    lp, routes, _ = _record(model, ctl, ids)
    validate_routes(routes, num_experts=ctl.num_experts, num_layers=ctl.num_layers)
    torch.testing.assert_close(lp, own, rtol=0, atol=0)
    ctl.replay(routes)
    replayed = _log_probs(model, ids)
    torch.testing.assert_close(replayed.detach(), lp, rtol=0, atol=1e-6)
    assert not ctl.flips.any()  # same weights: the live router agrees with every recorded route
    replayed.sum().backward()  # hard_assignment: gate weights recomputed from live logits
    grads = [b.gate.weight.grad for b in model.modules() if getattr(b, "gate", None) is not None
             and getattr(b.gate, "_lumenrl_r3", False)]
    assert len(grads) == ctl.num_layers and all(g is not None and g.abs().sum() > 0 for g in grads)
    other = (routes.long() + 1) % ctl.num_experts  # every row shifted: still k distinct experts
    ctl.replay(other.to(torch.int16))
    with torch.no_grad():
        changed = _log_probs(model, ids)
    assert (changed - lp).abs().max() > 1e-3
    assert ctl.flips.all()


@pytest.mark.parametrize("family", FAMILIES)
def test_distribution_mode_uses_recorded_probabilities(family):
    model = _model(family, seed=2)
    ctl = install_routing(model, replay_mode="distribution")
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    lp, routes, probs = _record(model, ctl, ids, probs=True)
    ctl.replay(routes, probs)
    with torch.no_grad():
        torch.testing.assert_close(_log_probs(model, ids), lp, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="record_router_logits"):
        ctl.replay(routes)


def _prompts(tokenizer, texts):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for r, i in enumerate(ids):
        input_ids[r, width - len(i):], mask[r, width - len(i):] = torch.tensor(i), 1
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask})


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_records_and_backend_replays(family):
    model = _model(family, seed=4)
    tokenizer = build_char_tokenizer()
    # 3 slots for 5 prompts: continuous batching admits the last two into freed slots
    engine = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=3, max_seq_len=32, record_routes=True)
    batch = engine.generate(_prompts(tokenizer, ["1+2=", "13+4=", "7=", "9+9+9=", "5+55="]),
                            {"temperature": 1.0, "max_new_tokens": 6, "seed": 3, "ignore_eos": True})
    routes = batch.batch["routed_experts"]
    assert routes.dtype == torch.int16 and routes.shape[:2] == batch.batch["input_ids"].shape
    validate_routes(routes, num_experts=engine.routes.ctl.num_experts)  # pad rows too
    backend = FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-3),
                           train=PolicyTrainConfig(micro_batch_size=2, packing="auto"), num_training_steps=1,
                           device=torch.device("cpu"), r3=R3Config(enabled=True))
    mask = batch.batch["response_mask"].bool()
    replayed, _ = backend.compute_log_probs(batch)
    gap = (replayed - batch.batch["rollout_log_probs"])[mask].abs().max()
    assert gap < 1e-4, gap
    valid = batch.batch["attention_mask"].bool()
    fed = valid & (valid.long().cumsum(-1) < valid.long().sum(-1, keepdim=True))  # all but each row's last
    assert not (backend.routes.last_flips & fed).any()  # same weights: live routers agree with the rollout
    shifted = batch.union(DataProto.from_dict(tensors={"route_flips": backend.routes.last_flips}))
    shifted.batch["routed_experts"] = ((routes.long() + 1) % engine.routes.ctl.num_experts).to(torch.int16)
    other, _ = backend.compute_log_probs(shifted)
    assert (other - batch.batch["rollout_log_probs"])[mask].abs().max() > 1e-3
    router = next(m.gate.weight for m in backend.model.modules() if getattr(getattr(m, "gate", None), "_lumenrl_r3", 0))
    before = router.detach().clone()

    def loss_fn(outputs, micro):
        return -(outputs["log_probs"] * micro.batch["response_mask"]).sum() / micro.meta_info["mini_batch_tokens"], {}

    backend.train_step(batch, loss_fn)  # update pass under hard_assignment replay: the router moves
    assert (router.detach() - before).abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_recording_with_cuda_graphs_equals_eager(family):
    """The record buffers are static tensors written inside the captured decode step (bf16: the
    dtype whose grouped expert GEMM is capturable; a float32 MoE decodes eagerly, tested below)."""
    model, tokenizer = _model(family, seed=5, dtype=torch.bfloat16), build_char_tokenizer()
    prompts = _prompts(tokenizer, ["1+2=", "13+4=", "7=", "9+9+9="])
    outs = []
    for graphs in (False, True):
        engine = NativeEngine(copy.deepcopy(model), tokenizer, device="cuda", max_batch_size=4, max_seq_len=48,
                              record_routes=True, cuda_graphs=graphs)
        outs.append(engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}))
        assert outs[-1].meta_info["perf"]["cuda_graphs"] is graphs
    eager, graph = outs
    assert torch.equal(eager.batch["responses"], graph.batch["responses"])
    assert torch.equal(eager.batch["routed_experts"], graph.batch["routed_experts"])


def test_hf_and_native_engines_record_the_same_routes():
    from lumenrl_backends.engines.hf import HFEngine

    model, tokenizer = _model("qwen3_moe", seed=6), build_char_tokenizer()
    prompts = _prompts(tokenizer, ["1+2=", "13+4=", "7="])
    greedy = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    native = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=4, max_seq_len=32,
                          record_routes=True).generate(prompts, greedy)
    hf = HFEngine(copy.deepcopy(model), tokenizer, max_seq_len=32, record_routes=True).generate(prompts, greedy)
    assert torch.equal(native.batch["responses"], hf.batch["responses"])
    assert torch.equal(native.batch["routed_experts"], hf.batch["routed_experts"])


def test_interrupted_and_resumed_rows_keep_aligned_routes():
    model, tokenizer = _model("qwen3_moe", seed=7), build_char_tokenizer()
    prompts = _prompts(tokenizer, ["1+2=", "13+4=", "7=", "9+9+9=", "5+55="])
    params = {"temperature": 1.0, "max_new_tokens": 8, "seed": 5, "ignore_eos": True}
    full = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=3, max_seq_len=32,
                        record_routes=True).generate(prompts, params)
    engine = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=3, max_seq_len=32, record_routes=True)
    original, count = engine._decode, {"n": 0}

    def counted(*args, **kwargs):  # interrupt after 3 decode steps
        original(*args, **kwargs)
        count["n"] += 1
        if count["n"] == 3:
            engine.interrupt()

    engine._decode = counted
    partial = engine.generate(prompts, params)
    assert partial.meta_info["interrupted"] is True
    validate_routes(partial.batch["routed_experts"])
    engine.resume()
    engine._decode = original
    done = engine.generate(partial, params)  # prompt + partial response re-prefilled, same weights
    assert torch.equal(done.batch["responses"], full.batch["responses"])
    assert torch.equal(done.batch["routed_experts"], full.batch["routed_experts"])


def test_float32_moe_is_known_not_capturable():
    """A float32 MoE model decodes eagerly by decision, not by a failed capture."""
    from lumenrl_backends.engines.graphs import graph_blocker

    assert "bfloat16" in graph_blocker(_model("qwen3_moe"))
    assert graph_blocker(_model("qwen3_moe", dtype=torch.bfloat16)) is None
    assert graph_blocker(AutoModelForCausalLM.from_config(tiny_config("qwen3", num_hidden_layers=1))) is None
