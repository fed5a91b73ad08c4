"""SDDD benchmark: wall-clock speed-up of speculative over plain greedy decoding in the native engine.

In the job: a Qwen3-architecture teacher (char tokenizer) is trained on lumenrl-sddd's structured corpus
(so it has learned structure), regenerates corpus prompts, and an Eagle3 draft is trained on its captured
hidden states; then, per batch size, the same prompts are decoded greedily with the plain engine (its
CUDA-graph decode step on GPU) and with speculative decoding (draft + verify rounds in CUDA graphs, the draft's
chained steps through torch.compile, k = 5), timed after one warm-up each (graph captures and compiles happen there); batch 1 is eight prompts decoded one at a time (times summed). Reported per batch: plain / speculative tokens per second, speed-up, tau (accepted
tokens per verify forward, measured), whether the outputs were identical, the share of identical rows and,
for rows that differ, the largest gap between the two tokens' logits at the first difference under a
float32 copy of the teacher (``lumenrl_sddd.lossless``: bf16 verify and decode kernels round differently,
so rows may part at near-ties; a gap far above bf16 rounding would be a real error).

``fn(smoke)``: smoke = CPU, tiny shapes, seconds. Full (GPU): hidden 1024, 16 layers, batches 1, 8, 64.
GPU command:  python -m benchmarks.sddd.speedup   (``--profile``: where a round's time goes, no training)
"""

from __future__ import annotations

import copy
import json
import tempfile
import time

import torch

__all__ = ["run", "main"]


def _setup(smoke: bool, device: torch.device) -> dict:
    from lumenrl_backends.models import build_tiny_model, load_model_and_tokenizer
    from lumenrl_sddd.capture import capture, eagle3_layer_ids, regenerate
    from lumenrl_sddd.corpus import corpus_lines, encode_lines, prompts_from_lines, train_causal_lm
    from lumenrl_sddd.eagle3 import Eagle3Draft
    from lumenrl_sddd.vocab import token_counts

    shape = dict(num_hidden_layers=4) if smoke else dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=1024)
    path = build_tiny_model("qwen3", tempfile.mkdtemp(prefix="sddd_teacher_"), seed=0, **shape)
    model, tok = load_model_and_tokenizer(str(path), dtype="float32")
    model.to(device)
    steps, draft_steps, batch = (30, 20, 8) if smoke else (800, 1600, 64)
    t0 = time.perf_counter()
    losses = train_causal_lm(model, encode_lines(tok, corpus_lines(4096, seed=0), 64), pad_id=tok.pad_token_id,
                             steps=steps, batch_size=batch, lr=3e-3 if smoke else 1e-3)
    teacher_s = time.perf_counter() - t0
    layers = eagle3_layer_ids(model.config.num_hidden_layers)
    prompts = prompts_from_lines(tok, corpus_lines(16 if smoke else 1024, seed=1), 10)
    ids, mask = regenerate(model, prompts, max_new_tokens=24 if smoke else 96, pad_id=tok.pad_token_id)
    cap = {k: v.to(device) for k, v in capture(model, ids, mask, layers).items()}
    draft = Eagle3Draft.from_teacher(model, counts=token_counts(ids.cpu(), mask.cpu(), model.config.vocab_size),
                                     draft_vocab_size=model.config.vocab_size, aux_layer_ids=layers, ttt_steps=5).to(device)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3 if smoke else 1e-3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, draft_steps, eta_min=1e-5)  # settles the late steps
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(draft_steps):
        sel = torch.randint(0, ids.shape[0], (min(32, ids.shape[0]),), generator=gen).to(device)
        loss, metrics = draft.ttt_loss({k: v[sel] for k, v in cap.items()})
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    if not smoke:
        model.to(torch.bfloat16)
    return {"model": model.eval(), "tok": tok, "draft": draft.eval(), "teacher_loss": losses[-1], "teacher_s": teacher_s,
            "draft_s": time.perf_counter() - t0, "draft_acc0": metrics["sddd/acc_step0"]}


