"""A small open-loop load generator for OpenAI-compatible endpoints (streaming chat).

Arrivals are Poisson at a target rate and never wait for earlier requests (open loop), so a slow
upstream shows up as queueing delay, as it would for real users. Measures time to first token
(first SSE event with content) and end-to-end latency per request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class Result:
    status: int
    ttft_s: float | None
    e2e_s: float
    served_by: str | None
    error: str | None = None


@dataclass(slots=True)
class Summary:
    name: str
    requests: int
    ok: int
    errors: int
    duration_s: float
    throughput_rps: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    split: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summarize(name: str, results: list[Result], duration_s: float) -> Summary:
    ok = [r for r in results if r.status == 200 and r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s * 1000 for r in ok]
    return Summary(
        name=name,
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        duration_s=duration_s,
        throughput_rps=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p90_ms=percentile(e2e, 90),
        e2e_p99_ms=percentile(e2e, 99),
        split=dict(Counter(r.served_by or "?" for r in ok)),
    )


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    started = time.perf_counter()
    ttft: float | None = None
    try:
        async with session.post(
            url, data=orjson.dumps(body), headers={"content-type": "application/json"}
        ) as r:
            served_by = r.headers.get("x-sim-engine")
            if r.status != 200:
                await r.read()
                return Result(r.status, None, time.perf_counter() - started, served_by, f"HTTP {r.status}")
            async for _ in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - started
            return Result(200, ttft, time.perf_counter() - started, served_by)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(0, None, time.perf_counter() - started, None, type(exc).__name__)


async def open_loop(
    url: str,
    bodies: list[dict[str, Any]],
    rate_rps: float,
    *,
    seed: int = 0,
    timeout_s: float = 120.0,
) -> tuple[list[Result], float]:
    """Send `bodies` with Poisson arrivals at `rate_rps`; returns results and the wall time taken."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        tasks: list[asyncio.Task[Result]] = []
        next_at = started
        for body in bodies:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, url, body)))
            next_at += rng.expovariate(rate_rps)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - started


async def closed_loop(
    url: str, body: dict[str, Any], total: int, concurrency: int, timeout_s: float = 60.0
) -> tuple[list[Result], float]:
    """`concurrency` workers each sending the next request when the last finishes (for overhead)."""
    connector = aiohttp.TCPConnector(limit=0)
    results: list[Result] = []
    remaining = total

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            results.append(await one_request(session, url, body))

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        started = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return results, time.perf_counter() - started


def format_table(summaries: list[Summary]) -> str:
    cols = [
        ("policy", lambda s: s.name),
        ("ok/req", lambda s: f"{s.ok}/{s.requests}"),
        ("req/s", lambda s: f"{s.throughput_rps:.1f}"),
        ("TTFT p50", lambda s: _ms(s.ttft_p50_ms)),
        ("TTFT p90", lambda s: _ms(s.ttft_p90_ms)),
        ("TTFT p99", lambda s: _ms(s.ttft_p99_ms)),
        ("E2E p50", lambda s: _ms(s.e2e_p50_ms)),
        ("E2E p99", lambda s: _ms(s.e2e_p99_ms)),
        ("split", lambda s: " ".join(f"{k}:{v}" for k, v in sorted(s.split.items()))),
    ]
    rows = [[c[0] for c in cols]] + [[str(c[1](s)) for c in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
