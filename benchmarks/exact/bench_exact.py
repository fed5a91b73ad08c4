"""Cost of the bitwise on-policy mode (``policy.rollout.exact_logprobs``) against the default fast path.

Harness entry ``benchmarks.exact.bench_exact:run`` (``fn(smoke) -> dict``). One job measures:

* decode: the ``native`` engine on a random-init Qwen3-8B shape (36 layers), batch 64, 128-token
  prompts, 128 new tokens (greedy, EOS ignored), CUDA graphs on: default engine (projection fusion,
  fused RoPE, cuBLAS) vs exact mode; decode tokens/s = 64 x 127 / (seconds - prefill seconds); goal
  exact / default >= 0.8. The exact engine's log-probs are compared with a training-style forward of
  the same model (trainer layout: whole sequences, the exact log-softmax): ``logprob_max_abs_diff_8b``.
* training step: FSDP2 single-device actor, bf16 compute / fp32 master, Qwen3-8B layer shapes with
  ``train_layers`` layers (fp32 master + AdamW of 36 layers do not fit one GPU), 64 sequences of
  128 + 128 tokens, micro-batch 8, one PPO-clip step: default vs exact; goal exact / default <= 1.25.
* GRPO: one full step (rollout + log-probs + update + sync) of ``configs/grpo_dense_bf16.yaml`` on a
  random Qwen3-1.7B shape, 16 prompts x 8 x 256 new tokens, both ways (median of 2 steps after 1
  warm-up), plus the largest |rollout - training| log-prob difference seen in exact mode.

``smoke=True``: the same three measurements on the tiny shape on CPU in seconds (numbers meaningless
except the exact-mode difference, which must be 0).

    python -m benchmarks.exact.bench_exact            # GPU (prints a table, writes results/exact.json)
    python -m benchmarks.exact.bench_exact --smoke    # CPU
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

import benchmarks.gpu._common as C


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _exact_forward_log_probs(model, out, rows_per_chunk: int) -> torch.Tensor:
    """What the exact trainer computes for the engine's rows (whole sequences, exact log-softmax)."""
    from lumenrl_backends.exact import exact_token_log_probs
    from lumenrl_backends.training.modeling import response_logits

    device = next(model.parameters()).device
    T = out.batch["responses"].shape[1]
    chunks = []
    with torch.no_grad():
        for s in range(0, len(out), rows_per_chunk):
            rows = slice(s, s + rows_per_chunk)
            logits = response_logits(model, out.batch["input_ids"][rows].to(device),
                                     out.batch["attention_mask"][rows].to(device),
                                     out.batch["position_ids"][rows].to(device), T)
            chunks.append(exact_token_log_probs(logits, out.batch["responses"][rows].to(device), 1.0).cpu())
    return torch.cat(chunks)


def decode(shape: str, batch: int, prompt: int, new: int, device: str) -> dict[str, Any]:
    from lumenrl_backends.engines import NativeEngine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prompts = C.prompt_batch(batch, prompt, seed=1)
    if shape == "tiny":
        prompts.batch["input_ids"] = prompts.batch["input_ids"] % (C.VOCAB - 10) + 2
    result: dict[str, Any] = {}
    for mode in ("default", "exact"):
        model = C.random_model(shape, device=device, dtype=dtype)
        engine = NativeEngine(model, C.StubTokenizer(), device=device, max_batch_size=batch, max_seq_len=prompt + new,
                              exact_logprobs=mode == "exact")
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new}
        engine.generate(prompts, params)  # warm-up: kernels compiled, every (bucket, kv_len) graph captured
        _sync()
        out = engine.generate(prompts, params)
        perf = out.meta_info["perf"]
        decode_s = perf["seconds"] - perf.get("prefill_seconds", 0.0)
        result[f"decode_tok_s_{mode}"] = batch * (new - 1) / max(decode_s, 1e-9)
        if mode == "exact":
            mask = out.batch["response_mask"].bool()
            trained = _exact_forward_log_probs(engine.model, out, rows_per_chunk=8)
            result["logprob_max_abs_diff_decode"] = float((trained - out.batch["rollout_log_probs"])[mask].abs().max())
        del engine, model, out
        _free()
    result["decode_ratio_exact_over_default"] = result["decode_tok_s_exact"] / result["decode_tok_s_default"]
    return result


def _train_batch(rows: int, prompt: int, resp: int, vocab: int, device: str):
    from lumenrl_core.data_proto import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab - 1, (rows, prompt + resp), generator=g)
    mask = torch.ones_like(ids)
    lengths = torch.randint(resp // 2, resp + 1, (rows,), generator=g)
    resp_mask = (torch.arange(resp)[None] < lengths[:, None]).long()
    mask[:, prompt:] = resp_mask
    tensors = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:], "response_mask": resp_mask,
               "advantages": torch.randn(rows, resp, generator=g), "old_log_probs": torch.full((rows, resp), -5.0)}
    return DataProto.from_dict(tensors=tensors)


def _pg_loss(outputs, micro):
    mask = micro.batch["response_mask"].float()
    ratio = torch.exp(outputs["log_probs"] - micro.batch["old_log_probs"])
    loss = -(ratio * micro.batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)
    return loss, {}


