"""Reading an engine's pages within the publisher's limits: at most `max_metrics_bytes` read, no
redirects followed, parsed on a thread pool before the scrape's deadline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from extproc.publishers.engines import (
    EngineLoad,
    GpuReading,
    normalize,
    normalize_dcgm,
)

# Threads that parse scrapes. Parsing runs off the event loop so the loop keeps scraping and writing
# the other instances on schedule; a few threads so one slow page does not queue every other parse
# behind it (they still share the GIL with the loop: the byte cap and the deadline bound them).
PARSE_WORKERS = 4


_T = TypeVar("_T")


@dataclass(slots=True)
class ScrapeResult:
    """One scrape of one instance. `outcome` is a metric label; `detail` becomes readiness_reason;
    `message`, when set, is what an operator must read (logged once while the problem lasts)."""

    health: int | None = None
    load: EngineLoad | None = None
    outcome: str = "ok"
    detail: str = ""
    message: str = ""


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The whole body, or None as soon as it is known to exceed `cap` bytes (read no further; closing
    the response then drops the connection). aiohttp's read(n) returns what is buffered, up to n
    bytes, hence the loop (a single read may return only the first part of a larger page)."""
    declared = response.content_length
    if declared is not None and declared > cap and not response.headers.get("Content-Encoding"):
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await response.content.read(cap + 1 - size)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)


def _redirect_message(path: str, response: aiohttp.ClientResponse) -> str:
    """Why a 3xx is a failed scrape: following it would send the publisher wherever the engine says."""
    location = response.headers.get("Location", "")[:200]
    return (
        f"{path} answered {response.status} (Location {location!r}); the publisher does not follow "
        f"redirects: point the instance's path at the page itself"
    )


def _parse_engine(engine: str, body: bytes, *, deadline: float) -> EngineLoad:
    """Decode and normalise one /metrics page (runs in a parse thread)."""
    return normalize(engine, body.decode("utf-8", errors="replace"), deadline=deadline)


def _parse_dcgm(body: bytes, gpus: tuple[str, ...], *, deadline: float) -> GpuReading:
    """Decode and read one DCGM exporter page (runs in a parse thread)."""
    return normalize_dcgm(body.decode("utf-8", errors="replace"), gpus, deadline=deadline)
