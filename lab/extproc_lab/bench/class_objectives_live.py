"""Priority classes past capacity, live: the discrete-event bench's cells through real processes on
loopback (Envoy, the service, Redis, the publisher, simulated engines).

    python -m extproc_lab.bench.class_objectives_live [--cell s6-a10g] [--count 600] [--time-scale 2]
        [--loads 0.5,1,1.2,1.6,2] [--replicas 1] [--out out/classes-live]

The workload and engines are the discrete-event bench's (`extproc_lab.bench.classes`: 8-sequence
batches, 600 KV blocks, 16 tenants' 1.2k-token prompts, 20 / 50 / 30 % critical / standard /
sheddable). Rows:
llm-extproc on the shipped settings with `admission.enabled: true`; the same with the publisher
configured with each engine's `max_num_seqs`; llm-extproc without admission; Envoy's `round_robin`
and `least_request`; sglang-router `cache_aware` when installed. Each row runs on a fresh fleet, one
after another. Capacity is not measured live: it is the discrete-event bench's (`--capacity`; the
default is its figure for the cell). With `--time-scale` above 1 time runs that many times faster
and latencies are converted back; the admission's waits are divided by it. Writes
`classes-live.json` and `classes-live.md` with the discrete-event bench's checks per row.
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
from extproc_lab.bench.classes import (
    CELLS,
    CONFIGURED,
    NO_ADMISSION,
    OURS,
    SHIPPED_ADMISSION,
    class_checks,
    workload,
)
from extproc_lab.bench.priorities import CLASSES, hold_line, row_stats
from extproc_lab.bench.report import RequestRecord, Slo
from extproc_lab.bench.scenarios import peer_missing, run_live_requests

# Row -> the live policy that runs it.
ROWS = {
    OURS: "llm-extproc",
    CONFIGURED: "llm-extproc",
    NO_ADMISSION: "llm-extproc",
    "round-robin": "envoy-round-robin",
    "least-request": "envoy-least-request",
    "sglang-cache-aware": "sglang-cache-aware",
}
# The discrete-event bench's capacity per cell (seed 0, 1 200 requests; docs/benchmarks.md).
DES_CAPACITY_RPS = {"s6-a10g": 7.50, "s6-h100": 47.25, "s4-mixed": 19.0, "s6-a10g-long-out": 2.25}


@dataclass(slots=True)
class LiveConfig:
    cell: str = "s6-a10g"
    count: int = 600
    seed: int = 0
    loads: tuple[float, ...] = (0.5, 1.0, 1.2, 1.6, 2.0)
    rows: tuple[str, ...] = tuple(ROWS)
    capacity_rps: float | None = None
    time_scale: float = 2.0
    warmup: float = 0.1
    replicas: int = 1  # llm-extproc `serve` processes behind Envoy, sharing state through Redis
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=2.0, tpot_s=10.0))


def scaled_admission(admission: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """`admission` with its waits in real seconds (the defaults where it leaves them unset)."""
    d = AdmissionSettings()
    out = dict(admission)
    out["max_wait_s"] = out.get("max_wait_s", d.max_wait_s) / time_scale
    out["overload_after_s"] = out.get("overload_after_s", d.overload_after_s) / time_scale
    wait = out.get("overload_wait_s", d.overload_wait_s)
    out["overload_wait_s"] = None if wait is None else wait / time_scale
    return out


async def run_live(cfg: LiveConfig, out_dir: Path, progress: Any = print) -> dict[str, Any]:
    unknown = [r for r in cfg.rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    cell = CELLS[cfg.cell]
    capacity = cfg.capacity_rps or DES_CAPACITY_RPS[cfg.cell]
    shipped = {"admission": scaled_admission(SHIPPED_ADMISSION, cfg.time_scale)}
    service_of = {
        OURS: shipped,
        CONFIGURED: shipped,
        NO_ADMISSION: {"admission": {"client_max_priority": "critical"}},
    }
    loads: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    started = time.perf_counter()
    for load in cfg.loads:
        wl = workload(cell, capacity * load, cfg.count, cfg.seed)
        requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
        per: dict[str, Any] = {}
        for row in cfg.rows:
            policy = ROWS[row]
            if peer_missing(policy) is not None:
                skipped[row] = peer_missing(policy) or ""
                continue
            samples: dict[str, float] = {}
            ran = await run_live_requests(
                policy,
                requests,
                list(cell.fleet),
                time_scale=cfg.time_scale,
                workdir=out_dir / "logs" / f"{load:g}" / row.replace(" ", "_"),
                service_extra=service_of.get(row),
                headers=list(wl.headers),
                max_num_seqs=row == CONFIGURED,
                service_metrics=samples,
                replicas=cfg.replicas if policy == "llm-extproc" else 1,
            )
            if ran is None:
                skipped[row] = "could not start"
                continue
            per[row] = row_stats(row, ran[0], wl.duration_s, cfg.slo, cfg.warmup)
            if samples:
                per[row]["observed_ttft"] = observed_ttft(ran[0], samples, cfg.time_scale)
            k = per[row]["classes"]
            progress(
                f"  {cfg.cell} {load:.0%} {row}: good {per[row]['goodput_rps']:.2f}/s, critical p99 "
                f"{(k['critical']['ttft_p99_ms'] or 0) / 1000:.2f} s (warm "
                f"{(k['critical']['ttft_p99_steady_ms'] or 0) / 1000:.2f}), shed "
                f"{k['critical']['shed']}/{k['standard']['shed']}/{k['sheddable']['shed']}"
            )
        loads[f"{load:g}"] = {"rate_rps": capacity * load, "window_s": wl.duration_s, "policies": per}
    ours = [r for r in (OURS, CONFIGURED, NO_ADMISSION) if r in cfg.rows and r not in skipped]
    result: dict[str, Any] = {
        "config": {
            "cell": cfg.cell,
            "count": cfg.count,
            "seed": cfg.seed,
            "slo_ttft_s": cfg.slo.ttft_s,
            "admission": SHIPPED_ADMISSION,
            "time_scale": cfg.time_scale,
            "replicas": cfg.replicas,
            "mode": f"live: Envoy, the service, Redis, simulated engines; time scale {cfg.time_scale:g}",
        },
        "capacity_rps": capacity,
        "capacity_source": "the discrete-event bench's (llm-extproc without admission, 95 % good)",
        "loads": loads,
        "skipped": skipped,
        "wall_s": time.perf_counter() - started,
    }
    if len(cfg.loads) > 1 and min(cfg.loads) <= 0.5:
        result["checks"] = {row: class_checks(loads, row) for row in ours}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "classes-live.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    (out_dir / "classes-live.md").write_text(markdown(result))
    return result


def observed_ttft(
    records: Sequence[RequestRecord], samples: dict[str, float], time_scale: float
) -> dict[str, dict[str, float | None]]:
    """Per class: the service's `llm_extproc_observed_ttft_seconds` (Envoy's first response byte)
    against the clients' own TTFT of the same requests, means in virtual ms: the metric checked
    against what was sent."""
    out: dict[str, dict[str, float | None]] = {}
    for klass in CLASSES:
        label = f'{{priority="{klass}"}}'
        count = samples.get(f"llm_extproc_observed_ttft_seconds_count{label}", 0.0)
        total = samples.get(f"llm_extproc_observed_ttft_seconds_sum{label}", 0.0)
        tag = f"{klass}/"
        client = [r.ttft_s for r in records if r.ok and r.ttft_s is not None and r.tag.startswith(tag)]
        out[klass] = {
            "service_count": count,
            "service_mean_ms": total / count * time_scale * 1000 if count else None,
            "client_count": float(len(client)),
            "client_mean_ms": sum(client) / len(client) * 1000 if client else None,
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"# Priority classes past capacity, live ({c['cell']}, {c['mode']})",
        "",
        f"{c['count']} requests a run, seed {c['seed']}; good: TTFT <= {c['slo_ttft_s']:g} s; capacity "
        f"{result['capacity_rps']:.2f} req/s ({result['capacity_source']}).",
        "",
        "| load | row | good/s | critical p50 / p99 s (warm p99) | standard p99 s | "
        "shed critical / standard / sheddable |",
        "|---|---|---|---|---|---|",
    ]
    for load, run in result["loads"].items():
        for row, st in run["policies"].items():
            k = st["classes"]
            crit = k["critical"]
            lines.append(
                f"| {float(load):.0%} | {row} | {st['goodput_rps']:.2f} | "
                f"{(crit['ttft_p50_ms'] or 0) / 1000:.2f} / {(crit['ttft_p99_ms'] or 0) / 1000:.2f} "
                f"({(crit['ttft_p99_steady_ms'] or 0) / 1000:.2f}) | "
                f"{(k['standard']['ttft_p99_ms'] or 0) / 1000:.2f} | "
                f"{crit['shed']} / {k['standard']['shed']} / {k['sheddable']['shed']} |"
            )
    for row, ch in result.get("checks", {}).items():
        lines += ["", f"## Checks: {row}", ""]
        for load, v in ch["loads"].items():
            lines.append(
                f"- {float(load):.0%}: critical p99 x{v['critical_p99_ratio'] or 0:.2f} of its 50 % value "
                f"(warm x{v['critical_p99_steady_ratio'] or 0:.2f}), critical shed {v['critical_shed']}, "
                f"sheddable first {'yes' if v['sheddable_first'] else 'NO'}, good/s {v['goodput']:.2f} vs "
                f"best peer {v['best_peer_goodput']:.2f} ({v['best_peer']})"
            )
        lines.append(f"- {hold_line(ch['goodput_hold'])}")
    observed = [
        (load, row, st["observed_ttft"])
        for load, run in result["loads"].items()
        for row, st in run["policies"].items()
        if "observed_ttft" in st
    ]
    if observed:
        lines += [
            "",
            "## Observed TTFT: the service's metric against the clients' (mean ms, virtual time)",
            "",
            "| load | row | " + " | ".join(f"{k}: service / clients (n)" for k in CLASSES) + " |",
            "|---|---|" + "---|" * len(CLASSES),
        ]
        for load, row, by in observed:
            cells = [
                f"{_ms(v['service_mean_ms'])} / {_ms(v['client_mean_ms'])} ({v['service_count']:.0f}/"
                f"{v['client_count']:.0f})"
                for v in (by[k] for k in CLASSES)
            ]
            lines.append(f"| {float(load):.0%} | {row} | " + " | ".join(cells) + " |")
    for row, why in result.get("skipped", {}).items():
        lines.append(f"- skipped {row}: {why}")
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", default="s6-a10g", choices=sorted(CELLS))
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1,1.2,1.6,2")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--capacity", type=float, default=None)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, default=1, help="llm-extproc replicas (replica sync on)")
    ap.add_argument("--out", type=Path, default=Path("out/classes-live"))
    args = ap.parse_args(argv)
    cfg = LiveConfig(
        cell=args.cell,
        count=args.count,
        seed=args.seed,
        loads=tuple(float(x) for x in args.loads.split(",")),
        rows=tuple(r for r in args.rows.split(",") if r),
        capacity_rps=args.capacity,
        time_scale=args.time_scale,
        replicas=args.replicas,
    )
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    result = asyncio.run(run_live(cfg, args.out))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
