"""The robustness grid: named sets of cells (fleet, KV size, workload, load), shared by the discrete-event
grid (`llm-extproc simulate --grid`) and the live one (`llm-extproc bench --local --grid`), and the
report both write: per cell and policy TTFT p50/p90/p99 and their geometric mean, output tokens/s,
goodput, prefix-cache hits and errors; per cell the ratios the targets of issue 8 use, with PASS/MISS.

A cell is one point of the grid. Its dimensions:

- ``engines`` (4, 8, 16) and ``fleet``: ``a10g`` (all A10G engines) or ``mixed`` (H100 and A10G
  alternating, half each);
- ``kv_prefixes`` (4, 15, 60): how many of the workload's shared prefixes one engine's KV cache holds.
  The prefix is a tenant's system prompt (``tenants`` cells) or a conversation's full history at its
  last turn (``chat`` cells), in the simulated engines' tokens, measured on the cell's own requests;
  every engine of the cell gets ``ceil(kv_prefixes * prefix_tokens / block_size)`` KV blocks (a
  `GpuProfile` variant by `dataclasses.replace`, `kv_variant`), whatever its GPU;
- ``tenants`` (16, 48, 200) with Zipf popularity ``zipf`` (0.6, 1.0, 1.2) and system prompts of
  ``prompt_tokens`` (1k, 2k, 4k, 8k workload tokens), for the shared-prefix workload;
- ``conversations`` (40, 100, 200) of ``turns`` turns each, users writing 150-450 tokens and replies
  of 50-200, so histories reach ~3.5-4k tokens, for the multi-turn workload;
- ``load`` (0.5, 0.8, 0.95): the arrival rate as a fraction of round robin's capacity on that cell
  (how it is measured: `extproc_lab.discrete_event.grid`).

Grids: ``smoke`` (3 cells, minutes), ``default`` (one factor at a time around a base cell of each
workload, plus corners: every dimension value appears at least once), ``full`` (the cross product;
hours, not meant for a laptop), ``report`` (6 cells shaped like issue 8's own report: 6 engines, KV
for ~5 tenants' prompts or ~3 chats' histories; off the grids above, as a check on them).

Targets (issue 8), evaluated per cell for `llm-extproc`:

- ``p90``: TTFT p90 <= 0.3 x round robin's, where round robin is *loaded* (its TTFT p90 at least 3x its
  unloaded value, measured in the same cell at a very low rate); n/a elsewhere.
- ``geomean``: geometric mean of TTFT p50/p90/p99 <= 0.8 x the best reference's (the references:
  round-robin, least-request, sglang-cache-aware, vllm-router-cache-aware; not the exact-state or
  clairvoyant ones, reported apart), or <= 1.05 x when the references are *on the cold-miss floor*:
  the best reference's TTFT p50 is at most 1.2 x the cold-prefill time of the cell's median prompt on
  an idle engine (mean over the fleet's engines); only where round robin is loaded.
- ``tok/s``: output tokens/s >= 1.05 x round robin's; only where round robin is loaded.
- ``errors``: no failed requests (every cell).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from extproc_lab.bench.report import Report, Slo
from extproc_lab.bench.workloads import Workload, multi_turn, shared_prefix
from extproc_lab.engines.profiles import A10G_LLAMA3_8B, H100_LLAMA3_8B, GpuProfile
from extproc_lab.engines.tokens import chat_to_tokens, message_tokens

CHAT_USER_TOKENS = (150, 450)
CHAT_OUTPUT_TOKENS = (50, 200)
REFERENCES = ("round-robin", "least-request", "sglang-cache-aware", "vllm-router-cache-aware")
EXACT = "exact-ttft"
OURS = "llm-extproc"
RR = "round-robin"
LR = "least-request"
MAX_MODEL_LEN = 32_768  # context of the KV variants when their cache is larger (a deployment choice)

# Targets (issue 30), for the `pressure` grid: never behind the balancers, not far behind the best peer.
STABLE_P90_VS_LR = 1.0
STABLE_TOKS_VS_RR = 0.99  # at or above round robin's output tokens/s, within 1 % of drain-time noise
STABLE_GEOMEAN = 0.85  # off the floor
STABLE_WORST = 1.2  # every cell
STABILITY_GRIDS = frozenset({"pressure"})

# Targets (issue 8).
P90_VS_RR = 0.3
GEOMEAN_OFF_FLOOR = 0.8
GEOMEAN_ON_FLOOR = 1.05
TOKS_VS_RR = 1.05
RR_LOADED = 3.0
FLOOR = 1.2


@dataclass(frozen=True, slots=True)
class Cell:
    """One grid point; `name` says what differs from the base cell of its workload."""

    name: str
    workload: Literal["tenants", "chat"] = "tenants"
    engines: int = 8
    fleet: Literal["a10g", "mixed"] = "a10g"
    kv_prefixes: float = 15
    tenants: int = 48
    zipf: float = 1.0
    prompt_tokens: int = 2000
    conversations: int = 100
    turns: int = 10
    load: float = 0.8
    count: int | None = None  # requests per policy; None: `default_count`
    # What the service does not control and cannot see directly (the `pressure` grid):
    # the service's token estimate over the engines' own count, per engine (cycled); 1: they agree
    token_ratio: tuple[float, ...] = (1.0,)
    output_tokens: tuple[int, int] | None = None  # None: the workload's default
    prefill_counters: bool = True  # engines publish prompt-token and prefill-time counters
    prefill_rate_error: float = 1.0  # the service's configured prefill_tokens_per_s, x this
    gpu_names: Literal["right", "missing", "wrong"] = "right"  # wrong: odd engines name the other GPU
    step_cost: float = 1.0  # the engines' decode step costs x this (the service's constants assume 1)

    def default_count(self) -> int:
        """Enough requests for ~100 per engine and, for chats, every conversation's last turn."""
        n = 100 * self.engines
        if self.workload == "chat":
            n = max(n, self.conversations * self.turns)
        return max(600, n)

    def requests(self, scale: float = 1.0) -> int:
        return max(8, round((self.count or self.default_count()) * scale))

    def describe(self) -> str:
        fleet = f"{self.engines} x A10G" if self.fleet == "a10g" else f"{self.engines} mixed H100/A10G"
        if self.workload == "tenants":
            wl = f"{self.tenants} tenants zipf {self.zipf:g}, {self.prompt_tokens}-tok prompts"
        else:
            wl = f"{self.conversations} chats x {self.turns} turns"
        out = f"{fleet}, KV {self.kv_prefixes} prefixes, {wl}, load {self.load:.0%}"
        extra = []
        if self.token_ratio != (1.0,):
            extra.append("service/engine tokens " + "/".join(f"{r:g}" for r in self.token_ratio))
        if self.output_tokens is not None:
            extra.append(f"outputs {self.output_tokens[0]}-{self.output_tokens[1]}")
        if not self.prefill_counters:
            extra.append("no prefill counters")
        if self.prefill_rate_error != 1.0:
            extra.append(f"prefill_tokens_per_s x{self.prefill_rate_error:g}")
        if self.gpu_names != "right":
            extra.append(f"GPU names {self.gpu_names}")
        if self.step_cost != 1.0:
            extra.append(f"decode steps x{self.step_cost:g}")
        return out + "".join(f", {e}" for e in extra)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------- grids

