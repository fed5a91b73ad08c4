"""Hypothesis property tests: DataProto row operations round-trip and keep rows aligned."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lumenrl_core.data_proto import DataProto

SETTINGS = settings(max_examples=40, deadline=None)

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def data_protos(draw, min_rows: int = 0, max_rows: int = 9) -> DataProto:
    """A DataProto whose row i is identifiable: tensor 'row_id' holds i, non-tensor 'tag' holds random JSON."""
    n = draw(st.integers(min_rows, max_rows))
    width = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "row_id": torch.arange(n, dtype=torch.int64),
        "logp": torch.randn(n, width, generator=g, dtype=torch.float32) - 1.0,
        "mask": torch.rand(n, width, generator=g) > 0.5,
    }
    tags = draw(st.lists(json_value, min_size=n, max_size=n))
    return DataProto.from_dict(tensors=tensors, non_tensors={"tag": tags}, meta_info={"seed": seed})


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert list(a.batch) == list(b.batch) and list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for k, t in a.batch.items():
        assert t.dtype == b.batch[k].dtype and torch.equal(t, b.batch[k]), k
    for k, arr in a.non_tensor_batch.items():
        assert arr.shape == b.non_tensor_batch[k].shape and arr.tolist() == b.non_tensor_batch[k].tolist(), k
    assert a.meta_info == b.meta_info


@SETTINGS
@given(dp=data_protos(), size=st.integers(1, 5))
def test_split_then_concat_is_identity(dp, size):
    parts = dp.split(size)
    assert all(len(p) == size for p in parts[:-1])
    assert 0 < len(parts[-1]) <= size if len(dp) else len(parts) == 1
    assert_same(DataProto.concat(parts), dp)


@SETTINGS
@given(dp=data_protos(), n=st.integers(1, 12))
def test_chunk_then_concat_is_identity(dp, n):
    parts = dp.chunk(n)
    sizes = [len(p) for p in parts]
    assert len(parts) == n and max(sizes) - min(sizes) <= 1
    assert_same(DataProto.concat(parts), dp)


@SETTINGS
@given(dp=data_protos(), divisor=st.integers(1, 7))
def test_pad_then_unpad_is_identity(dp, divisor):
    padded, pad = dp.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0 and 0 <= pad < divisor
    if len(dp):
        ids = padded["row_id"].tolist()
        assert ids[len(dp) :] == [i % len(dp) for i in range(pad)]
    assert_same(padded.unpad(pad), dp)


@SETTINGS
@given(dp=data_protos(min_rows=1), n=st.integers(1, 4), interleave=st.booleans())
def test_repeat_keeps_rows_aligned(dp, n, interleave):
    rep = dp.repeat(n, interleave=interleave)
    ids = rep["row_id"]
    assert len(rep) == n * len(dp)
    expected = torch.arange(len(dp)).repeat_interleave(n) if interleave else torch.arange(len(dp)).repeat(n)
    assert torch.equal(ids, expected)
    # every tensor and non-tensor row follows its row_id
    assert torch.equal(rep["logp"], dp["logp"][ids]) and torch.equal(rep["mask"], dp["mask"][ids])
    assert rep["tag"].tolist() == [dp["tag"][i] for i in ids.tolist()]
    first = rep[::n] if interleave else rep[: len(dp)]
    assert_same(first, dp)


@SETTINGS
@given(dp=data_protos(), data=st.data())
def test_reorder_then_inverse_is_identity(dp, data):
    perm = data.draw(st.permutations(range(len(dp))))
    original = dp[:]
    dp.reorder(perm)
    assert dp["row_id"].tolist() == list(perm)
    assert dp["tag"].tolist() == [original["tag"][i] for i in perm]
    dp.reorder(np.argsort(np.asarray(perm, dtype=np.int64)))
    assert_same(dp, original)


@SETTINGS
@given(dp=data_protos(), data=st.data())
def test_index_list_and_mask_select_the_same_rows(dp, data):
    mask = data.draw(st.lists(st.booleans(), min_size=len(dp), max_size=len(dp)))
    idx = [i for i, keep in enumerate(mask) if keep]
    assert_same(dp[mask], dp[idx])
    assert dp[idx]["row_id"].tolist() == idx


@settings(max_examples=25, deadline=None)
@given(dp=data_protos(), meta=st.dictionaries(st.text(max_size=4), json_value, max_size=3))
def test_save_load_round_trip(dp, meta):
    dp.meta_info.update(meta)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dp.safetensors"
        dp.save(path)
        assert_same(DataProto.load(path), dp)
