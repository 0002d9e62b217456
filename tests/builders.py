"""Shared builders for unit tests: routing records with sensible defaults, overridden per test."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from extproc.fleet import InstanceState
from extproc.fleet import snapshot_pb2 as spb
from extproc.openai import Api, InferenceRequest

NOW = 1_700_000_000.0
# A profile of text-block prefix affinity bounded by queue length, plus load scorers and the KV-usage
# cut-off: these plugins, combined as a user might, for the tests of their interplay.
AFFINITY_PROFILE: dict[str, Any] = {
    "filters": ["saturation"],
    "scorers": [
        {"name": "prefix-affinity", "weight": 3.0},
        {"name": "queue-depth", "weight": 1.0},
        {"name": "kv-cache-usage", "weight": 0.5},
        {"name": "least-outstanding", "weight": 0.5},
    ],
    "picker": "max-score",
}


def chat_request(
    *, session: str | None = None, user: str | None = None, prompt_text: str = "hello", body_bytes: int = 0
) -> InferenceRequest:
    return InferenceRequest(
        api=Api.CHAT,
        model="m",
        stream=False,
        max_tokens=None,
        prompt_text=prompt_text,
        prompt_token_ids=None,
        session=session,
        user=user,
        priority=0,
        body_bytes=body_bytes,
    )


def instance_state(upstream_id: str, cluster: str, address: str | None, **overrides: Any) -> InstanceState:
    """A fresh READY instance published at NOW with a 3 s TTL and no load."""
    fields: dict[str, Any] = {
        "upstream_id": upstream_id,
        "cluster": cluster,
        "address": address,
        "engine": "vllm",
        "models": frozenset({"m"}),
        "lora_adapters": frozenset(),
        "readiness": spb.READY,
        "weight": 1.0,
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "kv_blocks_total": 0,
        "kv_blocks_free": 0,
        "block_size": 0,
        "max_model_len": 0,
        "prefix_cache_hit_rate": None,
        "ttft_s": None,
        "tpot_s": None,
        "publisher_id": "p",
        "sequence": 1,
        "published_at": NOW,
        "expires_at": NOW + 3.0,
    }
    fields.update(overrides)
    return InstanceState(**fields)


async def serve_http(method: str, path: str, handler: Any) -> tuple[web.AppRunner, int]:
    """A one-route aiohttp server on a free loopback port: (runner to clean up, port)."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


class IdleState:
    """The scheduling state admission reads, for unit tests: no snapshots, no requests in flight, no
    batch limit known (`batches` gives upstreams their (occupancy, limit, turnover))."""

    def __init__(self, batches: dict[str, tuple[float, float | None, float | None]] | None = None) -> None:
        self.batches = batches if batches is not None else {}

    def count(self, uid: str) -> int:
        return 0

    def load(self, uid: str) -> Any:
        return None

    def pending(self, uid: str) -> int:
        return 0

    def batch(
        self, uid: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return self.batches.get(uid, (0.0, None, None))

    def now(self) -> float:
        return 0.0


class FixedBacklog:
    """A model of the prefill queues for admission's unit tests (`Admission(prefill=...)`): each
    upstream's (queued prefill seconds, mean prefill seconds per request) from `of(upstream)`."""

    def __init__(self, of: Any) -> None:
        self.of = of

    def backlog(self, upstream: Any, state: Any) -> tuple[float, float]:
        return self.of(upstream)  # type: ignore[no-any-return]
