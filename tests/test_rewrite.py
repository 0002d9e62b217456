"""The engine-priority body rewrite (extproc.openai.rewrite) and its settings (`engine_priority:`)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.config import load_config
from extproc.openai.rewrite import set_field
from extproc.settings import ConfigError, EnginePriority, engine_priority_settings


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","messages":[]}',
        b'{\n  "model": "m",\n  "max_tokens": 3\n}\n\n',
        b"{}",
        b"{ \n }",
        b'{"model":"m","nested":{"a":{}}}',
    ],
)
def test_the_field_is_spliced_in_and_the_rest_is_kept(body: bytes) -> None:
    out = set_field(body, "priority", -1)
    assert orjson.loads(out) == {**orjson.loads(body), "priority": -1}
    assert out.startswith(body.rstrip()[:-1].rstrip())  # the client's bytes, unchanged, up to the end


def test_a_body_that_names_the_field_is_rewritten_with_one_value() -> None:
    body = b'{"priority": -100, "model": "m", "priority": -7}'  # duplicates: the last wins in json
    out = set_field(body, "priority", 1)
    assert out.count(b'"priority"') == 1 and orjson.loads(out) == {"priority": 1, "model": "m"}
    text = b'{"model":"m","prompt":"priority","user":"a"}'  # the word as a value: parsed, still right
    assert orjson.loads(set_field(text, "priority", 0)) == {
        "model": "m",
        "prompt": "priority",
        "user": "a",
        "priority": 0,
    }
    escaped = b'{"model":"m","prompt":"say \\"priority\\" twice"}'  # quoted in a string: no match
    assert orjson.loads(set_field(escaped, "priority", 2))["priority"] == 2


@pytest.mark.parametrize("body", [b"[1,2]", b'"text"', b"  "])
def test_not_an_object_is_an_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        set_field(body, "priority", 0)


def test_settings_defaults_values_and_errors() -> None:
    assert engine_priority_settings(None) is None
    ep = engine_priority_settings({})
    assert ep == EnginePriority()
    assert (ep.value(1), ep.value(5), ep.value(0), ep.value(-1)) == (-1, -1, 0, 1)  # vLLM: lower first
    only_a = EnginePriority(clusters=frozenset({"gpu-a"}))
    assert (only_a.value_for("gpu-a", 1), only_a.value_for("gpu-b", 1)) == (-1, None)
    assert ep.value_for("any", -1) == 1
    sglang_like = engine_priority_settings({"critical": 10, "standard": 5, "sheddable": 0, "field": "prio"})
    assert sglang_like == EnginePriority(field="prio", critical=10, standard=5, sheddable=0)
    for raw, match in [
        ({"critical": "high"}, "critical must be an integer"),
        ({"critical": True}, "critical must be an integer"),
        ({"field": "a b"}, "field must be a JSON field name"),
        ({"field": ""}, "field"),
        ({"urgent": 3}, "urgent"),
        ({"clusters": []}, "clusters"),
        ({"clusters": "gpu-a"}, "clusters"),
        ([1], "mapping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            engine_priority_settings(raw)


def test_the_service_yaml_section(tmp_path: Path) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text("pool:\n  clusters:\n  - {name: gpu-a, models: ['*']}\nengine_priority: {critical: -5}\n")
    cfg = load_config(path)
    assert cfg.engine_priority == EnginePriority(critical=-5)
    path.write_text("pool:\n  clusters:\n  - {name: gpu-a, models: ['*']}\n")
    assert load_config(path).engine_priority is None
    pool = "pool:\n  clusters:\n  - {name: gpu-a, models: ['*']}\n  - {name: gpu-b, models: ['*']}\n"
    path.write_text(pool + "engine_priority: {clusters: [gpu-b]}\n")
    assert load_config(path).engine_priority == EnginePriority(clusters=frozenset({"gpu-b"}))
    path.write_text(pool + "engine_priority: {clusters: [gpu-b, gpu-c]}\n")
    with pytest.raises(ConfigError, match=r"not in the pool: \['gpu-c'\]"):
        load_config(path)


@pytest.mark.parametrize(
    "key",
    [
        "priorit\\u0079",
        "\\u0070riority",
        "pri\\u006Frity",  # upper-case hex digits
        "\\u0070\\u0072\\u0069\\u006f\\u0072\\u0069\\u0074\\u0079",
    ],
)
def test_a_json_escaped_spelling_of_the_field_counts_as_the_field(key: str) -> None:
    """`"priorit\\u0079"` is the key `priority` to every JSON parser: spliced in as a second member,
    the engine would see two values (and might keep the client's)."""
    body = b'{"model":"m","' + key.encode() + b'":-100,"prompt":"line\\none"}'
    out = set_field(body, "priority", 1)
    assert orjson.loads(out) == {"model": "m", "priority": 1, "prompt": "line\none"}
    assert out.count(b"priorit") == 1 and b"-100" not in out


def test_escapes_elsewhere_still_splice() -> None:
    body = b'{"model":"m","prompt":"caf\\u00e9 \\"prior\\"\\nity"}'
    out = set_field(body, "priority", 1)
    assert out.startswith(body[:-1]) and orjson.loads(out)["priority"] == 1
