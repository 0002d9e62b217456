"""Body limits, saturation, and what Envoy does when the service dies or drains."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from gateway_stack import MODEL, Stack, service_config, wait_until

from extproc_lab.engines import EngineGroup
from extproc_lab.stack import body_mode_edit, ext_proc_filter

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
MB = 1024 * 1024


def big_chat(size: int) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * size}]}
    )


async def post_raw(url: str, data: Any, **headers: str) -> tuple[int, aiohttp.typedefs.LooseHeaders, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/chat/completions", data=data, headers={"content-type": "application/json", **headers}
        ) as r,
    ):
        return r.status, r.headers.copy(), await r.read()


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_five_megabyte_prompt_routes_when_limit_allows(
    make_stack: Callable[..., Stack], mode: str
) -> None:
    stack = make_stack(service=service_config(max_body_bytes=8 * MB), envoy_edit=body_mode_edit(mode))
    status, _, body = await post_raw(stack.url, big_chat(5 * MB))
    assert status == 200, body[:300]
    assert orjson.loads(body)["usage"]["prompt_tokens"] > MB  # the engine saw the whole prompt


async def _chunked(data: bytes, piece: int = 256 * 1024) -> AsyncIterator[bytes]:
    for i in range(0, len(data), piece):
        yield data[i : i + piece]


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_five_megabyte_prompt_over_service_limit_is_413(
    make_stack: Callable[..., Stack], engines: EngineGroup, mode: str, chunked: bool
) -> None:
    stack = make_stack(service=service_config(max_body_bytes=4 * MB), envoy_edit=body_mode_edit(mode))
    payload = big_chat(5 * MB)
    status, headers, body = await post_raw(stack.url, _chunked(payload) if chunked else payload)
    assert status == 413
    assert headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["code"] == "request_too_large"
    assert sum(e.stats.requests for e in engines.engines) == 0


async def test_body_over_envoy_buffer_gets_json_413(make_stack: Callable[..., Stack]) -> None:
    def small_buffer(cfg: dict[str, Any]) -> None:
        cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = MB

    stack = make_stack(envoy_edit=small_buffer)
    status, headers, body = await post_raw(stack.url, _chunked(big_chat(3 * MB)))
    assert status == 413
    assert headers["content-type"] == "application/json"
    err = orjson.loads(body)["error"]  # Envoy's own reply, given an OpenAI-style body by local_reply_config
    assert err["code"] == 413 and err["type"] == "gateway_error"


async def test_saturated_pool_gets_503_with_retry_after(
    make_stack: Callable[..., Stack], engines: EngineGroup
) -> None:
    cfg = service_config(
        scheduling={
            "profile": "capped",
            "profiles": {
                "capped": {
                    "filters": [{"name": "max-inflight", "params": {"limit": 1}}],
                    "scorers": ["least-outstanding"],
                }
            },
        }
    )
    stack = make_stack(service=cfg)
    for e in engines.engines:
        e.token_delay_s = 0.1
    async with aiohttp.ClientSession() as s:
        holds = [
            await s.post(stack.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50})
            for _ in range(2)
        ]
        assert [h.status for h in holds] == [200, 200]
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            status, retry_after, body = r.status, r.headers.get("retry-after"), await r.read()
        for h in holds:
            h.close()
    assert status == 503
    assert retry_after == "1"
    assert orjson.loads(body)["error"]["code"] == "no_upstream"


async def test_service_killed_fail_closed_returns_503_json(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    assert (await post_raw(stack.url, orjson.dumps(CHAT)))[0] == 200
    stack.service.kill()
    status, headers, body = await post_raw(stack.url, orjson.dumps(CHAT))
    assert status == 503  # status_on_error in envoy.yaml
    assert headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["type"] == "gateway_error"


async def test_service_killed_fail_open_still_routes(
    make_stack: Callable[..., Stack], engines: EngineGroup
) -> None:
    def fail_open(cfg: dict[str, Any]) -> None:
        ext_proc_filter(cfg)["failure_mode_allow"] = True

    stack = make_stack(envoy_edit=fail_open)
    stack.service.kill()
    results = [await post_raw(stack.url, orjson.dumps(CHAT)) for _ in range(6)]
    assert [r[0] for r in results] == [200] * 6
    # The fallback route spread them by weight, and no engine saw a routing header from the service.
    assert all(h == {} for e in engines.engines for h in e.stats.routing_headers)


async def test_sigterm_drains_open_streams(make_stack: Callable[..., Stack], engines: EngineGroup) -> None:
    stack = make_stack(service=service_config(shutdown_announce_s=0))  # one replica: nothing to announce to
    for e in engines.engines:
        e.token_delay_s = 0.05
    async with aiohttp.ClientSession() as s:
        r = await s.post(stack.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 30})
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        exit_code = asyncio.create_task(asyncio.to_thread(stack.service.terminate, 20))
        rest = await r.read()  # the in-flight stream finishes intact during the drain
        assert rest.endswith(b"data: [DONE]\n\n")
        assert rest.count(b"data: ") == 30  # 29 remaining tokens + [DONE]
        assert await exit_code == 0
    assert wait_until(lambda: stack.service.proc is not None and stack.service.proc.poll() is not None)
