"""Releasing routed requests from Envoy's access log (release_on: access_log), without a network."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from test_stream import CHAT, POOL, body_msg, headers_msg, set_headers

from extproc.config import config_from_dict
from extproc.lifecycle import RequestLifecycle
from extproc.server.completions import AccessLogReceiver, PendingReleases, _first_byte_s
from extproc.server.relay import ReleaseRelay
from extproc.server.stream import Phase, RequestStream
from extproc.settings import RedisSettings
from extproc.telemetry import Metrics


def lifecycle(**extra: object) -> RequestLifecycle:
    cfg = config_from_dict(
        {"pool": POOL, "routing": "cluster", "metrics_listen": None, "release_on": "access_log", **extra}
    )
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


def released(lc: RequestLifecycle, trigger: str) -> float:
    return lc.metrics.registry.get_sample_value("llm_extproc_releases_total", {"trigger": trigger}) or 0.0


async def routed(lc: RequestLifecycle, pending: PendingReleases, body: bytes = CHAT) -> RequestStream:
    stream = RequestStream(lc, pending=pending)
    await stream.on_message(headers_msg())
    [reply] = await stream.on_message(body_msg(body))
    headers = set_headers(reply.request_body.response)
    assert headers["x-llm-ticket"] == stream.ticket
    assert ("x-llm-stream" in headers) == bool(orjson.loads(body).get("stream"))
    return stream


async def test_routed_request_carries_a_ticket_and_is_released_by_it() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0, replica="r1")
    stream = await routed(lc, pending)
    assert stream.ticket is not None and stream.ticket.startswith("r1.")
    assert len(stream.ticket.partition(".")[2]) == 32  # 128 random bits: not guessable from another
    stream.close()  # Envoy half-closes right after routing: the lease is kept
    assert lc.inflight.total() == 1 and len(pending) == 1
    assert pending.complete(stream.ticket, "access_log") == "released"
    assert lc.inflight.total() == 0 and released(lc, "access_log") == 1
    # A repeated entry (or a forged one) releases nothing more.
    assert pending.complete(stream.ticket, "access_log") == "unknown"
    assert pending.complete("other.1", "access_log") == "other_replica"
    assert pending.complete("", "access_log") == "no_ticket"
    assert lc.inflight.total() == 0
    # A forger who saw one ticket cannot name the next: the one after it, counted on, is unknown.
    second = await routed(lc, pending)
    second.close()
    guess = int(stream.ticket.partition(".")[2], 16) + 1
    assert pending.complete(f"r1.{guess:032x}", "access_log") == "unknown"
    assert pending.complete(f"r1.{guess:x}", "access_log") == "unknown"
    assert lc.inflight.total() == 1 and second.ticket is not None
    assert pending.complete(second.ticket, "access_log") == "released"


async def test_streaming_requests_are_marked_for_the_header_timeout_route() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    stream = RequestStream(lc, pending=pending)
    await stream.on_message(headers_msg())
    body = orjson.dumps({**orjson.loads(CHAT), "stream": True})
    [reply] = await stream.on_message(body_msg(body))
    assert set_headers(reply.request_body.response)["x-llm-stream"] == "1"
    plain = await routed(lc, pending)  # routed() checks the mark is absent without "stream": true
    assert plain.phase is Phase.ROUTED


async def test_cancelled_stream_releases_at_once() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    stream = await routed(lc, pending)
    stream.close(cancelled=True)  # Envoy reset the stream: the route may never have been applied
    assert lc.inflight.total() == 0 and len(pending) == 0
    assert released(lc, "stream_cancel") == 1
    assert stream.ticket is not None
    assert pending.complete(stream.ticket, "access_log") == "unknown"  # a late entry: nothing twice


async def test_response_phases_still_release_when_envoy_sends_them() -> None:
    """An Envoy config that keeps response_trailer_mode SEND with access_log release: both paths end
    in one release."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    stream = await routed(lc, pending)
    await stream.on_message(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert lc.inflight.total() == 0 and len(pending) == 0
    assert stream.ticket is not None
    assert pending.complete(stream.ticket, "access_log") == "unknown"
    assert released(lc, "response_end") == 1 and released(lc, "access_log") == 0


async def test_lost_entries_expire_oldest_first() -> None:
    lc = lifecycle()
    now = [100.0]
    pending = PendingReleases(lc, 30.0, clock=lambda: now[0])
    first = await routed(lc, pending)
    now[0] += 20
    await routed(lc, pending)
    now[0] += 15  # the first is 35 s old, the second 15 s
    assert pending.sweep() == 1
    assert lc.inflight.total() == 1 and released(lc, "expired") == 1
    assert first.ticket is not None and pending.complete(first.ticket, "access_log") == "unknown"


async def test_rejected_after_routing_forgets_the_ticket() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0)
    stream = await routed(lc, pending)
    from extproc.openai import RequestError

    stream._reject(RequestError(500, "boom", err_type="server_error", code="x"))
    assert lc.inflight.total() == 0 and len(pending) == 0


