"""The robustness grid in virtual time: every policy in every cell of a named grid, same requests and
seed per cell (cells and report: `extproc_lab.bench.grid`).

Per cell, before the policies run:

- **Round robin's capacity** is measured, not assumed: round robin serves the cell's whole request list
  on the cell's fleet with every request queued at t = 0 (saturation). An engine's saturated throughput
  is the requests it completed over the time it took to finish them, cold caches included (the cell's
  runs start cold too: with large caches the warm-up misses are much of a short run's work, and a
  capacity measured on warm caches alone overloads round robin at "80 %"). Round robin gives every
  engine 1/n of the requests, so its capacity is ``n x`` the slowest engine's throughput (in a mixed
  fleet the A10Gs saturate first). The cell's rate is ``load x`` capacity. Checked on t-base, t-mixed,
  t-kv-60, c-base and c-kv-60 by running round robin at 0.5-1.2x: its queue starts to grow between
  1.0x and 1.1x (docs/benchmarks.md).
- **Round robin unloaded**: the first 200 of the cell's requests at 2 % of capacity; its TTFT p90 is
  what "round robin is loaded" (p90 >= 3x unloaded) compares against.
- **Cold prefill**: the TTFT of the cell's median prompt on an idle engine with an empty cache, mean
  over the fleet's engines (the cold-miss floor).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from extproc.openai.parse import parse_head, parse_request
from extproc.scheduling.ttft_predictor import DEFAULT_PREFILL_TOKENS_PER_S
from extproc.settings import DEFAULT_PROFILE
from extproc.tokenization import estimate_tokens
from extproc_lab.bench.grid import (
    STABILITY_GRIDS,
    Calibration,
    Cell,
    CellResult,
    cell_profiles,
    cell_result,
    cell_slo,
    check_policies,
    finish_grid,
    grid,
    make_cell_workload,
    policy_row,
    prefix_tokens,
)
from extproc_lab.bench.report import RequestRecord, summarize
from extproc_lab.bench.workloads import Workload
from extproc_lab.discrete_event.simulation import (
    POLICIES,
    SEEDED_PICKER,
    VARIANTS,
    Request,
    simulate,
    tokenize_requests,
)
from extproc_lab.engines.model import EngineModel
from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.engines.tokens import Recount

MODEL = "sim-llama"
_HEAD = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
SATURATION_RATE = 1e4  # requests/s: every request is queued at once
UNLOADED_SHARE = 0.02
UNLOADED_REQUESTS = 200


def _requests(cell: Cell, rate: float, count: int, seed: int) -> list[Request]:
    wl = make_cell_workload(cell, rate=rate, count=count, seed=seed, model=MODEL)
    return [(r.arrival_s, r.body, r.tag) for r in wl.requests]


def saturated_capacity(records: Sequence[RequestRecord], engines: int) -> float:
    """Round robin's capacity from a saturated run (every request queued at t = 0): n x the slowest
    engine's throughput, its completed requests over the time it took to finish them all (module
    docstring)."""
    done: dict[str, list[float]] = {}
    for r in records:
        if r.ok and r.served_by is not None:
            done.setdefault(r.served_by, []).append(r.arrival_s + r.e2e_s)
    start = min((r.arrival_s for r in records), default=0.0)
    rates = [len(times) / (max(times) - start) for times in done.values() if max(times) > start]
    if not rates:
        raise ValueError("no completed requests to measure round robin's capacity")
    return engines * min(rates)


def cold_prefill_s(profile: GpuProfile, prompt: Sequence[int]) -> float:
    """TTFT of `prompt` alone on a fresh engine of `profile`."""
    engine = EngineModel(profile)
    engine.submit("cold", list(prompt), 1, 0.0)
    now = 0.0
    while True:
        step = engine.step(now)
        if step is None:
            raise RuntimeError("engine went idle before the first token")
        now = step.ended_at
        if step.first_tokens:
            return step.first_tokens[0].ttft


def cell_fleet(
    cell: Cell, probe: Workload, tokens: Sequence[list[int]], recount: Sequence[Recount] | None = None
) -> tuple[int, list[GpuProfile], float]:
    """(prefix tokens, one profile per engine, cold prefill seconds) of a cell, from its requests
    (`probe`, at any rate: content does not depend on it) and their tokens: KV sized for the cell's
    prefixes and at least the longest request, and the cold prefill of the median prompt on an idle
    engine, mean over the fleet. `recount`: per engine, its own tokenizer (`engine_recount`)."""
    prefix = prefix_tokens(cell, probe)
    longest = max(
        len(t) + int(r.body.get("max_tokens") or 0) for t, r in zip(tokens, probe.requests, strict=True)
    )
    scales = [r.scale for r in recount] if recount else [1.0]
    profiles = cell_profiles(cell, prefix, longest, scales)
    median_prompt = sorted(tokens, key=len)[len(tokens) // 2]
    cold = statistics.mean(
        cold_prefill_s(p, recount[i](median_prompt) if recount else median_prompt)
        for i, p in enumerate(profiles)
    )
    return prefix, profiles, cold


def service_estimate_ratio(requests: Sequence[Request], tokens: Sequence[Sequence[int]]) -> float:
    """The service's token estimate without a tokenizer (UTF-8 bytes / 4 of the prompt text, as
    parse_request joins it) over the simulated engines' own count, summed over the requests."""
    head = parse_head(
        _HEAD, session_header="x-session-id", user_header="x-user-id", priority_header="x-llm-priority"
    )
    est = sum(estimate_tokens(parse_request(head, orjson.dumps(body)).prompt_text) for _, body, _ in requests)
    return est / max(1, sum(len(t) for t in tokens))


