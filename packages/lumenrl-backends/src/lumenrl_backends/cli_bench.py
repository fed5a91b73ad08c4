"""``lumenrl bench ARGS``: run ``python -m benchmarks ARGS`` from the LumenRL checkout.

The benchmarks live in the repository (``benchmarks/``), not in any package: packages never import
them. This command finds the checkout (the current directory or a parent holding
``benchmarks/suite.py``, else ``$LUMENRL_REPO``) and runs the harness there in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["find_checkout", "register_cli", "run_bench"]


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="run the benchmark suite (python -m benchmarks ...; needs a LumenRL checkout)",
        description="Forwards its arguments to `python -m benchmarks`, e.g. `lumenrl bench run gpu`, "
        "`lumenrl bench run smoke`, `lumenrl bench list`, `lumenrl bench results`.",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of python -m benchmarks")
    p.set_defaults(func=run_bench)


def find_checkout(start: Path | None = None) -> Path | None:
    """The repository root holding ``benchmarks/suite.py``: ``start`` (default: cwd) or a parent, else $LUMENRL_REPO."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "benchmarks" / "suite.py").is_file():
            return folder
    env = os.environ.get("LUMENRL_REPO")
    if env and (Path(env) / "benchmarks" / "suite.py").is_file():
        return Path(env)
    return None


def run_bench(args: argparse.Namespace) -> int:
    from lumenrl_backends.cli import CLIError

    root = find_checkout()
    if root is None:
        raise CLIError("benchmarks live in the LumenRL repository (benchmarks/suite.py), not in the installed "
                       "packages: run this inside a checkout (git clone ...; cd LumenRL) or set LUMENRL_REPO")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "benchmarks", *(args.bench_args or ["--help"])], cwd=root,
                          env=env).returncode
