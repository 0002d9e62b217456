"""The configuration surface against its documentation: every key the parsers accept is documented,
and nothing documented is a key they refuse (docs/configuration.md for the service YAML, fleet-state.md
for the publisher's, tuning.md and architecture.md for the plugins' parameters). The key trees come
from the parsers' own key sets (extproc.config.service_keys, extproc.publishers.config.publisher_keys,
extproc.scheduling.framework.plugin_parameters)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import extproc.scheduling  # noqa: F401  (registers the built-in plugins)
from extproc.config import (
    _SCALAR_KEYS,
    _SECTIONS,
    ANY,
    DECLARED_SECTIONS,
    REQUIRED,
    config_from_dict,
    key_paths,
    service_keys,
    service_schema,
)
from extproc.publishers.config import load_publisher_config, publisher_keys
from extproc.scheduling.framework import PROFILE_KEYS, plugin_parameters
from extproc.settings import ConfigError, checks, yaml_keys

DOCS = Path(__file__).resolve().parent.parent / "docs"


def yaml_blocks(page: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (DOCS / page).read_text(), re.S)


def documented_paths(doc: Any, schema: dict[str, Any], prefix: str = "") -> set[str]:
    """The key paths of a YAML example, named as in the schema (a name the user chose, or a list
    entry, as ANY); below a schema leaf (a plugin's `params`, a value) nothing more is a key."""
    paths: set[str] = set()
    if isinstance(doc, list):
        for item in doc:
            paths |= documented_paths(item, schema, prefix)
        return paths
    if not isinstance(doc, dict):
        return paths
    for name, value in doc.items():
        key = ANY if ANY in schema else str(name)
        path = f"{prefix}{key}"
        paths.add(path)
        sub = schema.get(key)
        if isinstance(sub, dict):
            if isinstance(value, list):
                paths |= documented_paths(value, sub.get(ANY, {}), f"{path}.{ANY}.")
                if value and any(isinstance(v, dict) for v in value):
                    paths.add(f"{path}.{ANY}")
            else:
                paths |= documented_paths(value, sub, f"{path}.")
    return paths


def test_every_service_key_is_in_the_reference_and_every_documented_one_is_accepted() -> None:
    schema = service_keys()
    reference = yaml.safe_load(yaml_blocks("configuration.md")[0])  # every key at once: not a valid file
    optional = re.sub(r"(?m)^(\s*)# (\w+:)", r"\1\2", yaml_blocks("configuration.md")[1])  # commented keys
    tokenizers = yaml.safe_load(optional)
    documented = documented_paths({**reference, **tokenizers}, schema)
    accepted = set(key_paths(schema))
    assert not documented - accepted, f"documented, refused: {sorted(documented - accepted)}"
    assert not accepted - documented, f"accepted, not documented: {sorted(accepted - documented)}"


def _at(doc: Any, path: str) -> Any:
    for name in path.split("."):
        if not isinstance(doc, dict) or name not in doc:
            return KeyError
        doc = doc[name]
    return doc


def test_the_reference_shows_every_declared_default() -> None:
    """configuration.md's values are the schema's defaults (read as the service reads them: `off`
    is YAML's false), except the settings that have none."""
    reference = yaml.safe_load(yaml_blocks("configuration.md")[0])
    schema = service_schema()
    assert len(schema) > 60
    wrong = []
    for path, (check, default) in schema.items():
        shown = _at(reference, path)
        assert shown is not KeyError, f"{path} is not in the reference"
        if default != REQUIRED and check.read(shown, path) != default:
            wrong.append(f"{path}: reference {shown!r}, default {default!r}")
    assert not wrong, wrong


def test_the_schema_reads_what_each_key_takes() -> None:
    schema = service_schema()
    assert schema["bodies.worker_nice"][0].describe() == "integer 0..19"
    with pytest.raises(ConfigError, match=r"config: 'bodies'.worker_nice must be an integer from 0 to 19"):
        config_from_dict(
            {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "bodies": {"worker_nice": 20}}
        )
    with pytest.raises(
        ConfigError, match=r"explain'.header must be one of \['off', 'on_request', 'always'\]"
    ):
        config_from_dict(
            {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "explain": {"header": "yes"}}
        )
    with pytest.raises(ConfigError, match=r"discovery'.kubernetes needs 'cluster'"):
        config_from_dict(
            {
                "routing": "endpoint",
                "pool": {"clusters": [{"name": "a", "models": ["m"], "endpoints": []}]},
                "discovery": {"kubernetes": {"label_selector": "x=y"}},
            }
        )
    # null is a value only where the setting may be unset
    assert (
        config_from_dict(
            {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "metrics_listen": None}
        ).metrics_listen
        is None
    )
    with pytest.raises(ConfigError, match="config: 'listen' must be a non-empty string, got None"):
        config_from_dict({"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "listen": None})


def test_the_key_tree_is_the_parsers_key_sets() -> None:
    schema = service_keys()
    assert set(schema) == {*_SCALAR_KEYS, *_SECTIONS}
    for path, record in DECLARED_SECTIONS.items():  # the schema's records are the tree's sections
        subtree = schema
        for name in filter(None, path.split(".")):
            subtree = subtree[name]
        if path:
            assert set(subtree) == set(yaml_keys(record)), path
        else:  # the top level: ServiceConfig's declared scalars (its other fields are built objects)
            assert set(checks(record)) <= set(subtree)
    assert set(schema["scheduling"]["profiles"][ANY]) == set(PROFILE_KEYS)
    pool = {"clusters": [{"name": "a", "models": ["m"]}]}
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_dict(
            {
                "pool": pool,
                "scheduling": {
                    "profile": "p",
                    "profiles": {"p": {"filters": [{"name": "slo-ttft", "weight": 2}]}},
                },
            }
        )


def test_a_service_only_redis_key_is_refused_by_the_publisher(tmp_path: Path) -> None:
    doc = tmp_path / "publisher.yaml"
    doc.write_text("envoy_admin: http://e\nredis: {url: redis://h:1/0, stale_ready_grace_ttls: 2}\n")
    with pytest.raises(ConfigError, match="the service's"):
        load_publisher_config(str(doc))


def _mentioned(text: str, name: str) -> bool:
    """`name` as a key or in backquotes (`name`, name:, {name: ...}, `name: ...`)."""
    return re.search(rf"(`{re.escape(name)}[`:= ]|\b{re.escape(name)}:)", text) is not None


def test_every_publisher_key_is_documented() -> None:
    text = (DOCS / "fleet-state.md").read_text() + (DOCS / "engines.md").read_text()
    missing = [p for p in key_paths(publisher_keys()) if p.rsplit(".", 1)[-1] != ANY]
    missing = [p for p in missing if not _mentioned(text, p.rsplit(".", 1)[-1])]
    assert not missing, f"publisher keys fleet-state.md / engines.md do not name: {missing}"


def test_every_plugin_parameter_is_documented() -> None:
    text = "".join((DOCS / page).read_text() for page in ("tuning.md", "architecture.md", "configuration.md"))
    missing = [
        f"{kind} {name}: {param}"
        for kind, plugins in plugin_parameters().items()
        for name, params in plugins.items()
        for param in params
        if not _mentioned(text, param)
    ]
    assert not missing, f"plugin parameters tuning.md / architecture.md do not name: {missing}"


def test_check_config_lists_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    assert main(["check-config", "--keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "admission.objectives.models.*.critical" in out and "scorer predicted-ttft: block_tokens" in out
    assert out[-1].startswith("# ") and "service keys" in out[-1]
    assert all(line.strip() for line in out), "a blank line in the listing"
    assert any(line.startswith("fleet.sentinels ") and line.endswith("; default []") for line in out)
    assert any(line.startswith("admission.max_kv_usage ") and line.endswith("; default null") for line in out)
    counts = re.search(
        r"(\d+) keys in (\d+) sections, and (\d+) plugin\s+parameters",
        DOCS.joinpath("configuration.md").read_text(),
    )
    assert counts is not None
    keys, sections, params = counts.groups()
    assert out[-1] == f"# {keys} service keys (+ {sections} sections), {params} plugin parameters"
