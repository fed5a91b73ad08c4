"""``python -m benchmarks run SUITE [--smoke] [--only NAME ...]`` | ``list`` | ``results`` | ``merge FILE``.

On a GPU machine whose files come back only from an output folder: ``LUMENRL_BENCH_OUT=$OUT python -m
benchmarks run gpu`` also writes the new history lines to ``$OUT/history_new.jsonl``; back in the checkout,
``python -m benchmarks merge .../history_new.jsonl`` appends them and regenerates RESULTS.md.

See :mod:`benchmarks.suite` for the entries and how to add one.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.history import HISTORY, RESULTS, merge, read_history, render_results, run_entries
from benchmarks.suite import ENTRIES, entries, suite_names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite's entries (full runs append to history.jsonl)")
    run.add_argument("suite", choices=suite_names())
    run.add_argument("--smoke", action="store_true", help="tiny CPU shapes, seconds; not recorded")
    run.add_argument("--only", nargs="+", default=(), metavar="NAME", help="just these entries")
    run.add_argument("--no-record", action="store_true", help="do not append to the history")
    run.add_argument("--budget-s", type=float, default=None, metavar="S",
                     help="the seconds this call may take: an entry whose recorded time (median of its last 3 "
                          "records) does not fit in what is left is skipped, not started and killed")
    sub.add_parser("list", help="list the entries, their suites and goals")
    sub.add_parser("results", help=f"rewrite {RESULTS.name} from {HISTORY.name}")
    mrg = sub.add_parser("merge", help=f"append another machine's history lines to {HISTORY.name}, rewrite {RESULTS.name}")
    mrg.add_argument("file", type=Path)
    args = ap.parse_args(argv)
    if args.command == "list":
        for e in ENTRIES:
            print(f"{e.name:<20} {e.device:<5} {','.join(e.suites):<22} {e.goal}")
        return 0
    if args.command == "merge":
        print(f"{merge(args.file)} new records")
        RESULTS.write_text(render_results(read_history()))
        return 0
    if args.command == "results":
        RESULTS.write_text(render_results(read_history()))
        print(RESULTS)
        return 0
    smoke = args.smoke or args.suite == "smoke"
    if args.budget_s is not None and args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s:g}: allowed > 0")
    command = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
    failed = run_entries(entries(args.suite, tuple(args.only)), smoke=smoke, command=command,
                         record=not args.no_record, budget_s=args.budget_s)
    if not smoke and not args.no_record:
        RESULTS.write_text(render_results(read_history()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
