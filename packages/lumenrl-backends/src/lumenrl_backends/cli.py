"""The ``lumenrl`` command line: ``lumenrl <command> ...``.

Subcommands are registered from :data:`COMMANDS`, a map of command name to the
``"module:function"`` that adds it. The function receives argparse's subparsers object, adds
its parser and sets ``func=handler`` where ``handler(args) -> int`` returns the exit code:

    def register_cli(subparsers):
        p = subparsers.add_parser("train", help="run training from a config")
        p.add_argument("--config", required=True)
        p.set_defaults(func=run_train)

User errors (a bad config, a rejected assembly, a missing plugin) print one line to stderr and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lumenrl_backends.__about__ import __version__
from lumenrl_backends.versions import versions_line

__all__ = ["COMMANDS", "build_parser", "main"]

# command -> "module:function" that registers it; a command whose module is not installed is skipped.
COMMANDS: dict[str, str] = {
    "plugins": "lumenrl_backends.cli:register_plugins",
    "config": "lumenrl_backends.cli:register_config",
    "train": "lumenrl_backends.cli_train:register_cli",
    "report": "lumenrl_backends.cli_report:register_cli",
    "bench": "lumenrl_backends.cli_bench:register_cli",
}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------- plugins


def register_plugins(subparsers: Any) -> None:
    from lumenrl_core.plugins import KINDS

    p = subparsers.add_parser("plugins", help="list installed plugins, their capabilities, requirements and availability")
    p.add_argument("--kind", choices=KINDS, help="only this plugin kind")
    p.add_argument("--format", choices=("table", "plain", "json"), default="table",
                   help="table (rich on a terminal when installed, else plain), plain text, or JSON lines")
    p.set_defaults(func=run_plugins)


def _plugin_rows(kind: str | None) -> list[dict[str, str]]:
    from lumenrl_core.plugins import get_registry

    rows = []
    for info in get_registry().infos(kind):
        rows.append({
            "kind": info.kind,
            "name": info.name,
            "package": f"{info.distribution} {info.version}",
            "capabilities": ", ".join(sorted(info.capabilities)) or "-",
            "requires": ", ".join(sorted(info.requires)) or "-",
            "status": "available" if info.available else f"unavailable: {info.reason}",
        })
    return rows


def _print_plain(rows: list[dict[str, str]]) -> None:
    columns = ("kind", "name", "package", "capabilities", "requires", "status")
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns[:-1]}
    print("  ".join(c.upper().ljust(widths.get(c, 0)) for c in columns).rstrip())
    for row in rows:
        print("  ".join(row[c].ljust(widths.get(c, 0)) for c in columns).rstrip())


def _print_rich(rows: list[dict[str, str]]) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(title="LumenRL plugins")
    for column in ("kind", "name", "package"):
        table.add_column(column, no_wrap=True)
    table.add_column("capabilities", overflow="fold")
    table.add_column("requires", overflow="fold")
    table.add_column("status", overflow="fold")
    for row in rows:
        style = "green" if row["status"] == "available" else "yellow"
        table.add_row(row["kind"], row["name"], row["package"], row["capabilities"], row["requires"],
                      f"[{style}]{row['status']}[/{style}]")
    Console(soft_wrap=False).print(table)
    return True


def run_plugins(args: argparse.Namespace) -> int:
    """The plugin table, then one line with the installed version of every LumenRL package (JSON
    lines: one row per plugin, each naming its package and version)."""
    rows = _plugin_rows(args.kind)
    if args.format == "json":
        for row in rows:
            print(json.dumps(row))
        return 0
    if args.format == "plain" or not sys.stdout.isatty() or not _print_rich(rows):
        _print_plain(rows)
    print(f"packages: {versions_line()}")
    return 0


# ---------------------------------------------------------------------------- config


def register_config(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="inspect run configs")
    sub = p.add_subparsers(dest="config_command", required=True, metavar="{show,check}")
    show = sub.add_parser("show", help="print the fully resolved config (YAML) after overrides")
    check = sub.add_parser("check", help="resolve every plugin and apply the assembly policy (no model, no torch)")
    for parser, func in ((show, run_config_show), (check, run_config_check)):
        parser.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
        parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.rollout_engine=hf")
        parser.add_argument("--skip-machine-checks", action="store_true",
                            help="do not check model paths and devices against this machine (inspect a GPU preset)")
        parser.set_defaults(func=func)


def run_config_show(args: argparse.Namespace) -> int:
    from lumenrl_core.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides, machine=not args.skip_machine_checks)
    text = dump_config(cfg)
    print(text, end="" if text.endswith("\n") else "\n")
    return 0


def run_config_check(args: argparse.Namespace) -> int:
    from lumenrl_core.assembly import plan_run
    from lumenrl_core.config import load_config

    cfg = load_config(args.config, args.overrides, machine=not args.skip_machine_checks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tolerated violations are printed below, once each
        plan = plan_run(cfg, load_classes=False)  # checked from the plugins' specs: no torch import
    width = max(len(role) for role in plan.plugin_names)
    for role, name in plan.plugin_names.items():
        print(f"{role.ljust(width)}  {name}  ({plan.version_of(role)})")
    for line in plan.warnings:
        print(f"warning: {line}", file=sys.stderr)
    print(f"ok: assembly policy {'strict' if cfg.assembly.strict_policy else 'lenient'}, "
          f"{len(plan.warnings)} warning(s)")
    return 0


# ---------------------------------------------------------------------------- main


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types reported as one line, without a traceback."""
    from lumenrl_core.assembly import AssemblyError
    from lumenrl_core.config import ConfigError
    from lumenrl_core.plugins import PluginError

    return (CLIError, ConfigError, AssemblyError, PluginError)


def _register_all(subparsers: Any) -> None:
    for target in COMMANDS.values():
        module_name, _, func_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # command not shipped in this install
            raise
        getattr(module, func_name)(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lumenrl", description="LumenRL: LLM post-training (RL, SDDD, low precision).")
    parser.add_argument("--version", action="version", version=f"lumenrl {__version__} ({versions_line()})")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    _register_all(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    errors = _user_errors()
    try:
        return int(args.func(args) or 0)
    except errors as exc:
        message = str(exc).strip() or type(exc).__name__
        lines = message.splitlines()
        if not all(line.startswith("config") for line in lines):  # e.g. an assembly list: one message
            lines = [message]
        for line in lines:  # several config problems: one line each
            print(f"lumenrl {args.command}: error: {line}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `lumenrl plugins | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    # `python -m lumenrl_backends.cli` (and torchrun -m): run the imported module's main so that
    # CLIError raised by subcommands is the class this main catches (not __main__.CLIError).
    from lumenrl_backends.cli import main as _main

    sys.exit(_main())
