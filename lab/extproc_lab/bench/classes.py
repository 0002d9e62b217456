"""What the class-objective benches share (issue 33): the small-batch engines, the cells, the rows'
names, the shipped admission, the workload and the checks. The discrete-event bench is
`extproc_lab.discrete_event.class_objectives`, the live one `extproc_lab.bench.class_objectives_live`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from extproc_lab.bench.priorities import PEERS, goodput_hold, sheddable_first
from extproc_lab.bench.workloads import Workload, make_workload, with_priorities
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
CONFIGURED = "llm-extproc (max_num_seqs configured)"
# What a user who wants priorities sets; the bench's clients may ask for critical themselves.
SHIPPED_ADMISSION: dict[str, Any] = {"enabled": True, "client_max_priority": "critical"}
CHECKED_LOADS = (1.0, 1.2, 1.6, 2.0)


def workload(cell: ClassCell, rate: float, count: int, seed: int) -> Workload:
    """The cell's shared-prefix workload at `rate`, every request carrying its class."""
    wl = make_workload(
        "shared-prefix",
        rate=rate,
        count=count,
        seed=seed,
        tenants=cell.tenants,
        system_tokens=cell.system_tokens,
        output_tokens=cell.output_tokens,
    )
    return with_priorities(wl, seed=seed)


def class_checks(loads: dict[str, Any], row: str) -> dict[str, Any]:
    """Issue 33's checks for one row (extproc_lab.discrete_event.class_objectives' docstring): whether
    goodput holds past capacity (`bench.priorities.goodput_hold`); per checked load the critical p99
    against the lowest load's (whole run and warm), critical shed, sheddable first, goodput against
    the best peer's."""
    by_load = {float(k): v["policies"] for k, v in loads.items()}
    ordered = sorted(by_load)
    hold = goodput_hold({x: by_load[x][row]["goodput_rps"] for x in ordered})
    low = by_load[ordered[0]][row]["classes"]["critical"]
    per_load: dict[str, Any] = {}
    for x in (x for x in ordered if x in CHECKED_LOADS):
        ours = by_load[x][row]
        k = ours["classes"]
        crit = k["critical"]
        # (0, "-") where the run had no peer row (`--rows llm-extproc`), as the priorities bench's
        peer = max(((by_load[x][p]["goodput_rps"], p) for p in PEERS if p in by_load[x]), default=(0.0, "-"))
        per_load[f"{x:g}"] = {
            "critical_p99_ratio": _ratio(crit["ttft_p99_ms"], low["ttft_p99_ms"]),
            "critical_p99_steady_ratio": _ratio(crit["ttft_p99_steady_ms"], low["ttft_p99_steady_ms"]),
            "critical_shed": crit["shed"],
            "sheddable_first": sheddable_first(k),
            "goodput": ours["goodput_rps"],
            "best_peer": peer[1],
            "best_peer_goodput": peer[0],
        }
    return {"goodput_hold": hold, "loads": per_load}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b
