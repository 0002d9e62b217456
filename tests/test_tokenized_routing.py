"""The tokenization stage in the request path: the service YAML names a tokenizer per model, the
lifecycle tokenizes each chat with the model's template before scheduling, counts what it did, turns a
template's rejection into a 400, and routes a 200 KB prompt without encoding or hashing it on the event
loop."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from test_tokenization import CONFIGS, train_bytelevel

from extproc.config import config_from_dict, load_config
from extproc.lifecycle import RequestLifecycle
from extproc.openai import RequestError
from extproc.openai.parse import parse_head
from extproc.settings import ConfigError
from extproc.telemetry import Metrics

POOL = {"clusters": [{"name": "a", "models": ["llama", "mistral", "other"]}]}
HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
    session_header="x-session-id",
    user_header="x-user-id",
    priority_header="x-llm-priority",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    train_bytelevel(d / "tokenizer.json")
    for name in ("llama3", "mistral"):
        (d / f"{name}.json").write_text(json.dumps(CONFIGS[name]))
    (d / "llm-extproc.yaml").write_text(
        yaml.safe_dump(
            {
                "pool": POOL,
                "metrics_listen": None,
                "tokenizers": {
                    "llama": {"tokenizer_json": "tokenizer.json", "tokenizer_config": "llama3.json"},
                    "mistral": {"tokenizer_json": "tokenizer.json", "tokenizer_config": "mistral.json"},
                },
            }
        )
    )
    return d


def lifecycle(model_dir: Path) -> RequestLifecycle:
    cfg = load_config(model_dir / "llm-extproc.yaml")  # relative tokenizer paths: the file's folder
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


def chat(model: str, *contents: str) -> bytes:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return orjson.dumps({"model": model, "messages": messages})


def sample(lc: RequestLifecycle, name: str, **labels: str) -> float:
    return lc.metrics.registry.get_sample_value(name, labels) or 0.0


def test_chat_is_tokenized_with_the_models_template(model_dir: Path) -> None:
    lc = lifecycle(model_dir)
    assert lc.config.tokenizers is not None
    request = lc.prepare(HEAD, chat("llama", "What is a prefix cache?"))  # parsed and tokenized
    expected = lc.config.tokenizers.tokenize(
        "llama", messages=[{"role": "user", "content": "What is a prefix cache?"}]
    )
    assert request.prompt_tokens == expected.token_count > 5
    assert list(request.prompt_token_ids or []) == list(expected.token_ids)
    assert sample(lc, "llm_extproc_tokenized_requests_total", source="tokenizer") == 1
    # A model without a tokenizer is estimated (and counted as such); the request still routes.
    other = lc.route(HEAD, chat("other", "hello there"))
    assert other.request.prompt_tokens is None
    assert sample(lc, "llm_extproc_tokenized_requests_total", source="estimate") == 1


def test_a_growing_chat_hits_the_token_cache(model_dir: Path) -> None:
    lc = lifecycle(model_dir)
    turns = [f"turn {i}: " + "words about caches and engines " * 20 for i in range(6)]
    for n in range(1, 7):
        lc.route(HEAD, chat("llama", *turns[:n]))
    hit = sample(lc, "llm_extproc_tokenized_tokens_total", cache="hit")
    miss = sample(lc, "llm_extproc_tokenized_tokens_total", cache="miss")
    assert hit > miss > 0  # each turn encodes only its new message


def test_a_template_rejection_is_a_400(model_dir: Path) -> None:
    lc = lifecycle(model_dir)
    # The Mistral template raises when roles do not alternate user/assistant.
    body = orjson.dumps(
        {"model": "mistral", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    )
    with pytest.raises(RequestError) as info:
        lc.route(HEAD, body)
    assert info.value.status == 400
    assert "chat template" in info.value.message


async def test_a_200kb_prompt_is_encoded_off_the_event_loop(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = lifecycle(model_dir)
    assert lc.config.tokenizers is not None
    registry = lc.config.tokenizers
    threads: list[int] = []
    encode = registry._encode

    def spy(plan: object) -> object:
        threads.append(threading.get_ident())
        return encode(plan)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "_encode", spy)
    big = "tokens for a long context window " * 6500  # ~210 KB
    d = await lc.route_async(HEAD, chat("llama", big))
    assert threads and threading.get_ident() not in threads
    assert (
        d.request.prompt_tokens
        == lc.config.tokenizers.tokenize("llama", messages=[{"role": "user", "content": big}]).token_count
    )
    assert lc.config.tokenizers.cache_stats().entries > 0


async def test_a_long_prompts_blocks_are_hashed_off_the_event_loop_and_used(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default profile's predicted-ttft hashes the prompt's token ids in 64-token blocks; for a
    long prompt the lifecycle does that on a worker thread before scheduling, and the scorer uses
    those hashes (here: it matches against them, not against hashes of its own)."""
    from extproc.lifecycle import router
    from extproc.scheduling import ttft_predictor
    from extproc.tokenization import block_hashes

    lc = lifecycle(model_dir)
    threads: list[int] = []
    hashed: list[tuple[list[int], int, list[bytes]]] = []  # (ids, block, hashes): the request's

    def spy(ids: object, block: int, most: int | None = None) -> list[bytes]:
        threads.append(threading.get_ident())
        hashes = block_hashes(ids, block, most)  # type: ignore[arg-type]
        hashed.append((list(ids), block, hashes))  # type: ignore[call-overload]
        return hashes

    monkeypatch.setattr(router, "block_hashes", spy)
    scorer_hashed: list[int] = []

    def scorer_spy(ids: object, block: int, most: int | None = None) -> list[bytes]:
        scorer_hashed.append(block)
        return block_hashes(ids, block, most)  # type: ignore[arg-type]

    monkeypatch.setattr(ttft_predictor, "block_hashes", scorer_spy)
    big = "tokens for a long context window " * 6500  # ~210 KB, ~34k tokens
    await lc.route_async(HEAD, chat("llama", big))
    assert threads and threading.get_ident() not in threads
    ((ids, block, hashes),) = hashed
    assert len(ids) > 30_000 and block == 64 and hashes == block_hashes(ids, 64, 2048)
    assert scorer_hashed == []  # the scorer used the request's hashes
    await lc.route_async(HEAD, chat("llama", "a short question"))
    assert len(threads) == 1  # short: hashed in the decision, as before


