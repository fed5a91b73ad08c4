"""FP8 rollout vs train KL on a small Qwen3 that was actually TRAINED (issue #5's KL goal), CPU or GPU.

Why: the H200 runs only have random-init Qwen3-8B weights; random deep nets have no learned structure,
so their FP8 rounding errors are not representative of a trained checkpoint. This script trains a
small Qwen3 for real, on a synthetic language with a known conditional distribution, and measures the
same KLs as ``benchmarks/gpu/bench_fp8_rollout.py`` (whose ``exact_kl``/``sampled_metrics`` it imports).

Synthetic language (``SyntheticLanguage``; ids 0 = pad, 1 = eos are never emitted, content ids
2..V-1): a random sparse Markov chain, each content token has ``K = 4`` distinct random successors
with transition probabilities drawn from Dirichlet(1, 1, 1, 1), plus an induction / copy rule: if the
current token ``x_t`` occurred before (most recent earlier position ``j``), then with probability
``p_copy = 0.5`` the next token is ``x_{j+1}`` (what followed it last time), else the Markov step.
The true next-token distribution ``p_true(. | prefix)`` is therefore known exactly at every position:
we report its mean entropy (the best achievable loss), the trained model's held-out loss,
KL(p_true || p_model) and the model's mean next-token entropy (vs log V for a uniform model).
The first token is uniform over content ids. Sequences are 128 tokens.

Model: ``AutoConfig.for_model("qwen3")``, hidden 256, 4 layers, 4 heads / 2 KV heads of dim 64,
intermediate 1024, vocab 512, untied lm_head (every linear's in/out dims are multiples of 128, so
fp8_block's 128x128 weight blocks apply). Training: float32, AdamW (lr 3e-3, wd 0.01, 20 warm-up
steps, cosine to 10 %), batch 8 x 128, fresh sequences every step, ``--steps`` (default 400).
The checkpoint is written with ``save_pretrained`` to ``--cache`` (default
``/tmp/lumenrl_rollout_kl_cache``, never committed) and reloaded with
``AutoModelForCausalLM.from_pretrained(..., dtype=bfloat16)`` like a user's checkpoint; a cached
checkpoint of the same settings is reused (``--retrain`` forces training).

Measurement, for the trained model and for an UNTRAINED (random-init, same config, bf16) copy: the
trainer is the bf16 HF model (teacher-forced forward over prompt + response gives ``p_train``); each
engine is ``lumenrl_backends.engines.NativeEngine`` over a copy of it: ``bf16`` (no quantization),
``fp8_row`` / ``fp8_block`` (``get_quant_scheme``), ``fp8_row+kv`` (plus FP8 KV cache), ``+head`` (the
output head quantized too), ``+fusedmlp`` (``fp8_row`` with the fused SwiGLU MLP: 1 x 128 group scales on
the down projection's input; ``+tokmlp``: without, the default), ``+tokattn`` (with an FP8 cache: the
attention output quantized per token before ``o_proj`` instead of handed over as FP8 codes in V's units,
the default since session 6; this shows in the sampled k1/k3 only, see below), ``+tokln`` (the RMSNorm
output normalised, then quantized, instead of ``rmsnorm_quantize_fp8``'s one pass), ``+unfusedrope``
(q/k norms, RoPE and the KV-cache write as HF modules and ``cache.update`` instead of the fused decode
op, which is bit-identical: only speed differs). The engine
samples at temperature 1 ``--prompts`` (32) prompts of 64 tokens from the language, 64 new tokens
each (EOS ignored). KLs per response position, averaged (definitions in bench_fp8_rollout):
``kl_k1``/``kl_k3`` sampled from the engine's own log-probs, and exact over the vocabulary
``KL(p_roll || p_train)`` before and ``KL(q_TIS || p_train)`` after token-level TIS with cap 2,
where ``p_roll`` comes from a teacher-forced forward of the engine's (quantized) model. That forward
does not go through the engine's KV cache, so the exact KLs of ``fp8_row+kv`` equal ``fp8_row``'s:
the FP8 KV cache shows only in the sampled k1/k3. Note on the after-TIS number: ``q_TIS`` equals
``p_train`` exactly at every position where ``p_train <= 2 p_roll`` for all tokens, so it is ~0
unless some token's train probability exceeds twice its rollout probability; ``kl_exact_before``
is the stricter measure of the mismatch.

An 8B (``--preset qwen3-8b``, GPU): Qwen3-8B's dimensions (36 layers, hidden 4096, intermediate 12288,
32 / 8 heads of 128, the 151,936-token untied head, RoPE theta 1e6), trained in the job from random
init on the same kind of language over its first ``--lang-vocab`` ids (the model also learns to give
the other ids ~no mass: ``mass_outside_language``). Weights are bf16, with float32 AdamW moments and
each update written back with stochastic rounding (``AdamWBF16``; 12 bytes per parameter, ~100 GB with
the gradients: what fits one H200 next to the activations; plain bf16 AdamW stalled at the unigram loss),
initialised on the GPU, and the model stays in the process (``--cache ''``: no 16 GB checkpoint write). It is an
8B-shaped network with learned structure, not a pretrained LLM: what it shows is whether FP8 noise
through 36 trained layers stays small, which random-init weights cannot show (their near-tied logits
move with any rounding).

    python benchmarks/quant/bench_rollout_kl_trained.py            # ~5 min on 1 CPU thread
    python benchmarks/quant/bench_rollout_kl_trained.py --retrain --steps 600
    python benchmarks/quant/bench_rollout_kl_trained.py --preset qwen3-8b --cache '' --train-dtype bfloat16 \
        --lang-vocab 1024 --steps 400 --train-budget-s 250 --train-batch 16 --lr 3e-4 \
        --engines bf16,fp8_row+kv+head,fp8_row,fp8_block --untrained-engines fp8_row+kv+head   # H200: ~6 min
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

import benchmarks.gpu.bench_fp8_rollout as R  # noqa: E402
from benchmarks.gpu._common import StubTokenizer, command_line, environment, print_table, write_json  # noqa: E402
from lumenrl_backends.engines import KernelOptions, NativeEngine  # noqa: E402
from lumenrl_quant import get_quant_scheme  # noqa: E402

KL_GOAL = 1e-3  # issue #5: KL(rollout || train) <= 1e-3 after TIS
MODEL_DIMS = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "tie_word_embeddings": False,
              "rope_theta": 10_000.0}
# --preset qwen3-8b: Qwen3-8B's own dimensions (every decoder linear, the 151,936-token head); the synthetic
# language then uses only the first --lang-vocab ids and the model learns to give the rest ~no mass
PRESETS = {"small": {}, "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                     "vocab_size": 151936, "rope_theta": 1_000_000.0}}


class SyntheticLanguage:
    """Sparse random Markov chain + copy-what-followed-last-time rule, exact ``p_true`` (module docstring)."""

    def __init__(self, vocab: int = 512, successors: int = 4, p_copy: float = 0.5, seed: int = 0) -> None:
        if vocab < successors + 3:
            raise ValueError(f"vocab={vocab} must be >= successors + 3 = {successors + 3}")
        if not 0.0 <= p_copy <= 1.0:
            raise ValueError(f"p_copy={p_copy} must be in [0, 1]")
        gen = torch.Generator().manual_seed(seed)
        n = vocab - 2
        self.vocab, self.p_copy = vocab, p_copy
        succ = torch.stack([torch.randperm(n, generator=gen)[:successors] for _ in range(n)]) + 2
        probs = -torch.log(torch.rand(n, successors, dtype=torch.float64, generator=gen))  # Gamma(1): Dirichlet(1)
        self.transition = torch.zeros(vocab, vocab, dtype=torch.float64)  # rows 0, 1 unused
        self.transition[2:].scatter_(1, succ, probs / probs.sum(-1, keepdim=True))

    def sample(self, batch: int, length: int, *, seed: int, with_probs: bool = False) -> Any:
        """(batch, length) int64 ids; with ``with_probs`` also (batch, length - 1, V) float64 ``p_true`` of
        tokens 1..length-1 given their prefixes."""
        gen = torch.Generator().manual_seed(seed)
        rows = torch.arange(batch)
        ids = torch.empty(batch, length, dtype=torch.int64)
        ids[:, 0] = torch.randint(2, self.vocab, (batch,), generator=gen)
        after = torch.full((batch, self.vocab), -1, dtype=torch.int64)  # token that followed tok's last use
        probs = torch.empty(batch, length - 1, self.vocab, dtype=torch.float64) if with_probs else None
        for t in range(length - 1):
            cur = ids[:, t]
            p = self.transition[cur].clone()
            prev = after[rows, cur]
            seen = prev >= 0
            p[seen] *= 1.0 - self.p_copy
            p[rows[seen], prev[seen]] += self.p_copy
            ids[:, t + 1] = torch.multinomial(p, 1, generator=gen).squeeze(1)
            after[rows, cur] = ids[:, t + 1]
            if probs is not None:
                probs[:, t] = p
        return (ids, probs) if with_probs else ids


def qwen3_small(dims: dict | None = None) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3", **(dims or MODEL_DIMS), max_position_embeddings=512,
                                attn_implementation="sdpa", pad_token_id=0, eos_token_id=1)


class SynthTokenizer(StubTokenizer):
    pad_token_id, eos_token_id = 0, 1


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 rounding up or down with probability proportional to the distance (unbiased):
    random low 16 bits are added to the float32 pattern, then truncated (sign-magnitude, so negative
    values round their magnitude the same way)."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bfloat16 weights: float32 moments, the update computed in float32 and written back with
    stochastic rounding. Round-to-nearest would drop every update under half a bf16 ulp (an update of
    2e-4 is lost on any weight above 0.064, and on every RMSNorm gain), which stalled an 8B run at the
    language's unigram loss; stochastic rounding keeps the expected update exact (12 bytes / parameter)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p, dtype=torch.float32),
                                 v=torch.zeros_like(p, dtype=torch.float32))
                state["step"] += 1
                g = p.grad.float()
                state["m"].lerp_(g, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["v"] / (1 - beta2 ** state["step"])).sqrt_().add_(eps)
                new = p.float().mul_(1 - lr * decay).addcdiv_(state["m"], denom, value=-lr / (1 - beta1 ** state["step"]))
                p.copy_(stochastic_round_bf16(new) if p.dtype == torch.bfloat16 else new)
                del g, denom, new


def train(lang: SyntheticLanguage, *, steps: int, batch: int, seq: int, lr: float, device: str,
          seed: int = 0, log_every: int = 25, dims: dict | None = None,
          dtype: torch.dtype = torch.float32, budget_s: float = 0.0) -> tuple[Any, dict]:
    """AdamW on fresh sequences every step. ``dtype=bfloat16`` keeps the weights in bf16 with float32
    moments and stochastic rounding (:class:`AdamWBF16`: what fits an 8B model with its optimizer on one
    GPU); the weights are initialised on ``device`` directly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_small(dims), dtype=dtype).train()
    if dtype == torch.bfloat16:
        opt: torch.optim.Optimizer = AdamWBF16(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, steps - warm))))))
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids = lang.sample(batch, seq, seed=1_000_000 + step).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise SystemExit(f"training diverged at step {step}: loss {float(loss)}; lower --lr (now {lr})")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"train step {step:4d} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if budget_s and time.perf_counter() - t0 > budget_s:  # keep time for the measurement (device jobs)
            print(f"train: stopped after {step + 1} of {steps} steps (--train-budget-s {budget_s:g})", flush=True)
            break
    tail = losses[-max(1, len(losses) // 20):]
    del opt
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None
    return model.eval(), {"peak_gpu_gib": peak, "steps": len(losses), "steps_planned": steps, "batch": batch, "seq": seq,
                          "lr": lr, "dtype": str(dtype).removeprefix("torch."),
                          "train_seconds": time.perf_counter() - t0, "final_train_loss": sum(tail) / len(tail),
                          "first_train_loss": losses[0], "loss_every_25": losses[::25]}


def model_quality(model: Any, lang: SyntheticLanguage, *, batch: int = 32, seq: int = 128, seed: int = 7) -> dict:
    """Held-out loss vs the source's entropy, KL(p_true || p_model), model entropy (all nats/token)."""
    ids, p_true = lang.sample(batch, seq, seed=seed, with_probs=True)
    dev = next(model.parameters()).device
    with torch.no_grad():
        lp = torch.cat([torch.log_softmax(model(input_ids=ids[s:s + 4].to(dev)).logits[:, :-1].double(), dim=-1).cpu()
                        for s in range(0, batch, 4)])
    entropy = float(-(lp.exp() * lp).sum(-1).mean())
    outside = float(lp[..., lang.vocab:].exp().sum(-1).mean()) if lp.shape[-1] > lang.vocab else 0.0
    lp = lp[..., :lang.vocab]  # p_true is 0 beyond the language's ids (a model vocabulary may be larger)
    log_true = torch.log(p_true.clamp_min(1e-300))
    return {
        "source_entropy": float(-(p_true * torch.where(p_true > 0, log_true, 0.0)).sum(-1).mean()),
        "heldout_loss": float(-lp.gather(-1, ids[:, 1:, None]).mean()),
        "kl_true_model": float((p_true * torch.where(p_true > 0, log_true - lp, 0.0)).sum(-1).mean()),
        "model_entropy": entropy,
        "uniform_entropy": math.log(lang.vocab),
        "mass_outside_language": outside,
    }


def train_kwargs(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "batch": args.train_batch, "seq": args.seq, "lr": args.lr,
            "dtype": getattr(torch, args.train_dtype), "budget_s": args.train_budget_s}


def trained_model(args: argparse.Namespace, lang: SyntheticLanguage, device: str) -> tuple[Any, dict]:
    """The trained model in bf16 and its train log: reloaded from a ``save_pretrained`` checkpoint
    (trained now unless cached) or, with ``--cache ''`` (an 8B), trained in this process and kept."""
    if not args.cache:
        model, log = train(lang, device=device, **train_kwargs(args))
        model = model.to(torch.bfloat16)
        model.generation_config.eos_token_id = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return model, {**log, "cached": False, "saved": False}
    path, log = trained_checkpoint(args, lang, device)
    return load_bf16(path, device), log


def trained_checkpoint(args: argparse.Namespace, lang: SyntheticLanguage, device: str) -> tuple[Path, dict]:
    """save_pretrained'd checkpoint dir for these settings (trained now unless cached) and its train log."""
    key = json.dumps({"dims": MODEL_DIMS, "steps": args.steps, "batch": args.train_batch, "seq": args.seq,
                      "lr": args.lr, "lang_seed": args.lang_seed, "lang_vocab": lang.vocab,
                      "dtype": args.train_dtype, "budget_s": args.train_budget_s, "v": 2}, sort_keys=True)
    path = Path(args.cache) / ("qwen3_synth_" + hashlib.sha1(key.encode()).hexdigest()[:12])
    log_file = path / "train_log.json"
    if log_file.exists() and not args.retrain:
        print(f"reusing trained checkpoint {path}", flush=True)
        return path, {**json.loads(log_file.read_text()), "cached": True}
    model, log = train(lang, device=device, **train_kwargs(args))
    model.save_pretrained(path)
    log_file.write_text(json.dumps(log, indent=2) + "\n")
    return path, {**log, "cached": False}


def load_bf16(path: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def random_bf16(device: str, seed: int = 0, dims: dict | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_small(dims), dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def measure_engine(name: str, train_model: Any, batch: Any, params: dict, *, device: str,
                   max_seq_len: int) -> dict:
    """One engine's sampled and exact KLs vs ``train_model`` (its own copy of the weights)."""
    row: dict[str, Any] = {"engine": name}
    scheme = R.scheme_of(name)
    try:
        flags = R.variant(name)[1]
        quant = None if scheme is None else get_quant_scheme(scheme, quantize_lm_head="head" in flags)
        engine = NativeEngine(copy.deepcopy(train_model), SynthTokenizer(), device=device,
                              max_batch_size=batch.batch["input_ids"].shape[0], max_seq_len=max_seq_len,
                              quant_scheme=quant, kv_cache_dtype="fp8" if "kv" in flags else "auto",
                              kernels=KernelOptions(
                                  fuse_fp8_mlp="fusedmlp" in flags, fp8_act_kernel="inductmlp" not in flags,
                                  fp8_attn_out="tokattn" not in flags, fp8_norm_quant="tokln" not in flags,
                                  fused_qk_rope="unfusedrope" not in flags))
        if scheme is not None:
            row.update(quantized_linears=len(engine.quant_report.quantized),
                       skipped_linears=len(engine.quant_report.skipped),
                       lm_head=type(getattr(engine.model, "lm_head", None)).__name__)
            check = R.check_linear(engine.model)
            row.update(linear_path=check["path"], linear_check_sqnr_db=check["sqnr_db"])
        t0 = time.perf_counter()
        out = engine.generate(batch, params)
        row["generate_s"] = time.perf_counter() - t0
        metrics = R.sampled_metrics(train_model, out)
        row.update(kl_k1_sampled=metrics.get("rollout_correction/kl_k1"),
                   kl_k3_sampled=metrics.get("rollout_correction/kl_k3"))
        row.update(R.exact_kl(engine.model, train_model, out.batch["input_ids"], params["max_new_tokens"]))
        row["meets_goal_after_tis"] = row["kl_exact_after_tis"] <= KL_GOAL
    except Exception as err:  # noqa: BLE001 - keep the other engines' numbers
        row["error"] = f"{type(err).__name__}: {err}"[:400]
        print(f"ERROR {name}: {row['error']}", flush=True)
    gc.collect()
    return row


def run_all(train_model: Any, lang: SyntheticLanguage, engines: list[str], *, prompts: int, prompt_len: int,
            new: int, device: str, label: str) -> list[dict]:
    from lumenrl_core.data_proto import DataProto

    ids = lang.sample(prompts, prompt_len, seed=4242)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    params = {"temperature": 1.0, "max_new_tokens": new, "seed": 11, "ignore_eos": True}
    rows = []
    for name in engines:
        row = {"model": label, **measure_engine(name, train_model, batch, params, device=device,
                                                max_seq_len=prompt_len + new)}
        rows.append(row)
        print_table([row], COLUMNS)
    return rows


COLUMNS = ["model", "engine", "kl_exact_before", "kl_exact_after_tis", "kl_k1_sampled", "kl_k3_sampled",
           "meets_goal_after_tis", "lm_head", "linear_path", "generate_s", "error"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="bf16,fp8_row,fp8_block,fp8_row+kv")
    ap.add_argument("--steps", type=int, default=400, help="training steps")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-budget-s", type=float, default=0.0, help="stop training after this many seconds (0: off)")
    ap.add_argument("--seq", type=int, default=128, help="training sequence length")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lang-seed", type=int, default=0)
    ap.add_argument("--lang-vocab", type=int, default=0, help="ids of the synthetic language (0: the model's vocab)")
    ap.add_argument("--train-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="training weights; bfloat16: float32 AdamW moments, stochastic rounding (an 8B on one GPU)")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS),
                    help="model dims: small (hidden 256 x 4 layers) or qwen3-8b (Qwen3-8B's dims)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--cache", default="/tmp/lumenrl_rollout_kl_cache",
                    help="checkpoint cache dir; '' trains in this process without saving (an 8B)")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--no-untrained", action="store_true", help="skip the random-init contrast")
    ap.add_argument("--untrained-engines", default="", help="engines of the random-init contrast (default: --engines)")
    ap.add_argument("--dims", default="", help='JSON overrides of the model dims, e.g. \'{"hidden_size": 1024, '
                    '"num_hidden_layers": 12}\' (wider / deeper probes; the cache key includes them)')
    ap.add_argument("--out", default="rollout_kl_trained.json")
    args = ap.parse_args(argv)
    MODEL_DIMS.update(PRESETS[args.preset])
    if args.dims:
        extra = json.loads(args.dims)
        unknown = set(extra) - set(MODEL_DIMS)
        if unknown:
            raise SystemExit(f"--dims keys {sorted(unknown)}; allowed: {sorted(MODEL_DIMS)}")
        MODEL_DIMS.update(extra)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = args.engines.split(",")
    lang_vocab = args.lang_vocab or MODEL_DIMS["vocab_size"]
    if not 6 < lang_vocab <= MODEL_DIMS["vocab_size"]:
        raise SystemExit(f"--lang-vocab={args.lang_vocab}; allowed: 0 (the model's) or 7..{MODEL_DIMS['vocab_size']}")
    lang = SyntheticLanguage(vocab=lang_vocab, seed=args.lang_seed)
    result: dict[str, Any] = {"command": command_line(), "env": environment(), "args": vars(args),
                              "model_dims": MODEL_DIMS, "kl_goal": KL_GOAL,
                              "language": {"successors": 4, "dirichlet_alpha": 1.0, "p_copy": lang.p_copy,
                                           "vocab": lang.vocab},
                              "train_forward_dtype": "bfloat16"}
    trained, result["training"] = trained_model(args, lang, device)
    result["quality_trained_bf16"] = model_quality(trained, lang)
    print("trained (bf16):", result["quality_trained_bf16"], flush=True)
    rows = run_all(trained, lang, engines, prompts=args.prompts, prompt_len=args.prompt_len, new=args.new,
                   device=device, label="trained")
    result["rows"] = rows
    write_json(args.out, result)
    if not args.no_untrained:
        del trained
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        untrained = random_bf16(device)
        result["quality_untrained_bf16"] = model_quality(untrained, lang)
        print("untrained:", result["quality_untrained_bf16"], flush=True)
        rows += run_all(untrained, lang, args.untrained_engines.split(",") if args.untrained_engines else engines,
                        prompts=args.prompts, prompt_len=args.prompt_len, new=args.new,
                        device=device, label="untrained")
    result["summary"] = {f"{r['model']}/{r['engine']}": {k: r.get(k) for k in (
        "kl_exact_before", "kl_exact_after_tis", "kl_k3_sampled", "meets_goal_after_tis")} for r in rows}
    out = write_json(args.out, result)
    print(f"wrote {out}")
    print_table(rows, COLUMNS)
    return result


SMOKE_DIMS = '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, ' \
             '"num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128}'


def run(smoke: bool) -> dict:
    """Suite entry: exact KL(FP8 rollout || train) before/after TIS on a trained Qwen3-8B-shaped model
    (smoke: a tiny model trained a few steps on the CPU)."""
    engine = "fp8_row+kv+head"
    args = ["--dims", SMOKE_DIMS, "--steps", "4", "--train-batch", "4", "--seq", "32", "--prompts", "2",
            "--prompt-len", "8", "--new", "8", "--threads", "1", "--cache", "", "--no-untrained",
            "--engines", "fp8_row", "--out", "rollout_kl_trained_smoke.json"] if smoke else [
        "--preset", "qwen3-8b", "--cache", "", "--train-dtype", "bfloat16", "--lang-vocab", "1024", "--steps", "400",
        "--train-budget-s", "250", "--train-batch", "16", "--lr", "3e-4", "--engines", f"bf16,{engine}",
        "--no-untrained", "--out", "rollout_kl_trained_8b.json"]
    rows = main(args)["rows"]
    row = next(r for r in rows if r["engine"] == ("fp8_row" if smoke else engine))
    if "error" in row:
        raise RuntimeError(f"{row['engine']}: {row['error']}")
    return {"kl_before_tis": row["kl_exact_before"], "kl_after_tis": row["kl_exact_after_tis"],
            "sampled_k3": row["kl_k3_sampled"]}


if __name__ == "__main__":
    main()
