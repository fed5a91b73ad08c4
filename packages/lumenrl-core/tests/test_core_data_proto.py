"""Unit tests for lumenrl_core.data_proto.DataProto."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lumenrl_core.data_proto import DataProto


def make(n: int = 4, t: int = 3, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        tensors={
            "responses": torch.randint(0, 100, (n, t), generator=g),
            "old_log_probs": torch.randn(n, t, generator=g),
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "ground_truth": [[i, i + 1] for i in range(n)]},
        meta_info={"temperature": 1.0},
    )


def rows_of(dp: DataProto) -> list[tuple]:
    """Rows as comparable tuples: (tensor rows as lists..., non-tensor values...)."""
    out = []
    for i in range(len(dp)):
        tensors = tuple(dp.batch[k][i].tolist() for k in sorted(dp.batch))
        arrays = tuple(_plain(dp.non_tensor_batch[k][i]) for k in sorted(dp.non_tensor_batch))
        out.append(tensors + arrays)
    return out


def _plain(v):
    return v.tolist() if isinstance(v, np.ndarray) else v


# ----------------------------------------------------------------- construction
def test_from_dict_len_and_key_access():
    dp = make(5)
    assert len(dp) == dp.batch_size == 5
    assert dp["responses"].shape == (5, 3)
    assert dp["uid"].dtype == object and dp["uid"][2] == "u2"
    assert dp["ground_truth"][1] == [1, 2]  # list rows stay lists (1-D object array)
    assert "uid" in dp and "missing" not in dp
    with pytest.raises(KeyError, match="no key 'missing'.*responses"):
        dp["missing"]


def test_mismatched_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="'b' has 3 rows, but 'a' has 4 rows"):
        DataProto.from_dict(tensors={"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="'uid' has 2 rows"):
        DataProto.from_dict(tensors={"a": torch.zeros(4)}, non_tensors={"uid": ["x", "y"]})
    with pytest.raises(ValueError, match="batch_size=2"):
        DataProto.from_dict(tensors={"a": torch.zeros(4)}, batch_size=2)


def test_bad_entry_types_are_refused():
    with pytest.raises(TypeError, match=r"batch\['a'\] must be a torch.Tensor, got ndarray"):
        DataProto.from_dict(tensors={"a": np.zeros(3)})
    with pytest.raises(ValueError, match="0-dim tensor"):
        DataProto.from_dict(tensors={"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="numpy array or a list"):
        DataProto.from_dict(non_tensors={"a": "abc"})


def test_explicit_batch_size_survives_empty_select():
    dp = make(6).select([], [])
    assert len(dp) == 6 and not dp.batch and not dp.non_tensor_batch


def test_setitem_and_pop():
    dp = make(4)
    dp["advantages"] = torch.ones(4, 3)
    dp["response_text"] = ["a", "b", "c", "d"]
    assert dp["advantages"].sum() == 12 and dp["response_text"][3] == "d"
    with pytest.raises(ValueError, match="'bad' has 5 rows, but the batch has 4"):
        dp["bad"] = torch.ones(5)
    assert dp.pop("advantages").shape == (4, 3) and "advantages" not in dp
    empty = DataProto()
    empty["x"] = torch.arange(7)
    assert len(empty) == 7


# -------------------------------------------------------------------- indexing
def test_row_indexing_kinds_agree():
    dp = make(6)
    expected = [rows_of(dp)[i] for i in (1, 3, 4)]
    assert rows_of(dp[[1, 3, 4]]) == expected
    assert rows_of(dp[np.array([1, 3, 4])]) == expected
    assert rows_of(dp[torch.tensor([1, 3, 4])]) == expected
    mask = [False, True, False, True, True, False]
    assert rows_of(dp[mask]) == expected
    assert rows_of(dp[torch.tensor(mask)]) == expected
    assert rows_of(dp[1:5:2]) == [rows_of(dp)[1], rows_of(dp)[3]]
    assert rows_of(dp[::-1]) == rows_of(dp)[::-1]
    assert rows_of(dp[[-1, 0]]) == [rows_of(dp)[5], rows_of(dp)[0]]
    assert dp[[1]].meta_info == {"temperature": 1.0}


def test_int_index_keeps_batch_dim():
    dp = make(4)
    row = dp[-1]
    assert len(row) == 1 and row["responses"].shape == (1, 3)
    assert rows_of(row) == [rows_of(dp)[3]]


def test_bad_row_indices():
    dp = make(4)
    with pytest.raises(IndexError, match="row 4 is out of range"):
        dp[4]
    with pytest.raises(IndexError, match="out of range"):
        dp[[0, 9]]
    with pytest.raises(IndexError, match="bool mask has 3 entries, the batch has 4"):
        dp[[True, False, True]]
    with pytest.raises(IndexError, match="integers or bools"):
        dp[np.array([0.5])]
    with pytest.raises(TypeError, match="bare bool"):
        dp[True]


def test_select():
    dp = make(4)
    sub = dp.select(["responses"], ["uid"])
    assert set(sub.batch) == {"responses"} and set(sub.non_tensor_batch) == {"uid"}
    assert sub["responses"] is dp["responses"]
    assert set(dp.select(non_tensor_keys=[]).batch) == {"responses", "old_log_probs"}
    with pytest.raises(
        KeyError, match=r"no tensor key\(s\) \['nope'\]; available: \['responses', 'old_log_probs'\]"
    ):
        dp.select(["nope"])


# ------------------------------------------------------------ split / concat
def test_split_and_chunk_sizes():
    dp = make(7)
    assert [len(p) for p in dp.split(3)] == [3, 3, 1]
    assert [len(p) for p in dp.chunk(3)] == [3, 2, 2]
    assert [len(p) for p in dp.chunk(9)] == [1] * 7 + [0, 0]
    assert rows_of(DataProto.concat(dp.chunk(3))) == rows_of(dp)
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        dp.split(0)


def test_concat_checks_keys_dtypes_shapes():
    a, b = make(2), make(3, seed=1)
    b_extra = make(3).select(["responses"])
    with pytest.raises(ValueError, match=r"part 1 tensor keys differ.*missing \['old_log_probs'\]"):
        DataProto.concat([a, b_extra])
    b.batch["old_log_probs"] = b.batch["old_log_probs"].double()
    with pytest.raises(
        TypeError, match="'old_log_probs' is torch.float32 in part 0 but torch.float64 in part 1"
    ):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match="trailing dims must match"):
        DataProto.concat([a, make(2, t=5)])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])


def test_concat_meta_info_first_part_wins():
    a, b = make(2), make(2)
    a.meta_info, b.meta_info = {"step": 1}, {"step": 2, "extra": True}
    assert DataProto.concat([a, b]).meta_info == {"step": 1, "extra": True}


# ------------------------------------------------------------------- union
def test_union_adds_entries_in_place():
    dp = make(4)
    out = DataProto.from_dict(
        tensors={"values": torch.randn(4, 3), "responses": dp["responses"].clone()},
        non_tensors={"score": [0.5] * 4},
        meta_info={"temperature": 1.0, "step": 3},
    )
    result = dp.union(out)
    assert result is dp
    assert {"values", "responses", "old_log_probs"} <= set(dp.batch) and "score" in dp
    assert dp.meta_info == {"temperature": 1.0, "step": 3}


def test_union_conflicts_raise_without_changes():
    dp = make(4)
    with pytest.raises(ValueError, match="batch sizes differ: 4 rows vs 3 rows"):
        dp.union(make(3))
    clash = DataProto.from_dict(tensors={"new": torch.ones(4), "responses": dp["responses"] + 1})
    with pytest.raises(ValueError, match="tensor 'responses' differs"):
        dp.union(clash)
    assert "new" not in dp
    with pytest.raises(ValueError, match="non-tensor 'uid' differs"):
        dp.union(DataProto.from_dict(non_tensors={"uid": ["z"] * 4}))
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] conflicts: 1.0 vs 0.7"):
        dp.union(DataProto(meta_info={"temperature": 0.7}, batch_size=4))


# --------------------------------------------------------- repeat, pad, reorder
def test_repeat_interleave_and_tile():
    dp = make(2)
    uids = list(dp.repeat(3)["uid"])
    assert uids == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert list(dp.repeat(2, interleave=False)["uid"]) == ["u0", "u1", "u0", "u1"]
    assert torch.equal(dp.repeat(3)["responses"], dp["responses"].repeat_interleave(3, dim=0))


def test_pad_to_divisor_cycles_rows_and_unpad_restores():
    dp = make(5)
    padded, pad = dp.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert list(padded["uid"]) == ["u0", "u1", "u2", "u3", "u4", "u0", "u1", "u2"]
    assert rows_of(padded.unpad(pad)) == rows_of(dp)
    same, zero = dp.pad_to_divisor(5)
    assert zero == 0 and rows_of(same) == rows_of(dp)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, 5\], got 6"):
        dp.unpad(6)


def test_reorder_in_place_requires_permutation():
    dp = make(4)
    before = rows_of(dp)
    assert dp.reorder([2, 0, 3, 1]) is dp
    assert rows_of(dp) == [before[i] for i in (2, 0, 3, 1)]
    with pytest.raises(ValueError, match="permutation of range"):
        dp.reorder([0, 0, 1, 2])


def test_to_device_in_place():
    dp = make(3)
    assert dp.to("cpu") is dp and dp["responses"].device.type == "cpu"


# -------------------------------------------------------------- save / load
def test_save_load_round_trip(tmp_path):
    dp = make(4)
    dp["mask"] = torch.tensor([True, False, True, True])
    dp["bf16"] = torch.randn(4, 2).to(torch.bfloat16)
    dp["prompts"] = dp["responses"][:, :2]  # a view sharing storage with 'responses'
    dp["score"] = np.array([0.5, np.nan, -1.0, 2.0])
    dp["grid"] = np.arange(8, dtype=np.int32).reshape(4, 2)
    dp["extra"] = [{"a": [1, None]}, None, 3.5, True]
    dp.meta_info.update({"step": 7, "metrics": {"acc": [0.1, 0.2]}})
    path = tmp_path / "sub" / "batch.safetensors"
    dp.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["batch.safetensors"]  # no temp files left
    back = DataProto.load(path)
    assert list(back.batch) == list(dp.batch)
    for k, v in dp.batch.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    for k, a in dp.non_tensor_batch.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape
    np.testing.assert_array_equal(back["score"], dp["score"])
    assert list(back["extra"]) == [{"a": [1, None]}, None, 3.5, True]
    assert back.meta_info == dp.meta_info


def test_save_refuses_non_json_values(tmp_path):
    dp = make(2)
    dp["bad"] = [object(), 1]
    with pytest.raises(TypeError, match=r"non_tensor_batch\['bad'\]\[0\] has type object.*allowed: str, int"):
        dp.save(tmp_path / "x.st")
    dp.pop("bad")
    dp.meta_info["t"] = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"meta_info\['t'\] has type Tensor.*\.item\(\)"):
        dp.save(tmp_path / "x.st")
    dp.meta_info["t"] = (1, 2)
    with pytest.raises(TypeError, match="tuple"):
        dp.save(tmp_path / "x.st")
    assert not list(tmp_path.iterdir())


def test_save_is_atomic_over_existing_file(tmp_path):
    path = tmp_path / "b.st"
    make(2).save(path)
    broken = make(3)
    broken.meta_info["oops"] = {1: "non-str key"}
    with pytest.raises(TypeError, match="non-str dict key 1"):
        broken.save(path)
    assert len(DataProto.load(path)) == 2
    assert os.listdir(tmp_path) == ["b.st"]


def test_load_refuses_foreign_files(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.st"))
    with pytest.raises(ValueError, match="without DataProto metadata"):
        DataProto.load(tmp_path / "plain.st")
    header = json.dumps({"version": 99})
    save_file({"x": torch.zeros(1)}, str(tmp_path / "future.st"), metadata={"lumenrl.data_proto": header})
    with pytest.raises(ValueError, match="format version 99"):
        DataProto.load(tmp_path / "future.st")


def test_concat_skips_blank_accumulator():
    acc = DataProto(meta_info={"step": 1})
    dp = make(3)
    out = DataProto.concat([acc, dp, make(2, seed=5)])
    assert len(out) == 5 and rows_of(out)[:3] == rows_of(dp)
    assert out.meta_info == {"step": 1, "temperature": 1.0}
    assert len(DataProto.concat([DataProto(), DataProto()])) == 0


def test_pickle_and_deepcopy_keep_everything():
    import copy
    import pickle

    dp = make(3)
    for clone in (pickle.loads(pickle.dumps(dp)), copy.deepcopy(dp)):
        assert rows_of(clone) == rows_of(dp) and clone.meta_info == dp.meta_info and len(clone) == 3


def test_save_of_a_row_slice_writes_only_those_rows(tmp_path):
    dp = make(6)
    part = dp[2:4]  # tensor views into the full batch's storage
    part.save(tmp_path / "part.st")
    back = DataProto.load(tmp_path / "part.st")
    assert rows_of(back) == rows_of(dp)[2:4]
