"""R3 on the four MoE families (tiny models, CPU): record -> replay reproduces log-probs, other
routes change them, the router gets gradients under hard_assignment, distribution mode too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.models.tiny import tiny_config
from lumenrl_moe import RecordTarget, install_routing, validate_routes

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")
# group-limited top-k exercised: 8 experts in 4 groups, 2 groups kept
_OVERRIDES = {
    "qwen3_moe": {"num_experts": 8},
    "mixtral": {"num_local_experts": 8},
    "deepseek_v3": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "glm4_moe": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
}


def _model(family: str, seed: int = 0):
    config = tiny_config(family, num_hidden_layers=3, **_OVERRIDES[family])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
