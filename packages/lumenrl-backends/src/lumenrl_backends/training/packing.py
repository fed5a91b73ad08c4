"""Padding-free training forwards: sequence packing and pad-column trimming.

An RL micro-batch is a (b, L) grid: left-padded prompts then right-padded responses, so a
plain forward spends compute on every pad cell. Two exact remedies, chosen per micro-batch by
:func:`plan_micro_batch` (whichever feeds fewer token slots to the model; ties keep the plain
layout, which on GPU can use SDPA's ``is_causal`` flash path):

* **trim**: drop the columns that are padding in *every* row (leading prompt columns, trailing
  response columns). Nothing else changes, so outputs are those of the untrimmed forward.
* **pack**: the valid tokens of each row (a *segment*, in column order) are bin-packed,
  first-fit decreasing, into R <= b rows of capacity C = max segment length (rounded up to
  ``align``). Position ids restart at 0 for each segment and the rows get no attention mask:
  transformers then detects the packed segments from the position ids
  (``find_packed_sequence_indices``) and attends block-diagonally (causal within a segment),
  so every token sees exactly the tokens it saw in its own padded row, with the same positions.
  The free tail of a row is filled with token 0 as its own segment and never read.

Log-probs: response token j of row i (column c = L - T + j) is predicted by the previous valid
token of row i. Its packed position is (r, p); the LM head runs only on the packed columns
that some row needs (``logits_to_keep`` as a 1-D index tensor, portable across transformers
versions), and the (b, T) output is scattered back (zeros where the response is padding).

Equality with the padded forward is exact in exact arithmetic; in fp32 the only differences are
reduction-order rounding (tests: float64 reference and padded vs packed on CPU). Packing needs
position ids equal to ``cumsum(mask) - 1`` on valid tokens (what the engine and
``position_ids_from_mask`` produce); other position layouts (e.g. 3-D rope ids) use trimming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PACKING_MODES",
    "PackPlan",
    "TrimPlan",
    "check_packing_mode",
    "first_fit_decreasing",
    "layout_routes",
    "unlayout_tokens",
    "pack_input_ids",
    "plan_micro_batch",
    "unpack_tokens",
]

PACKING_MODES = ("auto", "trim", "none")


@dataclass(kw_only=True, slots=True)
class TrimPlan:
    """Run the padded layout on columns ``[lo, hi)``; ``resp_len`` response columns stay."""

    lo: int
    hi: int
    resp_len: int  # T' <= T: response columns kept (the rest are padding in every row)
    slots: int  # b * (hi - lo)
    # every kept column is a valid token of every row and the positions are 0, 1, ... from ``lo``: the forward
    # needs neither a mask nor position ids (given either, transformers reads it back to look for padding or
    # packed sequences, a wait for the queued work)
    dense: bool = False


@dataclass(kw_only=True, slots=True)
class PackPlan:
    """Index maps between the padded (b, L) grid and R packed rows of capacity C."""

    rows: int  # R
    capacity: int  # C
    src: torch.Tensor  # (R*C,) flat index into the (b*L) grid; -1 for tail filler
    position_ids: torch.Tensor  # (R, C)
    keep: torch.Tensor  # (K,) packed columns whose logits are needed (sorted, unique)
    pred_row: torch.Tensor  # (N,) packed row of each predicted response token
    pred_col: torch.Tensor  # (N,) packed column of its predictor
    pred_k: torch.Tensor  # (N,) index of pred_col in ``keep``
    out_row: torch.Tensor  # (N,) row in the (b, T) output
    out_col: torch.Tensor  # (N,) column in the (b, T) output
    slots: int  # R * C

    def to(self, device: torch.device) -> PackPlan:
        moved = {k: getattr(self, k) for k in self.__slots__}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[k] = v.to(device, non_blocking=True)
        return PackPlan(**moved)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= ``capacity``; longest items placed first."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"capacity={capacity} is smaller than the longest item {max(lengths)}")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def _trim(mask: torch.Tensor, resp_len: int, position_ids: torch.Tensor | None = None) -> TrimPlan:
    b, L = mask.shape
    cols = mask.any(dim=0).nonzero().flatten().tolist()
    lo = min(cols[0], L - resp_len - 1) if cols else 0
    hi = max(cols[-1] + 1, L - resp_len + 1) if cols else L
    dense = bool(cols) and bool(mask[:, lo:hi].all())
    if dense and position_ids is not None:  # the columns before lo hold no token: positions must restart at lo
        dense = bool((position_ids.cpu()[:, lo:hi] == torch.arange(hi - lo)).all())
    return TrimPlan(lo=lo, hi=hi, resp_len=hi - (L - resp_len), slots=b * (hi - lo), dense=dense)


def _positions_are_cumsum(mask: torch.Tensor, position_ids: torch.Tensor | None) -> bool:
    if position_ids is None:
        return True
    if position_ids.dim() != 2 or position_ids.shape != mask.shape:
        return False
    expected = mask.long().cumsum(-1) - 1
    return bool((position_ids.cpu()[mask] == expected[mask]).all())


def _pack(mask: torch.Tensor, resp_len: int, align: int) -> PackPlan:
    b, L = mask.shape
    valid = [mask[i].nonzero().flatten() for i in range(b)]  # segment columns, in order
    lengths = [int(v.numel()) for v in valid]
    capacity = -(-max(max(lengths), 1) // align) * align
    bins = first_fit_decreasing(lengths, capacity)
    src = torch.full((len(bins), capacity), -1, dtype=torch.long)
    pos = torch.zeros(len(bins), capacity, dtype=torch.long)
    preds: list[torch.Tensor] = []  # (n, 4): pred_row, pred_col, out_row, out_col
    for r, items in enumerate(bins):
        off = 0
        for i in items:
            cols, n = valid[i], lengths[i]
            src[r, off : off + n] = i * L + cols
            pos[r, off : off + n] = torch.arange(n)
            resp = (cols >= L - resp_len).nonzero().flatten()
            resp = resp[resp >= 1]  # a token with no valid token before it has no predictor
            preds.append(
                torch.stack(
                    [torch.full_like(resp, r), off + resp - 1, torch.full_like(resp, i), cols[resp] - (L - resp_len)],
                    dim=1,
                )
            )
            off += n
        pos[r, off:] = torch.arange(capacity - off)  # filler: its own segment, never read
    pred = torch.cat(preds) if preds else torch.zeros(0, 4, dtype=torch.long)
    keep, pred_k = torch.unique(pred[:, 1], sorted=True, return_inverse=True)
    return PackPlan(
        rows=len(bins),
        capacity=capacity,
        src=src.flatten(),
        position_ids=pos,
        keep=keep,
        pred_row=pred[:, 0],
        pred_col=pred[:, 1],
        pred_k=pred_k,
        out_row=pred[:, 2],
        out_col=pred[:, 3],
        slots=len(bins) * capacity,
    )


def check_packing_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`PACKING_MODES`; else a ValueError naming the config key."""
    if mode not in PACKING_MODES:
        raise ValueError(f"policy.train.packing={mode!r} is not allowed; allowed: {', '.join(PACKING_MODES)}")
    return mode


