"""OpenAI-style errors that end a request with an immediate response from Envoy."""

from __future__ import annotations

from typing import Any

import orjson


class RequestError(Exception):
    """A request the service refuses; carries the HTTP status and an OpenAI-style error body."""

    __slots__ = ("code", "err_type", "message", "param", "retry_after", "status")

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable, so a worker process can raise it (the default would pass only the message)."""
        return (
            _rebuild,
            (self.status, self.message, self.err_type, self.code, self.param, self.retry_after),
        )

    def body(self) -> bytes:
        """The JSON error body. Never echoes request content beyond short, sanitised field names."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": self.param,
                    "code": self.code if self.code is not None else self.status,
                }
            }
        )


def _rebuild(
    status: int, message: str, err_type: str, code: str | None, param: str | None, retry_after: int | None
) -> RequestError:
    return RequestError(status, message, err_type=err_type, code=code, param=param, retry_after=retry_after)


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> RequestError:
    return RequestError(400, message, param=param, code=code)


def unknown_model(model: str) -> RequestError:
    shown = model if len(model) <= 128 else model[:128] + "..."
    return RequestError(
        404,
        f"The model '{shown}' does not exist or is not served by this gateway.",
        err_type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def body_too_large(limit: int) -> RequestError:
    return RequestError(
        413,
        f"Request body exceeds the gateway limit of {limit} bytes.",
        code="request_too_large",
    )


def no_upstream(model: str | None) -> RequestError:
    what = f"model '{model}'" if model else "this request"
    return RequestError(
        503,
        f"No upstream is available for {what}.",
        err_type="service_unavailable_error",
        code="no_upstream",
        retry_after=1,
    )


def prompt_too_long(max_model_len: int, tokens: int, *, exact: bool) -> RequestError:
    """The prompt cannot fit the model's context (413, as for a body over the limit): `tokens` is
    its exact count, or a proven lower bound when the prompt was refused before being encoded."""
    count = f"{tokens}" if exact else f"at least {tokens}"
    return RequestError(
        413,
        f"This model's maximum context length is {max_model_len} tokens; the prompt has {count} tokens.",
        code="context_length_exceeded",
    )


def parser_failed() -> RequestError:
    """The worker process parsing a big body died (killed, out of memory): the request may be fine,
    so a retry is invited; the pool is replaced for the next request."""
    return RequestError(
        503,
        "The gateway failed to parse the request body (a parser process died); retry the request.",
        err_type="service_unavailable_error",
        code="body_parser_failed",
        retry_after=1,
    )


def internal_error() -> RequestError:
    return RequestError(
        500, "The gateway failed to route the request.", err_type="server_error", code="internal"
    )


def shed(reason: str, message: str, retry_after: int) -> RequestError:
    """429 from admission control: the fleet is saturated (`code` says why: `saturated`,
    `queue_full`, `queue_timeout`); the client may retry after `retry_after` seconds."""
    return RequestError(429, message, err_type="rate_limit_error", code=reason, retry_after=retry_after)


def slo_unattainable(
    slo_ms: float,
    best_ms: float | None,
    retry_after: int = 1,
    *,
    measure: str = "time to first token",
    margin: float = 1.0,
) -> RequestError:
    """429: the request asked for a time to first token (or per output token: `measure`) no upstream
    is predicted to meet; shed now rather than served late (only requests that set an objective get
    this). With a `margin` other than 1 the message says so: a best figure under the objective is
    then no contradiction."""
    best = f"; the best predicted is {best_ms:.0f} ms" if best_ms is not None else ""
    if margin != 1.0:
        best += f" (the limit is {margin:g} x the objective: {slo_ms * margin:g} ms)"
    return RequestError(
        429,
        f"No upstream is predicted to meet the requested {measure} of {slo_ms:g} ms{best}.",
        err_type="rate_limit_error",
        code="slo_unattainable",
        retry_after=retry_after,
    )
