"""Run every lumenrl-quant benchmark; each prints a table and writes benchmarks/results/quant_*.json.

    PYTHONPATH=packages/lumenrl-quant/src python benchmarks/quant/run_all.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_agreement  # noqa: E402
import bench_gemm  # noqa: E402
import bench_linear  # noqa: E402
import bench_quantize  # noqa: E402
from _common import environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; a CPU sanity run")
    parser.add_argument("--only", nargs="*", default=None, help="subset: agreement quantize gemm linear")
    args = parser.parse_args()
    print("environment:", environment(), flush=True)
    failed = []
    for name, mod in [("agreement", bench_agreement), ("quantize", bench_quantize), ("gemm", bench_gemm),
                      ("linear", bench_linear)]:
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        try:
            mod.run(args.smoke)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
