"""The simulated engine over real HTTP with the engine model behind it (virtual time sped up)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from extproc.publishers.engines import normalize
from extproc_lab.engines import SimEngine
from extproc_lab.engines.profiles import PROFILES
from extproc_lab.engines.tokens import chat_to_tokens

SYSTEM = "You are a careful assistant who answers in full sentences. " * 60


@pytest.fixture
async def engine() -> AsyncIterator[tuple[SimEngine, str]]:
    e = SimEngine("e0", "m", profile=PROFILES["h100-llama3-8b"], time_scale=20.0)
    port = await e.start()
    yield e, f"http://127.0.0.1:{port}"
    await e.stop()


def chat(user: str, **extra: object) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 8,
        **extra,
    }


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict]:
    raw = (await resp.read()).split(b"\n\n")
    out = []
    for ev in raw:
        if ev.startswith(b"data: ") and ev != b"data: [DONE]":
            out.append(orjson.loads(ev[6:]))
    assert raw[-2] == b"data: [DONE]"
    return out


async def test_streaming_shape_and_prefix_reuse(engine: tuple[SimEngine, str]) -> None:
    _, url = engine
    usages = []
    async with aiohttp.ClientSession() as s:
        for q in ("first question", "second question"):
            async with s.post(
                url + "/v1/chat/completions",
                json=chat(q, stream=True, stream_options={"include_usage": True}),
            ) as r:
                assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = await sse_events(r)
            deltas = [ev for ev in events if ev["choices"]]
            assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
            assert sum(1 for d in deltas if d["choices"][0]["delta"].get("content")) == 8
            assert deltas[-1]["choices"][0]["finish_reason"] == "length"
            usages.append(events[-1]["usage"])
    prompt = len(chat_to_tokens(chat("first question")["messages"]))
    assert usages[0]["prompt_tokens"] == prompt and usages[0]["completion_tokens"] == 8
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    # The second request shares the long system prompt: its full blocks come from the prefix cache.
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= prompt - 32


async def test_json_completion_and_render(engine: tuple[SimEngine, str]) -> None:
    _, url = engine
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url + "/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 3}
        ) as r:
            doc = await r.json()
        assert r.status == 200 and doc["usage"]["completion_tokens"] == 3
        assert len(doc["choices"][0]["text"].split()) == 3
        async with s.post(url + "/v1/chat/completions/render", json=chat("hi")) as r:
            rendered = await r.json()
        assert rendered["prompt_token_ids"] == chat_to_tokens(chat("hi")["messages"])
        async with s.post(url + "/v1/completions/render", json={"model": "m", "prompt": [1, 2, 3]}) as r:
            assert (await r.json())["prompt_token_ids"] == [1, 2, 3]


async def test_metrics_speak_vllm_and_load_endpoints(engine: tuple[SimEngine, str]) -> None:
    e, url = engine
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions", json=chat("x")) as r:
                await r.read()
        async with s.get(url + "/metrics") as r:
            load = normalize("vllm", await r.text())
        async with s.get(url + "/get_load") as r:
            assert (await r.json())["load"] == 0
        async with s.get(url + "/server_info") as r:
            info = await r.json()
    p = PROFILES["h100-llama3-8b"]
    assert load.kv_blocks_total == p.num_gpu_blocks and load.block_size == p.block_size
    assert load.prefix_cache_queries == e.driver.model.prefix_cache_queries > 0  # type: ignore[union-attr]
    assert 0 < load.prefix_cache_hits < load.prefix_cache_queries  # type: ignore[operator]
    assert load.ttft_count == 2
    model = e.driver.model  # the inter-token gaps, in real seconds, as the publisher's TPOT reads them
    assert load.tpot_count == model.itl_count > 0  # type: ignore[union-attr]
    assert load.tpot_sum == pytest.approx(model.itl_sum / e.driver.time_scale)  # type: ignore[union-attr]
    assert info["max_total_num_tokens"] == p.kv_capacity_tokens and "model_path" not in info


async def test_queueing_shows_in_load_and_disconnect_aborts(engine: tuple[SimEngine, str]) -> None:
    e, url = engine
    model = e.driver.model  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/chat/completions", json=chat("long", max_tokens=5000, stream=True))
        await resp.content.readuntil(b"\n\n")
        assert model.num_running == 1
        resp.close()
        for _ in range(100):
            if model.requests_aborted == 1:
                break
            await asyncio.sleep(0.02)
    assert model.requests_aborted == 1 and model.num_running == 0


async def test_prompt_longer_than_context_is_400() -> None:
    e = SimEngine("small", "m", profile=PROFILES["test"])
    port = await e.start()
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "word " * 500}
            ) as r,
        ):
            assert r.status == 400
    finally:
        await e.stop()


async def test_readiness_delay() -> None:
    e = SimEngine("slow-start", "m", profile=PROFILES["test"], ready_delay_s=0.3)
    port = await e.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503
            await asyncio.sleep(0.4)
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200
    finally:
        await e.stop()


async def test_an_engine_that_counts_differently_says_so_in_its_counters() -> None:
    """`token_scale`: the engine's own tokenizer counts fewer tokens than the built-in one (words of
    3-9 letters against ~4 bytes each); its render endpoint, its usage and its prompt-token counter
    all say the engine's count, which is what a router's calibration reads."""
    from extproc_lab.engines.tokens import Recount

    text = " ".join(f"w{i}x{i * 7}" for i in range(400))
    e = SimEngine("e0", "m", profile=PROFILES["h100-llama3-8b"], time_scale=20.0, token_scale=0.5)
    url = f"http://127.0.0.1:{await e.start('127.0.0.1', 0)}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions/render", json=chat(text)) as r:
                rendered = await r.json()
            own = chat_to_tokens(chat(text)["messages"])
            assert rendered["prompt_token_ids"] == Recount(0.5)(own)
            assert 0.35 * len(own) < rendered["count"] < 0.65 * len(own)
            async with s.post(url + "/v1/chat/completions", json=chat(text, max_tokens=2)) as r:
                usage = (await r.json())["usage"]
            assert usage["prompt_tokens"] == rendered["count"]
            async with s.get(url + "/metrics") as r:
                load = normalize("vllm", await r.text())
            assert load.prompt_tokens == rendered["count"]
    finally:
        await e.stop()
