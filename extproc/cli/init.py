"""`llm-extproc init`: an Envoy config and a service YAML that agree, to edit."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = (
    "Write envoy.yaml and llm-extproc.yaml (plus the endpoint-picker pair) that agree on cluster names, "
    "ports and headers, to edit for your own model servers."
)
# What `init` writes: an Envoy config and the service YAML that agree with it (cluster names, ports,
# header names), plus the endpoint-picker pair. The user edits addresses and model names.
INIT_FILES = ("envoy.yaml", "llm-extproc.yaml", "endpoint-picker.yaml", "llm-extproc-endpoint.yaml")


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "init",
        help="write an Envoy config and a service YAML that agree, to edit for your own servers",
        description=DESCRIPTION,
    )
    p.add_argument("dir", help="folder to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="replace files that already exist")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.settings import shipped_configs

    target = Path(args.dir)
    source = shipped_configs()
    clashes = [name for name in INIT_FILES if (target / name).exists()]
    if clashes and not args.force:
        raise ValueError(f"{target}: would overwrite {clashes}; pass --force to replace them")
    target.mkdir(parents=True, exist_ok=True)
    for name in INIT_FILES:
        (target / name).write_text((source / name).read_text())
    print(f"wrote {', '.join(INIT_FILES)} to {target}/")
    print(f"next: llm-extproc check-config --config {target / 'llm-extproc.yaml'}")
    print(f"      envoy --mode validate -c {target / 'envoy.yaml'}")
    return 0
