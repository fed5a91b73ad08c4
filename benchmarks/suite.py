"""The benchmark suite: every LumenRL benchmark, named once.

Adding a benchmark
------------------
Write ``fn(smoke: bool) -> dict`` in ``benchmarks/<area>/<module>.py``. It returns numbers (int/float)
and short strings, flat. ``smoke=True`` means tiny shapes on the CPU, done in seconds: the test
command runs every entry that way (``benchmarks/tests/test_benchmarks_smoke.py``), so no benchmark rots.
``smoke=False`` is the real measurement (full sizes, on ``device``). Then add one line below::

    Entry(name="my_bench", target="benchmarks.gpu.bench_x:run", suites=("gpu",),
          numbers=("tok_s",), goal="decode tok/s of X", metric="tok_s", bound=">= 1000", device="cuda")

* ``numbers``: keys the function must return as finite numbers (checked in smoke and full runs).
* ``goal``/``metric``/``bound``: an entry that measures a project goal names the number and the bar
  (``">= 1.5"`` or ``"<= 1e-3"``); ``benchmarks/RESULTS.md`` shows its latest figure.
* ``suites``: the suite names it belongs to; every entry is in ``smoke`` implicitly.

Run: ``python -m benchmarks run SUITE [--smoke] [--only NAME ...] [--budget-s S]`` (or ``lumenrl bench run SUITE``);
``--budget-s``: the seconds the call may take, an entry whose recorded time (median of its last 3 records) does not
fit in what is left is skipped and said so; full runs append to ``benchmarks/history.jsonl``; ``python -m benchmarks results`` rewrites RESULTS.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ENTRIES", "Entry", "entries", "suite_names"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    name: str
    target: str  # "benchmarks.<area>.<module>:<function>", called as fn(smoke: bool) -> dict
    suites: tuple[str, ...]
    numbers: tuple[str, ...] = ()  # keys that must come back finite
    goal: str = ""  # what the goal is, in words ("" = no goal, a measurement only)
    metric: str = ""  # the key of the returned dict that the goal judges
    bound: str = ""  # ">= X" or "<= X"
    device: str = "cuda"  # what a full run needs: "cuda" or "cpu"
    more_goals: tuple[tuple[str, str, str], ...] = ()  # further (goal, metric, bound) judged on the same run
    # ISO date of the last change of what the entry measures (its model, its shape): RESULTS.md judges and spreads
    # only records from then on (older ones stay in the history); "" = every record
    since: str = ""

    def goals(self) -> list[tuple[str, str, str]]:
        """Every (goal, metric, bound) of this entry: the main one first."""
        return ([(self.goal, self.metric, self.bound)] if self.goal else []) + list(self.more_goals)

    def load(self) -> Callable[[bool], dict[str, Any]]:
        module, _, func = self.target.partition(":")
        return getattr(importlib.import_module(module), func)

    def met(self, value: Any, bound: str | None = None) -> bool | None:
        bound = self.bound if bound is None else bound
        if not bound or not isinstance(value, (int, float)):
            return None
        op, _, bar = bound.partition(" ")
        return value >= float(bar) if op == ">=" else value <= float(bar)


ENTRIES: tuple[Entry, ...] = (
    # rollout: the native engine's decode
    Entry(name="decode", target="benchmarks.gpu.bench_decode:run", suites=("gpu", "rollout"),
          numbers=("native_decode_tok_s", "roofline_frac"), goal="native decode at 85% of the bandwidth roofline (8B, batch 64)",
          metric="roofline_frac", bound=">= 0.85"),
    Entry(name="decode_vs_hf", target="benchmarks.gpu.bench_decode:run_vs_hf", suites=("gpu", "rollout"),
          numbers=("native_decode_tok_s", "hf_decode_tok_s", "speedup"), goal="native decode 10x HF generate (8B, batch 64)",
          metric="speedup", bound=">= 10"),
    Entry(name="fp8_rollout", target="benchmarks.gpu.bench_fp8_rollout:run", suites=("gpu", "rollout", "quant"),
          numbers=("bf16_decode_tok_s", "fp8_decode_tok_s", "speedup"), goal="FP8 rollout decode 1.7x BF16 (8B, batch 64)",
          metric="speedup", bound=">= 1.7"),
    Entry(name="decode_linear", target="benchmarks.gpu.bench_decode_linear:run", suites=("gpu", "rollout"),
          numbers=("chain_cublas_ms", "chain_triton_ms", "chain_triton_pdl_ms")),
    Entry(name="attention", target="benchmarks.gpu.bench_attention:run", suites=("gpu", "rollout"),
          numbers=("bf16_us", "fp8_us")),
    Entry(name="sampler", target="benchmarks.gpu.bench_sampler:run", suites=("gpu", "rollout"),
          numbers=("plain_us", "greedy_us")),
    Entry(name="weight_sync", target="benchmarks.gpu.bench_weight_sync:run", suites=("gpu", "train"),
          numbers=("bf16_s", "fp8_s"), goal="trainer -> engine weight sync under 0.5 s (8B, one GPU)",
          metric="bf16_s", bound="<= 0.5"),
    # train
    Entry(name="train", target="benchmarks.gpu.bench_train:run", suites=("gpu", "train"),
          numbers=("mfu", "tokens_per_s", "mfu_fsdp2", "mfu_ungrouped", "grouped_speedup"),
          goal="train step MFU 50% (1.7B, one GPU, single-device path)",
          metric="mfu", bound=">= 0.5",
          more_goals=(("train step MFU 45% through fully_shard (1.7B, FSDP2 on a one-rank mesh)", "mfu_fsdp2",
                       ">= 0.45"),)),
    Entry(name="logprobs", target="benchmarks.gpu.bench_logprobs:run", suites=("gpu", "train"),
          numbers=("forward_us", "backward_us")),
    Entry(name="grpo_step", target="benchmarks.gpu.bench_grpo_step:run", suites=("gpu", "train"),
          numbers=("step_s",)),
    Entry(name="grpo_step_vs_trl", target="benchmarks.gpu.bench_grpo_trl:run", suites=("gpu", "train"),
          numbers=("lumenrl_step_s",), goal="GRPO step 12x faster than TRL (0.6B)",
          metric="speedup", bound=">= 12"),
    # quant
    Entry(name="quantize", target="benchmarks.quant.bench_quantize:bench", suites=("gpu", "quant"),
          numbers=("min_pct_copy",), goal="every quantize kernel at 80% of copy bandwidth",
          metric="min_pct_copy", bound=">= 80"),
    Entry(name="quant_agreement", target="benchmarks.quant.bench_agreement:bench", suites=("gpu", "quant"),
          numbers=("cases", "disagreements")),
    Entry(name="gemm", target="benchmarks.quant.bench_gemm:bench", suites=("gpu", "quant"),
          numbers=("best_fp8_speedup",)),
    Entry(name="linear", target="benchmarks.quant.bench_linear:bench", suites=("gpu", "quant"),
          numbers=("best_fp8_speedup",)),
    Entry(name="decode_gemm", target="benchmarks.quant.bench_decode_gemm:run", suites=("gpu", "quant"),
          numbers=("best_fp8_speedup",)),
    Entry(name="fused_mlp", target="benchmarks.quant.bench_fused_mlp:run", suites=("gpu", "quant"),
          numbers=("fused_speedup",)),
    Entry(name="fp8_training", target="benchmarks.quant.bench_fp8_training:run", suites=("gpu", "quant", "train"),
          numbers=("bf16_step_s", "fp8_step_s", "speedup"), goal="FP8 training step 1.25x BF16 (8B-shaped layers)",
          metric="speedup", bound=">= 1.25"),
    Entry(name="rollout_kl_trained", target="benchmarks.quant.bench_rollout_kl_trained:run",
          suites=("gpu", "quant", "rollout"), numbers=("kl_before_tis", "kl_after_tis"),
          goal="KL(FP8 rollout || train) after TIS <= 1e-3 (trained 8B-shaped model)", metric="kl_after_tis",
          bound="<= 1e-3"),
    # exact (batch-invariant) log-probs: the cost of bitwise on-policy RL
    Entry(name="exact_decode", target="benchmarks.exact.bench_exact:run", suites=("gpu", "rollout", "exact"),
          numbers=("decode_ratio_exact_over_default", "train_ratio_exact_over_default", "logprob_max_abs_diff_decode"),
          goal="exact-logprobs decode >= 0.8x the default fast path (8B, batch 64)",
          metric="decode_ratio_exact_over_default", bound=">= 0.8",
          more_goals=(("exact-logprobs training step cost <= 1.25x the default (8B layer shapes)",
                       "train_ratio_exact_over_default", "<= 1.25"),)),
    # fully asynchronous RL under long-tail response lengths
    Entry(name="async_long_tail", target="benchmarks.async_rl.long_tail:bench", suites=("async_rl",),
          numbers=("sync/samples_per_s", "partial/samples_per_s", "partial/speedup_vs_sync"), device="cpu"),
    Entry(name="async_long_tail_gpu", target="benchmarks.async_rl.long_tail:bench_gpu", suites=("gpu", "async_rl"),
          numbers=("sync/steady_samples_per_s", "partial/steady_samples_per_s", "partial/steady_speedup_vs_sync",
                   "partial/steady_speedup_vs_sync_min", "partial/steady_speedup_vs_sync_max",
                   "partial/speedup_vs_sync", "partial/speedup_vs_sync_min", "partial/speedup_vs_sync_max",
                   "partial/dropped_stale", "partial/first_step_s", "partial/rollouter_idle_ratio",
                   "partial/trainer_wait_s_per_step", "partial/rollouter_ready_s", "partial/startup_overlap_s",
                   "partial/rollouter_boot_s", "partial/rollouter_forked", "sync/step_update_actor_s",
                   "partial/step_update_actor_s", "partial_thread/steady_speedup_vs_sync",
                   "partial_thread/speedup_vs_sync", "partial_thread/step_update_actor_s",
                   "partial_keep/steady_speedup_vs_sync", "partial_keep/speedup_vs_sync",
                   "partial/rollouter_prefill_share", "partial_keep/rollouter_prefill_share"),
          since="2026-12-07T10:00:00Z",  # a Qwen3-0.6B-shaped model from here on (the built-in tiny one before)
          goal="async + partial rollout >= 2.0x synchronous samples/s (one H200, long-tail lengths, steady state; "
               "median of 3 side-by-side pairs since 2026-12-06; a Qwen3-0.6B-shaped model since 2026-12-07)",
          metric="partial/steady_speedup_vs_sync", bound=">= 2.0",
          more_goals=(("async + partial rollout >= 1.5x synchronous samples/s over the whole fit() (20 steps, "
                       "rollouter start-up included; median of 3 pairs since 2026-12-06; 0.6B shape since 2026-12-07)",
                       "partial/speedup_vs_sync",
                       ">= 1.5"),)),
    # Megatron-Core training backend against FSDP2 (needs the lumenrl-backends[megatron] extra)
    Entry(name="megatron_vs_fsdp2", target="benchmarks.megatron.bench_megatron:run", suites=("gpu", "train"),
          numbers=("fsdp2_step_s", "megatron_step_s", "megatron_over_fsdp2_step", "logprob_max_abs_diff"),
          goal="Megatron-Core train_step within 1.25x of FSDP2 (Qwen3-1.7B shape, one H200)",
          metric="megatron_over_fsdp2_step", bound="<= 1.25"),
    # SDDD: trained Eagle3 draft, speculative vs plain greedy decoding in the native engine (also b8/b64, tau)
    Entry(name="sddd_speedup", target="benchmarks.sddd.speedup:run", suites=("gpu", "sddd", "rollout"),
          numbers=("b1_speedup", "b1_tau", "b1_plain_tok_s", "b1_spec_tok_s"),
          goal="speculative decoding >= 2.0x plain at batch 1 (>= 1.3x at batch 8: b8_speedup), trained teacher + Eagle3",
          metric="b1_speedup", bound=">= 2.0"),
    # MoE: R3 under a perturbed (FP8) rollout, and MoE decode speed
    Entry(name="r3_mismatch", target="benchmarks.moe.r3_mismatch:r3_mismatch", suites=("moe",),
          numbers=("route_flip_frac_without_r3", "route_flip_frac_with_r3", "train_infer_kl_without_r3",
                   "train_infer_kl_with_r3", "kl_cut"),
          goal="R3 cuts train/infer KL under FP8 rollout >= 2x (0 flips)", metric="kl_cut", bound=">= 2",
          device="cpu"),
    Entry(name="moe_decode_speed", target="benchmarks.moe.decode_speed:moe_decode_speed", suites=("gpu", "moe", "rollout"),
          numbers=("native_decode_tok_s", "record_overhead_pct", "record_overhead_spread_pct", "native_vs_hf",
                   "grouped_mm_decode_tok_s",
                   "fp8_experts_vs_bf16"),
          goal="native MoE decode >= 75% of the HBM roofline (Qwen3-30B-A3B shape x12 layers, batch 64, bf16)",
          metric="roofline_pct", bound=">= 75",
          more_goals=(("FP8 expert weights decode >= 1.3x the bf16 engine (same shape and job)", "fp8_experts_vs_bf16",
                       ">= 1.3"),
                      ("R3 route recording costs <= 3% of MoE decode time (median of 3 runs, each the median of 5 "
                       "interleaved calls after a warm-up)", "record_overhead_pct", "<= 3"))),
    # scale-out: data-parallel rollout and the GRPO step over ranks
    Entry(name="rollout_dp", target="benchmarks.scale.rollout_dp:run", suites=("scale",),
          numbers=("tok_s_1proc", "tok_s_2proc", "speedup_2proc", "speedup_2proc_same_batch"), device="cpu"),
    Entry(name="grpo_scaling", target="benchmarks.scale.grpo_scaling:run", suites=("scale",),
          numbers=("step_s_1", "samples_s_1"),
          goal="GRPO step (rollout + training) scaling efficiency at 8 GPUs (1.7B shape)",
          metric="efficiency_8", bound=">= 0.85"),
    # model parallelism: FSDP2 x TP+SP mesh (needs >= 2 GPUs: not in the 1-GPU "gpu" suite)
    Entry(name="tp_train", target="benchmarks.parallel.bench_tp:run", suites=("parallel",),
          numbers=("tp1_train_tok_s", "tp2_train_tok_s", "tp2_prefill_tok_s")),
    # LoRA vs full fine-tuning (8B layer shapes, one GPU)
    Entry(name="lora", target="benchmarks.lora.bench_lora:run", suites=("gpu", "train"),
          numbers=("full_step_s", "lora_step_s", "lora_step_ratio", "lora_trainable_frac")),
)


def entries(suite: str, only: tuple[str, ...] = ()) -> list[Entry]:
    """Entries of ``suite`` (``smoke`` and ``all``: every entry), restricted to ``only`` names if given."""
    if suite not in suite_names():
        raise SystemExit(f"unknown suite {suite!r}; known: {suite_names()}")
    chosen = [e for e in ENTRIES if suite in ("smoke", "all") or suite in e.suites]
    names = [e.name for e in chosen]
    unknown = sorted(set(only) - set(names))
    if unknown:
        others = {e.name: e.suites for e in ENTRIES if e.name in unknown}
        where = "".join(f"; {n!r} is in suites {list(s)}" for n, s in others.items())
        raise SystemExit(f"--only {unknown}: not entries of suite {suite!r} (its entries: {names}){where}")
    return [e for e in chosen if not only or e.name in only]


def suite_names() -> list[str]:
    return sorted({"smoke", "all", *(s for e in ENTRIES for s in e.suites)})