BASE_TENANTS = Cell("t-base")
BASE_CHAT = Cell("c-base", workload="chat")


def _vary(base: Cell, name: str, **changes: Any) -> Cell:
    return dataclasses.replace(base, name=name, **changes)


# One factor at a time around a base cell: name suffix -> (field, value).
_FLEET_AND_KV: dict[str, tuple[str, Any]] = {
    "engines-4": ("engines", 4),
    "engines-16": ("engines", 16),
    "mixed": ("fleet", "mixed"),
    "kv-4": ("kv_prefixes", 4),
    "kv-60": ("kv_prefixes", 60),
}
_TENANT_FACTORS: dict[str, tuple[str, Any]] = {
    "tenants-16": ("tenants", 16),
    "tenants-200": ("tenants", 200),
    "zipf-0.6": ("zipf", 0.6),
    "zipf-1.2": ("zipf", 1.2),
    "prompt-1k": ("prompt_tokens", 1000),
    "prompt-4k": ("prompt_tokens", 4000),
    "prompt-8k": ("prompt_tokens", 8000),
}
_CHAT_FACTORS: dict[str, tuple[str, Any]] = {
    "conv-40": ("conversations", 40),
    "conv-200": ("conversations", 200),
}
_LOAD: dict[str, tuple[str, Any]] = {"load-50": ("load", 0.5), "load-95": ("load", 0.95)}


def _one_at_a_time(base: Cell, prefix: str, *factors: Mapping[str, tuple[str, Any]]) -> list[Cell]:
    """`base`, then one cell per entry of `factors`, named `<prefix>-<suffix>`."""
    return [base] + [
        _vary(base, f"{prefix}-{suffix}", **{field: value})
        for group in factors
        for suffix, (field, value) in group.items()
    ]


def _default_grid() -> list[Cell]:
    t, c = BASE_TENANTS, BASE_CHAT
    return [
        *_one_at_a_time(t, "t", _FLEET_AND_KV, _TENANT_FACTORS, _LOAD),
        *_one_at_a_time(c, "c", _CHAT_FACTORS, _FLEET_AND_KV, _LOAD),
        # Corners: several factors at once, mostly at high load and tight KV.
        _vary(t, "t-16e-200t-kv4-95", engines=16, tenants=200, kv_prefixes=4, load=0.95),
        _vary(t, "t-4e-16t-kv60-50", engines=4, tenants=16, kv_prefixes=60, load=0.5),
        _vary(t, "t-zipf1.2-kv4-95", zipf=1.2, kv_prefixes=4, load=0.95),
        _vary(t, "t-mixed-8k-95", fleet="mixed", prompt_tokens=8000, load=0.95),
        _vary(c, "c-200-kv4-95", conversations=200, kv_prefixes=4, load=0.95),
    ]


