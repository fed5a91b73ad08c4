"""Megatron's process groups for the backend, and the gradient reductions a training step needs.

Groups: ``parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)`` over the
default process group (gloo on CPU, nccl on CUDA; order ``tp-cp-ep-dp-pp``: a TP group is
neighbouring ranks). Data parallel size = world / (tp * pp); expert parallel borrows data-parallel
ranks (world must be divisible by tp * ep * pp, Megatron's expert grid with expert TP = tp).

Gradients (:func:`finalize_grads`, after the last micro-batch; the rules of Megatron's DDP and
``finalize_model_grads``, as plain coalesced all-reduces, no overlap with the backward):

* each rank back-propagates its share of a loss normalized over the whole mini-batch, so the
  mini-batch gradient is the SUM over data-parallel replicas: dense parameters over the DP group,
  expert parameters (Megatron's ``allreduce=False`` attribute) over the expert-DP group (the EP
  dispatcher's backward already summed the other ranks' tokens into them);
* Qwen3 q/k norms act on a TP rank's local heads: their gradients are summed over TP (Megatron:
  ``config.qk_layernorm`` params in ``_allreduce_non_tensor_model_parallel_grads``); other norms see
  replicated activations (no sequence parallel) and already hold the same gradient on every TP rank;
* tied embeddings with pp > 1: the first stage's embedding and the last stage's output-layer copy
  sum their gradients over the embedding group (Megatron's ``_allreduce_word_embedding_grads``).

Grad norm (:func:`clip_grad_norm`): squares summed once per distinct tensor (TP duplicates counted on
TP rank 0, Megatron's ``param_is_not_tensor_parallel_duplicate``; the tied output-layer copy not
at all), reduced over the model-parallel group (tp x pp) for dense and the expert tensor x model x
pipeline group for expert parameters; then ``clip_grads_with_norm_`` (torch's clip coefficient).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["ParallelGroups", "clip_grad_norm", "finalize_grads", "init_parallel"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelGroups:
    """Sizes, this rank's coordinates and Megatron's process groups."""

    tp: int
    pp: int
    ep: int
    dp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    ep_group: Any
    dp_group: Any
    expert_dp_group: Any
    embedding_group: Any
    model_parallel_group: Any
    expert_model_parallel_group: Any

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline."""
        return dist.get_process_group_ranks(self.pp_group)[stage]


def _check_sizes(tp: int, pp: int, ep: int, world: int) -> None:
    for key, value in (("policy.parallel.tp", tp), ("policy.parallel.pp", pp), ("moe.expert_parallel_size", ep)):
        if value < 1:
            raise ValueError(f"{key}={value}: must be >= 1")
    if world % (tp * pp):
        raise ValueError(f"policy.parallel.tp={tp} * pp={pp} = {tp * pp} must divide the world size {world}")
    if world % (tp * pp * ep):
        raise ValueError(f"moe.expert_parallel_size={ep}: tp*pp*ep={tp * pp * ep} must divide the world size {world} "
                         "(expert parallel borrows data-parallel ranks)")


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1) -> ParallelGroups:
    """Megatron's model-parallel groups over the default process group (once per process; a second
    backend in the process must ask for the same sizes)."""
    from megatron.core import parallel_state as ps

    _check_sizes(tp, pp, ep, dist.get_world_size())
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        if torch.cuda.is_available():  # Megatron's CUDA RNG tracker (dropout forks) must be seeded
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())
    if have != (tp, pp, ep):
        raise ValueError(f"megatron backend: this process already runs Megatron groups tp, pp, ep = {have}; "
                         f"a second backend asked for {(tp, pp, ep)}")
    return _groups(ps, tp, pp, ep)


def _groups(ps, tp: int, pp: int, ep: int) -> ParallelGroups:
    return ParallelGroups(
        tp=tp, pp=pp, ep=ep, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), expert_dp_group=ps.get_expert_data_parallel_group(),
        embedding_group=ps.get_embedding_group(check_initialized=False),
        model_parallel_group=ps.get_model_parallel_group(),
        expert_model_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
    )


def _all_reduce_grads(grads: list[torch.Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` in place, as one flat buffer."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def _is_expert(param: torch.Tensor) -> bool:
    return not getattr(param, "allreduce", True)


def finalize_grads(gpt: torch.nn.Module, groups: ParallelGroups) -> None:
    """The reductions of the module docstring, in Megatron's order (DP, then TP norms, then embeddings)."""
    named = [(n, p) for n, p in gpt.named_parameters() if p.grad is not None]
    _all_reduce_grads([p.grad for _, p in named if not _is_expert(p)], groups.dp_group)
    _all_reduce_grads([p.grad for _, p in named if _is_expert(p)], groups.expert_dp_group)
    if groups.tp > 1:
        _all_reduce_grads([p.grad for n, p in named if "q_layernorm" in n or "k_layernorm" in n], groups.tp_group)
    if groups.pp > 1 and getattr(gpt, "share_embeddings_and_output_weights", False) and (
        groups.first_stage or groups.last_stage
    ):
        weight = gpt.shared_embedding_or_output_weight()
        if weight.grad is not None:
            _all_reduce_grads([weight.grad], groups.embedding_group)


def _counted(param: torch.Tensor, tp_rank: int) -> bool:
    """Counted once in the norm: not a TP duplicate, not the tied output-layer copy."""
    if getattr(param, "shared", False):  # Megatron's mark on the last stage's copy of a tied embedding
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _sum_of_squares(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, groups: ParallelGroups,
                   device: torch.device) -> torch.Tensor:
    """Total grad norm over the whole model (see the module docstring); clips ``params`` in place."""
    counted = [p for p in params if p.grad is not None and _counted(p, groups.tp_rank)]
    squares = torch.stack([
        _sum_of_squares([p for p in counted if not _is_expert(p)], device),
        _sum_of_squares([p for p in counted if _is_expert(p)], device),
    ])  # (2,): dense, expert
    for i, group in enumerate((groups.model_parallel_group, groups.expert_model_parallel_group)):
        if group is not None and dist.get_world_size(group) > 1:
            part = squares[i : i + 1].clone()
            dist.all_reduce(part, group=group)
            squares[i] = part[0]
    total = squares.sum().sqrt()
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
    return total
