"""V stored in (D, T) tiles (``kv_v_tiles``, session 8): the slot cache stores and reads what the rows
layout does, and an engine with tiles generates what one with rows generates. The fused q/k-norm + RoPE +
KV-write op's tile writes are tested in ``test_backends_engine_rope.py``, the attention kernel's tile reads
in ``test_backends_engine_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines import KernelOptions, NativeEngine
from lumenrl_backends.engines.kv_cache import V_TILE, CacheView, SlotKVCache, value_rows, value_tiles
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU

FP8 = torch.float8_e4m3fn
PROMPTS = ["12+34=", "7*8=", "(1+2)*3 = what is it", "9", "abc"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


def test_value_rows_inverts_the_tiling():
    x = torch.randn(3, 2, 10, 8)
    assert torch.equal(value_rows(value_tiles(x, 4), 10), x) and value_rows(x) is x
    with pytest.raises(ValueError, match="v_tile=3"):
        SlotKVCache(num_layers=1, max_slots=2, max_len=8, device=torch.device("cpu"), v_tile=3)


@pytest.mark.parametrize("fp8", [False, True])
def test_slot_cache_with_v_tiles_stores_and_reads_what_rows_do(fp8):
    """Prefill then two decode steps into a rows cache and a tiled one (length 10, tiles of 4: the last tile
    is partly outside the cache): same keys, V equal once read back as rows, decode reads equal (as stored
    and dequantized)."""
    gen = torch.Generator().manual_seed(11)
    caches = [SlotKVCache(num_layers=1, max_slots=4, max_len=10, device=torch.device("cpu"),
                          kv_dtype=FP8 if fp8 else None, v_tile=tile) for tile in (0, 4)]
    k, v = torch.randn(3, 2, 6, 8, generator=gen), torch.randn(3, 2, 6, 8, generator=gen)
    rows = torch.tensor([2, 0, 3])
    for cache in caches:
        cache.set_view(CacheView(rows=rows, columns=torch.arange(6).expand(3, 6), decode=False, kv_len=6))
        cache.update(k, v, 0)
    for step in range(2):
        k1, v1 = torch.randn(3, 2, 1, 8, generator=gen), torch.randn(3, 2, 1, 8, generator=gen)
        view = CacheView(rows=torch.arange(3), columns=torch.tensor([[6 + step], [7], [9 - step]]), decode=True,
                         kv_len=8 + 2 * step)
        reads = []
        for cache in caches:
            cache.raw_fp8_decode = True
            cache.set_view(view)
            reads.append(cache.update(k1, v1, 0))
        (k_rows, v_rows), (k_tiles, v_tiles) = reads
        assert v_tiles.dim() == 5 and v_tiles.shape[2] == -(-view.kv_len // 4)
        assert torch.equal(as_bits(k_rows), as_bits(k_tiles))
        assert torch.equal(as_bits(v_rows), as_bits(value_rows(v_tiles, view.kv_len)))
    plain, tiles = (cache.layers[0] for cache in caches)
    assert torch.equal(as_bits(plain.keys), as_bits(tiles.keys))
    assert torch.equal(as_bits(plain.values), as_bits(value_rows(tiles.values, 10)))
    if fp8:  # the dequantizing read (attention without the engine's kernel) hands rows over
        for cache in caches:
            cache.raw_fp8_decode = False
        (_, v_plain), (_, v_deq) = (cache.layers[0].decode_read() for cache in caches)
        assert v_deq.dim() == 4 and torch.equal(v_plain, v_deq)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_with_v_tiles_generates_what_it_generates_by_rows(qwen3_dir, kv):
    """``kv_v_tiles`` off (the default) and on, the same greedy generation (CPU: attention reads the tiles back
    as rows; the fused op's reference writes them)."""
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    outs = []
    for tiles in (False, True):
        engine = NativeEngine(model, tokenizer, max_batch_size=8, max_seq_len=40, kv_cache_dtype=kv, kernels=KernelOptions(kv_v_tiles=tiles))
        outs.append(engine.generate(batch, GREEDY).batch)
        assert engine.cache.v_tile == (V_TILE if tiles else 0)
        assert engine.cache.layers[0].values.dim() == (5 if tiles else 4)
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    gap = float((outs[0]["rollout_log_probs"] - outs[1]["rollout_log_probs"]).abs().max())
    # the same V values (the cache test checks the stored bits); CPU SDPA gets them with other strides (a
    # view of the rows cache, a copy out of the tiles) and sums in another order: ~2e-6 in float32
    assert gap < 1e-5


def test_v_tiles_need_the_engines_attention(qwen3_dir):
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="kv_v_tiles=True needs the engine's attention"):
        NativeEngine(model, tokenizer, max_batch_size=2, max_seq_len=16, kernels=KernelOptions(kv_v_tiles=True))