def _full_grid() -> list[Cell]:
    cells: list[Cell] = []
    fleets: list[tuple[int, Literal["a10g", "mixed"]]] = [
        (4, "a10g"),
        (8, "a10g"),
        (16, "a10g"),
        (8, "mixed"),
    ]
    loads = (0.5, 0.8, 0.95)
    for (n, fleet), kv, tenants, zipf, prompt, load in itertools.product(
        fleets, (4, 15, 60), (16, 48, 200), (0.6, 1.0, 1.2), (1000, 2000, 4000, 8000), loads
    ):
        name = f"t-{fleet}{n}-kv{kv}-t{tenants}-z{zipf:g}-p{prompt}-l{round(load * 100)}"
        cells.append(Cell(name, "tenants", n, fleet, kv, tenants, zipf, prompt, load=load))
    for (n, fleet), kv, conv, load in itertools.product(fleets, (4, 15, 60), (40, 100, 200), loads):
        name = f"c-{fleet}{n}-kv{kv}-c{conv}-l{round(load * 100)}"
        cells.append(Cell(name, "chat", n, fleet, kv, conversations=conv, load=load))
    return cells


def _report_grid() -> list[Cell]:
    """Cells shaped like the fleet of issue 8's report, which tried this router on engines and
    workloads written apart from this repository: 6 engines whose KV holds ~5 of 48 tenants' 2k
    prompts (or ~3 of 40 chats' histories), plus 16 tenants on the same engines. Its own engines are
    not these; the shapes are, and none of them is a cell of the grids the defaults were chosen on."""
    t = _vary(BASE_TENANTS, "r-t48-kv5-80", engines=6, kv_prefixes=5)
    c = _vary(BASE_CHAT, "r-c40-kv3-80", engines=6, conversations=40, kv_prefixes=3)
    return [
        t,
        _vary(t, "r-t48-kv5-95", load=0.95),
        _vary(t, "r-t48-kv5-p1.5k-90", prompt_tokens=1500, load=0.9),
        _vary(t, "r-t16-kv5-90", tenants=16, load=0.9),
        c,
        _vary(c, "r-c40-kv3-95", load=0.95),
    ]


PRESSURE_OUTPUT = (20, 100)  # short replies: prefill-bound engines, as in issue 30's report
# service-estimate / engine token ratios: agree, words of 3-9 letters, pairs of characters, 3x fewer
# tokens than bytes/4, and half the pool counting one way, half the other.
PRESSURE_RATIOS: dict[str, tuple[float, ...]] = {
    "r1": (1.0,),
    "r1.75": (1.75,),
    "r0.5": (0.5,),
    "r3": (3.0,),
    "rmix": (1.0, 1.75),
}


def _pressure_grid() -> list[Cell]:
    """Issue 30: KV pressure and what the service does not control. Shapes of issue 30's report (6
    engines holding ~5 of 48 tenants' prompts, 8 holding ~3, 200 tenants, 16 that all fit, chats that
    barely fit), loaded past round robin's capacity where cache-aware routing is what keeps up, each
    with engines that count tokens differently from the service's bytes/4 estimate (`token_ratio`);
    then one factor at a time on two of them: no prefill counters, a configured prefill rate 0.3x and
    3x wrong, GPU names wrong or missing on a mixed fleet, engine steps 2x slower or faster than the
    service's constants assume. `llm-extproc-token-ids` (the engines' tokenizer configured) runs beside
    the default in every cell (`simulate --grid pressure`)."""
    out = PRESSURE_OUTPUT
    shapes = {
        "t6-kv5": Cell("", engines=6, tenants=48, kv_prefixes=5, output_tokens=out, load=1.6),
        "t8-kv3": Cell("", engines=8, tenants=48, kv_prefixes=3, output_tokens=out, load=1.3),
        "c6-kv3": Cell("", "chat", engines=6, conversations=40, kv_prefixes=3, output_tokens=out, load=1.2),
    }
    more = {
        "t8-kv3-overload": Cell("", engines=8, tenants=48, kv_prefixes=3, output_tokens=out, load=2.0),
        "t8-200t-kv4": Cell("", engines=8, tenants=200, kv_prefixes=4, output_tokens=out, load=1.2),
        "t6-16t-fit": Cell(
            "", engines=6, tenants=16, prompt_tokens=1200, kv_prefixes=20, output_tokens=out, load=2.0
        ),
        "t6-16t-fit-light": Cell(
            "", engines=6, tenants=16, prompt_tokens=1200, kv_prefixes=20, output_tokens=out, load=1.0
        ),
        "c6-kv1.6": Cell(
            "", "chat", engines=6, conversations=40, kv_prefixes=1.6, output_tokens=out, load=1.1
        ),
    }
    cells = [
        _vary(base, f"p-{shape}-{r}", token_ratio=ratio)
        for shape, base in shapes.items()
        for r, ratio in PRESSURE_RATIOS.items()
    ]
    cells += [
        _vary(base, f"p-{shape}-{r}", token_ratio=PRESSURE_RATIOS[r])
        for shape, base in more.items()
        for r in ("r1", "r1.75")
    ]
    t6, t8 = shapes["t6-kv5"], shapes["t8-kv3"]
    r175 = PRESSURE_RATIOS["r1.75"]
    cells += [
        _vary(t6, "p-t6-kv5-r1.75-no-counters", token_ratio=r175, prefill_counters=False),
        _vary(t8, "p-t8-kv3-r1.75-no-counters", token_ratio=r175, prefill_counters=False),
        _vary(t6, "p-t6-kv5-r1.75-rate-x0.3", token_ratio=r175, prefill_rate_error=0.3),
        _vary(t6, "p-t6-kv5-r1.75-rate-x3", token_ratio=r175, prefill_rate_error=3.0),
        _vary(t8, "p-t8-kv3-rate-x0.3", prefill_rate_error=0.3),
        _vary(t8, "p-t8-kv3-rate-x3", prefill_rate_error=3.0),
        _vary(t6, "p-t6-kv5-mixed", fleet="mixed"),
        _vary(t6, "p-t6-kv5-mixed-gpu-wrong", fleet="mixed", gpu_names="wrong"),
        _vary(t6, "p-t6-kv5-mixed-gpu-missing", fleet="mixed", gpu_names="missing"),
        _vary(t8, "p-t8-kv3-steps-x2", step_cost=2.0),
        _vary(t8, "p-t8-kv3-steps-x0.5", step_cost=0.5),
    ]
    return cells


