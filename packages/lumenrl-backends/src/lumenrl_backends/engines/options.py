"""The native engine's kernel choices, one options object (STYLE 14: a config object per concern).

Every default is the path measured faster on an H200 (``benchmarks/RESULTS.md``) or, for the opt-in ones,
kept for A/B benchmarks and equivalence tests; the modules named below document each path.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KernelOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelOptions:
    """Which fused paths :class:`~lumenrl_backends.engines.NativeEngine` takes."""

    fuse_projections: bool = True  # one q/k/v and one gate/up GEMM per layer over fused storage (engines/fusion.py)
    fused_qk_rope: bool = True  # decode: q/k norms + RoPE + KV write as one Triton op (engines/triton_rope.py)
    fused_sampling: bool = True  # CUDA: one Triton pass over the logits, after a self-check (engines/triton_sampling.py)
    overlap_sync: bool = True  # queue decode step N + 1 before reading step N (engines/native.py)
    fused_moe: str = "auto"  # MoE experts on lumenrl-quant's Triton kernel: auto | on | off (engines/moe.py)
    kv_v_tiles: bool = False  # opt-in: V stored in (D, 128) tiles (engines/kv_cache.py)
    fuse_fp8_mlp: bool = False  # opt-in, fp8_row: SiLU * up and the FP8 quantization in the gate/up epilogue
    fp8_act_kernel: bool = True  # fp8_row: SiLU * up and the down input's quantization as one kernel
    fp8_attn_out: bool = True  # FP8 KV cache: decode attention writes FP8 codes for o_proj
    fp8_norm_quant: bool = True  # RMSNorm hands its fp8_row consumer per-token FP8 input (compile="full", CPU)
    decode_linear: str = "auto"  # CUDA, 16-bit decode GEMMs (M <= 128) on the Triton decode kernel (engines/triton_linear.py):
    # auto (shapes with measured launch parameters, 33..64 rows), on (every shape it takes, 1..128 rows), off
    pdl: bool = True  # CUDA sm90+: decode GEMMs, RoPE, attention and inductor's kernels launch with PDL (engines/triton_pdl.py)
    pdl_prefetch: int | None = None  # with pdl: bytes of each weight row a decode GEMM prefetches to L2 before its wait;
    # None: each kernel's default (bf16 decode GEMM 1024 = triton_linear.PDL_PREFETCH columns, FP8 rowwise 512)
    rope_in_attention: bool = False  # experiment, measured slower (decision 0023): decode q/k norms + RoPE + KV write
    # inside the attention kernel instead of a kernel of their own (engines/triton_rope_attention.py)
    fused_norm: bool = False  # experiment, measured slower (decision 0023): decode, 16-bit layers whose GEMMs are on
    # the decode kernel: the RMSNorms inside q/k/v and gate/up, the residual adds in o and down's epilogues
    pdl_prefetch_second: int | None = None  # the same for the GEMMs after a long kernel (o_proj after attention,
    # down_proj after gate/up), whose tails leave more time to prefetch; None: as pdl_prefetch
    tma: bool = False  # experiment, measured level (decision 0023), CUDA sm90+: the decode GEMMs (16-bit decode
    # kernel, FP8 rowwise) copy their tiles with the tensor memory accelerator instead of pointer loads (same bits)

    def __post_init__(self) -> None:  # refused when built, before any engine touches a model
        if self.decode_linear not in ("auto", "on", "off"):
            raise ValueError(f"kernels.decode_linear={self.decode_linear!r}; allowed: auto, on, off")
        for name in ("pdl_prefetch", "pdl_prefetch_second"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"kernels.{name}={value!r}; allowed: None or an int >= 0 (bytes per weight row)")

    def prefetches(self) -> tuple[int | None, int | None]:
        """(bytes per weight row prefetched by the GEMMs after a norm, by those after a long kernel); None: the
        kernel's default."""
        return self.pdl_prefetch, self.pdl_prefetch if self.pdl_prefetch_second is None else self.pdl_prefetch_second
