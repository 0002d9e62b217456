"""Priorities and SLOs at overload, in the discrete-event mode (issue 11's target).

    python -m extproc_lab.discrete_event.priorities [--engines 4] [--count 3000] [--out out/priorities]

A Poisson workload (shared-prefix by default) whose requests each carry a priority class (20 %
critical, 50 % standard, 30 % sheddable; `workloads.with_priorities`) is run at 50, 100, 120, 160 and
200 % of the fleet's capacity against every reference policy and against llm-extproc with admission on (the
service's own `Admission`: shed sheddable at saturation, queue standard fairly, admit critical); the
same with the `decode-speed` scorer in its profile ("llm-extproc (+ decode-speed)") and with the TPOT
gate (`max_tpot_s`, "llm-extproc (+ TPOT gate)"), both at the SLO's TPOT; the gate row again on
engines that run vLLM's priority policy, each request's class written into its body
(`engine_priority: {}`, "llm-extproc (+ TPOT gate + engine priority)"; every other row's engines
serve first come, first served); with every request
carrying the SLO's TPOT as its own objective (`x-llm-tpot-slo-ms`, the default profile: "llm-extproc
(TPOT objective per request)"); and, for contrast, with admission off. Capacity is measured first,
under the SLO: the highest arrival rate at which exact-ttft (greedy least TTFT from the engines'
exact state) still serves 95 % of the requests within the SLO (bisection). Writes `priorities.json`
and `priorities.md`.

The checks (printed and in the JSON) are `extproc_lab.bench.priorities`'s (at 120 %, then at each load
from 100 %, and whether goodput holds at 160 and 200 %), for llm-extproc
with admission (and the same for the decode-speed row, `checks_decode_speed`, and the objective
row, `checks_tpot_objective`, whose requests of every class may be shed for the objective they
carry). TTFT counts the time a request waited in the admission queue. Goodput is good requests
(TTFT and TPOT within the SLO) per second of the arrival window, the same denominator for every
policy. The same bench through real processes: `extproc_lab.bench.priorities_live`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.settings import DEFAULT_PROFILE, DEFAULT_PUBLISH_INTERVAL_S
from extproc_lab.bench.priorities import (
    BENCH_ADMISSION,
    DECODE_SPEED_ROW,
    ENGINE_PRIORITY_ROW,
    TPOT_GATE_ROW,
    TPOT_OBJECTIVE_ROW,
    checks,
    is_good,
    markdown,
    priorities_workload,
    row_line,
    row_stats,
)
from extproc_lab.bench.report import RequestRecord, Slo
from extproc_lab.bench.workloads import Workload
from extproc_lab.discrete_event.simulation import POLICIES, SEEDED_PICKER, simulate, tokenize_requests
from extproc_lab.engines.profiles import PROFILES

REFERENCES = tuple(p for p in POLICIES if p != "llm-extproc")
# against predicted-ttft's 1.0: notebook/benchmarks-history.md, "Decode speed in placement"
DECODE_SPEED_WEIGHT = 0.6


def decode_speed_profile(tpot_objective_s: float) -> dict[str, Any]:
    """The default profile with the `decode-speed` scorer given a fleet-wide objective (the default
    profile's own acts only on requests that carry one)."""
    scorer = {
        "name": "decode-speed",
        "weight": DECODE_SPEED_WEIGHT,
        "params": {"tpot_objective_s": tpot_objective_s},
    }
    others = [s for s in DEFAULT_PROFILE["scorers"] if s["name"] != "decode-speed"]
    return {**DEFAULT_PROFILE, "scorers": [*others, scorer], "picker": SEEDED_PICKER}


@dataclass(slots=True)
class BenchConfig:
    engines: int = 4
    profile: str = "a10g-llama3-8b"
    workload: str = "shared-prefix"
    workload_params: dict[str, Any] = field(default_factory=lambda: {"tenants": 16})
    count: int = 3000
    seed: int = 0
    loads: tuple[float, ...] = (0.5, 1.0, 1.2, 1.6, 2.0)
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))
    admission: dict[str, Any] = field(default_factory=lambda: dict(BENCH_ADMISSION))
    references: tuple[str, ...] = REFERENCES
    publish_interval_s: float = DEFAULT_PUBLISH_INTERVAL_S
    # The share of requests (in arrival order: the same ones at every load) left out of the
    # "after warm-up" figures: the fleet starts with every cache empty, and a tenant's first request
    # is a cold prefill that its next requests wait for, however they are routed.
    warmup: float = 0.1


