"""Router math for R3 record/replay against float64 loop references."""

from __future__ import annotations

import pytest
import torch

from lumenrl_core.plugins import PluginRegistry
from lumenrl_moe import SigmoidGroupTopKRouter, SoftmaxTopKRouter, validate_routes


def ref_softmax_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, list[set[int]]]:
    probs = torch.softmax(logits.double(), dim=-1)
    weights, sets = [], []
    for row in probs:
        order = sorted(range(row.numel()), key=lambda e: -float(row[e]))[:k]
        w = row[order]
        weights.append(w / w.sum() if norm else w)
        sets.append(set(order))
    return torch.stack(weights), sets


def ref_sigmoid_group(logits, bias, k, n_group, topk_group, scale, norm):
    scores = torch.sigmoid(logits.double())
    out_w, out_sets = [], []
    per_group = logits.shape[-1] // n_group
    for s in scores:
        choice = s + bias.double()
        group_score = [sorted(choice[g * per_group:(g + 1) * per_group].tolist(), reverse=True)[:2] for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[:k]
        w = s[chosen]
        w = w / w.sum() if norm else w
        out_w.append(w * scale)
        out_sets.append(chosen)
    return out_w, out_sets


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_select_matches_reference(norm):
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(32, 8, generator=gen)
    router = SoftmaxTopKRouter(top_k=2, norm_topk_prob=norm)
    weights, indices = router.select(logits)
    ref_w, ref_sets = ref_softmax_topk(logits, 2, norm)
    assert [set(r.tolist()) for r in indices] == ref_sets
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-6, atol=1e-7)
    validate_routes(indices.view(32, 1, 2), num_experts=8)
    torch.testing.assert_close(router.replay(logits, indices), weights)  # replay of own routes = select