def engine_recount(cell: Cell, estimate_ratio: float) -> list[Recount] | None:
    """Per engine, its tokenizer when the cell says engines count differently from the service's
    estimate (`Cell.token_ratio`: estimate / engine tokens): None when they agree."""
    if cell.token_ratio == (1.0,):
        return None
    by_ratio: dict[float, Recount] = {}
    out = []
    for i in range(cell.engines):
        r = cell.token_ratio[i % len(cell.token_ratio)]
        if r not in by_ratio:
            by_ratio[r] = Recount(estimate_ratio / r, salt=len(by_ratio))
        out.append(by_ratio[r])
    return out


def calibrate(cell: Cell, *, seed: int = 0, count_scale: float = 1.0) -> Calibration:
    """Requests, fleet, capacity, rate, unloaded p90 and cold prefill of one cell (module docstring)."""
    # Capacity, KV size and the floors are properties of the cell: always measured on its full request
    # list, whatever `count_scale` does to the runs.
    full = cell.requests(1.0)
    count = min(full, cell.requests(count_scale))
    saturated = _requests(cell, SATURATION_RATE, full, seed)
    all_tokens = tokenize_requests(saturated)
    recount = None
    if cell.token_ratio != (1.0,):
        recount = engine_recount(cell, service_estimate_ratio(saturated, all_tokens))
    probe = make_cell_workload(cell, rate=1.0, count=full, seed=seed, model=MODEL)
    prefix, profiles, cold = cell_fleet(cell, probe, all_tokens, recount)
    run = simulate(saturated, profiles, "round-robin", tokens=all_tokens, recount=recount)
    capacity = saturated_capacity(run.records, len(profiles))
    rate = cell.load * capacity
    tokens = all_tokens[:count]

    unloaded_n = min(full, UNLOADED_REQUESTS)
    unloaded = _requests(cell, UNLOADED_SHARE * capacity, unloaded_n, seed)
    idle = simulate(unloaded, profiles, "round-robin", tokens=all_tokens[:unloaded_n], recount=recount)
    idle_p90 = summarize("unloaded", idle.records, idle.virtual_s).ttft_p90_ms

    requests = _requests(cell, rate, count, seed)
    return Calibration(
        cell=cell,
        requests=requests,
        tokens=tokens,
        profiles=profiles,
        prefix_tokens=prefix,
        capacity_rps=capacity,
        rate=rate,
        rr_unloaded_p90_ms=idle_p90,
        cold_prefill_ms=cold * 1000,
        slo=cell_slo(cold),
        recount=recount,
    )


