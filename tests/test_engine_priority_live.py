"""Engine priority through real Envoy: with `engine_priority:` the service writes each request's class
into the body the engine receives (vLLM's `priority` field, lower first), in both request body modes,
overwriting whatever the client put there, with a body length Envoy and the engine agree on; without
the setting the body reaches the engine untouched. The simulated engines refuse a non-zero priority
unless they run the priority policy, as vLLM does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from gateway_stack import MODEL, Stack, service_config

from extproc_lab.stack.processes import body_mode_edit

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
# Tests of the class -> number mapping let clients ask for critical themselves (the default caps them).
TRUSTED = {"client_max_priority": "critical"}


def with_policy(stack: Stack, policy: str) -> None:
    for e in stack.engines.engines:
        e.scheduling_policy = policy


async def post(stack: Stack, body: Any, path: str = "/v1/chat/completions", **extra: str) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **extra}
    async with (
        aiohttp.ClientSession() as session,
        session.post(stack.url + path, data=raw, headers=headers) as r,
    ):
        return r.status, orjson.loads(await r.read())


def received(stack: Stack) -> list[Any]:
    """The `priority` field of every body the engines got (None: absent), in no particular order."""
    return sorted((p for e in stack.engines.engines for p in e.stats.priorities), key=repr)


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_each_class_reaches_the_engine_as_its_number(
    make_stack: Callable[..., Stack], mode: str
) -> None:
    stack = make_stack(
        service=service_config(engine_priority={}, admission=TRUSTED), envoy_edit=body_mode_edit(mode)
    )
    with_policy(stack, "priority")
    for klass in ("critical", "standard", "sheddable"):
        status, doc = await post(stack, CHAT, **{"x-llm-priority": klass})
        assert status == 200, doc
    status, doc = await post(stack, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, "/v1/completions")
    assert status == 200, doc
    # Pretty-printed, with whitespace before the closing brace, and an empty-looking tail.
    pretty = orjson.dumps(CHAT, option=orjson.OPT_INDENT_2) + b"\n\n"
    status, doc = await post(stack, pretty, **{"x-llm-priority": "critical"})
    assert status == 200, doc
    assert received(stack) == [-1, -1, 0, 0, 1]


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_a_client_cannot_set_its_own_engine_priority(
    make_stack: Callable[..., Stack], mode: str
) -> None:
    stack = make_stack(service=service_config(engine_priority={}), envoy_edit=body_mode_edit(mode))
    with_policy(stack, "priority")
    status, doc = await post(stack, {**CHAT, "priority": -1000})  # standard, claiming the top of the queue
    assert status == 200, doc
    status, doc = await post(stack, {**CHAT, "priority": "urgent"}, **{"x-llm-priority": "sheddable"})
    assert status == 200, doc  # a malformed value is replaced too, not passed on to fail at the engine
    assert received(stack) == [0, 1]


async def test_without_the_setting_the_body_is_untouched(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(service=service_config())
    with_policy(stack, "fcfs")
    status, doc = await post(stack, CHAT, **{"x-llm-priority": "critical"})
    assert status == 200, doc
    status, doc = await post(stack, {**CHAT, "priority": 5})  # what an engine in FCFS refuses, as vLLM does
    assert status == 400
    assert "priority scheduling is not enabled" in doc["error"]["message"]
    status, doc = await post(stack, {**CHAT, "priority": "urgent"})  # not an integer: the engine's 400
    assert status == 400 and doc["error"]["message"] == "priority must be an integer"
    assert received(stack) == ["urgent", 5, None]  # sorted by repr


async def test_engines_left_on_fcfs_refuse_every_class_but_standard(make_stack: Callable[..., Stack]) -> None:
    """The misconfiguration docs/operations.md warns about: the setting on, the engines not started
    with the priority policy. vLLM's answer (400) reaches the client; standard requests (0) pass."""
    stack = make_stack(service=service_config(engine_priority={}, admission=TRUSTED))
    with_policy(stack, "fcfs")
    status, doc = await post(stack, CHAT, **{"x-llm-priority": "critical"})
    assert status == 400 and doc["error"]["param"] == "priority"
    status, doc = await post(stack, CHAT)
    assert status == 200, doc
    assert received(stack) == [-1, 0]


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_a_chunked_body_is_rewritten_too(make_stack: Callable[..., Stack], mode: str) -> None:
    """No content-length from the client (chunked transfer encoding): the rewritten body still
    reaches the engine whole, with the class's number."""
    stack = make_stack(
        service=service_config(engine_priority={}, admission=TRUSTED), envoy_edit=body_mode_edit(mode)
    )
    with_policy(stack, "priority")
    raw = orjson.dumps(CHAT)

    async def chunks() -> Any:
        yield raw[:10]
        yield raw[10:]

    headers = {"content-type": "application/json", "x-llm-priority": "critical"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(stack.url + "/v1/chat/completions", data=chunks(), headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert received(stack) == [-1]


async def test_only_the_named_clusters_get_the_field(make_stack: Callable[..., Stack]) -> None:
    """A pool where one cluster's engines run the priority policy and the other's do not:
    `clusters:` keeps the field away from the second, whose engines would refuse it."""
    stack = make_stack(service=service_config(engine_priority={"clusters": ["gpu-a"]}, admission=TRUSTED))
    a, b = stack.engines.engines  # gpu-a, gpu-b
    a.scheduling_policy, b.scheduling_policy = "priority", "fcfs"
    body = {**CHAT, "max_tokens": 20}  # held ~0.1 s each: concurrent ones spread over both
    results = await asyncio.gather(*(post(stack, body, **{"x-llm-priority": "critical"}) for _ in range(8)))
    assert [status for status, _ in results] == [200] * 8, results
    assert a.stats.priorities and set(a.stats.priorities) == {-1}
    assert b.stats.priorities and set(b.stats.priorities) == {None}


def route_caps(cfg: dict[str, Any]) -> None:
    """`x-caller: trusted` takes a route whose metadata grants critical; `x-caller: typo` one whose
    cap is misspelt (the service fails it closed: clients capped at sheddable)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    per_route = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
    for caller, cap in (("trusted", "critical"), ("typo", "critcal")):
        metadata = [{"key": "x-llm-max-priority", "value": cap}]
        match = {"name": "x-caller", "string_match": {"exact": caller}}
        routes.insert(
            0,
            {
                "match": {"prefix": "/", "headers": [match]},
                "route": {"cluster_header": "x-llm-destination-cluster", "timeout": "0s"},
                "typed_per_filter_config": {
                    "envoy.filters.http.ext_proc": {
                        "@type": per_route,
                        "overrides": {"grpc_initial_metadata": metadata},
                    }
                },
            },
        )


async def test_a_client_cannot_raise_itself_to_critical_unless_its_route_grants_it(
    make_stack: Callable[..., Stack],
) -> None:
    """The shipped service config caps a client's own x-llm-priority at standard; a route's
    `x-llm-max-priority: critical` lifts it for that route's callers; a misspelt cap fails closed."""
    stack = make_stack(service=service_config(engine_priority={}), envoy_edit=route_caps)
    with_policy(stack, "priority")
    for _ in range(3):
        status, doc = await post(stack, CHAT, **{"x-llm-priority": "critical"})  # any client
        assert status == 200, doc
    status, doc = await post(stack, CHAT, **{"x-llm-priority": "99"})
    assert status == 200, doc
    assert received(stack) == [0, 0, 0, 0]  # every one standard at the engine
    status, doc = await post(stack, CHAT, **{"x-llm-priority": "critical", "x-caller": "trusted"})
    assert status == 200, doc
    status, doc = await post(stack, CHAT, **{"x-llm-priority": "critical", "x-caller": "typo"})
    assert status == 200, doc
    assert received(stack) == [-1, 0, 0, 0, 0, 1]


async def test_with_admission_on_a_client_critical_is_counted_as_standard(
    make_stack: Callable[..., Stack],
) -> None:
    """The issue's probe: 20 requests sent with `x-llm-priority: critical` on the default route of the
    shipped configuration with admission on: none is counted as critical."""
    stack = make_stack(service=service_config(admission={"enabled": True}))
    results = await asyncio.gather(*(post(stack, CHAT, **{"x-llm-priority": "critical"}) for _ in range(20)))
    assert [status for status, _ in results] == [200] * 20, results
    counted = {
        key: value for key, value in stack.metrics().items() if key.startswith("llm_extproc_admission_total{")
    }
    assert sum(v for k, v in counted.items() if 'priority="standard"' in k) == 20, counted
    assert not any('priority="critical"' in k and v for k, v in counted.items()), counted
