"""The priorities bench across fleets and workloads, in the discrete-event mode: issue 11's checks in
cells of the routing grid, so that the admission settings are not judged on the one fleet they were
chosen on (`extproc_lab.discrete_event.priorities` runs 4 A10Gs whose caches hold every tenant).

    python -m extproc_lab.discrete_event.priorities_grid [--cells t-base,c-base] [--out out/priorities-grid]

Per cell (`extproc_lab.bench.grid`'s cells: fleet, KV per engine, workload; the cell's own load is
not used), its requests get priority classes (20 % critical, 50 % standard, 30 % sheddable) and:

- the goodput SLO is the routing grid's: TTFT within max(1 s, 2 x the cold prefill of the median
  prompt), TPOT within 100 ms;
- **capacity** is the highest arrival rate at which the *best* of the routers serves 95 % of the
  cell's requests within the SLO (each found by bisection, on the same request count as the runs):
  llm-extproc without admission, the peer routers and exact-ttft. Not exact-ttft's alone, which
  scatters tenants under KV pressure and would put "120 %" below what a cache-aware router serves
  with room to spare;
- every row runs at 50, 120, 160 and 200 % of it: llm-extproc with the bench's admission, with it
  and the TPOT gate (`max_tpot_s` at the SLO's TPOT), the same on engines that schedule by priority
  (vLLM's `--scheduling-policy priority`, the class written into each body: `engine_priority: {}`),
  without admission, and every reference, each on a fresh fleet (FCFS engines but for that row);
- the checks of `extproc_lab.bench.priorities` (at 120 %, at each load, and whether goodput holds
  at 160 and 200 %).

Writes `priorities-grid.json` and `priorities-grid.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.settings import DEFAULT_PUBLISH_INTERVAL_S
from extproc_lab.bench.grid import Cell, cell_slo, grid, make_cell_workload
from extproc_lab.bench.priorities import (
    BENCH_ADMISSION,
    ENGINE_PRIORITY_ROW,
    TPOT_GATE_ROW,
    checks,
    is_good,
    policy_table,
    row_stats,
)
from extproc_lab.bench.report import RequestRecord, Slo
from extproc_lab.bench.workloads import Workload, with_priorities
from extproc_lab.discrete_event.grid import cell_fleet
from extproc_lab.discrete_event.simulation import simulate, tokenize_requests
from extproc_lab.engines.profiles import GpuProfile

MODEL = "sim-llama"
OURS = "llm-extproc"
NO_ADMISSION = "llm-extproc (no admission)"
REFERENCES = ("round-robin", "least-request", "sglang-cache-aware", "vllm-router-cache-aware", "exact-ttft")
# Who sets the capacity: the best of these (round robin and least request never do here).
CAPACITY_POLICIES = (OURS, "sglang-cache-aware", "vllm-router-cache-aware", "exact-ttft")
CAPACITY_GOOD = 0.95
CELLS = ("t-base", "t-kv-4", "t-tenants-16", "t-prompt-4k", "t-mixed", "c-base", "c-kv-4")
"""The default cells: the routing grid's base cells, and one factor at a time where admission's
signals differ most (KV per engine, tenants, prompt length, GPUs); any cell of the routing grids
`default` and `report` can be named (`--cells`)."""


@dataclass(slots=True)
class CellSetup:
    cell: Cell
    count: int
    profiles: list[GpuProfile]
    tokens: list[list[int]]
    slo: Slo
    cold_prefill_s: float
    seed: int

    def workload(self, rate: float) -> Workload:
        wl = make_cell_workload(self.cell, rate=rate, count=self.count, seed=self.seed, model=MODEL)
        return with_priorities(wl, seed=self.seed)

    def run(
        self, rate: float, policy: str, admission: dict[str, Any] | None, engine_priority: bool = False
    ) -> tuple[Workload, list[RequestRecord]]:
        """`engine_priority`: the engines run vLLM's priority policy and llm-extproc writes each
        class's number into the body (`engine_priority: {}`)."""
        wl = self.workload(rate)
        requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
        service: dict[str, Any] | None = {"admission": admission} if admission else None
        if engine_priority:
            service = {**(service or {}), "engine_priority": {}}
        run = simulate(
            requests,
            self.profiles,
            policy,
            model=MODEL,
            service=service,
            tokens=self.tokens,
            headers=wl.headers,
            publish_interval_s=DEFAULT_PUBLISH_INTERVAL_S,
            scheduling_policy="priority" if engine_priority else "fcfs",
        )
        return wl, run.records


def setup(cell: Cell, *, seed: int = 0, count_scale: float = 2.0) -> CellSetup:
    """The cell's engines (KV sized as in the routing grid), its SLO and its request count (twice
    the routing grid's by default: 20 % of them are critical, and their p99 needs a few hundred)."""
    count = cell.requests(count_scale)
    probe = make_cell_workload(cell, rate=1.0, count=count, seed=seed, model=MODEL)
    tokens = tokenize_requests([(r.arrival_s, r.body, r.tag) for r in probe.requests])
    _, profiles, cold = cell_fleet(cell, probe, tokens)
    return CellSetup(cell, count, profiles, tokens, cell_slo(cold), cold, seed)


