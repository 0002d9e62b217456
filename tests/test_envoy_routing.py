"""Real Envoy -> real llm-extproc process -> simulated engines over HTTP, in both body modes."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from gateway_stack import MODEL, Stack, service_config, wait_until

from extproc_lab.engines import EngineGroup
from extproc_lab.stack import body_mode_edit, ext_proc_filter

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _stream_end_edit(cfg: dict) -> None:
    """The older release mode: the ext_proc stream held open for the whole response."""
    ext_proc_filter(cfg)["processing_mode"]["response_trailer_mode"] = "SEND"


# BUFFERED and FULL_DUPLEX_STREAMED with the shipped release mode (Envoy's access log reports each
# request's end); "stream_end": BUFFERED with the stream held open until the response ends.
@pytest.fixture(scope="module", params=["BUFFERED", "FULL_DUPLEX_STREAMED", "stream_end"])
def stack(
    request: pytest.FixtureRequest, engines: EngineGroup, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    if request.param == "stream_end":
        s = Stack(
            engines,
            tmp_path_factory.mktemp(request.param),
            envoy_edit=_stream_end_edit,
            service=service_config(release_on="stream_end", explain={"header": "on_request"}),
        )
    else:
        s = Stack(
            engines,
            tmp_path_factory.mktemp(request.param),
            envoy_edit=body_mode_edit(request.param),
            service=service_config(explain={"header": "on_request"}),
        )
    s.start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _fresh(engines: EngineGroup) -> None:
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.005


async def post(
    session: aiohttp.ClientSession, stack: Stack, path: str, body: object, **kw: object
) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
    async with session.post(stack.url + path, data=data, headers=headers) as r:
        return r.status, r.headers.copy(), await r.read()


def engine_for(stack: Stack, headers: dict) -> str:
    return stack.cluster_of[headers["x-sim-engine"]]


async def test_chat_json_lands_on_chosen_cluster(stack: Stack, engines: EngineGroup) -> None:
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(s, stack, "/v1/chat/completions", CHAT)
    assert status == 200, stack.logs()
    doc = orjson.loads(body)
    assert doc["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3"
    # The engine that answered received the cluster header the service chose, naming its own cluster.
    engine = engines.by_name(headers["x-sim-engine"])
    assert engine.stats.routing_headers[-1] == {"x-llm-destination-cluster": engine_for(stack, headers)}


async def test_completions_json_prompt_list(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(
            s, stack, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}
        )
    assert status == 200
    assert orjson.loads(body)["choices"][0]["text"] == "tok0 tok1"
    assert headers["x-sim-engine"] in stack.cluster_of


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_sse_stream_arrives_chunk_by_chunk(stack: Stack, engines: EngineGroup, path: str) -> None:
    for e in engines.engines:
        e.token_delay_s = 0.05
    n = 12
    body = dict(CHAT) if "chat" in path else {"model": MODEL, "prompt": "hi"}
    body.update(stream=True, max_tokens=n, stream_options={"include_usage": True})
    events: list[bytes] = []
    first_seen_while_generating = None
    async with aiohttp.ClientSession() as s, s.post(stack.url + path, json=body) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        engine = engines.by_name(r.headers["x-sim-engine"])
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if first_seen_while_generating is None:
                    # Streaming, not buffering: the first event reaches the client while the engine
                    # is still generating the rest.
                    first_seen_while_generating = engine.stats.active > 0
                events.append(event)
    assert first_seen_while_generating is True
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    texts = [
        (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text", ""))
        for c in chunks
        if c["choices"]
    ]
    assert "".join(texts) == "".join(f"tok{i} " for i in range(n))
    assert chunks[-1]["usage"]["completion_tokens"] == n


async def test_embeddings_pass_through_and_models_are_listed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        status, _headers, body = await post(s, stack, "/v1/embeddings", {"model": MODEL, "input": ["x", "y"]})
        assert status == 200 and orjson.loads(body)["object"] == "list"
        async with s.get(stack.url + "/v1/models") as r:  # answered by the gateway, from the pool
            assert r.status == 200 and r.headers["content-type"] == "application/json"
            assert [m["id"] for m in orjson.loads(await r.read())["data"]] == [MODEL]
            assert "x-sim-engine" not in r.headers
        async with s.get(stack.url + "/v1/models/" + MODEL) as r:  # one model: passed through
            await r.read()
            assert r.headers["server"] == "envoy" and r.status == 404  # the sim engine has no such route


async def test_concurrent_load_uses_both_upstreams(stack: Stack, engines: EngineGroup) -> None:
    for e in engines.engines:
        e.token_delay_s = 0.02
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(post(s, stack, "/v1/chat/completions", CHAT) for _ in range(40)))
    split = Counter(engine_for(stack, h) for status, h, _ in results if status == 200)
    assert sum(split.values()) == 40
    assert split["gpu-a"] >= 10 and split["gpu-b"] >= 10, split
    assert wait_until(lambda: stack.inflight() == 0)


async def test_slow_upstream_gets_fewer_new_requests(stack: Stack, engines: EngineGroup) -> None:
    slow, fast = engines.engines
    slow.token_delay_s = 0.25  # 16 tokens: 4 s per request
    fast.token_delay_s = 0.002
    async with aiohttp.ClientSession() as s:
        tasks = []
        for _ in range(30):
            tasks.append(
                asyncio.create_task(post(s, stack, "/v1/chat/completions", {**CHAT, "max_tokens": 16}))
            )
            await asyncio.sleep(0.03)
        results = await asyncio.gather(*tasks)
    split = Counter(h["x-sim-engine"] for status, h, _ in results if status == 200)
    assert sum(split.values()) == 30
    # Requests pile up on the slow engine, so in-flight accounting sends nearly everything else away.
    assert split[slow.name] <= 5, split
    assert wait_until(lambda: stack.inflight() == 0, timeout=15)


async def test_client_disconnect_releases_inflight(stack: Stack, engines: EngineGroup) -> None:
    for e in engines.engines:
        e.token_delay_s = 0.1
    # Earlier tests' requests are released when Envoy's access log reports them (20 ms flushes).
    assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0)
    async with aiohttp.ClientSession() as s:
        r = await s.post(stack.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 200})
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        assert stack.inflight() == 1  # held while the response streams
        r.close()  # the client goes away mid-stream
    assert wait_until(lambda: stack.inflight() == 0), stack.metrics()
    assert wait_until(lambda: sum(e.stats.disconnected for e in engines.engines) == 1)
    trigger = "stream_end" if stack.service_config.get("release_on") == "stream_end" else "access_log"
    assert stack.metrics()[f'llm_extproc_releases_total{{trigger="{trigger}"}}'] >= 1


def _observed(stack: Stack, klass: str) -> tuple[float, float]:
    m = stack.metrics()
    key = f'{{priority="{klass}"}}'
    return (
        m.get(f"llm_extproc_observed_ttft_seconds_count{key}", 0.0),
        m.get(f"llm_extproc_observed_ttft_seconds_sum{key}", 0.0),
    )


async def test_streamed_requests_report_their_observed_ttft_by_class(
    stack: Stack, engines: EngineGroup
) -> None:
    """The shipped envoy.yaml's Lua filter writes the first response byte's time into the access-log
    entry, and the service counts it by class: the time to the first token, not to the response
    headers (sent at the prefill's end here) nor to the last token. Non-streamed responses are not
    counted (their first byte is the whole answer); with `release_on: stream_end` there is no entry."""
    for e in engines.engines:
        e.token_delay_s = 0.1  # the prefill (~0.03 s here), then 0.1 s a token: first token ~0.13 s
    assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0)
    before = {k: _observed(stack, k) for k in ("standard", "sheddable")}
    streamed = {**CHAT, "stream": True, "max_tokens": 4}  # the last token ~0.43 s
    async with aiohttp.ClientSession() as s:
        for klass in ("standard", "sheddable"):
            for _ in range(2):
                status, _, _ = await post(
                    s, stack, "/v1/chat/completions", streamed, headers={"x-llm-priority": klass}
                )
                assert status == 200
        status, _, _ = await post(
            s, stack, "/v1/chat/completions", CHAT, headers={"x-llm-priority": "standard"}
        )
        assert status == 200
    assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0)
    if stack.service_config.get("release_on") == "stream_end":
        assert {k: _observed(stack, k) for k in before} == before
        return
    assert await asyncio.to_thread(
        wait_until, lambda: all(_observed(stack, k)[0] == before[k][0] + 2 for k in before)
    ), stack.metrics()
    for klass, (count, total) in before.items():
        now_count, now_total = _observed(stack, klass)
        mean = (now_total - total) / (now_count - count)
        assert 0.1 <= mean < 0.3, (klass, mean)


async def test_spoofed_routing_headers_are_ignored(stack: Stack, engines: EngineGroup) -> None:
    busy, idle = engines.engines
    busy.token_delay_s = 0.2
    # Earlier tests' requests are released when Envoy's access log reports them (flushed every
    # 20 ms): start from an empty count, or a late release could tie the two engines.
    assert await asyncio.to_thread(wait_until, lambda: stack.inflight() == 0)
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(post(s, stack, "/v1/chat/completions", {**CHAT, "max_tokens": 10}))
        assert await asyncio.to_thread(wait_until, lambda: busy.stats.active == 1 or idle.stats.active == 1)
        held = busy if busy.stats.active else idle
        other = idle if held is busy else busy
        spoof_cluster = stack.cluster_of[held.name]
        spoof = {
            "x-llm-destination-cluster": spoof_cluster,
            "x-gateway-destination-endpoint": engines.address(engines.engines.index(held)),
            "x-llm-explain": "1",  # the service's own choice comes back in x-llm-decision
        }
        # Every request goes where the service chose (the decision header), never where the client
        # said. Which engine the service picks is its scheduler's business (a busy engine that holds
        # the prompt's prefix can still win), so ask until it picks the other engine once: that is
        # the request that tells an ignored spoof from an obeyed one.
        told = False
        for _ in range(8):
            status, headers, _ = await post(s, stack, "/v1/chat/completions", CHAT, headers=spoof)
            assert status == 200
            picked = headers["x-llm-decision"].split("; ")[0]
            assert stack.cluster_of[headers["x-sim-engine"]] == picked, headers
            if picked != spoof_cluster:
                told = True
                assert headers["x-sim-engine"] == other.name
                assert other.stats.routing_headers[-1] == {"x-llm-destination-cluster": picked}
                break
        await hold
    assert told, "the service never chose the engine the client did not name"


ERROR_CASES = [
    ("malformed json", b'{"model": "sim-llama", "messages": [', {}, 400, "invalid_json"),
    ("body not an object", b"[1, 2]", {}, 400, "invalid_json"),
    ("missing model", {"messages": [{"role": "user", "content": "x"}]}, {}, 400, "missing_field"),
    (
        "model wrong type",
        {"model": 7, "messages": [{"role": "user", "content": "x"}]},
        {},
        400,
        "invalid_type",
    ),
    ("messages wrong type", {"model": MODEL, "messages": "hi"}, {}, 400, "invalid_type"),
    ("stream wrong type", {**CHAT, "stream": "yes"}, {}, 400, "invalid_type"),
    ("max_tokens wrong type", {**CHAT, "max_tokens": "10"}, {}, 400, "invalid_type"),
    (
        "non-json content type",
        b"model=sim-llama",
        {"content-type": "application/x-www-form-urlencoded"},
        400,
        "unsupported_content_type",
    ),
    ("bad priority header", CHAT, {"x-llm-priority": "high"}, 400, "invalid_request"),
    ("unknown model", {**CHAT, "model": "gpt-nope"}, {}, 404, "model_not_found"),
]


@pytest.mark.parametrize(
    ("name", "body", "headers", "status", "code"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
async def test_error_cases(
    stack: Stack, engines: EngineGroup, name: str, body: object, headers: dict, status: int, code: str
) -> None:
    async with aiohttp.ClientSession() as s:
        got, resp_headers, raw = await post(s, stack, "/v1/chat/completions", body, headers=headers)
        assert got == status, raw
        assert resp_headers.get("content-type") == "application/json", resp_headers
        err = orjson.loads(raw)["error"]
        assert err["code"] == code and err["message"] and err["type"]
        # The stream handler survived: the next request on the same gateway still routes.
        ok, _, _ = await post(s, stack, "/v1/chat/completions", CHAT)
        assert ok == 200
    assert sum(e.stats.requests for e in engines.engines) == 1  # the bad request never reached an engine


async def test_chat_content_parts_are_accepted(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
            },
        ],
    }
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(s, stack, "/v1/chat/completions", body)
    assert status == 200


def test_metrics_exposed(stack: Stack) -> None:
    m = stack.metrics()
    routed = sum(
        v for k, v in m.items() if k.startswith("llm_extproc_requests_total{") and 'outcome="routed"' in k
    )
    assert routed > 0
    assert m["llm_extproc_decision_seconds_count"] >= routed
    assert any(k.startswith('llm_extproc_errors_total{status="404"}') for k in m)
    # Client-chosen model names never become label values.
    assert not any("gpt-nope" in k for k in m)


def test_stack_logs_exist(stack: Stack) -> None:
    assert Path(stack.tmp / "envoy.log").exists()
