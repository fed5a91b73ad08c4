"""A plain-PyTorch GRPO loop (verl-style roles in one process) with lumenrl-quant only.

Imports torch, transformers and lumenrl_quant: no other LumenRL package. Each step:

1. rollout:  sample from an FP8 blockwise copy of the policy (``quantize_model``), keeping the sampled
             tokens' log-probs (``rollout_log_probs``), as an inference engine returns them;
2. reward:   share of low token ids (< LOW_TOKENS) in the response; GRPO advantages (group-normalized);
3. trainer:  the policy's log-probs of the same tokens (``old_log_probs``); token-level TIS weights and the
             correction metrics from the two tensors (``TISToken``; ``MISToken``, ``SeqMIS``, ... take the same
             arguments and return rejection masks too);
4. update:   PPO-clip loss weighted by TIS (``apply_is_weights``); the decoder linears train through
             ``Fp8TrainingLinear`` (FP8 forward/backward GEMMs: ``torch._scaled_mm`` on a GPU that has it,
             an exact emulation on CPU), master weights in float32;
5. sync:     after the optimizer step, requantize the rollout copy in place (``reload_quantized_weights_``).

Run: ``python examples/other_stacks/plain_grpo_quant.py`` (CPU or CUDA; a few seconds on CPU).
"""

from __future__ import annotations

import copy

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lumenrl_quant import (
    TISToken,
    apply_is_weights,
    attach_weight_cache_invalidation,
    convert_to_fp8_training,
    quantize_model,
    reload_quantized_weights_,
)

VOCAB, LOW_TOKENS, GROUPS, GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN = 32, 8, 4, 4, 6, 8


@torch.no_grad()
def sample(model, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestral sampling: (responses (B, T), log-probs of the sampled tokens (B, T))."""
    ids, log_probs = prompts, []
    for _ in range(new_tokens):
        lp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)  # (B, V)
        token = torch.multinomial(lp.exp(), 1)  # (B, 1)
        log_probs.append(lp.gather(-1, token))
        ids = torch.cat([ids, token], dim=1)
    return ids[:, prompts.shape[1]:], torch.cat(log_probs, dim=1)


def token_log_probs(model, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Log-probs (B, T) of ``responses`` given ``prompts`` under ``model`` (teacher-forced, one forward)."""
    ids = torch.cat([prompts, responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:-1].float()  # (B, T, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(B,) rewards in groups of GROUP_SIZE -> (B, 1) group-normalized advantages."""
    grouped = rewards.view(-1, GROUP_SIZE)
    return ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1, 1)


def ppo_clip_loss(log_probs, old_log_probs, advantages, mask, is_weights, keep_mask, eps: float = 0.2):
    ratio = torch.exp(log_probs - old_log_probs)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    weighted, loss_mask = apply_is_weights(per_token, mask, is_weights, keep_mask)
    return (weighted * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def build(device: str = "cpu", lr: float = 3e-3):
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.1)
    torch.manual_seed(0)
    policy = Qwen3ForCausalLM(config).to(device)  # stands in for AutoModelForCausalLM.from_pretrained(...)
    rollout = copy.deepcopy(policy).eval().requires_grad_(False)
    quantize_model(rollout, "fp8_block")  # the engine's copy: decoder linears -> FP8 weights
    convert_to_fp8_training(policy, recipe="tensorwise", module_filter=lambda name, _: name != "lm_head")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    attach_weight_cache_invalidation(optimizer, policy)  # FP8 weight cache dropped after each step
    return policy, rollout, optimizer


def train(steps: int = 5, device: str = "cpu") -> tuple[list[dict[str, float]], torch.nn.Module, torch.nn.Module]:
    policy, rollout, optimizer = build(device)
    correction, history = TISToken(clip=2.0), []
    for step in range(steps):
        prompts = torch.randint(0, VOCAB, (GROUPS, PROMPT_LEN), device=device).repeat_interleave(GROUP_SIZE, 0)
        responses, rollout_log_probs = sample(rollout, prompts, RESPONSE_LEN)
        mask = torch.ones_like(rollout_log_probs)
        rewards = (responses < LOW_TOKENS).float().mean(-1)
        with torch.no_grad():
            old_log_probs = token_log_probs(policy, prompts, responses)
        is_weights, keep_mask, metrics = correction(old_log_probs, rollout_log_probs, mask)
        loss = ppo_clip_loss(token_log_probs(policy, prompts, responses), old_log_probs, grpo_advantages(rewards),
                             mask, is_weights, keep_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reload_quantized_weights_(rollout, policy.state_dict())  # weight sync: requantize in place
        gap = float((old_log_probs - rollout_log_probs).abs().mean())
        history.append({"step": step, "loss": loss.item(), "reward": float(rewards.mean()),
                        "rollout/logprob_abs_diff_mean": gap, **metrics})
    return history, policy, rollout


if __name__ == "__main__":
    log, _, _ = train(device="cuda" if torch.cuda.is_available() else "cpu")
    for row in log:
        print({k: round(v, 5) for k, v in row.items() if k in ("step", "loss", "reward", "rollout/logprob_abs_diff_mean",
                                                              "rollout_correction/kl_k3", "rollout_correction/is_weight_mean")})