async def test_access_log_service_over_real_grpc() -> None:
    """Envoy's AccessLogService wire format: entries with and without our ticket, over a real channel."""
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0, replica="me")
    streams = [await routed(lc, pending) for _ in range(3)]
    server = grpc.aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogReceiver(pending, "x-llm-ticket"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = als_pb2_grpc.AccessLogServiceStub(channel)

            def message(*tickets: str) -> als_pb2.StreamAccessLogsMessage:
                msg = als_pb2.StreamAccessLogsMessage()
                for t in tickets:
                    entry = HTTPAccessLogEntry()
                    if t:
                        entry.request.request_headers["x-llm-ticket"] = t
                    msg.http_logs.log_entry.append(entry)
                return msg

            tickets = [s.ticket or "" for s in streams]
            call = stub.StreamAccessLogs()
            await call.write(message(tickets[0], ""))
            await call.write(message(tickets[1], tickets[2], "other.9"))
            await call.done_writing()
            await asyncio.wait_for(call, 10)
    finally:
        await server.stop(None)
    assert lc.inflight.total() == 0
    sample = lc.metrics.registry.get_sample_value
    assert sample("llm_extproc_access_log_entries_total", {"outcome": "released"}) == 3
    assert sample("llm_extproc_access_log_entries_total", {"outcome": "no_ticket"}) == 1
    assert sample("llm_extproc_access_log_entries_total", {"outcome": "other_replica"}) == 1


def _entry(start_s: float, first_byte: object = None, namespace: str = "llm_extproc") -> HTTPAccessLogEntry:
    entry = HTTPAccessLogEntry()
    entry.common_properties.start_time.FromNanoseconds(int(start_s * 1e9))
    if first_byte is not None:
        entry.common_properties.metadata.filter_metadata[namespace].update({"first_byte_ms": first_byte})
    return entry


def test_the_first_byte_time_is_read_from_the_entry_and_bad_values_are_dropped() -> None:
    """The Lua filter's `first_byte_ms` (ms since the epoch) against the entry's start; missing, of
    the wrong type, before the start or absurdly late: not a TTFT (the request still releases)."""
    start = 1_796_549_211.9182
    assert _first_byte_s(_entry(start, start * 1000 + 303.0)) == pytest.approx(0.303, abs=1e-6)
    assert _first_byte_s(_entry(start, 1_796_549_211_918.0)) == 0.0  # the start's own millisecond
    assert _first_byte_s(_entry(start)) is None
    assert _first_byte_s(_entry(start, start * 1000 + 300.0, namespace="other")) is None
    assert _first_byte_s(_entry(start, "1796549212221")) is None
    assert _first_byte_s(_entry(start, start * 1000 - 50.0)) is None
    assert _first_byte_s(_entry(start, start * 1000 + 2e7)) is None


async def test_streamed_requests_count_their_observed_ttft_by_class_when_released() -> None:
    lc = lifecycle()
    pending = PendingReleases(lc, 60.0, replica="r1")
    streamed = await routed(lc, pending, orjson.dumps({**orjson.loads(CHAT), "stream": True}))
    plain = await routed(lc, pending)
    for stream, seconds in ((streamed, 0.25), (plain, 0.75)):
        assert stream.ticket is not None
        assert pending.complete(stream.ticket, "access_log", None, lambda s=seconds: s) == "released"
    sample = lc.metrics.registry.get_sample_value
    assert sample("llm_extproc_observed_ttft_seconds_count", {"priority": "standard"}) == 1
    assert sample("llm_extproc_observed_ttft_seconds_sum", {"priority": "standard"}) == 0.25


async def test_a_relayed_first_byte_time_is_counted_by_the_owner_and_ignored_by_an_older_one() -> None:
    """With several replicas the access-log entry may reach another replica: it relays the first-byte
    time on a line of its own before the ticket. The owner counts it; a replica that predates it reads
    the line as a ticket it does not know, releases nothing by it, and releases on the ticket line."""
    lc = lifecycle()
    owner = PendingReleases(lc, 60.0, replica="owner")
    streamed = await routed(lc, owner, orjson.dumps({**orjson.loads(CHAT), "stream": True}))
    assert streamed.ticket is not None
    sender = ReleaseRelay(RedisSettings(url="redis://127.0.0.1:1", pool="p"), PendingReleases(lc, 60.0))
    sender.forward(streamed.ticket, 0.25)
    sender.forward("owner.plain")
    sender.forward("owner.with space", 0.1)  # not a ticket: dropped
    lines = sender._outbox["owner"]
    assert lines == [f"{streamed.ticket} 0.250000", streamed.ticket, "owner.plain"]
    assert owner.complete(lines[0], "access_log_relay") == "unknown"  # as an older replica reads it
    assert lc.inflight.total() == 1
    receiver = ReleaseRelay(RedisSettings(url="redis://127.0.0.1:1", pool="p"), owner)
    receiver._apply("\n".join([*lines[:2], f"{streamed.ticket} nan", "x.y -1", "x.y 0.3"]).encode())
    sample = lc.metrics.registry.get_sample_value
    assert sample("llm_extproc_observed_ttft_seconds_count", {"priority": "standard"}) == 1
    assert sample("llm_extproc_observed_ttft_seconds_sum", {"priority": "standard"}) == 0.25
    assert lc.inflight.total() == 0
    assert sample("llm_extproc_relayed_releases_total", {"direction": "applied"}) == 1


def test_release_mode_is_validated() -> None:
    from extproc.settings import ConfigError

    with pytest.raises(ConfigError, match="release_on"):
        config_from_dict({"pool": POOL, "release_on": "trailers"})
    with pytest.raises(ConfigError, match="lease_timeout_s"):
        config_from_dict({"pool": POOL, "lease_timeout_s": 0})