def _timed(engine, batch, params) -> tuple[float, object]:
    engine.generate(batch, params)  # warm-up (graph capture, allocator)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(batch, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run(smoke: bool) -> dict:
    from lumenrl_backends.engines import NativeEngine
    from lumenrl_backends.engines.speculative import attach_draft
    from lumenrl_backends.trainers.sddd_teacher import prompt_batch
    from lumenrl_sddd.corpus import corpus_lines, prompts_from_lines
    from lumenrl_sddd.lossless import divergence_gaps

    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    w = _setup(smoke, device)
    reference = copy.deepcopy(w["model"]).float()  # the tie check's reference (module docstring)
    new_tokens, k = (16, 5) if smoke else (128, 5)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "draft_tokens": k,
              "teacher_final_loss": round(w["teacher_loss"], 3), "draft_acc_step0": round(w["draft_acc0"], 3),
              "teacher_train_s": round(w["teacher_s"], 1), "draft_train_s": round(w["draft_s"], 1)}
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    for b in ((1, 4) if smoke else (1, 8, 64)):
        # batch 1: eight prompts one at a time (one prompt's predictability would decide the figure alone; smoke: two)
        calls = (2 if smoke else 8) if b == 1 else 1
        prompts = prompts_from_lines(w["tok"], corpus_lines(b * calls, seed=100 + b), 10)
        engine, spec_engine = (NativeEngine(w["model"], w["tok"], device=device, max_batch_size=b,
                                            max_seq_len=new_tokens + 64) for _ in range(2))
        attach_draft(spec_engine, w["draft"], k)
        plain_s, spec_s, plain_rows, spec_rows, row_rounds = 0.0, 0.0, [], [], 0
        for first in range(0, len(prompts), b):
            batch = prompt_batch(prompts[first:first + b], w["tok"].pad_token_id)
            seconds, plain = _timed(engine, batch, params)
            plain_s += seconds
            seconds, spec = _timed(spec_engine, batch, params)
            spec_s += seconds
            plain_rows.append(plain.batch["responses"])
            spec_rows.append(spec.batch["responses"])
            row_rounds += spec.meta_info["speculative"]["row_rounds"]
        tokens = len(prompts) * new_tokens
        gaps = divergence_gaps(reference, prompts, torch.cat(plain_rows), torch.cat(spec_rows))
        result.update({f"b{b}_plain_tok_s": round(tokens / plain_s, 1), f"b{b}_spec_tok_s": round(tokens / spec_s, 1),
                       f"b{b}_speedup": round(plain_s / spec_s, 3), f"b{b}_tau": round(tokens / max(row_rounds, 1), 3),
                       f"b{b}_identical": not gaps, f"b{b}_rows_identical": round(1 - len(gaps) / len(prompts), 3),
                       f"b{b}_max_divergence_gap": round(max((g for _, _, g in gaps), default=0.0), 4)})
    result["draft_compiled"] = spec_engine.draft.compiled or "no"  # torch.compile backend, or "no" (CPU, or failed)
    return result


def kernel_summary(events, per: int, top: int = 8) -> dict:
    """Profiler events (``prof.events()``) -> GPU kernels (memcpy/memset excluded) and their GPU time per
    ``per`` (rounds or steps), and the ``top`` kernel names by launches per ``per``."""
    from collections import Counter

    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    names = Counter(e.name for e in kernels)
    return {"kernels": len(kernels) / per, "gpu_ms": sum(e.device_time for e in kernels) / 1e3 / per,
            "top": [(name[:70], round(count / per, 1)) for name, count in names.most_common(top)]}


