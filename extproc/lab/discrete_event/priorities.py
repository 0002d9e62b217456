"""Priorities and SLOs at overload, in the discrete-event mode (issue 11's target).

    python -m extproc.lab.discrete_event.priorities [--engines 4] [--count 3000] [--out out/priorities]

A Poisson workload (shared-prefix by default) whose requests each carry a priority class (20 %
critical, 50 % standard, 30 % sheddable; `workloads.with_priorities`) is run at 50 %, 120 % and 160 %
of the fleet's capacity against every reference policy and against llm-extproc with admission on (the
service's own `Admission`: shed sheddable at saturation, queue standard fairly, admit critical); the
same with the `decode-speed` scorer in its profile ("llm-extproc (+ decode-speed)") and with the TPOT
gate (`max_tpot_s`, "llm-extproc (+ TPOT gate)"), both at the SLO's TPOT; with every request
carrying the SLO's TPOT as its own objective (`x-llm-tpot-slo-ms`, the default profile: "llm-extproc
(TPOT objective per request)"); and, for contrast, with admission off. Capacity is measured first,
under the SLO: the highest arrival rate at which exact-ttft (greedy least TTFT from the engines'
exact state) still serves 95 % of the requests within the SLO (bisection). Writes `priorities.json`
and `priorities.md`.

The checks (printed and in the JSON), at 120 %, for llm-extproc with admission (and the same for the
decode-speed row, `checks_decode_speed`, and the objective row, `checks_tpot_objective`, whose
requests of every class may be shed for the objective they carry):
- critical TTFT p99 <= 1.5 x its value at 50 %, over the whole run and after warm-up (the requests
  after the first `--warmup` share in arrival order, the same ones at every load: the run starts
  with every cache empty, and that cold start sets the whole-run tail);
- sheddable requests are shed before any standard one (no standard 429 before the first sheddable
  429), and no critical request is shed;
- goodput under the SLO >= every reference policy's in the same run.
TTFT counts the time a request waited in the admission queue. Goodput is good requests (TTFT and
TPOT within the SLO) per second of the arrival window, the same denominator for every policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.lab.bench.report import RequestRecord, Slo, percentile, summarize
from extproc.lab.bench.workloads import Workload, make_workload, with_priorities
from extproc.lab.discrete_event.simulation import POLICIES, SEEDED_PICKER, simulate, tokenize_requests
from extproc.lab.engines.profiles import PROFILES
from extproc.settings import DEFAULT_PROFILE

CLASSES = ("critical", "standard", "sheddable")
REFERENCES = tuple(p for p in POLICIES if p != "llm-extproc")
# The routers a deployment could run instead (the others read the engines' exact state or know the
# workload in advance: references no real router can be).
PEERS = ("round-robin", "least-request", "sglang-cache-aware", "vllm-router-cache-aware")
# Admission for the simulated A10Gs: an upstream has headroom while predicted-ttft's prefill queue
# there is under 0.15 s. The engines take every request into their batch at once (chunked prefill),
# so their waiting count stays near 0 however late first tokens come: the predicted prefill backlog
# is the signal that moves. Standard requests wait in the queue <= 1.5 s.
BENCH_ADMISSION: dict[str, Any] = {"enabled": True, "max_predicted_wait_s": 0.15, "max_wait_s": 1.5}


TPOT_GATE_ROW = "llm-extproc (+ TPOT gate)"
TPOT_OBJECTIVE_ROW = "llm-extproc (TPOT objective per request)"
DECODE_SPEED_ROW = "llm-extproc (+ decode-speed)"
DECODE_SPEED_WEIGHT = 0.6  # against predicted-ttft's 1.0: docs/benchmarks.md, "Decode speed in placement"


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
    loads: tuple[float, ...] = (0.5, 1.2, 1.6)
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))
    admission: dict[str, Any] = field(default_factory=lambda: dict(BENCH_ADMISSION))
    references: tuple[str, ...] = REFERENCES
    publish_interval_s: float = 0.5
    # The share of requests (in arrival order: the same ones at every load) left out of the
    # "after warm-up" figures: the fleet starts with every cache empty, and a tenant's first request
    # is a cold prefill that its next requests wait for, however they are routed.
    warmup: float = 0.1


def _workload(cfg: BenchConfig, rate: float) -> Workload:
    wl = make_workload(cfg.workload, rate=rate, count=cfg.count, seed=cfg.seed, **cfg.workload_params)
    return with_priorities(wl, seed=cfg.seed)


def _run(
    cfg: BenchConfig,
    wl: Workload,
    policy: str,
    admission: bool | dict[str, Any],
    profile: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> list[RequestRecord]:
    """`admission`: True for the bench's, a dict for another (llm-extproc only), False for none;
    `profile`: llm-extproc's scheduling profile instead of the default one; `headers`: added to
    every request's own."""
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    fleet = [PROFILES[cfg.profile]] * cfg.engines
    service: dict[str, Any] | None = None
    if admission:
        service = {"admission": cfg.admission if admission is True else admission}
    if profile is not None:
        service = {**(service or {}), "scheduling": {"profiles": {"default": profile}}}
    run = simulate(
        requests,
        fleet,
        policy,
        service=service,
        tokens=tokenize_requests(requests),
        headers=wl.headers if not headers else [{**(h or {}), **headers} for h in wl.headers],
        publish_interval_s=cfg.publish_interval_s,
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
        good = sum(1 for r in records if r.ok and _good(r, cfg.slo)) / len(records)
        lo, hi = (mid, hi) if good >= CAPACITY_GOOD else (lo, mid)
    return lo


CAPACITY_GOOD = 0.95
CAPACITY_POLICY = "exact-ttft"


def _fields(cfg: BenchConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def warmup_end_s(records: Sequence[RequestRecord], warmup: float) -> float:
    """The arrival time of the first request after the first `warmup` share of them."""
    arrivals = sorted(r.arrival_s for r in records)
    if not arrivals or warmup <= 0:
        return 0.0
    return arrivals[min(len(arrivals) - 1, int(len(arrivals) * warmup))]


def class_stats(records: Sequence[RequestRecord], slo: Slo, warmup: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per class: counts, shedding, TTFT p50 / p99 over the run and p99 of the requests that
    arrived after the first `warmup` share (`ttft_p99_steady_ms`)."""
    out: dict[str, dict[str, Any]] = {}
    steady_from = warmup_end_s(records, warmup)
    for klass in CLASSES:
        mine = [r for r in records if r.tag.startswith(klass + "/")]
        ok = [r for r in mine if r.ok]
        shed = [r for r in mine if r.status == 429]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        reasons: dict[str, int] = {}
        for r in shed:
            reasons[r.error or "?"] = reasons.get(r.error or "?", 0) + 1
        good = sum(1 for r in ok if _good(r, slo))
        p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
        steady = percentile([r.ttft_s for r in ok if r.ttft_s is not None and r.arrival_s >= steady_from], 99)
        out[klass] = {
            "requests": len(mine),
            "ok": len(ok),
            "shed": len(shed),
            "shed_reasons": reasons,
            "other_errors": len(mine) - len(ok) - len(shed),
            "good": good,
            "ttft_p50_ms": None if p50 is None else p50 * 1000,
            "ttft_p99_ms": None if p99 is None else p99 * 1000,
            "ttft_p99_steady_ms": None if steady is None else steady * 1000,
            # when the first 429 went out (a queued request's after its wait)
            "first_shed_s": min((r.arrival_s + r.e2e_s for r in shed), default=None),
        }
    return out


def _good(r: RequestRecord, slo: Slo) -> bool:
    tpot = r.tpot_s
    return r.ttft_s is not None and r.ttft_s <= slo.ttft_s and tpot is not None and tpot <= slo.tpot_s


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
    Row = tuple[str, str, bool | dict[str, Any], dict[str, Any] | None, dict[str, str] | None]
    policies: list[Row] = [("llm-extproc", "llm-extproc", True, None, None)]
    policies.append((DECODE_SPEED_ROW, "llm-extproc", True, decode_speed_profile(cfg.slo.tpot_s), None))
    if cfg.admission.get("max_tpot_s") is None:
        gated = {**cfg.admission, "max_tpot_s": cfg.slo.tpot_s}
        policies.append((TPOT_GATE_ROW, "llm-extproc", gated, None, None))
    objective = {"x-llm-tpot-slo-ms": f"{cfg.slo.tpot_s * 1000:g}"}
    policies.append((TPOT_OBJECTIVE_ROW, "llm-extproc", True, None, objective))
    policies.append(("llm-extproc (no admission)", "llm-extproc", False, None, None))
    policies += [(p, p, False, None, None) for p in cfg.references]
    for load in cfg.loads:
        rate = capacity * load
        wl = _workload(cfg, rate)
        window = wl.duration_s
        per_load: dict[str, Any] = {}
        for name, policy, admission, profile, headers in policies:
            records = _run(cfg, wl, policy, admission, profile, headers)
            report = summarize(name, records, window, cfg.slo)
            per_load[name] = {
                "goodput_rps": report.goodput_rps,
                "good": report.good,
                "ok": report.ok,
                "requests": report.requests,
                "ttft_p99_ms": report.ttft_p99_ms,
                "classes": class_stats(records, cfg.slo, cfg.warmup),
            }
            crit = per_load[name]["classes"]["critical"]
            log(
                f"  load {load:.0%} {name}: goodput {report.goodput_rps:.2f}/s, ok {report.ok}/"
                f"{report.requests}, critical TTFT p99 {_ms(crit['ttft_p99_ms'])} "
                f"(after warm-up {_ms(crit['ttft_p99_steady_ms'])})"
            )
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
            "mode": "discrete-event (virtual time)",
        },
        "capacity_rps": capacity,
        "loads": runs,
        "checks": checks(runs, cfg),
        # The same for the profile with `decode-speed` (the SLO's TPOT as its objective).
        "checks_decode_speed": checks(runs, cfg, DECODE_SPEED_ROW),
        # And with the SLO's TPOT as every request's own objective.
        "checks_tpot_objective": checks(runs, cfg, TPOT_OBJECTIVE_ROW),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "priorities.json").write_text(json.dumps(result, indent=2, sort_keys=True))
        (out_dir / "priorities.md").write_text(markdown(result))
    return result


def checks(runs: dict[str, dict[str, Any]], cfg: BenchConfig, row: str = "llm-extproc") -> dict[str, Any]:
    """The issue's checks for one llm-extproc row (see the module docstring)."""
    target = 1.2 if 1.2 in cfg.loads else max(cfg.loads)  # the target load
    low, high = f"{min(cfg.loads):g}", f"{target:g}"
    ours_low = runs[low]["policies"][row]["classes"]
    ours = runs[high]["policies"][row]
    classes = ours["classes"]
    crit_low, crit_high = ours_low["critical"]["ttft_p99_ms"], classes["critical"]["ttft_p99_ms"]
    steady_low = ours_low["critical"]["ttft_p99_steady_ms"]
    steady_high = classes["critical"]["ttft_p99_steady_ms"]
    first_sheddable = classes["sheddable"]["first_shed_s"]
    first_standard = classes["standard"]["first_shed_s"]
    at_high = runs[high]["policies"]
    best_ref = max((at_high[k]["goodput_rps"], k) for k in cfg.references)
    peers = [k for k in cfg.references if k in PEERS]
    best_peer = max((at_high[k]["goodput_rps"], k) for k in peers) if peers else (0.0, "-")
    return {
        "critical_ttft_p99_ratio": None if not crit_low or crit_high is None else crit_high / crit_low,
        "critical_ttft_ok": bool(crit_low and crit_high is not None and crit_high <= 1.5 * crit_low),
        "critical_ttft_steady_ratio": None
        if not steady_low or steady_high is None
        else steady_high / steady_low,
        "critical_ttft_steady_ok": bool(
            steady_low and steady_high is not None and steady_high <= 1.5 * steady_low
        ),
        "sheddable_shed_first": first_standard is None
        or (first_sheddable is not None and first_sheddable <= first_standard),
        "standard_shed": classes["standard"]["shed"],
        "sheddable_shed": classes["sheddable"]["shed"],
        "critical_shed": classes["critical"]["shed"],
        "no_critical_shed": classes["critical"]["shed"] == 0,
        "goodput_rps": ours["goodput_rps"],
        "best_reference": best_ref[1],
        "best_reference_goodput_rps": best_ref[0],
        "goodput_ok": ours["goodput_rps"] >= best_ref[0],
        "best_peer": best_peer[1],
        "best_peer_goodput_rps": best_peer[0],
        "goodput_ok_peers": ours["goodput_rps"] >= best_peer[0],
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        "# Priorities and SLOs (discrete-event mode)",
        "",
        f"{c['engines']} x {c['profile']}, workload {c['workload']} {c['workload_params']}, "
        f"{c['count']} requests, seed {c['seed']}; classes 20 % critical / 50 % standard / 30 % "
        f"sheddable; fleet capacity {result['capacity_rps']:.2f} req/s (the highest rate at which "
        "exact-ttft serves 95 % within the SLO).",
        f"Goodput SLO: TTFT <= {c['slo']['ttft_s'] * 1000:g} ms and TPOT <= "
        f"{c['slo']['tpot_s'] * 1000:g} ms; llm-extproc admission: {c['admission']}.",
        "",
    ]
    for load, run in result["loads"].items():
        lines += [
            f"## {float(load):.0%} load ({run['rate_rps']:.2f} req/s)",
            "",
            "| policy | goodput/s | served | critical TTFT p50 / p99 ms | critical p99 after warm-up | "
            "standard p99 ms | sheddable p99 ms | shed critical / standard / sheddable |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, p in run["policies"].items():
            k = p["classes"]
            lines.append(
                f"| {name} | {p['goodput_rps']:.2f} | {p['ok']}/{p['requests']} | "
                f"{_ms(k['critical']['ttft_p50_ms'])} / {_ms(k['critical']['ttft_p99_ms'])} | "
                f"{_ms(k['critical']['ttft_p99_steady_ms'])} | {_ms(k['standard']['ttft_p99_ms'])} | "
                f"{_ms(k['sheddable']['ttft_p99_ms'])} | "
                f"{k['critical']['shed']} / {k['standard']['shed']} / {k['sheddable']['shed']} |"
            )
        lines.append("")
    lines += _check_lines("llm-extproc with admission", result["checks"], c["warmup"])
    if "checks_decode_speed" in result:
        lines += _check_lines(DECODE_SPEED_ROW, result["checks_decode_speed"], c["warmup"])
    if "checks_tpot_objective" in result:
        lines += _check_lines(TPOT_OBJECTIVE_ROW, result["checks_tpot_objective"], c["warmup"])
    return "\n".join(lines)


def _check_lines(row: str, ch: dict[str, Any], warmup: float) -> list[str]:
    ratio = ch["critical_ttft_p99_ratio"]
    return [
        f"## Checks ({row}, at 120 % load)",
        "",
        f"- critical TTFT p99 vs the lowest load: x{ratio:.2f} (target <= 1.5): "
        f"{'pass' if ch['critical_ttft_ok'] else 'FAIL'}"
        if ratio is not None
        else "- critical TTFT p99: no data",
        f"- the same after warm-up (requests after the first {warmup:.0%}): "
        f"x{ch['critical_ttft_steady_ratio']:.2f}: {'pass' if ch['critical_ttft_steady_ok'] else 'FAIL'}"
        if ch["critical_ttft_steady_ratio"] is not None
        else "- critical TTFT p99 after warm-up: no data",
        f"- sheddable shed before any standard: {'pass' if ch['sheddable_shed_first'] else 'FAIL'} "
        f"({ch['sheddable_shed']} sheddable, {ch['standard_shed']} standard shed)",
        f"- no critical request shed: {'pass' if ch['no_critical_shed'] else 'FAIL'} ({ch['critical_shed']})",
        f"- goodput {ch['goodput_rps']:.2f}/s >= best peer router ({ch['best_peer']}, "
        f"{ch['best_peer_goodput_rps']:.2f}/s): {'pass' if ch['goodput_ok_peers'] else 'FAIL'}",
        f"- goodput {ch['goodput_rps']:.2f}/s >= best reference of all, exact-state ones included "
        f"({ch['best_reference']}, {ch['best_reference_goodput_rps']:.2f}/s): "
        f"{'pass' if ch['goodput_ok'] else 'FAIL'}",
        "",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.lab.discrete_event.priorities", description=__doc__)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--profile", default="a10g-llama3-8b", choices=sorted(PROFILES))
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1.2,1.6", help="comma-separated fractions of capacity")
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
