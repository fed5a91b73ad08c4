"""Whole-config checks run at load: combinations that would run wrong silently, or crash later.

Each check returns ConfigErrors (one line each); :func:`semantic_errors` runs them all so a config
with several mistakes reports every one at once. Two groups:

- meaning (pure functions of the config): non-finite numbers, batch sizes that skip or trim rows,
  GRPO-style group size < 2, sampling temperature, dual-clip constant, rollout precision vs scheme,
  overlong buffer vs max_new_tokens, an engine that is not installed, async_training keys outside
  the async_rl trainer, a weight_sync.method (or snapshot_dir) the trainer would not use, and every key
  set while nothing reads it (:mod:`.scope`: a switched-off feature's settings, another trainer's keys);
- machine (``machine=True``): model/tokenizer names that resolve to nothing here (no network is
  tried: a local directory, a built-in ``lumenrl:`` name, or a Hugging Face id already in the local
  HF cache), and a device the machine lacks (CUDA probed through the driver library, no torch).
"""

from __future__ import annotations

import ctypes
import dataclasses
import difflib
import importlib.util
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lumenrl_core.builtins import BUILTIN_MODELS, BUILTIN_PREFIX, is_builtin_name
from lumenrl_core.config.errors import ConfigError
from lumenrl_core.config.schema import RunConfig
from lumenrl_core.config.scope import scope_errors

__all__ = ["semantic_errors", "cuda_device_count", "hf_cache_has", "GROUP_ESTIMATORS"]

Source = Callable[[str], str | None]

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")  # advantages relative to the prompt's group: n >= 2
_SCHEME_PRECISION = {"fp8_block": "fp8", "fp8_tensor": "fp8", "fp8_row": "fp8", "fp8_w8a16": "fp8",
                     "mxfp8": "mxfp8", "mxfp4": "mxfp4"}
# rollout engines backed by an external package: plugin name -> import name
_ENGINE_MODULES = {"vllm": "vllm", "sglang": "sglang", "atom": "atom"}


def _err(src: Source, key: str, value: Any, problem: str, allowed: str | None = None) -> ConfigError:
    return ConfigError(key, value, problem=problem, allowed=allowed, source=src(key))


def _numbers(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, key + ".")
        elif isinstance(value, list):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value))
        else:
            yield key, value


def _non_finite(cfg: RunConfig, src: Source) -> list[ConfigError]:
    return [_err(src, k, v, "not a finite number", "a finite float")
            for k, v in _numbers(cfg) if isinstance(v, float) and not math.isfinite(v)]


def _batches(cfg: RunConfig, src: Source) -> list[ConfigError]:
    train, rows = cfg.policy.train, cfg.dataset.train_batch_size * cfg.policy.rollout.n
    mini, key = train.mini_batch_size, "policy.train.mini_batch_size"
    if mini and (mini > rows or rows % mini):
        why = "larger than" if mini > rows else "does not divide"
        return [_err(src, key, mini, f"{why} the {rows} rows per step (dataset.train_batch_size x "
                     "policy.rollout.n): steps would be skipped or rows trimmed",
                     f"a divisor of {rows}, or 0 (one step per epoch)")]
    return []


def _sampling(cfg: RunConfig, src: Source) -> list[ConfigError]:
    out, algo, n = [], cfg.algorithm, cfg.policy.rollout.n
    if algo.adv_estimator in GROUP_ESTIMATORS and n < 2:
        out.append(_err(src, "policy.rollout.n", n, f"adv_estimator={algo.adv_estimator!r} compares responses "
                        "within a prompt's group: with n < 2 every advantage is 0", "int >= 2"))
    t = cfg.policy.rollout.temperature
    if not (t > 0 and math.isfinite(t)):
        out.append(_err(src, "policy.rollout.temperature", t, "training samples with this temperature: it must "
                        "be a finite number > 0 (eval.temperature=0 is greedy evaluation)", "float > 0"))
    if algo.clip_ratio_c is not None and not algo.clip_ratio_c > 1:
        out.append(_err(src, "algorithm.clip_ratio_c", algo.clip_ratio_c, "dual-clip constant must be > 1",
                        "float > 1, or null (dual-clip off)"))
    buf, new = algo.overlong_buffer_len, cfg.policy.rollout.max_new_tokens
    if buf and buf >= new:
        out.append(_err(src, "algorithm.overlong_buffer_len", buf, f"must be smaller than "
                        f"policy.rollout.max_new_tokens={new}", f"int in [0, {new - 1}]"))
    return out


