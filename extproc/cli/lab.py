"""The lab's commands (llm-extproc-lab adds them through an entry point group); without the lab
they are listed and say how to get them."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points

COMMANDS_GROUP = "llm_extproc.commands"
LAB_COMMANDS = {
    "sim": "simulated OpenAI-compatible engines",
    "demo": "Envoy + llm-extproc + simulated engines, side by side with round robin",
    "bench": "a named workload against OpenAI-compatible targets, side by side",
    "simulate": "the discrete-event mode",
    "bench-overhead": "latency/throughput through Envoy with vs without llm-extproc",
    "bench-tokenization": "tokenization on the request path",
    "bench-fleet": "snapshot ingestion rate and decision latency vs fleet size",
    "bench-big-bodies": "small requests' latency while clients send 15 MB bodies",
}


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for command in entry_points(group=COMMANDS_GROUP):  # the lab's commands, when it is installed
        command.load()(sub)
    for name, what in LAB_COMMANDS.items():
        if name not in sub.choices:
            p = sub.add_parser(name, help=f"{what} (needs the lab: pip install llm-extproc-lab)")
            p.set_defaults(func=missing)


def missing(args: argparse.Namespace) -> int:
    raise ValueError(
        f"`{args.command}` is a command of the lab, which is not installed: "
        "pip install llm-extproc-lab (from a checkout: pip install -e ./lab)"
    )