def run_cell(
    cell: Cell,
    policies: Sequence[str] = POLICIES,
    *,
    seed: int = 0,
    count_scale: float = 1.0,
    publish_interval_s: float = 1.0,
    service: dict[str, Any] | None = None,
    stability: bool = False,
) -> CellResult:
    """Every policy on the cell's requests, each on a fresh fleet (`stability`: judged by the
    `pressure` grid's targets)."""
    started = time.perf_counter()
    cal = calibrate(cell, seed=seed, count_scale=count_scale)
    names = [f"engine-{i}" for i in range(len(cal.profiles))]
    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        run = simulate(
            cal.requests,
            cal.profiles,
            policy,
            model=MODEL,
            publish_interval_s=publish_interval_s,
            service=cell_service(cell, service),
            tokens=cal.tokens,
            recount=cal.recount,
            prefill_counters=cell.prefill_counters,
            gpu_names=cell.gpu_names,
        )
        rows[policy] = policy_row(summarize(policy, run.records, run.virtual_s, cal.slo, instances=names))
    return cell_result(cal, rows, started=started, stability=stability)


def cell_service(cell: Cell, service: dict[str, Any] | None) -> dict[str, Any] | None:
    """The service's configuration for a cell: `service`, with the predicted-ttft scorer's
    `prefill_tokens_per_s` set wrong by `Cell.prefill_rate_error` (a user's guess at their GPUs)."""
    if cell.prefill_rate_error == 1.0:
        return service
    profile = {**copy.deepcopy(DEFAULT_PROFILE), "picker": SEEDED_PICKER}
    for scorer in profile["scorers"]:
        if scorer["name"] == "predicted-ttft":
            params = scorer.setdefault("params", {})
            params["prefill_tokens_per_s"] = DEFAULT_PREFILL_TOKENS_PER_S * cell.prefill_rate_error
    out = dict(service or {})
    out.setdefault("scheduling", {"profiles": {"default": profile}})
    return out


def run_des_grid(
    name: str,
    *,
    policies: Sequence[str] = POLICIES,
    cells: Sequence[str] | None = None,
    seed: int = 0,
    count_scale: float = 1.0,
    publish_interval_s: float = 1.0,
    out_dir: Path = Path("out/grid"),
    progress: Callable[[str], None] | None = print,
) -> list[CellResult]:
    """`llm-extproc simulate --grid NAME`: every policy in every cell; JSON + markdown under `out_dir`."""
    check_policies(policies, (*POLICIES, *VARIANTS))
    chosen = grid(name, cells)
    started = time.perf_counter()
    results: list[CellResult] = []
    for i, cell in enumerate(chosen, 1):
        result = run_cell(
            cell,
            policies,
            seed=seed,
            count_scale=count_scale,
            publish_interval_s=publish_interval_s,
            stability=name in STABILITY_GRIDS,
        )
        results.append(result)
        if progress:
            ours = result.policies.get("llm-extproc", {})
            progress(
                f"[{i}/{len(chosen)}] {cell.name}: {cell.requests(count_scale)} requests at "
                f"{result.rate:.2f} req/s, llm-extproc p90 {_ms(ours.get('ttft_p90_ms'))}, targets "
                + " ".join(f"{k}={v}" for k, v in result.targets.items())
                + f" ({result.wall_s:.1f} s)"
            )
    meta = {
        "grid": name,
        "mode": "discrete-event (virtual time)",
        "seed": seed,
        "count_scale": count_scale,
        "policies": list(policies),
        "publish_interval_s": publish_interval_s,
    }
    finish_grid(out_dir, f"grid-{name}", results, meta, started=started, progress=progress)
    return results


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f} ms"
