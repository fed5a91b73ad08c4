"""R3 under a perturbed rollout: a tiny Qwen3-MoE whose rollout runs FP8 (blockwise) linears
while the trainer runs the fp32 weights. One rollout, scored twice by the trainer: without R3
(the trainer routes on its own) and with R3 (it replays the rollout's routes).

Reported: ``route_flip_frac`` (share of fed tokens whose expert set in the trainer's forward
differs from the rollout's, measured from the experts each forward actually used), the
train/infer KL (k3 over the sampled response tokens) and F(2), with and without R3, and
``kl_cut`` = KL without / KL with. Run: ``python -m benchmarks.moe.r3_mismatch [--full]``.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.engines.native import NativeEngine
from lumenrl_backends.models.tiny import tiny_config
from lumenrl_backends.models.tokenizer import build_char_tokenizer
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import PolicyTrainConfig, R3Config
from lumenrl_core.data_proto import DataProto
from lumenrl_moe import RecordTarget, extreme_token_fraction_from_log_probs, train_infer_kl

__all__ = ["r3_mismatch"]

EXPERT_STD = 0.15  # random-init experts (std 0.02) barely change the output; trained experts do


def _model(smoke: bool) -> torch.nn.Module:
    size = dict(hidden_size=64, num_hidden_layers=2, num_experts=8) if smoke else \
        dict(hidden_size=128, num_hidden_layers=4, num_experts=16)
    config = tiny_config("qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=64, **size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        for name, param in model.named_parameters():  # experts that differ strongly: a flip matters
            if ".experts." in name:
                param.data.normal_(0, EXPERT_STD)
        return model


def _prompts(tokenizer, rows: int) -> DataProto:
    g = torch.Generator().manual_seed(1)
    texts = [f"{int(a)}+{int(b)}=" for a, b in torch.randint(0, 99, (rows, 2), generator=g)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, i in enumerate(ids):
        input_ids[r, width - len(i):], mask[r, width - len(i):] = torch.tensor(i), 1
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask})


def _score(model, batch, r3: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, T), experts the trainer's forward used (B, P+T, L_moe, k))."""
    backend = FSDP2Backend(copy.deepcopy(model), role="ref", optim=None,
                           train=PolicyTrainConfig(micro_batch_size=len(batch), packing="none"), num_training_steps=1,
                           device=torch.device("cpu"), r3=R3Config(enabled=r3))
    from lumenrl_moe import install_routing

    ctl = install_routing(backend.model)  # the same controller the backend replays through (when r3)
    routes = batch.batch["routed_experts"]
    used = torch.zeros_like(routes)
    n = routes.shape[0] * routes.shape[1]
    ctl.record(RecordTarget(routes=used.view(n, *routes.shape[2:]), index=(torch.arange(n),)))
    log_probs, _ = backend.compute_log_probs(batch, temperature=1.0)
    ctl.record(None)
    return log_probs, used


def r3_mismatch(smoke: bool) -> dict:
    model, tokenizer = _model(smoke), build_char_tokenizer()
    engine = NativeEngine(copy.deepcopy(model), tokenizer, max_batch_size=64, max_seq_len=48, quant_scheme="fp8_block",
                          record_routes=True)
    batch = engine.generate(_prompts(tokenizer, 16 if smoke else 64),
                            {"temperature": 1.0, "max_new_tokens": 8 if smoke else 24, "seed": 0, "ignore_eos": True})
    valid = batch.batch["attention_mask"].bool()
    fed = valid & (valid.long().cumsum(-1) < valid.long().sum(-1, keepdim=True))  # tokens with a recorded route
    resp, infer = batch.batch["response_mask"], batch.batch["rollout_log_probs"]
    recorded = batch.batch["routed_experts"].long().sort(-1).values
    out: dict = {"model": "qwen3_moe tiny" + ("" if smoke else " x4 layers"), "rollout": "fp8_block",
                 "tokens": int(fed.sum())}
    for tag, r3 in (("without_r3", False), ("with_r3", True)):
        log_probs, used = _score(model, batch, r3)
        differs = (used.long().sort(-1).values != recorded).any(-1).any(-1)  # (B, P+T)
        out[f"route_flip_frac_{tag}"] = float(differs[fed].double().mean())
        out[f"train_infer_kl_{tag}"] = train_infer_kl(log_probs, infer, resp)
        out[f"extreme_token_frac@2_{tag}"] = extreme_token_fraction_from_log_probs(log_probs, infer, 2.0, resp)
    out["kl_cut"] = out["train_infer_kl_without_r3"] / max(out["train_infer_kl_with_r3"], 1e-30)
    return out


if __name__ == "__main__":
    for key, value in r3_mismatch(smoke="--full" not in sys.argv).items():
        print(f"{key:32s} {value}")
