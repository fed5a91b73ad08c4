"""Triton quantize kernels under Triton's CPU interpreter, every launch configuration the benchmark tunes.

Runs where ``triton`` is installed (``lumenrl-quant[triton]``), in a subprocess because
``TRITON_INTERPRET`` must be set before the kernels are decorated. The interpreter's own FP8
cast does not round like CUDA (it can be off by a binade), so the expected codes here are the
torch reference's scaled values cast by the interpreter itself, and scales must match the torch
path exactly; the GPU test in test_quant_triton.py checks bit-identity with torch on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl
    from lumenrl_quant import triton_kernels as tk
    from lumenrl_quant.fp8 import quantize_fp8
    from lumenrl_quant.mx import quantize_mx

    torch.manual_seed(0)

    @triton.jit
    def _cast(y_ptr, q_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + offs, mask=offs < n)
        tl.store(q_ptr + offs, y.to(tl.float8e4nv), mask=offs < n)

    def interp_cast(y):
        q = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
        _cast[(triton.cdiv(y.numel(), 1024),)](y.contiguous().reshape(-1), q.reshape(-1), y.numel(), BLOCK=1024)
        return q

    def check(name, got, x, expand):
        q, s = got
        qr, sr = quantize_fp8(x, **REF[name.split()[0]], backend="torch")
        assert torch.equal(s.float(), sr.float().reshape(s.shape)), f"{name}: scales differ"
        y = (x.float() / expand(sr.float())).clamp(-448, 448)
        assert torch.equal(q.view(torch.uint8), interp_cast(y).view(torch.uint8)), f"{name}: codes differ"

    REF = {"1x128": {"granularity": "block", "block_size": (1, 128)}, "rowwise": {"granularity": "rowwise"},
           "128x128": {"granularity": "block", "block_size": (128, 128)}, "tensorwise": {"granularity": "tensorwise"}}
    cols128 = lambda s: s.repeat_interleave(128, dim=-1)  # noqa: E731
    blocks = lambda s: s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200]  # noqa: E731

    x = torch.randn(40, 512) * 3
    for cfg in (None, {"block_m": 1, "ng": 1, "num_warps": 4}, {"block_m": 8, "ng": 8, "num_warps": 4},
                {"block_m": 16, "ng": 4, "num_warps": 8}, {"block_m": 4, "ng": 2, "num_warps": 4}):
        check(f"1x128 {cfg}", tk.fp8_quantize_groups(x, 128, config=cfg), x, cols128)
    for cfg in ({"block_m": 1, "num_warps": 4}, {"block_m": 2, "num_warps": 8}, {"block_m": 4, "num_warps": 4}):
        check(f"rowwise {cfg}", tk.fp8_quantize_groups(x, 512, config=cfg), x, lambda s: s)
    x3 = torch.randn(24, 384)  # group 384: tile 512, masked; K not a power of two
    check("rowwise 384", tk.fp8_quantize_groups(x3, 384), x3, lambda s: s)
    w = torch.randn(200, 640)  # 128x128 blocks with a partial row block and an odd number of K blocks
    for cfg in ({"impl": "tile", "ng": 1, "num_warps": 8}, {"impl": "tile", "ng": 2, "num_warps": 4},
                {"impl": "tile", "ng": 4, "num_warps": 8}, None, {"impl": "2pass", "rows": 16, "num_warps": 4},
                {"impl": "2pass", "rows": 64, "num_warps": 8, "hints": 1},
                {"impl": "2pass", "rows": 32, "num_warps": 4, "tiles": 4},  # 5 K blocks: a part-empty program
                {"impl": "2pass", "rows": 32, "num_warps": 4, "k_first": 1},  # block-row-major grid
                {"impl": "2pass", "rows": 32, "num_warps": 4, "tiles": 2, "k_first": 1}):
        check(f"128x128 {cfg}", tk.fp8_quantize_blocks(w, 128, config=cfg), w, blocks)
    for cfg in ({"amax_block": 1024, "amax_warps": 4, "cast_block": 512, "cast_warps": 4},):
        check("tensorwise", tk.fp8_quantize_tensorwise(x, config=cfg), x, lambda s: s)
    for cfg in ({"block_m": 4, "block_k": 64, "num_warps": 4}, {"block_m": 16, "block_k": 256, "num_warps": 8}, None):
        d, s = tk.mx_quantize(x, "e4m3", config=cfg)  # power-of-two scaling: exact before the cast
        ref = quantize_mx(x, "e4m3", backend="torch")
        assert torch.equal(s, ref.scale), f"mx {cfg}: scales differ"
        inv = torch.exp2(127.0 - ref.scale.float()).repeat_interleave(32, dim=-1)
        y = (x * inv).clamp(-448, 448)
        assert torch.equal(d.view(torch.uint8), interp_cast(y).view(torch.uint8)), f"mx {cfg}: codes differ"
    x4 = x.clone()  # every E2M1 tie and threshold, both signs, inside blocks whose scale exponent is 0
    x4[0, :32] = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 5.99,
                               0.26, 0.74, 1.24, 1.26, 1.74, 1.76, 2.49, 2.51, 3.49, 3.51, 4.99, 5.01, 0.1, 0.9,
                               1.1, 2.2])
    x4[1, :32] = -x4[0, :32]
    ref4 = quantize_mx(x4, "e2m1", backend="torch")
    for cfg in (None, {"block_m": 4, "block_k": 128, "num_warps": 4},
                {"impl": "sum", "block_m": 2, "block_k": 256, "num_warps": 4}):
        d, s = tk.mx_quantize(x4, "e2m1", config=cfg)
        assert torch.equal(s, ref4.scale) and torch.equal(d, ref4.data), f"mx e2m1 {cfg}: differs"

    def mx16(dtype, m, k, lo, hi):
        # 32-element blocks of random 16-bit values spanning <= 15 binades under a random block
        # exponent: every E2M1 code, ties of every kind, codes 0 below the grid, subnormal inputs
        e = torch.randint(lo, hi, (m, k // 32, 1)) - torch.randint(0, 15, (m, k // 32, 32))
        v = (1 + torch.randint(0, 1024, (m, k // 32, 32)) / 1024) * torch.exp2(e.double())
        return (v * torch.where(torch.rand(v.shape) < 0.5, -1.0, 1.0)).reshape(m, k).to(dtype)

    for dtype, lo, hi, big in ((torch.bfloat16, -140, 127, 3.3895e38), (torch.float16, -12, 16, 65504.0)):
        xs = mx16(dtype, 37, 1248, lo, hi)  # odd M, K = 39 blocks: not a multiple of any block_k
        xs[0, :32] = 0  # all-zero block
        xs[1, :32] = torch.tensor(1e-40 if dtype == torch.bfloat16 else 6e-8).to(dtype)  # all-equal subnormals
        xs[2, :32], xs[2, 32:64] = 7.0, -3.0  # all equal (7 saturates to 6)
        xs[3, :32] = x4[0, :32].to(dtype)  # the E2M1 ties and thresholds, as far as the dtype holds them
        xs[4, :32] = -x4[0, :32].to(dtype)
        xs[5, :32:2], xs[5, 1:32:2] = big, -big  # the dtype's largest magnitude
        xs[6, 5], xs[6, 40] = float("inf"), float("-inf")  # inf blocks: scale 0xFF, inf -> code 7
        xs[6, 70] = torch.finfo(dtype).tiny * 3  # a block of one subnormal-range value and zeros
        xs[6, 64:70] = 0
        ref = quantize_mx(xs, "e2m1", backend="torch")
        for cfg, rows, cols in ((None, 37, 1248), ({"impl": "words", "block_m": 1, "block_k": 32}, 7, 96),
                                ({"impl": "words", "block_m": 4, "block_k": 512, "num_warps": 4}, 37, 1248),
                                ({"impl": "words", "block_m": 2, "block_k": 2048, "num_warps": 8}, 37, 1248),
                                ({"impl": "split", "block_m": 4, "block_k": 512, "num_warps": 4}, 37, 1248)):
            # split gets the float32 copy: the interpreter widens subnormal bf16 wrongly (GPUs do not)
            xi = xs[:rows, :cols].float() if cfg and cfg["impl"] == "split" else xs[:rows, :cols]
            d, s = tk.mx_quantize(xi, "e2m1", config=cfg)
            assert torch.equal(s, ref.scale[:rows, :cols // 32]), f"mx e2m1 {dtype} {cfg}: scales differ"
            rd = ref.data[:rows, :cols // 2]
            assert torch.equal(d, rd), f"mx e2m1 {dtype} {cfg}: {(d != rd).sum()} bytes differ"
        odd = torch.empty(37 * 1248 + 1, dtype=dtype)[1:].view(37, 1248).copy_(xs)  # 2-byte aligned only
        d, s = tk.mx_quantize(odd, "e2m1")
        assert torch.equal(s, ref.scale) and torch.equal(d, ref.data), f"mx e2m1 {dtype} odd offset: differs"
        wide = torch.empty(37, 1280, dtype=dtype)
        wide[:, :1248] = xs
        d, s = tk.mx_quantize(wide[:, :1248], "e2m1")  # non-contiguous: copied, then words
        assert torch.equal(s, ref.scale) and torch.equal(d, ref.data), f"mx e2m1 {dtype} non-contiguous: differs"
        for start in (0, 1):  # one row of an odd-width tensor: "contiguous" with an odd row stride
            one = torch.empty(1, 1249, dtype=dtype)[:, start:start + 1248].copy_(xs[:1])
            d, s = tk.mx_quantize(one, "e2m1")
            assert torch.equal(s, ref.scale[:1]) and torch.equal(d, ref.data[:1]), f"mx e2m1 {dtype} row {start}: differs"
    try:
        tk.mx_quantize(x, "e2m1", config={"impl": "words"})
    except ValueError as err:
        assert "words" in str(err) and "float32" in str(err)
    else:
        raise AssertionError("impl='words' accepted for float32 x")
    for bad in ({"block_m": 3}, {"block_m": 0}, {"num_warps": 3}):
        try:
            tk.mx_quantize(x, "e4m3", config=bad)
        except ValueError as err:
            name, value = next(iter(bad.items()))
            assert f"config {name}={value} must be a power of two" in str(err), err
        else:
            raise AssertionError(f"mx_quantize accepted config={bad}")
    try:
        tk.fp8_quantize_groups(x, 128, config={"ng": 3})
    except ValueError as err:
        assert "ng=3" in str(err) and "power of two" in str(err)
    else:
        raise AssertionError("ng=3 accepted")
    try:
        tk.fp8_quantize_groups(x, 128, config={"block_rows": 2})
    except ValueError as err:
        assert "block_rows" in str(err) and "allowed" in str(err)
    else:
        raise AssertionError("unknown config key accepted")
    print("ok")
    """
)


