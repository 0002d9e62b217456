"""Replicas that act as one: each replica publishes its own scheduling decisions through Redis and
applies the others', so N `serve` processes behind one Envoy share one model of the upstreams' prefix
caches and queues, and one in-flight count per upstream (DESIGN.md section 9: "replicas must share
what they learn"; design and failure modes in docs/fleet-state.md, "Shared state between replicas").

When a replica routes or finishes a request it PUBLISHes at once (the leading edge), then at most
once per `interval_s`, batching what came meanwhile, and every `heartbeat_s` when idle; one msgpack
message on `<prefix>:sync`:

    {"r": replica id, "s": sequence, "t": unix time, "c": {upstream: own in-flight count},
     "u": {"<profile>/<i>:<plugin>": [update records, in order]}}

Counts are full counts (a lost message costs nothing once the next arrives); update records are the
shared plugins' picks and finishes (framework.SharedPlugin). A skipped sequence number means records
were lost: the receiver releases what that replica had pinned (its finishes may be among the lost).
Every `state_interval_s` each replica also SETs its plugins' dumps (`<prefix>:sync:state:<replica>`,
TTL 3 intervals); a replica that starts late, or reconnects, loads the freshest one. The next message
after that carries `"a"`, a sketch of the same dumps (per plugin and upstream, the FINGERPRINT_K
smallest of the held block hashes whose first byte is below FINGERPRINT_BYTE: a bottom-k sample);
receivers compare it with their own and set `llm_extproc_sync_agreement{plugin}`, the estimated
Jaccard similarity of the two replicas' indexes averaged over upstreams: 1.0 when they agree.

Nothing here is on the request path: plugins append records to in-memory outboxes and read in-memory
tables; this task moves them. With Redis down each replica routes on its own view (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from extproc.config import SyncSettings
from extproc.fleet import InFlight, RemoteInFlight
from extproc.fleet.redis_feed import cancel_until_done, follow_channel, redis_client
from extproc.scheduling import Profile, SharedPlugin
from extproc.scheduling.sharing import RESET, unpack_hashes
from extproc.settings import RedisSettings
from extproc.telemetry import Metrics

log = logging.getLogger("extproc.sync")

RECONNECT_S = (0.1, 2.0)
EXPIRE_TICK_S = 0.25
MAX_STATE_BYTES = 32 * 1024 * 1024  # a dump larger than this is neither written nor read
DEFAULT_SYNC = SyncSettings()
MAX_COUNT = 1_000_000  # an in-flight count above this is not believed (as snapshots' bad_load)
FINGERPRINT_K = 32  # hashes per plugin and upstream in an agreement sketch
FINGERPRINT_BYTE = 32  # of 256: the share of held hashes the sketch samples from (1/8)
FINGERPRINT_HASH_BYTES = 8  # a prefix of each hash is enough to compare
MAX_FINGERPRINT_UPSTREAMS = 4096


def shared_plugins(profiles: Mapping[str, Profile]) -> dict[str, SharedPlugin]:
    """Every shared plugin of every profile, by a key replicas with the same config agree on."""
    return {f"{name}/{key}": plugin for name, profile in profiles.items() for key, plugin in profile.shared}


class ReplicaSync:
    """The message logic (`outgoing`, `incoming`, `expire`, `state`, `load_state`: plain methods, no
    I/O, also driven by the discrete-event mode) and the Redis loops around it (`start`, `stop`)."""

    def __init__(
        self,
        replica: str,
        profiles: Mapping[str, Profile],
        inflight: InFlight,
        remote: RemoteInFlight,
        metrics: Metrics | None,
        settings: SyncSettings = DEFAULT_SYNC,
        redis: RedisSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self.plugins = shared_plugins(profiles)
        self.inflight = inflight
        self.remote = remote
        self.metrics = metrics
        self.settings = settings
        self.redis = redis
        self.clock = clock
        self.seq = 0
        self._seen_seq: dict[str, int] = {}
        self._last_counts: dict[str, int] | None = None
        self._budget = float(settings.max_updates_per_s)
        self._budget_at = clock()
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()  # set on every in-flight change: a pick or a finish to publish
        self._stopping = False
        self.connected = asyncio.Event()
        self.loaded_from: str | None = None  # the replica whose state this one started from
        # This replica's agreement sketch, from its last state(), and whether the next message sends it.
        self._fingerprint: dict[str, dict[str, list[bytes]]] = {}
        self._send_fingerprint = False
        for plugin in self.plugins.values():
            plugin.take_updates()  # the outboxes record from now on: the first pick is shared too

    # -- message logic -------------------------------------------------------------------------------
    def outgoing(self, force: bool = False) -> bytes | None:
        """The next message: this replica's news since the last one, or None when there is none and
        no heartbeat is due (`force`)."""
        updates: dict[str, list[Any]] = {}
        for key, plugin in self.plugins.items():
            records = plugin.take_updates()
            if records:
                updates[key] = records
        counts = self.inflight.counts()
        if not updates and not force and counts == self._last_counts:
            return None
        self._limit(updates)
        now = self.clock()
        self.seq += 1
        message: dict[str, Any] = {"r": self.replica, "s": self.seq, "t": now, "c": counts, "u": updates}
        if self._send_fingerprint:
            self._send_fingerprint = False
            message["a"] = self._fingerprint
        data: bytes = msgpack.packb(message)
        if len(data) > self.settings.max_message_bytes and "a" in message:
            del message["a"]  # the sketch is the first thing to go (a big fleet): never the updates
            data = msgpack.packb(message)
        if len(data) > self.settings.max_message_bytes:
            self._dropped(sum(len(v) for v in updates.values()))
            message["u"] = {key: [[RESET]] for key in updates}
            data = msgpack.packb(message)
        self._last_counts = counts
        return data

    def _limit(self, updates: dict[str, list[Any]]) -> None:
        """At most max_updates_per_s records per second (a token bucket); a plugin whose records
        were cut gets a RESET after those kept, so peers release what this replica pinned."""
        now = self.clock()
        rate = self.settings.max_updates_per_s
        self._budget = min(float(rate), self._budget + (now - self._budget_at) * rate)
        self._budget_at = now
        for key, records in updates.items():
            room = max(0, int(self._budget))
            if len(records) > room:
                self._dropped(len(records) - room)
                updates[key] = [*records[:room], [RESET]]
                records = updates[key][:-1]
            self._budget -= len(records)

    def _dropped(self, n: int) -> None:
        if self.metrics is not None and n:
            self.metrics.sync_updates_dropped.inc(n)

    def _count(self, direction: str) -> None:
        if self.metrics is not None:
            self.metrics.sync_messages.labels(direction=direction).inc()

    def incoming(self, data: object) -> bool:
        """Apply another replica's message; False for our own, malformed or oversized ones."""
        if not isinstance(data, bytes) or len(data) > self.settings.max_message_bytes:
            self._count("rejected")
            return False
        try:
            message = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:
            self._count("rejected")
            return False
        if not isinstance(message, dict):
            self._count("rejected")
            return False
        origin, seq, sent_at = message.get("r"), message.get("s"), message.get("t")
        counts, updates = message.get("c"), message.get("u")
        if (
            not isinstance(origin, str)
            or not 0 < len(origin) <= 64
            or not isinstance(seq, int)
            or not isinstance(sent_at, int | float)
            or not isinstance(counts, dict)
            or not isinstance(updates, dict)
        ):
            self._count("rejected")
            return False
        if origin == self.replica:
            return False
        last = self._seen_seq.get(origin)
        if last is not None and seq != last + 1:
            # Lost messages (a failed publish, a reconnect): their finishes may be among them.
            self._count("gap")
            self._forget_pins(origin)
        self._seen_seq[origin] = seq
        self.remote.update(
            origin,
            {
                u: n
                for u, n in counts.items()
                if isinstance(u, str) and isinstance(n, int) and 0 < n <= MAX_COUNT
            },
        )
        for key, records in updates.items():
            plugin = self.plugins.get(key) if isinstance(key, str) else None
            if plugin is not None and isinstance(records, list):
                plugin.apply_updates(origin, records)
        sketch = message.get("a")
        if isinstance(sketch, dict) and self._fingerprint and self.metrics is not None:
            for key, agreement in agreements(self._fingerprint, sketch).items():
                self.metrics.sync_agreement.labels(plugin=key).set(agreement)
        self._count("received")
        if self.metrics is not None:
            self.metrics.sync_apply_lag.observe(max(0.0, self.clock() - sent_at))
            self.metrics.sync_replicas.set(len(self.remote.origins()))
        return True

    def _forget_pins(self, origin: str) -> None:
        for plugin in self.plugins.values():
            plugin.forget_origin(origin)

    def expire(self) -> list[str]:
        """Drop replicas silent for expire_s: their counts and their pinned blocks."""
        gone = self.remote.expire()
        for origin in gone:
            self._seen_seq.pop(origin, None)
            self._forget_pins(origin)
            log.info(
                "replica %s silent for %.1fs: its in-flight counts dropped", origin, self.settings.expire_s
            )
        if gone and self.metrics is not None:
            self.metrics.sync_replicas.set(len(self.remote.origins()))
        return gone

    def state(self) -> bytes:
        """What a late-starting replica loads: every shared plugin's dump. Also refreshes this
        replica's agreement sketch, sent with the next message."""
        dumps = {key: plugin.dump() for key, plugin in self.plugins.items()}
        self._fingerprint = {key: fingerprint(dump) for key, dump in dumps.items()}
        self._send_fingerprint = True
        return bytes(msgpack.packb({"r": self.replica, "t": self.clock(), "p": dumps}))

    def load_state(self, data: object) -> bool:
        if not isinstance(data, bytes) or len(data) > MAX_STATE_BYTES:
            return False
        try:
            state = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:
            return False
        if not isinstance(state, dict) or not isinstance(state.get("p"), dict):
            return False
        for key, dump in state["p"].items():
            plugin = self.plugins.get(key) if isinstance(key, str) else None
            if plugin is not None:
                plugin.load(dump)
        origin = state.get("r")
        self.loaded_from = origin if isinstance(origin, str) else "?"
        return True

    def sample(self) -> None:
        """Index sizes per plugin and upstream into the gauge (every state_interval_s)."""
        if self.metrics is None:
            return
        gauge = self.metrics.sync_index_blocks
        for key, plugin in self.plugins.items():
            for uid, n in plugin.index_sizes().items():
                gauge.labels(plugin=key, upstream=uid).set(n)

    # -- Redis ---------------------------------------------------------------------------------------
    @property
    def channel(self) -> str:
        assert self.redis is not None
        return f"{self.redis.prefix}:sync"

    def state_key(self, replica: str) -> str:
        assert self.redis is not None
        return f"{self.redis.prefix}:sync:state:{replica}"

    def start(self) -> None:
        if self.redis is None or not self.settings.enabled:
            return
        self._stopping = False
        self.inflight.watch(self._wake.set)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="sync-publish"),
            asyncio.create_task(self._receive_loop(), name="sync-receive"),
            asyncio.create_task(self._expire_loop(), name="sync-expire"),
        ]

    async def stop(self) -> None:
        """Cancel the loops until they are done (a cancellation lost in a race is sent again)."""
        self._stopping = True
        self._wake.set()
        await cancel_until_done(self._tasks)
        self._tasks = []

    async def _expire_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(EXPIRE_TICK_S)
            self.expire()

    async def _publish_loop(self) -> None:
        assert self.redis is not None
        s = self.settings
        loop = asyncio.get_running_loop()
        client = redis_client(self.redis)
        last_sent = next_state = 0.0
        backoff = RECONNECT_S[0]
        try:
            while not self._stopping:
                # Leading edge: news after a quiet spell goes out at once; then at most one message
                # per interval_s, batching what came meanwhile; a heartbeat when there is none.
                if not self._wake.is_set():
                    # asyncio.wait, not wait_for: on 3.11 wait_for can swallow a cancellation that
                    # races with the event being set, and stop() would wait forever.
                    waiter = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait({waiter}, timeout=s.heartbeat_s)
                    finally:
                        waiter.cancel()
                if self._stopping:
                    return
                self._wake.clear()
                now = loop.time()
                data = self.outgoing(force=now - last_sent >= s.heartbeat_s)
                try:
                    if data is not None:
                        last_sent = now
                        await client.publish(self.channel, data)
                        self._count("sent")
                    if now >= next_state:
                        next_state = now + s.state_interval_s
                        self.sample()
                        blob = self.state()
                        if len(blob) <= MAX_STATE_BYTES:
                            ttl = max(1, math.ceil(3 * s.state_interval_s))
                            await client.set(self.state_key(self.replica), blob, ex=ttl)
                    backoff = RECONNECT_S[0]
                    await asyncio.sleep(s.interval_s)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis down: route on the local view; peers see a gap
                    self._count("failed")
                    log.debug("sync publish failed: %s", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_S[1])
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _receive_loop(self) -> None:
        assert self.redis is not None

        def lost(exc: Exception) -> None:
            if self.connected.is_set():
                log.warning("sync: Redis connection lost (%s); routing on the local view", exc)

        await follow_channel(
            self.redis,
            self.channel,
            self.incoming,
            on_subscribed=self._resync,
            on_lost=lost,
            connected=self.connected,
            running=lambda: not self._stopping,
        )

    async def _resync(self, client: Any) -> None:
        """Load the freshest state another replica wrote (a late start, or after a reconnect)."""
        keys = [k async for k in client.scan_iter(match=self.state_key("*"), count=100)]
        mine = self.state_key(self.replica).encode()
        keys = [k for k in keys if k != mine]
        if not keys:
            return
        best: tuple[float, bytes] | None = None
        for value in await client.mget(keys):
            if not isinstance(value, bytes) or len(value) > MAX_STATE_BYTES:
                continue
            try:
                t = msgpack.unpackb(value, raw=False, strict_map_key=False).get("t")
            except Exception:
                continue
            if isinstance(t, int | float) and (best is None or t > best[0]):
                best = (float(t), value)
        if best is not None and self.load_state(best[1]):
            log.info("sync: loaded the shared state of replica %s", self.loaded_from)


