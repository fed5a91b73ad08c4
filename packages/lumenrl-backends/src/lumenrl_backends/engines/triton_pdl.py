"""Programmatic dependent launch (PDL) for the engine's Triton decode kernels: the one contract they share.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is still
running, once that kernel has executed ``griddepcontrol.launch_dependents`` (or finished). The engine's
kernels keep one rule, which makes any chain of them safe:

1. before ``griddepcontrol.wait`` a program touches nothing the previous kernels write; it may only issue
   L2 prefetches (a hint: L2 is the device's point of coherence, so a prefetched line is never stale);
2. then it waits (``gdc_wait``: the previous kernel has completed and its writes are visible);
3. then it lets the next kernel launch (``gdc_launch_dependents``).

Triggering only after the wait makes the guarantee transitive: when kernel N starts, every kernel before
N - 1 has completed. Inductor's PDL kernels (``triton.enable_pdl``) follow the same order. A kernel
launched without PDL (cuBLAS) serializes as before. PDL is CUDA sm90+ only; in Triton's CPU
interpreter the kernels run without it (:func:`pdl_supported` is False there).
"""

from __future__ import annotations

import torch

# one answer for the stack: lumenrl-quant's rowwise GEMM joins the same chains
from lumenrl_quant.triton_gemm import pdl_supported

__all__ = ["launch_options", "pdl_supported"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None

def launch_options(pdl: bool, device: torch.device) -> tuple[bool, dict[str, bool]]:
    """(whether the kernel runs its PDL prologue, the launch keyword arguments): PDL only where supported."""
    on = bool(pdl) and pdl_supported(device)
    return on, ({"launch_pdl": True} if on else {})


if triton is not None:

    @triton.jit
    def prefetch_l2(ptrs):
        """One ``prefetch.global.L2`` per pointer (each naming one 128-byte line)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """Steps 2 and 3 of the contract (no-ops without PDL)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
