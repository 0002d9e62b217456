"""The tokenization stage in the request path: the service YAML names a tokenizer per model, the
lifecycle tokenizes each chat with the model's template before scheduling, counts what it did, turns a
template's rejection into a 400, and routes a 200 KB prompt without encoding it on the event loop."""

from __future__ import annotations

import json
import threading
from pathlib import Path

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
    d = lc.route(HEAD, chat("llama", "What is a prefix cache?"))
    expected = lc.config.tokenizers.tokenize(
        "llama", messages=[{"role": "user", "content": "What is a prefix cache?"}]
    )
    assert d.request.prompt_tokens == expected.token_count > 5
    assert list(d.request.prompt_token_ids or []) == list(expected.token_ids)
    assert sample(lc, "llm_extproc_tokenized_requests_total", source="tokenizer") == 1
    # A model without a tokenizer is estimated (and counted as such); the request still routes.
    other = lc.route(HEAD, chat("other", "hello there"))
    assert other.request.prompt_tokens is None and other.request.prompt_token_ids is None
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


def test_bad_tokenizer_config_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer_json"):
        config_from_dict(
            {"pool": POOL, "tokenizers": {"llama": {"tokenizer_json": "missing.json"}}}, base_dir=tmp_path
        )
    with pytest.raises(ConfigError, match="tokenizers"):
        config_from_dict({"pool": POOL, "tokenizers": ["llama"]})
