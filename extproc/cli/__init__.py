"""The `llm-extproc` command line, one module per command: its flags (`add`) and what it does
(`run`)."""

from __future__ import annotations

import argparse
import sys

from extproc import __version__
from extproc.cli import check, doctor, init, lab, publish, serve
from extproc.cli.common import HelpFormatter, add_log_options, check_listen, run_async
from extproc.cli.init import INIT_FILES
from extproc.telemetry.logs import setup_logging

__all__ = ["INIT_FILES", "HelpFormatter", "build_parser", "check_listen", "main", "run_async"]
COMMANDS = (serve, check, init, publish, doctor)
DESCRIPTION = (
    "Command line: `llm-extproc serve | check-config | init | publish | doctor`; the lab distribution "
    "(llm-extproc-lab) adds `sim | simulate | demo | bench...`."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-extproc", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    add_log_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
    lab.add(sub)
    _finish_subcommands(sub)
    return parser


def _finish_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every command: a description, defaults shown in --help, and the global log flags."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        p.formatter_class = HelpFormatter
        if not p.description:
            p.description = helps.get(name)
        if not any(a.dest == "log_level" for a in p._actions):
            add_log_options(p, top=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"llm-extproc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
