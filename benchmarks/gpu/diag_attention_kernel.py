"""What the decode attention kernel compiles to, and how its time scales with the batch (session 8).

For each cache dtype / V layout / launch configuration: registers per thread, spills, shared memory
per program, the programs one multiprocessor can hold by each limit, the PTX instruction mix of the
compiled kernel (the opcodes that dominate), and the time per call (CUDA graph, as ``bench_attention.py``)
at batch 16 / 32 / 64 / 128 with 384 of 512 columns attended. Question: is the FP8 kernel (46-53% of
copy bandwidth) held by occupancy (waves of programs), by its instruction count, or by neither?

    python benchmarks/gpu/diag_attention_kernel.py --out attention_diag_s8.json
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_attention import inputs  # noqa: E402

from lumenrl_backends.engines import triton_attention as ta  # noqa: E402

CASES = [  # (cache dtype, V layout, config)
    ("bf16", "rows", {}),
    ("fp8", "rows", {}),
    ("fp8", "blocks64", {"block_n": 64, "num_stages": 3}),
    ("fp8", "blocks64", {"block_n": 64, "num_stages": 3, "fp8_dots": 2}),
    ("fp8", "blocks64", {"block_n": 64, "num_stages": 2, "num_warps": 2}),
]


def _compiled() -> list:
    """Every compiled variant of the split kernel in this process (Triton's per-device caches)."""
    found = []
    for cache in getattr(ta._split_kernel, "device_caches", {}).values():
        for part in cache if isinstance(cache, tuple) else (cache,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "n_regs")]
    return found


def _ptx_mix(ptx: str, top: int = 12) -> dict[str, int]:
    ops = collections.Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s+(?:@%p\d+\s+)?([a-z][\w.]*)", line)
        if m and not m.group(1).startswith(("//", "ld.param")):
            ops[m.group(1)] += 1
    return dict(ops.most_common(top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,32,64,128")
    ap.add_argument("--out", default="attention_diag_s8.json")
    ap.add_argument("--dump", default="", help="folder for each variant's PTX / SASS")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms, smem_sm, regs_sm = props.multi_processor_count, 228 * 1024, 65536
    rows = []
    for name, layout, cfg in CASES:
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[name]
        full = ta._config(cfg, fp8=name == "fp8")
        row = {"dtype": name, "v_layout": layout, **full}
        for batch in (int(b) for b in args.batches.split(",")):
            sets = [inputs(batch, 8, 4, 128, 512, 384, dtype, seed, layout) for seed in (1, 2)]
            before = {id(k) for k in _compiled()}
            fns = [lambda s=s, c=cfg: ta._run(s[0], s[1], s[2], s[3], 128**-0.5, k_scale=s[5][0], v_scale=s[5][1], last=s[4],
                                       config=c) for s in sets]
            fns[0]()
            new = [k for k in _compiled() if id(k) not in before]
            if new and "n_regs" not in row:
                k = new[0]
                shared = int(getattr(k.metadata, "shared", 0))
                warps = full["num_warps"]
                row.update(n_regs=k.n_regs, n_spills=k.n_spills, shared_bytes=shared,
                           programs_per_sm_by_regs=regs_sm // max(1, k.n_regs * 32 * warps),
                           programs_per_sm_by_smem=smem_sm // max(1, shared) if shared else None,
                           ptx_mix=_ptx_mix(k.asm.get("ptx", "")))
                if args.dump:  # the PTX (and SASS where nvdisasm is there) for reading off the machine
                    Path(args.dump).mkdir(parents=True, exist_ok=True)
                    stem = Path(args.dump) / f"attn_{name}_{layout}_{len(rows)}"
                    stem.with_suffix(".ptx").write_text(k.asm.get("ptx", ""))
                    try:
                        stem.with_suffix(".sass").write_text(k.asm["sass"])
                    except Exception as err:  # noqa: BLE001 - SASS is optional
                        row["sass"] = f"{type(err).__name__}: {err}"[:120]
            ms, _ = C.time_graph_ms(fns)
            row[f"us_b{batch}"] = ms * 1e3
            row[f"gbs_b{batch}"] = 2 * batch * 8 * 384 * 128 * (1 if name == "fp8" else 2) / (ms * 1e-3) / 1e9
            row[f"programs_b{batch}"] = batch * 8 * ta._splits(batch, 8, 512, full["block_n"])
            del sets
        rows.append(row)
        print(row)
    C.write_json(args.out, {"command": C.command_line(), "env": C.environment(), "sms": sms, "rows": rows})
    cols = ["dtype", "v_layout", "block_n", "num_warps", "num_stages", "fp8_dots", "n_regs", "n_spills", "shared_bytes",
            "programs_per_sm_by_regs", "programs_per_sm_by_smem"]
    cols += [f"us_b{b}" for b in args.batches.split(",")]
    C.print_table(rows, cols)


if __name__ == "__main__":
    main()
