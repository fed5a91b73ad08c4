"""SharedCounter (the CUDA IPC seqlock): it crosses a pipe to a process spawned before it existed."""

from __future__ import annotations

import torch.multiprocessing as mp

from lumenrl_async.cuda_ipc import SharedCounter


def _child(conn) -> None:
    counter = conn.recv()  # sent after the spawn: not a spawn argument
    conn.send(counter.value)
    counter.value = counter.value * 10 + 7  # the parent must see this write
    conn.send("written")
    while (target := conn.recv()) is not None:  # then follow the parent's writes
        conn.send(counter.value == target)


def test_counter_sent_through_a_pipe_after_spawn_is_shared_both_ways():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    try:
        counter = SharedCounter(-1)
        counter.value = 41
        parent.send(counter)
        assert parent.recv() == 41
        assert parent.recv() == "written" and counter.value == 417
        for v in (2**40 + 3, -1, 0):  # the whole int64 range it carries (2 * version + 1, -1 unpublished)
            counter.value = v
            parent.send(v)
            assert parent.recv() is True
        parent.send(None)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
