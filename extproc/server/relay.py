"""Access-log entries for requests another replica routed, handed to that replica through Redis.

Envoy opens one access-log stream per worker thread to *some* llm-extproc replica, so with several
replicas an entry often reaches a replica that did not route the request. The ticket names the
routing replica; the receiver batches such tickets and PUBLISHes them on that replica's channel
(`<prefix>:done:<replica>`), which the owner applies. Nothing here is on the request path. With
Redis down or failing over (or the owner not yet subscribed again) the tickets are held and retried
for HOLD_S, then dropped (counted) and the owner's leases expire (lease_timeout_s).

A message is one ticket a line. A streamed request's first-byte time (observed TTFT) travels on a
line of its own, `<ticket> <seconds>`, before its ticket's: an older replica reads it as a ticket it
does not know and releases nothing by it, so replicas of both versions can run side by side.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from extproc.fleet.redis_feed import cancel_until_done, follow_channel, redis_client, write_and_publish
from extproc.server.completions import PendingReleases
from extproc.settings import RedisSettings
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.relay")

FLUSH_EVERY_S = 0.02
MAX_BATCH = 2000  # tickets per published message
MAX_MESSAGE_BYTES = 256 * 1024
RECONNECT_S = (0.1, 2.0)
# Tickets that could not be delivered (Redis down, a failover, the owner not subscribed yet) are
# retried for this long, at most MAX_HELD of them, then dropped (counted; the owner's lease expires).
HOLD_S = 10.0
MAX_HELD = 50_000


class ReleaseRelay:
    def __init__(self, settings: RedisSettings, pending: PendingReleases) -> None:
        self.settings = settings
        self.pending = pending
        self.metrics = pending.lifecycle.metrics
        self._outbox: dict[str, list[str]] = defaultdict(list)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def channel(self, replica: str) -> str:
        return f"{self.settings.prefix}:done:{replica}"

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(supervised("release-relay-send", self._send_loop)),
            asyncio.create_task(supervised("release-relay-receive", self._receive_loop)),
        ]

    async def stop(self) -> None:
        await cancel_until_done(self._tasks)

    def forward(self, ticket: str, first_byte_s: float | None = None) -> None:
        """Queue a ticket routed by another replica (called from the access-log receiver), with its
        response's first-byte time when the entry had one."""
        replica = ticket.partition(".")[0]
        if not replica or len(replica) > 64 or " " in ticket:
            return
        lines = self._outbox[replica]
        if first_byte_s is not None:
            lines.append(f"{ticket} {first_byte_s:.6f}")
        lines.append(ticket)
        self._wake.set()

    async def _send_loop(self) -> None:
        client = redis_client(self.settings)
        held_since: float | None = None  # first failed attempt of the tickets held for a retry
        delay = RECONNECT_S[0]
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(FLUSH_EVERY_S)  # batch what arrives meanwhile
                self._wake.clear()
                outbox, self._outbox = self._outbox, defaultdict(list)
                batches = [
                    (replica, tickets[i : i + MAX_BATCH])
                    for replica, tickets in outbox.items()
                    for i in range(0, len(tickets), MAX_BATCH)
                ]
                try:
                    receivers = await write_and_publish(
                        client, [(self.channel(r), "\n".join(t)) for r, t in batches]
                    )
                except Exception as exc:  # Redis down or failing over: hold the tickets, retry
                    log.debug("relay publish failed: %s", exc)
                    receivers = [-1] * len(batches)
                # Nobody listening (the owner is reconnecting after a failover; counted only where
                # PUBLISH can tell: not on a Cluster) or Redis failed: retry for up to HOLD_S.
                retry = [b for b, n in zip(batches, receivers or [1] * len(batches), strict=True) if n <= 0]
                sent = sum(_tickets(t) for _, t in batches) - sum(_tickets(t) for _, t in retry)
                if sent:
                    self.metrics.relayed_releases.labels(direction="sent").inc(sent)
                if not retry:
                    held_since, delay = None, RECONNECT_S[0]
                    continue
                now = loop.time()
                held_since = now if held_since is None else held_since
                if now - held_since > HOLD_S:  # the owners' leases expire instead
                    self.metrics.relayed_releases.labels(direction="dropped").inc(
                        sum(_tickets(t) for _, t in retry)
                    )
                    held_since, delay = None, RECONNECT_S[0]
                    continue
                for replica, tickets in retry:
                    self._outbox[replica][:0] = tickets
                self._bound_outbox()
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_S[1] / 2)
                self._wake.set()
        finally:
            await client.aclose()

    def _bound_outbox(self) -> None:
        excess = sum(map(len, self._outbox.values())) - MAX_HELD
        for tickets in self._outbox.values():
            if excess <= 0:
                break
            cut = min(excess, len(tickets))
            dropped = _tickets(tickets[:cut])
            del tickets[:cut]  # the oldest go first
            excess -= cut
            self.metrics.relayed_releases.labels(direction="dropped").inc(dropped)

    async def _receive_loop(self) -> None:
        def lost(exc: Exception) -> None:
            log.debug("relay subscription lost: %s", exc)

        await follow_channel(self.settings, self.channel(self.pending.replica), self._apply, on_lost=lost)

    def _apply(self, data: object) -> None:
        if not isinstance(data, bytes | str) or len(data) > MAX_MESSAGE_BYTES:
            return
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        applied = 0
        for line in text.split("\n"):
            ticket, _, first_byte = line.partition(" ")
            if first_byte:
                self.pending.first_byte(ticket, first_byte)
            elif self.pending.complete(ticket, "access_log_relay") == "released":
                applied += 1
        if applied:
            self.metrics.relayed_releases.labels(direction="applied").inc(applied)


def _tickets(lines: list[str]) -> int:
    """The tickets among relayed lines (a `<ticket> <seconds>` line is a first-byte time)."""
    return sum(1 for line in lines if " " not in line)
