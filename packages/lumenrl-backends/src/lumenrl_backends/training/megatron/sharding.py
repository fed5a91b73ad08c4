"""Where each tensor of a Megatron-Core GPTModel lives under TP / PP / EP: pure tensor logic.

The *full* state dict is :meth:`FamilyAdapter.to_megatron`'s: global layer indices
(``decoder.layers.{i}``), global expert indices (``local_experts.{e}``), whole tensors. A rank at
coordinates (tp_rank, pp_rank, ep_rank) holds (Megatron-Core 0.16, local layer spec):

* pipeline stage ``s`` holds layers ``[s * L/pp, (s+1) * L/pp)`` under local indices
  ``decoder.layers.{i - s*L/pp}``; stage 0 the embedding, the last stage the final norm and the
  output layer. Tied embeddings with pp > 1: the last stage holds ``output_layer.weight`` too,
  a copy of the embedding (Megatron all-reduces their gradients over the embedding group).
* expert parallel rank ``r`` holds experts ``[r * E/ep, (r+1) * E/ep)`` as ``local_experts.{e - r*E/ep}``.
* tensor parallel rank ``t`` holds a slice of each TP-split tensor; ``split`` says which:

  ============  ================================================  ===========================
  split         tensors                                           rank t holds
  ============  ================================================  ===========================
  ``rows``      ``linear_qkv`` (whole query groups: the per-group  rows chunk t of tp
                interleave keeps a group's q, k, v together),
                ``word_embeddings`` / ``output_layer`` (vocab)
  ``swiglu``    ``linear_fc1`` = [gate; up] (F rows each)          [gate chunk t; up chunk t]
  ``cols``      ``linear_proj``, ``linear_fc2`` (row-parallel)     columns chunk t of tp
  None          norms, q/k norms, router                          the whole tensor
  ============  ================================================  ===========================

Experts are TP-split by the same rules (Megatron's expert tensor parallel size defaults to tp).
Splitting and merging are views, cat and chunk: HF -> shards -> merged is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["RankCoords", "Placement", "global_name", "placement", "rank_state_dict", "tp_merge", "tp_split"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCoords:
    """Parallel sizes and this rank's coordinates in them; ``num_layers``/``num_experts`` of the model."""

    num_layers: int
    num_experts: int = 0
    tp: int = 1
    pp: int = 1
    ep: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_layers % self.pp:
            raise ValueError(f"policy.parallel.pp={self.pp} does not divide num_hidden_layers={self.num_layers}")
        if self.ep > 1 and self.num_experts % self.ep:
            raise ValueError(f"moe.expert_parallel_size={self.ep} does not divide num_experts={self.num_experts}")

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a full tensor lives: its pipeline ``stage``, the ``expert_rank`` holding it (None: every
    EP rank), its name on that rank and how tensor parallel splits it."""

    stage: int
    expert_rank: int | None
    local_name: str
    split: str | None


def _split_of(suffix: str) -> str | None:
    if suffix.endswith(("linear_qkv.weight", "word_embeddings.weight")) or suffix == "output_layer.weight":
        return "rows"
    if suffix.endswith("linear_fc1.weight"):
        return "swiglu"
    if suffix.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return None


def placement(name: str, c: RankCoords) -> Placement:
    """Placement of the full tensor ``name`` (global layer and expert indices)."""
    last = c.pp - 1
    if name.startswith("embedding."):
        return Placement(0, None, name, _split_of(name))
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        return Placement(last, None, name, _split_of(name))
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no placement rule for Megatron tensor {name!r}")
    layer, rest = int(m.group(1)), m.group(2)
    stage, local_layer = divmod(layer, c.layers_per_stage)
    expert_rank = None
    e = _EXPERT.match(rest)
    if e is not None:
        expert_rank, local_expert = divmod(int(e.group(2)), c.experts_per_rank)
        rest = f"{e.group(1)}{local_expert}{e.group(3)}"
    return Placement(stage, expert_rank, f"decoder.layers.{local_layer}.{rest}", _split_of(rest))


def tp_split(full: torch.Tensor, split: str | None, tp: int) -> list[torch.Tensor]:
    """The ``tp`` slices of ``full`` (views; contiguous copies for ``cols`` and ``swiglu``)."""
    if split is None or tp == 1:
        return [full] * tp
    if split == "rows":
        return list(full.chunk(tp, dim=0))
    if split == "cols":
        return [part.contiguous() for part in full.chunk(tp, dim=1)]
    gate, up = full.chunk(2, dim=0)  # (F, H) each
    return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]


def tp_merge(shards: list[torch.Tensor], split: str | None) -> torch.Tensor:
    """Inverse of :func:`tp_split`."""
    if split is None or len(shards) == 1:
        return shards[0]
    if split == "rows":
        return torch.cat(shards, dim=0)
    if split == "cols":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]  # [(gate_t, up_t)]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def _check_divisible(name: str, full: torch.Tensor, split: str | None, tp: int) -> None:
    if split is None:
        return
    dim = 1 if split == "cols" else 0
    size = full.shape[dim] // (2 if split == "swiglu" else 1)
    if size % tp:
        raise ValueError(f"policy.parallel.tp={tp} does not divide dim {dim} ({size}) of {name}")


def rank_state_dict(full: Mapping[str, torch.Tensor], c: RankCoords, *, tied: bool) -> dict[str, torch.Tensor]:
    """The tensors the rank at ``c`` loads, under its local names (HF -> Megatron, sharded)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        p = placement(name, c)
        if p.stage != c.pp_rank or p.expert_rank not in (None, c.ep_rank):
            continue
        _check_divisible(name, tensor, p.split, c.tp)
        out[p.local_name] = tp_split(tensor, p.split, c.tp)[c.tp_rank]
    if tied and c.pp > 1 and c.pp_rank == c.pp - 1:  # the last stage's copy of the tied embedding
        out["output_layer.weight"] = tp_split(full["embedding.word_embeddings.weight"], "rows", c.tp)[c.tp_rank]
    return out


def global_name(local_name: str, c: RankCoords) -> str:
    """Inverse of :func:`placement`'s naming: this rank's ``local_name`` -> the full tensor's name."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    layer, rest = int(m.group(1)) + c.pp_rank * c.layers_per_stage, m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        rest = f"{e.group(1)}{int(e.group(2)) + c.ep_rank * c.experts_per_rank}{e.group(3)}"
    return f"decoder.layers.{layer}.{rest}"