def capacity_of(cs: CellSetup, policy: str, start: float, steps: int = 6) -> float:
    """The highest rate at which `policy` (without admission) serves CAPACITY_GOOD of the requests
    within the SLO: grown by 1.5x from `start` until it fails, then bisected."""

    def good_share(rate: float) -> float:
        _, records = cs.run(rate, policy, None)
        return sum(1 for r in records if r.ok and is_good(r, cs.slo)) / len(records)

    lo, hi = 0.0, start
    while good_share(hi) >= CAPACITY_GOOD:
        lo, hi = hi, hi * 1.5
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if good_share(mid) >= CAPACITY_GOOD else (lo, mid)
    return lo


def run_cell(
    cs: CellSetup,
    *,
    loads: Sequence[float] = (0.5, 1.2, 1.6, 2.0),
    admission: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    started = time.perf_counter()
    admission = dict(admission or BENCH_ADMISSION)
    start = 2.0 * len(cs.profiles)  # requests/s; a first guess, grown or bisected from there
    capacities = {p: capacity_of(cs, p, start) for p in CAPACITY_POLICIES}
    capacity = max(capacities.values())
    each = ", ".join(f"{k} {v:.2f}" for k, v in capacities.items())
    log(f"{cs.cell.name}: capacity {capacity:.2f} req/s ({each})")
    rows: list[tuple[str, str, dict[str, Any] | None, bool]] = [(OURS, OURS, admission, False)]
    if admission.get("max_tpot_s") is None:  # the TPOT gate at the SLO's TPOT, as in the 4-A10G bench
        gated = {**admission, "max_tpot_s": cs.slo.tpot_s}
        rows.append((TPOT_GATE_ROW, OURS, gated, False))
        rows.append((ENGINE_PRIORITY_ROW, OURS, gated, True))
    rows.append((NO_ADMISSION, OURS, None, False))
    rows += [(p, p, None, False) for p in REFERENCES]
    runs: dict[str, dict[str, Any]] = {}
    for load in loads:
        per: dict[str, Any] = {}
        wl: Workload | None = None
        for name, policy, adm, engine_priority in rows:
            wl, records = cs.run(capacity * load, policy, adm, engine_priority)
            per[name] = row_stats(name, records, wl.duration_s, cs.slo, 0.1)
        assert wl is not None
        runs[f"{load:g}"] = {"rate_rps": capacity * load, "window_s": wl.duration_s, "policies": per}
    result = {
        "cell": cs.cell.name,
        "describe": cs.cell.describe().rsplit(", load", 1)[0],
        "requests": cs.count,
        "slo": {"ttft_s": cs.slo.ttft_s, "tpot_s": cs.slo.tpot_s},
        "cold_prefill_ms": cs.cold_prefill_s * 1000,
        "capacity_rps": capacity,
        "capacities": capacities,
        "admission": admission,
        "loads": runs,
        "checks": checks(runs, loads, REFERENCES),
        "checks_tpot_gate": checks(runs, loads, REFERENCES, TPOT_GATE_ROW)
        if TPOT_GATE_ROW in runs[f"{loads[0]:g}"]["policies"]
        else None,
        "checks_engine_priority": checks(runs, loads, REFERENCES, ENGINE_PRIORITY_ROW)
        if ENGINE_PRIORITY_ROW in runs[f"{loads[0]:g}"]["policies"]
        else None,
        "wall_s": time.perf_counter() - started,
    }
    log(cell_line(result))
    return result


def cell_line(result: dict[str, Any]) -> str:
    ch = result["checks"]
    ratio = ch["critical_ttft_p99_ratio"]
    steady = ch["critical_ttft_steady_ratio"]
    high = result["loads"]["1.2"]["policies"]
    gated = result.get("checks_tpot_gate")
    gate = f"+ TPOT gate {gated['goodput_rps']:.2f}; " if gated else ""
    prio = result.get("checks_engine_priority")
    if prio:
        x = prio["critical_ttft_p99_ratio"]
        gate += f"+ engine priority {prio['goodput_rps']:.2f}, critical p99 x{x or float('nan'):.2f}; "
    return (
        f"  {result['cell']}: at 120 % goodput {ch['goodput_rps']:.2f}/s ({gate}no admission "
        f"{high[NO_ADMISSION]['goodput_rps']:.2f}; best peer {ch['best_peer']} "
        f"{ch['best_peer_goodput_rps']:.2f}), "
        f"critical p99 x{ratio if ratio is not None else float('nan'):.2f} "
        f"(after warm-up x{steady if steady is not None else float('nan'):.2f}), shed "
        f"{ch['critical_shed']}/{ch['standard_shed']}/{ch['sheddable_shed']} ({result['wall_s']:.0f} s)"
    )


def markdown(results: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Priorities across fleets and workloads (discrete-event mode)",
        "",
        f"Seed {meta['seed']}; admission {meta['admission']}; capacity = the best router's rate with 95 % "
        "of requests within the SLO; checks at 120 % of it (issue 11).",
        "",
    ]
    for row, key in (
        (OURS, "checks"),
        (TPOT_GATE_ROW, "checks_tpot_gate"),
        (ENGINE_PRIORITY_ROW, "checks_engine_priority"),
    ):
        if any(r.get(key) for r in results):
            lines += [f"## {row}", "", *_summary(results, row, key), ""]
    for r in results:
        lines += [f"## {r['cell']}: {r['describe']}", ""]
        for load, run in r["loads"].items():
            lines += [f"### {float(load):.0%} load ({run['rate_rps']:.2f} req/s)", ""]
            lines += policy_table(run["policies"])
            lines.append("")
    return "\n".join(lines)


def _summary(results: Sequence[dict[str, Any]], row: str, key: str) -> list[str]:
    """One line per cell: `row`'s checks (`key`) and goodput beside no admission and the best peer."""
    lines = [
        f"| cell | capacity req/s | goodput at 120 %: {row} / no admission / best peer | at 160 % | "
        "at 200 % | critical p99 x (whole run / after warm-up) | shed critical / standard / sheddable | "
        "sheddable first | goodput >= peers | goodput holds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ch = r.get(key)
        if not ch:
            continue
        at = {k: v["policies"] for k, v in r["loads"].items()}
        deeper = []
        for load in ("1.6", "2"):
            deep = at.get(load)
            if deep is None:
                deeper.append("-")
                continue
            best = max((deep[p]["goodput_rps"], p) for p in REFERENCES if p != "exact-ttft")
            deeper.append(
                f"{deep[row]['goodput_rps']:.2f} / {deep[NO_ADMISSION]['goodput_rps']:.2f} / {best[0]:.2f}"
            )
        hold = ch.get("goodput_hold") or {}
        ratio = ch["critical_ttft_p99_ratio"]
        steady = ch["critical_ttft_steady_ratio"]
        lines.append(
            f"| {r['cell']} ({r['describe']}) | {r['capacity_rps']:.2f} | {ch['goodput_rps']:.2f} / "
            f"{at['1.2'][NO_ADMISSION]['goodput_rps']:.2f} / {ch['best_peer_goodput_rps']:.2f} "
            f"({ch['best_peer']}) | "
            f"{deeper[0]} | {deeper[1]} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} / {'-' if steady is None else f'{steady:.2f}'} | "
            f"{ch['critical_shed']} / {ch['standard_shed']} / {ch['sheddable_shed']} | "
            f"{'yes' if ch['sheddable_shed_first'] else 'NO'} | "
            f"{'yes' if ch['goodput_ok_peers'] else 'NO'} | {_held(hold)} |"
        )
    return lines


def _held(hold: dict[str, Any]) -> str:
    """The goodput past capacity over its best so far, per load (bench.priorities.goodput_hold)."""
    held = hold.get("held") or {}
    if not held:
        return "-"
    shares = ", ".join(f"{v:.2f}" if v is not None else "-" for v in held.values())
    return f"{'yes' if hold.get('holds') else 'NO'} ({shares})"


def run_grid(
    cells: Sequence[str] = CELLS,
    *,
    seed: int = 0,
    count_scale: float = 2.0,
    loads: Sequence[float] = (0.5, 1.2, 1.6, 2.0),
    admission: dict[str, Any] | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    unknown = [name for name in cells if name not in _KNOWN]
    if unknown:
        raise ValueError(f"unknown cells {unknown}; choose from the grids default and report")
    chosen = [grid(_KNOWN[name], [name])[0] for name in cells]
    results = [
        run_cell(setup(c, seed=seed, count_scale=count_scale), loads=loads, admission=admission, log=log)
        for c in chosen
    ]
    if out_dir is not None:
        meta = {"seed": seed, "count_scale": count_scale, "admission": admission or BENCH_ADMISSION}
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "priorities-grid.json").write_text(
            json.dumps({"meta": meta, "cells": results}, indent=2, sort_keys=True)
        )
        (out_dir / "priorities-grid.md").write_text(markdown(results, meta))
    return results


_KNOWN = {c.name: g for g in ("report", "default") for c in grid(g)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extproc_lab.discrete_event.priorities_grid", description=__doc__
    )
    ap.add_argument("--cells", default=",".join(CELLS), help="cells of the routing grids (default, report)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count-scale", type=float, default=2.0, help="x the routing grid's request count")
    ap.add_argument("--loads", default="0.5,1.2,1.6,2")
    ap.add_argument("--out", default="out/priorities-grid")
    args = ap.parse_args(argv)
    results = run_grid(
        [c for c in args.cells.split(",") if c],
        seed=args.seed,
        count_scale=args.count_scale,
        loads=tuple(float(x) for x in args.loads.split(",")),
        out_dir=Path(args.out),
    )
    print(f"{len(results)} cells: {Path(args.out) / 'priorities-grid.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
