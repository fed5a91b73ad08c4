"""lumenrl_core.storage: atomic writes and owned CPU copies."""

from __future__ import annotations

import pytest
import torch

from lumenrl_core.storage import atomic_write, atomic_write_text, cpu_copies


def test_atomic_write_text_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "entry.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new", fsync=False)
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def test_atomic_write_failure_keeps_old_file_and_removes_temp(tmp_path):
    path = tmp_path / "data.bin"
    atomic_write_text(path, "complete")

    def half_write(tmp):
        tmp.write_text("par")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_write)
    assert path.read_text() == "complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_cpu_copies_own_their_memory():
    weight = torch.randn(4, 3)
    tied = {"embed": weight, "lm_head": weight, "view": weight.t()}
    before = weight.clone()
    copies = cpu_copies(tied)
    weight.add_(1.0)
    assert not torch.equal(copies["embed"], weight)
    assert copies["embed"].untyped_storage().data_ptr() != copies["lm_head"].untyped_storage().data_ptr()
    assert copies["view"].is_contiguous() and torch.equal(copies["view"], before.t())