def test_triton_quantize_configs_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


BIG_ROWS = textwrap.dedent(
    """
    import torch
    import triton.language as tl
    from lumenrl_quant import triton_kernels as tk
    from lumenrl_quant.mx import quantize_mx

    # rows whose offsets pass 2**31 elements (as in an (M, K) tensor with M * K > 2**31), built as
    # views with a huge row stride over lazily backed memory: only the 3 rows' pages are touched.
    # BLOCK_M = 2: row 2 is the second program's first row (offsets inside a row block are int32)
    x = torch.randn(3, 64).bfloat16()
    ref = quantize_mx(x, "e2m1", backend="torch")
    for kernel in ("split", "words"):
        if kernel == "split":
            stride = 2**30 + 64  # elements; row 2 at 2**31 + 128
            base = torch.empty(2 * stride + 64, dtype=torch.bfloat16)
            view = base.as_strided((3, 64), (stride, 1))
        else:
            stride = 2**30 + 32  # int32 words; row 2 at word 2**31 + 64
            base = torch.empty(2 * stride + 32, dtype=torch.int32)
            view = base.as_strided((3, 32), (stride, 1))
        view.copy_(x.view(torch.int32) if kernel == "words" else x)
        q = torch.empty(3, 32, dtype=torch.uint8)
        s = torch.empty(3, 2, dtype=torch.uint8)
        if kernel == "split":
            tk._mx_quant_kernel[(2, 1)](view, q, s, 3, 64, stride, 32, 2, EMAX=2, ELEM_MAX=6.0, FP4=True,
                                        OUT=tl.uint8, BLOCK_M=2, BLOCK_K=64)
        else:
            tk._mx_fp4_words_kernel[(2, 1)](view, q, s, 3, 32, stride, 32, 2, EMAX=2, FP16=False, BLOCK_M=2,
                                            BLOCK_W=32)
        assert torch.equal(q, ref.data) and torch.equal(s, ref.scale), f"{kernel}: differs"
        del base, view
    print("ok")
    """
)


