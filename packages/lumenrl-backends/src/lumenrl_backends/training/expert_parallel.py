"""Expert parallel for the HF MoE families with fused expert tensors (qwen3_moe, mixtral, ...).

Design: the ``ep`` ranks of a group each own ``E / ep`` consecutive experts (rank r: experts
``[r*E/ep, (r+1)*E/ep)``; the slices of ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)) and
each holds its OWN tokens (EP ranks are data-parallel ranks). The router stays replicated and runs
on the local tokens; :class:`ExpertParallelExperts` replaces the block's ``experts`` module, whose
call ``experts(hidden (T, H), top_k_index (T, K), top_k_weights (T, K))`` is the seam:

1. the T*K (token, expert) pairs are sorted by owner rank; counts are exchanged (all-to-all);
2. token rows go to their expert's owner (differentiable uneven ``all_to_all_single``);
3. the owner applies its local experts (SwiGLU: down(act(gate) * up)) to the rows it received;
4. results come back by the inverse all-to-all, are scaled by the routing weight at the source
   (so the router's gradient stays local) and summed per token.

The backward of each exchange is the inverse exchange, so expert gradients collect the
contributions of every rank's tokens; replicated (non-expert) parameters need the usual
data-parallel gradient sum. The expert tensors are DTensors ``Shard(0)`` over the ``ep`` mesh, so
state dicts, checkpoints and weight export see the full ``(E, ...)`` tensors under the HF names;
every local expert takes part in each forward (an empty row block when no token picks it), so
every rank has a gradient for each expert tensor (FSDP2 reduces them in step).

R3 replay: routing replay substitutes ``top_k_index`` (the recorded experts) in the router, before
this module; dispatch is a pure function of the indices it is given, so replay under EP selects
exactly the recorded experts (same tokens, same experts, same weights as without EP).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ExpertParallelExperts", "apply_expert_parallel"]


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: ``send[r]`` rows to rank r, ``recv[r]`` from it."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group or torch.distributed.group.WORLD)
    return funcol.wait_tensor(out)


class ExpertParallelExperts(nn.Module):
    """This rank's ``E / ep`` experts of a fused-expert module, with all-to-all token dispatch."""

    def __init__(self, experts: nn.Module, mesh) -> None:
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        total, ep = experts.num_experts, mesh.size()
        if total % ep:
            raise ValueError(f"moe.expert_parallel_size={ep} does not divide the {total} experts")
        self.num_experts, self.local, self.group, self.ep = total, total // ep, mesh.get_group(), ep
        lo, hi = mesh.get_local_rank() * self.local, (mesh.get_local_rank() + 1) * self.local

        def slice_of(full: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(DTensor.from_local(full.detach()[lo:hi].clone(), mesh, [Shard(0)], run_check=False))

        self.gate_up_proj = slice_of(experts.gate_up_proj)  # (E, 2I, H), this rank: (E/ep, 2I, H)
        self.down_proj = slice_of(experts.down_proj)  # (E, H, I), this rank: (E/ep, H, I)
        self.act_fn = experts.act_fn

    def _local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # (E/ep, 2I, H), (E/ep, H, I)
        out = torch.zeros_like(rows)  # rows (M, H), expert (M,) local expert ids
        for e in range(self.local):
            pick = (expert == e).nonzero().squeeze(-1)
            gate, up = nn.functional.linear(rows[pick], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, pick, nn.functional.linear(self.act_fn(gate) * up, down[e]))
        return out

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape  # hidden (T, H)
        flat = top_k_index.reshape(-1)  # (T*K,)
        owner = torch.div(flat, self.local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        token = torch.arange(t, device=hidden.device).repeat_interleave(k)[order]
        send_counts = torch.bincount(owner, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        torch.distributed.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = _exchange(hidden[token], send, recv, self.group)  # (M, H) rows for my experts
        expert = _exchange((flat[order] % self.local)[:, None], send, recv, self.group).squeeze(-1)
        back = _exchange(self._local_experts(rows, expert), recv, send, self.group)  # (T*K, H) sorted by owner
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)[:, None]
        return torch.zeros_like(hidden).index_add(0, token, back * weights)


def apply_expert_parallel(model: nn.Module, mesh) -> list[ExpertParallelExperts]:
    """Replace every fused ``experts`` module of ``model`` by this rank's slice over the 1-D ``mesh``
    (the EP group); returns the new modules."""
    replaced = []
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            module.experts = ExpertParallelExperts(experts, mesh)
            replaced.append(module.experts)
    if not replaced:
        raise ValueError(f"moe.expert_parallel_size={mesh.size()}: {type(model).__name__} has no fused experts "
                         "module (gate_up_proj/down_proj)")
    return replaced
