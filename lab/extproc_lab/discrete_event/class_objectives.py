"""Priority classes on small engines past capacity, in the discrete-event mode (issue 33's targets).

    python -m extproc_lab.discrete_event.class_objectives [--seed 0] [--cells s6-a10g] [--out out/classes]

The shape an independent run found the classes not separating on: engines whose batch and KV are
small (8 sequences, 600 blocks of 16 tokens: a new request waits for a running one to finish as soon
as the batch is full), 16 tenants with ~1k-token system prompts, every request carrying
`x-llm-priority` (20 % critical, 50 % standard, 30 % sheddable), open loop. llm-extproc runs the
**shipped** settings with `admission.enabled: true` (and the bench's clients trusted to ask for
critical): no bench-tuned thresholds.

Per cell, capacity is the highest arrival rate at which the best router (llm-extproc without
admission, the peers, exact-ttft) serves 95 % of the requests within the goodput SLO (TTFT <= 2 s),
and every row runs at 50 %, 100 %, 120 %, 160 %, 200 % and 300 % of it, each on a fresh fleet.

The checks per llm-extproc row (`class_checks`):
- goodput at 1.5x and 2x the load where its goodput peaks (the loads run nearest above them) is
  within 10 % of that peak;
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

from extproc_lab.bench.priorities import PEERS, is_good, policy_table, row_stats
from extproc_lab.bench.report import RequestRecord, Slo
from extproc_lab.bench.workloads import Workload, make_workload, with_priorities
from extproc_lab.discrete_event.simulation import simulate, tokenize_requests
from extproc_lab.engines.profiles import A10G_LLAMA3_8B, H100_LLAMA3_8B, GpuProfile

# The engines: an A10G's and an H100's costs with a small batch and a small KV cache.
SMALL_A10G = dataclasses.replace(
    A10G_LLAMA3_8B, name="a10g-8seq-600blk", max_num_seqs=8, num_gpu_blocks=600, max_model_len=4096
)
SMALL_H100 = dataclasses.replace(
    H100_LLAMA3_8B, name="h100-8seq-600blk", max_num_seqs=8, num_gpu_blocks=600, max_model_len=4096
)


@dataclass(frozen=True, slots=True)
class ClassCell:
    name: str
    fleet: tuple[GpuProfile, ...]
    system_tokens: int = 1200
    tenants: int = 16
    output_tokens: tuple[int, int] = (50, 200)


CELLS: dict[str, ClassCell] = {
    c.name: c
    for c in (
        ClassCell("s6-a10g", (SMALL_A10G,) * 6),
        ClassCell("s6-h100", (SMALL_H100,) * 6),
        ClassCell("s4-mixed", (SMALL_H100, SMALL_H100, SMALL_A10G, SMALL_A10G)),
        ClassCell("s6-a10g-long-out", (SMALL_A10G,) * 6, output_tokens=(200, 600)),
    )
}

OURS = "llm-extproc"
ENGINE_PRIORITY = "llm-extproc (+ engine priority)"
NO_ADMISSION = "llm-extproc (no admission)"
REFERENCES = (*PEERS, "exact-ttft")
CAPACITY_POLICIES = (NO_ADMISSION, "sglang-cache-aware", "vllm-router-cache-aware", "exact-ttft")
CAPACITY_GOOD = 0.95
# What a user who wants priorities sets; the bench's clients may ask for critical themselves.
SHIPPED_ADMISSION: dict[str, Any] = {"enabled": True, "client_max_priority": "critical"}
CHECKED_LOADS = (1.0, 1.2, 1.6, 2.0)


@dataclass(slots=True)
class Config:
    cells: tuple[str, ...] = ("s6-a10g",)
    count: int = 1200
    seed: int = 0
    loads: tuple[float, ...] = (0.5, 1.0, 1.2, 1.6, 2.0, 3.0)
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=2.0, tpot_s=10.0))
    admission: dict[str, Any] = field(default_factory=lambda: dict(SHIPPED_ADMISSION))
    references: tuple[str, ...] = REFERENCES
    publish_interval_s: float = 0.5
    warmup: float = 0.1


def workload(cell: ClassCell, cfg: Config, rate: float) -> Workload:
    wl = make_workload(
        "shared-prefix",
        rate=rate,
        count=cfg.count,
        seed=cfg.seed,
        tenants=cell.tenants,
        system_tokens=cell.system_tokens,
        output_tokens=cell.output_tokens,
    )
    return with_priorities(wl, seed=cfg.seed)


def run_row(cell: ClassCell, cfg: Config, wl: Workload, row: str) -> list[RequestRecord]:
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    service: dict[str, Any] | None = None
    policy = row
    engine_priority = row == ENGINE_PRIORITY
    if row in (OURS, ENGINE_PRIORITY):
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
    )
    return run.records


def capacity(cell: ClassCell, cfg: Config, steps: int = 6) -> tuple[float, str]:
    """The highest rate at which the best of CAPACITY_POLICIES serves CAPACITY_GOOD within the SLO."""
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
    return [OURS, ENGINE_PRIORITY, NO_ADMISSION, *cfg.references]


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
    checks = {row: class_checks(loads, row) for row in (OURS, ENGINE_PRIORITY, NO_ADMISSION)}
    return {"capacity_rps": cap, "capacity_by": by, "loads": loads, "checks": checks}


def class_checks(loads: dict[str, Any], row: str) -> dict[str, Any]:
    """Issue 33's checks for one row (see the module docstring)."""
    by_load = {float(k): v["policies"] for k, v in loads.items()}
    ordered = sorted(by_load)
    goodput = {x: by_load[x][row]["goodput_rps"] for x in ordered}
    peak_load = max(ordered, key=lambda x: goodput[x])
    peak = goodput[peak_load]
    holds: dict[str, Any] = {}
    for factor in (1.5, 2.0):
        above = [x for x in ordered if x >= factor * peak_load - 1e-9]
        if above:
            x = above[0]
            holds[f"{factor:g}x"] = {"load": x, "goodput": goodput[x], "ok": goodput[x] >= 0.9 * peak}
    low = by_load[ordered[0]][row]["classes"]["critical"]
    per_load: dict[str, Any] = {}
    for x in (x for x in ordered if x in CHECKED_LOADS):
        ours = by_load[x][row]
        k = ours["classes"]
        crit = k["critical"]
        first_sheddable, first_standard = k["sheddable"]["first_shed_s"], k["standard"]["first_shed_s"]
        peer = max((by_load[x][p]["goodput_rps"], p) for p in PEERS if p in by_load[x])
        per_load[f"{x:g}"] = {
            "critical_p99_ratio": _ratio(crit["ttft_p99_ms"], low["ttft_p99_ms"]),
            "critical_p99_steady_ratio": _ratio(crit["ttft_p99_steady_ms"], low["ttft_p99_steady_ms"]),
            "critical_shed": crit["shed"],
            "sheddable_first": first_standard is None
            or (first_sheddable is not None and first_sheddable <= first_standard),
            "goodput": ours["goodput_rps"],
            "best_peer": peer[1],
            "best_peer_goodput": peer[0],
        }
    return {"peak_load": peak_load, "peak_goodput": peak, "holds": holds, "loads": per_load}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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
        "| cell | row | peak good/s (load) | at 1.5x / 2x peak | critical p99 x at 100/120/160/200 % "
        "(whole / warm) | critical shed | sheddable first | good/s vs best peer at 100/120/160/200 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cell in worst:
        for row in (OURS, ENGINE_PRIORITY, NO_ADMISSION):
            ch = cell["checks"][row]
            holds = " / ".join(
                f"{h['goodput']:.2f}{'' if h['ok'] else ' MISS'}" for h in ch["holds"].values()
            )
            ratios = ", ".join(
                f"{_x(v['critical_p99_ratio'])}/{_x(v['critical_p99_steady_ratio'])}"
                for v in ch["loads"].values()
            )
            shed = sum(v["critical_shed"] for v in ch["loads"].values())
            first = all(v["sheddable_first"] for v in ch["loads"].values())
            vs = ", ".join(f"{v['goodput']:.2f}/{v['best_peer_goodput']:.2f}" for v in ch["loads"].values())
            lines.append(
                f"| {name} | {row} | {ch['peak_goodput']:.2f} ({ch['peak_load']:.0%}) | {holds or '-'} | "
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
    ap.add_argument("--out", default="out/classes")
    args = ap.parse_args(argv)
    cfg = Config(
        cells=tuple(c for c in args.cells.split(",") if c),
        count=args.count,
        seed=args.seed,
        loads=tuple(float(x) for x in args.loads.split(",")),
    )
    if args.rows:
        cfg.references = tuple(r for r in args.rows.split(",") if r)
    result = run(cfg, Path(args.out))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
