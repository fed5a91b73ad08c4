"""``lumenrl report RUN_DIR [--out PNG]``: plot a run's metrics.jsonl (see :mod:`.report`)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register_cli", "run_report"]


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="write a PNG of a run's curves (reward, KL, entropy, lengths, speed)"
    )
    p.add_argument("run_dir", help="a trainer.output_dir holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from lumenrl_backends.cli import CLIError
    from lumenrl_backends.report import write_report

    try:
        path = write_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    print(path)
    return 0