def train_step(shape: str, layers: int, rows: int, prompt: int, resp: int, micro: int, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from lumenrl_backends.training.fsdp2 import FSDP2Backend
    from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig

    config = C.qwen3_config(shape)
    config.num_hidden_layers = min(layers, config.num_hidden_layers)
    batch = _train_batch(rows, prompt, resp, config.vocab_size, device)
    result: dict[str, Any] = {"train_layers": config.num_hidden_layers}
    for mode in ("default", "exact"):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        backend = FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-6),
                               train=PolicyTrainConfig(micro_batch_size=micro, single_device="on"),
                               num_training_steps=10, device=torch.device(device), exact_logprobs=mode == "exact")
        times = []
        for _ in range(3):  # first: warm-up
            _sync()
            start = time.perf_counter()
            backend.train_step(batch, _pg_loss)
            _sync()
            times.append(time.perf_counter() - start)
        result[f"train_step_s_{mode}"] = statistics.median(times[1:])
        del backend, model
        _free()
    result["train_ratio_exact_over_default"] = result["train_step_s_exact"] / result["train_step_s_default"]
    return result


def grpo(shape: str, prompts: int, generations: int, new: int, micro: int, device: str, steps: int) -> dict[str, Any]:
    from benchmarks.gpu import bench_grpo_step as G

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        G.save_random_model(shape, model_dir, device)
        for mode in ("default", "exact"):
            args = Namespace(generations=generations, prompts=prompts, new=new, micro_batch=micro, steps=steps,
                             device=device, override=[f"policy.rollout.exact_logprobs={mode == 'exact'}".lower(),
                                                      "policy.rollout.exact_logprobs_check=warn"])  # report, not raise
            trainer, _ = G.build_trainer(model_dir, Path(tmp) / f"run_{mode}", args)
            times, diffs = [], []
            for step in range(1, steps + 2):
                start = time.perf_counter()
                metrics = trainer.train_step(step)
                _sync()
                times.append(time.perf_counter() - start)
                diffs.append(metrics.get("actor/logprob_max_abs_diff", float("nan")))
            result[f"grpo_step_s_{mode}"] = statistics.median(times[1:])
            result[f"grpo_logprob_max_abs_diff_{mode}"] = max(diffs)
            del trainer
            _free()
    result["grpo_ratio_exact_over_default"] = result["grpo_step_s_exact"] / result["grpo_step_s_default"]
    return result


def run(smoke: bool) -> dict[str, Any]:
    """Harness entry: decode (8B shape, b64), training step (8B layer shapes), 1.7B GRPO step, both ways."""
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if smoke:
        threads, vocab = torch.get_num_threads(), C.VOCAB
        torch.set_num_threads(1)
        C.VOCAB = 512  # the tiny shape with a small vocabulary: seconds on CPU
        try:
            out = decode("tiny", batch=4, prompt=8, new=6, device=device)
            out.update(train_step("tiny", layers=2, rows=4, prompt=8, resp=8, micro=2, device=device))
        finally:
            torch.set_num_threads(threads)
            C.VOCAB = vocab
        return {"device": device, **out}
    out = {"device": torch.cuda.get_device_name(0)}
    out.update(decode("8b", batch=64, prompt=128, new=128, device=device))
    out.update(train_step("8b", layers=8, rows=64, prompt=128, resp=128, micro=8, device=device))
    out.update(grpo("1.7b", prompts=16, generations=8, new=256, micro=32, device=device, steps=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    result = run(args.smoke)
    for key, value in result.items():
        print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}")
    if not args.smoke:
        C.write_json("exact.json", {"command": C.command_line(), "env": C.environment(), "result": result})


if __name__ == "__main__":
    main()


def sweep_matmul(m_values: tuple[int, ...] = (64, 4096), only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Tile configurations of the exact-mode GEMM on the 8B linear shapes (CUDA), against cuBLAS.

    A configuration may depend on (N, K) only (a weight's shape), never on M, so each row is one
    (N, K, config) timed at every M. ``python -c "from benchmarks.exact.bench_exact import sweep_matmul;
    sweep_matmul()"``."""
    import triton

    from lumenrl_backends.exact import triton_ops as T

    shapes = {"kv": (1024, 4096), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    configs = [(bn, bk, w, s) for bn in (16, 32, 64, 128) for bk in (64, 128) for w in (4, 8) for s in (3, 4)
               if not (bn == 128 and w == 4) and not (bn == 16 and w == 8)]
    if only:
        shapes = {k: v for k, v in shapes.items() if k in only}
    rows = []
    for name, (n, k) in shapes.items():
        w_ = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in m_values}
        base = {m: triton.testing.do_bench(lambda x=xs[m], w=w_: torch.nn.functional.linear(x, w)) for m in m_values}
        for bn, bk, warps, stages in configs:
            row: dict[str, Any] = {"shape": name, "bn": bn, "bk": bk, "warps": warps, "stages": stages}
            for m in m_values:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(m, T.MM_BLOCK_M) * triton.cdiv(n, bn),)

                def call(m=m, x=xs[m], w=w_, n=n, k=k, out=out, grid=grid, bn=bn, bk=bk, warps=warps, stages=stages):
                    T._matmul_kernel[grid](x, w, out, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                           HAS_BIAS=False, BLOCK_M=T.MM_BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                           num_warps=warps, num_stages=stages)
                try:
                    row[f"m{m}_vs_cublas"] = round(base[m] / triton.testing.do_bench(call), 3)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                    row[f"m{m}_vs_cublas"] = f"{type(exc).__name__}"
            rows.append(row)
            print(row, flush=True)
    return rows
