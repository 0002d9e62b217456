"""Replicas that act as one: each replica publishes its own scheduling decisions through Redis and
applies the others', so N `serve` processes behind one Envoy share one model of the upstreams' prefix
caches and queues, and one in-flight count per upstream (design and failure modes in
docs/fleet-state.md, "Shared state between replicas").

When a replica routes or finishes a request it PUBLISHes at once (the leading edge), then at most
once per `interval_s`, batching what came meanwhile, and every `heartbeat_s` when idle; one msgpack
message on `<prefix>:sync`:

    {"v": 1, "r": replica id, "s": sequence, "t": unix time, "c": {upstream: own in-flight count},
     "u": {"<profile>/<i>:<plugin>": [update records, in order]},
     "k": {model: own critical requests per second},    ("k" only while there are some)
     "w": {model: standard requests waiting in its admission queue}}   ("w" likewise)

followed, when the replicas share a key (`sync.key_file` or $LLM_EXTPROC_SYNC_KEY), by 32 bytes of
HMAC-SHA256 over the packed message (state dumps likewise, under another context string).

What another replica wrote is checked before anything is applied, as snapshots are: a wrong version,
signature, replica id, sequence or time (more than `expire_s` from this replica's clock: it would
have expired anyway; hosts' clocks must agree that well) drops the whole message; a count for an
upstream this replica does not know, or above MAX_COUNT, drops that entry; the plugins skip records
they do not believe (`sharing.PeerChecks`: unknown upstreams, NaN or future times). Everything
dropped is counted in `llm_extproc_sync_rejected_total{reason}` and logged once a minute per reason.

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
import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeGuard

import msgpack
from redis.exceptions import ResponseError

from extproc.fleet import FleetView, InFlight, Pool, RemoteInFlight, RoutingMode
from extproc.fleet.redis_feed import cancel_until_done, follow_channel, redis_client
from extproc.scheduling import Profile, SharedPlugin
from extproc.scheduling.sharing import (
    MAX_UPSTREAMS,
    RESET,
    PeerChecked,
    PeerChecks,
    is_int,
    unpack_hashes,
)
from extproc.settings import ConfigError, RedisSettings, SyncSettings
from extproc.telemetry import Metrics
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.sync")

RECONNECT_S = (0.1, 2.0)
EXPIRE_TICK_S = 0.25
MAX_STATE_BYTES = 32 * 1024 * 1024  # a dump larger than this is neither written nor read
MAX_STATE_KEYS = 64  # other replicas' dumps looked at on a resync (one GET each, the freshest kept)
DEFAULT_SYNC = SyncSettings()
SYNC_VERSION = 1  # "v" of messages and dumps; another version is dropped (counted "version")
# An in-flight count per upstream and replica above this is not believed: Envoy holds every one as
# an open stream, and an upstream is one engine or one cluster of them.
MAX_COUNT = 100_000
MAX_REPLICA_ID = 64  # characters
MAX_SEQ = 1 << 63
KEY_ENV = "LLM_EXTPROC_SYNC_KEY"
MIN_KEY_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
# Context strings under the HMAC: a signed state dump is not a valid message, nor the reverse.
MESSAGE_CONTEXT = b"llm-extproc sync message\x00"
STATE_CONTEXT = b"llm-extproc sync state\x00"
KNOWN_REFRESH_S = 0.25  # the known upstream ids are re-read at most this often (wall clock)
LOG_EVERY_S = 60.0  # a rejection reason is logged at most once per this (counted always)
FINGERPRINT_K = 32  # hashes per plugin and upstream in an agreement sketch
FINGERPRINT_BYTE = 32  # of 256: the share of held hashes the sketch samples from (1/8)
FINGERPRINT_HASH_BYTES = 8  # a prefix of each hash is enough to compare
MAX_FINGERPRINT_UPSTREAMS = 4096
# Per-model fields: critical arrival rates ("k": admission keeps places for the whole fleet's critical
# traffic, and each replica sees only its share) and standard waiters ("w": sheddable requests are
# shed while any replica's wait); lifecycle/admission.py.
MAX_MODEL_ENTRIES = 1024  # more models in one field: the field is dropped
MAX_RATE = 1e6  # requests per second; above it an entry is not believed
MAX_MODEL_CHARS = 256
MIN_RATE = 1e-3  # a rate decayed below this is not sent (a model that had critical traffic once)


def shared_plugins(profiles: Mapping[str, Profile]) -> dict[str, SharedPlugin]:
    """Every shared plugin of every profile, by a key replicas with the same config agree on."""
    return {f"{name}/{key}": plugin for name, profile in profiles.items() for key, plugin in profile.shared}


def pool_upstreams(pool: Pool, view: FleetView | None = None) -> Callable[[], frozenset[str]]:
    """The upstream ids this replica can route to, for ReplicaSync's `known_upstreams`: the pool's
    (configured and discovered endpoints) and, with a fleet view, those its snapshots name (endpoint
    mode: `cluster/address`; snapshots of unknown clusters were rejected already)."""

    def known() -> frozenset[str]:
        ids = {u.id for u in pool.everything()}
        if view is not None:
            endpoint = pool.mode is RoutingMode.ENDPOINT
            for inst in list(view.instances().values()):
                if not endpoint:
                    ids.add(inst.cluster)
                elif inst.address is not None:
                    ids.add(f"{inst.cluster}/{inst.address}")
        return frozenset(ids)

    return known


def sync_key(settings: SyncSettings, env: Mapping[str, str] = os.environ) -> bytes | None:
    """The replicas' shared HMAC key: the contents of `sync.key_file` (surrounding whitespace
    stripped), else $LLM_EXTPROC_SYNC_KEY; None: messages are not signed. Never read from the YAML,
    which is often less guarded than a mounted secret."""
    if settings.key_file is not None:
        where = f"config: 'sync'.key_file ({settings.key_file})"
        try:
            key = Path(settings.key_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    else:
        raw = env.get(KEY_ENV, "")
        if not raw:
            return None
        where, key = f"${KEY_ENV}", raw.strip().encode()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the sync key must be at least {MIN_KEY_BYTES} bytes")
    return key


def _tag(key: bytes, context: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, context, "sha256")
    mac.update(payload)
    return mac.digest()


def _number(value: Any) -> TypeGuard[float]:
    """A finite int or float as msgpack decodes them (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _replica_id(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_REPLICA_ID and value.isprintable()


class Rejected(Exception):
    """A message or dump dropped whole, with the reason counted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ReplicaSync:
    """The message logic (`outgoing`, `incoming`, `expire`, `state`, `load_state`: plain methods, no
    I/O, also driven by the discrete-event mode) and the Redis loops around it (`start`, `stop`).

    `known_upstreams` returns the upstream ids this replica can route to (`pool_upstreams`); peers'
    counts and records about others are dropped. Without it any well-formed id is taken, at most
    MAX_UPSTREAMS of them (sharing.PeerChecks)."""

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
        known_upstreams: Callable[[], Collection[str]] | None = None,
        critical_rates: Callable[[], Mapping[str, float]] | None = None,
        waiting: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.replica = replica
        self.critical_rates = critical_rates  # this replica's, by model (Admission.own_critical_rates)
        self.waiting = waiting  # this replica's standard waiters, by model (Admission.own_waiting)
        self._last_waiting: dict[str, int] = {}
        self.plugins = shared_plugins(profiles)
        self.inflight = inflight
        self.remote = remote
        self.metrics = metrics
        self.settings = settings
        self.redis = redis
        self.clock = clock
        self.known_upstreams = known_upstreams
        self.key = sync_key(settings)
        self.seq = 0
        self._seen_seq: dict[str, tuple[int, float]] = {}  # origin: (last sequence, its time)
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
        self._sampled: set[tuple[str, str]] = set()  # (plugin, upstream) series of the index gauge
        self._send_fingerprint = False
        # What peers' records are checked against (set before each message), shared by the plugins.
        self.checks = PeerChecks(ahead_s=settings.expire_s, on_reject=self._reject)
        self._known: Collection[str] | None = None
        self._known_at = -math.inf
        self._logged: dict[str, float] = {}  # reason: when it was last logged (monotonic)
        for plugin in self.plugins.values():
            if isinstance(plugin, PeerChecked):
                plugin.check_peers(self.checks)
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
        waiting = dict(self.waiting()) if self.waiting is not None else {}
        if not updates and not force and counts == self._last_counts and waiting == self._last_waiting:
            return None
        self._limit(updates)
        now = self.clock()
        self.seq += 1
        message: dict[str, Any] = {
            "v": SYNC_VERSION,
            "r": self.replica,
            "s": self.seq,
            "t": now,
            "c": counts,
            "u": updates,
        }
        if self.critical_rates is not None:
            rates = {m: r for m, r in self.critical_rates().items() if r >= MIN_RATE}
            if rates:
                message["k"] = rates
        if waiting:
            message["w"] = waiting
        if self._send_fingerprint:
            self._send_fingerprint = False
            message["a"] = self._fingerprint
        room = self.settings.max_message_bytes - (TAG_BYTES if self.key is not None else 0)
        data: bytes = msgpack.packb(message)
        if len(data) > room and "a" in message:
            del message["a"]  # the sketch is the first thing to go (a big fleet): never the updates
            data = msgpack.packb(message)
        if len(data) > room:
            self._dropped(sum(len(v) for v in updates.values()))
            message["u"] = {key: [[RESET]] for key in updates}
            data = msgpack.packb(message)
        self._last_counts = counts
        self._last_waiting = waiting
        return self._sign(data, MESSAGE_CONTEXT)

    def news(self) -> None:
        """Something to publish besides in-flight changes (the admission queue changed)."""
        self._wake.set()

    def _sign(self, payload: bytes, context: bytes) -> bytes:
        return payload if self.key is None else payload + _tag(self.key, context, payload)

    def _open(self, data: bytes, context: bytes) -> bytes:
        """The payload of what a peer wrote, its signature checked when there is a key."""
        if self.key is None:
            return data
        payload, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if len(data) < TAG_BYTES or not hmac.compare_digest(tag, _tag(self.key, context, payload)):
            raise Rejected("signature")
        return payload

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

    def _reject(self, reason: str, n: int = 1) -> None:
        """Count what was dropped; log each reason at most once a minute (a hostile or misconfigured
        peer must not flood the log)."""
        if not n:
            return
        if self.metrics is not None:
            self.metrics.sync_rejected.labels(reason=reason).inc(n)
        now = time.monotonic()
        if now - self._logged.get(reason, -math.inf) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning(
                "sync: dropped data from Redis (reason %s); further ones for %.0fs are only counted "
                "in llm_extproc_sync_rejected_total",
                reason,
                LOG_EVERY_S,
            )

    def _known_ids(self) -> Collection[str] | None:
        """The upstream ids this replica knows, re-read at most every KNOWN_REFRESH_S."""
        if self.known_upstreams is None:
            return None
        now = time.monotonic()
        if self._known is None or now - self._known_at >= KNOWN_REFRESH_S:
            self._known, self._known_at = self.known_upstreams(), now
        return self._known

    def incoming(self, data: object) -> bool:
        """Apply another replica's message; False for our own and for one dropped whole (counted:
        `direction="rejected"` and the reason). Never raises: the receive loop must go on."""
        try:
            return self._incoming(data)
        except Rejected as exc:
            self._count("rejected")
            self._reject(exc.reason)
        except Exception:  # a check missed (a bug): counted, and the loop goes on
            log.debug("sync: message not applied", exc_info=True)
            self._count("rejected")
            self._reject("error")
        return False

    def _unpack(self, data: object, limit: int, context: bytes) -> dict[Any, Any]:
        """A peer's msgpack map (message or dump), size, signature and version checked."""
        if not isinstance(data, bytes):
            raise Rejected("undecodable")
        if len(data) > limit:
            raise Rejected("size")
        payload = self._open(data, context)
        try:
            value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:
            raise Rejected("undecodable") from None
        if not isinstance(value, dict):
            raise Rejected("undecodable")
        version = value.get("v")
        if not is_int(version) or version != SYNC_VERSION:
            raise Rejected("version")
        return value

    def _incoming(self, data: object) -> bool:
        message = self._unpack(data, self.settings.max_message_bytes, MESSAGE_CONTEXT)
        origin, seq, sent_at = message.get("r"), message.get("s"), message.get("t")
        counts, updates = message.get("c"), message.get("u")
        if (
            not _replica_id(origin)
            or not is_int(seq)
            or not 0 <= seq < MAX_SEQ
            or not isinstance(sent_at, int | float)
            or isinstance(sent_at, bool)
            or not isinstance(counts, dict)
            or not isinstance(updates, dict)
        ):
            raise Rejected("malformed")
        if origin == self.replica:
            return False
        now = self.clock()
        if not math.isfinite(sent_at) or abs(sent_at - now) > self.settings.expire_s:
            raise Rejected("time")  # would have expired by now, or from a clock far off
        if not self.remote.admits(origin):
            raise Rejected("origins")
        last = self._seen_seq.get(origin)
        if last is not None and seq <= last[0] and sent_at <= last[1]:
            raise Rejected("replay")  # a restarted replica's sequence starts again, at a later time
        checks = self.checks
        checks.now, checks.known = now, self._known_ids()
        own_counts = self._checked_counts(counts)
        # Believed: from here on it is applied.
        if last is not None and seq != last[0] + 1:
            # Lost messages (a failed publish, a reconnect): their finishes may be among them.
            self._count("gap")
            self._forget_pins(origin)
        self._seen_seq[origin] = (seq, float(sent_at))
        self.remote.update(origin, own_counts)
        self.remote.update_critical(origin, self._checked_rates(message.get("k")))
        self.remote.update_waiting(origin, self._checked_waiting(message.get("w")))
        for key, records in updates.items():
            plugin = self.plugins.get(key) if isinstance(key, str) else None
            if plugin is None:
                self._reject("unknown_plugin")
            elif not isinstance(records, list):
                self._reject("record")
            else:
                plugin.apply_updates(origin, records)
        sketch = message.get("a")
        if isinstance(sketch, dict) and self._fingerprint and self.metrics is not None:
            for key, agreement in agreements(self._fingerprint, sketch).items():
                self.metrics.sync_agreement.labels(plugin=key).set(agreement)
        self._count("received")
        if self.metrics is not None:
            self.metrics.sync_apply_lag.observe(max(0.0, now - sent_at))
            self.metrics.sync_replicas.set(len(self.remote.origins()))
        return True

    def _checked_counts(self, counts: dict[Any, Any]) -> dict[str, int]:
        """A peer's in-flight counts, entry by entry: known upstreams, ints in [0, MAX_COUNT]; more
        entries than this replica knows upstreams drop the message."""
        checks = self.checks
        limit = len(checks.known) if checks.known is not None else MAX_UPSTREAMS
        if len(counts) > limit:
            raise Rejected("too_many")
        out: dict[str, int] = {}
        bad = 0
        for uid, n in counts.items():
            if not is_int(n) or not 0 <= n <= MAX_COUNT:
                bad += 1
            elif checks.upstream(uid) and n:
                out[uid] = n
        self._reject("count", bad)
        return out

    def _checked_rates(self, rates: object) -> dict[str, float]:
        """A peer's critical arrival rates by model ("k"; absent: none): finite, in [0, MAX_RATE]."""
        return self._checked_by_model(rates, "rate", lambda v: _number(v) and 0.0 <= v <= MAX_RATE)

    def _checked_waiting(self, waiting: object) -> dict[str, int]:
        """A peer's standard waiters by model ("w"; absent: none): ints in [0, MAX_COUNT]."""
        return self._checked_by_model(waiting, "waiting", lambda v: is_int(v) and 0 <= v <= MAX_COUNT)

    def _checked_by_model(self, values: object, reason: str, valid: Callable[[Any], bool]) -> dict[str, Any]:
        """A per-model map from a peer, entry by entry: a model name of at most MAX_MODEL_CHARS
        characters and a `valid` value, zeros left out; not a map, or more than MAX_MODEL_ENTRIES
        entries, drops the field (never the message). Drops are counted under `reason`."""
        if values is None:
            return {}
        if not isinstance(values, dict) or len(values) > MAX_MODEL_ENTRIES:
            self._reject(reason)
            return {}
        out: dict[str, Any] = {}
        bad = 0
        for model, value in values.items():
            if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS and valid(value):
                if value:
                    out[model] = value
            else:
                bad += 1
        self._reject(reason, bad)
        return out

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
        payload = msgpack.packb({"v": SYNC_VERSION, "r": self.replica, "t": self.clock(), "p": dumps})
        return self._sign(bytes(payload), STATE_CONTEXT)

    @property
    def state_age_s(self) -> float:
        """How old a dump may be: written every state_interval_s, kept 3 intervals, plus clock skew."""
        return 3 * self.settings.state_interval_s + self.settings.expire_s

    def _checked_state(self, data: object) -> dict[Any, Any]:
        """Another replica's dump, checked as messages are (size, signature, version, replica id,
        time within state_age_s before now and expire_s after)."""
        state = self._unpack(data, MAX_STATE_BYTES, STATE_CONTEXT)
        origin, t, dumps = state.get("r"), state.get("t"), state.get("p")
        if not _replica_id(origin) or not isinstance(dumps, dict) or not _number(t):
            raise Rejected("malformed")
        now = self.clock()
        if not now - self.state_age_s <= t <= now + self.settings.expire_s:
            raise Rejected("time")
        return state

    def load_state(self, data: object) -> bool:
        """Merge another replica's dump (a late start, a reconnect); False when it is dropped
        (counted). Its plugins' parts are checked as their records are."""
        try:
            state = self._checked_state(data)
            checks = self.checks
            checks.now, checks.known = self.clock(), self._known_ids()
            for key, dump in state["p"].items():
                plugin = self.plugins.get(key) if isinstance(key, str) else None
                if plugin is None:
                    self._reject("unknown_plugin")
                else:
                    plugin.load(dump)
        except Rejected as exc:
            self._reject(exc.reason)
            return False
        except Exception:  # a check missed (a bug): counted, never raised into the resync
            log.debug("sync: state not loaded", exc_info=True)
            self._reject("error")
            return False
        self.loaded_from = state["r"]
        return True

    def sample(self) -> None:
        """Index sizes per plugin and upstream into the gauge (every state_interval_s)."""
        if self.metrics is None:
            return
        gauge = self.metrics.sync_index_blocks
        sampled: set[tuple[str, str]] = set()
        for key, plugin in self.plugins.items():
            for uid, n in plugin.index_sizes().items():
                gauge.labels(plugin=key, upstream=uid).set(n)
                sampled.add((key, uid))
        for key, uid in self._sampled - sampled:  # upstreams gone: no series left behind
            with contextlib.suppress(KeyError):
                gauge.remove(key, uid)
        self._sampled = sampled

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
            asyncio.create_task(supervised("sync-publish", self._publish_loop), name="sync-publish"),
            asyncio.create_task(supervised("sync-receive", self._receive_loop), name="sync-receive"),
            asyncio.create_task(supervised("sync-expire", self._expire_loop), name="sync-expire"),
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
        """Load the freshest state another replica wrote (a late start, or after a reconnect): each
        candidate checked whole (a forged dump stamped in the future, or NaN, must not win), looked
        at one by one (at most MAX_STATE_KEYS, each at most MAX_STATE_BYTES: two held at a time)."""
        mine = self.state_key(self.replica).encode()
        keys: list[bytes] = []
        async with contextlib.aclosing(client.scan_iter(match=self.state_key("*"), count=100)) as found:
            async for k in found:
                if k != mine:
                    keys.append(k)
                if len(keys) >= MAX_STATE_KEYS:
                    break
        best: tuple[float, bytes] | None = None
        for key in keys:
            try:  # a key of another type answers WRONGTYPE: skipped, the resync goes on
                if await client.strlen(key) > MAX_STATE_BYTES:
                    self._reject("size")
                    continue
                value = await client.get(key)
            except ResponseError:
                self._reject("undecodable")
                continue
            if value is None:  # expired meanwhile
                continue
            try:
                t = float(self._checked_state(value)["t"])
            except Rejected as exc:
                self._reject(exc.reason)
                continue
            if best is None or t > best[0]:
                best = (t, value)
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
        if not isinstance(other, dict) or len(other) > MAX_FINGERPRINT_UPSTREAMS:
            continue  # (bounded: the work per message stays that of a real sketch)
        scores = []
        for uid in own.keys() | {u for u in other if isinstance(u, str)}:
            a = set(own.get(uid, ()))
            raw = other.get(uid, ())
            b = {h for h in raw[:FINGERPRINT_K] if isinstance(h, bytes)} if isinstance(raw, list) else set()
            union = heapq.nsmallest(FINGERPRINT_K, a | b)
            if union:
                scores.append(sum(1 for h in union if h in a and h in b) / len(union))
        if scores:
            out[key] = sum(scores) / len(scores)
    return out
