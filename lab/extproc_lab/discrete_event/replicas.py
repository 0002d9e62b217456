"""Replicas bench: one llm-extproc process vs N behind one Envoy, sharing decisions (server/sync.py)
or each learning alone. The target (issue 10): N shared replicas within 10 % of one replica's TTFT p90
and prefix hit rate on the shared-prefix and multi-turn workloads.

    python -m extproc_lab.discrete_event.replicas                 # discrete-event mode, ~1 min
    python -m extproc_lab.discrete_event.replicas --live          # also live: Envoy + N `serve`s

Discrete-event mode: the service's own code in virtual time; N `RequestLifecycle`s (each its own
profile, view and counts) take the requests in turn (round robin, as Envoy spreads ext_proc streams),
exchanging the real sync messages every `sync.interval_s` (20 ms), each delivered `--sync-delay-ms`
later. Live: `LocalGateway(replicas=N)` (real Envoy, N real `serve` processes, real Redis and
publisher) over simulated engines running `--time-scale` times faster than the modelled GPU.
Results: `<out>/replicas.json` and `<out>/replicas.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc_lab.bench.report import Report, summarize
from extproc_lab.bench.workloads import make_workload
from extproc_lab.discrete_event.simulation import simulate, tokenize_requests
from extproc_lab.engines.profiles import PROFILES

TOLERANCE = 0.10  # the target: within 10 % of one replica


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    workload: str
    rate: float
    count: int
    params: dict[str, Any]


# 6 A10G engines, as in the measurement: 16 tenants with 2k-token system prompts; 40 growing
# chats (10 turns each, histories to ~3.6k tokens). Rates load the fleet without saturating it.
SCENARIOS = (
    Scenario("tenants", "shared-prefix", 24.0, 1500, {"tenants": 16}),
    Scenario("chats", "multi-turn", 6.0, 1200, {"conversations": 40}),
)


@dataclass(slots=True)
class Row:
    mode: str  # des | live
    scenario: str
    setup: str  # "1 replica", "N shared", "N alone"
    report: Report
    wall_s: float
    agreement: dict[str, dict[str, float]] | None = None  # live, N replicas: per plugin (agreement_summary)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scenario": self.scenario,
            "setup": self.setup,
            "wall_s": self.wall_s,
            "report": self.report.as_dict(),
            "agreement": self.agreement,
        }


AGREEMENT_WARMUP_S = 10.0  # live samples before this (seconds into the run) are left out


def agreement_summary(samples: Sequence[tuple[float, int, str, float]]) -> dict[str, dict[str, float]] | None:
    """Per plugin: mean, min and count of the replicas' `llm_extproc_sync_agreement` samples taken
    after the first AGREEMENT_WARMUP_S (the indexes start empty and identical, then fill)."""
    by_plugin: dict[str, list[float]] = {}
    for t, _, plugin, value in samples:
        if t >= AGREEMENT_WARMUP_S:
            by_plugin.setdefault(plugin, []).append(value)
    if not by_plugin:
        return None
    return {
        p: {"mean": sum(v) / len(v), "min": min(v), "samples": float(len(v))}
        for p, v in sorted(by_plugin.items())
    }


def setups(replicas: int) -> list[tuple[str, int, bool]]:
    return [
        ("1 replica", 1, True),
        (f"{replicas} shared", replicas, True),
        (f"{replicas} alone", replicas, False),
    ]


def run_des(
    scenarios: Sequence[Scenario],
    *,
    engines: int,
    replicas: int,
    profile: str,
    sync_delay_s: float,
    seed: int,
) -> list[Row]:
    rows: list[Row] = []
    fleet = [PROFILES[profile]] * engines
    for sc in scenarios:
        wl = make_workload(sc.workload, rate=sc.rate, count=sc.count, seed=seed, **sc.params)
        requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
        tokens = tokenize_requests(requests)
        for label, n, share in setups(replicas):
            started = time.perf_counter()
            run = simulate(
                requests,
                fleet,
                "llm-extproc",
                tokens=tokens,
                replicas=n,
                share=share,
                sync_delay_s=sync_delay_s,
            )
            report = summarize(
                label, run.records, run.virtual_s, instances=[f"engine-{i}" for i in range(engines)]
            )
            rows.append(Row("des", sc.name, label, report, time.perf_counter() - started))
            print(f"  des {sc.name:8} {label:10} {_brief(report)}", flush=True)
    return rows


async def run_live(
    scenarios: Sequence[Scenario],
    *,
    engines: int,
    replicas: int,
    profile: str,
    time_scale: float,
    count_scale: float,
    seed: int,
    out: Path,
) -> list[Row]:
    from extproc_lab.bench import scenarios as live

    rows: list[Row] = []
    gpu = [PROFILES[profile]] * engines
    for sc in scenarios:
        count = max(20, int(sc.count * count_scale))
        wl = make_workload(sc.workload, rate=sc.rate, count=count, seed=seed, model=live.MODEL, **sc.params)
        requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
        for label, n, share in setups(replicas):
            started = time.perf_counter()
            samples: list[tuple[float, int, str, float]] = []
            result = await live.run_live_requests(
                "llm-extproc",
                requests,
                gpu,
                time_scale=time_scale,
                workdir=out / "live" / sc.name / label.replace(" ", "-"),
                replicas=n,
                service_extra=_live_service(share),
                agreement=samples,
            )
            assert result is not None
            records, virtual_s = result
            report = summarize(label, records, virtual_s)
            agree = agreement_summary(samples) if share and n > 1 else None
            rows.append(Row("live", sc.name, label, report, time.perf_counter() - started, agree))
            print(f"  live {sc.name:8} {label:10} {_brief(report)}{_agreement(agree)}", flush=True)
    return rows


def _live_service(share: bool) -> dict[str, Any]:
    """Sync on or off; admission off where the service has it: this compares placement, with every
    request served (as the discrete-event mode does), not shedding under the host's CPU contention."""
    from extproc.config import ServiceConfig

    extra: dict[str, Any] = {"sync": {"enabled": share}}
    if "admission" in ServiceConfig.__dataclass_fields__:
        extra["admission"] = {"enabled": False}
    return extra


