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
data-parallel gradient sum.

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

    def __init__(self, experts: nn.Module, group, ep: int, ep_rank: int) -> None:
        super().__init__()
        total = experts.num_experts
        if total % ep:
            raise ValueError(f"moe.expert_parallel_size={ep} does not divide the {total} experts")
        self.num_experts, self.local, self.group, self.ep = total, total // ep, group, ep
        lo, hi = ep_rank * self.local, (ep_rank + 1) * self.local
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[lo:hi].clone())  # (E/ep, 2I, H)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[lo:hi].clone())  # (E/ep, H, I)
        self.act_fn = experts.act_fn

    def _local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(rows)  # rows (M, H), expert (M,) local expert ids
        for e in range(self.local):
            pick = (expert == e).nonzero().squeeze(-1)
            if pick.numel():
                gate, up = nn.functional.linear(rows[pick], self.gate_up_proj[e]).chunk(2, dim=-1)
                out = out.index_add(0, pick, nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
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


def apply_expert_parallel(model: nn.Module, group, ep: int, ep_rank: int) -> nn.Module:
    """Replace every fused ``experts`` module of ``model`` by this rank's expert-parallel slice."""
    replaced = 0
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            module.experts = ExpertParallelExperts(experts, group, ep, ep_rank)
            replaced += 1
    if not replaced:
        raise ValueError(
            f"moe.expert_parallel_size={ep}: {type(model).__name__} has no fused experts module (gate_up_proj/down_proj)"
        )
    return model
