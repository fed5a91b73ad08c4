"""Megatron-Core training backend (``policy.training_backend: megatron``).

Same seam as :class:`~lumenrl_backends.training.fsdp2.FSDP2Backend` (``compute_log_probs``,
``train_step(batch, loss_fn)``, ``sft_step``, ``named_weights``, ``save_hf``, checkpoints), so
trainers, workers and loss closures are unchanged: it reuses FSDP2Backend's mini/micro-batch loop,
log-prob/entropy math (temperature, response slice), clipping, non-finite guard and LR schedule,
and swaps the model: HF weights are converted into a Megatron-Core ``GPTModel``
(:mod:`.families`, :mod:`.model`) which trains under plain torch AdamW on fp32 master weights
(fused on CUDA); ``policy.train.mixed_precision`` auto/bf16 on CUDA = bf16 autocast forwards.

Parallelism (:mod:`.parallel`): ``policy.parallel.tp`` / ``pp`` and ``moe.expert_parallel_size``
initialize Megatron's groups; data parallel = world / (tp * pp). Each rank loads its slice of the
HF weights (:mod:`.sharding`); batch rows are split by Megatron's DP rank (the ranks of one TP x PP
replica get the same rows), token counts and losses are summed over DP, results gathered over DP.
TP: log-probs and entropies from vocab-parallel logits (:mod:`.vocab_parallel`). PP (CUDA): the
micro-batches of a mini-batch go through Megatron's 1F1B schedule (:mod:`.pipeline`); the last
stage computes log-probs and calls ``loss_fn``, and sends results and metrics to the other stages.
Gradients: summed over DP (experts over expert-DP), q/k norms over TP, tied embeddings over the
first/last stage, then one model-wide norm for clipping (:func:`.parallel.finalize_grads`,
:func:`.parallel.clip_grad_norm`).

Weights leave under HF names, whole on every rank (``named_weights`` gathers and converts one tensor
at a time, :mod:`.weights`), so ``sync_to_engine`` and ``save_hf`` are unchanged; checkpoints are
DCP of the model and AdamW state under full Megatron names, TP slices as DTensors (written
atomically by :mod:`..checkpoint`). Padded layout only (``packing`` is ``none``).
Limits: dense Llama/Qwen3 and Qwen3-MoE families, actor/ref roles (no value head); pp and ep > 1
need CUDA; MoE with tp > 1 is refused (Megatron wants sequence parallelism there).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.training import checkpoint as ckpt
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.batching import split_rows
from lumenrl_backends.training.fsdp2 import FSDP2Backend, optimizer_steps_per_training_step
from lumenrl_backends.training.megatron.families import adapter_for
from lumenrl_backends.training.megatron.model import MegatronCausalLM, build_gpt_model, check_parallel
from lumenrl_backends.training.megatron.parallel import clip_grad_norm, finalize_grads, init_parallel
from lumenrl_backends.training.megatron.pipeline import from_last_stage, run_pipeline
from lumenrl_backends.training.megatron.sharding import RankCoords
from lumenrl_backends.training.megatron.vocab_parallel import vocab_parallel_token_log_probs
from lumenrl_backends.training.megatron.weights import CheckpointState, GatheredWeights
from lumenrl_backends.training.nonfinite import NonFiniteGuard, refuse_nonfinite
from lumenrl_backends.training.precision import compute_dtype
from lumenrl_backends.training.routes import route_replay

__all__ = ["MegatronBackend"]


def _parallel_sizes(cfg: Any) -> tuple[int, int, int]:
    """(tp, pp, ep) from ``policy.parallel.tp`` / ``pp`` and ``moe.expert_parallel_size``;
    ``policy.parallel.cp`` must be 1."""
    par = cfg.policy.parallel
    if par.cp != 1:
        raise ValueError(f"policy.parallel.cp={par.cp}: the megatron backend has no context parallelism; allowed: 1")
    return par.tp, par.pp, cfg.moe.expert_parallel_size


class MegatronBackend(FSDP2Backend):
    """Actor or reference model as a (TP/PP/EP-sharded) Megatron-Core GPTModel, HF weights in and out."""

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
        self._build_model(model, parallel)
        self.model.compute_dtype = compute_dtype(train.mixed_precision, self.device)  # bf16 on CUDA (auto)
        self.fp8_report, self.exact, self.single = None, False, None
        self.routes = route_replay(None, None)  # R3 replay is not wired into Megatron's MoE layer (refused)
        self.packing, self._pack_align, self._logprob_backend = "none", 8, None
        self._init_optimizer(num_training_steps, optimizer_steps_per_training_step)

    def _build_model(self, hf_model: Any, parallel: tuple[int, int, int]) -> None:
        """Megatron's groups, then this rank's GPTModel slice loaded from ``hf_model``'s weights."""
        self.hf_config, adapter = hf_model.config, adapter_for(hf_model.config)
        check_parallel(hf_model.config, adapter, parallel, self.device)
        self.groups = g = init_parallel(*parallel)
        self.dp_group = g.dp_group
        self.coords = RankCoords(
            num_layers=self.hf_config.num_hidden_layers, num_experts=getattr(self.hf_config, "num_experts", 0) or 0,
            tp=g.tp, pp=g.pp, ep=g.ep, tp_rank=g.tp_rank, pp_rank=g.pp_rank, ep_rank=g.ep_rank,
        )
        gpt = build_gpt_model(self.hf_config, adapter, parallel, stage=g.pp_rank)
        self.model = MegatronCausalLM(gpt, self.hf_config, adapter, self.coords)
        self.full_shapes = self.model.load_hf_state_dict({k: v.float() for k, v in hf_model.state_dict().items()})
        self.model.to(self.device)

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

    @property
    def dp_size(self) -> int:
        return self.groups.dp

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    # ----------------------------------------------------------------- forward

    def _response_log_probs(self, logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], temperature: float,
                            with_entropy: bool):
        """(b, T) log-probs (and entropies) of the responses from full-sequence logits (b, s, V/tp)."""
        T, L = inputs["responses"].shape[1], inputs["input_ids"].shape[1]
        return vocab_parallel_token_log_probs(
            logits[:, L - T - 1 : L - 1], inputs["responses"], temperature, with_entropy, self.groups.tp_group
        )

    def _forward_padded(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool):
        logits = self.model.stage_forward(inputs["input_ids"], inputs["attention_mask"])  # (b, s, V/tp)
        return self._response_log_probs(logits, inputs, temperature, with_entropy)

    def _infer_rows(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool):
        if self.groups.pp == 1:
            return super()._infer_rows(inputs, temperature, with_entropy)
        micros = self._micro_slices(inputs)
        results = run_pipeline(self.model, micros, lambda i, logits: (
            torch.zeros((), device=logits.device),
            self._response_log_probs(logits, micros[i], temperature, with_entropy),
        ), forward_only=True)
        shape = tuple(inputs["responses"].shape)
        first = self._stage_tensor([r[0] for r in results], shape)
        return first, (self._stage_tensor([r[1] for r in results], shape) if with_entropy else None)

    def _micro_slices(self, inputs: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        micro, rows = max(self.train_cfg.micro_batch_size, 1), inputs["input_ids"].shape[0]
        return [{k: v[s : s + micro] for k, v in inputs.items()} for s in range(0, rows, micro)]

    def _stage_tensor(self, parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The last stage's ``cat(parts)`` (float32, ``shape``) on every pipeline stage."""
        out = torch.cat(parts).float() if self.groups.last_stage else torch.empty(shape, device=self.device)
        dist.broadcast(out, src=self.groups.stage_rank(self.groups.pp - 1), group=self.groups.pp_group)
        return out

    # ----------------------------------------------------------------- training

    def _accumulate(self, local: Any, loss_fn: Callable, collected: dict[str, list[float]], plans: list) -> Any:
        if self.groups.pp == 1:
            return super()._accumulate(local, loss_fn, collected, plans)
        micros = split_rows(local, max(self.train_cfg.micro_batch_size, 1))
        inputs = [self._inputs(m) for m in micros]

        def on_logits(i: int, logits: torch.Tensor):
            temperature = float(micros[i].meta_info.get("temperature", 1.0))
            log_probs, entropy = self._response_log_probs(logits, inputs[i], temperature, True)
            loss, metrics = loss_fn({"log_probs": log_probs, "entropy": entropy}, micros[i])
            return loss, (loss.detach(), metrics)

        results = run_pipeline(self.model, inputs, on_logits, forward_only=False)
        return self._pipeline_metrics(results, collected)

    def _pipeline_metrics(self, results: list[tuple[torch.Tensor, Mapping[str, Any]]],
                          collected: dict[str, list[float]]) -> float:
        """The last stage's summed loss and per-micro-batch metrics, on every stage (as floats)."""
        summary = None
        if self.groups.last_stage:
            metrics: dict[str, list[float]] = {}
            for _, micro_metrics in results:
                for k, v in micro_metrics.items():
                    metrics.setdefault(k, []).append(dist_utils.as_float(v))
            summary = (sum(dist_utils.as_float(loss) for loss, _ in results), metrics)
        loss, metrics = from_last_stage(summary, self.groups)
        for k, values in metrics.items():
            collected[k].extend(values)
        return loss

    def _sft_uses_log_probs(self) -> bool:  # vocab-parallel logits: the log-prob forward reduces over the TP ranks
        return True

    def _sft_accumulate(self, local: Mapping[str, torch.Tensor], n_tokens: float) -> Any:
        if self.groups.pp == 1:
            return super()._sft_accumulate(local, n_tokens)
        micros = self._micro_slices(local)

        def on_logits(i: int, logits: torch.Tensor):
            labels = micros[i]["labels"][:, 1:]  # (b, L-1)
            inputs = {"input_ids": micros[i]["input_ids"], "responses": labels.clamp(min=0)}
            log_probs, _ = self._response_log_probs(logits, inputs, 1.0, False)
            loss = -(log_probs * (labels != -100)).sum() / n_tokens
            return loss, (loss.detach(), {})

        return self._pipeline_metrics(run_pipeline(self.model, micros, on_logits, forward_only=False), defaultdict(list))

    def _grad_sync(self, enabled: bool) -> None:  # gradients are reduced once, in _clip_grads
        return None

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # this rank's share of a mini-batch-normalized loss: finalize_grads sums over DP

    def _clip_grads(self, clip: float) -> float:
        finalize_grads(self.model.gpt, self.groups)
        params = [p for p in self.model.parameters() if p.requires_grad]
        return dist_utils.as_float(clip_grad_norm(params, clip, self.groups, self.device))

    # ----------------------------------------------------------------- weights and export

    @property
    def weights_module(self) -> torch.nn.Module:
        return self.model.gpt

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole fp32 weights under HF names, one at a time, on every rank. Collective."""
        full = GatheredWeights(self.model.gpt, self.coords, self.groups, self.full_shapes, self.device)
        for name, tensor in self.model.adapter.to_hf(self.hf_config, full):
            yield name, tensor.detach()

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor for ``sync_to_engine`` (the engine loads HF names). Collective."""
        return dict(self.named_weights())

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self.named_weights()}

    def _check_finite(self, what: str) -> None:  # every rank checks its own slice; refuse_nonfinite reduces
        local = ((n, p) for n, p in self.model.gpt.state_dict().items() if isinstance(p, torch.Tensor))
        refuse_nonfinite(local, what, self.device)

    def save_hf(self, path: str, tokenizer: Any = None) -> None:
        """HF ``save_pretrained`` of the gathered weights (rank 0 writes). Collective."""
        from transformers import AutoModelForCausalLM

        self._check_finite(f"the {self.role} export {path}")
        state = self.state_dict_for_export()
        if dist_utils.rank() == 0:
            hf = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            hf.load_state_dict(state, strict=True)
            hf.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        dist_utils.barrier()

    def _checkpoint_tree(self) -> CheckpointState:
        return CheckpointState(self.model.gpt, self.optimizer, self.coords, self.groups, self.full_shapes)

    def save_checkpoint(self, path: str, *, extra: Mapping[str, Any] | None = None) -> None:
        self._check_finite(f"the {self.role} checkpoint {path}")
        ckpt.save_training_state(path, model=self.weights_module, optimizer=self.optimizer,
                                 scheduler=self.scheduler, extra=extra, tree=self._checkpoint_tree())

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return ckpt.load_training_state(path, model=self.weights_module, optimizer=self.optimizer,
                                        scheduler=self.scheduler, tree=self._checkpoint_tree())