def _quant(cfg: RunConfig, src: Source) -> list[ConfigError]:
    r = cfg.quantization.rollout
    family = _SCHEME_PRECISION.get(r.scheme)
    if family is not None and family != r.precision and r.precision in _SCHEME_PRECISION.values():
        schemes = ", ".join(s for s, p in _SCHEME_PRECISION.items() if p == r.precision)
        return [_err(src, "quantization.rollout.scheme", r.scheme, f"is a {family} scheme but "
                     f"quantization.rollout.precision={r.precision!r}", f"{schemes}, or empty (derived)")]
    # 16/32-bit precisions pick no scheme: the engine computes in policy.dtype, the trainer in mixed_precision
    want = {"fp16": "float16", "fp32": "float32"}.get(r.precision)
    if want is not None and cfg.policy.dtype != want:
        return [_err(src, "quantization.rollout.precision", r.precision, f"the engine computes in policy.dtype="
                     f"{cfg.policy.dtype!r}; this key picks low-precision weights only",
                     f"bf16 (the default), fp8, mxfp8, mxfp4, or policy.dtype={want}")]
    t = cfg.quantization.training
    if t.precision == "fp32" and cfg.policy.train.mixed_precision != "fp32":
        return [_err(src, "quantization.training.precision", "fp32", "training computes in "
                     f"policy.train.mixed_precision={cfg.policy.train.mixed_precision!r}; this key picks FP8 GEMMs only",
                     "bf16 (the default), fp8, or policy.train.mixed_precision=fp32")]
    return []


def _engine(cfg: RunConfig, src: Source) -> list[ConfigError]:
    name = cfg.policy.rollout_engine
    module = _ENGINE_MODULES.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        return [_err(src, "policy.rollout_engine", name, f"engine {name!r} is not installed here (no module "
                     f"{module!r})", "native (installed: LumenRL's embedded engine) or hf")]
    return []


