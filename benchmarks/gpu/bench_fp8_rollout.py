"""BF16 vs FP8 rollout on the same ``native`` engine, and the train/infer log-prob KL of each.

Random-init Qwen3-8B shape, batch 64, prompt 256 + 256 new tokens, temperature 1 (EOS ignored).
Engines: ``bf16`` (the model as is), ``fp8`` (W8A8 blockwise linears from lumenrl-quant,
``fp8_block``: 128x128 weight blocks, 1x128 dynamic activation groups; bf16 KV), and
``fp8+kv`` (plus the FP8 KV cache with per-layer scales recalibrated at each prefill after an
update). The trainer is the BF16 model itself: ``p_train`` comes from a teacher-forced forward
over each rollout's prompt + response.

KL, per response position, averaged over positions:

* sample-based, from the engine's own log-probs of the sampled tokens
  (``lumenrl_quant.correction.rollout_correction_metrics``: k1, k3 of KL(rollout || train));
* exact over the vocabulary, with ``p_roll`` from a teacher-forced forward of the engine's
  (quantized) model: ``KL(p_roll || p_train)`` before correction, and after token-level TIS
  (cap C = 2): importance weights ``w = min(p_train / p_roll, C)`` turn sampling from ``p_roll``
  into sampling from ``q = min(p_train, C p_roll) / Z``; the table gives ``KL(q || p_train)``.

    python benchmarks/gpu/bench_fp8_rollout.py --engines bf16,fp8,fp8+kv
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from lumenrl_backends.engines import NativeEngine  # noqa: E402

TIS_CAP = 2.0


def full_log_probs(model, ids: torch.Tensor, width: int, rows: slice) -> torch.Tensor:
    """(rows, width, V) float32 log-softmax predicting the last ``width`` tokens (full prompts: no padding)."""
    with torch.no_grad():
        logits = model(input_ids=ids[rows].cuda()).logits[:, -width - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def exact_kl(roll_model, train_model, ids: torch.Tensor, width: int, chunk: int = 4) -> dict[str, float]:
    """Mean over positions of KL(p_roll || p_train) and KL(q_TIS || p_train) (see module docstring)."""
    before, after, count = 0.0, 0.0, 0
    for s in range(0, ids.shape[0], chunk):
        rows = slice(s, s + chunk)
        lp_roll, lp_train = full_log_probs(roll_model, ids, width, rows), full_log_probs(train_model, ids, width, rows)
        p_roll = lp_roll.exp()
        before += float((p_roll * (lp_roll - lp_train)).sum(-1).sum())
        log_q = torch.minimum(lp_train, lp_roll + torch.log(torch.tensor(TIS_CAP)))  # unnormalised
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
        after += float((log_q.exp() * (log_q - lp_train)).sum(-1).sum())
        count += lp_roll.shape[0] * lp_roll.shape[1]
        del lp_roll, lp_train, p_roll, log_q
    return {"kl_exact_before": before / count, "kl_exact_after_tis": after / count}


def sampled_metrics(train_model, out) -> dict[str, float]:
    from lumenrl_quant.correction import rollout_correction_metrics, tis_token_weights

    ids, width = out.batch["input_ids"], out.batch["responses"].shape[1]
    train_lp = []
    for s in range(0, ids.shape[0], 4):
        lp = full_log_probs(train_model, ids, width, slice(s, s + 4))
        train_lp.append(lp.gather(-1, out.batch["responses"][s:s + 4, :, None].cuda()).squeeze(-1).cpu())
        del lp
    old = torch.cat(train_lp)
    rollout, mask = out.batch["rollout_log_probs"], out.batch["response_mask"]
    weights = tis_token_weights(old, rollout, mask, clip=TIS_CAP)
    return rollout_correction_metrics(old, rollout, mask, is_weights=weights,
                                      clipped=(weights >= TIS_CAP) & (mask != 0))


def measure(name: str, train_model, batch, params: dict, args) -> dict:
    model = train_model if name == "bf16" else copy.deepcopy(train_model)
    engine = NativeEngine(model, C.StubTokenizer(), device="cuda", max_batch_size=args.batch,
                          max_seq_len=args.prompt + args.new, compile="full" if args.mode == "full" else "none",
                          quant_scheme=None if name == "bf16" else "fp8_block",
                          kv_cache_dtype="fp8" if name.endswith("+kv") else "auto")
    row = {"engine": name}
    try:
        engine.generate(batch, params)  # warm-up: graphs, kernels, KV scales
        out, total = C.timed(lambda: engine.generate(batch, params))
        decode_s = total - out.meta_info["perf"]["prefill_seconds"]
        row.update(e2e_tok_s=args.batch * args.new / total, decode_tok_s=args.batch * (args.new - 1) / decode_s,
                   prefill_s=out.meta_info["perf"]["prefill_seconds"], graph_error=engine.graphs.error)
        metrics = sampled_metrics(train_model, out)
        row.update(kl_k3_sampled=metrics.get("rollout_correction/kl_k3"),
                   kl_k1_sampled=metrics.get("rollout_correction/kl_k1"), sampled_metrics=metrics)
        row.update(exact_kl(engine.model, train_model, out.batch["input_ids"], args.new))
    except Exception as err:  # noqa: BLE001 - keep the other engines' numbers
        row["error"] = f"{type(err).__name__}: {err}"[:400]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--engines", default="bf16,fp8,fp8+kv")
    ap.add_argument("--mode", default="graph", help="native mode: graph or full (torch.compile + graphs)")
    ap.add_argument("--out", default="fp8_rollout.json")
    args = ap.parse_args()
    result = {"command": C.command_line(), "env": C.environment(), "args": vars(args)}
    train_model = C.random_model(args.model)
    batch = C.prompt_batch(args.batch, args.prompt, seed=4)
    params = {"temperature": 1.0, "max_new_tokens": args.new, "seed": 11, "ignore_eos": True}
    rows = []
    for name in args.engines.split(","):
        rows.append(measure(name, train_model, batch, params, args))
        gc.collect()
        torch.cuda.empty_cache()
        result["rows"] = rows
        C.write_json(args.out, result)
    base = next((r for r in rows if r["engine"] == "bf16" and "decode_tok_s" in r), None)
    for r in rows:
        if base and "decode_tok_s" in r:
            r["x_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
    fp8 = next((r for r in rows if r["engine"] == "fp8" and "decode_tok_s" in r), None)
    summary = {}
    if fp8 and base:
        summary["fp8_rollout_speedup_8b_b64"] = {"value": fp8["x_bf16"], "command": result["command"]}
        summary["fp8_rollout_kl_after_tis"] = {
            "value": fp8["kl_exact_after_tis"], "before_tis": fp8["kl_exact_before"],
            "definition": "mean over response positions of KL(q_TIS || p_train), q_TIS = min(p_train, 2 p_roll)/Z",
            "command": result["command"]}
    result["summary"] = summary
    C.write_json(args.out, result)
    C.print_table(rows, ["engine", "e2e_tok_s", "decode_tok_s", "x_bf16", "kl_exact_before", "kl_exact_after_tis",
                         "kl_k3_sampled", "prefill_s", "error"])
    print("summary:", summary)


if __name__ == "__main__":
    main()
