"""Render chat messages with a model's Jinja chat template, as `transformers` would.

Chat templates come from model repositories and are untrusted code, so they run in jinja2's
`ImmutableSandboxedEnvironment` with the same options and globals that transformers'
`apply_chat_template` installs (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII and takes `indent`, a restricted `dict` and
`namespace`); the rendered text is then what transformers renders for
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`.

Content parts: OpenAI messages may carry `content` as a list of parts (`[{"type": "text", ...}]`).
Most templates expect a string and would print the list's repr, so by default ("auto") a list is
joined into one string, its text parts separated by "\\n" (what vLLM does for such templates;
non-text parts such as images are dropped: they carry no text tokens here). A template that
iterates over a message's content (`{% for part in message['content'] %}`) is given the list as
sent. `content_format` ("string" / "openai") overrides the detection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS: tuple[str, ...] = ("auto", "string", "openai")

# Names transformers passes to the template from the tokenizer's special tokens (its
# SPECIAL_TOKENS_ATTRIBUTES): only those set in tokenizer_config.json are passed.
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Used when a model has no template: ChatML, the most common format. Counts are then exact only for
# ChatML models; for others they are close (a few tokens per message).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is defined "
    "else '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the messages (e.g. `raise_exception` on bad role alternation) or failed:
    the request is invalid for this model (a client error, like vLLM's 400)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _make_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_env()  # one environment: templates are compiled once per model at load


def _is_content_access(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:  # content | selectattr(...)
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in aliases


def detect_content_format(source: str) -> Literal["string", "openai"]:
    """ "openai" when the template loops over a message's content (directly or through a `set`
    alias), i.e. it understands content parts; "string" otherwise."""
    ast = _ENV.parse(source)
    aliases = {
        assign.target.name
        for assign in ast.find_all(jinja2.nodes.Assign)
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content_access(assign.node, set())
    }
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter, aliases):
            return "openai"
    return "string"


def _text_of_parts(parts: Sequence[Any]) -> str:
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text":
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
    return "\n".join(texts)


def content_text(content: Any) -> str:
    """A message content as one string: a list of parts joins its text parts with "\\n"."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        return _text_of_parts(content)
    return str(content)


def _normalize_messages(messages: Sequence[Mapping[str, Any]], parts_as_list: bool) -> list[dict[str, Any]]:
    """Fresh dicts (the template never sees the caller's objects); None-valued keys dropped, as
    transformers does (OpenAI clients send `"tool_calls": null`, which many templates mishandle)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        msg = {key: value for key, value in message.items() if value is not None}
        content = msg.get("content")
        if isinstance(content, list | tuple) and not parts_as_list:
            msg["content"] = _text_of_parts(content)
        out.append(msg)
    return out


class ChatTemplate:
    """One model's compiled chat template plus the special-token strings it may reference."""

    __slots__ = ("_template", "content_format", "source", "special_tokens")

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        content_format: ContentFormat = "auto",
    ) -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.content_format: Literal["string", "openai"] = (
            detect_content_format(source) if content_format == "auto" else content_format
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text, as `apply_chat_template(..., tokenize=False)` renders it; raises
        ChatTemplateError when the template rejects the messages."""
        chat = _normalize_messages(messages, self.content_format == "openai")
        # Request kwargs override special tokens (as in transformers); fixed arguments override both.
        context: dict[str, Any] = {**self.special_tokens, **(template_kwargs or {})}
        context.update(
            messages=chat,
            tools=[dict(t) for t in tools] if tools is not None else None,
            documents=[dict(d) for d in documents] if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc


def iter_template_choices(raw: Any) -> Iterator[tuple[str, str]]:
    """(name, source) pairs of a tokenizer_config `chat_template`: a string is ("default", it)."""
    if isinstance(raw, str):
        yield "default", raw
        return
    if isinstance(raw, list):
        for item in raw:
            if (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                yield item["name"], item["template"]
            else:
                raise ValueError("chat_template list items must be {name: str, template: str}")
        return
    raise ValueError(
        f"chat_template must be a string or a list of {{name, template}}, got {type(raw).__name__}"
    )


def special_token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None
