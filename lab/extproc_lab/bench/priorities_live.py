"""The priorities bench live: mixed priority classes at 50, 120, 160 and 200 % of capacity through real
processes on loopback (issue 11's target; the discrete-event run is
`extproc_lab.discrete_event.priorities`).

    python -m extproc_lab.bench.priorities_live [--count 1000] [--time-scale 1] [--out out/priorities-live]

The same workload as the discrete-event bench (shared-prefix, 16 tenants; 20 % critical, 50 %
standard, 30 % sheddable as `x-llm-priority`, the tenant as `x-user-id`), sent open loop to each
policy on a fresh fleet of four model-driven simulated A10G engines (cold caches): `llm-extproc`
(Envoy + the service + Redis + the publisher, the bench's admission), the same with admission's TPOT
gate at the SLO's TPOT (`max_tpot_s`), the gate again on engines running vLLM's priority policy
with each request's class written into its body by the service (`engine_priority: {}`), the
bench's admission with every request carrying the SLO's TPOT as `x-llm-tpot-slo-ms`, Envoy's own
`round_robin` and `least_request`, and sglang-router `cache_aware` when installed (reported as
skipped when not). Policies run one after another, each on its own fleet.

With `time_scale` above 1, time runs that many times faster than the engines' virtual time and
latencies are converted back (as in the live grid), so figures compare with the discrete-event
bench's; every time the service is given (the admission's waits, the TPOT objective) is divided by
`time_scale`, since the service and the engines' own figures run on real time. The default is 1:
at overload a few hundred streams are open at once, and on a 2-core machine the simulated engines,
Envoy and the load generator then compete for the CPU, which stretches token gaps: llm-extproc's
goodput at 160 % was 0.80 and 1.25/s in two runs at time scale 2 and 5.95/s at 1 (docs/
benchmarks.md, "Live, through real processes"). Capacity is not measured live: it is the
discrete-event bench's (`--capacity`, default 9.43 req/s, exact-ttft's under the SLO on these
engines). Writes `priorities-live.json` and `priorities-live.md`; the checks are the
discrete-event bench's (`extproc_lab.bench.priorities`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.settings import AdmissionSettings
from extproc_lab.bench.priorities import (
    BENCH_ADMISSION,
    ENGINE_PRIORITY_ROW,
    TPOT_GATE_ROW,
    TPOT_OBJECTIVE_ROW,
    checks,
    markdown,
    priorities_workload,
    row_line,
    row_stats,
)
from extproc_lab.bench.report import Slo
from extproc_lab.bench.scenarios import peer_missing, run_live_requests
from extproc_lab.engines.profiles import PROFILES

# Row name -> the live policy that runs it (llm-extproc rows differ in what the requests carry).
ROWS = {
    "llm-extproc": "llm-extproc",
    TPOT_GATE_ROW: "llm-extproc",
    ENGINE_PRIORITY_ROW: "llm-extproc",
    TPOT_OBJECTIVE_ROW: "llm-extproc",
    "round-robin": "envoy-round-robin",
    "least-request": "envoy-least-request",
    "sglang-cache-aware": "sglang-cache-aware",
}
REFERENCES = ("round-robin", "least-request", "sglang-cache-aware")
WORKLOAD, WORKLOAD_PARAMS = "shared-prefix", {"tenants": 16}  # the discrete-event bench's default
DES_CAPACITY_RPS = 9.43  # docs/benchmarks.md, "Priorities and SLOs": seeds 1-7 at this rate


@dataclass(slots=True)
class LiveConfig:
    engines: int = 4
    profile: str = "a10g-llama3-8b"
    count: int = 1000
    seed: int = 0
    loads: tuple[float, ...] = (0.5, 1.2, 1.6, 2.0)
    rows: tuple[str, ...] = tuple(ROWS)
    capacity_rps: float = DES_CAPACITY_RPS
    time_scale: float = 1.0
    warmup: float = 0.1
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))


def service_admission(time_scale: float, max_tpot_s: float | None = None) -> dict[str, Any]:
    """The bench's admission with its times in real seconds; with `max_tpot_s` (virtual), the TPOT
    gate."""
    defaults = AdmissionSettings()
    wait = defaults.overload_wait_s
    admission = {
        **BENCH_ADMISSION,
        "max_predicted_wait_s": BENCH_ADMISSION["max_predicted_wait_s"] / time_scale,
        "max_wait_s": BENCH_ADMISSION["max_wait_s"] / time_scale,
        "overload_after_s": defaults.overload_after_s / time_scale,
        "overload_wait_s": None if wait is None else wait / time_scale,
    }
    if max_tpot_s is not None:
        admission["max_tpot_s"] = max_tpot_s / time_scale
    return admission


async def run_live(cfg: LiveConfig, out_dir: Path, progress: Any = print) -> dict[str, Any]:
    """Every row at every load, one after another; results JSON (+ markdown with the checks)."""
    unknown = [r for r in cfg.rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    profiles = [PROFILES[cfg.profile]] * cfg.engines
    service = {"admission": service_admission(cfg.time_scale)}
    gated = {"admission": service_admission(cfg.time_scale, cfg.slo.tpot_s)}
    service_of = {
        "llm-extproc": service,
        TPOT_GATE_ROW: gated,
        ENGINE_PRIORITY_ROW: {**gated, "engine_priority": {}},
        TPOT_OBJECTIVE_ROW: service,
    }
    objective_ms = cfg.slo.tpot_s * 1000.0 / cfg.time_scale
    runs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    started = time.perf_counter()
    for load in cfg.loads:
        rate = cfg.capacity_rps * load
        wl = priorities_workload(WORKLOAD, WORKLOAD_PARAMS, rate=rate, count=cfg.count, seed=cfg.seed)
        requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
        per_load: dict[str, Any] = {}
        for row in cfg.rows:
            policy = ROWS[row]
            why = peer_missing(policy)
            if why is not None:
                skipped[row] = why
                continue
            headers = wl.headers
            if row == TPOT_OBJECTIVE_ROW:
                headers = [{**h, "x-llm-tpot-slo-ms": f"{objective_ms:g}"} for h in headers]
            ran = await run_live_requests(
                policy,
                requests,
                profiles,
                time_scale=cfg.time_scale,
                workdir=out_dir / "logs" / f"{load:g}" / policy,
                service_extra=service_of.get(row),
                headers=list(headers),
                scheduling_policy="priority" if row == ENGINE_PRIORITY_ROW else "fcfs",
            )
            if ran is None:
                skipped[row] = "could not start"
                continue
            records, _ = ran
            per_load[row] = row_stats(row, records, wl.duration_s, cfg.slo, cfg.warmup)
            progress(row_line(load, row, per_load[row]))
        runs[f"{load:g}"] = {"rate_rps": rate, "window_s": wl.duration_s, "policies": per_load}
    references = [r for r in REFERENCES if r in cfg.rows and r not in skipped]
    result: dict[str, Any] = {
        "config": {
            "engines": cfg.engines,
            "profile": cfg.profile,
            "workload": WORKLOAD,
            "workload_params": WORKLOAD_PARAMS,
            "count": cfg.count,
            "seed": cfg.seed,
            "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
            "admission": BENCH_ADMISSION,
            "admission_real_seconds": service["admission"],
            "warmup": cfg.warmup,
            "time_scale": cfg.time_scale,
            "mode": f"live: Envoy, the service, Redis, simulated engines; time scale {cfg.time_scale:g}",
        },
        "capacity_rps": cfg.capacity_rps,
        "capacity_source": "the discrete-event bench's: exact-ttft's under the SLO",
        "loads": runs,
        "skipped": skipped,
        "wall_s": time.perf_counter() - started,
    }
    if "llm-extproc" in cfg.rows and len(cfg.loads) > 1:
        result["checks"] = checks(runs, cfg.loads, references)
        if TPOT_OBJECTIVE_ROW in cfg.rows:
            result["checks_tpot_objective"] = checks(runs, cfg.loads, references, TPOT_OBJECTIVE_ROW)
        if TPOT_GATE_ROW in cfg.rows:
            result["checks_tpot_gate"] = checks(runs, cfg.loads, references, TPOT_GATE_ROW)
        if ENGINE_PRIORITY_ROW in cfg.rows:
            result["checks_engine_priority"] = checks(runs, cfg.loads, references, ENGINE_PRIORITY_ROW)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "priorities-live.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    if "checks" in result:
        text = markdown(result)
        if skipped:
            text += "\n" + "\n".join(f"- skipped {k}: {v}" for k, v in skipped.items()) + "\n"
        (out_dir / "priorities-live.md").write_text(text)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc_lab.bench.priorities_live", description=__doc__)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1.2,1.6,2", help="comma-separated fractions of capacity")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (policies) to run")
    ap.add_argument("--capacity", type=float, default=DES_CAPACITY_RPS, help="requests/s taken as 100 %%")
    ap.add_argument("--time-scale", type=float, default=1.0, help="above 1: faster than real time")
    ap.add_argument("--out", default="out/priorities-live")
    args = ap.parse_args(argv)
    cfg = LiveConfig(
        count=args.count,
        seed=args.seed,
        loads=tuple(float(x) for x in args.loads.split(",")),
        rows=tuple(r for r in args.rows.split(",") if r),
        capacity_rps=args.capacity,
        time_scale=args.time_scale,
    )
    out = Path(args.out)
    result = asyncio.run(run_live(cfg, out))
    if "checks" in result:
        print((out / "priorities-live.md").read_text())
    print(f"results: {out / 'priorities-live.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