def _brief(r: Report) -> str:
    return (
        f"hit {_f(r.prefix_cache_hit_rate, 3)}  TTFT p50 {_f(r.ttft_p50_ms, 0)} p90 {_f(r.ttft_p90_ms, 0)} "
        f"p99 {_f(r.ttft_p99_ms, 0)} ms  errors {r.errors}"
    )


def _agreement(summary: dict[str, dict[str, float]] | None) -> str:
    if not summary:
        return ""
    return "  agreement " + ", ".join(
        f"{p} mean {s['mean']:.3f} min {s['min']:.3f} ({s['samples']:.0f})" for p, s in summary.items()
    )


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def verdicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per mode and scenario: each N-replica setup against one replica (p90 TTFT and hit rate)."""
    out: list[dict[str, Any]] = []
    keys = sorted({(r.mode, r.scenario) for r in rows})
    for mode, scenario in keys:
        group = [r for r in rows if r.mode == mode and r.scenario == scenario]
        base = next((r for r in group if r.setup == "1 replica"), None)
        if base is None:
            continue
        for r in group:
            if r is base:
                continue
            p90 = _ratio(r.report.ttft_p90_ms, base.report.ttft_p90_ms)
            hit = _ratio(r.report.prefix_cache_hit_rate, base.report.prefix_cache_hit_rate)
            ok = p90 is not None and hit is not None and p90 <= 1 + TOLERANCE and hit >= 1 - TOLERANCE
            out.append(
                {
                    "mode": mode,
                    "scenario": scenario,
                    "setup": r.setup,
                    "p90_ratio": p90,
                    "hit_ratio": hit,
                    "within_10pct": ok,
                }
            )
    return out


def _agreement_cell(summary: dict[str, dict[str, float]] | None) -> str:
    if not summary:
        return "-"
    return "; ".join(f"{p} {s['mean']:.3f} / {s['min']:.3f}" for p, s in summary.items())


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def markdown(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    lines = [
        f"Replicas bench ({meta['engines']} x {meta['profile']}, {meta['replicas']} replicas; "
        f"command: `{meta['command']}`)",
        "",
        "| mode | scenario | setup | prefix hit | TTFT p50 ms | p90 ms | p99 ms | errors "
        "| p90 / 1 replica | hit / 1 replica | replicas' index agreement, mean / min (live) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {(v["mode"], v["scenario"], v["setup"]): v for v in verdicts(rows)}
    for r in rows:
        v = ratios.get((r.mode, r.scenario, r.setup))
        rep = r.report
        lines.append(
            f"| {r.mode} | {r.scenario} | {r.setup} | {_f(rep.prefix_cache_hit_rate, 3)} "
            f"| {_f(rep.ttft_p50_ms, 0)} "
            f"| {_f(rep.ttft_p90_ms, 0)} | {_f(rep.ttft_p99_ms, 0)} | {rep.errors} "
            f"| {_f(v['p90_ratio'], 2) if v else '-'} | {_f(v['hit_ratio'], 2) if v else '-'} "
            f"| {_agreement_cell(r.agreement)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extproc_lab.discrete_event.replicas", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--engines", type=int, default=6)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--profile", default="a10g-llama3-8b", choices=sorted(PROFILES))
    ap.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS))
    ap.add_argument("--count-scale", type=float, default=1.0, help="x each scenario's request count")
    ap.add_argument("--sync-delay-ms", type=float, default=2.0, help="delivery delay of a sync message")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live", action="store_true", help="also run the live bench (Envoy, N serve processes)")
    ap.add_argument("--live-only", action="store_true")
    ap.add_argument("--live-count-scale", type=float, default=0.2, help="x the request count, live")
    ap.add_argument("--time-scale", type=float, default=1.0, help="live engines run this much faster")
    ap.add_argument("--out", type=Path, default=Path("out/replicas"))
    args = ap.parse_args(argv)
    wanted = set(args.scenarios.split(","))
    chosen = [
        Scenario(s.name, s.workload, s.rate, max(20, int(s.count * args.count_scale)), s.params)
        for s in SCENARIOS
        if s.name in wanted
    ]
    rows: list[Row] = []
    if not args.live_only:
        rows += run_des(
            chosen,
            engines=args.engines,
            replicas=args.replicas,
            profile=args.profile,
            sync_delay_s=args.sync_delay_ms / 1000,
            seed=args.seed,
        )
    if args.live or args.live_only:
        rows += asyncio.run(
            run_live(
                chosen,
                engines=args.engines,
                replicas=args.replicas,
                profile=args.profile,
                time_scale=args.time_scale,
                count_scale=args.live_count_scale,
                seed=args.seed,
                out=args.out,
            )
        )
    import sys

    meta = {
        "engines": args.engines,
        "replicas": args.replicas,
        "profile": args.profile,
        "scenarios": [
            {"name": s.name, "workload": s.workload, "rate": s.rate, "count": s.count, **s.params}
            for s in chosen
        ],
        "sync_delay_ms": args.sync_delay_ms,
        "time_scale": args.time_scale,
        "live_count_scale": args.live_count_scale,
        "command": "python -m extproc_lab.discrete_event.replicas "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": [r.as_dict() for r in rows], "verdicts": verdicts(rows)}
    (args.out / "replicas.json").write_text(json.dumps(result, indent=2))
    table = markdown(rows, meta)
    (args.out / "replicas.md").write_text(table)
    print(table)
    print(f"results: {args.out}/replicas.json, {args.out}/replicas.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
