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

A SwiGLU MLP (``down_proj(silu(gate_proj(x)) * up_proj(x))``, checked on a probe input when grouping) runs its
gate/up GEMM and the activation as one function instead (:class:`GroupedSwiGLU`), whose backward writes the
gradient of the grouped GEMM's output, gate's half and up's half, in one pass (:func:`swiglu_backward`: the
activation's inputs and output gradient read once). With the members' gradients concatenated by the generic path,
Inductor on CUDA lowers the concatenation as one masked kernel over the grouped width that reads the activation's
inputs once per half, slower than the ungrouped layer's kernel (decision 0006).

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

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: swiglu_backward runs its torch formula
    triton = None

__all__ = ["GROUPING_MODES", "GROUPS", "GroupReport", "GroupedLinear", "GroupedSwiGLU", "group_projections",
           "swiglu_backward", "ungroup_projections", "use_grouping"]

# (parent attribute names run on one input, in the order transformers calls them)
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
GROUPING_MODES = ("auto", "on", "off")  # policy.train.group_projections
_GROUP_ATTR = "_lumenrl_grouped"


class GroupedLinear(torch.autograd.Function):
    """``F.linear(x, fused)`` split into the members' outputs, where ``fused`` is a view over ``weights`` stacked
    by rows; the weight gradient goes to ``weights`` (row blocks of one GEMM), none to ``fused``.

    The members' outputs are separate outputs of the function (column slices of one GEMM's result), so backward
    receives each member's output gradient on its own and concatenates them. Slicing one output instead made the
    concatenation a sum of zero-padded slices, which Inductor computed over the whole width and which cost more
    for q/k/v (decision 0006). Inductor on CUDA may still lower the concatenation as one masked kernel that
    recomputes each block's producer; the SwiGLU MLP's gate/up, where that re-reads the activation's inputs, goes
    through :class:`GroupedSwiGLU` instead.
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


def _swiglu_backward_torch(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    dyf = dy.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = dyf * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, dyf * silu], dim=-1).to(h.dtype)


if triton is not None:

    @triton.jit
    def _swiglu_backward_kernel(dy_ptr, h_ptr, dh_ptr, n, inter, BLOCK: tl.constexpr):
        """One program per BLOCK elements of (rows, inter): reads dy, gate, up once; writes both halves of dh."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // inter
        col = offs - row * inter
        gate_at = row * (2 * inter) + col
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + gate_at + inter, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = dy * up * sig * (1 + gate * (1 - sig))
        d_up = dy * gate * sig
        tl.store(dh_ptr + gate_at, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + gate_at + inter, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


def _swiglu_backward_triton(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    dy, h = dy.contiguous(), h.contiguous()
    dh = torch.empty_like(h)
    n = dy.numel()
    block = 1024
    _swiglu_backward_kernel[(triton.cdiv(n, block),)](dy, h, dh, n, dy.shape[-1], BLOCK=block, num_warps=4)
    return dh


@torch.library.custom_op("lumenrl::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` with respect to ``h = [gate, up]`` (last dimension), given the output
    gradient ``dy``: one (..., 2 * inter) tensor in ``h``'s dtype, computed in float32. On CUDA one Triton pass
    reads ``dy``, gate and up once and writes both halves; elsewhere (or without Triton) the same formula in torch.
    An opaque op under ``torch.compile``, so Inductor keeps that one pass."""
    if dy.shape[:-1] != h.shape[:-1] or h.shape[-1] != 2 * dy.shape[-1]:
        raise ValueError(f"swiglu_backward: dy {tuple(dy.shape)} and h {tuple(h.shape)}: h must be (..., 2 x dy's last)")
    if dy.is_cuda and triton is not None:
        return _swiglu_backward_triton(dy, h)
    return _swiglu_backward_torch(dy, h)


@swiglu_backward.register_fake
def _(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(h, memory_format=torch.contiguous_format)


class GroupedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` with ``[gate, up] = F.linear(x, fused)``, ``fused`` a view over the gate and up weights
    stacked by rows: one forward GEMM; backward one :func:`swiglu_backward` pass, one input-gradient GEMM and one
    weight-gradient GEMM whose row blocks are the two weights' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fused: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, fused)
        gate, up = h.split([w_gate.shape[0], w_up.shape[0]], dim=-1)
        ctx.save_for_backward(x, fused, h)
        ctx.rows = [w_gate.shape[0], w_up.shape[0]]
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, fused, h = ctx.saved_tensors
        dh = swiglu_backward(dy.contiguous(), h)
        d2 = dh.reshape(-1, dh.shape[-1])
        dx = (d2 @ fused).view(*dh.shape[:-1], fused.shape[1]) if ctx.needs_input_grad[0] else None
        dw = d2.t() @ x.reshape(-1, x.shape[-1])
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


_SWIGLU_ATTR = "_lumenrl_swiglu"
_SWIGLU_CLASSES: dict[type, type] = {}  # an MLP class -> its grouped subclass


def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    fused = self.__dict__[_SWIGLU_ATTR]
    return self.down_proj(GroupedSwiGLU.apply(x, fused, self.gate_proj.weight, self.up_proj.weight))


def _swiglu_mismatch(parent: nn.Module) -> str | None:
    """Why ``parent`` is not ``down_proj(silu(gate_proj(x)) * up_proj(x))``, from its forward on a probe input."""
    down = getattr(parent, "down_proj", None)
    if not isinstance(down, nn.Linear) or not hasattr(parent, "act_fn"):
        return "no down_proj/act_fn"
    w = parent.gate_proj.weight
    probe = torch.randn(3, w.shape[1], generator=torch.Generator(device=w.device).manual_seed(0), device=w.device,
                        dtype=w.dtype)
    with torch.no_grad():
        got = parent(probe).float()
        want = down(F.silu(parent.gate_proj(probe)) * parent.up_proj(probe)).float()
    tol = 1e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-5
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return "forward is not down_proj(silu(gate_proj(x)) * up_proj(x))"
    return None


def _group_swiglu(parent: nn.Module, fused: torch.Tensor) -> None:
    cls = type(parent)
    grouped = _SWIGLU_CLASSES.get(cls)
    if grouped is None:
        grouped = _SWIGLU_CLASSES[cls] = type(f"GroupedSwiGLU{cls.__name__}", (cls,), {"forward": _swiglu_mlp_forward})
    parent.__class__ = grouped
    parent.__dict__[_SWIGLU_ATTR] = fused


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


def use_grouping(mode: bool | str, *, single: bool, exact: bool, device: torch.device) -> bool:
    """Whether a training backend groups (``policy.train.group_projections``; a bool means ``on`` / ``off``):
    ``auto`` where the one-rank path (``single``) runs on CUDA without exact log-probs (measured there: decision
    0006); ``on`` insists, CPU included, and raises where it cannot; ``off`` never."""
    mode = ("on" if mode else "off") if isinstance(mode, bool) else mode
    if mode not in GROUPING_MODES:
        raise ValueError(f"policy.train.group_projections={mode!r} is not allowed; allowed: "
                         f"{', '.join(GROUPING_MODES)}")
    if mode == "off":
        return False
    problem = None
    if not single:
        problem = "the one-rank path is off here (several ranks, FP8 training or policy.train.single_device='off')"
    elif exact:
        problem = "exact_logprobs is on (its batch-invariant GEMMs run per module)"
    if problem is not None and mode == "on":
        raise ValueError(f"policy.train.group_projections='on' needs the one-rank path and exact_logprobs off: "
                         f"{problem}")
    return problem is None and (mode == "on" or torch.device(device).type == "cuda")


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
            if attrs == ("gate_proj", "up_proj") and _swiglu_mismatch(parent) is None:
                _group_swiglu(parent, fused)  # gate/up GEMM and the activation as one function
                report.grouped.append(f"{where} (SwiGLU)")
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
    originals = {grouped: cls for cls, grouped in _SWIGLU_CLASSES.items()}
    for m in model.modules():
        if type(m) is _GroupedMember:
            m.__class__ = nn.Linear
            del m.__dict__[_GROUP_ATTR]
            count += 1
        elif type(m) in originals:
            m.__class__ = originals[type(m)]
            del m.__dict__[_SWIGLU_ATTR]
            count += 2  # its gate and up projections
    return count
