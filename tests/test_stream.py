"""The ext_proc stream state machine, driven with real protobuf messages and no network."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import config_from_dict
from extproc.lifecycle import RequestLifecycle
from extproc.server.completions import CANCELLED_ROUTE_GRACE_S, PendingReleases
from extproc.server.stream import ExternalProcessor, Phase, RequestStream
from extproc.telemetry import Metrics

POOL = {
    "clusters": [
        {"name": "gpu-a", "models": ["m"], "endpoints": ["127.0.0.1:1"]},
        {"name": "gpu-b", "models": ["m"], "endpoints": ["127.0.0.1:2"]},
    ]
}
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def lifecycle(routing: str = "cluster", **extra: object) -> RequestLifecycle:
    cfg = config_from_dict({"pool": POOL, "routing": routing, "metrics_listen": None, **extra})
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


def headers_msg(
    end_of_stream: bool = False,
    mode: int = ProcessingMode.BUFFERED,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    **extra: str,
) -> pb.ProcessingRequest:
    hs = {":method": method, ":path": path, "content-type": "application/json", **extra}
    hmap = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap, end_of_stream=end_of_stream))
    msg.protocol_config.request_body_mode = mode
    return msg


def body_msg(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def test_buffered_routes_in_body_reply_and_holds_lease_until_close() -> None:
    lc = lifecycle()
    s = RequestStream(lc)
    [r1] = await s.on_message(headers_msg())
    assert r1.WhichOneof("response") == "request_headers"
    assert not r1.request_headers.response.HasField("header_mutation")  # just continue
    [r2] = await s.on_message(body_msg(CHAT))
    common = r2.request_body.response
    assert common.clear_route_cache
    chosen = set_headers(common)["x-llm-destination-cluster"]
    assert chosen in {"gpu-a", "gpu-b"}
    # Cluster mode: a smuggled endpoint header is removed, and values go in raw_value only.
    assert list(common.header_mutation.remove_headers) == ["x-gateway-destination-endpoint"]
    assert all(h.header.value == "" for h in common.header_mutation.set_headers)
    assert not common.HasField("body_mutation")  # buffered: Envoy keeps the body
    assert lc.inflight.count(chosen) == 1
    s.close()
    assert lc.inflight.count(chosen) == 0
    s.close()  # idempotent
    assert lc.inflight.total() == 0


async def test_full_duplex_defers_headers_reply_and_returns_body() -> None:
    lc = lifecycle()
    s = RequestStream(lc)
    assert await s.on_message(headers_msg(mode=ProcessingMode.FULL_DUPLEX_STREAMED)) == []
    assert await s.on_message(body_msg(CHAT[:10], end_of_stream=False)) == []
    r_headers, r_body = await s.on_message(body_msg(CHAT[10:], end_of_stream=True))
    assert r_headers.request_headers.response.clear_route_cache
    assert "x-llm-destination-cluster" in set_headers(r_headers.request_headers.response)
    streamed = r_body.request_body.response.body_mutation.streamed_response
    assert streamed.body == CHAT and streamed.end_of_stream


async def test_full_duplex_with_trailers_ends_in_trailers_reply() -> None:
    s = RequestStream(lifecycle())
    await s.on_message(headers_msg(mode=ProcessingMode.FULL_DUPLEX_STREAMED))
    assert await s.on_message(body_msg(CHAT, end_of_stream=False)) == []
    replies = await s.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    assert not replies[1].request_body.response.body_mutation.streamed_response.end_of_stream


async def test_models_listed_by_the_gateway_from_the_pool() -> None:
    s = RequestStream(lifecycle())
    [r] = await s.on_message(headers_msg(end_of_stream=True, method="GET", path="/v1/models"))
    assert r.immediate_response.status.code == 200
    doc = orjson.loads(r.immediate_response.body)
    assert doc["object"] == "list" and [m["id"] for m in doc["data"]] == ["m"]
    assert s.phase is Phase.DONE and s.decision is None  # nothing routed, nothing held


async def test_bodyless_request_routes_in_headers_reply() -> None:
    s = RequestStream(lifecycle())
    [r] = await s.on_message(headers_msg(end_of_stream=True, method="GET", path="/v1/models/m"))
    assert r.request_headers.response.clear_route_cache
    assert set_headers(r.request_headers.response)["x-llm-destination-cluster"] in {"gpu-a", "gpu-b"}
    assert s.phase is Phase.ROUTED


async def test_chat_without_body_is_400() -> None:
    s = RequestStream(lifecycle())
    [r] = await s.on_message(headers_msg(end_of_stream=True))
    assert r.immediate_response.status.code == 400
    assert orjson.loads(r.immediate_response.body)["error"]["code"] == "missing_body"
    assert s.phase is Phase.DONE


async def test_endpoint_mode_sets_header_and_lb_metadata() -> None:
    s = RequestStream(lifecycle(routing="endpoint"))
    await s.on_message(headers_msg())
    [r] = await s.on_message(body_msg(CHAT))
    hs = set_headers(r.request_body.response)
    addr = hs["x-gateway-destination-endpoint"]
    assert addr in {"127.0.0.1:1", "127.0.0.1:2"}
    md = r.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert md.string_value == addr


async def test_immediate_error_has_json_body_and_content_type() -> None:
    s = RequestStream(lifecycle())
    await s.on_message(headers_msg())
    [r] = await s.on_message(body_msg(b"{not json"))
    ir = r.immediate_response
    assert ir.status.code == 400 and ir.details == "llm_extproc_rejected"
    assert {h.header.key: h.header.raw_value for h in ir.headers.set_headers}[
        "content-type"
    ] == b"application/json"
    assert (
        await s.on_message(body_msg(b"more")) == []
    )  # after an immediate response, nothing else is answered


async def test_content_length_over_limit_rejected_at_headers() -> None:
    s = RequestStream(lifecycle(max_body_bytes=100))
    [r] = await s.on_message(headers_msg(**{"content-length": "101"}))
    assert r.immediate_response.status.code == 413


async def test_full_duplex_chunks_over_limit_rejected_before_the_end() -> None:
    s = RequestStream(lifecycle(max_body_bytes=100))
    await s.on_message(headers_msg(mode=ProcessingMode.FULL_DUPLEX_STREAMED))
    assert await s.on_message(body_msg(b"x" * 60, end_of_stream=False)) == []
    [r] = await s.on_message(body_msg(b"x" * 60, end_of_stream=False))
    assert r.immediate_response.status.code == 413


async def test_partial_buffered_body_is_413() -> None:
    s = RequestStream(lifecycle())
    await s.on_message(headers_msg(mode=ProcessingMode.BUFFERED_PARTIAL))
    [r] = await s.on_message(body_msg(CHAT[:5], end_of_stream=False))
    assert r.immediate_response.status.code == 413


async def test_streamed_body_mode_is_refused_clearly() -> None:
    s = RequestStream(lifecycle())
    [r] = await s.on_message(headers_msg(mode=ProcessingMode.STREAMED))
    assert r.immediate_response.status.code == 500
    assert b"FULL_DUPLEX_STREAMED" in r.immediate_response.body


async def test_response_trailers_release_lease_once() -> None:
    lc = lifecycle()
    s = RequestStream(lc)
    await s.on_message(headers_msg())
    await s.on_message(body_msg(CHAT))
    assert lc.inflight.total() == 1
    [r] = await s.on_message(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert r.WhichOneof("response") == "response_trailers"
    assert lc.inflight.total() == 0
    s.close()
    assert lc.inflight.total() == 0
    m = lc.metrics.registry
    assert m.get_sample_value("llm_extproc_releases_total", {"trigger": "response_end"}) == 1
    assert m.get_sample_value("llm_extproc_releases_total", {"trigger": "stream_end"}) is None


async def test_full_duplex_response_body_is_echoed() -> None:
    lc = lifecycle()
    s = RequestStream(lc)
    msg = headers_msg()
    msg.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    await s.on_message(msg)
    await s.on_message(body_msg(CHAT))
    [r] = await s.on_message(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=True))
    )
    assert r.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert lc.inflight.total() == 0


async def test_internal_error_becomes_500_and_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    lc = lifecycle()

    class Boom:
        name = "boom"

        def pick(self, *a: object) -> None:
            raise RuntimeError("bug")

    monkeypatch.setattr(lc.config.profile, "picker", Boom())
    s = RequestStream(lc)
    await s.on_message(headers_msg())
    [r] = await s.on_message(body_msg(CHAT))
    assert r.immediate_response.status.code == 500
    assert b"bug" not in r.immediate_response.body  # internals are not leaked to the client


def test_duplicate_headers_are_joined_and_keys_lowercased() -> None:
    from extproc.server.stream import _header_map

    hmap = HeaderMap(
        headers=[HeaderValue(key="X-Session-Id", raw_value=b"a"), HeaderValue(key="x-session-id", value="b")]
    )
    assert _header_map(pb.HttpHeaders(headers=hmap)) == {"x-session-id": "a,b"}


def test_route_profile_selection_falls_back_to_default() -> None:
    lc = lifecycle(
        scheduling={
            "profile": "a",
            "profiles": {"a": {"scorers": ["least-outstanding"]}, "b": {"scorers": []}},
        }
    )
    assert lc.profile(None).name == "a"
    assert lc.profile("b").name == "b"
    assert lc.profile("typo").name == "a"  # a typo in envoy.yaml must not fail requests


class FakeContext:
    """grpc.aio's reader/writer side of one stream: `read()` hands out the messages, then EOF (or
    raises `fail`); `write()` keeps the replies (or raises `fail_write` on write number `fail_at`)."""

    def __init__(
        self,
        msgs: list[pb.ProcessingRequest],
        *,
        fail: BaseException | None = None,
        fail_write: BaseException | None = None,
        fail_at: int = 0,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.msgs = list(msgs)
        self.fail = fail
        self.fail_write = fail_write
        self.fail_at = fail_at
        self.metadata = metadata
        self.written: list[pb.ProcessingResponse] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def read(self) -> object:
        if self.msgs:
            return self.msgs.pop(0)
        if self.fail is not None:
            raise self.fail
        return grpc.aio.EOF

    async def write(self, reply: pb.ProcessingResponse) -> None:
        if self.fail_write is not None and len(self.written) == self.fail_at:
            raise self.fail_write
        self.written.append(reply)


def streams_open(lc: RequestLifecycle) -> float:
    return lc.metrics.registry.get_sample_value("llm_extproc_active_streams") or 0.0


def released(lc: RequestLifecycle, trigger: str) -> float:
    return lc.metrics.registry.get_sample_value("llm_extproc_releases_total", {"trigger": trigger}) or 0.0


async def test_servicer_ends_the_call_once_routed_with_a_ticket() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    ctx = FakeContext([headers_msg(), body_msg(CHAT), headers_msg()])
    await ExternalProcessor(lc, pending).Process(None, ctx)  # type: ignore[arg-type]
    assert [r.WhichOneof("response") for r in ctx.written] == ["request_headers", "request_body"]
    assert len(ctx.msgs) == 1  # not read: the call ended once routed
    assert len(pending) == 1 and lc.inflight.total() == 1  # the access log releases it
    assert streams_open(lc) == 0


async def test_servicer_without_tickets_releases_when_the_client_goes_away() -> None:
    lc = lifecycle()
    ctx = FakeContext([headers_msg(), body_msg(CHAT)], fail=asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await ExternalProcessor(lc).Process(None, ctx)  # type: ignore[arg-type]
    assert len(ctx.written) == 2
    assert lc.inflight.total() == 0 and streams_open(lc) == 0
    assert released(lc, "stream_end") == 1


async def test_servicer_cancelled_before_the_routes_last_reply_releases_the_ticket_at_once() -> None:
    """FULL_DUPLEX_STREAMED routes with two replies (headers, then the body Envoy kept no copy of): a
    call cancelled while the first is written never gave Envoy a request it could send on."""
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    duplex = headers_msg(mode=ProcessingMode.FULL_DUPLEX_STREAMED)
    ctx = FakeContext([duplex, body_msg(CHAT)], fail_write=asyncio.CancelledError(), fail_at=0)
    with pytest.raises(asyncio.CancelledError):
        await ExternalProcessor(lc, pending).Process(None, ctx)  # type: ignore[arg-type]
    assert ctx.written == []
    assert len(pending) == 0 and lc.inflight.total() == 0
    assert released(lc, "stream_cancel") == 1


@pytest.mark.parametrize("mode", [ProcessingMode.BUFFERED, ProcessingMode.FULL_DUPLEX_STREAMED])
async def test_servicer_cancelled_while_writing_the_routes_last_reply_waits_for_the_access_log(
    mode: int,
) -> None:
    """Envoy resets the call once it has the last reply it needs, so a service slow to end the call
    sees a cancelled write of a reply Envoy applied: the lease stays until the access log reports
    the request, or until a short grace has passed (the reply never arrived)."""
    now = [100.0]
    for entry_comes in (True, False):
        lc = lifecycle()
        pending = PendingReleases(lc, 60.0, clock=lambda: now[0])
        # The second write: BUFFERED's route (after "continue"), FULL_DUPLEX's body (after the route).
        ctx = FakeContext(
            [headers_msg(mode=mode), body_msg(CHAT)], fail_write=asyncio.CancelledError(), fail_at=1
        )
        with pytest.raises(asyncio.CancelledError):
            await ExternalProcessor(lc, pending).Process(None, ctx)  # type: ignore[arg-type]
        assert len(pending) == 1 and lc.inflight.total() == 1
        [ticket] = pending._pending
        pending.sweep()
        assert lc.inflight.total() == 1  # not yet
        if entry_comes:
            assert pending.complete(ticket, "access_log") == "released"
            assert released(lc, "access_log") == 1
        now[0] += CANCELLED_ROUTE_GRACE_S
        pending.sweep()
        assert len(pending) == 0 and lc.inflight.total() == 0
        assert released(lc, "stream_cancel") == (0 if entry_comes else 1)


async def test_servicer_ends_quietly_when_envoy_closes_before_the_body() -> None:
    lc = lifecycle()
    ctx = FakeContext([headers_msg()])
    await ExternalProcessor(lc).Process(None, ctx)  # type: ignore[arg-type]
    assert [r.WhichOneof("response") for r in ctx.written] == ["request_headers"]
    assert lc.inflight.total() == 0 and streams_open(lc) == 0


def test_metric_children_are_the_labelled_series() -> None:
    lc = lifecycle()
    m = lc.metrics
    routed = m.requests.labels(model="m", cluster="gpu-a", outcome="routed")
    assert m.requests_by("m", "gpu-a", "routed") is routed
    assert m.releases_by("access_log") is m.releases_by("access_log")
