"""Expert parallel and expert tensor parallel for the HF MoE families with fused expert tensors
(qwen3_moe, mixtral, glm4_moe, deepseek_v3, ...).

Design: :class:`ShardedExperts` replaces a block's fused ``experts`` module, whose call
``experts(hidden (T, H), top_k_index (T, K), top_k_weights (T, K))`` is the seam. Its weights are
sharded over a mesh with dims ``ep`` and/or ``tp``:

* ``ep``: the ranks of an EP group each own ``E / ep`` consecutive experts (rank r: experts
  ``[r*E/ep, (r+1)*E/ep)``) and each holds its OWN tokens (EP ranks are data/context-parallel
  ranks). The (token, expert) pairs are sorted by owner rank, counts exchanged (all-to-all), token
  rows sent to their expert's owner (differentiable uneven ``all_to_all_single``), the owner applies
  its local experts, results come back by the inverse all-to-all.
* ``tp``: the TP ranks hold the SAME tokens (the MoE block's input is gathered over the sequence,
  as for a dense MLP) and each holds a slice of every local expert's intermediate dim: gate rows
  ``[t*I/tp, (t+1)*I/tp)``, the MATCHING up rows ``I + [t*I/tp, (t+1)*I/tp)`` of ``gate_up_proj``
  (E, 2I, H) = [gate; up], and the same columns of ``down_proj`` (E, H, I). SwiGLU is elementwise
  over the intermediate dim, so each rank's ``down(act(gate) * up)`` is its partial sum of the
  expert output; the block's output is reduced over tp by the caller (reduce-scatter to the
  sequence shards under SP). ``gate_up_proj`` is a DTensor ``_StridedShard(1, split_factor=2)``
  (each rank: [gate_t; up_t]), ``down_proj`` ``Shard(2)``.

Both compose (EP x TP on the experts: mesh ``("ep", "tp")``): dispatch runs between the EP ranks of
one TP coordinate, every rank computes its experts' intermediate slice. Routing weights are applied
at the source, after the exchange back, so the router's gradient stays local; under tp the
gradients reaching ``hidden`` and ``top_k_weights`` are partial sums over tp (each rank's slice), so
both pass :func:`sum_grad_over` (identity forward, all-reduce backward: Megatron's "copy to the
model-parallel region"), and the replicated router gets the full gradient on every TP rank.

The weights are DTensors (``Shard(0)`` over ep, the layouts above over tp), so state dicts, weight
export and checkpoints see the full ``(E, ...)`` tensors under the HF names (the checkpoint stores
``gate_up_proj`` through :func:`checkpoint_view`, a box-sharded (E, 2, I, H) view). Every local
expert takes part in each forward (an empty row block when no token picks it), so every rank has
a gradient for each expert tensor (FSDP2 reduces them in step).

R3 replay: routing replay substitutes ``top_k_index`` (the recorded experts) in the router, before
this module; dispatch is a pure function of the indices it is given, and every TP rank routes the
same whole-sequence inputs, so replay selects exactly the recorded experts under EP and TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["ShardedExperts", "apply_expert_parallel", "checkpoint_view", "has_fused_experts", "sum_grad_over"]


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: ``send[r]`` rows to rank r, ``recv[r]`` from it."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group or torch.distributed.group.WORLD)
    return funcol.wait_tensor(out)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group) -> torch.Tensor:
    return _SumGradOver.apply(x, group) if group is not None else x


def has_fused_experts(module: nn.Module) -> bool:
    """True when ``module`` (an MoE block) has a fused ``experts`` module; raises when peft wrapped it (LoRA on
    the expert tensors, which sharding them would drop)."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return False
    if hasattr(experts, "lora_A") and hasattr(experts, "base_layer"):  # peft's ParamWrapper (target_parameters)
        raise ValueError("policy.lora.target_modules: peft put LoRA adapters on the fused experts (gate_up_proj/"
                         "down_proj, from gate_proj/up_proj/down_proj targets); expert and tensor parallel shard the "
                         "experts without them: leave gate_proj/up_proj/down_proj out of the targets, or use tp=1 "
                         "and moe.expert_parallel_size=1")
    return hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")


