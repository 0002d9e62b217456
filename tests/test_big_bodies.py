"""Big request bodies: parsed by worker processes (bounded), with the same result as on the event loop;
errors as for small bodies; a dead worker costs one 503; memory handed back; prompts that provably
cannot fit the model's context refused before they are encoded; and, through real Envoy, concurrent
15 MB bodies next to small requests, all answered.

No timing thresholds: "the loop is not blocked" is shown by small requests finishing while big ones
are still held in a (deliberately slow) worker."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from gateway_stack import MODEL, Stack, service_config
from test_tokenization import CONFIGS, train_bytelevel

from extproc.config import config_from_dict
from extproc.lifecycle import RequestLifecycle
from extproc.lifecycle.bodies import BodyParser
from extproc.openai import InferenceRequest, RequestError, RequestHead
from extproc.openai.parse import Body, parse_detached, parse_head, parse_request
from extproc.openai.worker import tune_allocator
from extproc.settings import BodySettings, ConfigError
from extproc.telemetry import Metrics
from extproc.tokenization import PromptTooLong, from_config
from extproc.tokenization.registry import min_tokens
from extproc_lab.engines import EngineGroup

SMALL_LIMIT = 4096  # bodies from this size go to workers in these tests
DETERMINISTIC = {"scorers": [{"name": "session-affinity", "weight": 1.0}], "picker": "max-score"}


def head(path: str = "/v1/chat/completions", session: str | None = "s-1") -> RequestHead:
    headers = {":method": "POST", ":path": path, "content-type": "application/json"}
    if session:
        headers["x-session-id"] = session
    return parse_head(headers, session_header="x-session-id", user_header="x-user-id", priority_header="p")


def chat(text: str, model: str = "m", **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}], **extra})


def lifecycle(
    tmp: Path | None = None, *, tokenizers: dict[str, Any] | None = None, **bodies: Any
) -> RequestLifecycle:
    raw: dict[str, Any] = {
        "pool": {"clusters": [{"name": c, "models": ["m"]} for c in ("a", "b", "c")]},
        "metrics_listen": None,
        "scheduling": {"profiles": {"default": DETERMINISTIC}},
        "bodies": {"offload_bytes": SMALL_LIMIT, "trim_interval_s": 0.05, **bodies},
    }
    if tokenizers is not None:
        raw["tokenizers"] = tokenizers
    cfg = config_from_dict(raw, base_dir=tmp)
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


@pytest.fixture
async def lc() -> AsyncIterator[RequestLifecycle]:
    made = lifecycle()
    yield made
    made.close()  # on the test's event loop, which the workers' pipes belong to


def fields(r: InferenceRequest) -> dict[str, Any]:
    ids = r.prompt_token_ids
    return {
        "api": r.api,
        "model": r.model,
        "stream": r.stream,
        "max_tokens": r.max_tokens,
        "prompt_text": r.prompt_text,
        "prompt_token_ids": list(ids) if ids is not None else None,
        "session": r.session,
        "user": r.user,
        "priority": r.priority,
        "body_bytes": r.body_bytes,
        "prompt_tokens": r.prompt_tokens,
    }


# -- parsers the workers run in some tests (imported there by "module:function") ------------------
def slow_parse(head: RequestHead, body: Body, keep_messages: bool) -> InferenceRequest:
    """Holds its worker until the file named in the body's `wait_for` exists (or 30 s pass)."""
    doc = orjson.loads(body)
    deadline = time.monotonic() + 30
    while not os.path.exists(doc["wait_for"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return parse_detached(head, body, keep_messages)


def dying_parse(head: RequestHead, body: Body, keep_messages: bool) -> InferenceRequest:
    """Kills its own process on a body that asks for it, as the OOM killer would."""
    if b"kill-this-worker" in bytes(body):
        os.kill(os.getpid(), signal.SIGKILL)
    return parse_detached(head, body, keep_messages)


def test_body_settings_from_yaml() -> None:
    cfg = config_from_dict({"pool": {"clusters": [{"name": "a", "models": ["m"]}]}})
    assert cfg.bodies == BodySettings()
    assert cfg.bodies.offload_bytes == 1024 * 1024 and cfg.bodies.workers == 2
    raw = {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}}
    got = config_from_dict({**raw, "bodies": {"offload_bytes": 100, "workers": 3, "worker_nice": 0}}).bodies
    assert (got.offload_bytes, got.workers, got.worker_nice) == (100, 3, 0)
    for bad in (
        {"workers": 0},
        {"offload_bytes": "1MiB"},
        {"worker_nice": 20},
        {"trim_interval_s": -1},
        {"max": 1},
    ):
        with pytest.raises(ConfigError, match="bodies"):
            config_from_dict({**raw, "bodies": bad})


# -- the off-loop path gives the loop's result -----------------------------------------------------
BODIES = {
    "chat text": chat("The lease ends in May. " * 600, stream=True, max_completion_tokens=7, user="u"),
    "chat parts + image": orjson.dumps(
        {
            "model": "m",
            "max_tokens": 3,
            "messages": [
                {"role": "system", "content": "Read it."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What does the scan say?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 3000}},
                    ],
                },
            ],
        }
    ),
    "completion ids": orjson.dumps({"model": "m", "prompt": list(range(3000))}),
    "completion text": orjson.dumps({"model": "m", "prompt": ["first " * 500, "second " * 500]}),
}


