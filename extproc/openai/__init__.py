"""OpenAI API surface: request parsing and error bodies."""

from extproc.openai.errors import RequestError
from extproc.openai.parse import (
    Api,
    InferenceRequest,
    RequestHead,
    api_for_path,
    bodyless_request,
    parse_body,
    parse_head,
)

__all__ = [
    "Api",
    "InferenceRequest",
    "RequestError",
    "RequestHead",
    "api_for_path",
    "bodyless_request",
    "parse_body",
    "parse_head",
]