LIVE_CELLS: dict[str, tuple[str, ...]] = {
    "smoke": ("t-base", "c-base"),
    "default": ("t-base", "t-kv-4", "t-tenants-200", "t-load-95", "t-mixed", "c-base", "c-load-95"),
    "pressure": ("p-t6-kv5-r1.75", "p-t8-kv3-r1.75", "p-c6-kv3-r1.75"),
}
"""The cells of each grid that `llm-extproc bench --local --grid` runs live (each costs real seconds)."""

GRIDS: dict[str, list[Cell]] = {
    "smoke": [
        BASE_TENANTS,
        BASE_CHAT,
        _vary(BASE_TENANTS, "t-mixed-kv4-95", fleet="mixed", kv_prefixes=4, load=0.95),
    ],
    "default": _default_grid(),
    "full": _full_grid(),
    "report": _report_grid(),
    "pressure": _pressure_grid(),
}

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "engines": (4, 8, 16),
    "fleet": ("a10g", "mixed"),
    "kv_prefixes": (4, 15, 60),
    "tenants": (16, 48, 200),
    "zipf": (0.6, 1.0, 1.2),
    "prompt_tokens": (1000, 2000, 4000, 8000),
    "conversations": (40, 100, 200),
    "load": (0.5, 0.8, 0.95),
}
"""Every value issue 8 asks for; `default` and `full` cover each (tests check)."""


def check_policies(policies: Sequence[str], known: Collection[str]) -> None:
    """ValueError naming the policies that are not in `known`, if any."""
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(known)}")


def grid(name: str, only: Sequence[str] | None = None) -> list[Cell]:
    """The cells of a named grid, optionally only those named in `only`."""
    try:
        cells = GRIDS[name]
    except KeyError:
        raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}") from None
    if only:
        unknown = set(only) - {c.name for c in cells}
        if unknown:
            raise ValueError(f"cells {sorted(unknown)} are not in grid {name!r}")
        cells = [c for c in cells if c.name in only]
    return list(cells)


# ------------------------------------------------------------------------------------ cell set-up


def make_cell_workload(cell: Cell, *, rate: float, count: int, seed: int, model: str) -> Workload:
    """The cell's requests at `rate`. Content does not depend on the rate (only arrival times do)."""
    if cell.workload == "tenants":
        return shared_prefix(
            rate=rate,
            count=count,
            seed=seed,
            model=model,
            tenants=cell.tenants,
            system_tokens=cell.prompt_tokens,
            zipf_s=cell.zipf,
            **({"output_tokens": cell.output_tokens} if cell.output_tokens else {}),
        )
    return multi_turn(
        rate=rate,
        count=count,
        seed=seed,
        model=model,
        conversations=cell.conversations,
        turns=cell.turns,
        user_tokens=CHAT_USER_TOKENS,
        output_tokens=cell.output_tokens or CHAT_OUTPUT_TOKENS,
    )


def prefix_tokens(cell: Cell, wl: Workload) -> int:
    """Simulated-engine tokens of one of the workload's shared prefixes: the mean tenant system prompt,
    or the mean conversation history at its last turn (extrapolated linearly from the turns seen when
    the run is too short to reach it)."""
    if cell.workload == "tenants":
        sizes: dict[str, int] = {}
        for r in wl.requests:
            if r.tag not in sizes:
                system = r.body["messages"][0]
                sizes[r.tag] = len(message_tokens(system["role"], system["content"]))
        return round(statistics.mean(sizes.values())) if sizes else cell.prompt_tokens
    longest: dict[str, tuple[int, int]] = {}  # conversation -> (turns seen, longest prompt)
    for r in wl.requests:
        n = len(chat_to_tokens(r.body["messages"]))
        seen, top = longest.get(r.tag, (0, 0))
        longest[r.tag] = (seen + 1, max(top, n))
    if not longest:
        return 1
    return round(statistics.mean(top * cell.turns / seen for seen, top in longest.values()))


def kv_variant(profile: GpuProfile, blocks: int) -> GpuProfile:
    """`profile` with `blocks` KV blocks; its context is capped by the cache (vLLM refuses a
    max_model_len above it) and otherwise raised to at least MAX_MODEL_LEN."""
    capacity = blocks * profile.block_size
    return dataclasses.replace(
        profile,
        name=f"{profile.name}-kv{blocks}",
        num_gpu_blocks=blocks,
        max_model_len=min(capacity, max(profile.max_model_len, MAX_MODEL_LEN)),
    )


