"""Load generation against any OpenAI-compatible base URL.

Open loop (`open_loop`): each request is sent at its own arrival time and never waits for earlier
ones, so a slow upstream shows up as queueing delay, as it would for real users. Closed loop
(`closed_loop`): a fixed number of workers, for overhead measurements. Streaming responses are read
event by event: time to first token is the first SSE event carrying output, inter-token gaps follow,
and the final `usage` chunk gives prompt, cached and completion tokens.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from extproc_lab.bench.report import RequestRecord


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    tag: str = "",
    arrival_s: float = 0.0,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """`headers`: sent besides content-type (a priority class, an objective, a user)."""
    started = time.perf_counter()
    rec = RequestRecord(
        tag=tag, served_by=None, status=0, error=None, arrival_s=arrival_s, ttft_s=None, e2e_s=0.0
    )
    sent = {"content-type": "application/json", **(headers or {})}
    try:
        async with session.post(url, data=orjson.dumps(body), headers=sent) as r:
            rec.status = r.status
            rec.served_by = r.headers.get("x-sim-engine") or r.headers.get("x-served-by")
            if r.status != 200:
                await r.read()
                rec.error = f"HTTP {r.status}"
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                await _read_sse(r, rec, started)
            else:
                doc = orjson.loads(await r.read())
                rec.ttft_s = time.perf_counter() - started
                if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                    rec.apply_usage(doc["usage"])
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        rec.error = type(exc).__name__
    rec.e2e_s = time.perf_counter() - started
    return rec


async def _read_sse(r: aiohttp.ClientResponse, rec: RequestRecord, started: float) -> None:
    last: float | None = None
    buf = b""
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ").strip()
            if not data or data == b"[DONE]":
                continue
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                rec.error = "bad SSE event"
                continue
            if isinstance(doc.get("usage"), dict):
                rec.apply_usage(doc["usage"])
            if doc.get("choices"):
                now = time.perf_counter()
                if rec.ttft_s is None:
                    rec.ttft_s = now - started
                elif last is not None:
                    rec.inter_token_s.append(now - last)
                last = now


async def open_loop(
    url: str,
    requests: Sequence[tuple[float, dict[str, Any], str]],
    *,
    timeout_s: float = 300.0,
    progress: str | None = None,
    headers: Sequence[dict[str, str] | None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send each (arrival_s, body, tag) at its arrival time, with `headers[i]` added to request i's
    when given; returns records and the wall time taken."""
    if headers is not None and len(headers) != len(requests):
        raise ValueError(f"{len(headers)} header sets for {len(requests)} requests")
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    done = 0
    total = len(requests)

    async def tracked(coro: Any) -> RequestRecord:
        nonlocal done
        rec = await coro
        done += 1
        if progress and (done == total or done % max(1, total // 10) == 0):
            print(
                f"\r  {progress}: {done}/{total}",
                end="" if done < total else "\n",
                file=sys.stderr,
                flush=True,
            )
        return rec

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        tasks: list[asyncio.Task[RequestRecord]] = []
        for i, (arrival, body, tag) in enumerate(requests):
            delay = started + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            extra = headers[i] if headers is not None else None
            sending = one_request(session, url, body, tag=tag, arrival_s=arrival, headers=extra)
            tasks.append(asyncio.create_task(tracked(sending)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - started


async def closed_loop(
    url: str, body: dict[str, Any], total: int, concurrency: int, timeout_s: float = 60.0
) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers each sending the next request when the last finishes (for overhead)."""
    connector = aiohttp.TCPConnector(limit=0)
    records: list[RequestRecord] = []
    remaining = total

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            records.append(await one_request(session, url, body))

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        started = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return records, time.perf_counter() - started