@pytest.mark.parametrize("name", list(BODIES))
async def test_big_body_is_parsed_off_the_loop_like_on_it(lc: RequestLifecycle, name: str) -> None:
    body = BODIES[name]
    path = "/v1/completions" if name.startswith("completion") else "/v1/chat/completions"
    assert len(body) >= SMALL_LIMIT
    inline = parse_request(head(path), body)
    detached = await lc.bodies.parse(head(path), body, keep_messages=True)
    assert fields(detached) == fields(inline)
    assert detached.messages == inline.messages
    assert lc.bodies.stats.offloaded == 1
    # Messages come back only when tokenizers will render them.
    dropped = await lc.bodies.parse(head(path), body, keep_messages=False)
    assert dropped.messages is None and fields(dropped) == fields(inline)


async def test_big_body_gets_the_same_decision_as_on_the_loop() -> None:
    on_loop, off_loop = lifecycle(offload_bytes=100_000_000), lifecycle()
    try:
        for i in range(6):
            body = chat(f"Contract number {i}. " * 500, max_tokens=5)
            h = head(session=f"tenant-{i}")
            a, b = on_loop.route(h, body), await off_loop.route_async(h, body)
            assert b.upstream == a.upstream
            assert (b.request.model, b.request.max_tokens, b.request.body_bytes) == ("m", 5, len(body))
            on_loop.finish(a, "stream_end")
            off_loop.finish(b, "stream_end")
        assert off_loop.bodies.stats.offloaded == 6 and on_loop.bodies.stats.offloaded == 0
        # A routed big body does not keep its prompt while it runs; the counts stay.
        assert (
            b.request.prompt_text == "" and b.request.messages is None and b.request.body_bytes == len(body)
        )
    finally:
        on_loop.close()
        off_loop.close()


async def test_big_chat_is_tokenized_as_on_the_loop(tmp_path: Path) -> None:
    train_bytelevel(tmp_path / "tokenizer.json")
    (tmp_path / "llama3.json").write_text(json.dumps(CONFIGS["llama3"]))
    spec = {"m": {"tokenizer_json": "tokenizer.json", "tokenizer_config": "llama3.json"}}
    on_loop = lifecycle(tmp_path, tokenizers=spec, offload_bytes=100_000_000)
    off_loop = lifecycle(tmp_path, tokenizers=spec)
    try:
        body = chat("The tenant shall pay rent monthly. " * 400)
        a, b = on_loop.route(head(), body), await off_loop.route_async(head(), body)
        assert b.request.prompt_tokens == a.request.prompt_tokens > 1000
        assert b.upstream == a.upstream and off_loop.bodies.stats.offloaded == 1
    finally:
        on_loop.close()
        off_loop.close()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"model": "m", "messages": [' + b'{"role": "user", "content": "x"},' * 300, "invalid_json"),
        (b"[" + b"1," * 3000 + b"1]", "invalid_json"),
        (chat("y" * 5000, stream="yes"), "invalid_type"),
        (orjson.dumps({"messages": [{"role": "user", "content": "z" * 5000}]}), "missing_field"),
    ],
    ids=["truncated", "not an object", "bad stream", "no model"],
)
async def test_malformed_big_body_gets_the_same_400(lc: RequestLifecycle, body: bytes, code: str) -> None:
    with pytest.raises(RequestError) as small:
        lc.route(head(), body)  # the same body, parsed on the calling thread
    with pytest.raises(RequestError) as big:
        await lc.route_async(head(), body)
    assert big.value.status == small.value.status == 400
    assert (big.value.code, big.value.message, big.value.param) == (
        code,
        small.value.message,
        small.value.param,
    )
    assert big.value.body() == small.value.body()
    assert lc.bodies.stats.worker_failures == 0


