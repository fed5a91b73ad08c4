"""The two-stage (rows x vocab chunks) fused sampler against the torch sampler, in Triton's CPU interpreter.

One interpreted subprocess runs every case (fresh random logits each) and prints one JSON line per
case; the tests check them: tokens identical to ``sample_tokens`` (and to the one-program-per-row
kernel), log-probs within 1e-5. Launch-parameter validation and the default chunk run in-process.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

_CASES = """
import json
import torch
from lumenrl_backends.engines import triton_sampling
from lumenrl_backends.engines.sampling import sample_tokens


def case(name, logits, temperature, greedy_only=False, **launch):
    batch = logits.shape[0]
    gen = torch.Generator().manual_seed(len(name))
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)  # negative seeds too
    counters = torch.randint(0, 5000, (batch,), generator=gen)
    args = dict(temperature=temperature, seeds=seeds, counters=counters, greedy_only=greedy_only)
    tokens, log_probs = triton_sampling.fused_sample(logits, **args, **launch)
    row_tokens, row_log_probs = triton_sampling.fused_sample(logits, **args, impl="rowwise", block_v=1024)
    ref_tokens, ref_log_probs = sample_tokens(logits, **args, top_k=torch.zeros_like(seeds),
                                              top_p=torch.ones(batch), restrict=False)
    print(json.dumps({"name": name, "tokens": tokens.tolist(), "ref_tokens": ref_tokens.tolist(),
                      "rowwise_tokens": row_tokens.tolist(),
                      "err": float((log_probs - ref_log_probs).abs().max()),
                      "rowwise_err": float((row_log_probs - ref_log_probs).abs().max())}))


torch.manual_seed(11)
case("greedy_only", torch.randn(5, 5000) * 3, torch.zeros(5), greedy_only=True, chunk=1024, block_v=512)
case("temperature", torch.randn(5, 5000) * 3, torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0]), chunk=1024, block_v=256)
case("mixed", torch.randn(5, 4097) * 4, torch.tensor([0.0, 1.0, 0.0, 0.8, 1.2]), chunk=2048, block_v=1024)
case("batch1_default_chunk", torch.randn(1, 3001) * 3, torch.ones(1))
case("bf16", (torch.randn(5, 3000) * 3).bfloat16(), torch.tensor([1.0, 0.0, 0.9, 1.0, 1.1]), chunk=1024)
masked = torch.randn(5, 5000) * 3
masked[:, 3000:] = float("-inf")  # whole chunks of -inf (a padded vocabulary tail)
masked[1, :1024] = float("-inf")  # and the first chunk of one row
case("masked_chunks", masked, torch.tensor([1.0, 0.0, 1.0, 0.7, 0.0]), chunk=1024, block_v=512)
tied = torch.randn(5, 6000)
for row, cols in enumerate([(700, 2100, 4000), (5999, 3000), (1024, 1023), (10, 11, 5000), (2048, 4096)]):
    tied[row, list(cols)] = 9.0  # equal maxima in different chunks (and blocks): the lowest id wins
case("ties_greedy_only", tied, torch.zeros(5), greedy_only=True, chunk=1024, block_v=256)
case("ties_mixed", tied, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]), chunk=1024, block_v=512)
"""

_EXPECTED_TIES = [700, 3000, 1023, 10, 2048]


@pytest.fixture(scope="module")
def interpreted_runs(triton_interpreted):
    """This file's interpreted scripts, in one Triton-interpreter process."""
    return triton_interpreted({"cases": _CASES, "big_stride": _BIG_STRIDE})


@pytest.fixture(scope="module")
def interpreted(interpreted_runs) -> dict[str, dict]:
    rows = interpreted_runs.json_rows("cases", key="name")
    return {name: {"name": name, **row} for name, row in rows.items()}


@pytest.mark.parametrize(
    "name", ["greedy_only", "temperature", "mixed", "batch1_default_chunk", "bf16", "masked_chunks", "ties_greedy_only",
             "ties_mixed"],
)
def test_chunked_sampler_matches_torch_sampler(interpreted, name):
    case = interpreted[name]
    assert case["tokens"] == case["ref_tokens"], case
    assert case["tokens"] == case["rowwise_tokens"], case
    assert case["err"] < 1e-5, case
    assert case["rowwise_err"] < 1e-5, case  # (nan when a leading block was all -inf)


def test_ties_resolve_to_the_lowest_vocab_id(interpreted):
    assert interpreted["ties_greedy_only"]["tokens"] == _EXPECTED_TIES
    greedy_rows = [0, 1, 3, 4]
    assert [interpreted["ties_mixed"]["tokens"][r] for r in greedy_rows] == [_EXPECTED_TIES[r] for r in greedy_rows]


