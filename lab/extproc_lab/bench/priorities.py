"""The priorities bench's accounting, shared by its discrete-event run
(`extproc_lab.discrete_event.priorities`) and its live one (`extproc_lab.bench.priorities_live`):
per-class statistics, the issue's checks, and the markdown report.

The checks, for one llm-extproc row, at 120 % (the first target load) and at every load from 100 %
on (`by_load`):
- critical TTFT p99 <= 1.5 x its value at the lowest load, over the whole run and after warm-up (the
  requests after the first `warmup` share in arrival order, the same ones at every load: the run
  starts with every cache empty, and that cold start sets the whole-run tail);
- sheddable requests are shed before standard ones (no sheddable request served while a standard
  one that was then shed waited for room), and no critical request is shed;
- goodput under the SLO >= every reference policy's in the same run;
- goodput holds past capacity (`goodput_hold`, the class bench's too): at every load of 150 % and
  more up to the first at or past 2x the load where goodput peaks, within 10 % of the row's best
  goodput from 100 % up to that load (issue 33 asks it at 1.5x and 2x the peak's load; a goodput
  still rising with the load holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc_lab.bench.report import RequestRecord, Slo, percentile, summarize
from extproc_lab.bench.workloads import Workload, make_workload, with_priorities

CLASSES = ("critical", "standard", "sheddable")
# The routers a deployment could run instead (the DES's other references read the engines' exact
# state or know the workload in advance: references no real router can be).
PEERS = ("round-robin", "least-request", "sglang-cache-aware", "vllm-router-cache-aware")
# Admission for the simulated A10Gs: an upstream has headroom while predicted-ttft's prefill queue
# there is under 0.15 s. The engines take every request into their batch at once (chunked prefill),
# so their waiting count stays near 0 however late first tokens come: the predicted prefill backlog
# is the signal that moves. Standard requests wait in the queue <= 1.5 s.
# The bench's clients are trusted callers: their own x-llm-priority may ask for critical.
BENCH_ADMISSION: dict[str, Any] = {
    "enabled": True,
    "max_predicted_wait_s": 0.15,
    "max_wait_s": 1.5,
    "client_max_priority": "critical",
}
TPOT_GATE_ROW = "llm-extproc (+ TPOT gate)"
# The TPOT gate row on engines that run vLLM's priority policy, each request's class written into its
# body (`engine_priority: {}`); every other row's engines run FCFS (the peers set no priority).
ENGINE_PRIORITY_ROW = "llm-extproc (+ TPOT gate + engine priority)"
TPOT_OBJECTIVE_ROW = "llm-extproc (TPOT objective per request)"
DECODE_SPEED_ROW = "llm-extproc (+ decode-speed)"


def priorities_workload(name: str, params: dict[str, Any], *, rate: float, count: int, seed: int) -> Workload:
    """The bench's workload at `rate`: `name` with `params`, each request given a priority class
    (`workloads.with_priorities`, seeded)."""
    wl = make_workload(name, rate=rate, count=count, seed=seed, **params)
    return with_priorities(wl, seed=seed)


def row_stats(
    name: str, records: Sequence[RequestRecord], window_s: float, slo: Slo, warmup: float
) -> dict[str, Any]:
    """One policy's row at one load: goodput over the arrival window, counts, failures other than a
    429, and the per-class statistics."""
    report = summarize(name, list(records), window_s, slo)
    return {
        "goodput_rps": report.goodput_rps,
        "good": report.good,
        "ok": report.ok,
        "requests": report.requests,
        "errors": sum(1 for r in records if not r.ok and r.status != 429),
        "ttft_p99_ms": report.ttft_p99_ms,
        "classes": class_stats(records, slo, warmup),
    }


def row_line(load: float, name: str, row: dict[str, Any]) -> str:
    """The progress line printed for a row_stats() row."""
    crit = row["classes"]["critical"]
    return (
        f"  load {load:.0%} {name}: goodput {row['goodput_rps']:.2f}/s, ok {row['ok']}/"
        f"{row['requests']}, critical TTFT p99 {ms(crit['ttft_p99_ms'])} "
        f"(after warm-up {ms(crit['ttft_p99_steady_ms'])})"
    )


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
        good = sum(1 for r in ok if is_good(r, slo))
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
    # Sheddable requests served that arrived while a standard request that was shed in the end
    # waited for room: the classes shed out of order (0 when sheddable goes first).
    waits = [
        (r.arrival_s, r.arrival_s + r.e2e_s)
        for r in records
        if r.tag.startswith("standard/") and r.status == 429
    ]
    served = [r.arrival_s for r in records if r.tag.startswith("sheddable/") and r.ok]
    out["sheddable"]["served_over_shed_standard"] = sum(
        1 for t in served if any(a <= t <= b for a, b in waits)
    )
    return out


def sheddable_first(classes: dict[str, dict[str, Any]]) -> bool:
    """Sheddable is shed before standard: no sheddable request was served while a standard one that
    was then shed waited, and where standard requests were shed, sheddable ones were too."""
    sheddable, standard = classes["sheddable"], classes["standard"]
    in_order = sheddable.get("served_over_shed_standard", 0) == 0
    return in_order and (standard["shed"] == 0 or sheddable["shed"] > 0)


def is_good(r: RequestRecord, slo: Slo) -> bool:
    tpot = r.tpot_s
    return r.ttft_s is not None and r.ttft_s <= slo.ttft_s and tpot is not None and tpot <= slo.tpot_s


HOLD_SHARE = 0.9  # goodput past capacity within 10 % of the peak
HOLD_FROM = 1.5  # loads (x capacity) where the goodput must hold


def checks(
    runs: dict[str, dict[str, Any]],
    loads: Sequence[float],
    references: Sequence[str],
    row: str = "llm-extproc",
) -> dict[str, Any]:
    """The issue's checks for one llm-extproc row at 120 % load (or the highest run), against its
    figures at the lowest load and the `references` rows at 120 %; the same at each load from 100 %
    on (`by_load`), and whether goodput holds past capacity (see the module docstring)."""
    target = 1.2 if 1.2 in loads else max(loads)  # the target load
    by_load = {
        f"{load:g}": _checks_at(runs, min(loads), load, references, row)
        for load in loads
        if load >= 1.0 and load > min(loads)
    }
    result = dict(by_load.get(f"{target:g}") or _checks_at(runs, min(loads), target, references, row))
    result["by_load"] = by_load
    result["goodput_hold"] = goodput_hold(
        {load: runs[f"{load:g}"]["policies"][row]["goodput_rps"] for load in loads}
    )
    return result


def goodput_hold(goodput: Mapping[float, float]) -> dict[str, Any]:
    """Goodput by load (shares of capacity) at each load from HOLD_FROM up to the first at or past
    twice the load where it peaks, over its best from 100 % up to that load. Issue 33 asks it at 1.5x
    and 2x the peak's load; this reads every load run in between too, and where the peak is at 150 %
    or more, every load past capacity against the best before it (a goodput still rising holds)."""
    from_capacity = sorted(x for x in goodput if x >= 1.0)
    peak_load = max(from_capacity, key=lambda x: goodput[x], default=None)
    best = 0.0
    held: dict[str, float | None] = {}
    for load in from_capacity:
        best = max(best, goodput[load])
        if load >= HOLD_FROM - 1e-9:
            held[f"{load:g}"] = goodput[load] / best if best > 0 else None
            if peak_load is not None and load >= 2.0 * peak_load - 1e-9:
                break
    return {
        "peak_load": peak_load,
        "peak_goodput_rps": best if peak_load is None else goodput[peak_load],
        "held": held,
        "holds": bool(held) and all(v is not None and v >= HOLD_SHARE for v in held.values()),
    }


def hold_line(hold: dict[str, Any]) -> str:
    """`goodput_hold`'s result in words."""
    shares = ", ".join(f"{float(k):.0%}: {'-' if v is None else f'{v:.2f}'}" for k, v in hold["held"].items())
    return (
        f"goodput holds past capacity (>= {HOLD_SHARE:.0%} of its best so far from 150 % to 2x its peak's "
        f"load, peak {hold['peak_goodput_rps']:.2f}/s; {shares or 'no load there'}): "
        f"{'pass' if hold['holds'] else 'FAIL'}"
    )


