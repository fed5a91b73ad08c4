"""Small transformer pieces the drafts are built from (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

Design: the drafts take explicit boolean attention masks ``(B, 1, Tq, Tk)`` ("may attend") and
explicit RoPE positions ``(B, T)``, so one attention function serves training (the Eagle3
training-time test, DFlash anchored blocks) and inference against the drafts' own KV caches.
RoPE is the Llama/Qwen rotate-half form with ``rope_theta``. Parameter names follow the HF Llama
layout (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``)
so an Eagle3 draft exports to the tensor names vLLM and SGLang load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "Attention", "MLP", "apply_rope", "attend", "rope_tables"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, in float32, rounded once to x's dtype:
        torch's ``rms_norm`` (one fused kernel on CUDA, where the draft's chained steps would otherwise launch
        ~7 elementwise kernels per norm), as serving engines' RMSNorm kernels round it."""
        if self.weight.dtype != x.dtype:  # mixed dtypes: the same math written out
            x32 = x.float()
            out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
            return out.to(torch.promote_types(x.dtype, self.weight.dtype))
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> RoPE (cos, sin), each (B, 1, T, D/2) in ``dtype``: computed once, shared by the
    query and key of a step (:func:`apply_rope`'s ``tables``)."""
    half = dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, device=positions.device, dtype=torch.float32) / half))  # (D/2,)
    angles = positions.float()[:, None, :, None] * inv  # (B, 1, T, D/2)
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x (B, H, T, D), positions (B, T) -> rotated x (rotate-half RoPE); ``tables``: :func:`rope_tables` of
    these positions (the same values, not recomputed)."""
    half = x.shape[-1] // 2
    cos, sin = tables if tables is not None else rope_tables(positions, x.shape[-1], theta, x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (B, H, Tq, D), k/v (B, H_kv, Tk, D), allowed (B, 1, Tq, Tk) bool -> (B, Tq, H * D)."""
    rep = q.shape[1] // k.shape[1]
    b, heads, tq, d = q.shape
    if rep > 1 and tq == 1 and allowed.shape[1] == 1:  # decode: the group's heads share K/V and the mask
        packed = q.reshape(b, k.shape[1], rep, d)  # (B, H_kv, rep, D): one pass over K/V, no repeat_interleave
        out = F.scaled_dot_product_attention(packed, k, v, attn_mask=allowed)  # mask (B, 1, 1, Tk) broadcasts
        return out.reshape(b, 1, heads * v.shape[-1])
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, Tq, D)
    return out.transpose(1, 2).flatten(2)


class Attention(nn.Module):
    """GQA projections; ``in_size`` may differ from ``hidden_size`` (Eagle3: 2H in)."""

    def __init__(self, *, in_size: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(in_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # (B, n, T, D)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.head_dim, self.rope_theta, dtype)

    def query(self, x: torch.Tensor, positions: torch.Tensor, tables: tuple | None = None) -> torch.Tensor:
        return apply_rope(self._heads(self.q_proj(x), self.num_heads), positions, self.rope_theta, tables)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor, tables: tuple | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        k = apply_rope(self._heads(self.k_proj(x), self.num_kv_heads), positions, self.rope_theta, tables)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