def cell_profiles(
    cell: Cell, prefix: int, longest_request: int, scales: Sequence[float] = (1.0,)
) -> list[GpuProfile]:
    """One profile per engine: the cell's GPUs, each with KV for `kv_prefixes` prefixes of `prefix`
    tokens (and at least room for the longest request, prompt plus output, so every request can run).
    `scales` (cycled over the engines): engine tokens per workload token, when the engines' tokenizer
    counts differently (`Cell.token_ratio`); an engine's KV is sized in its own tokens."""
    base = [A10G_LLAMA3_8B] * cell.engines
    if cell.fleet == "mixed":
        base = [H100_LLAMA3_8B if i % 2 == 0 else A10G_LLAMA3_8B for i in range(cell.engines)]
    if cell.step_cost != 1.0:
        f = cell.step_cost
        slow = {
            p.name: dataclasses.replace(
                p,
                name=f"{p.name}-steps{f:g}",
                decode_base_s=p.decode_base_s * f,
                decode_s_per_seq=p.decode_s_per_seq * f,
                decode_s_per_kv_token=p.decode_s_per_kv_token * f,
            )
            for p in base
        }
        base = [slow[p.name] for p in base]
    bs = base[0].block_size
    variants: dict[tuple[str, int], GpuProfile] = {}
    out = []
    for i, p in enumerate(base):
        s = scales[i % len(scales)]
        blocks = max(math.ceil(cell.kv_prefixes * prefix * s / bs), math.ceil(longest_request * s / bs) + 1)
        key = (p.name, blocks)
        if key not in variants:
            variants[key] = kv_variant(p, blocks)
        out.append(variants[key])
    return out


@dataclass(slots=True)
class Calibration:
    """A cell made concrete (by `extproc_lab.discrete_event.grid.calibrate`): its requests at its rate
    in virtual seconds, its engines, round robin's capacity, and the reference latencies."""

    cell: Cell
    requests: list[tuple[float, dict[str, Any], str]]
    tokens: list[list[int]]
    profiles: list[GpuProfile]
    prefix_tokens: int
    capacity_rps: float
    rate: float
    rr_unloaded_p90_ms: float | None
    cold_prefill_ms: float
    slo: Slo
    recount: Any = None  # per engine, its tokenizer where it differs from the service's estimate

    @property
    def kv_blocks(self) -> int:
        return self.profiles[0].num_gpu_blocks


def cell_slo(cold_prefill_s: float) -> Slo:
    """Goodput SLO of a cell: TTFT within max(1 s, 2 x the cold prefill of its median prompt), TPOT 100 ms
    (a 1 s TTFT cannot be met by any router when one cold 8k-token prefill takes 3 s)."""
    return Slo(ttft_s=max(1.0, 2 * cold_prefill_s), tpot_s=0.1)


# ------------------------------------------------------------------------------------------ results


def geomean(*values: float | None) -> float | None:
    if any(v is None or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values if v is not None) / len(values))


def policy_row(report: Report) -> dict[str, Any]:
    """What the grid keeps of one policy's run (latencies in ms)."""
    return {
        "ttft_p50_ms": report.ttft_p50_ms,
        "ttft_p90_ms": report.ttft_p90_ms,
        "ttft_p99_ms": report.ttft_p99_ms,
        "ttft_geomean_ms": geomean(report.ttft_p50_ms, report.ttft_p90_ms, report.ttft_p99_ms),
        "output_tokens_per_s": report.output_tokens_per_s,
        "goodput_rps": report.goodput_rps,
        "good_fraction": report.good / report.requests if report.requests else None,
        "throughput_rps": report.throughput_rps,
        "prefix_cache_hit_rate": report.prefix_cache_hit_rate,
        "requests": report.requests,
        "errors": report.errors,
        "errors_by_kind": report.errors_by_kind,
        "imbalance": report.imbalance,
        "busiest_share": _busiest(report.split),
        "duration_s": report.duration_s,
    }


