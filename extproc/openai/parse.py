"""Parse OpenAI-style requests into the few fields routing needs.

Only what the scheduler uses is extracted and type-checked; the body itself is forwarded untouched,
so fields this parser does not know (tools, response_format, ...) reach the engine as sent.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from extproc.openai.errors import RequestError, bad_request
from extproc.settings import PRIORITY_NAMES, RouteObjectives


class Api(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    MODELS = "models"
    OTHER = "other"


_API_BY_PATH: dict[str, Api] = {
    "/v1/chat/completions": Api.CHAT,
    "/v1/completions": Api.COMPLETION,
    "/v1/embeddings": Api.EMBEDDING,
    "/v1/models": Api.MODELS,
}

MAX_MODEL_NAME = 256
MAX_SLO_MS = 3_600_000.0
# A conversation longer than this is refused (400): rendering and tokenizing a million tiny messages
# costs seconds of CPU whatever their size in bytes, for no real conversation.
MAX_MESSAGES = 10_000
Body = bytes | bytearray | memoryview  # what orjson reads: a worker parses from shared memory


@dataclass(slots=True)
class RequestHead:
    """What the request headers say, before any body is seen."""

    method: str
    path: str
    api: Api
    content_type: str | None
    content_length: int | None
    session: str | None
    user: str | None
    priority: int
    ttft_slo_ms: float | None = None
    """The client's time-to-first-token objective (the TTFT SLO header), if it sent one."""
    tpot_slo_ms: float | None = None
    """The client's time-per-output-token objective (the TPOT SLO header), if it sent one."""


@dataclass(slots=True)
class InferenceRequest:
    """A parsed request: the routing-relevant view of one OpenAI call."""

    api: Api
    model: str | None
    stream: bool
    max_tokens: int | None
    prompt_text: str
    prompt_token_ids: Sequence[int] | None
    """From the body (completions with token ids) or from the tokenization stage."""
    session: str | None
    user: str | None
    priority: int
    body_bytes: int
    messages: list[dict[str, Any]] | None = None
    """Chat messages as validated here: what the tokenization stage renders with the chat template."""
    prompt_tokens: int | None = None
    """Set by the tokenization stage: exact with a tokenizer, else None (plugins estimate)."""
    block_hashes: tuple[int, list[bytes]] | None = None
    """(block size, chained hashes of `prompt_token_ids`): a long prompt's, hashed off the event
    loop before scheduling for the profile's plugins that hash blocks (`PromptHashing`)."""
    ttft_slo_ms: float | None = None
    """Time-to-first-token objective (client header, else the route's): the `slo-ttft` filter keeps
    candidates predicted to meet it and sheds the request (429) when none is. None: no objective."""
    tpot_slo_ms: float | None = None
    """Time-per-output-token objective (client header, else the route's): `decode-speed` steers the
    request toward engines decoding within it, `slo-tpot` sheds it (429) when none does."""
    predicted_ttft_s: float | None = None
    """Set by the profile's TTFT predictor when the request is placed: its own predicted TTFT on the
    upstream chosen (the per-class metrics read it)."""
    route_objectives: RouteObjectives = ()
    """The class objectives its route's metadata sets (`x-llm-objectives`), over the model's."""
    prepared: dict[str, dict[str, float]] | None = None
    """The decision's prepared figures, by name then upstream id (e.g. "predicted-ttft": this
    request's own predicted TTFT there, seconds): written once by the profile's producers in the
    prepare stage (extproc.scheduling.framework.Producer), read by admission and the plugins that
    consume them; None outside a decision."""

    def release_prompt(self) -> None:
        """Drop the prompt (text, messages, token ids) once the request is routed, so that a routed
        request, held until its response ends, does not keep a 15 MB prompt alive all that time.
        The counts (`prompt_tokens`, `body_bytes`) and every other field stay."""
        self.prompt_text = ""
        self.messages = None
        self.prompt_token_ids = None
        self.block_hashes = None


def api_for_path(path: str) -> Api:
    bare = path.split("?", 1)[0].rstrip("/") or "/"
    return _API_BY_PATH.get(bare, Api.OTHER)


