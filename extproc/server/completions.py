"""Learning that a routed request ended without holding its ext_proc stream open.

With `release_on: access_log` the routing stream ends as soon as the route is set (Envoy's
`response_trailer_mode: SKIP`), so a service replica that dies mid-generation cuts nothing. The
routed request carries a ticket header; Envoy's gRPC access log (AccessLogService, one long-lived
stream per Envoy worker, buffered) reports every finished request with that header, and the entry
releases the request's in-flight lease. The access log is best effort: a ticket whose entry never
comes (an access-log stream lost with its buffer) is released after `lease_timeout_s`, counted.
The entry also carries the response's first body byte time where the shipped envoy.yaml's Lua filter
wrote it: a streamed request's TTFT as Envoy saw it, counted by class (no other Envoy timing gives
it: the first upstream byte is the response headers, sent before the first token).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.lifecycle import Decision, RequestLifecycle
from extproc.server.picker import record_served

log = logging.getLogger("extproc.completions")

SWEEP_EVERY_S = 1.0
# Where the shipped envoy.yaml's Lua filter writes the response's first body byte time (observed TTFT).
FIRST_BYTE_NAMESPACE = "llm_extproc"
FIRST_BYTE_KEY = "first_byte_ms"
MAX_FIRST_BYTE_S = 3600.0  # later than this after the start: not this request's (a clock step)
# Routed requests older than this with no access-log stream ever seen: Envoy is not configured to
# report to us (warned once; the leases would otherwise expire only after lease_timeout_s).
NO_ACCESS_LOG_WARN_S = 30.0
# A routing stream cancelled while its last reply was being written: the reply may have reached
# Envoy (FULL_DUPLEX_STREAMED: Envoy resets the stream once it has the body reply, and a service slow
# to end the call sees that reset as a cancelled write) or not (the client went away). The lease
# waits this long for the ticket's access-log entry before it is released.
CANCELLED_ROUTE_GRACE_S = 10.0


@dataclass(slots=True)
class _Pending:
    decision: Decision
    routed_at: float  # monotonic seconds


class PendingReleases:
    """Routed requests waiting for the access log to say they ended, by ticket.

    Tickets are `<replica>.<128 random bits>`: the replica part tells an entry routed by another
    replica (whose access log happened to reach this one) from a lost or forged ticket; the random
    part cannot be guessed, so a forged access-log entry cannot release another request's lease
    (sequential numbers could be). Event-loop use only.
    """

    __slots__ = (
        "_clock",
        "_doubtful",
        "_pending",
        "_warned",
        "access_log_seen",
        "lifecycle",
        "replica",
        "timeout_s",
    )

    def __init__(
        self,
        lifecycle: RequestLifecycle,
        timeout_s: float,
        *,
        replica: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lifecycle = lifecycle
        self.timeout_s = timeout_s
        self.replica = replica or os.urandom(4).hex()
        self._clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._doubtful: deque[tuple[float, str]] = deque()  # (release at, ticket), oldest first
        self.access_log_seen = False
        self._warned = False

    def __len__(self) -> int:
        return len(self._pending)

    def register(self, decision: Decision) -> str:
        ticket = f"{self.replica}.{secrets.token_hex(16)}"
        self._pending[ticket] = _Pending(decision, self._clock())
        return ticket

    def complete(
        self,
        ticket: str,
        trigger: str,
        served: str | Callable[[], str | None] | None = None,
        first_byte: Callable[[], float | None] | None = None,
    ) -> str:
        """Release the request behind `ticket`; returns the outcome (a metric label). `served`: the
        upstream address Envoy reports (endpoint mode: counted, see server/picker.py), or a function
        that reads it, called only in endpoint mode (so the other modes never pay for reading it
        out of an entry). `first_byte`: reads the seconds from the request's start to its first
        response byte, called only for streamed requests."""
        entry = self._pending.pop(ticket, None)
        if entry is not None:
            decision = entry.decision
            if served is not None and decision.upstream.address is not None:
                where = served() if callable(served) else served
                if where:
                    record_served(self.lifecycle, decision, where)
            if first_byte is not None and decision.request.stream:
                seconds = first_byte()
                if seconds is not None:
                    self.lifecycle.first_byte(decision, seconds)
            self.lifecycle.finish(decision, trigger)
            return "released"
        if not ticket:
            return "no_ticket"
        replica, _, _ = ticket.partition(".")
        return "unknown" if replica == self.replica else "other_replica"

    def first_byte(self, ticket: str, seconds: str) -> None:
        """Another replica's access log gave the first-byte time (`seconds`, as relayed) of a request
        this one routed and still holds: counted as its observed TTFT (the release comes next)."""
        entry = self._pending.get(ticket)
        if entry is None:
            return
        try:
            value = _ttft_or_none(float(seconds))
        except ValueError:
            return
        if value is not None:
            self.lifecycle.first_byte(entry.decision, value)

    def cancel(self, ticket: str) -> None:
        """Forget a ticket whose request was released another way (rejected, stream cancelled)."""
        self._pending.pop(ticket, None)

    def doubt(self, ticket: str, grace_s: float = CANCELLED_ROUTE_GRACE_S) -> None:
        """The stream was cancelled while the route's last reply was being written: its access-log
        entry releases it if the route was applied, else the sweep does after `grace_s`."""
        if ticket in self._pending:
            self._doubtful.append((self._clock() + grace_s, ticket))

    def sweep(self) -> int:
        """Release tickets older than the timeout (oldest first: insertion order is routing order)."""
        now = self._clock()
        while self._doubtful and self._doubtful[0][0] <= now:
            _, ticket = self._doubtful.popleft()
            if (entry := self._pending.pop(ticket, None)) is not None:
                self.lifecycle.finish(entry.decision, "stream_cancel")
        deadline = now - self.timeout_s
        expired = 0
        while self._pending:
            ticket, entry = next(iter(self._pending.items()))
            if entry.routed_at > deadline:
                break
            del self._pending[ticket]
            self.lifecycle.finish(entry.decision, "expired")
            expired += 1
        return expired

    def oldest_age(self) -> float:
        if not self._pending:
            return 0.0
        return self._clock() - next(iter(self._pending.values())).routed_at

    async def sweep_forever(self, every_s: float = SWEEP_EVERY_S) -> None:
        while True:
            await asyncio.sleep(every_s)
            if not self.access_log_seen and not self._warned and self.oldest_age() > NO_ACCESS_LOG_WARN_S:
                self._warned = True
                log.warning(
                    "release_on is access_log but Envoy has opened no access-log stream to this "
                    "service: add the http_grpc access log of the shipped envoy.yaml (cluster "
                    "llm-extproc, header %s), or set release_on: stream_end with "
                    "response_trailer_mode: SEND. Until then in-flight counts only fall after %.0fs.",
                    self.lifecycle.config.headers.ticket,
                    self.timeout_s,
                )
            if expired := self.sweep():
                log.warning(
                    "released %d request(s) whose access-log entry never came within %.0fs; is Envoy's "
                    "http_grpc access log pointed at llm-extproc?",
                    expired,
                    self.timeout_s,
                )


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's AccessLogService: each HTTP entry carrying a ticket header releases that request."""

    def __init__(
        self,
        pending: PendingReleases,
        ticket_header: str,
        relay: Callable[[str, float | None], None] | None = None,
    ) -> None:
        self.pending = pending
        self.header = ticket_header
        self.relay = relay  # hands another replica's tickets to it (server/relay.py)
        self.entries = pending.lifecycle.metrics.access_log_entries_by

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        self.pending.access_log_seen = True
        streams = self.pending.lifecycle.metrics.access_log_streams
        streams.inc()
        try:
            async for message in request_iterator:
                self._entries(message)
        finally:
            streams.dec()
        return als_pb2.StreamAccessLogsResponse()

    def _entries(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        for entry in message.http_logs.log_entry:
            ticket = entry.request.request_headers.get(self.header, "")
            outcome = self.pending.complete(
                ticket, "access_log", partial(_upstream_address, entry), partial(_first_byte_s, entry)
            )
            if outcome == "other_replica" and self.relay is not None:
                self.relay(ticket, _first_byte_s(entry))
                outcome = "relayed"
            self.entries(outcome).inc()


def _upstream_address(entry: Any) -> str | None:
    """The `ip:port` that served an access-log entry (the endpoint-picker protocol's "served")."""
    addr = entry.common_properties.upstream_remote_address.socket_address
    if not addr.address:
        return None
    host = f"[{addr.address}]" if ":" in addr.address else addr.address
    return f"{host}:{addr.port_value}"


def _first_byte_s(entry: Any) -> float | None:
    """Seconds from the entry's start to its response's first body byte: `first_byte_ms` (Envoy's
    wall clock, ms since the epoch) in the FIRST_BYTE_NAMESPACE dynamic metadata, which the shipped
    envoy.yaml's Lua filter writes. None without it (another Envoy configuration), or out of range."""
    common = entry.common_properties
    namespaces = common.metadata.filter_metadata
    if FIRST_BYTE_NAMESPACE not in namespaces:
        return None
    fields = namespaces[FIRST_BYTE_NAMESPACE].fields
    if FIRST_BYTE_KEY not in fields:
        return None
    value = fields[FIRST_BYTE_KEY]
    if value.WhichOneof("kind") != "number_value":
        return None
    start = common.start_time
    return _ttft_or_none(value.number_value / 1000.0 - (start.seconds + start.nanos / 1e9))


def _ttft_or_none(seconds: float) -> float | None:
    """A first-byte time as a TTFT, or None: before the start, past MAX_FIRST_BYTE_S, or not a number.
    Millisecond resolution against a microsecond start: one in the start's millisecond reads up to
    1 ms early, and counts as 0."""
    return max(seconds, 0.0) if -0.001 <= seconds <= MAX_FIRST_BYTE_S else None