def test_masked_tail_never_drawn(interpreted):
    case = interpreted["masked_chunks"]
    assert all(t < 3000 for t in case["tokens"]) and case["tokens"][1] >= 1024


_BIG_STRIDE = """
import json
import torch
from lumenrl_backends.engines import triton_sampling
from lumenrl_backends.engines.sampling import sample_tokens

stride = 2**30 + 64  # row 2 starts past element 2**31: int32 row offsets wrap there
base = torch.empty(2 * stride + 1000, dtype=torch.bfloat16)  # virtual: only the 3 rows' pages are touched
logits = base.as_strided((3, 1000), (stride, 1))
logits.copy_(torch.randn(3, 1000) * 3)
seeds = torch.tensor([1, -5, 2**40])
args = dict(temperature=torch.tensor([0.0, 1.0, 0.8]), seeds=seeds, counters=torch.tensor([0, 3, 9]))
ref, ref_lp = sample_tokens(logits, **args, top_k=torch.zeros_like(seeds), top_p=torch.ones(3), restrict=False)
for impl in ("chunked", "rowwise"):
    tokens, log_probs = triton_sampling.fused_sample(logits, **args, impl=impl)
    print(json.dumps({"impl": impl, "same": tokens.tolist() == ref.tolist(),
                      "err": float((log_probs - ref_lp).abs().max())}))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (runs in its interpreter on CPU)")
def test_row_offsets_past_int32_range(interpreted_runs):
    """A (B, V) view whose row stride puts a row past element 2**31 (int64 offsets in the kernels)."""
    rows = [json.loads(line) for line in interpreted_runs["big_stride"].splitlines() if line.startswith("{")]
    assert [r["impl"] for r in rows] == ["chunked", "rowwise"]
    assert all(r["same"] and r["err"] < 1e-5 for r in rows), rows


def test_default_chunk_covers_the_gpu_and_shrinks_for_small_batches():
    from lumenrl_backends.engines.triton_sampling import _TARGET_PROGRAMS, default_chunk

    vocab = 151936
    assert default_chunk(64, vocab) == 8192 and 64 * -(-vocab // 8192) >= _TARGET_PROGRAMS
    assert default_chunk(256, vocab) == 8192
    assert default_chunk(16, vocab) == 2048
    assert default_chunk(1, vocab) == 1024  # never below 1024 columns per program
    assert default_chunk(1, vocab, block_v=4096) == 4096  # a chunk is a whole number of blocks


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("launch", "match"),
    [
        ({"block_v": 1000}, r"block_v=1000: must be a power of two in \[16, 16384\]"),
        ({"chunk": 3000}, r"chunk=3000: must be a power of two"),
        ({"chunk": 1024, "block_v": 2048}, r"block_v=2048: must be <= chunk=1024"),
        ({"impl": "fast"}, r"impl='fast': must be one of 'chunked', 'rowwise'"),
        ({"impl": "rowwise", "chunk": 1024}, r"chunk=1024: only impl='chunked'"),
        ({"num_warps": 3}, r"num_warps=3: must be a power of two in \[1, 16\]"),
    ],
)
def test_bad_launch_parameters_raise(launch, match):
    from lumenrl_backends.engines.triton_sampling import fused_sample

    one = torch.ones(2)
    with pytest.raises(ValueError, match=match):
        fused_sample(torch.zeros(2, 100), temperature=one, seeds=one.long(), counters=one.long(), **launch)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("logits", "per_row", "match"),
    [
        (torch.zeros(3, 100), {"temperature": torch.ones(2)}, r"temperature must have shape \(B,\) = \(3,\).*got \(2,\)"),
        (torch.zeros(3, 100), {"seeds": torch.ones(1, 3).long()}, r"seeds must have shape \(B,\) = \(3,\).*\(1, 3\)"),
        (torch.zeros(3, 100), {"counters": torch.ones(4).long()}, r"counters must have shape .*got \(4,\)"),
        (torch.zeros(1, 3, 100), {}, r"logits must be \(B, V\); got shape \(1, 3, 100\)"),
    ],
)
def test_per_row_tensors_must_match_the_batch(logits, per_row, match):
    """Checked on the host from shapes: a short per-row tensor would be read out of bounds by the kernels."""
    from lumenrl_backends.engines.triton_sampling import fused_sample

    one = torch.ones(logits.shape[0])
    args = {"temperature": one, "seeds": one.long(), "counters": one.long(), **per_row}
    with pytest.raises(ValueError, match=match):
        fused_sample(logits, **args)
