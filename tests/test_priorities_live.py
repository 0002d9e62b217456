"""Priorities and shedding through real Envoy: a sheddable request at saturation gets 429 with
Retry-After and an OpenAI-style body, a standard one waits in the service's queue and is served when
capacity frees, a route can fix a class its clients cannot raise, and a client that goes away while
queued leaves the queue, and an overloaded queue sheds its stale waiters at once and serves the newest.
Saturation here is one in-flight request per cluster (no snapshots)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from gateway_stack import MODEL, Stack, service_config, wait_until

pytestmark = pytest.mark.envoy

SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
LONG = {**SHORT, "max_tokens": 60}  # 60 tokens x 10 ms: holds its engine ~0.6 s
# First come, first served here (the overload mode, its own test below, would shed a waiter that a
# slow machine kept past 0.25 s).
ADMISSION = {
    "enabled": True,
    "max_inflight_per_weight": 1,
    "max_wait_s": 1.5,
    "retry_after_s": 2,
    "overload_wait_s": None,
    "client_max_priority": "critical",  # these clients may ask for critical themselves
}


def batch_route(cfg: dict[str, Any]) -> None:
    """Requests with `x-tenant: batch` take a route whose metadata fixes the class to sheddable."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(
        0,
        {
            "match": {"prefix": "/", "headers": [{"name": "x-tenant", "string_match": {"exact": "batch"}}]},
            "route": {"cluster_header": "x-llm-destination-cluster", "timeout": "0s"},
            "typed_per_filter_config": {
                "envoy.filters.http.ext_proc": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                    "overrides": {"grpc_initial_metadata": [{"key": "x-llm-priority", "value": "sheddable"}]},
                }
            },
        },
    )


@pytest.fixture
def stack(make_stack: Callable[..., Stack]) -> Stack:
    s = make_stack(service=service_config(admission=ADMISSION), envoy_edit=batch_route)
    for e in s.engines.engines:
        e.token_delay_s = 0.01
    return s


async def post(session: aiohttp.ClientSession, stack: Stack, body: dict[str, Any], **headers: str) -> Any:
    async with session.post(stack.url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, r.headers.copy(), await r.read()


async def saturate(session: aiohttp.ClientSession, stack: Stack) -> list[asyncio.Task[Any]]:
    """Two long requests, one per cluster, in flight before returning."""
    held = [asyncio.create_task(post(session, stack, LONG)) for _ in range(2)]
    assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 2, 5.0)
    return held


def admission(stack: Stack, klass: str, decision: str, reason: str) -> float:
    key = f'llm_extproc_admission_total{{decision="{decision}",priority="{klass}",reason="{reason}"}}'
    return stack.metrics().get(key, 0.0)


async def test_sheddable_gets_429_at_once_and_standard_queues_then_is_served(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        held = await saturate(session, stack)
        status, headers, body = await post(session, stack, SHORT, **{"x-llm-priority": "sheddable"})
        assert status == 429
        assert headers["retry-after"] == "2"
        error = orjson.loads(body)["error"]
        assert (error["code"], error["type"]) == ("saturated", "rate_limit_error")
        assert all(not t.done() for t in held)  # shed while both long requests still ran

        status, _, _ = await post(session, stack, SHORT)  # standard: waits, then is served
        assert status == 200
        assert [(await t)[0] for t in held] == [200, 200]
    assert admission(stack, "standard", "queued", "saturated") == 1
    assert admission(stack, "standard", "admitted", "dequeued") == 1
    assert admission(stack, "sheddable", "shed", "saturated") == 1


async def test_route_fixes_a_class_the_client_cannot_raise(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        held = await saturate(session, stack)
        critical = {"x-llm-priority": "critical"}
        status, _, _ = await post(session, stack, SHORT, **critical, **{"x-tenant": "batch"})
        assert status == 429  # the batch route says sheddable, whatever the client claims
        status, _, _ = await post(session, stack, SHORT, **critical)
        assert status == 200  # on the default route the same header is honoured: admitted over the cap
        await asyncio.gather(*held)
    assert admission(stack, "sheddable", "shed", "saturated") == 1
    assert admission(stack, "critical", "admitted", "critical") == 1


async def test_client_gone_while_queued_leaves_the_queue(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        held = await saturate(session, stack)
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                stack.url + "/v1/chat/completions", json=SHORT, timeout=aiohttp.ClientTimeout(total=0.2)
            ) as r:
                await r.read()
        assert await asyncio.to_thread(
            wait_until, lambda: admission(stack, "standard", "abandoned", "client_gone") == 1, 5.0
        )
        assert stack.metrics()["llm_extproc_admission_queue_length"] == 0
        await asyncio.gather(*held)
        # The held requests' ends reach the service through the access log (~20 ms later).
        assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0, 5.0)
        status, _, _ = await post(session, stack, SHORT)  # nothing left holding capacity
        assert status == 200
    assert admission(stack, "standard", "admitted", "dequeued") == 0


async def test_an_overloaded_queue_sheds_its_stale_waiters(make_stack: Callable[..., Stack]) -> None:
    """Busy past `overload_after_s`, the queue sheds waiters older than `overload_wait_s` at the next
    arrival or finish, long before `max_wait_s`; the next request after the overload is served."""
    overload = {**ADMISSION, "max_wait_s": 5.0, "overload_after_s": 0.1, "overload_wait_s": 0.2}
    stack = make_stack(service=service_config(admission=overload))
    for e in stack.engines.engines:
        e.token_delay_s = 0.02  # LONG holds its engine ~1.2 s
    async with aiohttp.ClientSession() as session:
        held = await saturate(session, stack)
        stale = asyncio.create_task(post(session, stack, SHORT, **{"x-user-id": "u"}))
        assert await asyncio.to_thread(
            wait_until, lambda: stack.metrics().get("llm_extproc_admission_queue_length") == 1, 5.0
        )
        await asyncio.sleep(0.35)  # the queue is overloaded (busy > 0.1 s), `stale` waited > 0.2 s
        late = asyncio.create_task(post(session, stack, SHORT, **{"x-user-id": "u"}))
        status, headers, body = await stale  # shed as `late` arrived
        assert status == 429 and headers["retry-after"] == "2"
        error = orjson.loads(body)["error"]
        assert error["code"] == "queue_timeout" and "overloaded" in error["message"]
        assert not late.done() and all(not t.done() for t in held)
        # `late` waits for the first finish (~1 s): by then past 0.2 s, it is shed, not served
        status, _, body = await late
        assert status == 429 and orjson.loads(body)["error"]["code"] == "queue_timeout"
        assert [(await t)[0] for t in held] == [200, 200]
        assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0, 5.0)
        assert (await post(session, stack, SHORT))[0] == 200
    assert admission(stack, "standard", "shed", "queue_timeout") == 2
    assert admission(stack, "standard", "admitted", "dequeued") == 0
    assert stack.metrics()["llm_extproc_admission_queue_length"] == 0