def test_softmax_replay_forces_recorded_experts_and_is_differentiable():
    gen = torch.Generator().manual_seed(11)
    logits_infer = torch.randn(16, 8, generator=gen)
    logits_train = (logits_infer + 0.5 * torch.randn(16, 8, generator=gen)).requires_grad_(True)
    router = SoftmaxTopKRouter(top_k=2)
    _, recorded = router.select(logits_infer)
    weights = router.replay(logits_train, recorded)
    probs = torch.softmax(logits_train.detach().double(), -1)
    ref = probs.gather(-1, recorded)
    torch.testing.assert_close(weights.detach().double(), ref / ref.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    (weights[:, 0] * torch.arange(16.0)).sum().backward()
    assert logits_train.grad is not None and logits_train.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"indices.shape=\(16, 3\)"):
        router.replay(logits_train, torch.zeros(16, 3, dtype=torch.long))


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_group_select_matches_reference(norm):
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(24, 16, generator=gen)
    bias = 0.1 * torch.randn(16, generator=gen)
    router = SigmoidGroupTopKRouter(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    norm_topk_prob=norm, e_score_correction_bias=bias)
    weights, indices = router.select(logits)
    ref_w, ref_sets = ref_sigmoid_group(logits, bias, 3, 4, 2, 2.5, norm)
    for row, (w, idx) in enumerate(zip(weights, indices)):
        order = {int(e): i for i, e in enumerate(idx)}
        assert set(order) == set(ref_sets[row])
        ref_by_expert = {e: float(ref_w[row][i]) for i, e in enumerate(ref_sets[row])}
        for e, i in order.items():
            assert float(w[i]) == pytest.approx(ref_by_expert[e], rel=1e-6)
    # every chosen expert lies in one of the 2 best groups: at most 2 distinct groups per row
    assert int((indices // 4).sort(-1).values.diff(dim=-1).ne(0).sum(-1).max()) <= 1
    torch.testing.assert_close(router.replay(logits, indices), weights)


def test_sigmoid_replay_gradients_and_config():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(8, 8, generator=gen, requires_grad=True)
    router = SigmoidGroupTopKRouter.from_model_config(
        {"model_type": "deepseek_v3", "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
         "routed_scaling_factor": 2.0, "norm_topk_prob": True})
    assert (router.top_k, router.n_group, router.topk_group, router.routed_scaling_factor) == (2, 2, 1, 2.0)
    _, idx = router.select(logits.detach())
    weights = router.replay(logits, idx)
    torch.testing.assert_close(weights.sum(-1), torch.full((8,), 2.0))
    weights[:, 0].sum().backward()
    assert logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="topk_group=3"):
        SigmoidGroupTopKRouter(top_k=2, n_group=2, topk_group=3)


def test_router_config_and_registration():
    assert SoftmaxTopKRouter.from_model_config({"model_type": "mixtral", "num_experts_per_tok": 2,
                                                "norm_topk_prob": False}).norm_topk_prob is True
    qwen = SoftmaxTopKRouter.from_model_config({"model_type": "qwen3_moe", "num_experts_per_tok": 8,
                                                "norm_topk_prob": False})
    assert (qwen.top_k, qwen.norm_topk_prob) == (8, False)
    registry = PluginRegistry()
    assert registry.load("moe_routers", "qwen3_moe") is SoftmaxTopKRouter
    assert registry.load("moe_routers", "deepseek_v3") is SigmoidGroupTopKRouter
    info = registry.info("moe_routers", "glm4_moe")
    assert info.available and info.distribution == "lumenrl-moe" and "route_replay" in info.capabilities


def test_install_routing_refuses_a_model_without_moe_blocks_and_resolves_router_names():
    import pytest
    from torch import nn

    from lumenrl_moe import install_routing
    from lumenrl_moe.replay import router_class
    from lumenrl_moe.routers import SigmoidGroupTopKRouter

    dense = nn.Linear(2, 2)
    dense.config = type("C", (), {"model_type": "llama"})()
    with pytest.raises(ValueError, match="model_type='llama' has no MoE block"):
        install_routing(dense)
    assert router_class("deepseek_v3") is SigmoidGroupTopKRouter and router_class("") is None


def test_uninstall_routing_restores_the_models_own_router():
    from torch import nn

    from lumenrl_moe import install_routing, uninstall_routing

    class Gate(nn.Module):  # an HF-style router: its own forward returns (logits, weights, indices)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8))

        def forward(self, h):
            logits = h @ self.weight.T
            w, i = logits.softmax(-1).topk(2, dim=-1)
            return logits, w, i

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = Gate(), nn.Linear(8, 8)

    model = nn.Sequential(Block())
    model.config = type("C", (), {"model_type": "qwen3_moe", "num_experts_per_tok": 2, "norm_topk_prob": True})()
    gate = model[0].gate
    ctl = install_routing(model)
    assert "forward" in gate.__dict__ and model.lumenrl_routes is ctl
    x = torch.randn(3, 8)
    assert torch.equal(gate(x)[2].sort(-1).values, Gate.forward(gate, x)[2].sort(-1).values)  # same experts
    assert uninstall_routing(model) is True
    assert "forward" not in gate.__dict__ and not hasattr(model, "lumenrl_routes")
    assert uninstall_routing(model) is False
    assert install_routing(model) is not ctl  # a fresh controller after uninstalling


def test_routing_in_the_block_is_refused_naming_the_transformers_floor():
    """transformers 5.0-5.12 DeepSeek-V3 / GLM-4-MoE: the gate returns logits and the block routes
    (``route_tokens_to_experts``): a patched router's tuple would break that forward, so it is refused."""
    import pytest
    import torch
    from torch import nn

    from lumenrl_moe.replay import install_routing

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.experts = nn.Linear(4, 4, bias=False), Experts()

        def route_tokens_to_experts(self, router_logits):  # the 5.0-5.12 layout
            return router_logits.topk(2)

    model = nn.Sequential(Block())
    model.config = type("Config", (), {"model_type": "deepseek_v3"})()
    with pytest.raises(ValueError, match=r"deepseek_v3.*routes in its MoE block.*transformers >= 5.13"):
        install_routing(model)


def _tiny_qwen3_moe():
    from torch import nn

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = Gate(), nn.Linear(8, 8)

    model = nn.Sequential(Block())
    model.config = type("C", (), {"model_type": "qwen3_moe", "num_experts_per_tok": 2, "norm_topk_prob": True})()
    return model


def test_install_routing_validates_replay_mode_on_every_path():
    from lumenrl_moe import install_routing

    model = _tiny_qwen3_moe()
    with pytest.raises(ValueError, match=r"replay_mode='bogus'; allowed: hard_assignment, distribution"):
        install_routing(model, replay_mode="bogus")  # fresh model
    assert not hasattr(model, "lumenrl_routes")
    ctl = install_routing(model, replay_mode="distribution")
    with pytest.raises(ValueError, match=r"replay_mode='bogus'; allowed: hard_assignment, distribution"):
        install_routing(model, replay_mode="bogus")  # already patched: refused too, the controller unchanged
    assert ctl.replay_mode == "distribution"
    assert install_routing(model, replay_mode="hard_assignment") is ctl and ctl.replay_mode == "hard_assignment"


def test_install_routing_on_a_patched_model_refuses_another_router_class():
    from lumenrl_moe import install_routing, uninstall_routing

    model = _tiny_qwen3_moe()
    ctl = install_routing(model)  # by model type: SoftmaxTopKRouter
    assert ctl.router_cls is SoftmaxTopKRouter
    # the installed class, by class or plugin name, or None: the same controller
    assert install_routing(model, router_cls=SoftmaxTopKRouter) is ctl
    assert install_routing(model, router_cls="qwen3_moe") is ctl
    assert install_routing(model, router_cls=None) is ctl
    with pytest.raises(ValueError, match=r"router_cls=lumenrl_moe\.routers\.SigmoidGroupTopKRouter on a model "
                                         r"already patched with lumenrl_moe\.routers\.SoftmaxTopKRouter"):
        install_routing(model, router_cls=SigmoidGroupTopKRouter)
    with pytest.raises(ValueError, match=r"router_cls=.*SigmoidGroupTopKRouter"):
        install_routing(model, router_cls="deepseek_v3")
    assert model.lumenrl_routes is ctl and ctl.router_cls is SoftmaxTopKRouter

    class PluginRouter(SoftmaxTopKRouter):  # a third-party router plugin
        @classmethod
        def from_model_config(cls, config):
            return SoftmaxTopKRouter.from_model_config(config)

    assert uninstall_routing(model)
    plugged = install_routing(model, router_cls=PluginRouter)
    assert plugged.router_cls is PluginRouter and install_routing(model, router_cls=PluginRouter) is plugged
    with pytest.raises(ValueError, match=r"router_cls=.*\.SoftmaxTopKRouter on a model already patched with "
                                         r".*PluginRouter"):
        install_routing(model, router_cls=SoftmaxTopKRouter)
