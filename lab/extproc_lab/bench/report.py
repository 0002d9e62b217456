"""Benchmark statistics per routing policy: latency percentiles, goodput under an SLO, cache hits, balance.

``summarize`` turns per-request records into a ``Report``; ``format_table`` prints reports side by side,
``write_json`` / ``read_json`` keep them with run metadata, and ``plot`` draws a TTFT CDF and per-instance
load over time (matplotlib, optional: ``pip install matplotlib``).

Definitions:

* Percentiles are nearest-rank: the p-th percentile of n values is the ceil(p/100 * n)-th smallest, always
  an observed value (no interpolation).
* TPOT (time per output token) = (E2E - TTFT) / max(1, completion_tokens - 1): decode time per token after
  the first.
* Goodput = requests/s that succeeded with TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s`` (default 1 s
  and 100 ms); throughput counts every success, goodput only the ones users would find fast enough.
* Prefix-cache hit rate = sum(cached_tokens) / sum(prompt_tokens) over requests whose final SSE ``usage``
  chunk reported both.
* Imbalance = (max - min) / mean of per-instance request counts: 0 is even, 1 means the busiest instance
  got one mean's worth more requests than the idlest.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class Slo:
    """Latency targets for goodput; printed with every table so results state what they were held to."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s * 1000:g} ms, TPOT <= {self.tpot_s * 1000:g} ms"


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times in seconds; ``arrival_s`` is when it was sent, from the run's start.

    ``served_by`` names the upstream instance that answered (None when unknown, e.g. a connection error).
    Token counts come from the final SSE ``usage`` chunk and are None when the server sent none.
    """

    tag: str
    served_by: str | None
    status: int
    error: str | None
    arrival_s: float
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    inter_token_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / max(1, completion_tokens - 1); token count from usage, else from the gaps seen."""
        if self.ttft_s is None:
            return None
        tokens = self.completion_tokens
        if tokens is None:
            tokens = len(self.inter_token_s) + 1 if self.inter_token_s else 1
        return (self.e2e_s - self.ttft_s) / max(1, tokens - 1)

    @property
    def error_kind(self) -> str | None:
        """None for a success; else the error text, or ``HTTP <status>`` when there is none."""
        if self.ok:
            return None
        return self.error or f"HTTP {self.status}"

    def apply_usage(self, usage: Mapping[str, Any]) -> None:
        """Fill token counts from an OpenAI ``usage`` object (``prompt_tokens_details.cached_tokens``)."""
        self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        self.completion_tokens = _int_or_none(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        self.cached_tokens = (
            _int_or_none(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        )


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(slots=True)
class Report:
    """One policy's results. Latencies in milliseconds (None without data), rates per second."""

    name: str
    requests: int
    ok: int
    errors: int
    duration_s: float
    slo: Slo
    throughput_rps: float
    goodput_rps: float
    good: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    tpot_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefix_cache_hit_rate: float | None
    split: dict[str, int] = field(default_factory=dict)
    imbalance: float | None = None
    errors_by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        return cls(**{**data, "slo": Slo(**data["slo"])})


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): the ceil(q/100 * n)-th smallest value; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = math.ceil(round(q * len(ordered) / 100, 9))  # round: 0.9 * 10 must be 9, not 9.000000000000002
    return ordered[min(len(ordered), max(1, rank)) - 1]


def imbalance(counts: Iterable[int]) -> float | None:
    """(max - min) / mean of per-instance counts; None without instances or requests."""
    values = list(counts)
    if not values or sum(values) == 0:
        return None
    return (max(values) - min(values)) / (sum(values) / len(values))


def summarize(
    name: str,
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: Slo | None = None,
    *,
    instances: Iterable[str] | None = None,
) -> Report:
    """Statistics for one policy's run of ``duration_s`` seconds.

    Latency percentiles, throughput and goodput count successful requests only. The per-instance split
    counts every request with a known ``served_by`` (a routing decision was made even if the upstream then
    failed); pass ``instances`` so that instances that got nothing count as 0 in the imbalance.
    """
    slo = slo or Slo()
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    e2e = [r.e2e_s for r in ok]
    good = sum(
        1
        for r in ok
        if r.ttft_s is not None and r.ttft_s <= slo.ttft_s and (t := r.tpot_s) is not None and t <= slo.tpot_s
    )
    with_cache = [r for r in records if r.prompt_tokens is not None and r.cached_tokens is not None]
    cache_prompt = sum(r.prompt_tokens or 0 for r in with_cache)
    cache_hit = sum(r.cached_tokens or 0 for r in with_cache)
    split = Counter({i: 0 for i in instances or ()})
    split.update(r.served_by for r in records if r.served_by is not None)
    completion = sum(r.completion_tokens or 0 for r in ok)

    def per_s(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v * 1000

    return Report(
        name=name,
        requests=len(records),
        ok=len(ok),
        errors=len(records) - len(ok),
        duration_s=duration_s,
        slo=slo,
        throughput_rps=per_s(len(ok)),
        goodput_rps=per_s(good),
        good=good,
        output_tokens_per_s=per_s(completion),
        ttft_p50_ms=ms(ttft, 50),
        ttft_p90_ms=ms(ttft, 90),
        ttft_p99_ms=ms(ttft, 99),
        tpot_p50_ms=ms(tpot, 50),
        tpot_p90_ms=ms(tpot, 90),
        tpot_p99_ms=ms(tpot, 99),
        e2e_p50_ms=ms(e2e, 50),
        e2e_p90_ms=ms(e2e, 90),
        e2e_p99_ms=ms(e2e, 99),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in records),
        completion_tokens=completion,
        cached_tokens=cache_hit,
        prefix_cache_hit_rate=cache_hit / cache_prompt if cache_prompt > 0 else None,
        split=dict(sorted(split.items())),
        imbalance=imbalance(split.values()),
        errors_by_kind=dict(Counter(k for r in records if (k := r.error_kind) is not None).most_common()),
    )


# --------------------------------------------------------------------------------------------- table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


_COLUMNS: list[tuple[str, Any]] = [
    ("policy", lambda r: r.name),
    ("ok/req", lambda r: f"{r.ok}/{r.requests}"),
    ("req/s", lambda r: f"{r.throughput_rps:.2f}"),
    ("goodput/s", lambda r: f"{r.goodput_rps:.2f}"),
    ("good%", lambda r: _pct(r.good / r.requests if r.requests else None)),
    ("out tok/s", lambda r: f"{r.output_tokens_per_s:.1f}"),
    ("TTFT p50", lambda r: _ms(r.ttft_p50_ms)),
    ("TTFT p90", lambda r: _ms(r.ttft_p90_ms)),
    ("TTFT p99", lambda r: _ms(r.ttft_p99_ms)),
    ("TPOT p50", lambda r: _ms(r.tpot_p50_ms)),
    ("TPOT p90", lambda r: _ms(r.tpot_p90_ms)),
    ("TPOT p99", lambda r: _ms(r.tpot_p99_ms)),
    ("E2E p50", lambda r: _ms(r.e2e_p50_ms)),
    ("E2E p90", lambda r: _ms(r.e2e_p90_ms)),
    ("E2E p99", lambda r: _ms(r.e2e_p99_ms)),
    ("cache hit", lambda r: _pct(r.prefix_cache_hit_rate)),
    ("imbalance", lambda r: "-" if r.imbalance is None else f"{r.imbalance:.2f}"),
    ("split", lambda r: " ".join(f"{k}:{v}" for k, v in r.split.items()) or "-"),
    ("errors", lambda r: " ".join(f"{k}:{v}" for k, v in r.errors_by_kind.items()) or "-"),
]


def format_table(reports: Sequence[Report]) -> str:
    """One row per policy, preceded by the SLO(s) goodput was measured against and the units."""
    slos = {r.slo for r in reports}
    if len(slos) == 1:
        header = [f"goodput SLO: {next(iter(slos)).describe()}"]
    else:
        header = [f"goodput SLO ({r.name}): {r.slo.describe()}" for r in reports]
    header.append("latencies in ms, percentiles nearest-rank; imbalance = (max - min) / mean requests")
    rows = [[c[0] for c in _COLUMNS]] + [[str(c[1](r)) for c in _COLUMNS] for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(header + lines)


# ---------------------------------------------------------------------------------------------- JSON


def write_json(path: str | Path, reports: Sequence[Report], meta: Mapping[str, Any] | None = None) -> Path:
    """``{"meta": ..., "reports": [...]}``; meta records what was run (workload params, versions, host)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": dict(meta or {}), "reports": [r.as_dict() for r in reports]}
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path


def read_json(path: str | Path) -> tuple[list[Report], dict[str, Any]]:
    """Inverse of ``write_json``: the reports and the metadata."""
    doc = json.loads(Path(path).read_text())
    return [Report.from_dict(r) for r in doc["reports"]], doc["meta"]


# --------------------------------------------------------------------------------------------- plots


def _matplotlib() -> tuple[Any, Any]:
    """Import matplotlib only when plotting, so the benchmark runs without it."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plotting benchmark results needs matplotlib (a dependency of the lab distribution): "
            "pip install matplotlib"
        ) from exc
    return Figure, FigureCanvasAgg


def in_flight(records: Iterable[RequestRecord]) -> dict[str, tuple[list[float], list[int]]]:
    """Per instance, step points (time, requests in flight from that time on), from send to completion."""
    events: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        if r.served_by is not None:
            events.setdefault(r.served_by, []).extend([(r.arrival_s, 1), (r.arrival_s + r.e2e_s, -1)])
    out: dict[str, tuple[list[float], list[int]]] = {}
    for instance, evs in sorted(events.items()):
        evs.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
        times, counts, level = [0.0], [0], 0
        for t, delta in evs:
            level += delta
            times.append(t)
            counts.append(level)
        out[instance] = (times, counts)
    return out


def plot(
    path_prefix: str | Path,
    records_by_policy: Mapping[str, Sequence[RequestRecord]],
    *,
    slo: Slo | None = None,
) -> list[Path]:
    """Write ``<prefix>-ttft-cdf.png`` and ``<prefix>-in-flight.png``; returns their paths.

    The CDF has one line per policy (successful requests, TTFT in ms; the SLO as a dashed line if given).
    The load figure has one subplot per policy with requests in flight per instance over time, which
    shows hot spots and idle instances that averages hide. Uses the Agg backend (no display needed).
    """
    Figure, FigureCanvasAgg = _matplotlib()
    prefix = Path(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    cdf_path = prefix.with_name(prefix.name + "-ttft-cdf.png")
    load_path = prefix.with_name(prefix.name + "-in-flight.png")

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for policy, records in records_by_policy.items():
        ttft = sorted(r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None)
        if ttft:
            n = len(ttft)
            ax.step(ttft, [(i + 1) / n for i in range(n)], where="post", label=f"{policy} (n={n})")
    if slo is not None:
        ax.axvline(slo.ttft_s * 1000, color="grey", linestyle="--", label=f"SLO {slo.ttft_s * 1000:g} ms")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title("Time to first token, CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(cdf_path, dpi=100)

    n_policies = max(1, len(records_by_policy))
    fig = Figure(figsize=(10, 2.6 * n_policies + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_policies, 1, sharex=True, squeeze=False)[:, 0]
    instances = sorted({r.served_by for rs in records_by_policy.values() for r in rs if r.served_by})
    colours = {inst: f"C{i % 10}" for i, inst in enumerate(instances)}
    for ax, (policy, records) in zip(axes, records_by_policy.items(), strict=False):
        for instance, (times, counts) in in_flight(records).items():
            ax.step(times, counts, where="post", color=colours[instance], label=instance, linewidth=1)
        ax.set_title(policy)
        ax.set_ylabel("in flight")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="upper right", fontsize="small", ncols=min(4, max(1, len(instances))))
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle("Requests in flight per instance")
    fig.savefig(load_path, dpi=100)
    return [cdf_path, load_path]