def _workload(cfg: BenchConfig, rate: float) -> Workload:
    return priorities_workload(cfg.workload, cfg.workload_params, rate=rate, count=cfg.count, seed=cfg.seed)


def _run(
    cfg: BenchConfig,
    wl: Workload,
    policy: str,
    admission: bool | dict[str, Any],
    profile: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    engine_priority: bool = False,
) -> list[RequestRecord]:
    """`admission`: True for the bench's, a dict for another (llm-extproc only), False for none;
    `profile`: llm-extproc's scheduling profile instead of the default one; `headers`: added to
    every request's own; `engine_priority`: the engines run vLLM's priority policy and llm-extproc
    writes each class's number into the body (`engine_priority: {}`)."""
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    fleet = [PROFILES[cfg.profile]] * cfg.engines
    service: dict[str, Any] | None = None
    if admission:
        service = {"admission": cfg.admission if admission is True else admission}
    if profile is not None:
        service = {**(service or {}), "scheduling": {"profiles": {"default": profile}}}
    if engine_priority:
        service = {**(service or {}), "engine_priority": {}}
    run = simulate(
        requests,
        fleet,
        policy,
        service=service,
        tokens=tokenize_requests(requests),
        headers=wl.headers if not headers else [{**(h or {}), **headers} for h in wl.headers],
        publish_interval_s=cfg.publish_interval_s,
        scheduling_policy="priority" if engine_priority else "fcfs",
    )
    return run.records


def saturated_throughput(cfg: BenchConfig) -> float:
    """Requests per second the fleet completes with arrivals far faster than it can serve (the
    capacity policy): an upper bound for the capacity search."""
    wl = _workload(cfg, 50.0 * cfg.engines)
    records = _run(cfg, wl, CAPACITY_POLICY, admission=False)
    ok = [r for r in records if r.ok]
    return len(ok) / max(r.arrival_s + r.e2e_s for r in ok)


def calibrate(cfg: BenchConfig, steps: int = 6, count: int = 800) -> float:
    """The fleet's capacity under the SLO: the highest arrival rate (bisection, `count` requests a
    run) at which `CAPACITY_POLICY` (greedy least TTFT from the engines' exact state, a router that
    does not depend on ours) still serves `CAPACITY_GOOD` of the requests within the SLO. 100 %
    load; above it, requests must be turned away or served late."""
    small = BenchConfig(**{**_fields(cfg), "count": count})
    lo, hi = 0.0, saturated_throughput(small)
    for _ in range(steps):
        mid = (lo + hi) / 2
        wl = _workload(small, mid)
        records = _run(small, wl, CAPACITY_POLICY, admission=False)
        good = sum(1 for r in records if r.ok and is_good(r, cfg.slo)) / len(records)
        lo, hi = (mid, hi) if good >= CAPACITY_GOOD else (lo, mid)
    return lo


CAPACITY_GOOD = 0.95
CAPACITY_POLICY = "exact-ttft"


