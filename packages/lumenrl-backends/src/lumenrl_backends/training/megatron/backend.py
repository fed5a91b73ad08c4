"""Megatron-Core training backend (``policy.training_backend: megatron``).

Same seam as :class:`~lumenrl_backends.training.fsdp2.FSDP2Backend` (``compute_log_probs``,
``train_step(batch, loss_fn)``, ``sft_step``, ``named_weights``, ``save_hf``, checkpoints), so
trainers, workers and loss closures are unchanged: it reuses FSDP2Backend's mini/micro-batch loop,
log-prob/entropy math (temperature, response slice), clipping, non-finite guard and LR schedule,
and swaps the model: HF weights are converted into a Megatron-Core ``GPTModel``
(:mod:`.families`, :mod:`.model`) which trains under plain torch AdamW on fp32 master weights
(fused on CUDA); ``policy.train.mixed_precision`` auto/bf16 on CUDA = bf16 autocast forwards.

Weights leave under HF names (``named_weights`` converts on the fly), so ``sync_to_engine`` and
``save_hf`` are unchanged; checkpoints hold the Megatron state dict (torch.distributed.checkpoint,
written atomically by :mod:`..checkpoint`). Padded layout only (``packing`` is ``none``).
Limits: tp = pp = ep = 1, dense Llama/Qwen3 families, actor/ref roles (no value head).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.training import checkpoint as ckpt
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.fsdp2 import FSDP2Backend, optimizer_steps_per_training_step
from lumenrl_backends.training.megatron.families import adapter_for
from lumenrl_backends.training.megatron.model import MegatronCausalLM, build_gpt_model, init_parallel
from lumenrl_backends.training.nonfinite import NonFiniteGuard, refuse_nonfinite
from lumenrl_backends.training.precision import compute_dtype
from lumenrl_backends.training.routes import route_replay

__all__ = ["MegatronBackend"]


def _parallel_sizes(cfg: Any) -> tuple[int, int, int]:
    """(tp, pp, ep) from the run config: ``policy.parallel.tp`` (and ``cp``, which must be 1) where
    the schema has them, ``moe.expert_parallel_size``; there is no pipeline key, so pp = 1."""
    par = getattr(cfg.policy, "parallel", None)
    cp = int(getattr(par, "cp", 1) or 1)
    if cp != 1:
        raise ValueError(
            f"policy.parallel.cp={cp}: the megatron backend has no context parallelism; allowed: 1"
        )
    return int(getattr(par, "tp", 1) or 1), 1, int(cfg.moe.expert_parallel_size)


class MegatronBackend(FSDP2Backend):
    """Actor or reference model as a Megatron-Core GPTModel, HF weights in and out."""

    capabilities = manifest.MEGATRON.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.MEGATRON.unavailable_reason()

    def __init__(  # noqa: PLR0913 - mirrors FSDP2Backend's keyword arguments
        self,
        model: Any,
        *,
        role: str,
        optim: Any | None,
        train: Any,
        num_training_steps: int,
        device: torch.device,
        optimizer_steps_per_training_step: int = 1,
        parallel: tuple[int, int, int] = (1, 1, 1),
    ) -> None:
        reason = manifest.megatron_missing_api()
        if reason is not None:
            raise RuntimeError(reason)
        if role not in ("actor", "ref"):
            raise ValueError(
                f"megatron backend: role={role!r} is not supported (actor, ref); use fsdp2 for the critic"
            )
        if role == "actor" and optim is None:
            raise ValueError("role='actor' trains, so optim must be an OptimConfig, got None")
        if train.packing not in ("auto", "none"):
            raise ValueError(f"megatron backend: policy.train.packing={train.packing!r}; allowed: auto, none")
        self.role, self.train_cfg, self.optim_cfg = role, train, optim
        self.device, self.is_critic = torch.device(device), False
        self.nonfinite = NonFiniteGuard(getattr(train, "max_consecutive_nonfinite_steps", 3), self.prefix)
        dist_utils.ensure_process_group(self.device)
        if self.world_size > 1:
            raise ValueError("megatron backend: one rank only in this release (data parallel not wired)")
        init_parallel(*parallel)
        self.hf_config, adapter = model.config, adapter_for(model.config)
        self.model = MegatronCausalLM(build_gpt_model(model.config, adapter), model.config, adapter)
        self.model.load_hf_state_dict({k: v.float() for k, v in model.state_dict().items()})
        self.model.to(self.device)
        self.model.compute_dtype = compute_dtype(train.mixed_precision, self.device)  # bf16 on CUDA (auto)
        self.fp8_report, self.exact, self.single = None, False, None
        self.routes = route_replay(None, None)  # R3 replay is not wired into Megatron's MoE layer (refused)
        self.packing, self._pack_align, self._logprob_backend = "none", 8, None
        self._init_optimizer(num_training_steps, optimizer_steps_per_training_step)

    @classmethod
    def from_config(cls, cfg: Any, *, role: str, model_path: str) -> MegatronBackend:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, trust_remote_code=cfg.policy.trust_remote_code
        )
        optim = {"actor": cfg.policy.optim, "ref": None}.get(role)
        return cls(
            hf,
            role=role,
            optim=optim,
            train=cfg.policy.train,
            num_training_steps=cfg.num_training_steps,
            device=dist_utils.resolve_device(cfg.cluster.device),
            optimizer_steps_per_training_step=optimizer_steps_per_training_step(cfg),
            parallel=_parallel_sizes(cfg),
        )

    def _grad_sync(self, enabled: bool) -> None:  # one rank: nothing to reduce
        return None

    # ----------------------------------------------------------------- weights and export

    @property
    def weights_module(self) -> torch.nn.Module:
        return self.model.gpt

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """fp32 weights under HF names (converted from the Megatron layout), one at a time."""
        mc = {k: v for k, v in self.model.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        for name, tensor in self.model.adapter.to_hf(self.hf_config, mc):
            yield name, tensor.detach()

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor for ``sync_to_engine`` (the engine loads HF names)."""
        return dict(self.named_weights())

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self.named_weights()}

    def _check_finite(self, what: str) -> None:
        refuse_nonfinite(self.named_weights(), what, self.device)

    def save_hf(self, path: str, tokenizer: Any = None) -> None:
        """HF ``save_pretrained`` of the converted weights (tied embeddings re-tied by HF)."""
        from transformers import AutoModelForCausalLM

        self._check_finite(f"the {self.role} export {path}")
        hf = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        hf.load_state_dict(self.state_dict_for_export(), strict=True)
        hf.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def save_checkpoint(self, path: str, *, extra: Mapping[str, Any] | None = None) -> None:
        self._check_finite(f"the {self.role} checkpoint {path}")
        ckpt.save_training_state(
            path, model=self.weights_module, optimizer=self.optimizer, scheduler=self.scheduler, extra=extra
        )

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return ckpt.load_training_state(
            path, model=self.weights_module, optimizer=self.optimizer, scheduler=self.scheduler
        )
