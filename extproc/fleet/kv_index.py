"""The precise prefix index: per upstream, the exact set of the service's block hashes the engine holds.

Engines that publish KV-cache events (vLLM, SGLang: `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
over ZMQ) tell exactly which blocks they cache. `llm-extproc publish` subscribes to each engine
(publishers/kv_events.py), turns the engine's blocks into this service's index blocks (the chained
8-byte hashes of `block_tokens`-token blocks that `predicted-ttft` matches, extproc.tokenization) and
publishes them through Redis, compactly:

- deltas on the pool's channel `<prefix>:kv` (msgpack map: `u` instance id, `e` the publisher's epoch
  for that instance, `s` sequence (consecutive within an epoch), `a` / `r` added / removed hashes
  (8-byte hashes concatenated), `c` true when the set was cleared first, `k` what the set is worth
  (2 complete, 1 a lower bound, 0 unknown: the engine's socket is gone), `t` publish time, `l` the
  engine's timestamp of the newest event batch behind it). An empty delta is a heartbeat.
- the full set under `<prefix>:kv:<instance>` (map: `u`, `e`, `s`, `k`, `h` every hash, `t`),
  rewritten at least every few seconds with a TTL, for a replica that starts late or missed a delta.

`KvIndex` applies both: deltas in order; a missing sequence (a lost message, a new epoch) makes that
instance's set unusable until its full key is read again (`KvIndexFeed` does that off the request
path). `blocks(id)` answers only with a set that is synced and fresh (a message, heartbeats included,
within `stale_after_s`); otherwise None, and the scorer falls back to its own cache model.

An instance that has left is forgotten: when nothing was heard from it for `forget_after_s` (its
publisher heartbeats every instance it follows; `KvIndexFeed` prunes every few seconds), and at once
when the service sees its endpoint leave the pool (extproc.lifecycle calls `forget`). A publisher that
still follows it brings it back, re-read from its full key.

Nothing here runs on the request path but `blocks()`, a dict lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from extproc.fleet.redis_feed import RedisClient, cancel_until_done, follow_channel
from extproc.fleet.view import KvHeld
from extproc.settings import FORGET_AFTER_S, RedisSettings
from extproc.telemetry import Metrics
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.kv_index")

HASH_BYTES = 8  # extproc.tokenization.block_hashes digests
UNKNOWN, PARTIAL, COMPLETE = 0, 1, 2  # what a published set is worth (`k`)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_BUFFERED = 256  # deltas held per instance while waiting for its full set
RESYNC_POLL_S = 0.25  # how often instances out of sync get their full key read
PRUNE_EVERY_S = 5.0  # how often instances silent for forget_after_s are forgotten


def kv_channel(settings: RedisSettings) -> str:
    return f"{settings.prefix}:kv"


def kv_key(settings: RedisSettings, upstream_id: str) -> str:
    return f"{settings.prefix}:kv:{upstream_id}"


def pack_hashes(hashes: Any) -> bytes:
    return b"".join(hashes)


def unpack_hashes(blob: object) -> list[bytes] | None:
    """8-byte hashes from a concatenation; None when it is not one."""
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        return None
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def encode_delta(
    upstream_id: str,
    epoch: int,
    seq: int,
    added: list[bytes],
    removed: list[bytes],
    cleared: bool,
    engine_ts: float | None,
    knowledge: int = COMPLETE,
) -> bytes:
    doc: dict[str, Any] = {
        "u": upstream_id,
        "e": epoch,
        "s": seq,
        "a": pack_hashes(added),
        "r": pack_hashes(removed),
        "c": cleared,
        "k": knowledge,
        "t": time.time(),
    }
    if engine_ts is not None:
        doc["l"] = engine_ts
    return bytes(msgpack.packb(doc, use_bin_type=True))


def encode_full(upstream_id: str, epoch: int, seq: int, hashes: Any, knowledge: int = COMPLETE) -> bytes:
    doc = {"u": upstream_id, "e": epoch, "s": seq, "k": knowledge, "h": pack_hashes(hashes), "t": time.time()}
    return bytes(msgpack.packb(doc, use_bin_type=True))


@dataclass(slots=True)
class _Delta:
    upstream_id: str
    epoch: int
    seq: int
    added: list[bytes]
    removed: list[bytes]
    cleared: bool
    sent_at: float
    engine_ts: float | None
    knowledge: int


def _decode(data: object) -> dict[Any, Any] | None:
    if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        doc = msgpack.unpackb(data, raw=False)
    except Exception:
        return None
    if not isinstance(doc, dict):
        return None
    if not isinstance(doc.get("u"), str) or not isinstance(doc.get("e"), int):
        return None
    if not isinstance(doc.get("s"), int) or isinstance(doc.get("s"), bool):
        return None
    return doc


def decode_delta(data: object) -> _Delta | None:
    doc = _decode(data)
    if doc is None:
        return None
    added, removed = unpack_hashes(doc.get("a", b"")), unpack_hashes(doc.get("r", b""))
    sent_at, engine_ts = doc.get("t"), doc.get("l")
    if added is None or removed is None or not isinstance(sent_at, int | float):
        return None
    if engine_ts is not None and not isinstance(engine_ts, int | float):
        return None
    knowledge = _knowledge(doc)
    if knowledge is None:
        return None
    cleared = bool(doc.get("c"))
    return _Delta(doc["u"], doc["e"], doc["s"], added, removed, cleared, float(sent_at), engine_ts, knowledge)


def _knowledge(doc: dict[Any, Any]) -> int | None:
    k = doc.get("k", COMPLETE)
    return k if k in (UNKNOWN, PARTIAL, COMPLETE) and not isinstance(k, bool) else None


@dataclass(slots=True)
class _Entry:
    held: KvHeld = field(default_factory=lambda: KvHeld(set()))
    knowledge: int = UNKNOWN
    epoch: int = -1
    seq: int = -1
    synced: bool = False
    heard_at: float = 0.0  # local time of the last message (any: heartbeats count)
    buffered: list[_Delta] = field(default_factory=list)  # while not synced


class KvIndex:
    """Per instance, the exact set of index block hashes its engine holds (see the module docstring).

    `blocks(upstream_id)` is the only call on the request path. An upstream in cluster routing mode
    (the cluster id, no address) uses its instance's set when exactly one instance of the cluster has
    one; with several, Envoy picks the instance, so no set is exact and the answer is None."""

    def __init__(
        self,
        stale_after_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        forget_after_s: float = FORGET_AFTER_S,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._by_cluster: dict[str, list[str]] = {}
        self.gaps = 0  # deltas that found a sequence missing
        self.lag_observer: Callable[[float], None] | None = None  # engine batch -> applied (seconds)

    # -- request path ---------------------------------------------------------------------------------
    def blocks(self, upstream_id: str) -> KvHeld | None:
        entry = self._entries.get(upstream_id)
        if entry is None:
            ids = self._by_cluster.get(upstream_id)
            if ids is None or len(ids) != 1:
                return None
            entry = self._entries.get(ids[0])
            if entry is None:
                return None
        return entry.held if self._usable(entry, self.clock() - self.stale_after_s) else None

    @staticmethod
    def _usable(entry: _Entry, oldest: float) -> bool:
        """A set the request path may trust: synced, known, and heard from since `oldest`."""
        return entry.synced and entry.knowledge != UNKNOWN and entry.heard_at >= oldest

    def holding(self, block: bytes) -> list[str]:
        """Ids of the instances whose synced, fresh set holds `block`, and the cluster id of each
        such instance that is its cluster's only one: one pass over the sets, for a caller that
        would otherwise ask `blocks()` of every candidate in a large pool."""
        oldest = self.clock() - self.stale_after_s
        found: list[str] = []
        for uid, entry in self._entries.items():
            if block in entry.held.blocks and self._usable(entry, oldest):
                found.append(uid)
                cluster, sep, _ = uid.partition("/")
                if sep and len(self._by_cluster.get(cluster, ())) == 1:
                    found.append(cluster)
        return found

    # -- feeding ------------------------------------------------------------------------------------------
    def _entry(self, upstream_id: str) -> _Entry:
        entry = self._entries.get(upstream_id)
        if entry is None:
            entry = self._entries[upstream_id] = _Entry()
            cluster, sep, _ = upstream_id.partition("/")
            if sep:
                self._by_cluster.setdefault(cluster, []).append(upstream_id)
        return entry

    def apply_delta(self, delta: _Delta) -> str:
        """'applied', 'buffered' (waiting for a full set) or 'old' (already covered)."""
        entry = self._entry(delta.upstream_id)
        entry.heard_at = self.clock()
        if delta.cleared:  # a clear is a full state: empty, then the additions
            blocks = set(delta.added)
            blocks.difference_update(delta.removed)
            entry.held = KvHeld(blocks)
            entry.epoch, entry.seq, entry.synced = delta.epoch, delta.seq, True
            self._know(entry, delta.knowledge)
            entry.buffered.clear()
            self._observe(delta)
            return "applied"
        if entry.synced and delta.epoch == entry.epoch:
            if delta.seq <= entry.seq:
                return "old"
            if delta.seq == entry.seq + 1:
                self._apply(entry, delta)
                return "applied"
        if entry.synced:
            self.gaps += 1
        entry.synced = False
        entry.buffered.append(delta)
        if len(entry.buffered) > MAX_BUFFERED:
            del entry.buffered[0]
        return "buffered"

    def apply_full(self, data: object) -> bool:
        doc = _decode(data)
        if doc is None:
            return False
        hashes = unpack_hashes(doc.get("h"))
        knowledge = _knowledge(doc)
        if hashes is None or knowledge is None:
            return False
        entry = self._entry(doc["u"])
        if entry.synced and entry.epoch == doc["e"] and entry.seq >= doc["s"]:
            return True  # the deltas got further already
        entry.held = KvHeld(set(hashes))
        entry.epoch, entry.seq, entry.synced = doc["e"], doc["s"], True
        self._know(entry, knowledge)
        entry.heard_at = self.clock()
        pending, entry.buffered = entry.buffered, []
        for delta in sorted(pending, key=lambda d: d.seq):
            if delta.epoch != entry.epoch or delta.seq <= entry.seq:
                continue
            if delta.seq != entry.seq + 1:
                entry.synced = False  # still a hole: the next full set fills it
                entry.buffered = [d for d in pending if d.epoch == entry.epoch and d.seq > entry.seq]
                break
            self._apply(entry, delta)
        return True

    def _apply(self, entry: _Entry, delta: _Delta) -> None:
        blocks = entry.held.blocks
        blocks.difference_update(delta.removed)
        blocks.update(delta.added)
        entry.seq = delta.seq
        self._know(entry, delta.knowledge)
        self._observe(delta)

    @staticmethod
    def _know(entry: _Entry, knowledge: int) -> None:
        entry.knowledge = knowledge
        entry.held.complete = knowledge == COMPLETE

    def _observe(self, delta: _Delta) -> None:
        if delta.engine_ts is not None and self.lag_observer is not None:
            self.lag_observer(max(0.0, time.time() - delta.engine_ts))

    def forget(self, upstream_id: str) -> None:
        if self._entries.pop(upstream_id, None) is not None:
            cluster = upstream_id.partition("/")[0]
            ids = self._by_cluster.get(cluster)
            if ids is not None and upstream_id in ids:
                ids.remove(upstream_id)
                if not ids:
                    del self._by_cluster[cluster]

    def prune(self) -> list[str]:
        """Forget the instances nothing was heard from (deltas, heartbeats, full sets) for
        `forget_after_s`: their engines are gone. Returns their ids."""
        oldest = self.clock() - self.forget_after_s
        gone = [uid for uid, e in self._entries.items() if e.heard_at < oldest]
        for uid in gone:
            self.forget(uid)
        return gone

    def out_of_sync(self) -> list[str]:
        return [uid for uid, e in self._entries.items() if not e.synced]

    def sizes(self) -> dict[str, int]:
        """Blocks held per instance (synced or not), for the index-size gauge."""
        return {uid: len(e.held.blocks) for uid, e in self._entries.items()}


class KvIndexFeed:
    """Follows the KV channel into a `KvIndex`; reads full sets at start, after a reconnect and for any
    instance out of sync. Reconnects with backoff; Redis down leaves the sets to go stale (then the
    scorer uses its own cache model), never blocks a request."""

    def __init__(self, settings: RedisSettings, index: KvIndex, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.index = index
        self.metrics = metrics
        if metrics is not None:
            index.lag_observer = metrics.kv_event_lag.observe
        self._tasks: list[asyncio.Task[None]] = []
        self._exported: set[str] = set()
        self._next_prune = 0.0
        self.connected = asyncio.Event()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(supervised("kv-index", self._follow), name="kv-index")]

    async def stop(self) -> None:
        await cancel_until_done(self._tasks)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_index_messages.labels(outcome=outcome).inc()

    def _export(self) -> None:
        if self.metrics is None:
            return
        sizes = self.index.sizes()
        gauge = self.metrics.kv_index_blocks
        for uid, n in sizes.items():
            gauge.labels(upstream=uid).set(n)
        for uid in self._exported - sizes.keys():
            with contextlib.suppress(KeyError):
                gauge.remove(uid)
        self._exported = set(sizes)

    def maintain(self, now: float) -> None:
        """Every poll: the size gauge; every PRUNE_EVERY_S, instances long silent are forgotten."""
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            gone = self.index.prune()
            if gone:
                silent = self.index.forget_after_s
                log.info("kv index: forgot %d instances silent for %.0fs", len(gone), silent)
        self._export()

    def ingest(self, data: object) -> None:
        delta = decode_delta(data)
        if delta is None:
            self._count("rejected")
            return
        self._count(self.index.apply_delta(delta))

    async def load_all(self, client: Any) -> int:
        keys = [k async for k in client.scan_iter(match=f"{self.settings.prefix}:kv:*", count=500)]
        return await self._load(client, keys)

    async def _load(self, client: Any, keys: list[Any]) -> int:
        if not keys:
            return 0
        loaded = 0
        for value in await client.mget(keys):
            if value is not None and self.index.apply_full(value):
                loaded += 1
                self._count("full")
        return loaded

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        next_poll = 0.0

        async def poll(client: RedisClient) -> None:
            nonlocal next_poll
            if loop.time() < next_poll:
                return
            next_poll = loop.time() + RESYNC_POLL_S
            self.maintain(loop.time())
            behind = self.index.out_of_sync()
            if behind:
                await self._load(client, [kv_key(self.settings, uid) for uid in behind])

        def lost(exc: Exception) -> None:
            log.debug("kv index subscription lost: %s", exc)

        await follow_channel(
            self.settings,
            kv_channel(self.settings),
            self.ingest,
            on_subscribed=self.load_all,
            on_poll=poll,
            poll_s=RESYNC_POLL_S,
            on_lost=lost,
            connected=self.connected,
        )
