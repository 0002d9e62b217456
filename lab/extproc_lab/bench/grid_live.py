"""The robustness grid live: the same cells (`extproc_lab.bench.grid`) through real processes on loopback.

Each policy gets a fresh fleet of model-driven simulated engines (the cell's GPU profiles with the
cell's KV size) and the cell's requests, open loop: `llm-extproc` (Envoy + the service + Redis + the
publisher), Envoy's own `round_robin` and `least_request`, sglang-router and vllm-router with
`--policy cache_aware` pointed at the same engines. A peer that is not installed is reported as
skipped in the results, never dropped silently.

Time runs `time_scale` times faster than the virtual time of the discrete-event mode (engines step
faster, requests are sent faster) and latencies are converted back, so the numbers compare with the
DES grid's; each router's own real overhead is magnified by `time_scale`. The cell's calibration (round
robin's capacity and so the rate, the unloaded p90, the cold-prefill floor) comes from the
discrete-event mode, passed in as `calibrate` (this package may not import the DES).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from extproc_lab.bench.grid import (
    LIVE_CELLS,
    OURS,
    STABILITY_GRIDS,
    Calibration,
    Cell,
    CellResult,
    cell_result,
    check_policies,
    finish_grid,
    grid,
    policy_row,
)
from extproc_lab.bench.report import summarize
from extproc_lab.bench.scenarios import peer_missing, run_live_requests

# Live policy -> the grid's (DES) name for what it implements, so both grids share the targets.
LIVE_NAMES = {
    "llm-extproc": OURS,
    "envoy-round-robin": "round-robin",
    "envoy-least-request": "least-request",
    "sglang-cache-aware": "sglang-cache-aware",
    "vllm-router-cache-aware": "vllm-router-cache-aware",
}


PEER_NOTES = {
    "vllm-router-cache-aware": (
        "vllm-router 0.1.17 asks every worker for POST /v1/chat/completions/render and POST /tokenize "
        "(vLLM's endpoints) before routing each chat request; the simulated engines answer 404, so it "
        "routes without token ids and pays two HTTP calls per worker per request: its live figures "
        "measure that, not its cache_aware policy on real vLLM workers"
    ),
}


def live_cells(name: str, only: Sequence[str] | None = None) -> list[Cell]:
    """The live subset of grid `name` (`LIVE_CELLS`), or the named cells of that grid."""
    if only:
        return grid(name, only)
    if name not in LIVE_CELLS:
        raise ValueError(f"no live cells for grid {name!r}; choose one of {', '.join(LIVE_CELLS)}")
    return grid(name, LIVE_CELLS[name])


async def run_live_grid(
    name: str,
    *,
    calibrate: Callable[[Cell], Calibration],
    policies: Sequence[str] = tuple(LIVE_NAMES),
    cells: Sequence[str] | None = None,
    time_scale: float = 2.0,
    out_dir: Path = Path("out/grid-live"),
    progress: Callable[[str], None] | None = print,
) -> list[CellResult]:
    """`llm-extproc bench --local --grid NAME`: every live policy in every live cell; JSON + markdown."""
    check_policies(policies, LIVE_NAMES)
    started = time.perf_counter()
    results: list[CellResult] = []
    chosen = live_cells(name, cells)
    for i, cell in enumerate(chosen, 1):
        t0 = time.perf_counter()
        cal = calibrate(cell)
        if progress:
            progress(
                f"[{i}/{len(chosen)}] {cell.name}: {cell.describe()}; {len(cal.requests)} requests at "
                f"{cal.rate:.2f} req/s virtual ({cal.rate * time_scale:.1f} real)"
            )
        rows: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        names = [f"engine-{k}" for k in range(len(cal.profiles))]
        for policy in policies:
            why = peer_missing(policy)
            ran = None
            if why is None:
                workdir = out_dir / "logs" / cell.name / policy
                ran = await run_live_requests(
                    policy,
                    cal.requests,
                    cal.profiles,
                    time_scale=time_scale,
                    workdir=workdir,
                    token_scales=[r.scale for r in cal.recount] if cal.recount else (1.0,),
                )
            if ran is None:
                skipped[LIVE_NAMES[policy]] = why or "could not start"
                if progress:
                    progress(f"  {policy}: skipped ({skipped[LIVE_NAMES[policy]]})")
                continue
            records, duration = ran
            report = summarize(policy, records, duration, cal.slo, instances=names)
            rows[LIVE_NAMES[policy]] = policy_row(report)
        result = cell_result(cal, rows, started=t0, skipped=skipped, stability=name in STABILITY_GRIDS)
        results.append(result)
        if progress:
            progress(
                "  targets "
                + " ".join(f"{k}={v}" for k, v in result.targets.items())
                + f" ({result.wall_s:.0f} s)"
            )
    meta = {
        "grid": name,
        "mode": f"live (Envoy, routers, simulated engines on loopback; time scale {time_scale:g})",
        "time_scale": time_scale,
        "policies": {LIVE_NAMES[p]: p for p in policies},
        "calibration": "discrete-event mode (capacity, rate, unloaded p90, cold prefill)",
        "notes": {LIVE_NAMES[p]: PEER_NOTES[p] for p in policies if p in PEER_NOTES},
    }
    finish_grid(out_dir, f"grid-live-{name}", results, meta, started=started, progress=progress)
    return results
