"""Builders for ext_proc ProcessingResponse messages.

Header values always go in `raw_value`: current Envoy ignores `value` and would set empty headers.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from extproc.fleet import Upstream
from extproc.lifecycle.endpoints import destination
from extproc.openai import RequestError
from extproc.scheduling.explain import DECISION_HEADER
from extproc.settings import HeaderNames

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
IMMEDIATE_DETAILS = "llm_extproc_rejected"


def _set(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def routing_mutation(
    upstream: Upstream,
    names: HeaderNames,
    ticket: str | None = None,
    *,
    stream: bool = False,
    decision: str | None = None,
    fallbacks: Sequence[Upstream] = (),
    content_length: int | None = None,
) -> pb.HeaderMutation:
    """Set the destination (plus the access-log ticket, the streaming mark routes match on, the
    decision explanation envoy.yaml copies onto the response, and the length of a rewritten body);
    in cluster mode also remove any endpoint header a client smuggled in."""
    sets = [_set(names.destination_cluster, upstream.cluster)]
    if content_length is not None:
        sets.append(_set("content-length", str(content_length)))
    if decision is not None:
        sets.append(_set(DECISION_HEADER, decision))
    if ticket is not None:
        sets.append(_set(names.ticket, ticket))
    if stream:
        sets.append(_set(names.stream, "1"))
    removes: list[str] = []
    endpoints = destination(upstream, fallbacks)  # "ip:port" or "ip:port,fallback,..."
    if endpoints is not None:
        sets.append(_set(names.destination_endpoint, endpoints))
    else:
        removes.append(names.destination_endpoint)
    return pb.HeaderMutation(set_headers=sets, remove_headers=removes)


def endpoint_metadata(
    upstream: Upstream, namespace: str, key: str, fallbacks: Sequence[Upstream] = ()
) -> Struct | None:
    """The same value as the header (the protocol forbids the two differing)."""
    endpoints = destination(upstream, fallbacks)
    if endpoints is None:
        return None
    md = Struct()
    md.update({namespace: {key: endpoints}})
    return md


def _common(common: pb.CommonResponse, mutation: pb.HeaderMutation | None) -> None:
    """Fill a reply's CommonResponse in place: built apart and passed to the constructors, the
    mutation (and a full-duplex body) would be copied twice more. Present even when empty."""
    common.SetInParent()
    if mutation is not None:
        common.clear_route_cache = True
        common.header_mutation.CopyFrom(mutation)


def request_headers(
    mutation: pb.HeaderMutation | None = None, *, metadata: Struct | None = None
) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    _common(resp.request_headers.response, mutation)
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def request_body(
    mutation: pb.HeaderMutation | None = None,
    *,
    metadata: Struct | None = None,
    streamed: bytes | None = None,
    end_of_stream: bool = True,
) -> pb.ProcessingResponse:
    """Body reply. `streamed` carries the body back to Envoy in FULL_DUPLEX_STREAMED mode, where Envoy
    keeps no copy of what it sent us."""
    resp = pb.ProcessingResponse()
    common = resp.request_body.response
    _common(common, mutation)
    if streamed is not None:
        common.body_mutation.streamed_response.body = streamed
        common.body_mutation.streamed_response.end_of_stream = end_of_stream
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def response_body(streamed: bytes | None = None, end_of_stream: bool = False) -> pb.ProcessingResponse:
    common = pb.CommonResponse()
    if streamed is not None:
        common.body_mutation.streamed_response.body = streamed
        common.body_mutation.streamed_response.end_of_stream = end_of_stream
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def model_list(models: list[str], created: int) -> pb.ProcessingResponse:
    """`GET /v1/models` answered by the gateway: every model the pool serves, in OpenAI's shape
    (one upstream's own list would name only what that engine serves)."""
    body = orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": created, "owned_by": "llm-extproc"} for m in models
            ],
        }
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=200),
            headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
            body=body,
            details="llm_extproc_models",
        )
    )


def immediate(error: RequestError) -> pb.ProcessingResponse:
    sets = [_set("content-type", "application/json")]
    if error.retry_after is not None:
        sets.append(_set("retry-after", str(error.retry_after)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=sets),
            body=error.body(),
            details=IMMEDIATE_DETAILS,
        )
    )