def test_bad_tokenizer_config_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer_json"):
        config_from_dict(
            {"pool": POOL, "tokenizers": {"llama": {"tokenizer_json": "missing.json"}}}, base_dir=tmp_path
        )
    with pytest.raises(ConfigError, match="tokenizers"):
        config_from_dict({"pool": POOL, "tokenizers": ["llama"]})


async def test_many_short_messages_are_rendered_off_the_event_loop(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendering costs per message, not only per character: 5 000 empty messages (a 150 KB body that
    the content-length rule would keep on the loop) are rendered on a worker thread."""
    lc = lifecycle(model_dir)
    registry = lc.config.tokenizers
    assert registry is not None
    threads: list[int] = []
    prepare = registry._prepare_checked

    def spy(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return prepare(*args)

    monkeypatch.setattr(registry, "_prepare_checked", spy)
    await lc.route_async(HEAD, chat("llama", *([""] * 5000)))
    assert threads and threading.get_ident() not in threads
    threads.clear()
    await lc.route_async(HEAD, chat("llama", "hi", "hello"))  # a short chat stays on the loop
    assert threads == [threading.get_ident()]


async def test_the_prompt_is_not_kept_once_routed(model_dir: Path) -> None:
    """A routed request is held until its response ends: its messages and text are dropped at the
    decision (a 1 MB chat body is ~10 MB of Python objects), the counts stay."""
    lc = lifecycle(model_dir)
    d = await lc.route_async(HEAD, chat("llama", "a question " * 50, "an answer"))
    assert d.request.messages is None and d.request.prompt_text == "" and d.request.prompt_token_ids is None
    assert d.request.prompt_tokens and d.request.body_bytes > 0


COMPLETION_HEAD = parse_head(
    {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"},
    session_header="x-session-id",
    user_header="x-user-id",
    priority_header="x-llm-priority",
)


@pytest.mark.parametrize(
    "prompt",
    [[10**12] * 200, [5, -1, 7] * 100, [[1, 2], [2**32]], [2**32] * 5000],
    ids=["huge", "negative", "nested", "long"],
)
async def test_token_ids_out_of_range_are_a_400_not_a_500(model_dir: Path, prompt: list[object]) -> None:
    """Token ids are hashed as uint32: an id outside 0..2^32-1 is the client's error (400, OpenAI's
    shape), on the calling thread and on the event loop alike, never an OverflowError from a scorer."""
    lc = lifecycle(model_dir)
    body = orjson.dumps({"model": "llama", "prompt": prompt})
    for attempt in ("route", "route_async"):
        with pytest.raises(RequestError) as info:
            if attempt == "route":
                lc.route(COMPLETION_HEAD, body)
            else:
                await lc.route_async(COMPLETION_HEAD, body)
        err = info.value
        assert (err.status, err.code, err.param) == (400, "invalid_value", "prompt"), attempt
        assert "token id" in err.message
    edges = orjson.dumps({"model": "llama", "prompt": [0, 2**32 - 1] * 64})
    ok = await lc.route_async(COMPLETION_HEAD, edges)
    assert ok.upstream.cluster == "a"  # the range's two ends are ids like any other