# -- bounded, and the loop keeps answering ---------------------------------------------------------
async def test_at_most_workers_big_bodies_at_once_and_small_ones_go_on(tmp_path: Path) -> None:
    bodies = BodyParser(
        BodySettings(offload_bytes=SMALL_LIMIT, workers=2), 1 << 24, "test_big_bodies:slow_parse"
    )
    small_lc = lifecycle()
    gate = tmp_path / "open"
    try:
        big = orjson.dumps(
            {"model": "m", "wait_for": str(gate), "messages": [{"role": "user", "content": "q" * 9000}]}
        )
        jobs = [asyncio.create_task(bodies.parse(head(), big, keep_messages=False)) for _ in range(5)]
        while bodies.stats.active < 2:
            await asyncio.sleep(0.01)
        # Two workers hold two bodies; the other three wait, and the event loop is free meanwhile.
        for i in range(20):
            d = await small_lc.route_async(head(session=f"s{i}"), chat(f"small {i}"))
            small_lc.finish(d, "stream_end")
        assert bodies.stats.active == 2 and bodies.stats.waiting == 3
        assert not any(job.done() for job in jobs)
        assert len(bodies.pids()) == 2
        gate.touch()
        results = await asyncio.gather(*jobs)
        assert all(r.model == "m" for r in results)
        assert bodies.stats.max_active == 2 and bodies.stats.offloaded == 5
        assert bodies.stats.workers_started == 2  # reused, not one per body
    finally:
        gate.touch()
        bodies.close()
        small_lc.close()


async def test_cancelled_request_leaves_its_worker_usable(tmp_path: Path) -> None:
    bodies = BodyParser(
        BodySettings(offload_bytes=SMALL_LIMIT, workers=1), 1 << 24, "test_big_bodies:slow_parse"
    )
    gate = tmp_path / "open"
    try:
        big = orjson.dumps(
            {"model": "m", "wait_for": str(gate), "messages": [{"role": "user", "content": "q" * 9000}]}
        )
        first = asyncio.create_task(bodies.parse(head(), big, keep_messages=False))
        while bodies.stats.active < 1:
            await asyncio.sleep(0.01)
        first.cancel()  # Envoy gave up (message timeout): the worker finishes in the background
        second = asyncio.create_task(bodies.parse(head(), big, keep_messages=False))
        await asyncio.sleep(0.05)
        assert bodies.stats.waiting == 1  # the slot is still the cancelled body's
        gate.touch()
        assert (await second).model == "m"
        assert bodies.stats.workers_started == 1 and bodies.stats.worker_failures == 0
    finally:
        gate.touch()
        bodies.close()


# -- failures --------------------------------------------------------------------------------------
async def test_dead_worker_fails_one_body_with_503_then_the_next_works() -> None:
    lc = lifecycle()
    lc.bodies = BodyParser(lc.config.bodies, lc.config.max_body_bytes, "test_big_bodies:dying_parse")
    try:
        ok = chat("fine " * 2000)
        d = await lc.route_async(head(), ok)
        lc.finish(d, "stream_end")
        with pytest.raises(RequestError) as err:
            await lc.route_async(head(), chat("kill-this-worker " * 500))
        assert err.value.status == 503 and err.value.code == "body_parser_failed"
        assert err.value.retry_after == 1 and "retry" in err.value.message
        assert lc.bodies.stats.worker_failures == 1
        d = await lc.route_async(head(), ok)  # a fresh worker takes it
        assert d.request.model == "m"
        # A worker that dies while idle is replaced without failing anyone.
        for pid in lc.bodies.pids():
            os.kill(pid, signal.SIGKILL)
        # Until the event loop has seen them exit (a fixed sleep was too short on a busy machine).
        deadline = time.monotonic() + 30
        while any(w.alive for w in lc.bodies._all) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        d = await lc.route_async(head(), ok)
        assert d.request.model == "m" and lc.bodies.stats.worker_failures == 1
    finally:
        lc.close()


