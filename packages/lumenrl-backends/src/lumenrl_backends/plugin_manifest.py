"""lumenrl-backends' plugins as :class:`~lumenrl_core.plugins.PluginSpec`: the entry points in
``pyproject.toml`` name these, so ``lumenrl config check`` and ``lumenrl plugins`` list and check
them without importing torch. Each class reads its ``capabilities`` from here and its ``probe()``
returns its spec's ``unavailable_reason()``.

Probes import no torch (what torch provides is read from its installed files until torch is
imported), except ``megatron``'s once Megatron-Core is installed (it imports torch): probes run only
for plugins a config names, and for ``lumenrl plugins``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

from lumenrl_core.plugins import PluginSpec, module_installed, module_probe

__all__ = [
    "FSDP2", "MEGATRON", "NATIVE", "HF", "VLLM", "SGLANG", "ATOM", "LOCAL", "RAY", "RL", "SDDD", "ASYNC_RL",
    "JSONL", "CONSOLE", "TENSORBOARD", "WANDB", "megatron_missing_api", "probe_module",
]


# ---------------------------------------------------------------------------- probes
def _fsdp2_reason() -> str | None:
    """FSDP2 is ``torch.distributed.fsdp.fully_shard``: asked of torch once it is imported, else of
    its installed files (``lumenrl config check`` must not import torch to answer)."""
    if "torch" in sys.modules:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            return f"torch {sys.modules['torch'].__version__} has no torch.distributed.fsdp.fully_shard (FSDP2): {exc}"
        return None
    if not module_installed("torch"):
        return "torch is not installed"
    if not module_installed("torch.distributed.fsdp._fully_shard"):
        return f"torch {importlib.metadata.version('torch')} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    return None


_MEGATRON_API = (
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.models.gpt", "GPTModel"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
)


def megatron_missing_api() -> str | None:
    """Why no usable Megatron-Core is installed, or None. Checks the real API (``parallel_state``,
    ``GPTModel``, the local layer spec), so a namesake ``megatron`` package or an incompatible
    version is reported as such."""
    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed (pip install 'lumenrl-backends[megatron]')"
    for module, attr in _MEGATRON_API:
        try:
            found = hasattr(importlib.import_module(module), attr)
        except Exception as exc:  # a namesake 'megatron' package, or a broken install
            return f"megatron.core is not usable: importing {module} failed ({type(exc).__name__}: {exc})"
        if not found:
            return f"megatron.core has no {module}.{attr}: not a supported Megatron-Core version"
    return None


def probe_module(module: str, attributes: tuple[str, ...], install: str) -> str | None:
    """None if ``module`` imports and has every attribute, else a one-line reason."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # e.g. sys.modules[module] is None
        spec = None
    if spec is None:
        return f"{module} is not installed ({install})"
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # a broken install must not crash plugin listing
        return f"{module} is installed but fails to import: {type(exc).__name__}: {exc}"
    missing = [name for name in attributes if not hasattr(imported, name)]
    if missing:
        return f"the installed {module!r} package lacks {', '.join(missing)}: not the expected library ({install})"
    return None


def _vllm_reason() -> str | None:
    return probe_module("vllm", ("LLM", "SamplingParams"), "pip install lumenrl-backends[vllm]")


def _sglang_reason() -> str | None:
    return probe_module("sglang", ("Engine",), "pip install lumenrl-backends[sglang]")


def _atom_reason() -> str | None:
    """PyPI's ``atom`` is an unrelated namesake: check ATOM's own API and its ``atom.model_engine``."""
    reason = probe_module("atom", ("LLMEngine", "SamplingParams"), "install ROCm/ATOM from source on a ROCm machine")
    if reason is None and importlib.util.find_spec("atom.model_engine") is None:
        return "the installed 'atom' package has no atom.model_engine: not AMD's ATOM"
    return reason


def _ray_reason() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'lumenrl-backends[ray]')"
    return None


def _tensorboard_reason() -> str | None:
    """The ``tensorboard`` package, and torch's writer for it (asked of torch once it is imported)."""
    reason = module_probe("tensorboard", install="lumenrl-backends[tensorboard]")
    if reason is None and "torch" not in sys.modules:
        return None if module_installed("torch.utils.tensorboard") else "torch has no torch.utils.tensorboard"
    return reason or module_probe("torch.utils.tensorboard", ["SummaryWriter"])


