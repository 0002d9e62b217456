"""`llm-extproc doctor`: check a running setup and say what to fix."""

from __future__ import annotations

import argparse
import os

from extproc.cli.common import run_async, warn_credentials_in_argv
from extproc.settings import ENV_REDIS_PASSWORD

DESCRIPTION = (
    "Check a running setup: Envoy admin reachable and its llm-extproc cluster healthy, Redis "
    "reachable, a fresh snapshot per upstream, and envoy.yaml's clusters matching the service YAML. "
    "One line per check; exits 1 when any fails."
)


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check a running setup (Envoy, service, Redis, snapshots) and say what to fix",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--config", help="the service YAML the running service uses (default: $LLM_EXTPROC_CONFIG)"
    )
    p.add_argument("--envoy-admin", help="Envoy's admin API, e.g. http://127.0.0.1:9901")
    p.add_argument(
        "--envoy-config", help="an envoy.yaml to compare clusters with (default: Envoy's live config_dump)"
    )
    p.add_argument(
        "--redis",
        help="Redis URL holding the snapshots (default: the YAML's fleet.url); without a password: "
        f"the command line is visible to every user of the host, set ${ENV_REDIS_PASSWORD} instead",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds allowed for each part's answers")
    p.add_argument(
        "--service-metrics",
        help="the service's /metrics URL, for its calibration against the engines (default: the YAML's "
        "metrics_listen on loopback)",
    )
    p.add_argument(
        "--probe-engines",
        action="store_true",
        help="with engine_priority: send each engine it writes to (at its snapshot's address) a "
        "one-token completion carrying a non-zero priority, to find engines that refuse it (vLLM not "
        "started with --scheduling-policy priority); bearer token from $LLM_EXTPROC_ENGINE_API_KEY",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="repeat the checks until all pass or this long has gone by (for scripts that just started "
        "the parts)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.doctor import DoctorOptions, report, run_doctor_until

    warn_credentials_in_argv("--redis", args.redis)
    opts = DoctorOptions(
        config=args.config,
        envoy_admin=args.envoy_admin,
        envoy_config=args.envoy_config,
        redis_url=args.redis,
        timeout_s=args.timeout,
        probe_engines=args.probe_engines,
        engine_api_key=os.environ.get("LLM_EXTPROC_ENGINE_API_KEY") or None,
        service_metrics=args.service_metrics,
    )
    text, status = report(run_async(run_doctor_until(opts, args.wait)))
    print(text)
    return status