def test_request_error_survives_pickling() -> None:
    err = RequestError(429, "slow down", err_type="rate_limit", code="shed", param="p", retry_after=3)
    back = pickle.loads(pickle.dumps(err))
    assert (back.status, back.message, back.err_type, back.code, back.param, back.retry_after) == (
        429,
        "slow down",
        "rate_limit",
        "shed",
        "p",
        3,
    )


# -- memory ------------------------------------------------------------------------------------------
async def test_memory_is_handed_back_after_big_bodies(lc: RequestLifecycle) -> None:
    if tune_allocator() is None:
        pytest.skip("no glibc malloc_trim here")
    for _ in range(3):
        d = await lc.route_async(head(), chat("w" * 20_000))
        lc.finish(d, "stream_end")
    assert lc.bodies.trimmer.enabled
    for _ in range(100):  # trim_interval_s 0.05 in these tests
        if lc.bodies.stats.trims:
            break
        await asyncio.sleep(0.02)
    assert lc.bodies.stats.trims >= 1


async def test_no_trim_while_a_body_is_in_a_worker(tmp_path: Path) -> None:
    settings = BodySettings(offload_bytes=SMALL_LIMIT, workers=1, trim_interval_s=0.02)
    bodies = BodyParser(settings, 1 << 24, "test_big_bodies:slow_parse")
    if tune_allocator() is None:
        pytest.skip("no glibc malloc_trim here")
    gate = tmp_path / "open"
    try:
        quick = orjson.dumps(
            {"model": "m", "wait_for": str(tmp_path), "messages": [{"role": "user", "content": "q" * 9000}]}
        )
        await bodies.parse(head(), quick, keep_messages=False)  # arms the trimmer
        held = orjson.dumps(
            {"model": "m", "wait_for": str(gate), "messages": [{"role": "user", "content": "q" * 9000}]}
        )
        job = asyncio.create_task(bodies.parse(head(), held, keep_messages=False))
        while bodies.stats.active < 1:
            await asyncio.sleep(0.01)
        before = bodies.stats.trims
        await asyncio.sleep(0.3)
        assert bodies.stats.trims == before  # busy: postponed
        gate.touch()
        await job
        for _ in range(100):
            if bodies.stats.trims > before:
                break
            await asyncio.sleep(0.02)
        assert bodies.stats.trims > before
    finally:
        gate.touch()
        bodies.close()


# -- prompts that cannot fit the context ----------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    train_bytelevel(d / "tokenizer.json")
    (d / "llama3.json").write_text(json.dumps(CONFIGS["llama3"]))
    return d


def limited(tok_dir: Path, max_model_len: int) -> dict[str, Any]:
    return {
        "m": {
            "tokenizer_json": "tokenizer.json",
            "tokenizer_config": "llama3.json",
            "max_model_len": max_model_len,
        }
    }


async def test_prompt_longer_than_the_context_is_refused_before_encoding(tok_dir: Path) -> None:
    lc = lifecycle(tok_dir, tokenizers=limited(tok_dir, 2048))
    registry = lc.config.tokenizers
    assert registry is not None
    tok = registry._get("m")
    assert tok.max_token_bytes is not None and tok.max_token_bytes < 64
    try:
        text = "Witness my hand this day. " * 20_000  # 520 KB: far more than 2048 tokens can hold
        with pytest.raises(RequestError) as err:
            await lc.route_async(head(), chat(text))
        assert err.value.status == 413 and err.value.code == "context_length_exceeded"
        assert "2048" in err.value.message and "at least" in err.value.message
        assert registry.cache_stats().entries == 0  # refused on the bound: nothing was encoded
        # Synchronous path: the same answer.
        with pytest.raises(RequestError) as sync_err:
            lc.route(head(), chat(text))
        assert sync_err.value.body() == err.value.body()
    finally:
        lc.close()