def parse_priority(raw: str, name: str) -> int:
    """A priority value: an integer, or a class name (critical, standard, sheddable); else 400."""
    text = raw.strip()
    named = PRIORITY_NAMES.get(text.lower())
    if named is not None:
        return named
    try:
        return int(text)
    except ValueError:
        raise bad_request(
            f"Header '{name}' must be an integer or one of {', '.join(PRIORITY_NAMES)}.", param=name
        ) from None


def parse_slo_ms(raw: str, name: str) -> float:
    """A TTFT or TPOT objective in milliseconds: a positive number up to an hour; else 400."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_SLO_MS:  # also NaN and inf
        raise bad_request(f"Header '{name}' must be a number of milliseconds above 0.", param=name)
    return value


def parse_head(
    headers: dict[str, str],
    *,
    session_header: str,
    user_header: str,
    priority_header: str,
    ttft_slo_header: str | None = None,
    tpot_slo_header: str | None = None,
) -> RequestHead:
    path = headers.get(":path", "/")
    content_length: int | None = None
    raw_len = headers.get("content-length")
    if raw_len is not None:
        try:
            content_length = int(raw_len)
        except ValueError:
            content_length = None
        if content_length is not None and content_length < 0:
            content_length = None
    priority = 0
    raw_prio = headers.get(priority_header)
    if raw_prio is not None:
        priority = parse_priority(raw_prio, priority_header)
    ttft_slo = _slo_header(headers, ttft_slo_header)
    tpot_slo = _slo_header(headers, tpot_slo_header)
    return RequestHead(
        method=headers.get(":method", "GET").upper(),
        path=path,
        api=api_for_path(path),
        content_type=headers.get("content-type"),
        content_length=content_length,
        session=headers.get(session_header) or None,
        user=headers.get(user_header) or None,
        priority=priority,
        ttft_slo_ms=ttft_slo,
        tpot_slo_ms=tpot_slo,
    )


def _slo_header(headers: dict[str, str], name: str | None) -> float | None:
    if name is None:
        return None
    raw = headers.get(name)
    return None if raw is None else parse_slo_ms(raw, name)


def check_content_type(head: RequestHead) -> None:
    """A body we must read has to be JSON; a missing content type is tolerated (curl -d sends none useful)."""
    ctype = head.content_type
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise RequestError(
            400,
            "Content-Type must be application/json.",
            code="unsupported_content_type",
            param="content-type",
        )


MODEL_APIS = frozenset({Api.CHAT, Api.COMPLETION, Api.EMBEDDING})
"""APIs whose requests must carry a JSON body naming a model."""


def parse_body(head: RequestHead, body: Body) -> InferenceRequest:
    """Parse and type-check a JSON body. Raises RequestError (400) on anything malformed."""
    check_content_type(head)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(
            f"Request body is not valid JSON ({_short(str(exc))}).", code="invalid_json"
        ) from None
    return _from_doc(head, doc, len(body))


def parse_request(head: RequestHead, body: Body) -> InferenceRequest:
    """A non-empty body, whatever the path: parse_body() for the model APIs; other paths
    (/v1/responses, /tokenize, ...) are routed by 'model' when the body is a JSON object that has
    one, and otherwise passed through to any upstream (never refused here)."""
    if head.api in MODEL_APIS:
        return parse_body(head, body)
    try:
        check_content_type(head)
        doc = orjson.loads(body)
    except (RequestError, orjson.JSONDecodeError):
        return bodyless_request(head)
    if isinstance(doc, dict) and "model" in doc:
        return _from_doc(head, doc, len(body))
    return bodyless_request(head)


def parse_detached(head: RequestHead, body: Body, keep_messages: bool) -> InferenceRequest:
    """parse_request() for a worker process, whose result is pickled back: token ids become a
    uint32 array (unpickling a list of millions of ints would hold the receiver's GIL, and so its
    event loop, for long; an array is one copy), and `messages` is dropped unless the caller
    tokenizes them. Raises
    RequestError as parse_request() does."""
    request = parse_request(head, body)
    ids = request.prompt_token_ids
    if isinstance(ids, list) and ids:
        with contextlib.suppress(OverflowError):  # ids outside uint32 stay as sent
            request.prompt_token_ids = array("I", ids)
    if not keep_messages:
        request.messages = None
    return request


def _from_doc(head: RequestHead, doc: Any, body_bytes: int) -> InferenceRequest:
    if not isinstance(doc, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")

    api = head.api
    model = doc.get("model")
    if api in (Api.CHAT, Api.COMPLETION, Api.EMBEDDING) or model is not None:
        model = _model(doc)

    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream", code="invalid_type")

    # max_completion_tokens supersedes the deprecated max_tokens; both are type-checked.
    legacy_max = _opt_int(doc, "max_tokens")
    max_tokens = _opt_int(doc, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = legacy_max

    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string.", param="user", code="invalid_type")

    prompt_text = ""
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    if api is Api.CHAT:
        prompt_text = _chat_text(doc)
        messages = doc["messages"]
    elif api is Api.COMPLETION:
        prompt_text, token_ids = _prompt(doc, "prompt")
    elif api is Api.EMBEDDING:
        prompt_text, token_ids = _prompt(doc, "input")

    return InferenceRequest(
        api=api,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        prompt_text=prompt_text,
        prompt_token_ids=token_ids,
        session=head.session,
        user=head.user or user,
        priority=head.priority,
        body_bytes=body_bytes,
        messages=messages,
        ttft_slo_ms=head.ttft_slo_ms,
        tpot_slo_ms=head.tpot_slo_ms,
    )


def bodyless_request(head: RequestHead) -> InferenceRequest:
    return InferenceRequest(
        api=head.api,
        model=None,
        stream=False,
        max_tokens=None,
        prompt_text="",
        prompt_token_ids=None,
        session=head.session,
        user=head.user,
        priority=head.priority,
        body_bytes=0,
        ttft_slo_ms=head.ttft_slo_ms,
        tpot_slo_ms=head.tpot_slo_ms,
    )


def _model(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    if model is None:
        raise bad_request("Missing required field 'model'.", param="model", code="missing_field")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string.", param="model", code="invalid_type")
    if not model or len(model) > MAX_MODEL_NAME:
        raise bad_request(
            f"'model' must be 1 to {MAX_MODEL_NAME} characters.", param="model", code="invalid_value"
        )
    return model


def _opt_int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer.", param=key, code="invalid_type")
    if value < 0:
        raise bad_request(f"'{key}' must not be negative.", param=key, code="invalid_value")
    return value


def _chat_text(doc: dict[str, Any]) -> str:
    messages = doc.get("messages")
    if messages is None:
        raise bad_request("Missing required field 'messages'.", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", param="messages", code="invalid_type")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES} are accepted.",
            param="messages",
            code="too_many_messages",
        )
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad_request(
                f"'messages[{i}]' must be an object.", param=f"messages[{i}]", code="invalid_type"
            )
        role = msg.get("role")
        if not isinstance(role, str):
            raise bad_request(
                f"'messages[{i}].role' must be a string.", param=f"messages[{i}].role", code="invalid_type"
            )
        content = msg.get("content")
        if content is None or isinstance(content, str):
            parts.append(content or "")
        elif isinstance(content, list):
            parts.extend(_content_parts(content, i))
        else:
            raise bad_request(
                f"'messages[{i}].content' must be a string or an array of content parts.",
                param=f"messages[{i}].content",
                code="invalid_type",
            )
    return "\n".join(parts)


def _content_parts(content: list[Any], i: int) -> list[str]:
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(
                f"'{where}' must be an object with a string 'type'.", param=where, code="invalid_type"
            )
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(
                    f"'{where}.text' must be a string.", param=f"{where}.text", code="invalid_type"
                )
            texts.append(text)
    return texts


def _prompt(doc: dict[str, Any], key: str) -> tuple[str, list[int] | None]:
    value = doc.get(key)
    if value is None:
        raise bad_request(f"Missing required field '{key}'.", param=key, code="missing_field")
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        if all(isinstance(x, str) for x in value):
            return "\n".join(value), None
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return "", value
        if all(
            isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            for x in value
        ):
            return "", [t for x in value for t in x]
    raise bad_request(
        f"'{key}' must be a string, an array of strings, or an array of token ids.",
        param=key,
        code="invalid_type",
    )


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
