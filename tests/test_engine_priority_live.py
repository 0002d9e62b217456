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

from extproc.lab.stack.processes import body_mode_edit

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


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
    stack = make_stack(service=service_config(engine_priority={}), envoy_edit=body_mode_edit(mode))
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
    stack = make_stack(service=service_config(engine_priority={}))
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
    stack = make_stack(service=service_config(engine_priority={}), envoy_edit=body_mode_edit(mode))
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
    stack = make_stack(service=service_config(engine_priority={"clusters": ["gpu-a"]}))
    a, b = stack.engines.engines  # gpu-a, gpu-b
    a.scheduling_policy, b.scheduling_policy = "priority", "fcfs"
    body = {**CHAT, "max_tokens": 20}  # held ~0.1 s each: concurrent ones spread over both
    results = await asyncio.gather(*(post(stack, body, **{"x-llm-priority": "critical"}) for _ in range(8)))
    assert [status for status, _ in results] == [200] * 8, results
    assert a.stats.priorities and set(a.stats.priorities) == {-1}
    assert b.stats.priorities and set(b.stats.priorities) == {None}