def _busiest(split: Mapping[str, int]) -> float | None:
    """The busiest engine's requests over the mean per engine (1: an even split)."""
    counts = list(split.values())
    return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def evaluate(
    policies: Mapping[str, Mapping[str, Any]],
    *,
    rr_unloaded_p90_ms: float | None,
    cold_prefill_ms: float,
    stability: bool = False,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The cell's ratios and its targets' PASS / MISS / n/a (module docstring). Policies missing from
    the run (a peer that is not installed) are left out of the references. `stability`: the
    `pressure` grid's targets (`stability_targets`) instead of issue 8's."""
    ours, rr, exact = policies.get(OURS), policies.get(RR), policies.get(EXACT)
    refs = {n: p for n, p in policies.items() if n in REFERENCES and p.get("ttft_geomean_ms") is not None}
    best_ref = min(refs, key=lambda n: refs[n]["ttft_geomean_ms"]) if refs else None
    ratios: dict[str, Any] = {
        "best_reference": best_ref,
        "rr_unloaded_p90_ms": rr_unloaded_p90_ms,
        "cold_prefill_ms": cold_prefill_ms,
    }
    rr_p90 = rr["ttft_p90_ms"] if rr else None
    ratios["rr_p90_vs_unloaded"] = _ratio(rr_p90, rr_unloaded_p90_ms)
    loaded = ratios["rr_p90_vs_unloaded"] is not None and ratios["rr_p90_vs_unloaded"] >= RR_LOADED
    ratios["rr_loaded"] = loaded
    best_p50 = refs[best_ref]["ttft_p50_ms"] if best_ref else None
    ratios["best_ref_p50_vs_cold"] = _ratio(best_p50, cold_prefill_ms)
    on_floor = best_p50 is not None and best_p50 <= FLOOR * cold_prefill_ms
    ratios["refs_on_floor"] = on_floor
    if ours is None:
        return ratios, {"p90": "n/a", "geomean": "n/a", "tok/s": "n/a", "errors": "n/a"}
    ratios["p90_vs_rr"] = _ratio(ours["ttft_p90_ms"], rr_p90)
    ratios["geomean_vs_best_ref"] = _ratio(
        ours["ttft_geomean_ms"], refs[best_ref]["ttft_geomean_ms"] if best_ref else None
    )
    ratios["geomean_vs_exact"] = _ratio(ours["ttft_geomean_ms"], exact["ttft_geomean_ms"] if exact else None)
    ratios["tok_s_vs_rr"] = _ratio(ours["output_tokens_per_s"], rr["output_tokens_per_s"] if rr else None)
    geomean_bound = GEOMEAN_ON_FLOOR if on_floor else GEOMEAN_OFF_FLOOR
    ratios["geomean_bound"] = geomean_bound

    def check(value: float | None, ok: bool) -> str:
        if not loaded:
            return "n/a"
        return "MISS" if value is None or not ok else "PASS"

    lr = policies.get(LR)
    ratios["p90_vs_lr"] = _ratio(ours["ttft_p90_ms"], lr["ttft_p90_ms"] if lr else None)
    if stability:
        return ratios, stability_targets(ratios, ours["errors"])
    p90, gm, toks = ratios["p90_vs_rr"], ratios["geomean_vs_best_ref"], ratios["tok_s_vs_rr"]
    targets = {
        "p90": check(p90, p90 is not None and p90 <= P90_VS_RR),
        "geomean": check(gm, gm is not None and gm <= geomean_bound),
        "tok/s": check(toks, toks is not None and toks >= TOKS_VS_RR),
        "errors": "PASS" if ours["errors"] == 0 else "MISS",
    }
    return ratios, targets


@dataclass(slots=True)
class CellResult:
    cell: Cell
    rate: float
    capacity_rps: float
    prefix_tokens: int
    kv_blocks: int
    slo: Slo
    policies: dict[str, dict[str, Any]]
    ratios: dict[str, Any]
    targets: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # policy -> why it did not run
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "cell": self.cell.as_dict(),
            "describe": self.cell.describe(),
            "rate_rps": self.rate,
            "capacity_rps": self.capacity_rps,
            "prefix_tokens": self.prefix_tokens,
            "kv_blocks_per_engine": self.kv_blocks,
            "slo": dataclasses.asdict(self.slo),
            "policies": self.policies,
            "ratios": self.ratios,
            "targets": self.targets,
            "skipped": self.skipped,
            "wall_s": self.wall_s,
        }


def _f(v: float | None, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def _triple(p: Mapping[str, Any] | None) -> str:
    if not p:
        return "-"
    return " / ".join(_f(p.get(k)) for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"))


def stability_table(results: Sequence[CellResult]) -> str:
    """The `pressure` grid's rows, worst cell first: llm-extproc (and its variants) against least
    request, round robin and the best reference, with the busiest engine's share of the requests."""
    variants = sorted({n for r in results for n in r.policies if n.startswith(OURS + "-")})
    head = (
        "| cell | rate (req/s) | llm-extproc TTFT p50/p90/p99 ms | best reference | geomean / best "
        + "".join(f"| {v.removeprefix(OURS + '-')} / best " for v in variants)
        + "| p90 / LR | tok/s / RR | busiest / fair | hit % (best ref) | p90/LR | tok/s/RR | geomean "
        "| worst | errors |"
    )
    lines = [head, "|" + "---|" * (14 + len(variants))]
    ordered = sorted(results, key=lambda r: -(r.ratios.get("geomean_vs_best_ref") or 0.0))
    for r in ordered:
        ra, t = r.ratios, r.targets
        best = ra.get("best_reference")
        ours = r.policies.get(OURS) or {}
        ref = r.policies.get(best) if best else None
        cells = ""
        for v in variants:
            row, ref_gm = r.policies.get(v), ref.get("ttft_geomean_ms") if ref else None
            cells += f"| {_f(_ratio(row.get('ttft_geomean_ms') if row else None, ref_gm), '.2f')} "
        hit, ref_hit = ours.get("prefix_cache_hit_rate"), (ref or {}).get("prefix_cache_hit_rate")
        lines.append(
            f"| {r.cell.name} | {r.rate:.2f} | {_triple(ours)} | {best or '-'}: {_triple(ref)} "
            f"| {_f(ra.get('geomean_vs_best_ref'), '.2f')} {cells}"
            f"| {_f(ra.get('p90_vs_lr'), '.2f')} | {_f(ra.get('tok_s_vs_rr'), '.2f')} "
            f"| {_f(ours.get('busiest_share'), '.2f')} "
            f"| {_f(None if hit is None else hit * 100)} ({_f(None if ref_hit is None else ref_hit * 100)}) "
            + " ".join(f"| {t.get(k, '-')}" for k in ("p90/LR", "tok/s/RR", "geomean", "worst", "errors"))
            + " |"
        )
    return "\n".join(lines)


def summary_table(results: Sequence[CellResult]) -> str:
    """One markdown row per cell: llm-extproc against round robin and the best reference."""
    if results and "worst" in results[0].targets:
        return stability_table(results)
    head = (
        "| cell | rate (req/s) | llm-extproc TTFT p50/p90/p99 ms | round robin | best reference "
        "| p90 / RR | geomean / best ref | geomean / exact | tok/s / RR | RR p90 / unloaded | floor "
        "| p90 | geomean | tok/s | errors |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in results:
        ra, t = r.ratios, r.targets
        best = ra.get("best_reference")
        lines.append(
            f"| {r.cell.name} | {r.rate:.2f} ({r.cell.load:.0%} of {r.capacity_rps:.2f}) "
            f"| {_triple(r.policies.get(OURS))} | {_triple(r.policies.get(RR))} "
            f"| {best or '-'}: {_triple(r.policies.get(best) if best else None)} "
            f"| {_f(ra.get('p90_vs_rr'), '.2f')} "
            f"| {_f(ra.get('geomean_vs_best_ref'), '.2f')} (≤ {ra.get('geomean_bound', '-')}) "
            f"| {_f(ra.get('geomean_vs_exact'), '.2f')} | {_f(ra.get('tok_s_vs_rr'), '.3f')} "
            f"| {_f(ra.get('rr_p90_vs_unloaded'), '.1f')}x | {'on' if ra.get('refs_on_floor') else 'off'} "
            f"| {t['p90']} | {t['geomean']} | {t['tok/s']} | {t['errors']} |"
        )
    return "\n".join(lines)


def variant_lines(results: Sequence[CellResult]) -> list[str]:
    """llm-extproc run another way beside the default (rows named `llm-extproc-*`, e.g. with the
    engines' KV events): its geometric-mean TTFT against the best reference and against the
    default's, over the cells where all three ran; the cells where it is > 5 % worse or better."""
    names = sorted({n for r in results for n in r.policies if n.startswith(OURS + "-")})
    out: list[str] = []
    for name in names:
        rows = []
        for r in results:
            ours, other = r.policies.get(OURS), r.policies.get(name)
            best = r.ratios.get("best_reference")
            ref = r.policies.get(best) if best else None
            values = [p.get("ttft_geomean_ms") if p else None for p in (other, ours, ref)]
            if all(v is not None and v > 0 for v in values):
                v, o, b = (float(x) for x in values if x is not None)
                rows.append((r.cell.name, v / b, o / b, v / o))
        if not rows:
            continue

        def gm(i: int, rows: list[tuple[str, float, float, float]] = rows) -> float:
            return math.exp(sum(math.log(float(row[i])) for row in rows) / len(rows))

        worse = [f"{c} {x:.2f}x" for c, _, _, x in sorted(rows, key=lambda row: -row[3]) if x > 1.05]
        better = [f"{c} {x:.2f}x" for c, _, _, x in sorted(rows, key=lambda row: row[3]) if x < 1 / 1.05]
        out += [
            f"## Variant `{name}`",
            "",
            f"Over {len(rows)} cells, geometric mean of TTFT geomean / best reference: {gm(1):.3f} "
            f"(`{OURS}`: {gm(2):.3f}); / `{OURS}`: {gm(3):.3f}.",
            f"- > 5 % worse than `{OURS}`: {', '.join(worse) or 'none'}",
            f"- > 5 % better: {', '.join(better) or 'none'}",
            "",
        ]
    return out


def detail_table(result: CellResult) -> str:
    """Every policy of one cell."""
    lines = [
        f"#### {result.cell.name}: {result.cell.describe()}",
        "",
        f"rate {result.rate:.2f} req/s = {result.cell.load:.0%} of round robin's capacity "
        f"{result.capacity_rps:.2f}; prefix {result.prefix_tokens} tokens, {result.kv_blocks} KV blocks per "
        f"engine; cold prefill {_f(result.ratios.get('cold_prefill_ms'))} ms; round robin unloaded "
        f"p90 {_f(result.ratios.get('rr_unloaded_p90_ms'))} ms; goodput SLO {result.slo.describe()}",
        "",
        "| policy | TTFT p50 | p90 | p99 | geomean | out tok/s | goodput/s | good % | hit % | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in result.policies.items():
        good = p.get("good_fraction")
        hit = p.get("prefix_cache_hit_rate")
        lines.append(
            f"| {name} | {_f(p['ttft_p50_ms'])} | {_f(p['ttft_p90_ms'])} | {_f(p['ttft_p99_ms'])} "
            f"| {_f(p['ttft_geomean_ms'])} | {_f(p['output_tokens_per_s'], '.1f')} "
            f"| {_f(p['goodput_rps'], '.2f')} | {_f(None if good is None else good * 100, '.1f')} "
            f"| {_f(None if hit is None else hit * 100, '.1f')} | {p['errors']} |"
        )
    for name, why in result.skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | | |")
    return "\n".join(lines)


def misses(results: Sequence[CellResult]) -> list[str]:
    """One line per missed target: which cell, which target, by how much."""
    out = []
    for r in results:
        ra = r.ratios
        for target, verdict in r.targets.items():
            if verdict != "MISS":
                continue
            if target == "p90":
                out.append(
                    f"{r.cell.name}: TTFT p90 {ra['p90_vs_rr']:.2f}x round robin (target <= {P90_VS_RR})"
                )
            elif target == "geomean":
                bound = STABLE_GEOMEAN if "worst" in r.targets else ra["geomean_bound"]
                out.append(
                    f"{r.cell.name}: TTFT geomean {ra['geomean_vs_best_ref']:.2f}x {ra['best_reference']} "
                    f"(target <= {bound})"
                )
            elif target == "tok/s":
                out.append(
                    f"{r.cell.name}: output tok/s {ra['tok_s_vs_rr']:.3f}x round robin "
                    f"(target >= {TOKS_VS_RR})"
                )
            elif target == "p90/LR":
                out.append(f"{r.cell.name}: TTFT p90 {ra['p90_vs_lr']:.2f}x least request's")
            elif target == "tok/s/RR":
                out.append(f"{r.cell.name}: output tok/s {ra['tok_s_vs_rr']:.3f}x round robin's")
            elif target == "worst":
                out.append(
                    f"{r.cell.name}: TTFT geomean {ra['geomean_vs_best_ref']:.2f}x {ra['best_reference']} "
                    f"(every cell <= {STABLE_WORST})"
                )
            else:
                out.append(f"{r.cell.name}: {r.policies[OURS]['errors']} errors")
    return out


def stability_targets(ratios: Mapping[str, Any], errors: int) -> dict[str, str]:
    """Issue 30's targets for one cell: TTFT p90 at or below least request's, output tokens/s at or
    above round robin's, TTFT geomean <= 0.85x the best reference off the floor, and <= 1.2x it in
    every cell; no errors. A target whose reference was not run (`--policies` without it) is n/a."""

    def check(value: float | None, ok: Callable[[float], bool]) -> str:
        if value is None:
            return "n/a"
        return "PASS" if ok(value) else "MISS"

    gm = ratios.get("geomean_vs_best_ref")
    return {
        "p90/LR": check(ratios.get("p90_vs_lr"), lambda v: v <= STABLE_P90_VS_LR),
        "tok/s/RR": check(ratios.get("tok_s_vs_rr"), lambda v: v >= STABLE_TOKS_VS_RR),
        "geomean": "n/a" if ratios.get("refs_on_floor") else check(gm, lambda v: v <= STABLE_GEOMEAN),
        "worst": check(gm, lambda v: v <= STABLE_WORST),
        "errors": "PASS" if errors == 0 else "MISS",
    }


def cell_result(
    cal: Calibration,
    policies: dict[str, dict[str, Any]],
    *,
    started: float,
    skipped: dict[str, str] | None = None,
    stability: bool = False,
) -> CellResult:
    """A calibrated cell's result from its policies' rows (`policy_row`): ratios and targets
    (`evaluate`), wall time since `started` (`time.perf_counter()`)."""
    ratios, targets = evaluate(
        policies,
        rr_unloaded_p90_ms=cal.rr_unloaded_p90_ms,
        cold_prefill_ms=cal.cold_prefill_ms,
        stability=stability,
    )
    return CellResult(
        cell=cal.cell,
        rate=cal.rate,
        capacity_rps=cal.capacity_rps,
        prefix_tokens=cal.prefix_tokens,
        kv_blocks=cal.kv_blocks,
        slo=cal.slo,
        policies=policies,
        ratios=ratios,
        targets=targets,
        skipped={} if skipped is None else skipped,
        wall_s=time.perf_counter() - started,
    )


def write_results(
    out_dir: Path, stem: str, results: Sequence[CellResult], meta: Mapping[str, Any]
) -> tuple[Path, Path]:
    """`<stem>.json` (every number) and `<stem>.md` (summary table, misses, per-cell details)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": dict(meta), "cells": [r.as_dict() for r in results]}
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    passes = sum(v == "PASS" for r in results for v in r.targets.values())
    total = sum(v != "n/a" for r in results for v in r.targets.values())
    md = [
        f"# Robustness grid `{meta.get('grid')}` ({meta.get('mode')})",
        "",
        ", ".join(f"{k}: {v}" for k, v in meta.items() if k not in ("grid", "mode")),
        "",
        f"Targets met: {passes} of {total} applicable (n/a: round robin not loaded, RR p90 < "
        f"{RR_LOADED:g}x unloaded).",
        "",
        summary_table(results),
        "",
        "## Misses",
        "",
        *([f"- {m}" for m in misses(results)] or ["none"]),
        "",
        *variant_lines(results),
        "## Cells",
        "",
    ]
    for r in results:
        md += [detail_table(r), ""]
    md_path = out_dir / f"{stem}.md"
    md_path.write_text("\n".join(md))
    return json_path, md_path


def finish_grid(
    out_dir: Path,
    stem: str,
    results: Sequence[CellResult],
    meta: Mapping[str, Any],
    *,
    started: float,
    progress: Callable[[str], None] | None,
) -> None:
    """`write_results` with the run's wall time (since `started`) and date added to `meta`; the summary
    table and where the results are to `progress`."""
    meta = {
        **meta,
        "wall_s": round(time.perf_counter() - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    json_path, md_path = write_results(out_dir, stem, results, meta)
    if progress:
        progress(summary_table(results))
        progress(f"results: {json_path}, {md_path} ({meta['wall_s']} s)")