def _wandb_reason() -> str | None:
    return module_probe("wandb", ["init", "log"], install="lumenrl-backends[wandb]")


# ---------------------------------------------------------------------------- specs
_TRAINING, _ENGINES = "lumenrl_backends.training", "lumenrl_backends.engines"

# lumenrl.training_backends
FSDP2 = PluginSpec(f"{_TRAINING}.fsdp2:FSDP2Backend", {
    "logprobs", "values", "fp8_training", "gradient_checkpointing", "checkpoint", "lora", "route_replay",
    "tensor_parallel", "context_parallel", "expert_parallel",  # training/parallelize.py (decision 0016)
    "compile_layers", "single_device", "group_projections", "packing",  # policy.train.*
    "exact_logprobs"},  # exact log-probs' trainer side
    probe=_fsdp2_reason)
MEGATRON = PluginSpec(f"{_TRAINING}.megatron:MegatronBackend", {  # training/megatron (decision 0017)
    "logprobs", "checkpoint", "tensor_parallel", "pipeline_parallel", "expert_parallel"}, probe=megatron_missing_api)

# lumenrl.rollout_engines
NATIVE = PluginSpec(f"{_ENGINES}.native:NativeEngine", {
    "logprobs", "interrupt_resume", "weight_update", "continuous_batching", "fp8_weights", "mx_weights",
    "fp8_kv_cache", "hidden_state_capture", "speculative_decoding",  # the last two: engines/speculative.py
    "route_recording",  # engines/routes.py (R3)
    "row_max_new_tokens",  # an input column max_new_tokens caps a row's response (engines/requests.py)
    "router_probs",  # moe.r3.record_router_logits: the routers' probabilities recorded with the routes
    "kept_kv_across_updates",  # async_training.resume_kv=keep: engine.keep_kv_on_update (engines/native.py)
    # policy.rollout.* keys it reads (another engine refuses them away from their defaults)
    "cuda_graphs", "compile", "fuse_projections", "overlap_sync", "share_prefill", "pack_prefill", "kv_block",
    "gpu_memory_utilization",
})
HF = PluginSpec(f"{_ENGINES}.hf:HFEngine", {"logprobs", "interrupt_resume", "weight_update", "route_recording"})
VLLM = PluginSpec(f"{_ENGINES}.adapters:VLLMEngine", {"logprobs", "weight_update", "gpu_memory_utilization"},
                  probe=_vllm_reason)
SGLANG = PluginSpec(f"{_ENGINES}.adapters:SGLangEngine", {"logprobs", "weight_update", "gpu_memory_utilization"},
                    probe=_sglang_reason)
ATOM = PluginSpec(f"{_ENGINES}.adapters:AtomEngine", {"gpu_memory_utilization"},  # no log-probs from its offline API
                  probe=_atom_reason)

# lumenrl.controllers
LOCAL = PluginSpec("lumenrl_backends.controllers.local:LocalController", {"in_process", "dispatch_modes"})
RAY = PluginSpec("lumenrl_backends.controllers.ray:RayController",
                 {"dispatch_modes", "multi_node", "placement_groups", "colocated", "disaggregated"}, probe=_ray_reason)

# lumenrl.trainers
RL = PluginSpec("lumenrl_backends.trainers:RLTrainer",  # exact_logprobs, online_sddd: checks and draft steps per step
                {"grpo", "dapo", "ppo", "checkpoint", "resume", "exact_logprobs", "online_sddd"})
SDDD = PluginSpec("lumenrl_backends.trainers.sddd:SDDDTrainer", {"sddd", "checkpoint", "resume"})
ASYNC_RL = PluginSpec("lumenrl_backends.trainers.async_rl:AsyncRLTrainer",
                      {"grpo", "dapo", "ppo", "checkpoint", "resume", "async"})

# lumenrl.loggers
JSONL = PluginSpec("lumenrl_backends.loggers:JsonlLogger", {"file"})
CONSOLE = PluginSpec("lumenrl_backends.loggers:ConsoleLogger")
TENSORBOARD = PluginSpec("lumenrl_backends.loggers:TensorBoardLogger", {"file"}, probe=_tensorboard_reason)
WANDB = PluginSpec("lumenrl_backends.loggers:WandbLogger", {"remote"}, probe=_wandb_reason)
