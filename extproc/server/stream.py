"""The ext_proc stream state machine: one gRPC stream per HTTP request.

BUFFERED: Envoy sends headers (we continue), then the whole body (we route in the body reply).
FULL_DUPLEX_STREAMED: Envoy sends headers and body chunks without waiting; we hold the headers reply
until the body is complete, then send headers (with the route) and give the body back, because in
this mode Envoy keeps no copy. Bodyless requests are routed in the headers reply.

Releasing the in-flight lease: with `release_on: stream_end` the stream stays open while response
phases arrive and the lease is released at the end of the response (response trailers / last body
chunk) or when the stream closes, so the response depends on this stream. With `release_on:
access_log` the routed request carries a ticket, the stream ends right after routing, and Envoy's
access log releases it (server/completions.py); a stream cancelled after routing releases at once,
or, cancelled while the route's last reply was being written (it may have arrived), when the
access log reports it or a short grace has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from enum import Enum, auto

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.lifecycle import Decision, RequestLifecycle
from extproc.lifecycle.admission import NO_ROUTE, RouteAdmission, route_admission
from extproc.openai import Api, RequestError, RequestHead
from extproc.openai.errors import internal_error
from extproc.scheduling import Profile
from extproc.server import picker, responses
from extproc.server.completions import PendingReleases
from extproc.settings import PROFILE_METADATA_KEY

log = logging.getLogger("extproc.stream")

_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_STREAMED = ProcessingMode.STREAMED
ENDPOINT_METADATA_KEY = "x-gateway-destination-endpoint"
Metadata = Sequence[tuple[str, str | bytes]]


class Phase(Enum):
    HEADERS = auto()
    BODY = auto()
    ROUTED = auto()
    DONE = auto()


class RequestStream:
    """State for one ext_proc stream. `on_message` returns the replies to send, in order. It awaits
    only when routing a long prompt (tokenized on a worker thread, never on the event loop)."""

    __slots__ = (
        "_body",
        "_body_size",
        "body_mode",
        "decision",
        "explain",
        "head",
        "lifecycle",
        "pending",
        "phase",
        "profile",
        "response_body_mode",
        "route",
        "route_sent",
        "subset",
        "ticket",
    )

    def __init__(
        self,
        lifecycle: RequestLifecycle,
        profile: Profile | None = None,
        pending: PendingReleases | None = None,
        route: RouteAdmission = NO_ROUTE,
    ) -> None:
        self.lifecycle = lifecycle
        self.profile = profile
        self.route = route  # the route's priority class / cap / TTFT objective (route metadata)
        self.pending = pending
        self.ticket: str | None = None
        self.route_sent = False  # the route's last reply was handed to gRPC
        self.phase = Phase.HEADERS
        self.body_mode: int = ProcessingMode.BUFFERED
        self.response_body_mode: int = ProcessingMode.NONE
        self.head: RequestHead | None = None
        self.decision: Decision | None = None
        self.subset: frozenset[str] | None = None  # the gateway's subset hint (server/picker.py)
        self.explain = False  # this response gets the x-llm-decision header (explain: settings)
        self._body: list[bytes] = []
        self._body_size = 0

    async def on_message(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if msg.HasField("protocol_config"):
            self.body_mode = msg.protocol_config.request_body_mode
            self.response_body_mode = msg.protocol_config.response_body_mode
        if self.subset is None and self.phase is not Phase.ROUTED and msg.HasField("metadata_context"):
            self.subset = picker.subset_hint(msg)
        try:
            if kind == "request_headers":
                return await self._on_request_headers(msg.request_headers)
            if kind == "request_body":
                return await self._on_request_body(msg.request_body)
            if kind == "request_trailers":
                return await self._on_request_trailers()
            return self._on_response(kind, msg)
        except RequestError as err:
            return self._reject(err)
        except Exception:
            log.exception("unexpected error while processing %s", kind)
            return self._reject(internal_error())

    def close(self, *, cancelled: bool = False) -> None:
        """The stream ended: normally, or `cancelled` (Envoy reset it, the client went away)."""
        if self.decision is not None:
            if self.ticket is None:
                self.lifecycle.finish(self.decision, "stream_end")
            elif cancelled and self.route_sent and self.pending is not None:
                self.pending.doubt(self.ticket)
            elif cancelled:
                # Envoy never had the route (so no access-log entry will carry the ticket): release
                # now; a late entry finds nothing to release.
                self.pending_done()
                self.lifecycle.finish(self.decision, "stream_cancel")
        self.phase = Phase.DONE

    @property
    def released_by_access_log(self) -> bool:
        """Routed, and the access log (not this stream) will report the request's end."""
        return self.ticket is not None and self.phase is Phase.ROUTED

    def pending_done(self) -> None:
        if self.ticket is not None and self.pending is not None:
            self.pending.cancel(self.ticket)

    # -- request path --------------------------------------------------------------------------
    async def _on_request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.HEADERS:
            raise RequestError(500, "Unexpected request headers.", err_type="server_error", code="protocol")
        headers = _header_map(msg)
        self.head = self.lifecycle.read_head(headers)
        self.explain = self.lifecycle.config.explain.wants_header(headers)
        if self.head.api is Api.MODELS and self.head.method == "GET":
            self.phase = Phase.DONE
            return [responses.model_list(self.lifecycle.served_models(), int(time.time()))]
        if msg.end_of_stream:
            return [await self._route(None, in_headers=True)]
        if self.body_mode == _STREAMED:
            raise RequestError(
                500,
                "ext_proc request_body_mode STREAMED cannot route on the body; "
                "use BUFFERED or FULL_DUPLEX_STREAMED.",
                err_type="server_error",
                code="unsupported_mode",
            )
        self.phase = Phase.BODY
        if self.body_mode == _FULL_DUPLEX:
            return []  # the headers reply waits for the body
        return [responses.request_headers()]

    async def _on_request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.BODY:
            raise RequestError(500, "Unexpected request body.", err_type="server_error", code="protocol")
        chunk = msg.body  # each read of a bytes field copies it out of the message: read it once
        if chunk:
            self._body.append(chunk)
            self._body_size += len(chunk)
            self.lifecycle.check_size(self._body_size)
        if self.body_mode == _FULL_DUPLEX:
            if not msg.end_of_stream:
                return []
            return await self._route_full_duplex(end_of_stream=True)
        if not msg.end_of_stream:
            # BUFFERED_PARTIAL hands over a prefix once Envoy's buffer is full: the body is too big.
            raise RequestError(413, "Request body exceeds the gateway buffer.", code="request_too_large")
        return [await self._route(b"".join(self._body), in_headers=False)]

    async def _on_request_trailers(self) -> list[pb.ProcessingResponse]:
        if self.phase is Phase.BODY and self.body_mode == _FULL_DUPLEX:
            return [*await self._route_full_duplex(end_of_stream=False), responses.request_trailers()]
        return [responses.request_trailers()]

    async def _route_full_duplex(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        body = b"".join(self._body)
        headers_reply, rewritten = await self._route_body(body, in_headers=True)
        out = body if rewritten is None else rewritten
        return [headers_reply, responses.request_body(streamed=out, end_of_stream=end_of_stream)]

    async def _route(self, body: bytes | None, *, in_headers: bool) -> pb.ProcessingResponse:
        reply, rewritten = await self._route_body(body, in_headers=in_headers)
        if rewritten is not None and not in_headers:  # BUFFERED: Envoy swaps in the new body
            reply.request_body.response.body_mutation.body = rewritten
        return reply

    async def _route_body(
        self, body: bytes | None, *, in_headers: bool
    ) -> tuple[pb.ProcessingResponse, bytes | None]:
        """The routing reply, and the body as the engine must get it when it changes (else None):
        with `engine_priority:` the request's class is written into it, and its length header with it."""
        assert self.head is not None
        self._body = []
        decision = await self.lifecycle.route_async(
            self.head, body, self.profile, explain=self.explain, subset=self.subset, route=self.route
        )
        self.decision = decision
        rewritten = await self.lifecycle.engine_body(decision, body)
        self.phase = Phase.ROUTED
        cfg = self.lifecycle.config
        if self.pending is not None:
            self.ticket = self.pending.register(decision)
        why = cfg.explain.header_for(decision.explanation) if self.explain and decision.explanation else None
        mutation = responses.routing_mutation(
            decision.upstream,
            cfg.headers,
            self.ticket,
            stream=decision.request.stream,
            decision=why,
            fallbacks=decision.fallbacks,
            content_length=None if rewritten is None else len(rewritten),
        )
        metadata = responses.endpoint_metadata(
            decision.upstream,
            cfg.endpoint_metadata_namespace,
            cfg.headers.destination_endpoint,
            decision.fallbacks,
        )
        if in_headers:
            return responses.request_headers(mutation, metadata=metadata), rewritten
        return responses.request_body(mutation, metadata=metadata), rewritten

    # -- response path -------------------------------------------------------------------------
    def _on_response(self, kind: str | None, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if kind == "response_headers":
            if self.decision is not None and self.decision.upstream.address is not None:
                served = picker.served_endpoint(msg, _header_map(msg.response_headers))
                if served is not None:
                    picker.record_served(self.lifecycle, self.decision, served)
            if msg.response_headers.end_of_stream:
                self._release_on_response_end()
            return [responses.response_headers()]
        if kind == "response_body":
            if msg.response_body.end_of_stream:
                self._release_on_response_end()
            if self.response_body_mode == _FULL_DUPLEX:
                return [responses.response_body(msg.response_body.body, msg.response_body.end_of_stream)]
            return [responses.response_body()]
        if kind == "response_trailers":
            self._release_on_response_end()
            return [responses.response_trailers()]
        log.debug("ignoring ext_proc message %s", kind)
        return []

    def _release_on_response_end(self) -> None:
        if self.decision is not None:
            self.pending_done()
            self.lifecycle.finish(self.decision, "response_end")

    def _reject(self, err: RequestError) -> list[pb.ProcessingResponse]:
        if self.phase is Phase.DONE:
            return []
        self.phase = Phase.DONE
        self.pending_done()
        self.lifecycle.reject(err, self.decision)
        return [responses.immediate(err)]


def _header_map(msg: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        raw = h.raw_value  # each field read builds a new object: read it once
        value = raw.decode("utf-8", "replace") if raw else h.value
        key = h.key.lower()
        if key in out:
            out[key] = f"{out[key]},{value}"
        else:
            out[key] = value
    return out


def _profile_name(metadata: Metadata) -> str | None:
    for key, value in metadata:
        if key == PROFILE_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """grpc.aio servicer: drives one RequestStream per Envoy stream."""

    def __init__(self, lifecycle: RequestLifecycle, pending: PendingReleases | None = None) -> None:
        self.lifecycle = lifecycle
        self.pending = pending

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """grpc.aio's reader/writer API (`context.read()` / `context.write()`) rather than async
        generators: a generator layer each way costs a step per message, and a request generator
        left unfinished (we stop reading once routed) is closed later by asyncio's finalizer hook,
        a thread-safe wake-up of the loop and a task per request. `request_iterator` is unused."""
        metadata: Metadata = context.invocation_metadata() or ()
        profile = self.lifecycle.profile(_profile_name(metadata))
        route = route_admission(metadata, self.lifecycle.config.admission.client_max_priority)
        stream = RequestStream(self.lifecycle, profile, self.pending, route)
        streams = self.lifecycle.metrics.streams
        streams.inc()
        cancelled = True  # until the loop ends on its own: a cancellation or error skips the flag
        try:
            while (msg := await context.read()) is not grpc.aio.EOF:
                replies = await stream.on_message(msg)
                for i, reply in enumerate(replies, 1):
                    if i == len(replies) and stream.released_by_access_log:
                        stream.route_sent = True
                    await context.write(reply)
                if stream.phase is Phase.DONE or stream.released_by_access_log:
                    # Routed with a ticket: end the call now (gRPC OK). Envoy goes on without this
                    # stream, so the response never depends on it; it would otherwise hold a
                    # buffered-body stream open until the response ends, even with every response
                    # phase set to SKIP/NONE.
                    break
            cancelled = False
        finally:
            stream.close(cancelled=cancelled)
            streams.dec()
