"""Unit tests for extproc.openai.parse and extproc.openai.errors (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.openai import Api, InferenceRequest, RequestError, RequestHead, api_for_path
from extproc.openai.errors import (
    bad_request,
    body_too_large,
    internal_error,
    no_upstream,
    unknown_model,
)
from extproc.openai.parse import MAX_MESSAGES, MAX_MODEL_NAME, bodyless_request, parse_body, parse_head

SESSION = "x-session-id"
USER = "x-user-id"
PRIO = "x-llm-priority"


def head_of(headers: dict[str, str]) -> RequestHead:
    return parse_head(headers, session_header=SESSION, user_header=USER, priority_header=PRIO)


def make_head(
    path: str = "/v1/chat/completions",
    content_type: str | None = "application/json",
    **extra: str,
) -> RequestHead:
    headers = {":method": "POST", ":path": path, **extra}
    if content_type is not None:
        headers["content-type"] = content_type
    return head_of(headers)


def parse(doc: Any, path: str = "/v1/chat/completions", **kw: Any) -> InferenceRequest:
    return parse_body(make_head(path, **kw), orjson.dumps(doc))


def parse_err(doc: Any, path: str = "/v1/chat/completions", **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(doc, path, **kw)
    return info.value


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_error_body(err: RequestError) -> dict[str, Any]:
    doc = orjson.loads(err.body())
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["message"] == err.message
    assert doc["error"]["type"] == err.err_type
    assert doc["error"]["param"] == err.param
    return doc["error"]


# --------------------------------------------------------------------------------------------------
# parse_head
# --------------------------------------------------------------------------------------------------


class TestParseHead:
    def test_defaults_with_no_headers(self) -> None:
        head = head_of({})
        assert head.method == "GET"
        assert head.path == "/"
        assert head.api is Api.OTHER
        assert head.content_type is None
        assert head.content_length is None
        assert head.session is None
        assert head.user is None
        assert head.priority == 0

    def test_method_is_upper_cased(self) -> None:
        assert head_of({":method": "post", ":path": "/v1/models"}).method == "POST"

    def test_full_head(self) -> None:
        head = head_of(
            {
                ":method": "POST",
                ":path": "/v1/chat/completions",
                "content-type": "application/json",
                "content-length": "123",
                SESSION: "sess-1",
                USER: "alice",
                PRIO: "5",
            }
        )
        assert head == RequestHead(
            method="POST",
            path="/v1/chat/completions",
            api=Api.CHAT,
            content_type="application/json",
            content_length=123,
            session="sess-1",
            user="alice",
            priority=5,
        )

    @pytest.mark.parametrize(("raw", "expected"), [("7", 7), (" 3 ", 3), ("-2", -2), ("0", 0)])
    def test_priority_integer(self, raw: str, expected: int) -> None:
        assert head_of({PRIO: raw}).priority == expected

    @pytest.mark.parametrize("raw", ["high", "1.5", "", "0x10", "1e3"])
    def test_priority_not_integer_is_400(self, raw: str) -> None:
        with pytest.raises(RequestError) as info:
            head_of({PRIO: raw})
        err = info.value
        assert err.status == 400
        assert err.param == PRIO
        assert err.code == "invalid_request"
        assert PRIO in err.message
        assert_error_body(err)

    def test_priority_header_name_is_configurable(self) -> None:
        head = parse_head(
            {"x-prio": "9", PRIO: "not-used"},
            session_header=SESSION,
            user_header=USER,
            priority_header="x-prio",
        )
        assert head.priority == 9

    @pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("42", 42), (" 17 ", 17)])
    def test_content_length_parsed(self, raw: str, expected: int) -> None:
        assert head_of({"content-length": raw}).content_length == expected

    @pytest.mark.parametrize("raw", ["abc", "", "1.5", "12 bytes"])
    def test_content_length_garbage_is_none(self, raw: str) -> None:
        assert head_of({"content-length": raw}).content_length is None

    def test_session_and_user_headers(self) -> None:
        head = head_of({SESSION: "s", USER: "u"})
        assert (head.session, head.user) == ("s", "u")

    def test_empty_session_and_user_are_none(self) -> None:
        head = head_of({SESSION: "", USER: ""})
        assert head.session is None
        assert head.user is None

    def test_session_header_name_is_configurable(self) -> None:
        head = parse_head(
            {"x-conv": "c1", SESSION: "other"},
            session_header="x-conv",
            user_header="x-who",
            priority_header=PRIO,
        )
        assert head.session == "c1"
        assert head.user is None

    def test_content_type_kept_verbatim(self) -> None:
        assert head_of({"content-type": "Application/JSON; charset=UTF-8"}).content_type == (
            "Application/JSON; charset=UTF-8"
        )


class TestApiForPath:
    @pytest.mark.parametrize(
        ("path", "api"),
        [
            ("/v1/chat/completions", Api.CHAT),
            ("/v1/completions", Api.COMPLETION),
            ("/v1/embeddings", Api.EMBEDDING),
            ("/v1/models", Api.MODELS),
            ("/v1/chat/completions/", Api.CHAT),
            ("/v1/completions/", Api.COMPLETION),
            ("/v1/embeddings?api-version=2", Api.EMBEDDING),
            ("/v1/chat/completions?stream=true&x=1", Api.CHAT),
            ("/v1/chat/completions/?x=1", Api.CHAT),
            ("/v1/models?", Api.MODELS),
        ],
    )
    def test_known(self, path: str, api: Api) -> None:
        assert api_for_path(path) is api
        assert head_of({":path": path}).api is api

    @pytest.mark.parametrize(
        "path",
        [
            "/",
            "",
            "/v1",
            "/v1/responses",
            "/tokenize",
            "/v1/chat",
            "/v1/chat/completions/extra",
            "/V1/chat/completions",
            "/v2/chat/completions",
            "v1/chat/completions",
            "/v1/models/sim-llama",
            "?/v1/chat/completions",
        ],
    )
    def test_unknown_is_other(self, path: str) -> None:
        assert api_for_path(path) is Api.OTHER


def test_bodyless_request_copies_head() -> None:
    head = head_of({":path": "/v1/models", SESSION: "s", USER: "u", PRIO: "3"})
    req = bodyless_request(head)
    assert req == InferenceRequest(
        api=Api.MODELS,
        model=None,
        stream=False,
        max_tokens=None,
        prompt_text="",
        prompt_token_ids=None,
        session="s",
        user="u",
        priority=3,
        body_bytes=0,
    )


# --------------------------------------------------------------------------------------------------
# parse_body: chat
# --------------------------------------------------------------------------------------------------


class TestChat:
    def test_string_content(self) -> None:
        body = orjson.dumps(
            {
                "model": "sim-llama",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"},
                ],
            }
        )
        req = parse_body(make_head(), body)
        assert req.api is Api.CHAT
        assert req.model == "sim-llama"
        assert req.prompt_text == "be brief\nhello"
        assert req.prompt_token_ids is None
        assert req.stream is False
        assert req.max_tokens is None
        assert req.body_bytes == len(body)

    def test_content_part_arrays(self) -> None:
        req = parse(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look at"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                            {"type": "text", "text": "this"},
                        ],
                    },
                    {"role": "assistant", "content": "ok"},
                ],
            }
        )
        assert req.prompt_text == "look at\nthis\nok"

    def test_image_only_parts_give_no_text(self) -> None:
        req = parse(
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            }
        )
        assert req.prompt_text == ""

    def test_none_and_missing_content(self) -> None:
        req = parse(
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": None, "tool_calls": []},
                    {"role": "tool"},
                    {"role": "user", "content": "b"},
                ],
            }
        )
        assert req.prompt_text == "a\n\n\nb"

    @pytest.mark.parametrize("role", [None, 1, ["user"], {"r": "user"}, True])
    def test_bad_role_type(self, role: Any) -> None:
        msg: dict[str, Any] = {"content": "x"}
        if role is not None:
            msg["role"] = role
        err = parse_err({"model": "m", "messages": [{"role": "user", "content": "ok"}, msg]})
        assert err.status == 400
        assert err.param == "messages[1].role"
        assert err.code == "invalid_type"

    def test_messages_missing(self) -> None:
        err = parse_err({"model": "m"})
        assert (err.status, err.param, err.code) == (400, "messages", "missing_field")

    def test_messages_null_is_missing(self) -> None:
        err = parse_err({"model": "m", "messages": None})
        assert (err.param, err.code) == ("messages", "missing_field")

    @pytest.mark.parametrize("messages", [[], "hello", {"role": "user"}, 3])
    def test_messages_empty_or_not_list(self, messages: Any) -> None:
        err = parse_err({"model": "m", "messages": messages})
        assert (err.status, err.param, err.code) == (400, "messages", "invalid_type")

    @pytest.mark.parametrize("msg", ["hello", 1, None, ["user", "hi"]])
    def test_message_not_object(self, msg: Any) -> None:
        err = parse_err({"model": "m", "messages": [{"role": "user", "content": "ok"}, msg]})
        assert (err.status, err.param, err.code) == (400, "messages[1]", "invalid_type")

    @pytest.mark.parametrize("content", [1, {"type": "text", "text": "x"}, True, 2.5])
    def test_content_wrong_type(self, content: Any) -> None:
        err = parse_err({"model": "m", "messages": [{"role": "user", "content": content}]})
        assert (err.status, err.param, err.code) == (400, "messages[0].content", "invalid_type")

    @pytest.mark.parametrize("part", ["text", 1, None, {"text": "no type"}, {"type": 5, "text": "x"}])
    def test_bad_part(self, part: Any) -> None:
        content = [{"type": "text", "text": "fine"}, part]
        err = parse_err({"model": "m", "messages": [{"role": "user", "content": content}]})
        assert (err.status, err.param, err.code) == (400, "messages[0].content[1]", "invalid_type")

    @pytest.mark.parametrize("text", [None, 5, ["a"], {"t": "a"}])
    def test_text_part_without_string_text(self, text: Any) -> None:
        part: dict[str, Any] = {"type": "text"}
        if text is not None:
            part["text"] = text
        err = parse_err({"model": "m", "messages": [{"role": "user", "content": [part]}]})
        assert (err.status, err.param, err.code) == (400, "messages[0].content[0].text", "invalid_type")

    def test_unknown_fields_ignored(self) -> None:
        req = parse(chat(tools=[{"type": "function"}], response_format={"type": "json_object"}, n=2))
        assert req.prompt_text == "hi"


# --------------------------------------------------------------------------------------------------
# parse_body: completions and embeddings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "key"), [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
class TestPrompt:
    def test_string(self, path: str, key: str) -> None:
        req = parse({"model": "m", key: "once upon"}, path)
        assert req.prompt_text == "once upon"
        assert req.prompt_token_ids is None

    def test_list_of_strings(self, path: str, key: str) -> None:
        req = parse({"model": "m", key: ["a", "b", "c"]}, path)
        assert req.prompt_text == "a\nb\nc"
        assert req.prompt_token_ids is None

    def test_token_ids(self, path: str, key: str) -> None:
        req = parse({"model": "m", key: [1, 2, 3]}, path)
        assert req.prompt_text == ""
        assert req.prompt_token_ids == [1, 2, 3]

    def test_batched_token_ids_are_flattened(self, path: str, key: str) -> None:
        req = parse({"model": "m", key: [[1, 2], [3], [4, 5]]}, path)
        assert req.prompt_text == ""
        assert req.prompt_token_ids == [1, 2, 3, 4, 5]

    @pytest.mark.parametrize(
        "value",
        [
            5,
            1.5,
            True,
            {"text": "x"},
            ["a", 1],
            [1, "a"],
            [1, True],
            [1.0, 2.0],
            [[1, 2], "a"],
            [[1, "x"]],
            [[1, True]],
            [[1], 2],
            [None],
        ],
    )
    def test_wrong_types(self, path: str, key: str, value: Any) -> None:
        err = parse_err({"model": "m", key: value}, path)
        assert (err.status, err.param, err.code) == (400, key, "invalid_type")

    def test_missing(self, path: str, key: str) -> None:
        err = parse_err({"model": "m"}, path)
        assert (err.status, err.param, err.code) == (400, key, "missing_field")

    def test_null_is_missing(self, path: str, key: str) -> None:
        err = parse_err({"model": "m", key: None}, path)
        assert (err.param, err.code) == (key, "missing_field")

    def test_api_set(self, path: str, key: str) -> None:
        req = parse({"model": "m", key: "x"}, path)
        assert req.api is api_for_path(path)


def test_embeddings_ignore_prompt_key() -> None:
    err = parse_err({"model": "m", "prompt": "x"}, "/v1/embeddings")
    assert err.param == "input"


def test_completions_ignore_messages() -> None:
    err = parse_err({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "/v1/completions")
    assert err.param == "prompt"


# --------------------------------------------------------------------------------------------------
# parse_body: common fields
# --------------------------------------------------------------------------------------------------


class TestModel:
    @pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
    def test_missing_on_model_apis(self, path: str) -> None:
        err = parse_err({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "input": "x"}, path)
        assert (err.status, err.param, err.code) == (400, "model", "missing_field")

    def test_null_is_missing(self) -> None:
        err = parse_err(chat(model=None))
        assert (err.param, err.code) == ("model", "missing_field")

    @pytest.mark.parametrize("model", [1, True, ["m"], {"name": "m"}, 1.5])
    def test_wrong_type(self, model: Any) -> None:
        err = parse_err(chat(model=model))
        assert (err.status, err.param, err.code) == (400, "model", "invalid_type")

    def test_empty(self) -> None:
        err = parse_err(chat(model=""))
        assert (err.status, err.param, err.code) == (400, "model", "invalid_value")

    def test_too_long(self) -> None:
        err = parse_err(chat(model="x" * (MAX_MODEL_NAME + 1)))
        assert (err.status, err.param, err.code) == (400, "model", "invalid_value")
        assert "x" * 50 not in err.message

    def test_max_length_ok(self) -> None:
        assert MAX_MODEL_NAME == 256
        assert parse(chat(model="y" * 256)).model == "y" * 256

    def test_optional_on_other_apis(self) -> None:
        req = parse({"anything": 1}, "/v1/responses")
        assert req.api is Api.OTHER
        assert req.model is None
        assert req.prompt_text == ""
        assert req.prompt_token_ids is None

    def test_validated_on_other_apis_when_present(self) -> None:
        assert parse({"model": "m"}, "/v1/responses").model == "m"
        err = parse_err({"model": 5}, "/v1/responses")
        assert (err.param, err.code) == ("model", "invalid_type")
        err = parse_err({"model": ""}, "/tokenize")
        assert (err.param, err.code) == ("model", "invalid_value")

    def test_models_api_without_model(self) -> None:
        assert parse({}, "/v1/models").model is None


class TestStream:
    @pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (None, False)])
    def test_bool_or_null(self, value: Any, expected: bool) -> None:
        assert parse(chat(stream=value)).stream is expected

    def test_absent_is_false(self) -> None:
        assert parse(chat()).stream is False

    @pytest.mark.parametrize("value", ["true", 1, 0, "yes", [], {}])
    def test_non_bool(self, value: Any) -> None:
        err = parse_err(chat(stream=value))
        assert (err.status, err.param, err.code) == (400, "stream", "invalid_type")


class TestMaxTokens:
    def test_max_tokens(self) -> None:
        assert parse(chat(max_tokens=64)).max_tokens == 64

    def test_max_completion_tokens(self) -> None:
        assert parse(chat(max_completion_tokens=32)).max_tokens == 32

    def test_max_completion_tokens_takes_precedence(self) -> None:
        assert parse(chat(max_tokens=64, max_completion_tokens=32)).max_tokens == 32
        assert parse(chat(max_tokens=64, max_completion_tokens=0)).max_tokens == 0

    def test_null_max_completion_tokens_falls_back(self) -> None:
        assert parse(chat(max_tokens=64, max_completion_tokens=None)).max_tokens == 64

    def test_zero_allowed(self) -> None:
        assert parse(chat(max_tokens=0)).max_tokens == 0

    @pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
    def test_negative_rejected(self, key: str) -> None:
        err = parse_err(chat(**{key: -1}))
        assert (err.status, err.param, err.code) == (400, key, "invalid_value")

    @pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
    @pytest.mark.parametrize("value", [True, False, 1.5, 10.0, "10", [10]])
    def test_non_int_rejected(self, key: str, value: Any) -> None:
        err = parse_err(chat(**{key: value}))
        assert (err.status, err.param, err.code) == (400, key, "invalid_type")


class TestUser:
    def test_body_user(self) -> None:
        assert parse(chat(user="bob")).user == "bob"

    def test_header_user_wins(self) -> None:
        req = parse(chat(user="bob"), **{USER: "alice"})
        assert req.user == "alice"

    @pytest.mark.parametrize("value", [1, True, ["bob"], {"id": "bob"}])
    def test_user_not_string(self, value: Any) -> None:
        err = parse_err(chat(user=value))
        assert (err.status, err.param, err.code) == (400, "user", "invalid_type")

    def test_session_and_priority_from_head(self) -> None:
        req = parse(chat(), **{SESSION: "s1", PRIO: "4"})
        assert (req.session, req.priority) == ("s1", 4)


class TestDocument:
    @pytest.mark.parametrize("doc", [[], [1, 2], "text", 5, None, True])
    def test_non_object(self, doc: Any) -> None:
        err = parse_err(doc)
        assert (err.status, err.code) == (400, "invalid_json")
        assert err.param is None

    @pytest.mark.parametrize(
        "body", [b"", b"{", b'{"model": "m",}', b"not json", b'{"a": 1} trailing', b"\xff\xfe"]
    )
    def test_malformed(self, body: bytes) -> None:
        with pytest.raises(RequestError) as info:
            parse_body(make_head(), body)
        err = info.value
        assert (err.status, err.code) == (400, "invalid_json")
        assert err.message.startswith("Request body is not valid JSON")
        assert_error_body(err)

    @pytest.mark.parametrize(
        "body",
        [
            b'{"model": "m", "api_key": "sk-SECRET-TOKEN-123"',
            b'{"model": "m", "k": sk-SECRET-TOKEN-123}',
            b'{"k": "\\q sk-SECRET-TOKEN-123"}',
            b'{"k": 1} sk-SECRET-TOKEN-123',
            b"sk-SECRET-TOKEN-123",
            b'{"k": "' + b"A" * 500 + b'" sk-SECRET-TOKEN-123',
        ],
    )
    def test_decode_error_does_not_echo_body(self, body: bytes) -> None:
        with pytest.raises(RequestError) as info:
            parse_body(make_head(), body)
        err = info.value
        assert err.code == "invalid_json"
        assert "SECRET" not in err.message
        assert b"SECRET" not in err.body()
        assert "AAAAAAAAAA" not in err.message
        assert len(err.message) < 200

    @pytest.mark.parametrize(
        "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "", "json"]
    )
    def test_non_json_content_type(self, ctype: str) -> None:
        err = parse_err(chat(), content_type=ctype)
        assert err.status == 400
        assert err.code == "unsupported_content_type"
        assert err.param == "content-type"
        assert assert_error_body(err)["code"] == "unsupported_content_type"

    def test_content_type_checked_before_json(self) -> None:
        with pytest.raises(RequestError) as info:
            parse_body(make_head(content_type="text/plain"), b"not json at all")
        assert info.value.code == "unsupported_content_type"

    @pytest.mark.parametrize(
        "ctype",
        [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON;charset=UTF-8",
            "  application/json  ",
            "application/vnd.api+json",
            "application/merge-patch+json; charset=utf-8",
        ],
    )
    def test_json_content_types_accepted(self, ctype: str) -> None:
        assert parse(chat(), content_type=ctype).model == "m"

    def test_missing_content_type_accepted(self) -> None:
        head = make_head(content_type=None)
        assert head.content_type is None
        assert parse_body(head, orjson.dumps(chat())).model == "m"


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


class TestErrors:
    def test_body_shape(self) -> None:
        err = RequestError(400, "bad thing", code="bad", param="p")
        assert orjson.loads(err.body()) == {
            "error": {"message": "bad thing", "type": "invalid_request_error", "param": "p", "code": "bad"}
        }
        assert str(err) == "bad thing"
        assert err.retry_after is None

    def test_code_defaults_to_status(self) -> None:
        err = RequestError(418, "teapot")
        body = assert_error_body(err)
        assert body["code"] == 418
        assert body["param"] is None

    def test_bad_request(self) -> None:
        err = bad_request("nope", param="x")
        assert (err.status, err.code, err.param, err.err_type) == (
            400,
            "invalid_request",
            "x",
            "invalid_request_error",
        )
        assert bad_request("nope", code="c").code == "c"

    def test_unknown_model(self) -> None:
        err = unknown_model("llama-7b")
        assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
        assert "'llama-7b'" in err.message
        assert assert_error_body(err)["code"] == "model_not_found"

    def test_unknown_model_truncates_long_name(self) -> None:
        name = "z" * 5000
        err = unknown_model(name)
        echoed = err.message.count("z")
        assert echoed <= 140
        assert echoed >= 100
        assert "..." in err.message
        assert len(err.message) < 300
        assert b"z" * 141 not in err.body()

    def test_unknown_model_exact_128_not_truncated(self) -> None:
        err = unknown_model("q" * 128)
        assert "'" + "q" * 128 + "'" in err.message
        assert "..." not in err.message

    def test_body_too_large(self) -> None:
        err = body_too_large(1024)
        assert (err.status, err.code) == (413, "request_too_large")
        assert "1024" in err.message
        assert_error_body(err)

    def test_no_upstream(self) -> None:
        err = no_upstream("m1")
        assert (err.status, err.code, err.err_type, err.retry_after) == (
            503,
            "no_upstream",
            "service_unavailable_error",
            1,
        )
        assert "'m1'" in err.message
        assert "this request" in no_upstream(None).message
        assert_error_body(err)

    def test_internal_error(self) -> None:
        err = internal_error()
        assert (err.status, err.code, err.err_type) == (500, "internal", "server_error")
        assert_error_body(err)

    def test_body_is_json_even_with_quotes_in_message(self) -> None:
        err = unknown_model('bad"name\\with\nstuff')
        doc = orjson.loads(err.body())
        assert 'bad"name\\with\nstuff' in doc["error"]["message"]

    def test_is_exception(self) -> None:
        with pytest.raises(RequestError):
            raise bad_request("x")


def test_a_conversation_longer_than_max_messages_is_a_400() -> None:
    """Rendering a million tiny messages takes seconds whatever their bytes: refused with a clear
    400 before any is validated; the longest accepted conversation still parses."""
    one = {"role": "user", "content": ""}
    err = parse_err(chat(messages=[one] * (MAX_MESSAGES + 1)))
    assert (err.status, err.param, err.code) == (400, "messages", "too_many_messages")
    assert f"at most {MAX_MESSAGES}" in assert_error_body(err)["message"]
    assert len(parse(chat(messages=[one] * MAX_MESSAGES)).messages or ()) == MAX_MESSAGES