def fingerprint(dump: Any) -> dict[str, list[bytes]]:
    """A plugin dump ({upstream: packed block hashes}) reduced to a bottom-k sketch per upstream."""
    out: dict[str, list[bytes]] = {}
    if not isinstance(dump, dict):
        return out
    for uid, blob in list(dump.items())[:MAX_FINGERPRINT_UPSTREAMS]:
        hashes = unpack_hashes(blob)
        if isinstance(uid, str) and hashes:
            sampled = {h[:FINGERPRINT_HASH_BYTES] for h in hashes if h[0] < FINGERPRINT_BYTE}
            out[uid] = heapq.nsmallest(FINGERPRINT_K, sampled)
    return out


def agreements(mine: Mapping[str, Mapping[str, list[bytes]]], theirs: Mapping[Any, Any]) -> dict[str, float]:
    """Per plugin, the mean over upstreams (those either side holds blocks of) of the estimated
    Jaccard similarity of two replicas' indexes: of the k smallest hashes of the union of the two
    sketches, the share both sketches hold (the bottom-k estimator)."""
    out: dict[str, float] = {}
    for key, own in mine.items():
        other = theirs.get(key)
        if not isinstance(other, dict):
            continue
        scores = []
        for uid in own.keys() | {u for u in other if isinstance(u, str)}:
            a = set(own.get(uid, ()))
            raw = other.get(uid, ())
            b = {h for h in raw if isinstance(h, bytes)} if isinstance(raw, list) else set()
            union = heapq.nsmallest(FINGERPRINT_K, a | b)
            if union:
                scores.append(sum(1 for h in union if h in a and h in b) / len(union))
        if scores:
            out[key] = sum(scores) / len(scores)
    return out
