"""The native engine's slot state: releasing slots one at a time, in a batch, and all at once leaves the same
device state and free list."""

from __future__ import annotations

import torch

from lumenrl_backends.engines.sampling import SamplingParams
from lumenrl_backends.engines.slots import SlotState


def _admitted(slots: int, count: int) -> SlotState:
    s = SlotState.allocate(slots, torch.device("cpu"))
    taken = s.take(count)
    rows = torch.tensor(taken)
    s.admit(rows, [7 + i for i in taken], SamplingParams())
    s.columns[rows] = torch.arange(10, 10 + count)
    s.positions[rows] = torch.arange(20, 20 + count)
    for slot in taken:
        s.host_columns[slot] = 10 + slot
    return s


def _freed(s: SlotState, slots: list[int]) -> bool:
    index = torch.tensor(slots, dtype=torch.int64)
    return (not s.occupied[index].any() and not s.columns[index].any() and not s.positions[index].any()
            and all(s.host_columns[i] == 0 for i in slots) and set(slots) <= set(s.free))


def test_release_in_batches_and_all_at_once():
    s = _admitted(6, 4)  # slots 0..3 occupied, 4 and 5 never used
    s.release_many([1, 3])  # some stay occupied: per-slot writes
    assert _freed(s, [1, 3]) and s.occupied[[0, 2]].all() and s.columns[[0, 2]].tolist() == [10, 12]
    assert sorted(s.free) == [1, 3, 4, 5]
    s.release_many([0, 2])  # the last occupied ones: whole-tensor fills
    assert _freed(s, list(range(6))) and sorted(s.free) == list(range(6))
    assert s.take(2) == [0, 1]  # the heap hands out the lowest slots first again


def test_release_all_frees_what_the_free_list_lacks():
    """A slot taken but never admitted (a prefill that raised) is freed too: the free list, not the device's
    occupied flags, says which slots are held."""
    s = _admitted(5, 3)
    s.take(1)  # slot 3: taken, not admitted
    s.release_all()
    assert _freed(s, list(range(5))) and sorted(s.free) == list(range(5))
    s.release_all()  # nothing held: no change
    assert sorted(s.free) == list(range(5))