# ------------------------------------------------------------------ machine checks
def hf_cache_dir() -> Path:
    """The Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hf_cache_has(repo_id: str) -> bool:
    """Whether ``org/name`` has a snapshot with a config.json in the local HF cache (no network)."""
    if repo_id.count("/") != 1 or any(not p for p in repo_id.split("/")):
        return False
    snapshots = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    try:
        return any((snap / name).is_file() for snap in snapshots.iterdir()
                   for name in ("config.json", "tokenizer_config.json"))
    except OSError:
        return False


def _model_name(key: str, name: str, src: Source) -> list[ConfigError]:
    if name.startswith(BUILTIN_PREFIX):
        if is_builtin_name(name):
            return []
        names = [BUILTIN_PREFIX + n for n in BUILTIN_MODELS]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [_err(src, key, name, f"not a built-in model{hint}", ", ".join(names))]
    if Path(name).expanduser().is_dir() or hf_cache_has(name):
        return []
    return [_err(src, key, name, f"not a local directory, a built-in 'lumenrl:' model, or a Hugging Face id "
                 f"in the local cache ({hf_cache_dir()}); no download is tried",
                 "a model directory, lumenrl:tiny-qwen3-arith, or an id fetched first with "
                 "`huggingface-cli download ID`")]


def _models(cfg: RunConfig, src: Source) -> list[ConfigError]:
    out = _model_name("policy.model_name", cfg.policy.model_name, src)
    if cfg.policy.tokenizer_name:
        out += _model_name("policy.tokenizer_name", cfg.policy.tokenizer_name, src)
    if cfg.critic.enabled and cfg.critic.model_name:
        out += _model_name("critic.model_name", cfg.critic.model_name, src)
    return out


def cuda_device_count() -> int:
    """GPUs the CUDA (or ROCm HIP) driver reports, through ctypes: no torch import; 0 without a driver."""
    for lib, init, count in (("libcuda.so.1", "cuInit", "cuDeviceGetCount"),
                             ("libamdhip64.so", None, "hipGetDeviceCount")):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        n = ctypes.c_int(0)
        if init is not None and getattr(handle, init)(0) != 0:
            continue
        if getattr(handle, count)(ctypes.byref(n)) == 0:
            return n.value
    return 0


def _device(cfg: RunConfig, src: Source) -> list[ConfigError]:
    c = cfg.cluster
    if c.device != "cuda" and c.gpus_per_node == 0:
        return []
    have = cuda_device_count()
    if c.device == "cuda" and have == 0:
        return [_err(src, "cluster.device", "cuda", "no CUDA/ROCm GPU on this machine", "auto or cpu")]
    if c.gpus_per_node > have:
        return [_err(src, "cluster.gpus_per_node", c.gpus_per_node, f"this machine has {have} GPU(s)",
                     f"int in [0, {have}]")]
    return []


_ASYNC_KEYS = ("staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout",
               "staleness_from", "resume_kv", "queue_size", "recompute_proximal_log_probs")


def _weight_sync(cfg: RunConfig, src: Source) -> list[ConfigError]:
    """weight_sync.method picks async_rl's trainer -> rollouter sync; the synchronous trainers sync in
    process (or over the Ray controller's own channel) and would ignore another method."""
    w, trainer = cfg.weight_sync, cfg.trainer.name
    if w.method != "inprocess" and trainer != "async_rl":
        return [_err(src, "weight_sync.method", w.method, f"trainer.name={trainer!r} syncs in process and would "
                     "ignore it", "inprocess, or trainer.name=async_rl")]
    if w.snapshot_dir and w.method != "filesystem":
        return [_err(src, "weight_sync.snapshot_dir", w.snapshot_dir, f"only weight_sync.method=filesystem writes "
                     f"snapshots (method is {w.method!r})", "'' (the default), or weight_sync.method=filesystem")]
    return []


def _async(cfg: RunConfig, src: Source) -> list[ConfigError]:
    """async_training.* is read by trainer.name=async_rl only: elsewhere a set key would be ignored."""
    a, trainer = cfg.async_training, cfg.trainer.name
    if a.enabled and trainer != "async_rl":
        return [_err(src, "async_training.enabled", True, f"trainer.name={trainer!r} is synchronous and would "
                     "ignore it", "false, or trainer.name=async_rl")]
    if trainer == "async_rl" and not a.enabled:
        return [_err(src, "trainer.name", trainer, "async_rl needs async_training.enabled=true", "true")]
    default = type(a)()
    if a.enabled:
        if not a.partial_rollout and a.staleness_from != default.staleness_from:
            return [_err(src, "async_training.staleness_from", a.staleness_from, "has no effect without "
                         "async_training.partial_rollout=true (a group generated under one version starts and "
                         "finishes under it)", f"{default.staleness_from!r} (the default), or partial_rollout=true")]
        if a.resume_kv != default.resume_kv:
            return _resume_kv(cfg, src)
        return []
    return [_err(src, f"async_training.{k}", getattr(a, k), "has no effect unless async_training.enabled=true "
                 "(trainer.name=async_rl)", f"{getattr(default, k)!r} (the default)")
            for k in _ASYNC_KEYS if getattr(a, k) != getattr(default, k)]


def _resume_kv(cfg: RunConfig, src: Source) -> list[ConfigError]:
    """async_training.resume_kv=keep: the engine keeps an interrupted row's cache across a weight update; refused
    where nothing is interrupted by an update, or where the engine frees those caches at every call's end."""
    a, q, key = cfg.async_training, cfg.quantization.rollout, "async_training.resume_kv"
    if not a.partial_rollout:
        return [_err(src, key, a.resume_kv, "has no effect without async_training.partial_rollout=true (no sequence "
                     "is interrupted by a weight update)", "'recompute' (the default), or partial_rollout=true")]
    if q.kv_cache_dtype == "fp8" and q.kv_scale_recalibration:
        return [_err(src, key, a.resume_kv, "an FP8 KV cache recalibrated at every weight update "
                     "(quantization.rollout.kv_scale_recalibration=true) would read the kept codes at new scales",
                     "'recompute', or kv_scale_recalibration=false")]
    if cfg.moe.r3.enabled:
        return [_err(src, key, a.resume_kv, "R3 route recording (moe.r3.enabled) ends every engine call with its "
                     "rows' routes taken and their caches freed", "'recompute', or moe.r3.enabled=false")]
    if cfg.policy.rollout.speculative.draft_path:
        return [_err(src, key, a.resume_kv, "speculative decoding (policy.rollout.speculative.draft_path) keeps no "
                     "cache across engine calls", "'recompute', or no draft")]
    return []


MEANING_CHECKS = (_non_finite, _batches, _sampling, _quant, _engine, _async, _weight_sync)
MACHINE_CHECKS = (_models, _device)


def semantic_errors(cfg: RunConfig, source: Source, *, machine: bool = True,
                    rank: Callable[[str], int] | None = None) -> list[ConfigError]:
    """Every semantic problem of ``cfg`` (``source(key)``: where a key was set; ``rank(key)``: the layer that
    set it, later layers higher, for :func:`~.scope.scope_errors`); machine checks optional."""
    checks = MEANING_CHECKS + (MACHINE_CHECKS if machine else ())
    out: dict[str | None, ConfigError] = {}
    for check in checks:
        for err in check(cfg, source):
            out.setdefault(err.key, err)  # one line per key (temperature=inf: the first reason)
    for err in scope_errors(cfg, source, rank):
        out.setdefault(err.key, err)
    return list(out.values())