def _checks_at(
    runs: dict[str, dict[str, Any]], lowest: float, target: float, references: Sequence[str], row: str
) -> dict[str, Any]:
    low, high = f"{lowest:g}", f"{target:g}"
    ours_low = runs[low]["policies"][row]["classes"]
    ours = runs[high]["policies"][row]
    classes = ours["classes"]
    crit_low, crit_high = ours_low["critical"]["ttft_p99_ms"], classes["critical"]["ttft_p99_ms"]
    steady_low = ours_low["critical"]["ttft_p99_steady_ms"]
    steady_high = classes["critical"]["ttft_p99_steady_ms"]
    at_high = runs[high]["policies"]
    present = [k for k in references if k in at_high]
    best_ref = max((at_high[k]["goodput_rps"], k) for k in present) if present else (0.0, "-")
    peers = [k for k in present if k in PEERS]
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
        "sheddable_shed_first": sheddable_first(classes),
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


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The bench's tables per load and its checks, from the result JSON (either mode)."""
    c = result["config"]
    lines = [
        f"# Priorities and SLOs ({c['mode']})",
        "",
        f"{c['engines']} x {c['profile']}, workload {c['workload']} {c['workload_params']}, "
        f"{c['count']} requests, seed {c['seed']}; classes 20 % critical / 50 % standard / 30 % "
        f"sheddable; fleet capacity {result['capacity_rps']:.2f} req/s ({result['capacity_source']}).",
        f"Goodput SLO: TTFT <= {c['slo']['ttft_s'] * 1000:g} ms and TPOT <= "
        f"{c['slo']['tpot_s'] * 1000:g} ms; llm-extproc admission: {c['admission']}.",
        "",
    ]
    for load, run in result["loads"].items():
        lines += [f"## {float(load):.0%} load ({run['rate_rps']:.2f} req/s)", ""]
        lines += policy_table(run["policies"])
        lines.append("")
    lines += _check_lines("llm-extproc with admission", result["checks"], c["warmup"])
    if "checks_decode_speed" in result:
        lines += _check_lines(DECODE_SPEED_ROW, result["checks_decode_speed"], c["warmup"])
    if "checks_tpot_objective" in result:
        lines += _check_lines(TPOT_OBJECTIVE_ROW, result["checks_tpot_objective"], c["warmup"])
    if "checks_tpot_gate" in result:
        lines += _check_lines(TPOT_GATE_ROW, result["checks_tpot_gate"], c["warmup"])
    return "\n".join(lines)


