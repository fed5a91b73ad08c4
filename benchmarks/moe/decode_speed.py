"""MoE decode speed of the ``native`` engine on a Qwen3-30B-A3B-shaped model (issue #17 goal).

Full shape (``smoke=False``, CUDA): hidden 2048, 128 experts, top-8, expert width 768, 32/4 heads
of 128, 12 of the 48 layers, vocab 151936, bf16 random init; batch 64, 256 prompt + 128 new
tokens, greedy, EOS ignored. Reported, each from one whole generate call after a warm-up call:

* ``native_decode_tok_s``: batch x (new - 1) / (seconds - prefill seconds), ``compile="full"``;
* ``roofline_pct``: that rate over the HBM roofline when every expert is read each step (all
  weights but the input embedding + the mean KV, over the measured copy bandwidth);
* ``record_overhead_pct``: decode time with R3 recording on vs off (goal <= 3%);
* ``hf_decode_tok_s``: HF ``generate`` (dynamic cache), prefill timed separately;
* ``fp8_experts_vs_bf16``: not measured (FP8 expert weights are not built: n/a).

Smoke (CPU, seconds): a hidden-64 / 8-expert version of the same measurements (no roofline).
GPU: ``python -c "from benchmarks.moe.decode_speed import moe_decode_speed as f; print(f(False))"``.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.engines.native import NativeEngine
from lumenrl_core.data_proto import DataProto

__all__ = ["moe_decode_speed"]

FULL = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            intermediate_size=6144, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            vocab_size=151936, norm_topk_prob=True, max_position_embeddings=4096)
SMOKE = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             norm_topk_prob=True, max_position_embeddings=512)


class _Tok:  # the engine only decodes response text with it
    eos_token_id, pad_token_id = None, 0

    def batch_decode(self, rows, **_):
        return ["" for _ in rows]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(shape: dict, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **shape), dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model.eval()


def _native(model, batch, new: int, *, device: str, compile: str, record: bool) -> tuple[float, float]:
    """(decode tok/s, decode seconds) of the second of two generate calls."""
    torch._dynamo.reset()
    rows, prompt = batch.batch["input_ids"].shape
    engine = NativeEngine(model, _Tok(), device=device, max_batch_size=rows, max_seq_len=prompt + new,
                          compile=compile, record_routes=record)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new}
    engine.generate(batch, params)
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(batch, params)
    _sync(device)
    decode_s = time.perf_counter() - start - out.meta_info["perf"]["prefill_seconds"]
    if engine.routes.enabled:  # restore the model's own routing for the next engine
        engine.routes.ctl.record(None)
    return rows * (new - 1) / decode_s, decode_s


def _hf(model, batch, new: int, device: str) -> float:
    ids, mask = batch.batch["input_ids"].to(device), batch.batch["attention_mask"].to(device)

    def run(n):
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        return time.perf_counter() - start

    run(2)
    prefill, total = run(1), run(new)
    return ids.shape[0] * (new - 1) / max(total - prefill, 1e-9)


def moe_decode_speed(smoke: bool) -> dict:
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    shape, (rows, prompt, new) = (SMOKE, (4, 16, 8)) if smoke else (FULL, (64, 256, 128))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = _model(shape, device, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, shape["vocab_size"] - 1, (rows, prompt), generator=g)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    compile = "full" if device == "cuda" else "none"
    out = {"device": device, "shape": "smoke" if smoke else "qwen3-30b-a3b x12 layers", "batch": rows,
           "prompt": prompt, "new": new, "compile": compile,
           "experts_implementation": model.config._experts_implementation}
    plain, plain_s = _native(model, batch, new, device=device, compile=compile, record=False)
    recorded, recorded_s = _native(model, batch, new, device=device, compile=compile, record=True)
    out["native_decode_tok_s"] = plain
    out["native_record_decode_tok_s"] = recorded
    out["record_overhead_pct"] = 100.0 * (recorded_s / plain_s - 1.0)
    out["hf_decode_tok_s"] = _hf(model, batch, new, device)
    out["native_vs_hf"] = plain / out["hf_decode_tok_s"]
    if device == "cuda":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
        import _common as C

        roof = C.decode_roofline(model, batch=rows, prompt_len=prompt, new_tokens=new,
                                 bandwidth_gbs=C.copy_bandwidth_gbs())
        out["roofline_tok_s"] = roof["tokens_per_s"]
        out["roofline_pct"] = 100.0 * plain / roof["tokens_per_s"]
    out["fp8_experts_vs_bf16"] = "n/a (FP8 expert weights not built)"
    return out


if __name__ == "__main__":
    import sys

    for key, value in moe_decode_speed(smoke="--full" not in sys.argv).items():
        print(f"{key:28s} {value}")
