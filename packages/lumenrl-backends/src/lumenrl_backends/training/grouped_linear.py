"""One GEMM for projections that read the same input: q/k/v, and gate/up, in the single-device training step.

A transformers decoder layer runs ``q_proj``, ``k_proj`` and ``v_proj`` on one input, then ``gate_proj`` and
``up_proj`` on another: five forward GEMMs, and in backward five weight-gradient GEMMs plus five input-gradient
GEMMs whose results autograd adds up. On the single-device path (:mod:`.single_device`) the module weights are
views of one flat buffer in parameter order, so a group's weights already lie one after another in memory:
one (rows of all members, K) view covers them. :func:`group_projections` makes each group's members run as one
GEMM over that view:

* forward: the first member's call runs ``x @ W_group.T`` once (:class:`GroupedLinear`) and returns its column
  slice; each later member called with the same input tensor returns its slice of that output. A member called
  with another input, out of order, or alone runs its own ``F.linear``: nothing depends on the call pattern for
  correctness, only for speed.
* backward: one input-gradient GEMM ``dY @ W_group`` (no adds) and one weight-gradient GEMM ``dY.T @ x`` whose
  row blocks are the members' gradients (views; autograd accumulates them into each parameter's ``grad`` as
  before, so the optimizer, the gradient stash of the flat AdamW and clipping see what they saw).

Same math as the separate GEMMs (each output column is the same dot product); cuBLAS may pick another tile for
the wider GEMM, so results differ by accumulation order only (tested against float64 and the unfused module).
A group is formed only where every member is a plain ``nn.Linear`` without bias, trainable, of one dtype and
device, and the weights are contiguous and adjacent in one storage; anything else keeps its own GEMMs
(``GroupReport.skipped`` says why). Not used by the bitwise mode (its batch-invariant GEMMs are per module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUPS", "GroupReport", "GroupedLinear", "group_projections", "ungroup_projections"]

# (parent attribute names run on one input, in the order transformers calls them)
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_GROUP_ATTR = "_lumenrl_grouped"


class GroupedLinear(torch.autograd.Function):
    """``F.linear(x, fused)`` split into the members' outputs, where ``fused`` is a view over ``weights`` stacked
    by rows; the weight gradient goes to ``weights`` (row blocks of one GEMM), none to ``fused``.

    The members' outputs are separate outputs of the function (column slices of one GEMM's result), so backward
    receives each member's output gradient on its own and concatenates them: under Inductor each gradient's
    producer then writes its block of the concatenation directly (gate's and up's from one SwiGLU-backward kernel,
    as without grouping). Slicing one output instead gives the concatenation as a sum of zero-padded slices, a
    kernel over the whole width that reads the SwiGLU inputs once per half (1.5x the bytes, measured on an H100).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, fused: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x, fused)
        ctx.rows = [w.shape[0] for w in weights]
        return F.linear(x, fused).split(ctx.rows, dim=-1)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, fused = ctx.saved_tensors
        grad = torch.cat(grads, dim=-1)  # unused outputs come as zeros (materialized grads)
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = (g2 @ fused).view(*grad.shape[:-1], fused.shape[1]) if ctx.needs_input_grad[0] else None
        dw = g2.t() @ x.reshape(-1, x.shape[-1])
        return (dx, None, *dw.split(ctx.rows))


class _Group:
    """One group's fused weight view and the outputs its first member computed for the later ones."""

    def __init__(self, members: list[nn.Linear], fused: torch.Tensor) -> None:
        self.members = members
        self.fused = fused
        # (input, the members' outputs)
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def run(self, index: int, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            outs = GroupedLinear.apply(x, self.fused, *(m.weight for m in self.members))
            self.pending = (x, outs)
            return outs[0]
        pending = self.pending
        if pending is None or pending[0] is not x:  # another input or order: this member's own GEMM
            return F.linear(x, module.weight, module.bias)
        if index == len(self.members) - 1:
            self.pending = None  # the last member: nothing keeps the output alive after it
        return pending[1][index]


class _GroupedMember(nn.Linear):
    """An ``nn.Linear`` whose forward goes through its group (class swapped in place; ``isinstance`` holds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, index = self.__dict__[_GROUP_ATTR]
        return group.run(index, self, x)


@dataclass
class GroupReport:
    grouped: list[str] = field(default_factory=list)  # "<parent>: q_proj+k_proj+v_proj"
    skipped: dict[str, str] = field(default_factory=dict)  # parent -> reason


def _fused_view(members: list[nn.Linear]) -> torch.Tensor | str:
    """A (sum of rows, K) view over the members' weights, or why there is none."""
    first = members[0].weight
    for m in members:
        w = m.weight
        if type(m) is not nn.Linear:
            return f"{type(m).__name__} is not a plain nn.Linear"
        if m.bias is not None:
            return "has a bias"
        if not w.requires_grad:
            return "frozen weight"
        if w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1]:
            return "members differ in dtype, device or input width"
        if not w.is_contiguous():
            return "weight not contiguous"
    offset = first.storage_offset()
    for m in members:
        if m.weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or m.weight.storage_offset() != offset:
            return "weights not adjacent in one storage"
        offset += m.weight.numel()
    rows = sum(m.out_features for m in members)
    view = torch.empty(0, dtype=first.dtype, device=first.device)
    return view.set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]), (first.shape[1], 1))


def group_projections(model: nn.Module) -> GroupReport:
    """Group every module's q/k/v and gate/up projections (module doc), in place; returns what was grouped."""
    report = GroupReport()
    for name, parent in model.named_modules():
        for attrs in GROUPS:
            members = [getattr(parent, a, None) for a in attrs]
            if not all(isinstance(m, nn.Module) for m in members):
                continue
            where = f"{name or '<root>'}: {'+'.join(attrs)}"
            fused = _fused_view(members)  # type: ignore[arg-type]
            if isinstance(fused, str):
                report.skipped[where] = fused
                continue
            group = _Group(members, fused)  # type: ignore[arg-type]
            for index, m in enumerate(members):
                m.__class__ = _GroupedMember
                m.__dict__[_GROUP_ATTR] = (group, index)
            report.grouped.append(where)
    return report


def ungroup_projections(model: nn.Module) -> int:
    """Undo :func:`group_projections` (each member runs its own GEMM again); returns how many were undone."""
    count = 0
    for m in model.modules():
        if type(m) is _GroupedMember:
            m.__class__ = nn.Linear
            del m.__dict__[_GROUP_ATTR]
            count += 1
    return count
