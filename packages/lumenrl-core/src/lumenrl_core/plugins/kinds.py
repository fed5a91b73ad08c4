"""The plugin kinds, their entry-point groups, and where the well-known plugins come from.

One entry-point group per kind: ``lumenrl.<kind>``. ``KNOWN_PROVIDERS`` maps a plugin name that
LumenRL's own distributions ship to the pip requirement that provides it, so a missing plugin
error can say what to install.
"""

from __future__ import annotations

__all__ = ["KINDS", "GROUP_PREFIX", "group_of", "check_kind", "KNOWN_PROVIDERS", "install_hint"]

GROUP_PREFIX = "lumenrl."

KINDS: tuple[str, ...] = (
    "training_backends",
    "rollout_engines",
    "advantage_estimators",
    "policy_losses",
    "rollout_corrections",
    "quant_schemes",
    "moe_routers",
    "draft_models",
    "transfer_engines",
    "weight_syncs",
    "rewards",
    "controllers",
    "trainers",
    "loggers",
)

_BACKENDS = "lumenrl-backends"

KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "training_backends": {"fsdp2": _BACKENDS, "megatron": "lumenrl-backends[megatron]"},
    "rollout_engines": {
        "native": _BACKENDS,
        "hf": _BACKENDS,
        "vllm": "lumenrl-backends[vllm]",
        "sglang": "lumenrl-backends[sglang]",
        "atom": _BACKENDS,  # the adapter; ATOM itself is built from source on ROCm (its probe says so)
    },
    "advantage_estimators": {n: "lumenrl-core" for n in ("grpo", "drgrpo", "rloo", "gae")},
    "policy_losses": {"ppo_clip": "lumenrl-core"},
    "rewards": {"math": "lumenrl-core", "countdown": "lumenrl-core"},
    "rollout_corrections": {
        n: "lumenrl-quant" for n in ("tis_token", "tis_seq", "mis_token", "mis_seq", "mis_geo", "seq_mis")
    },
    "quant_schemes": {n: "lumenrl-quant" for n in ("fp8_block", "fp8_tensor", "fp8_row", "fp8_w8a16", "mxfp8", "mxfp4")},
    "moe_routers": {n: "lumenrl-moe" for n in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")},
    "weight_syncs": {n: "lumenrl-async" for n in ("inprocess", "filesystem", "cuda_ipc", "collective")},
    "transfer_engines": {"inprocess": "lumenrl-sddd", "shm": "lumenrl-sddd", "tcp": "lumenrl-sddd",
                         "mooncake": "lumenrl-sddd[mooncake]", "mori": "lumenrl-sddd"},
    "draft_models": {"eagle3": "lumenrl-sddd", "dflash": "lumenrl-sddd"},
    "controllers": {"local": _BACKENDS, "ray": "lumenrl-backends[ray]"},
    "trainers": {"rl": _BACKENDS, "sddd": _BACKENDS, "async_rl": _BACKENDS},
    "loggers": {
        "jsonl": _BACKENDS,
        "console": _BACKENDS,
        "tensorboard": "lumenrl-backends[tensorboard]",
        "wandb": "lumenrl-backends[wandb]",
    },
}


def group_of(kind: str) -> str:
    """Entry-point group of ``kind``: ``rollout_engines`` -> ``lumenrl.rollout_engines``."""
    return GROUP_PREFIX + check_kind(kind)


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is a plugin kind, else raise ``ValueError`` naming the allowed kinds."""
    if kind not in KINDS:
        import difflib

        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"kind={kind!r} is not a plugin kind; allowed: {', '.join(KINDS)}{hint}")
    return kind


def install_hint(kind: str, name: str) -> str | None:
    """The pip requirement that ships plugin ``name`` of ``kind``, if LumenRL knows it."""
    return KNOWN_PROVIDERS.get(kind, {}).get(name)