async def test_prompt_that_may_fit_is_never_refused_on_the_bound(tok_dir: Path) -> None:
    lc = lifecycle(tok_dir, tokenizers=limited(tok_dir, 4096))
    try:
        # ~3000 bytes of text: the bound is far below 4096 tokens, so it is encoded, and it fits.
        d = await lc.route_async(head(), chat("a b c " * 500))
        assert d.request.prompt_tokens is not None and d.request.prompt_tokens <= 4096
        lc.finish(d, "stream_end")
        # Over the limit once encoded (bound below it, exact count above it): 413 with the count.
        with pytest.raises(RequestError) as err:
            await lc.route_async(head(), chat("a b c " * 2000))
        assert err.value.status == 413 and "at least" not in err.value.message
    finally:
        lc.close()


def test_token_bound_is_a_lower_bound(tok_dir: Path) -> None:
    registry = from_config(limited(tok_dir, 10**9), base_dir=tok_dir)
    tok = registry._get("m")
    assert tok.max_token_bytes is not None
    for text in ("plain words and more words", "    " * 50, "ééé 😀 " * 40, "<|eot_id|>" * 30):
        exact = registry.tokenize("m", prompt=text, add_special_tokens=False).token_count
        assert min_tokens(text, tok.max_token_bytes) <= exact


def test_max_model_len_needs_a_tokenizer_file() -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        config_from_dict(
            {
                "pool": {"clusters": [{"name": "a", "models": ["m"]}]},
                "tokenizers": {"m": {"estimate_bytes_per_token": 4, "max_model_len": 100}},
            }
        )
    with pytest.raises(PromptTooLong):
        raise PromptTooLong("m", 10, 5, exact=True)


# -- through real Envoy ---------------------------------------------------------------------------
def legal_chat(size: int, kind: str) -> bytes:
    if kind == "image":
        image = base64.b64encode(os.urandom(size * 3 // 4)).decode()
        content: Any = [
            {"type": "text", "text": "What does this page say?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        ]
    else:
        content = "The parties agree as follows. " * (size // 30)
    return orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]})


@pytest.fixture
def stack(engines: EngineGroup, tmp_path: Path) -> Iterator[Stack]:
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.001
    s = Stack(engines, tmp_path / "stack", service=service_config()).start()
    yield s
    s.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        await r.read()
        return r.status


@pytest.mark.envoy
async def test_concurrent_15_mb_bodies_and_small_requests_through_envoy(stack: Stack) -> None:
    url = stack.url + "/v1/chat/completions"
    bigs = [legal_chat(15_000_000, kind) for kind in ("text", "image")]
    small = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def smalls() -> AsyncIterator[int]:
            for _ in range(20):
                yield await _post(session, url, small)
                await asyncio.sleep(0.05)

        big_jobs = [asyncio.create_task(_post(session, url, bigs[i % 2])) for i in range(4)]
        small_statuses = [s async for s in smalls()]
        big_statuses = await asyncio.gather(*big_jobs)
    assert small_statuses == [200] * 20, stack.logs()
    assert big_statuses == [200] * 4, stack.logs()  # 504 would be Envoy's ext_proc message timeout


@pytest.mark.envoy
async def test_a_chunked_body_of_500k_tiny_messages_is_refused_and_small_requests_go_on(stack: Stack) -> None:
    """~14.5 MB of one-character messages, chunked (no content-length: the main process gets it):
    a clear 400 instead of a 504 after seconds of rendering, and small requests meanwhile served
    (their latencies are printed: the bench, not this test, judges time)."""
    url = stack.url + "/v1/chat/completions"
    raw = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 500_000})

    async def chunked() -> AsyncIterator[bytes]:
        for at in range(0, len(raw), 1 << 20):
            yield raw[at : at + (1 << 20)]

    small = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def big() -> tuple[int, Any]:
            headers = {"content-type": "application/json"}
            async with session.post(url, data=chunked(), headers=headers) as r:
                return r.status, orjson.loads(await r.read())

        async def smalls() -> list[tuple[int, float]]:
            out = []
            for _ in range(20):
                started = time.perf_counter()
                out.append((await _post(session, url, small), time.perf_counter() - started))
                await asyncio.sleep(0.05)
            return out

        (status, doc), timed = await asyncio.gather(big(), smalls())
    assert status == 400, doc
    assert doc["error"]["code"] == "too_many_messages" and "at most" in doc["error"]["message"]
    assert [s for s, _ in timed] == [200] * 20, stack.logs()
    print("small requests' latencies (s):", sorted(round(t, 4) for _, t in timed))
