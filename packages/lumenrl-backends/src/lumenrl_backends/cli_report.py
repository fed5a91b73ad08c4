"""``lumenrl report RUN_DIR [--out PNG] [--html PAGE]``: a run-health report (see :mod:`.report`)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register_cli", "run_report"]


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="run-health report: PNG of the curves and an HTML page with health verdicts"
    )
    p.add_argument("run_dir", help="a trainer.output_dir holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    p.add_argument("--html", default=None, help="HTML path (default: RUN_DIR/report.html)")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from lumenrl_backends.cli import CLIError
    from lumenrl_backends.loggers import read_metrics
    from lumenrl_backends.report import verdicts, write_html, write_report

    try:
        png = write_report(args.run_dir, args.out)
        page = write_html(args.run_dir, png, args.html)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    for v in verdicts(read_metrics(args.run_dir)):
        print(f"{'ok   ' if v.ok else 'CHECK'} {v.check}: {v.detail}")
    print(png)
    print(page)
    return 0
