"""R3 (rollout routing replay) on a Hugging Face MoE model, without a LumenRL trainer.

``install_routing`` patches every MoE router of a transformers (>= 5.13) Qwen3-MoE / Mixtral / DeepSeek-V3 /
GLM-4-MoE model. The rollout forward *records* the experts each token was routed to (``RecordTarget``, an
int tensor (B, S, L_moe, k)); the training forward *replays* them, so the trainer computes its log-probs
through the same experts the sampler used, even when its weights (or kernels, or precision) differ enough
to flip a router's top-k. The replayed gate weights come from the live router logits over the recorded
experts (``hard_assignment``): the router still gets gradients.

Here the "trainer" is the same model after a weight perturbation (stands in for an optimizer step or an
FP8 engine). Run: ``python examples/other_stacks/plain_r3_moe.py``.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lumenrl_moe import RecordTarget, install_routing, moe_blocks, route_flip_fraction


def tiny_moe() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()  # stands in for AutoModelForCausalLM.from_pretrained(...)


def forward_recording(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, S, V), routes (B, S, L_moe, k)): one forward that records the experts of every token."""
    ctl, (b, s) = model.lumenrl_routes, ids.shape
    routes = torch.zeros(b, s, ctl.num_layers, ctl.top_k, dtype=torch.long)
    ctl.record(RecordTarget(routes=routes, index=(torch.arange(b).repeat_interleave(s), torch.arange(s).repeat(b))))
    try:
        return model(input_ids=ids).logits, routes
    finally:
        ctl.record(None)


def main(perturbation: float = 0.2) -> dict[str, float]:
    model = tiny_moe()
    ctl = install_routing(model, replay_mode="hard_assignment")
    ids = torch.randint(0, 64, (4, 16))
    with torch.no_grad():
        rollout_logits, rollout_routes = forward_recording(model, ids)  # the rollout: record
        ctl.replay(rollout_routes)
        same_weights_replay = model(input_ids=ids).logits  # replay with unchanged weights: the same forward
        ctl.replay(None)
        for p in model.parameters():  # the trainer's weights move away from the sampler's
            p.add_(perturbation * p.std() * torch.randn_like(p))
        train_logits, own_routes = forward_recording(model, ids)  # no replay: own routing
    ctl.replay(rollout_routes)  # the training forward with replay
    replay_logits, used_routes = forward_recording(model, ids)
    replay_logits.logsumexp(-1).mean().backward()  # gradients reach the routers through the replayed gates
    flips = ctl.flips.float().mean()
    ctl.replay(None)
    return {
        "route_agreement_without_replay": 1.0 - float(route_flip_fraction(rollout_routes, own_routes)),
        "route_agreement_with_replay": 1.0 - float(route_flip_fraction(rollout_routes, used_routes)),
        "moe/route_flip_frac": float(flips),  # tokens whose live top-k differs from the replayed experts
        "replay_logits_max_abs_diff_same_weights": float((same_weights_replay - rollout_logits).abs().max()),
        "train_vs_replay_logits_max_abs_diff": float((train_logits - replay_logits.detach()).abs().max()),
        "router_grad_norm": float(sum(block.gate.weight.grad.norm() for block in moe_blocks(model))),
    }


if __name__ == "__main__":
    for name, value in main().items():
        print(f"{name}: {value:.4g}")
