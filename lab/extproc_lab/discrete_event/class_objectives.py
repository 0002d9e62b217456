"""Priority classes on small engines past capacity, in the discrete-event mode (issue 33's targets).

    python -m extproc_lab.discrete_event.class_objectives [--seed 0] [--cells s6-a10g] [--out out/classes]

The shape an independent run found the classes not separating on: engines whose batch and KV are
small (8 sequences, 600 blocks of 16 tokens: a new request waits for a running one to finish as soon
as the batch is full), 16 tenants with ~1k-token system prompts, every request carrying
`x-llm-priority` (20 % critical, 50 % standard, 30 % sheddable), open loop. llm-extproc runs the
**shipped** settings with `admission.enabled: true` (and the bench's clients trusted to ask for
critical): no bench-tuned thresholds. `--objectives critical=300ms` runs them under other class
objectives (the trade of critical latency for goodput at capacity: docs/tuning.md); `--replicas 3`
as three replicas sharing state through replica sync, taking the requests in turn.

Per cell, capacity is the highest arrival rate at which the best router (llm-extproc without
admission, the peers, exact-ttft) serves 95 % of the requests within the goodput SLO (TTFT <= 2 s),
and every row runs at 50 %, 100 %, 120 %, 160 %, 200 % and 300 % of it, each on a fresh fleet.

The checks per llm-extproc row (`class_checks`):
- goodput holds past capacity (`extproc_lab.bench.priorities.goodput_hold`): at every load from
  150 % up to the first at or past 2x the load where it peaks, within 10 % of its best before;
- at 100-200 %: critical TTFT p99 <= 1.5x its p99 at 50 % (whole run and after warm-up), no critical
  request shed, sheddable shed before standard, goodput >= the best peer's at that load.

Writes `classes.json` and `classes.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.config import ConfigError
from extproc.settings import DEFAULT_PUBLISH_INTERVAL_S, route_objectives
from extproc_lab.bench.classes import (
    CELLS,
    CONFIGURED,
    ENGINE_PRIORITY,
    NO_ADMISSION,
    OURS,
    SHIPPED_ADMISSION,
    ClassCell,
    class_checks,
)
from extproc_lab.bench.classes import workload as cell_workload
from extproc_lab.bench.priorities import PEERS, is_good, policy_table, row_stats
from extproc_lab.bench.report import RequestRecord, Slo
from extproc_lab.bench.workloads import Workload
from extproc_lab.discrete_event.simulation import simulate, tokenize_requests

REFERENCES = (*PEERS, "exact-ttft")
CAPACITY_POLICIES = (NO_ADMISSION, "sglang-cache-aware", "vllm-router-cache-aware", "exact-ttft")
CAPACITY_GOOD = 0.95


@dataclass(slots=True)
class Config:
    cells: tuple[str, ...] = ("s6-a10g",)
    count: int = 1200
    seed: int = 0
    loads: tuple[float, ...] = (0.5, 1.0, 1.2, 1.6, 2.0, 3.0)
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=2.0, tpot_s=10.0))
    admission: dict[str, Any] = field(default_factory=lambda: dict(SHIPPED_ADMISSION))
    references: tuple[str, ...] = REFERENCES
    publish_interval_s: float = DEFAULT_PUBLISH_INTERVAL_S
    warmup: float = 0.1
    replicas: int = 1  # llm-extproc processes taking the requests in turn, sharing state (sync)


def with_objectives(admission: dict[str, Any], value: str) -> dict[str, Any]:
    """`admission` with the class objectives of `value` (`critical=300ms,standard=4x`, checked as a
    route's `x-llm-objectives`) over its own."""
    route_objectives(value, "--objectives")
    own = dict(admission.get("objectives") or {})
    for item in value.split(","):
        name, _, objective = item.partition("=")
        own[name.strip().lower()] = objective.strip()
    return {**admission, "objectives": own}


def workload(cell: ClassCell, cfg: Config, rate: float) -> Workload:
    return cell_workload(cell, rate, cfg.count, cfg.seed)


def run_row(cell: ClassCell, cfg: Config, wl: Workload, row: str) -> list[RequestRecord]:
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    service: dict[str, Any] | None = None
    policy = row
    engine_priority = row == ENGINE_PRIORITY
    if row in (OURS, ENGINE_PRIORITY, CONFIGURED):
        policy = OURS
        service = {"admission": cfg.admission}
        if engine_priority:
            service["engine_priority"] = {}
    elif row == NO_ADMISSION:
        policy = OURS
        service = {"admission": {"client_max_priority": "critical"}}
    run = simulate(
        requests,
        list(cell.fleet),
        policy,
        service=service,
        tokens=tokenize_requests(requests),
        headers=wl.headers,
        publish_interval_s=cfg.publish_interval_s,
        scheduling_policy="priority" if engine_priority else "fcfs",
        max_num_seqs=row == CONFIGURED,
        replicas=cfg.replicas if policy == OURS else 1,
    )
    return run.records


def capacity(cell: ClassCell, cfg: Config, steps: int = 6) -> tuple[float, str]:
    """The highest rate at which the best of CAPACITY_POLICIES serves CAPACITY_GOOD within the SLO
    (one llm-extproc replica: runs with `--replicas` keep the cell's capacity)."""
    cfg = dataclasses.replace(cfg, replicas=1)
    best = (0.0, "-")
    for policy in CAPACITY_POLICIES:
        lo, hi = 0.0, 8.0 * len(cell.fleet)
        for _ in range(steps):
            mid = (lo + hi) / 2
            records = run_row(cell, cfg, workload(cell, cfg, mid), policy)
            good = sum(1 for r in records if r.ok and is_good(r, cfg.slo)) / len(records)
            lo, hi = (mid, hi) if good >= CAPACITY_GOOD else (lo, mid)
        best = max(best, (lo, policy))
    return best


def rows(cfg: Config) -> list[str]:
    own = [OURS, CONFIGURED, ENGINE_PRIORITY, NO_ADMISSION]
    return own + [r for r in cfg.references if r not in own]  # `--rows llm-extproc`: no peers


def run_cell(cell: ClassCell, cfg: Config, log: Any = print) -> dict[str, Any]:
    cap, by = capacity(cell, cfg)
    log(f"{cell.name}: capacity {cap:.2f} req/s (set by {by})")
    loads: dict[str, Any] = {}
    for load in cfg.loads:
        wl = workload(cell, cfg, cap * load)
        per: dict[str, Any] = {}
        for row in rows(cfg):
            per[row] = row_stats(row, run_row(cell, cfg, wl, row), wl.duration_s, cfg.slo, cfg.warmup)
            k = per[row]["classes"]
            log(
                f"  {cell.name} {load:.0%} {row}: good {per[row]['goodput_rps']:.2f}/s, critical p99 "
                f"{_s(k['critical']['ttft_p99_ms'])}, shed {k['critical']['shed']}/"
                f"{k['standard']['shed']}/{k['sheddable']['shed']}"
            )
        loads[f"{load:g}"] = {"rate_rps": cap * load, "window_s": wl.duration_s, "policies": per}
    checks = {row: class_checks(loads, row) for row in (OURS, CONFIGURED, ENGINE_PRIORITY, NO_ADMISSION)}
    return {"capacity_rps": cap, "capacity_by": by, "loads": loads, "checks": checks}


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s"


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        "# Priority classes past capacity (discrete-event mode, virtual time)",
        "",
        f"{c['count']} requests a run, seed {c['seed']}; 20 % critical / 50 % standard / 30 % sheddable; "
        f"good: TTFT <= {c['slo_ttft_s']:g} s; llm-extproc admission {c['admission']}.",
        "",
    ]
    worst = sorted(result["cells"].items(), key=lambda kv: _score(kv[1]["checks"][OURS]))
    lines += ["## Checks, worst cell first", ""]
    lines += [
        "| cell | row | peak good/s (load) | past 150 %, over its best so far | critical p99 x at "
        "100/120/160/200 % (whole / warm) | critical shed | sheddable first | good/s vs best peer at "
        "100/120/160/200 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cell in worst:
        for row in (r for r in (OURS, CONFIGURED, ENGINE_PRIORITY, NO_ADMISSION) if r in cell["checks"]):
            ch = cell["checks"][row]
            hold = ch["goodput_hold"]
            held = ", ".join(f"{float(k):.0%}: {_x(v)}" for k, v in hold["held"].items())
            if held and not hold["holds"]:
                held += " MISS"
            ratios = ", ".join(
                f"{_x(v['critical_p99_ratio'])}/{_x(v['critical_p99_steady_ratio'])}"
                for v in ch["loads"].values()
            )
            shed = sum(v["critical_shed"] for v in ch["loads"].values())
            first = all(v["sheddable_first"] for v in ch["loads"].values())
            vs = ", ".join(f"{v['goodput']:.2f}/{v['best_peer_goodput']:.2f}" for v in ch["loads"].values())
            lines.append(
                f"| {name} | {row} | {hold['peak_goodput_rps']:.2f} ({_share(hold['peak_load'])}) | "
                f"{held or '-'} | "
                f"{ratios} | {shed} | {'yes' if first else 'NO'} | {vs} |"
            )
    lines.append("")
    for name, cell in result["cells"].items():
        lines += [f"## {name} (capacity {cell['capacity_rps']:.2f} req/s, set by {cell['capacity_by']})", ""]
        for load, run in cell["loads"].items():
            lines += [f"### {float(load):.0%} ({run['rate_rps']:.2f} req/s)", ""]
            lines += policy_table(run["policies"])
            lines.append("")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"x{v:.2f}"


def _share(load: float | None) -> str:
    return "-" if load is None else f"{load:.0%}"


def _score(ch: dict[str, Any]) -> float:
    """Lower is worse: the worst critical ratio (negated) ranks the cells."""
    worst = max((v["critical_p99_ratio"] or 0.0 for v in ch["loads"].values()), default=0.0)
    return -worst


def run(cfg: Config, out: Path | None, log: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {
        "config": {
            "cells": list(cfg.cells),
            "count": cfg.count,
            "seed": cfg.seed,
            "loads": list(cfg.loads),
            "slo_ttft_s": cfg.slo.ttft_s,
            "admission": cfg.admission,
            "publish_interval_s": cfg.publish_interval_s,
            "warmup": cfg.warmup,
            "replicas": cfg.replicas,
        },
        "cells": {},
    }
    for name in cfg.cells:
        result["cells"][name] = run_cell(CELLS[name], cfg, log)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "classes.json").write_text(json.dumps(result, indent=2, sort_keys=True))
            (out / "classes.md").write_text(markdown(result))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extproc_lab.discrete_event.class_objectives", description=__doc__
    )
    ap.add_argument("--cells", default="s6-a10g", help=f"comma-separated, of {', '.join(CELLS)}")
    ap.add_argument("--count", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1,1.2,1.6,2,3")
    ap.add_argument("--rows", default="", help="comma-separated references to run (default: all)")
    ap.add_argument(
        "--objectives",
        default="",
        help="the llm-extproc rows' class objectives, as a route's x-llm-objectives "
        "(critical=300ms,standard=4x; default: the shipped ones): what critical latency buys goodput",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="llm-extproc replicas sharing state (replica sync), taking the requests in turn",
    )
    ap.add_argument("--out", default="out/classes")
    args = ap.parse_args(argv)
    cfg = Config(
        cells=tuple(c for c in args.cells.split(",") if c),
        count=args.count,
        seed=args.seed,
        loads=tuple(float(x) for x in args.loads.split(",")),
        replicas=args.replicas,
    )
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if args.rows:
        cfg.references = tuple(r for r in args.rows.split(",") if r)
    if args.objectives:
        try:
            cfg.admission = with_objectives(cfg.admission, args.objectives)
        except ConfigError as exc:
            ap.error(str(exc))
    result = run(cfg, Path(args.out))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
