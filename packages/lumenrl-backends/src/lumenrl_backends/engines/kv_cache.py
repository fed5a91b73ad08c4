"""Slot-based preallocated KV cache for the native engine, plus its attention masks.

Layout: per layer, ``keys`` (S, H_kv, L, D_k) and ``values`` (S, H_kv, L, D_v) with S = engine
slots (max concurrent sequences) and L = max sequence length in cache columns. Tensors are
allocated once, on the first write (so any attention variant fits: GQA, MLA latents of
DeepSeek-V3 with D_k != D_v), and then only written in place: no per-step allocation, stable
data pointers (what CUDA graphs need).

Each sequence owns one slot (a row). Its tokens occupy columns 0..n-1 of that row, left-padded
prompts included (pad columns are marked invalid in ``valid`` (S, L) bool). Every row has its
own write column and its own RoPE position, so rows admitted at different times (continuous
batching) decode together in one fixed-shape step.

The model sees this object as a ``transformers.Cache``: attention layers call
``cache.update(k, v, layer_idx)``. What that call does depends on the *view* the engine sets
before each forward:

* prefill view (fresh sequences in arbitrary slots): the new K/V are written to their slots and
  returned as-is, since a fresh prompt attends only to itself (no gather of the cache); a packed prefill
  (one batch row holding the sequences back to back, no padding) gives each token its own slot and column
  (rows (1, T)) and the sequences' offsets (``segments``), read by the engine's varlen attention;
* decode view (rows ``0..b-1``, one new token each, or q each in speculative decoding's verify
  forward): the tokens are written at each row's own columns and the layer gets the first ``kv_len``
  columns of rows ``0..b-1`` (a view, no copy).
  A layer whose decode kernel writes K/V itself (``fused_qk_rope``:
  :mod:`~lumenrl_backends.engines.triton_rope`) takes the buffers from :meth:`SlotKVCache.decode_write_target`
  and then reads what ``update`` would have returned from :meth:`SlotKVCache.decode_read`.

With an FP8 ``kv_dtype`` the cache stores FP8 K/V with static per-layer scales (calibrated
from a prefill, recalibrated after weight updates: :class:`~lumenrl_backends.engines.quant.FP8KVCodec`)
and attention reads the dequantized values, prefill included, so every token sees the same
precision. With ``raw_fp8_decode`` (set by the engine for its ``sdpa`` path) decode returns the
FP8 storage itself and leaves the layer's scales in ``current_scales``; the engine's attention
(:mod:`~lumenrl_backends.engines.attention`) dequantizes in its kernel or just before SDPA.

V in tiles (``v_tile`` T > 0; the engine's opt-in ``kv_v_tiles``): ``values`` is (S, H_kv, L / T, D, T),
column ``c`` of a head at ``[..., c // T, :, c % T]``. Each T-column block of a head is one contiguous
(D, T) tile, so the kernel's p.v product reads V with the reduction dim (columns) contiguous: the
layout the MMA wants for its B operand, which 8-bit rows cannot give (no 8-bit ``ldmatrix.trans``).
The attention call gets faster (benchmarks/RESULTS.md, entry ``attention``), but the decode step's V
write scatters (one byte per D row), and whole 8B steps were no faster. Decode
returns the tiles as stored (5-D) to the engine's attention; every other reader gets rows from
:func:`value_rows`.

Masks are explicit 4D tensors (bool for SDPA, additive float for eager) built from ``valid``,
so transformers never needs a sequence length from the cache. A query always sees itself, so no
row is fully masked (pad rows would otherwise produce NaN in SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lumenrl_backends.engines.quant import FP8KVCodec

__all__ = ["CacheView", "DecodeWrite", "SlotKVCache", "V_TILE", "decode_mask", "decode_masks", "packed_mask", "prefill_mask",
           "to_attention_mask", "value_rows", "value_tiles"]

V_TILE = 128  # columns per V tile where the cache stores V in tiles (a multiple of the kernel's block_n)


def value_tiles(values: torch.Tensor, tile: int) -> torch.Tensor:
    """(B, H_kv, L, D) rows -> (B, H_kv, ceil(L / tile), D, tile) tiles (a copy; columns past L are zero):
    the inverse of :func:`value_rows`."""
    b, h, length, d = values.shape
    n = -(-length // tile)
    padded = values.new_zeros((b, h, n * tile, d))
    padded[:, :, :length] = values
    return padded.reshape(b, h, n, tile, d).transpose(-1, -2).contiguous()


def value_rows(values: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """V as (B, H_kv, L, D) rows: a tiled (B, H_kv, L / T, D, T) tensor is copied out (first ``length``
    columns); a 4-D one is returned as is."""
    if values.dim() != 5:
        return values
    b, h, n, d, t = values.shape
    rows = values.transpose(-1, -2).reshape(b, h, n * t, d)
    return rows if length is None else rows[:, :, :length]


@dataclass(kw_only=True, slots=True)
class CacheView:
    """Where the next forward writes and what it reads."""

    rows: torch.Tensor  # (b,) int64 slot index of each batch row; a packed prefill: (1, T), each token's slot
    columns: torch.Tensor  # (b, q) int64 cache column of each new token
    decode: bool  # True: read back rows 0..b-1 (rows must be arange(b)); False: fresh prefill
    kv_len: int  # decode: number of cache columns visible to attention
    # decode, compile="full": the step's RoPE (cos, sin), each (b, 1, D), computed once before the forward; the
    # fused q/k-norm + RoPE + KV-write op reads these instead of the forward's position embeddings (engines/fusion.py)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # a packed prefill (sequences back to back in one batch row, :mod:`~lumenrl_backends.engines.prefill`): (n + 1,)
    # int32 offsets of the sequences' tokens, the longest one, and whether attention runs the varlen kernel on them
    # (else the forward's mask is block-diagonal)
    segments: torch.Tensor | None = None
    longest: int = 0
    varlen: bool = False


class DecodeWrite(NamedTuple):
    """What a fused decode kernel needs to write one layer's new K/V itself (a NamedTuple: traceable)."""

    keys: torch.Tensor  # (S, H_kv, L, D_k) the layer's key storage: FP8 codes or the model dtype
    values: torch.Tensor  # (S, H_kv, L, D_v), or (S, H_kv, L / T, D_v, T) tiles
    columns: torch.Tensor  # (b, q) int64 write columns of rows 0..b-1 (q > 1: distinct within a row)
    k_scale: torch.Tensor | None  # FP8 cache: one-element dequant scales (x ≈ code * scale); else None
    v_scale: torch.Tensor | None


