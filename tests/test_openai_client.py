"""The real OpenAI Python SDK through real Envoy + llm-extproc + simulated engines: what users of the SDK
(and of LiteLLM, which wraps it) see, including errors raised as the SDK's own exception types."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import MODEL, Stack, service_config

MAX_BODY = 256 * 1024


@pytest.fixture
def client(make_stack: Callable[..., Stack]) -> Iterator[openai.OpenAI]:
    stack = make_stack(service=service_config(max_body_bytes=MAX_BODY))
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_chat(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert resp.system_fingerprint in {"engine-0", "engine-1"}  # which engine answered


def test_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == [f"tok{i}" for i in range(5)]
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5 and last.usage.total_tokens > 5


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert resp.object == "text_completion"
    assert resp.choices[0].text.split() == ["tok0", "tok1", "tok2"]


def test_embeddings_list_input(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(model=MODEL, input=["first", "second", "third"])
    assert [d.index for d in resp.data] == [0, 1, 2]
    vectors = [d.embedding for d in resp.data]
    assert len({tuple(v) for v in vectors}) == 3 and all(len(v) == 8 for v in vectors)
    one = client.embeddings.create(model=MODEL, input="first")
    assert len(one.data) == 1 and one.data[0].embedding == vectors[0]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 404
    assert "no-such-model" in exc.value.message


def test_malformed_input_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages="not a list")  # type: ignore[arg-type]
    assert exc.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])  # type: ignore[list-item]


def test_oversized_body_is_413(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * (MAX_BODY + 1024)}], max_tokens=1
        )
    assert exc.value.status_code == 413
    assert not isinstance(exc.value, openai.BadRequestError | openai.InternalServerError)


async def test_async_client_streams_too(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        pieces = [ch.choices[0].delta.content async for ch in stream if ch.choices]
    assert "".join(p or "" for p in pieces).split() == ["tok0", "tok1", "tok2"]
