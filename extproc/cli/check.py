"""`llm-extproc check-config`: load a service YAML as `serve` would, and exit."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = (
    "Load a service YAML exactly as `serve` would, report its clusters, models and profile, and exit "
    "(non-zero with the reason when it is invalid)."
)


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config", help="load and validate a config file, then exit", description=DESCRIPTION
    )
    p.add_argument("--config", help="YAML config (default: $LLM_EXTPROC_CONFIG)")
    p.add_argument(
        "--envoy-config",
        help="also check the ext_proc metadata (profiles, priority caps, objectives) of an envoy.yaml",
    )
    p.add_argument(
        "--keys",
        action="store_true",
        help="list every key the service YAML accepts (dotted paths; * is a name you choose or a list "
        "entry; with what it takes and its default where one check declares both) and every plugin's "
        "parameters, then exit (docs/configuration.md explains each)",
    )
    p.set_defaults(func=run)


def print_keys() -> None:
    from extproc.config import key_paths, service_keys, service_schema
    from extproc.scheduling.framework import plugin_parameters

    paths = key_paths(service_keys())
    schema = service_schema()
    leaves = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]
    width = max(len(p) for p in paths)
    for path in paths:
        if path in schema:  # what it takes and its default; the others are described in the docs
            check, default = schema[path]
            shown = default if isinstance(default, str) else yaml_value(default)
            print(f"{path:<{width}}  {check.describe()}; default {shown}")
        else:
            print(path)
    params = plugin_parameters()
    for kind, plugins in params.items():
        for name, names in plugins.items():
            for param in names:
                print(f"{kind} {name}: {param}")
    count = sum(len(n) for plugins in params.values() for n in plugins.values())
    print(f"# {len(leaves)} service keys (+ {len(paths) - len(leaves)} sections), {count} plugin parameters")


def yaml_value(value: object) -> str:
    """A default as it is written in the YAML (null, true, [])."""
    import yaml

    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
    return str(text).removesuffix("...\n").strip()


def run(args: argparse.Namespace) -> int:
    from extproc.config import load_config

    if args.keys:
        print_keys()
        return 0
    config = load_config(args.config)
    if args.envoy_config:
        import yaml

        from extproc.doctor import route_metadata_problems

        envoy_cfg = yaml.safe_load(Path(args.envoy_config).read_text())
        if not isinstance(envoy_cfg, dict):
            raise ValueError(f"{args.envoy_config}: not a YAML mapping")
        problems = route_metadata_problems(config, envoy_cfg)
        if problems:
            raise ValueError(f"{args.envoy_config}: route metadata: " + "; ".join(problems))
    print(
        f"ok: {len(config.pool.clusters)} clusters, models {config.pool.models()}, "
        f"profile '{config.profile.name}'"
        + (f", route metadata in {args.envoy_config} valid" if args.envoy_config else "")
    )
    return 0
