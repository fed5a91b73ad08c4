"""``distributed.ensure_process_group`` without a launcher: a one-rank group that leaves ``os.environ`` alone,
so a child process can start its own group (before, the child inherited ``RANK``/``MASTER_PORT`` of a
rendezvous whose port the parent's store held)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, os, subprocess, sys
import torch
import torch.distributed as dist
from lumenrl_backends.training import distributed as D

D.ensure_process_group(torch.device("cpu"))
t = torch.tensor([2.0])
dist.all_reduce(t)
keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
child = "" if len(sys.argv) > 1 else subprocess.run(
    [sys.executable, "-c", CODE, "child"],  # CODE: this script's text (the child's argv marks it a child)
    capture_output=True, text=True, timeout=300).stdout.strip().splitlines()[-1]
print(json.dumps({"world": dist.get_world_size(), "rank": dist.get_rank(), "sum": float(t),
                  "env": [k for k in keys if k in os.environ], "child": child}))
"""


def test_one_rank_group_writes_no_rendezvous_environment():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    code = "CODE = " + repr(_SCRIPT) + "\n" + _SCRIPT
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parent = json.loads(done.stdout.strip().splitlines()[-1])
    assert parent["world"] == 1 and parent["rank"] == 0 and parent["sum"] == 2.0
    assert parent["env"] == []  # nothing for a child to inherit
    child = json.loads(parent["child"])  # the child, started while the parent's group lives, formed its own
    assert child["world"] == 1 and child["sum"] == 2.0 and child["env"] == []


_RELEASE = """
import json, socket
import torch
import torch.distributed as dist
from lumenrl_backends.training import distributed as D

out = {}
D.ensure_process_group(torch.device("cpu"))
D.release_process_group()
out["own_released"] = not dist.is_initialized()
D.ensure_process_group(torch.device("cpu"))  # a second run in the same process makes a fresh group
t = torch.tensor([3.0])
dist.all_reduce(t)
out["second_sum"] = float(t)
D.release_process_group()
D.release_process_group()  # nothing left to release: a no-op
out["second_released"] = not dist.is_initialized()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)  # the caller's
D.ensure_process_group(torch.device("cpu"))  # uses it
D.release_process_group()
out["callers_kept"] = dist.is_initialized()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_release_destroys_only_the_group_ensure_made():
    done = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"own_released": True, "second_sum": 3.0, "second_released": True, "callers_kept": True}
