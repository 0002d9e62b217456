"""What decision explanation costs per decision: `RequestLifecycle.route()` (fleet_state's
decision_latency: parse + schedule + record over n fresh instances) with explanation off, with
/debug/decisions keeping decisions, and with the header asked for; optionally against a checkout of the
code from before explanation existed (`--baseline-tree DIR`, a folder holding an `extproc/` package,
e.g. `git archive <commit> extproc | tar -x -C DIR`).

First the variants take turns decision by decision in one process (robust to a machine whose load
drifts); then each variant, and the code from before explanation, runs in its own process, round by
round; medians are reported with their ratio to "off".

    python -m extproc_lab.bench.explain_cost --out out/explain [--baseline-tree /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "keep_last=100": {"explain": {"keep_last": 100}},
    "header asked": {"explain": {"header": "on_request"}, "asked": True},
}

_CHILD = """
import json, sys
from extproc_lab.bench.fleet_state import decision_latency
n, mode, decisions, kw = json.loads(sys.argv[1])
print(json.dumps(decision_latency(n, mode, decisions, **kw)))
"""


def _run(tree: str | None, n: int, mode: str, decisions: int, kw: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([n, mode, decisions, kw])],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=tree or None,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(
    sizes: tuple[int, ...] = (100, 1000),
    mode: str = "endpoint",
    rounds: int = 5,
    decisions: int = 2000,
    baseline_tree: str | None = None,
) -> list[dict[str, Any]]:
    variants: list[tuple[str, str | None, dict[str, Any]]] = []
    if baseline_tree:
        variants.append(("before explanation", baseline_tree, {}))
    variants += [(name, None, kw) for name, kw in VARIANTS.items()]
    rows = []
    for n in sizes:
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in variants}
        for _ in range(rounds):
            for name, tree, kw in variants:
                r = _run(tree, n, mode, decisions, kw)
                samples[name].append((r["p50_us"], r["p99_us"]))
        off = statistics.median(p50 for p50, _ in samples["off"])
        for name, _, _ in variants:
            p50 = statistics.median(p50 for p50, _ in samples[name])
            p99 = statistics.median(p99 for _, p99 in samples[name])
            rows.append(
                {"instances": n, "variant": name, "p50_us": p50, "p99_us": p99, "p50_vs_off": p50 / off}
            )
    return rows


def interleaved(n: int, mode: str = "endpoint", decisions: int = 2000) -> list[dict[str, Any]]:
    """In one process, the variants take turns decision by decision (off, keep_last, header asked,
    off, ...), each with its own lifecycle over the same fleet view: machine-load drift hits them
    alike, which separate processes cannot promise on a shared machine."""
    from extproc.config import config_from_dict
    from extproc.fleet import FleetView, decode
    from extproc.lifecycle import RequestLifecycle
    from extproc.telemetry import Metrics
    from extproc_lab.bench.fleet_state import CLUSTERS, MODEL, _config, _head, _snapshots

    rng = random.Random(n)
    base = config_from_dict(_config(n, mode))
    view = FleetView(base.pool)
    for data in _snapshots(n, 1, rng):
        view.apply(decode(data, view.known_clusters))
    view.rebuild()
    head = _head()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 200}]}).encode()
    runs = []
    for name, kw in VARIANTS.items():
        raw = _config(n, mode)
        if "explain" in kw:
            raw["explain"] = kw["explain"]
        metrics = Metrics([MODEL], [f"pool-{c}" for c in range(CLUSTERS)])
        runs.append((name, RequestLifecycle(config_from_dict(raw), metrics, view), bool(kw.get("asked"))))
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(decisions):
        for name, lifecycle, asked in runs:
            t0 = time.perf_counter()
            d = lifecycle.route(head, body, explain=asked)
            if asked and d.explanation is not None:
                d.explanation.header_value()
            times[name].append(time.perf_counter() - t0)
            lifecycle.finish(d, "response_end")
    off = statistics.median(times["off"])
    rows = []
    for name, samples in times.items():
        samples.sort()
        p50 = statistics.median(samples)
        rows.append(
            {
                "instances": n,
                "variant": f"{name} (interleaved)",
                "p50_us": p50 * 1e6,
                "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
                "p50_vs_off": p50 / off,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], mode: str, rounds: int) -> str:
    lines = [
        f"Decision latency (RequestLifecycle.route, {mode} mode): interleaved in one process, then "
        f"separate processes (median of {rounds} rounds)",
        "",
        "| instances | variant | p50 µs | p99 µs | p50 / off |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['instances']} | {r['variant']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
            f"{r['p50_vs_off']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,1000", help="fleet sizes (instances), comma-separated")
    p.add_argument("--mode", default="endpoint", choices=["endpoint", "cluster"], help="routing mode")
    p.add_argument("--rounds", type=int, default=5, help="runs per variant in separate processes (0: none)")
    p.add_argument("--decisions", type=int, default=2000, help="decisions per run")
    p.add_argument("--baseline-tree", help="folder with the extproc package from before explanation")
    p.add_argument("--out", default="out/explain", help="output folder (explain_cost.json, .md)")
    args = p.parse_args(argv)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    rows = [r for n in sizes for r in interleaved(n, args.mode, args.decisions)]
    if args.rounds > 0:
        rows += run(sizes, args.mode, args.rounds, args.decisions, args.baseline_tree)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "explain_cost.json").write_text(json.dumps(rows, indent=2))
    text = markdown(rows, args.mode, args.rounds)
    (out / "explain_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