class _SlotLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotKVCache) -> None:
        super().__init__()
        self._owner = owner
        self.codec = FP8KVCodec(owner.kv_dtype) if owner.kv_dtype is not None else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, length = self._owner.max_slots, self._owner.max_len
        self.device, self.dtype = key_states.device, key_states.dtype  # dtype: what attention computes in
        storage = self._owner.kv_dtype or key_states.dtype
        self.keys = torch.zeros(
            (slots, key_states.shape[1], length, key_states.shape[-1]), dtype=storage, device=self.device
        )
        tile = self._owner.v_tile
        shape = ((slots, value_states.shape[1], -(-length // tile), value_states.shape[-1], tile) if tile
                 else (slots, value_states.shape[1], length, value_states.shape[-1]))
        self.values = torch.zeros(shape, dtype=storage, device=self.device)
        self.is_initialized = True

    def _encode(self, key_states: torch.Tensor, value_states: torch.Tensor, decode: bool):
        if self.codec is None:
            return key_states, value_states
        if self.codec.scales is None or (self._owner.recalibrate and not decode):
            self.codec.calibrate(key_states, value_states)
        return self.codec.encode(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        view = self._owner.view
        if view is None:
            raise RuntimeError("SlotKVCache.update called without a view; the engine sets one per forward")
        stored_k, stored_v = self._encode(key_states, value_states, view.decode)
        rows = view.rows[:, None] if view.rows.dim() == 1 else view.rows  # (b, 1), or (1, T) packed
        self.keys[rows, :, view.columns] = stored_k.transpose(1, 2).to(self.keys.dtype)  # (b, q, H, D)
        if self._owner.v_tile:
            tile = self._owner.v_tile
            self.values[rows, :, view.columns // tile, :, view.columns % tile] = stored_v.transpose(1, 2).to(
                self.values.dtype)
        else:
            self.values[rows, :, view.columns] = stored_v.transpose(1, 2).to(self.values.dtype)
        if view.decode:
            return self.decode_read()
        if self.codec is not None:  # attention sees exactly what the cache holds
            return self.codec.decode(stored_k, stored_v, self.dtype)
        return stored_k, stored_v

    def decode_read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns in decode, without writing: the first ``kv_len`` columns of rows
        0..b-1 (views); FP8: as stored with the scales in ``current_scales`` (``raw_fp8_decode``), or
        dequantized."""
        view = self._owner.view
        batch = view.rows.shape[0]
        tile = self._owner.v_tile
        stored_k = self.keys[:batch, :, : view.kv_len]
        # tiles: the ones holding the first kv_len columns, as stored (the engine's attention reads them)
        stored_v = self.values[:batch, :, : -(-view.kv_len // tile)] if tile else self.values[:batch, :, : view.kv_len]
        if self.codec is None:
            return stored_k, stored_v
        if self._owner.raw_fp8_decode:  # the engine's attention dequantizes
            self._owner.current_scales = self.codec.scales
            return stored_k, stored_v
        return self.codec.decode(stored_k, value_rows(stored_v, view.kv_len), self.dtype)

    def decode_write_target(self, key_states: torch.Tensor, value_states: torch.Tensor) -> DecodeWrite | None:
        """The buffers and scales for a kernel that writes this decode step's K/V itself, or None where
        ``update`` must write (no decode view; an FP8 cache before its first calibration, which only a
        prefill's ``update`` does, or with scales that are not one per tensor). key/value_states
        (b, H_kv, q, D) size the buffers on first use, as ``update`` does; q > 1 (speculative decoding's
        verify forward) writes q columns per row, the view's (distinct within a row: ``col + arange(q)``)."""
        view = self._owner.view
        if view is None or not view.decode or view.columns.shape != (view.rows.shape[0], key_states.shape[2]):
            return None
        scales = None if self.codec is None else self.codec.scales
        if self.codec is not None and (scales is None or scales.k_scale.numel() != 1 or scales.v_scale.numel() != 1):
            return None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return DecodeWrite(self.keys, self.values, view.columns, None if scales is None else scales.k_scale,
                           None if scales is None else scales.v_scale)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        view = self._owner.view
        kv_len = view.kv_len if view is not None and view.decode else query_length
        return kv_len, 0

    def get_seq_length(self) -> int:
        return 0  # positions are always passed explicitly; there is no single length

    def get_max_length(self) -> int:
        return self._owner.max_len

    def get_max_cache_shape(self) -> int:  # transformers < 5.11 names get_max_length so (abstract there)
        return self._owner.max_len

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


class SlotKVCache(Cache):
    """``max_slots`` x ``max_len`` KV cache with per-slot validity (see module docstring)."""

    def __init__(
        self,
        *,
        num_layers: int,
        max_slots: int,
        max_len: int,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        v_tile: int = 0,
    ) -> None:
        if v_tile < 0 or v_tile & (v_tile - 1):
            raise ValueError(f"v_tile={v_tile!r}; allowed: 0 (V by rows) or a power of two (columns per V tile)")
        self.max_slots, self.max_len = max_slots, max_len
        self.v_tile = v_tile  # > 0: V stored in (D, v_tile) tiles (module docstring); decode returns them 5-D
        self.kv_dtype = kv_dtype  # None: the model's dtype; an FP8 dtype: quantized with per-layer scales
        self.recalibrate = False  # FP8: recompute scales during the next prefill
        self.raw_fp8_decode = False  # FP8 decode returns stored tensors; the engine's attention dequantizes
        self.current_scales = None  # FP8 scales of the layer whose K/V were returned last
        self.view: CacheView | None = None
        self.valid = torch.zeros((max_slots, max_len), dtype=torch.bool, device=device)  # (S, L)
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def set_view(self, view: CacheView | None) -> None:
        self.view = view

    def decode_write_target(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> DecodeWrite | None:
        """Layer ``layer_idx``'s buffers for a decode kernel that writes K/V itself (see ``_SlotLayer``)."""
        return self.layers[layer_idx].decode_write_target(key_states, value_states)

    def decode_read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update(k, v, layer_idx)`` returns in decode, after a kernel wrote K/V itself."""
        return self.layers[layer_idx].decode_read()

    def clear_slots(self, rows: torch.Tensor) -> None:
        self.valid[rows] = False

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        """Slots ``targets`` (n,) take the first ``width`` columns of slots ``sources`` (n,): validity and every
        layer's stored K/V (FP8 codes as stored: the scales are per layer), the rest of each target row invalid.
        A prefill shared by rows of one context (the native engine's ``share_prefill``)."""
        self.valid[targets] = False
        self.valid[targets, :width] = self.valid[sources, :width]
        tiles = -(-width // self.v_tile) if self.v_tile else width  # V's leading columns, or the tiles holding them
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[targets, :, :width] = layer.keys[sources, :, :width]
                layer.values[targets, :, :tiles] = layer.values[sources, :, :tiles]


def _window_ok(q_col: torch.Tensor, k_col: torch.Tensor, window: int | None) -> torch.Tensor | bool:
    if window is None:
        return True
    return (q_col - k_col) < window


def prefill_mask(token_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(b, P) 0/1 mask of left-padded inputs -> (b, 1, P, P) bool: causal, real keys, self always."""
    length = token_mask.shape[1]
    cols = torch.arange(length, device=token_mask.device)
    q_col, k_col = cols[:, None], cols[None, :]
    causal = (k_col <= q_col) & _window_ok(q_col, k_col, window)  # (P, P)
    allowed = causal[None] & token_mask.bool()[:, None, :]  # (b, P, P)
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=token_mask.device)[None]
    return allowed[:, None]


def packed_mask(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """(n,) lengths of sequences packed back to back in ``total`` tokens -> (1, 1, total, total) bool: causal within
    each sequence, nothing across (the mask of a packed prefill where no varlen kernel runs)."""
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths, output_size=total)
    cols = torch.arange(total, device=lengths.device)
    allowed = (segment[:, None] == segment[None, :]) & (cols[None, :] <= cols[:, None])
    return allowed[None, None]


def decode_mask(
    valid: torch.Tensor, write_cols: torch.Tensor, kv_len: int, window: int | None = None
) -> torch.Tensor:
    """valid (b, L) bool, write_cols (b,) -> (b, 1, 1, kv_len) bool; the written column is visible."""
    cols = torch.arange(kv_len, device=valid.device)[None, :]
    allowed = valid[:, :kv_len] | (cols == write_cols[:, None])
    allowed = allowed & (cols <= write_cols[:, None]) & _window_ok(write_cols[:, None], cols, window)
    return allowed[:, None, None, :]


def decode_masks(
    valid: torch.Tensor, write_cols: torch.Tensor, batch: int, kv_len: int, window: int | None, mixed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's masks over slots 0..batch-1: marks each slot's write column valid in ``valid`` (S, L)
    (in place), then (allowed, allowed without the window; the same tensor unless ``mixed``), each
    (batch, 1, 1, kv_len) bool. One function so that the engine compiles it into one kernel (``compile="full"``)."""
    rows = valid[:batch]
    rows.scatter_(1, write_cols[:, None], True)
    allowed = decode_mask(rows, write_cols, kv_len, window)
    return allowed, decode_mask(rows, write_cols, kv_len, None) if mixed else allowed


def to_attention_mask(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """Bool 'may attend' mask -> the 4D mask format the attention implementation expects."""
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    if attn_implementation not in ("sdpa", "lumenrl_exact"):  # lumenrl_exact (exact mode): sdpa's boolean masks
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not supported by the native engine; use sdpa or eager"
        )
    return allowed
