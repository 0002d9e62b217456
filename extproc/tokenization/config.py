"""Per-model tokenizer settings, parsed from the plain dict under the service YAML's `tokenizers:`.

    tokenizers:
      sim-llama: {tokenizer_json: /m/tokenizer.json, tokenizer_config: /m/tokenizer_config.json}
      gpt-x: {tiktoken_file: /m/cl100k.tiktoken, special_tokens: {"<|endoftext|>": 100257}}
      "*": {estimate_bytes_per_token: 4}

Exactly one source key per model: `tokenizer_json` (a Hugging Face tokenizers file),
`tiktoken_file` (a local .tiktoken rank file) or `estimate_bytes_per_token` (no tokenizer: count
ceil(UTF-8 bytes / n)). Optional for any kind: `tokenizer_config` (tokenizer_config.json, for the
chat template and special tokens), `chat_template` (a .jinja file, overrides the config's) and
`content_format` (auto|string|openai, see chat_template.py). "*" applies to models not listed.
With a tokenizer file, `max_model_len` (the engines' context, in tokens) refuses prompts that provably
cannot fit it (413 context_length_exceeded), a 15 MB prompt before it is encoded (see registry.py).
Files are only ever read from disk: nothing is downloaded. Errors are ValueErrors naming the key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from extproc.tokenization.chat_template import CONTENT_FORMATS, ContentFormat

DEFAULT_BYTES_PER_TOKEN = 4.0  # English BPE text averages ~4 bytes a token; see estimate_tokens()
WILDCARD = "*"

Kind = Literal["hf", "tiktoken", "estimate"]

_SOURCE_KEYS: dict[str, Kind] = {
    "tokenizer_json": "hf",
    "tiktoken_file": "tiktoken",
    "estimate_bytes_per_token": "estimate",
}
_COMMON_KEYS = ("tokenizer_config", "chat_template", "content_format")
_KIND_KEYS: dict[Kind, tuple[str, ...]] = {
    "hf": ("tokenizer_json", "max_model_len", *_COMMON_KEYS),
    "tiktoken": ("tiktoken_file", "pat_str", "special_tokens", "max_model_len", *_COMMON_KEYS),
    "estimate": ("estimate_bytes_per_token", *_COMMON_KEYS),
}
TOKENIZER_KEYS = tuple(dict.fromkeys(k for keys in _KIND_KEYS.values() for k in keys))  # of every kind


@dataclass(slots=True, frozen=True)
class TokenizerSpec:
    """One model's validated settings; files are checked to exist, not yet read."""

    name: str
    kind: Kind
    path: Path | None = None  # tokenizer.json or .tiktoken file
    tokenizer_config: Path | None = None
    chat_template: Path | None = None
    content_format: ContentFormat = "auto"
    pat_str: str | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)
    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN
    max_model_len: int | None = None  # refuse prompts that provably exceed it (tokenizer files only)


def _file(where: str, value: Any, base_dir: Path | None) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ValueError(f"{where}: must be a file path string, got {type(value).__name__}")
    path = Path(os.fspath(value)).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ValueError(f"{where}: no such file: {path}")
    return path


def parse_spec(
    name: str, raw: Any, *, base_dir: Path | None = None, prefix: str = "tokenizers"
) -> TokenizerSpec:
    """One model's settings; `prefix` names the config section in error messages."""
    where = f"{prefix}.{name}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be strings, got {key!r}")
    sources = [key for key in _SOURCE_KEYS if key in raw]
    if len(sources) != 1:
        got = f"got {', '.join(sources)}" if sources else "got none"
        raise ValueError(f"{where}: needs exactly one of {', '.join(_SOURCE_KEYS)} ({got})")
    kind = _SOURCE_KEYS[sources[0]]
    allowed = _KIND_KEYS[kind]
    if kind == "estimate" and "max_model_len" in raw:
        raise ValueError(
            f"{where}.max_model_len: needs a tokenizer file (an estimate cannot prove a prompt too long)"
        )
    for key in raw:
        if key not in allowed:
            raise ValueError(
                f"{where}: unknown key {key!r} for a {sources[0]} tokenizer (allowed: {', '.join(allowed)})"
            )

    content_format = raw.get("content_format", "auto")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"{where}.content_format: must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}"
        )
    common: dict[str, Any] = {
        "tokenizer_config": (
            _file(f"{where}.tokenizer_config", raw["tokenizer_config"], base_dir)
            if "tokenizer_config" in raw
            else None
        ),
        "chat_template": (
            _file(f"{where}.chat_template", raw["chat_template"], base_dir)
            if "chat_template" in raw
            else None
        ),
        "content_format": content_format,
    }
    if "max_model_len" in raw:
        limit = raw["max_model_len"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{where}.max_model_len: must be a positive integer, got {limit!r}")
        common["max_model_len"] = limit

    if kind == "hf":
        return TokenizerSpec(
            name, kind, path=_file(f"{where}.tokenizer_json", raw["tokenizer_json"], base_dir), **common
        )
    if kind == "tiktoken":
        pat_str = raw.get("pat_str")
        if pat_str is not None and (not isinstance(pat_str, str) or not pat_str):
            raise ValueError(
                f"{where}.pat_str: must be a non-empty string (a regex), got {type(pat_str).__name__}"
            )
        special = raw.get("special_tokens", {})
        if not isinstance(special, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in special.items()
        ):
            raise ValueError(f"{where}.special_tokens: must map token strings to non-negative int ids")
        return TokenizerSpec(
            name,
            kind,
            path=_file(f"{where}.tiktoken_file", raw["tiktoken_file"], base_dir),
            pat_str=pat_str,
            special_tokens=dict(special),
            **common,
        )
    bpt = raw["estimate_bytes_per_token"]
    if isinstance(bpt, bool) or not isinstance(bpt, int | float) or not math.isfinite(bpt) or bpt <= 0:
        raise ValueError(f"{where}.estimate_bytes_per_token: must be a positive number, got {bpt!r}")
    return TokenizerSpec(name, kind, bytes_per_token=float(bpt), **common)


def parse_specs(
    raw: Any, *, base_dir: Path | None = None, prefix: str = "tokenizers"
) -> dict[str, TokenizerSpec]:
    """All models' settings from the `tokenizers:` mapping (None or empty: no tokenizers)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix}: must be a mapping of model name to settings, got {type(raw).__name__}")
    specs: dict[str, TokenizerSpec] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{prefix}: model names must be non-empty strings, got {name!r}")
        specs[name] = parse_spec(name, spec, base_dir=base_dir, prefix=prefix)
    return specs
