"""FSDP2 training backend: ``torch.distributed.fsdp.fully_shard`` on an HF causal LM.

One rank (``train.single_device`` auto/on): no ``fully_shard``; :mod:`.single_device` keeps bf16
compute weights in the module and fp32 master weights/gradients for the optimizer (same math).

Sharding: ``fully_shard`` on every decoder layer, then on the root module (embeddings, final
norm, LM head / value head). Master parameters stay float32; on CUDA with
``train.mixed_precision`` ``auto``/``bf16`` a ``MixedPrecisionPolicy`` computes in bf16 and
reduces gradients in fp32; on CPU everything is fp32. One process runs as a 1-rank group
(gloo on CPU, nccl on CUDA); under torchrun every rank holds the full batch and takes its own
contiguous slice (data parallel), global token counts are all-reduced. A batch that a
controller already split (``dp_compute_proto`` stamps ``meta_info["dispatch_dp_size"]`` = W on
each rank's chunk) is used as this rank's part as it is: no slicing, no gathering.

Parallelism mesh (decision 0016; :mod:`~lumenrl_backends.training.parallelize`): ``tp`` / ``cp``
(``policy.parallel``) and ``ep`` (``moe.expert_parallel_size``) build a ``("dp_shard", "cp", "tp")``
mesh; EP, the family's TP + SP plan and Ulysses CP are applied, then FSDP2 over dp_shard x cp.
"Data parallel" above means the ``dp_shard`` ranks: the ranks of one TP/CP group get the same rows,
token counts and losses are reduced over dp_shard only, results are gathered over it. Under CP
each rank runs its chunk of the sequence and the per-token results are gathered over cp
(:func:`~lumenrl_backends.training.context_parallel.gather_sequence`), so log-probs, entropies and
values are whole on every rank. ``from_config`` gives the mesh to the policy (actor, reference);
a critic trains data-parallel over all ranks there (built directly, it takes cp and ep). Refused
at build, with the numbers (:func:`~lumenrl_backends.training.parallelize.check_mesh`): sizes the
world or the model cannot meet, LoRA, FP8 linears or a critic with tp > 1, R3
replay with cp > 1; at call time, a batch a controller split over other than the dp ranks.

Loss scaling: ``loss_fn`` returns a loss already normalized so that the sum over micro-batches
and dp ranks is the mini-batch loss. FSDP2 averages gradients over its dp_shard x cp ranks; TP
ranks hold the same loss (DTensor backward counts it once) and the CP gather's backward sums the
cp ranks' identical gradients, so the backend back-propagates ``loss * dp_shard`` and the reduced
gradient is the gradient of that sum (expert slices: the same factor, see ``parallelize``).

Padding-free forwards (``packing``, default ``auto``): every micro-batch runs either packed
(valid tokens bin-packed into fewer rows, position ids restarting per sequence, block-diagonal
attention) or with the all-padding columns trimmed, whichever feeds fewer token slots to the
model (:mod:`~lumenrl_backends.training.packing`); ``none`` keeps the padded grid. Results equal
the padded forward up to fp rounding (tested). Under cp > 1 ``auto`` trims only (logged): the
Ulysses attention does not exchange packed varlen rows. ``compile_layers`` compiles each decoder layer
(``nn.Module.compile``, names unchanged; ``True`` = inductor, or a torch.compile backend name),
and the fused log-prob/entropy kernels with the same backend.

Schedule units: the LR scheduler steps once per optimizer step. ``num_training_steps`` and
``optim.warmup_steps`` are in *training steps* and multiplied by
``optimizer_steps_per_training_step`` (``from_config`` derives it: ppo_epochs x mini-batches).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.controllers.dispatch import DISPATCH_DP_SIZE_KEY
from lumenrl_backends.exact import EXACT_BACKEND, exact_actor
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.batching import (
    dp_slice_bounds,
    pad_rows,
    position_ids_from_mask,
    split_rows,
)
from lumenrl_backends.training.context_parallel import context_parallel_forward
from lumenrl_backends.training.grouped_linear import GroupReport, use_grouping
from lumenrl_backends.training.grouped_linear import group_projections as group_model_projections
from lumenrl_backends.training.logprobs import logprob_backend
from lumenrl_backends.training.lora import apply_lora
from lumenrl_backends.training.modeling import (
    CriticModel,
    compile_decoder_layers,
    enable_activation_checkpointing,
    response_logits,
    set_training,
    token_log_probs,
)
from lumenrl_backends.training.nonfinite import NonFiniteGuard
from lumenrl_backends.training.packing import (
    PackPlan,
    TrimPlan,
    check_packing_mode,
    pack_input_ids,
    plan_micro_batch,
    unpack_tokens,
)
from lumenrl_backends.training.parallelize import MeshDims, build_mesh, check_mesh, parallelize
from lumenrl_backends.training.precision import apply_fp8, compute_dtype, fp8_api, mixed_precision
from lumenrl_backends.training.routes import route_replay
from lumenrl_backends.training.schedules import (
    LRSchedule,
    build_lr_scheduler,
    optimizer_steps_per_training_step,
)
from lumenrl_backends.training.sft_step import SFTSteps
from lumenrl_backends.training.single_device import SingleDeviceWeights, check_single_device_mode
from lumenrl_backends.training.weights_io import BackendWeights

__all__ = ["FSDP2Backend", "optimizer_steps_per_training_step"]

ROLES = ("actor", "ref", "critic")
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


_UNPLANNED = object()  # _forward plans the micro-batch layout itself


def _policy_mesh(cfg: Any) -> dict[str, int]:
    """The policy's mesh sizes: ``policy.parallel.tp`` / ``cp`` and ``moe.expert_parallel_size``;
    ``policy.parallel.pp`` > 1 is refused (pipeline stages are the megatron backend's)."""
    if cfg.policy.parallel.pp != 1:
        raise ValueError(f"policy.parallel.pp={cfg.policy.parallel.pp}: the fsdp2 backend has no pipeline "
                         "parallelism; allowed: 1 (policy.training_backend='megatron' runs pipeline stages)")
    return {"tp": cfg.policy.parallel.tp, "cp": cfg.policy.parallel.cp, "ep": cfg.moe.expert_parallel_size}


class FSDP2Backend(SFTSteps, BackendWeights):
    """Actor, reference or critic model sharded with FSDP2, with its optimizer and LR schedule."""

    capabilities = manifest.FSDP2.capabilities

    @classmethod
    def probe(cls) -> str | None:
        return manifest.FSDP2.unavailable_reason()

    def __init__(
        self,
        model: nn.Module,
        *,
        role: str,
        optim: Any | None,
        train: Any,
        num_training_steps: int,
        device: torch.device,
        value_head: bool = False,
        fp8: Any | None = None,
        optimizer_steps_per_training_step: int = 1,
        packing: str | None = None,
        compile_layers: bool | str | None = None,
        single_device: str | None = None, exact_logprobs: bool = False, r3: Any | None = None,
        tp: int = 1, cp: int = 1, ep: int = 1, group_projections: bool | str | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not allowed; allowed: {', '.join(ROLES)}")
        if role != "ref" and optim is None:
            raise ValueError(f"role={role!r} trains, so optim must be an OptimConfig, got None")
        self.role, self.train_cfg, self.optim_cfg = role, train, optim
        self.device = torch.device(device)
        self.is_critic = value_head or role == "critic"
        self.nonfinite = NonFiniteGuard(getattr(train, "max_consecutive_nonfinite_steps", 3), self.prefix)
        dist_utils.ensure_process_group(self.device)
        self.dims = MeshDims(world=self.world_size, tp=tp, cp=cp, ep=ep)
        check_mesh(model, self.dims, critic=self.is_critic, fp8=fp8 is not None and fp8.precision == "fp8",
                   r3=r3 is not None and r3.enabled)
        if self.is_critic and not isinstance(model, CriticModel):
            model = CriticModel(model)
        self.hf_config = model.config
        self.fp8_report = apply_fp8(model, fp8)
        compile_layers = train.compile_layers if compile_layers is None else compile_layers
        self.exact = exact_actor(model, exact_logprobs and role == "actor", self.fp8_report, compile_layers)
        self.routes = route_replay(model, r3)  # R3: routers patched before sharding; forwards replay routed_experts
        if train.gradient_checkpointing and role != "ref":
            enable_activation_checkpointing(model)
        model.to(device=self.device, dtype=torch.float32)
        self.mesh = build_mesh(self.dims, self.device.type)
        self.dp_group = self.mesh.get_group("dp_shard")
        self.single: SingleDeviceWeights | None = None  # the one-rank fast path (single_device.py)
        self.flat_optimizer = self.device.type == "cuda"  # fully_shard: AdamW on the local shards in two launches
        self.grouping: GroupReport | None = None  # q/k/v and gate/up as one GEMM each (grouped_linear.py)
        single = self._use_single_device(single_device if single_device is not None else train.single_device)
        grouping = use_grouping(getattr(train, "group_projections", "auto") if group_projections is None
                                else group_projections, single=single, exact=self.exact, device=self.device)
        if single:
            self.single = SingleDeviceWeights(model, compute_dtype(train.mixed_precision, self.device))
            self.model = model
            if grouping:  # adjacent flat-buffer weights: one GEMM per group
                self.grouping = group_model_projections(model)
        else:  # on one rank keep the unsharded parameters after forward: nothing to save, backward reuses them
            self.model = parallelize(model, self.mesh, ep=ep, reshard_after_forward=self.world_size > 1,
                                     mp_policy=mixed_precision(train.mixed_precision, self.device))
        self.packing = self._packing_mode(packing if packing is not None else train.packing)
        self._pack_align = 64 if self.device.type == "cuda" else 8
        self._logprob_backend = EXACT_BACKEND if self.exact else None  # exact log-softmax or torch.compile
        if compile_layers:
            compile_decoder_layers(self.model, compile_layers)
            self._logprob_backend = logprob_backend(self.device, compile_layers)
        self._init_optimizer(num_training_steps, optimizer_steps_per_training_step)

    # ----------------------------------------------------------------- construction

    def _packing_mode(self, mode: str) -> str:
        """``policy.train.packing``; under cp > 1 ``auto`` trims pad columns but packs no rows."""
        check_packing_mode(mode)
        if mode == "auto" and self.dims.cp > 1:
            warnings.warn(f"fsdp2: policy.train.packing='auto' trims only under policy.parallel.cp={self.dims.cp}: "
                          "the Ulysses attention does not exchange packed varlen rows", stacklevel=3)
            return "trim"
        return mode

    def _init_optimizer(self, num_training_steps: int, steps_per_training_step: int) -> None:
        """AdamW and its LR schedule (in optimizer steps) for a training role; none for ``ref``."""
        self.optimizer = self.scheduler = self._sft_optimizer = None
        if self.role == "ref":
            return
        o = self.optim_cfg
        self.optimizer = self._build_optimizer(o.lr)
        self.scheduler = build_lr_scheduler(self.optimizer, LRSchedule(
            name=o.lr_schedule, num_training_steps=max(num_training_steps * steps_per_training_step, 1),
            warmup_steps=o.warmup_steps * steps_per_training_step, min_lr_ratio=o.min_lr_ratio))

    @classmethod
    def from_config(cls, cfg: Any, *, role: str, model_path: str) -> FSDP2Backend:
        """Load ``model_path`` (float32 master weights) and build the backend for ``role``."""
        from transformers import AutoModelForCausalLM

        device = dist_utils.resolve_device(cfg.cluster.device)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, trust_remote_code=cfg.policy.trust_remote_code
        )
        optim = {"actor": cfg.policy.optim, "critic": cfg.critic.optim, "ref": None}.get(role)
        if role == "actor" and cfg.policy.lora.rank > 0:
            model = apply_lora(model, cfg.policy.lora)
        return cls(
            model,
            role=role,
            optim=optim,
            train=cfg.policy.train,
            num_training_steps=cfg.num_training_steps,
            device=device,
            value_head=role == "critic",
            fp8=cfg.quantization.training if role == "actor" else None,
            optimizer_steps_per_training_step=optimizer_steps_per_training_step(cfg),
            exact_logprobs=cfg.policy.rollout.exact_logprobs, r3=cfg.moe.r3,
            **(_policy_mesh(cfg) if role != "critic" else {}))

    def _use_single_device(self, mode: str) -> bool:
        """``auto``: one rank and no FP8 linears; ``on`` insists; ``off``: always ``fully_shard``."""
        check_single_device_mode(mode)
        if mode == "off":
            return False
        problem = None
        if self.world_size > 1:
            problem = f"this process group has {self.world_size} ranks"
        elif self.fp8_report is not None:
            problem = "FP8 training linears (quantization.training.precision='fp8') need the fully_shard path"
        if problem is not None and mode == "on":
            raise ValueError(f"policy.train.single_device='on' needs one rank and no FP8 training: {problem}")
        return problem is None

    def _build_optimizer(self, lr: float) -> torch.optim.Optimizer:
        o = self.optim_cfg
        params = self.single.trainable if self.single is not None else self.model.parameters()
        optimizer = torch.optim.AdamW(
            [p for p in params if p.requires_grad],
            lr=lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=self.device.type == "cuda",
        )
        if self.fp8_report is not None and self.fp8_report.config.weight_cache:
            fp8_api()[1](optimizer, self.model)  # cached FP8 weights go stale at every step
        return optimizer

    @property
    def prefix(self) -> str:
        return "critic" if self.is_critic else self.role

    @property
    def world_size(self) -> int:
        return dist_utils.world_size()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (``dp_shard``): each holds its own rows."""
        return self.dims.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp_shard")

    # ----------------------------------------------------------------- forward

    def _inputs(self, batch: Any) -> dict[str, torch.Tensor]:
        tensors = batch.batch
        missing = [k for k in ("input_ids", "attention_mask", "responses") if k not in tensors]
        if missing:
            raise KeyError(
                f"batch is missing {missing}; needs input_ids, attention_mask (B, P+T) and responses (B, T)"
            )
        out = {k: tensors[k].to(self.device) for k in _MODEL_INPUTS + self.routes.keys if k in tensors}
        if "position_ids" not in out:
            out["position_ids"] = position_ids_from_mask(out["attention_mask"])
        return out

    def _plan(self, attention_mask: torch.Tensor, resp_len: int, position_ids: torch.Tensor | None):
        plan = plan_micro_batch(
            attention_mask, resp_len, position_ids=position_ids, mode=self.packing, align=self._pack_align
        )
        return plan.to(self.device) if isinstance(plan, PackPlan) else plan

    def _plans(self, local: Any, micro: int) -> list[Any]:
        """Layouts of ``local``'s micro-batches of ``micro`` rows, planned up front from one host
        copy of the masks (no device sync between micro-batches)."""
        rows, T = local.batch["responses"].shape
        if self.packing == "none":
            return [None] * -(-rows // micro)
        masks = local.batch["attention_mask"].cpu().split(micro)
        pos = local.batch.get("position_ids")
        positions = pos.cpu().split(micro) if pos is not None else [None] * len(masks)
        return [self._plan(m, T, p) for m, p in zip(masks, positions)]

    def _forward(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool, plan=_UNPLANNED):
        """Actor/ref: (log_probs, entropy) (b, T); critic: (values, None) (b, T).

        Runs packed, trimmed or padded (see the module docstring); positions whose response
        token is padding hold 0 in the packed/trimmed layouts.
        """
        T = inputs["responses"].shape[1]
        if plan is _UNPLANNED:
            plan = self._plan(inputs["attention_mask"], T, inputs.get("position_ids"))
        self.routes.set(inputs, plan)
        if isinstance(plan, PackPlan):
            return self._forward_packed(plan, inputs, temperature, with_entropy)
        if isinstance(plan, TrimPlan):
            cols = slice(plan.lo, plan.hi)
            sliced = {k: inputs[k][:, cols] for k in ("input_ids", "attention_mask", "position_ids")}
            if plan.dense and self.dims.cp == 1:  # no padding: plain causal attention, positions 0..n-1
                sliced["attention_mask"] = sliced["position_ids"] = None
            sliced["responses"] = inputs["responses"][:, : plan.resp_len]
            first, second = self._forward_padded(sliced, temperature, with_entropy)
            pad = (0, T - plan.resp_len)
            return F.pad(first, pad), (F.pad(second, pad) if second is not None else None)
        return self._forward_padded(inputs, temperature, with_entropy)

    def _forward_padded(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool):
        if self.dims.cp > 1:
            return self._forward_cp(inputs, temperature, with_entropy)
        T = inputs["responses"].shape[1]
        model_in = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids")}
        if self.is_critic:
            values = self.model(**model_in)  # (b, P+T)
            return values[:, -T - 1 : -1], None
        logits = response_logits(self.model, **model_in, response_len=T)  # (b, T, V)
        return token_log_probs(
            logits, inputs["responses"], temperature, with_entropy, compile_backend=self._logprob_backend
        )

    def _forward_cp(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool):
        """Context parallel: this rank's sequence chunk, results gathered over cp (whole on every rank)."""
        if self.is_critic:
            return context_parallel_forward(self.model, inputs, self.mesh["cp"]), None
        return context_parallel_forward(self.model, inputs, self.mesh["cp"], lambda logits, tokens: token_log_probs(
            logits, tokens, temperature, with_entropy, compile_backend=self._logprob_backend))

    def _forward_packed(self, plan: PackPlan, inputs: Mapping[str, torch.Tensor], temperature, with_entropy):
        """One forward over R packed rows; per-token results scattered back to (b, T)."""
        shape = tuple(inputs["responses"].shape)
        ids = pack_input_ids(plan, inputs["input_ids"])  # (R, C)
        if self.is_critic:  # no attention mask: segments come from the restarting position ids
            values = self.model(input_ids=ids, attention_mask=None, position_ids=plan.position_ids)
            return unpack_tokens(plan, values[plan.pred_row, plan.pred_col], shape), None
        out = self.model(
            input_ids=ids, position_ids=plan.position_ids, logits_to_keep=plan.keep, use_cache=False
        )
        logits = out.logits[plan.pred_row, plan.pred_k]  # (N, V): only the predicting positions
        tokens = inputs["responses"][plan.out_row, plan.out_col]  # (N,)
        log_probs, entropy = token_log_probs(
            logits[None], tokens[None], temperature, with_entropy, compile_backend=self._logprob_backend
        )
        first = unpack_tokens(plan, log_probs[0], shape)
        return first, (unpack_tokens(plan, entropy[0], shape) if entropy is not None else None)

    def _presharded(self, batch: Any) -> bool:
        """True when a controller already split the batch over the DP ranks (``dp_compute_proto``)."""
        split = int(batch.meta_info.get(DISPATCH_DP_SIZE_KEY, 1))
        if split == 1 or self.world_size == 1:
            return False
        if split != self.dp_size:
            raise ValueError(
                f"batch was dispatched over {split} ranks (meta_info[{DISPATCH_DP_SIZE_KEY!r}]) but this "
                f"backend has {self.dp_size} data-parallel ranks (world {self.world_size} / model-parallel ranks "
                f"{self.world_size // self.dp_size}); they must match"
            )
        return True

    @torch.no_grad()
    def _infer(self, batch: Any, temperature: float, with_entropy: bool):
        """Each rank runs its slice of the (padded) batch; results are gathered in rank order.

        A pre-sharded batch (controller dispatch) is this rank's part: computed, not gathered.
        """
        set_training(self.model, False)
        presharded = self._presharded(batch)
        inputs, pad = pad_rows(self._inputs(batch), 1 if presharded else self.dp_size)
        total = inputs["input_ids"].shape[0]
        lo, hi = (0, total) if presharded else dp_slice_bounds(total, self.dp_rank, self.dp_size)
        first, second = self._infer_rows({k: v[lo:hi] for k, v in inputs.items()}, temperature, with_entropy)
        out_device = batch.batch["input_ids"].device  # results live where the caller's batch lives
        gather = (lambda t: t) if presharded else (lambda t: dist_utils.all_gather_rows(t, self.dp_group))
        first = gather(first)[: total - pad].to(out_device)
        self.routes.finish(gather, total - pad, out_device)
        if not with_entropy:
            return first, None
        return first, gather(second)[: total - pad].to(out_device)

    def _infer_rows(self, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool):
        """(log-probs or values, entropies or None) of this rank's rows, one micro-batch at a time."""
        micro = max(self.train_cfg.micro_batch_size, 1)
        rows = inputs["input_ids"].shape[0]
        firsts, seconds = [], []
        for s in range(0, rows, micro):
            first, second = self._forward({k: v[s : s + micro] for k, v in inputs.items()}, temperature, with_entropy)
            self.routes.collect()
            firsts.append(first.float())
            seconds.append(second.float() if second is not None else None)
        return torch.cat(firsts), (torch.cat(seconds) if with_entropy else None)

    def compute_log_probs(
        self, batch: Any, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) log-probs of ``responses`` (and entropies) under ``logits / temperature``."""
        if self.is_critic:
            raise RuntimeError(
                "compute_log_probs called on a critic backend (role='critic'); use compute_values"
            )
        return self._infer(batch, temperature, with_entropy)

    def compute_values(self, batch: Any) -> torch.Tensor:
        """(B, T) values of the states before each response token (critic only)."""
        if not self.is_critic:
            raise RuntimeError(f"compute_values needs the critic backend; this one has role={self.role!r}")
        return self._infer(batch, 1.0, False)[0]

    # ----------------------------------------------------------------- training

    def _check_trainable(self) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                f"the {self.role!r} backend has no optimizer; only actor/critic backends train"
            )

    def _mini_batches(self, batch: Any) -> tuple[list[Any], int]:
        """This rank's rows of every mini-batch, and the global mini-batch size in rows."""
        world, presharded = self.dp_size, self._presharded(batch)
        total = len(batch) * (world if presharded else 1)
        mini = self.train_cfg.mini_batch_size or total
        if total % mini or mini % world:
            raise ValueError(
                f"batch of {total} rows with policy.train.mini_batch_size={mini}: need rows divisible by "
                f"mini_batch_size and mini_batch_size divisible by the {world} data-parallel ranks"
            )
        local = mini // world
        if presharded:  # rank r holds rows [r*B/W, (r+1)*B/W): its slices of the mini-batches, in order
            return split_rows(batch, local), mini
        rank = self.dp_rank
        return [
            batch[s + rank * local : s + (rank + 1) * local] for s in range(0, total, mini)
        ], mini

    def train_step(
        self, batch: Any, loss_fn: Callable[[dict, Any], tuple[torch.Tensor, Mapping[str, Any]]]
    ) -> dict[str, float]:
        """ppo_epochs x mini-batches optimizer steps; returns averaged metrics."""
        self._check_trainable()
        set_training(self.model, True)
        collected: dict[str, list[float]] = defaultdict(list)
        minis, mini_rows = self._mini_batches(batch)
        for _ in range(self.train_cfg.ppo_epochs):
            for local in minis:
                self._optimizer_step(local, mini_rows, loss_fn, collected)
        local_loss = collected.pop(f"{self.prefix}/loss")  # this rank's share of each mini-batch loss
        collected = dist_utils.as_floats(collected)  # the step's only device->host copy of metrics
        flags = collected.pop(f"{self.prefix}/skipped_steps", [])
        guard = self.nonfinite.observe(flags)  # raises NonFiniteError after too many skips in a row
        if any(flags):  # the key is there only when some step was skipped (non-finite loss or grad norm)
            collected[f"{self.prefix}/skipped_steps"] = [v for v in flags if v]
        metrics = dist_utils.all_reduce_mean_dict(
            {k: sum(v) / len(v) for k, v in collected.items() if k != f"{self.prefix}/lr"}, self.device
        )
        metrics[f"{self.prefix}/loss"] = dist_utils.all_reduce_sum(
            sum(local_loss) / len(local_loss), self.device, self.dp_group
        )
        metrics[f"{self.prefix}/lr"] = collected[f"{self.prefix}/lr"][-1]
        metrics.update(guard)
        return metrics

    def _micro_outputs(self, micro: Any, plan: Any = _UNPLANNED) -> dict[str, torch.Tensor]:
        inputs = self._inputs(micro)
        temperature = float(micro.meta_info.get("temperature", 1.0))
        first, second = self._forward(inputs, temperature, with_entropy=not self.is_critic, plan=plan)
        return {"values": first} if self.is_critic else {"log_probs": first, "entropy": second}

    def _optimizer_step(
        self, local: Any, mini_rows: int, loss_fn: Callable, collected: dict[str, list[float]]
    ) -> None:
        """One optimizer step on this rank's rows ``local`` of a ``mini_rows``-row mini-batch."""
        local.meta_info = dict(local.meta_info)  # per-step counts must not leak into the caller's dict
        # Token count and packing plans from the rows where they are (host tensors on the usual path),
        # before the move: reading them back from the device would wait for the queued work.
        mask = local.batch.get("response_mask")
        local_tokens = float(mask.sum()) if mask is not None else float(local.batch["responses"].numel())
        plans = self._plans(local, max(self.train_cfg.micro_batch_size, 1))
        # loss_fn mixes outputs with batch tensors (advantages, masks). non_blocking: a blocking copy from host
        # memory would first wait for the queued work (the previous mini-batch's optimizer step)
        local = local.to(self.device, non_blocking=True)
        local.meta_info.update(
            mini_batch_tokens=dist_utils.all_reduce_sum(local_tokens, self.device, self.dp_group),
            mini_batch_seqs=mini_rows,
            dp_size=self.dp_size,
        )
        self._zero_grad(self.optimizer)
        mini_loss = self._accumulate(local, loss_fn, collected, plans)
        collected[f"{self.prefix}/loss"].append(mini_loss)
        self._clip_and_step(self.optimizer, self.scheduler, collected, self.prefix, mini_loss)

    def _accumulate(self, local: Any, loss_fn: Callable, collected: dict[str, list[float]], plans: list) -> Any:
        """Forward and backward every micro-batch of ``local`` (laid out by ``plans``); returns the summed
        loss (on the device)."""
        micros = split_rows(local, max(self.train_cfg.micro_batch_size, 1))
        mini_loss = 0.0  # tensors stay on the device until train_step's one host copy
        for i, (micro, plan) in enumerate(zip(micros, plans, strict=True)):
            self._grad_sync(i == len(micros) - 1)
            loss, micro_metrics = loss_fn(self._micro_outputs(micro, plan), micro)
            self._backward(loss)
            mini_loss = mini_loss + loss.detach()
            for k, v in micro_metrics.items():
                collected[k].append(v.detach() if isinstance(v, torch.Tensor) else float(v))
        return mini_loss

    def _zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        if self.single is not None:
            self.single.zero_grad()

    def _grad_sync(self, enabled: bool) -> None:
        if self.single is None:  # FSDP2: reduce-scatter only after the last micro-batch
            self.model.set_requires_gradient_sync(enabled)

    def _backward(self, loss: torch.Tensor) -> None:
        (loss * self.dp_size).backward()  # see "Loss scaling" in the module docstring
        if self.single is not None:  # bf16 module grads -> fp32 master grads (or kept for the flat AdamW)
            self.single.accumulate_grads()

    def _clip_and_step(self, optimizer, scheduler, collected: dict, prefix: str, loss: Any = 0.0) -> None:
        """Clip and step; a non-finite grad norm or ``loss`` skips the step (weights and moments untouched)."""
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        params = None if self.single is not None else [p for p in self.model.parameters() if p.grad is not None]
        if self.single is not None and optimizer.defaults.get("fused"):  # clip inside fused AdamW, no sync
            norm, skipped = self.single.fused_clip_and_step(optimizer, clip, loss)
            collected[f"{prefix}/grad_norm"].append(norm)
            collected[f"{prefix}/skipped_steps"].append(skipped)  # zeros are dropped in train_step
        elif params is not None and dist_utils.can_step_without_sync(optimizer, params):
            norm, skipped = dist_utils.fused_clip_and_step(optimizer, params, clip, loss, self.dp_group,
                                                           flat=self.flat_optimizer)
            collected[f"{prefix}/grad_norm"].append(norm)
            collected[f"{prefix}/skipped_steps"].append(skipped)
        else:
            grad_norm = self._clip_grads(clip)
            collected[f"{prefix}/grad_norm"].append(grad_norm)
            total_loss = dist_utils.all_reduce_sum(dist_utils.as_float(loss), self.device, self.dp_group)
            if math.isfinite(grad_norm) and math.isfinite(total_loss):
                optimizer.step()
                if self.single is not None:
                    self.single.copy_back()
            else:  # every rank sees the same (all-reduced) norm and loss, so all skip together
                self._zero_grad(optimizer)
            collected[f"{prefix}/skipped_steps"].append(0.0 if math.isfinite(grad_norm + total_loss) else 1.0)
        collected[f"{prefix}/lr"].append(float(optimizer.param_groups[0]["lr"]))
        if scheduler is not None:
            scheduler.step()

    def _clip_grads(self, clip: float) -> float:
        """Clip the gradients to total norm ``clip`` (inf: measure only); returns the norm before clipping."""
        if self.single is not None:
            self.single.materialize_grads()
        source = self.single.masters if self.single is not None else self.model.parameters()
        params = [p for p in source if p.grad is not None]
        return dist_utils.as_float(dist_utils.clip_grad_norm_(params, clip))