def policy_table(policies: dict[str, dict[str, Any]]) -> list[str]:
    """One load's rows (row_stats() results by name) as a markdown table."""
    lines = [
        "| policy | goodput/s | served | critical TTFT p50 / p99 ms | critical p99 after warm-up | "
        "standard p99 ms | sheddable p99 ms | shed critical / standard / sheddable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in policies.items():
        k = p["classes"]
        lines.append(
            f"| {name} | {p['goodput_rps']:.2f} | {p['ok']}/{p['requests']} | "
            f"{ms(k['critical']['ttft_p50_ms'])} / {ms(k['critical']['ttft_p99_ms'])} | "
            f"{ms(k['critical']['ttft_p99_steady_ms'])} | {ms(k['standard']['ttft_p99_ms'])} | "
            f"{ms(k['sheddable']['ttft_p99_ms'])} | "
            f"{k['critical']['shed']} / {k['standard']['shed']} / {k['sheddable']['shed']} |"
        )
    return lines


def _check_lines(row: str, ch: dict[str, Any], warmup: float) -> list[str]:
    ratio = ch["critical_ttft_p99_ratio"]
    return [
        f"## Checks ({row}, at 120 % load, then each load)",
        "",
        f"- critical TTFT p99 vs the lowest load: x{ratio:.2f} (target <= 1.5): "
        f"{'pass' if ch['critical_ttft_ok'] else 'FAIL'}"
        if ratio is not None
        else "- critical TTFT p99: no data",
        f"- the same after warm-up (requests after the first {warmup:.0%}): "
        f"x{ch['critical_ttft_steady_ratio']:.2f}: {'pass' if ch['critical_ttft_steady_ok'] else 'FAIL'}"
        if ch["critical_ttft_steady_ratio"] is not None
        else "- critical TTFT p99 after warm-up: no data",
        f"- sheddable shed before standard: {'pass' if ch['sheddable_shed_first'] else 'FAIL'} "
        f"({ch['sheddable_shed']} sheddable, {ch['standard_shed']} standard shed)",
        f"- no critical request shed: {'pass' if ch['no_critical_shed'] else 'FAIL'} ({ch['critical_shed']})",
        f"- goodput {ch['goodput_rps']:.2f}/s >= best peer router ({ch['best_peer']}, "
        f"{ch['best_peer_goodput_rps']:.2f}/s): {'pass' if ch['goodput_ok_peers'] else 'FAIL'}",
        f"- goodput {ch['goodput_rps']:.2f}/s >= best reference of all, exact-state ones included "
        f"({ch['best_reference']}, {ch['best_reference_goodput_rps']:.2f}/s): "
        f"{'pass' if ch['goodput_ok'] else 'FAIL'}",
        *_by_load_lines(ch),
        "",
    ]


def _by_load_lines(ch: dict[str, Any]) -> list[str]:
    """Each load from 100 % on (critical p99 x, shed, goodput against the best peer), and the hold."""
    lines = []
    for load, at in (ch.get("by_load") or {}).items():
        ratio, steady = at["critical_ttft_p99_ratio"], at["critical_ttft_steady_ratio"]
        lines.append(
            f"- at {float(load):.0%}: critical p99 x{ratio if ratio is not None else float('nan'):.2f} "
            f"(after warm-up x{steady if steady is not None else float('nan'):.2f}), shed "
            f"{at['critical_shed']} / {at['standard_shed']} / {at['sheddable_shed']}"
            f"{'' if at['sheddable_shed_first'] else ' (standard before sheddable)'}, goodput "
            f"{at['goodput_rps']:.2f}/s against the best peer's {at['best_peer_goodput_rps']:.2f}/s"
        )
    hold = ch.get("goodput_hold")
    if hold and hold["held"]:
        lines.append(f"- {hold_line(hold)}")
    return lines
