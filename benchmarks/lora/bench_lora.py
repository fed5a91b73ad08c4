"""LoRA vs full fine-tuning: training step time and peak GPU memory on the FSDP2 backend.

Method: one process, one GPU, the one-rank fast path of the FSDP2 backend (bf16 compute weights,
fp32 master weights and AdamW state). The model is Qwen3-8B's layer shapes with ``layers`` of its
36 decoder layers (full fine-tuning of all 36 needs ~150 GB of weights, gradients and Adam state:
more than one GPU holds), random weights. The same batch of ``rows`` sequences (prompt +
response tokens) runs a PPO-style update three times per mode; the step time is the median of
the last two, the memory is ``torch.cuda.max_memory_allocated`` over the steps, reset between
modes. LoRA: rank 16 on every attention and MLP projection (``policy.lora`` defaults).
``smoke``: a tiny Qwen3 on the CPU (time only).

    python -m benchmarks run gpu --only lora
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from typing import Any

import torch

from benchmarks.gpu import _common as C


def _batch(rows: int, prompt: int, resp: int, vocab: int):
    from lumenrl_core.data_proto import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab - 1, (rows, prompt + resp), generator=g)
    resp_mask = torch.ones(rows, resp, dtype=torch.long)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, prompt:],
        "response_mask": resp_mask, "advantages": torch.randn(rows, resp, generator=g),
        "old_log_probs": torch.full((rows, resp), -5.0),
    })


def _pg_loss(outputs, micro):
    mask = micro.batch["response_mask"].float()
    ratio = torch.exp(outputs["log_probs"] - micro.batch["old_log_probs"])
    return -(ratio * micro.batch["advantages"] * mask).sum() / micro.meta_info["mini_batch_tokens"], {}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _mode(config: Any, batch: Any, *, lora_rank: int, micro: int, device: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from lumenrl_backends.training.fsdp2 import FSDP2Backend
    from lumenrl_backends.training.lora import apply_lora
    from lumenrl_core.config.schema import LoraConfig, OptimConfig, PolicyTrainConfig

    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    if lora_rank:
        model = apply_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    backend = FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-5),
                           train=PolicyTrainConfig(micro_batch_size=micro, gradient_checkpointing=device == "cuda"),
                           num_training_steps=10, device=torch.device(device))
    trainable = sum(p.numel() for g in backend.optimizer.param_groups for p in g["params"])
    times = []
    for _ in range(3):  # the first is warm-up
        _sync(device)
        start = time.perf_counter()
        backend.train_step(batch, _pg_loss)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    del backend, model
    gc.collect()
    return {"step_s": statistics.median(times[1:]), "peak_gib": peak, "trainable_params": float(trainable)}


def run(smoke: bool) -> dict[str, Any]:
    """Full fine-tuning vs LoRA r=16: step seconds, peak GiB, trainable parameters, and the ratios."""
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if smoke:
        config = C.qwen3_config("tiny")
        config.vocab_size = 512
        rows, prompt, resp, micro, layers = 4, 8, 8, 2, 2
    else:
        config = C.qwen3_config("8b")
        rows, prompt, resp, micro, layers = 16, 256, 256, 4, 16
        config.num_hidden_layers = layers
    batch = _batch(rows, prompt, resp, config.vocab_size)
    full = _mode(config, batch, lora_rank=0, micro=micro, device=device)
    lora = _mode(config, batch, lora_rank=16, micro=micro, device=device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "shape": "tiny" if smoke else f"qwen3-8b x{layers} layers",
                           "rows_x_tokens": f"{rows}x{prompt + resp}"}
    for name, got in (("full", full), ("lora", lora)):
        out.update({f"{name}_{k}": round(v, 4) for k, v in got.items()})
    out["lora_step_ratio"] = round(lora["step_s"] / full["step_s"], 3)
    out["lora_memory_ratio"] = round(lora["peak_gib"] / full["peak_gib"], 3) if device == "cuda" else float("nan")
    out["lora_trainable_frac"] = round(lora["trainable_params"] / full["trainable_params"], 5)
    return out


if __name__ == "__main__":
    import sys

    for key, value in run("--smoke" in sys.argv).items():
        print(f"{key:28s} {value}")