def _fixed_and_per_round(engine, data, params) -> str:
    """Wall per generate = fixed + rounds x per-round (plain: a round is one decode step): solved from 96 and
    8 new tokens (no profiler)."""
    times, rounds = [], []
    for new in (params["max_new_tokens"], 8):
        engine.generate(data, {**params, "max_new_tokens": new})
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(data, {**params, "max_new_tokens": new})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        rounds.append(out.meta_info["speculative"]["row_rounds"] / len(data) if "speculative" in out.meta_info else new)
    per_round = (times[0] - times[1]) / max(rounds[0] - rounds[1], 1e-9)
    return (f"{per_round * 1e3:.2f} ms per round, {(times[1] - rounds[1] * per_round) * 1e3:.2f} ms fixed per generate "
            f"({rounds[0]:.0f} and {rounds[1]:.0f} rounds)")


def profile(batch: int = 8, k: int = 5) -> None:
    """Where a speculative round's time goes (no training: an untrained teacher of the full shape and an
    untrained draft; the round's work does not depend on acceptance): torch.profiler over one generate.
    Prints the GPU kernels per round (the whole generate's kernels, prefill included, over its rounds) and
    per plain decode step for comparison, their GPU time, the most launched kernels, and the op tables."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lumenrl_backends.engines import NativeEngine
    from lumenrl_backends.engines.speculative import attach_draft
    from lumenrl_backends.models import build_tiny_model, load_model_and_tokenizer
    from lumenrl_backends.trainers.sddd_teacher import prompt_batch
    from lumenrl_sddd.capture import eagle3_layer_ids
    from lumenrl_sddd.eagle3 import Eagle3Draft

    path = build_tiny_model("qwen3", tempfile.mkdtemp(prefix="sddd_profile_"), seed=0, hidden_size=1024,
                            intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=64, max_position_embeddings=1024)
    model, tok = load_model_and_tokenizer(str(path), dtype="bfloat16")
    model.cuda()
    draft = Eagle3Draft.from_teacher(model, counts=torch.ones(model.config.vocab_size), draft_vocab_size=model.config.vocab_size,
                                     aux_layer_ids=eagle3_layer_ids(16), ttt_steps=k)
    engine = NativeEngine(model, tok, device=torch.device("cuda"), max_batch_size=batch, max_seq_len=192)
    data = prompt_batch([[5 + i % 7] * 10 for i in range(batch)], tok.pad_token_id)
    params = {"temperature": 0.0, "max_new_tokens": 96, "ignore_eos": True}
    engine.generate(data, params)  # plain decode: warm-up, then profiled
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = engine.generate(data, params)
        torch.cuda.synchronize()
    plain = kernel_summary(prof.events(), params["max_new_tokens"])
    plain_ms = out.meta_info["perf"]["seconds"] * 1e3 / params["max_new_tokens"]
    plain_prefill_ms = out.meta_info["perf"]["prefill_seconds"] * 1e3
    plain_fit = _fixed_and_per_round(engine, data, params)
    attach_draft(engine, draft, k)
    engine.generate(data, params)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = engine.generate(data, params)
        torch.cuda.synchronize()
    rounds = out.meta_info["speculative"]["row_rounds"] // batch
    spec = kernel_summary(prof.events(), max(rounds, 1))
    print(f"batch {batch}: {rounds} rounds, {out.meta_info['perf']['seconds'] * 1e3 / max(rounds, 1):.2f} ms/round, "
          f"graphs={out.meta_info['perf']['cuda_graphs']}, prefill + context {out.meta_info['perf']['prefill_seconds'] * 1e3:.1f} ms "
          f"(plain prefill {plain_prefill_ms:.1f} ms)")
    print(f"kernels per round: {spec['kernels']:.0f} ({spec['gpu_ms']:.2f} ms GPU); plain decode: "
          f"{plain['kernels']:.0f} kernels per step ({plain['gpu_ms']:.2f} ms GPU, {plain_ms:.2f} ms wall)")
    print("most launched per round:", spec["top"])
    print("wall (no profiler), from two lengths: speculative", _fixed_and_per_round(engine, data, params),
          "| plain", plain_fit)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    import sys

    if "--profile" in sys.argv:
        profile(batch=int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 8)
        return
    result = run(smoke="--smoke" in sys.argv)
    width = max(len(key) for key in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