class ShardedExperts(nn.Module):
    """This rank's experts (``E / ep``) and intermediate slice (``I / tp``) of a fused-expert module."""

    def __init__(self, experts: nn.Module, mesh) -> None:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        super().__init__()
        names = tuple(mesh.mesh_dim_names)
        total, inter = experts.num_experts, experts.down_proj.shape[-1]
        self.ep = mesh["ep"].size() if "ep" in names else 1
        self.tp = mesh["tp"].size() if "tp" in names else 1
        if total % self.ep:
            raise ValueError(f"moe.expert_parallel_size={self.ep} does not divide the {total} experts")
        if inter % self.tp:
            raise ValueError(f"policy.parallel.tp={self.tp} does not divide the expert intermediate size {inter}")
        self.num_experts, self.local = total, total // self.ep
        self.group = mesh["ep"].get_group() if self.ep > 1 else None  # EP dispatch
        self.tp_group = mesh["tp"].get_group() if self.tp > 1 else None  # partial sums
        e = mesh["ep"].get_local_rank() if self.ep > 1 else 0
        t = mesh["tp"].get_local_rank() if self.tp > 1 else 0
        rows, part = slice(e * self.local, (e + 1) * self.local), inter // self.tp
        cols = slice(t * part, (t + 1) * part)
        gate_up = experts.gate_up_proj.detach()[rows]  # (E/ep, 2I, H)
        gate_up = torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1)  # (E/ep, 2I/tp, H)
        down = experts.down_proj.detach()[rows][:, :, cols]  # (E/ep, H, I/tp)
        ep_place = [Shard(0)] if "ep" in names else []
        tp_gate_up, tp_down = ([_StridedShard(1, split_factor=2)], [Shard(2)]) if "tp" in names else ([], [])

        frozen = not experts.gate_up_proj.requires_grad  # a LoRA policy's base: stays frozen

        def param(local: torch.Tensor, placements: list) -> nn.Parameter:
            local = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
            return nn.Parameter(local, requires_grad=not frozen)

        self.gate_up_proj = param(gate_up, ep_place + tp_gate_up)  # full (E, 2I, H)
        self.down_proj = param(down, ep_place + tp_down)  # full (E, H, I)
        self.act_fn = experts.act_fn

    def _local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # (E/ep, 2I/tp, H), (E/ep, H, I/tp)
        out = torch.zeros_like(rows)  # rows (M, H), expert (M,) local expert ids
        for e in range(self.local):
            pick = (expert == e).nonzero().squeeze(-1)
            gate, up = nn.functional.linear(rows[pick], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, pick, nn.functional.linear(self.act_fn(gate) * up, down[e]))
        return out

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """(T, H) output: whole over ep; a partial sum over tp (the caller reduces it)."""
        hidden, top_k_weights = sum_grad_over(hidden, self.tp_group), sum_grad_over(top_k_weights, self.tp_group)
        t, k = top_k_index.shape  # hidden (T, H)
        flat = top_k_index.reshape(-1)  # (T*K,)
        owner = torch.div(flat, self.local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        token = torch.arange(t, device=hidden.device).repeat_interleave(k)[order]
        local_ids = (flat[order] % self.local)[:, None]
        if self.ep > 1:
            send_counts = torch.bincount(owner, minlength=self.ep)
            recv_counts = torch.empty_like(send_counts)
            torch.distributed.all_to_all_single(recv_counts, send_counts, group=self.group)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            rows = _exchange(hidden[token], send, recv, self.group)  # (M, H) rows for my experts
            expert = _exchange(local_ids, send, recv, self.group).squeeze(-1)
            back = _exchange(self._local_experts(rows, expert), recv, send, self.group)  # (T*K, H) by owner
        else:
            back = self._local_experts(hidden[token], local_ids.squeeze(-1))
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)[:, None]
        return torch.zeros_like(hidden).index_add(0, token, back * weights)


def apply_expert_parallel(model: nn.Module, mesh) -> list[ShardedExperts]:
    """Replace every fused ``experts`` module of ``model`` by this rank's shard over ``mesh`` (dims
    ``ep`` and/or ``tp``: the EP group, the TP group); returns the new modules."""
    replaced = []
    for module in list(model.modules()):
        if has_fused_experts(module) and not isinstance(module.experts, ShardedExperts):
            module.experts = ShardedExperts(module.experts, mesh)
            replaced.append(module.experts)
    if not replaced:
        raise ValueError(f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}: {type(model).__name__} has no fused "
                         "experts module (gate_up_proj/down_proj)")
    return replaced


def checkpoint_view(tensor: Any) -> Any:
    """A fused ``gate_up_proj`` (E, 2I, H), any layout, as the (E, 2, I, H) view the checkpoint stores.

    The TP layout ``_StridedShard(1, 2)`` holds [gate_t; up_t]: not one box of (E, 2I, H), which DCP
    cannot save; in (E, 2, I, H) it is ``Shard(2)``, a box. Every layout (one rank, FSDP, EP, TP) is
    stored through this view, so a checkpoint reloads on any other layout. Shares storage (loading
    into the view fills the parameter or optimizer state)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if tensor.dim() != 3 or tensor.shape[1] % 2:
        return tensor
    e, two_i, h = tensor.shape
    if not isinstance(tensor, DTensor):
        return tensor.view(e, 2, two_i // 2, h)
    placements = []
    for p in tensor.placements:
        if isinstance(p, _StridedShard) and p.dim == 1:
            if p.split_factor != 2:
                return tensor
            placements.append(Shard(2))
        elif isinstance(p, Shard) and p.dim >= 1:
            return tensor  # another layout sharding dim 1+: not this module's
        else:
            placements.append(p)
    local = tensor.to_local()
    view = local.view(local.shape[0], 2, local.shape[1] // 2, local.shape[2])
    return DTensor.from_local(view, tensor.device_mesh, placements, run_check=False, shape=(e, 2, two_i // 2, h),
                              stride=(two_i * h, two_i // 2 * h, h, 1))
