"""The simulated engine's errors and embeddings are shaped like vLLM's (over real HTTP).

vLLM's error body is `{"error": {"message", "type", "param", "code"}}` (ErrorResponse/ErrorInfo in
vllm/entrypoints/openai/protocol.py), `type` being NotFoundError for an unknown model and
BadRequestError for a bad request, `code` the HTTP status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from extproc_lab.engines import SimEngine
from extproc_lab.engines.profiles import PROFILES


@pytest.fixture(params=["fixed-cost", "engine-model"])
async def base(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    profile = PROFILES["test"] if request.param == "engine-model" else None
    e = SimEngine("e0", "m", 0.001, profile=profile, time_scale=50.0, check_model=True)
    port = await e.start()
    yield f"http://127.0.0.1:{port}"
    await e.stop()


async def error_of(resp: aiohttp.ClientResponse, status: int, kind: str) -> dict:
    assert resp.status == status
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == kind and err["message"]
    return err


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
async def test_unknown_model_is_vllms_404(base: str, path: str) -> None:
    body = {**CHAT, "prompt": "hi", "input": "hi", "model": "nope"}
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        err = await error_of(r, 404, "NotFoundError")
    assert err["message"] == "The model `nope` does not exist." and err["param"] == "model"


async def test_unknown_route_and_method_are_json(base: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/nothing-here") as r:
            err = await error_of(r, 404, "NotFoundError")
            assert "/v1/nothing-here" in err["message"]
        async with s.get(base + "/v1/chat/completions") as r:
            await error_of(r, 405, "MethodNotAllowed")
            assert "POST" in r.headers["Allow"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [], "max_tokens": "many"}'),
        ("/v1/embeddings", b'{"model": "m", "input": [1, "a"]}'),
        ("/v1/embeddings", b'{"model": "m"}'),
    ],
)
async def test_malformed_requests_are_400(base: str, path: str, body: bytes) -> None:
    async with aiohttp.ClientSession() as s, s.post(base + path, data=body) as r:
        await error_of(r, 400, "BadRequestError")


@pytest.mark.parametrize(
    ("inputs", "count"),
    [("one", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3], [4, 5, 6]], 3)],
)
async def test_embeddings_one_vector_per_input(base: str, inputs: object, count: int) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/embeddings", json={"model": "m", "input": inputs}) as r:
            assert r.status == 200
            doc = await r.json()
        async with s.post(base + "/v1/embeddings", json={"model": "m", "input": inputs}) as r:
            again = await r.json()
    assert [d["index"] for d in doc["data"]] == list(range(count))
    assert doc["usage"]["prompt_tokens"] > 0
    vectors = [d["embedding"] for d in doc["data"]]
    assert vectors == [d["embedding"] for d in again["data"]]  # deterministic
    assert all(abs(sum(v * v for v in vec) - 1.0) < 1e-9 for vec in vectors)
    if count > 1:
        assert len({tuple(v) for v in vectors}) == count  # distinct inputs, distinct vectors


async def test_without_check_model_any_model_is_served() -> None:
    """Tests and benches route several configured names to one simulated engine."""
    e = SimEngine("e0", "m", 0.001)
    port = await e.start()
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with s.post(url, json={**CHAT, "model": "other"}) as r:
                assert r.status == 200
    finally:
        await e.stop()