def plan_micro_batch(
    attention_mask: torch.Tensor,
    resp_len: int,
    *,
    position_ids: torch.Tensor | None = None,
    mode: str = "auto",
    align: int = 8,
) -> TrimPlan | PackPlan | None:
    """The cheapest exact layout for a (b, L) micro-batch, or None for the plain padded forward. A batch without
    padding gets a :class:`TrimPlan` over all its columns marked ``dense``."""
    if check_packing_mode(mode) == "none":
        return None
    mask = attention_mask.detach().cpu().bool()
    b, L = mask.shape
    if not 0 < resp_len < L:
        raise ValueError(f"response length {resp_len} must be in [1, {L - 1}] for sequences of length {L}")
    trim = _trim(mask, resp_len, position_ids)
    best: TrimPlan | PackPlan | None = trim if trim.slots < b * L or trim.dense else None
    if mode == "auto" and _positions_are_cumsum(mask, position_ids):
        cost = trim.slots if best is not None else b * L
        lengths = mask.sum(-1)
        if int(lengths.sum()) < cost:  # some interior padding could go
            pack = _pack(mask, resp_len, align)
            if pack.slots < cost:
                best = pack
    return best


def pack_input_ids(plan: PackPlan, input_ids: torch.Tensor) -> torch.Tensor:
    """(R, C) packed token ids (filler slots get token 0) from the padded (b, L) ``input_ids``."""
    flat = input_ids.reshape(-1)
    ids = torch.where(plan.src >= 0, flat[plan.src.clamp(min=0)], torch.zeros_like(plan.src))
    return ids.view(plan.rows, plan.capacity)


def unpack_tokens(plan: PackPlan, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Scatter per-token ``values`` (N,) into a zero (b, T) float32 grid (differentiable)."""
    out = values.new_zeros(shape, dtype=torch.float32)
    return out.index_put((plan.out_row, plan.out_col), values.float())


def layout_routes(plan: TrimPlan | PackPlan | None, routes: torch.Tensor) -> torch.Tensor:
    """R3: per-token rows (b, L, ...) -> (N, ...) in the forward's flattened token order: packed
    (filler slots get the row 0..k-1 of a pad token, which repeats no expert), trimmed or padded."""
    if isinstance(plan, PackPlan):
        flat = routes.reshape(-1, *routes.shape[2:])[plan.src.clamp(min=0)]  # (R*C, ...)
        if routes.dtype.is_floating_point:
            return flat
        pad = torch.arange(routes.shape[-1], dtype=routes.dtype, device=routes.device)
        filler = (plan.src < 0).view(-1, *([1] * (flat.dim() - 1)))
        return torch.where(filler, pad, flat)
    if isinstance(plan, TrimPlan):
        routes = routes[:, plan.lo : plan.hi]
    return routes.reshape(-1, *routes.shape[2:])


def unlayout_tokens(plan: TrimPlan | PackPlan | None, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`layout_routes` for per-token values (N,) -> (b, L) (zeros where not run)."""
    out = values.new_zeros(shape[0] * shape[1])
    if isinstance(plan, PackPlan):
        real = plan.src >= 0
        out[plan.src[real]] = values[real]
        return out.view(shape)
    if isinstance(plan, TrimPlan):
        grid = out.view(shape)
        grid[:, plan.lo : plan.hi] = values.view(shape[0], plan.hi - plan.lo)
        return grid
    return values.view(shape)