def test_mx_kernels_address_rows_past_int32_range():
    """int64 row-block offsets: an int32 ``row * stride`` wrapped (out-of-bounds reads) past 2**31 elements."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", BIG_ROWS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:] + out.stderr[-4000:])
    assert out.stdout.strip().endswith("ok")


BIG_ROWS_FP8 = textwrap.dedent(
    """
    import torch
    import triton.language as tl
    from lumenrl_quant import triton_kernels as tk
    from lumenrl_quant.fp8 import quantize_fp8

    # FP8 row kernels at rows whose offsets pass 2**31 elements: views with a huge row stride over
    # lazily backed memory (only the touched rows' pages are real); expected values from the same
    # rows copied densely through the same kernels
    out = tl.float8e4nv
    # 1x128 groups / rowwise (the group kernel), BLOCK_M = 2: row 2 starts the second program, past 2**31
    x = torch.randn(3, 256).bfloat16()
    stride = 2**30 + 256
    base = torch.empty(2 * stride + 256, dtype=torch.bfloat16)
    view = base.as_strided((3, 256), (stride, 1))
    view.copy_(x)
    for group, block_k in ((128, 128), (256, 256)):
        got, want = [], []
        for src in (view, x):
            q = torch.empty(3, 256, dtype=torch.float8_e4m3fn)
            s = torch.empty(3, 256 // group, dtype=torch.float32)
            tk._group_quant_kernel[(2, 256 // group)](src, q, s, 3, 256, src.stride(0), 256, s.stride(0), group,
                                                      FP8_MAX=448.0, OUT=out, REDUCE_ROWS=False, BLOCK_M=2,
                                                      BLOCK_K=block_k, NG=1)
            (got if src is view else want).append((q.view(torch.uint8).clone(), s.clone()))
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1]), group
        ref_q, ref_s = quantize_fp8(x, granularity="block", block_size=(1, group), backend="torch")
        assert torch.equal(want[0][1], ref_s.float().reshape(want[0][1].shape)), group
    del base, view
    # 128x128 weight tiles (two-pass kernel): the second 128-row tile starts past 2**31
    w = torch.randn(256, 128).bfloat16()
    stride = 2**24 + 128
    base = torch.empty(255 * stride + 128, dtype=torch.bfloat16)
    view = base.as_strided((256, 128), (stride, 1))
    view.copy_(w)
    got = []
    for src in (view, w):
        q = torch.empty(256, 128, dtype=torch.float8_e4m3fn)
        s = torch.empty(2, 1, dtype=torch.float32)
        tk._block_quant_2pass_kernel[(2, 1)](src, q, s, 256, 128, src.stride(0), 128, 1, FP8_MAX=448.0, OUT=out,
                                             BLOCK=128, ROWS=64, HINTS=False)
        got.append((q.view(torch.uint8).clone(), s.clone()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), "128x128"
    ref_q, ref_s = quantize_fp8(w, granularity="block", block_size=(128, 128), backend="torch")
    assert torch.equal(got[1][1], ref_s.float().reshape(2, 1)), "128x128 scales"
    print("ok")
    """
)


def test_fp8_row_kernels_address_rows_past_int32_range():
    """int64 row-block offsets in the FP8 group and 128x128 kernels (as in the MX kernels above)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", BIG_ROWS_FP8], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:] + out.stderr[-4000:])
    assert out.stdout.strip().endswith("ok")