def _fields(cfg: BenchConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def run_bench(
    cfg: BenchConfig, out_dir: Path | None = None, log: Any = print, capacity: float | None = None
) -> dict[str, Any]:
    """`capacity`: the fleet's capacity in requests/s, to compare seeds at one rate (default: measured)."""
    if capacity is None:
        capacity = calibrate(cfg)
    log(f"fleet capacity: {capacity:.2f} requests/s ({cfg.engines} x {cfg.profile}, {cfg.workload})")
    runs: dict[str, dict[str, Any]] = {}
    # Admission as configured; the same with the `decode-speed` scorer beside predicted-ttft, and
    # with the TPOT gate instead (both at the SLO's TPOT: the scorer keeps one engine from decoding
    # slower than the SLO at 120 %, the gate sheds at 160 %); the SLO's TPOT as every request's own
    # objective (the default profile: `decode-speed` steers it, `slo-tpot` sheds it); none.
    # The gate row again on engines that schedule by priority (`engine_priority: {}`).
    Row = tuple[str, str, bool | dict[str, Any], dict[str, Any] | None, dict[str, str] | None, bool]
    policies: list[Row] = [("llm-extproc", "llm-extproc", True, None, None, False)]
    speed = decode_speed_profile(cfg.slo.tpot_s)
    policies.append((DECODE_SPEED_ROW, "llm-extproc", True, speed, None, False))
    if cfg.admission.get("max_tpot_s") is None:
        gated = {**cfg.admission, "max_tpot_s": cfg.slo.tpot_s}
        policies.append((TPOT_GATE_ROW, "llm-extproc", gated, None, None, False))
        policies.append((ENGINE_PRIORITY_ROW, "llm-extproc", gated, None, None, True))
    objective = {"x-llm-tpot-slo-ms": f"{cfg.slo.tpot_s * 1000:g}"}
    policies.append((TPOT_OBJECTIVE_ROW, "llm-extproc", True, None, objective, False))
    policies.append(("llm-extproc (no admission)", "llm-extproc", False, None, None, False))
    policies += [(p, p, False, None, None, False) for p in cfg.references]
    for load in cfg.loads:
        rate = capacity * load
        wl = _workload(cfg, rate)
        window = wl.duration_s
        per_load: dict[str, Any] = {}
        for name, policy, admission, profile, headers, engine_priority in policies:
            records = _run(cfg, wl, policy, admission, profile, headers, engine_priority)
            per_load[name] = row_stats(name, records, window, cfg.slo, cfg.warmup)
            log(row_line(load, name, per_load[name]))
        runs[f"{load:g}"] = {"rate_rps": rate, "window_s": window, "policies": per_load}
    result = {
        "config": {
            "engines": cfg.engines,
            "profile": cfg.profile,
            "workload": cfg.workload,
            "workload_params": cfg.workload_params,
            "count": cfg.count,
            "seed": cfg.seed,
            "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
            "admission": cfg.admission,
            "publish_interval_s": cfg.publish_interval_s,
            "warmup": cfg.warmup,
            "mode": "discrete-event mode, virtual time",
        },
        "capacity_rps": capacity,
        "loads": runs,
        "capacity_source": "the highest rate at which exact-ttft serves 95 % within the SLO",
        "checks": checks(runs, cfg.loads, cfg.references),
        # The same for the profile with `decode-speed` (the SLO's TPOT as its objective).
        "checks_decode_speed": checks(runs, cfg.loads, cfg.references, DECODE_SPEED_ROW),
        # And with the SLO's TPOT as every request's own objective.
        "checks_tpot_objective": checks(runs, cfg.loads, cfg.references, TPOT_OBJECTIVE_ROW),
        # And the TPOT gate on engines that schedule by the class written into each body.
        "checks_engine_priority": checks(runs, cfg.loads, cfg.references, ENGINE_PRIORITY_ROW)
        if cfg.admission.get("max_tpot_s") is None
        else None,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "priorities.json").write_text(json.dumps(result, indent=2, sort_keys=True))
        (out_dir / "priorities.md").write_text(markdown(result))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc_lab.discrete_event.priorities", description=__doc__)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--profile", default="a10g-llama3-8b", choices=sorted(PROFILES))
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1,1.2,1.6,2", help="comma-separated fractions of capacity")
    ap.add_argument("--references", default=",".join(REFERENCES))
    ap.add_argument(
        "--capacity", type=float, default=None, help="requests/s taken as 100 %% load instead of measuring it"
    )
    ap.add_argument(
        "--warmup", type=float, default=0.1, help="share of requests left out of the after-warm-up p99"
    )
    ap.add_argument("--out", default="out/priorities")
    args = ap.parse_args(argv)
    cfg = BenchConfig(
        engines=args.engines,
        profile=args.profile,
        count=args.count,
        seed=args.seed,
        loads=tuple(float(x) for x in args.loads.split(",")),
        references=tuple(p for p in args.references.split(",") if p),
        warmup=args.warmup,
    )
    result = run_bench(cfg, Path(args.out), capacity=args.capacity)
    print(markdown(result))
    print(f"results: {Path(args.out) / 'priorities.json'}")
    ch = result["checks"]
    ok = ch["critical_ttft_ok"] and ch["sheddable_shed_first"] and ch["no_critical_shed"] and ch["goodput_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
