"""KV-cache events from engines: the wire format, the translation into the service's index blocks, and
the per-instance ZMQ subscription of `llm-extproc publish`.

Wire format (checked against vLLM 0.33.0's `vllm/distributed/kv_events.py`, whose msgspec classes
encoded tests/data/vllm-0.33.0-kv-events.json, and SGLang's `python/sglang/srt/disaggregation/
kv_events.py`; docs/fleet-state.md "KV events"): the engine's ZMQ PUB socket sends multipart messages
`[topic, seq, payload]`, `seq` an 8-byte big-endian counter from 0, `payload` a msgpack
`KVEventBatch`: an array `[ts, events, data_parallel_rank]` (SGLang: `[ts, events]`). Each event is a
msgspec tagged struct: in vLLM 0.33 a map whose `type` names the class
(`{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
"block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null, ...}`); in SGLang and older
vLLM an array whose first element is the tag (`["BlockStored", hashes, parent, token_ids, block_size,
lora_id, ...]`). Block hashes are bytes (vLLM's sha256 default) or 64-bit ints. `decode_batch` reads
every form; `encode_batch` writes vLLM 0.33's, byte for byte (the simulated engine uses it).

Translation: an engine block's hash chains everything before it, so an engine hash stands for one
exact token prefix. `BlockTranslator` keeps, per engine block it has seen stored, the service's chain
state after it (the last full index block's hash and the tokens since), so a `BlockStored` whose
parent it knows extends the chain with `block_tokens`-token index blocks hashed exactly as the
service hashes prompts (extproc.tokenization.block_hashes: blake2b-8 over little-endian uint32 ids).
An index block is held while every engine block it spans is held; removing one engine block drops
every index block it was part of. Memory is bounded by the engine's cached blocks (entries leave on
`BlockRemoved`) and capped (`max_engine_blocks`: past it, the mapping is dropped and resynced).
This only works when the service tokenizes prompts with the engine's tokenizer (`tokenizers:`);
events with a LoRA adapter, another medium than the GPU, or another KV-cache group are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import sys
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

import msgpack

from extproc.fleet.kv_index import COMPLETE, PARTIAL, UNKNOWN, encode_delta, encode_full, kv_channel, kv_key
from extproc.fleet.redis_feed import is_cluster, write_and_publish
from extproc.settings import ConfigError, RedisSettings, check_keys, number

log = logging.getLogger("extproc.publisher.kv_events")

EngineHash = bytes | int
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_LITTLE = sys.byteorder == "little"


class KvEventsError(ValueError):
    """A payload that is not a KV event batch."""


# -- wire format ------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


def _event_doc(event: KvEvent) -> dict[str, Any]:
    """vLLM 0.33's map form: required fields always, defaulted ones only when set (omit_defaults)."""
    if isinstance(event, BlockStored):
        doc: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    elif isinstance(event, BlockRemoved):
        doc = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if event.group_idx is not None:
        doc["group_idx"] = event.group_idx
    return doc


# msgspec sizes a struct's map header for all its fields plus the tag: BlockStored (17 possible
# entries) always gets a map16 header, even with fewer entries; the others fit a fixmap.
_MAP16_EVENTS = ("BlockStored",)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame vLLM 0.33 sends for `batch`, byte for byte (tests/data: vLLM's own bytes)."""
    packer = msgpack.Packer(use_bin_type=True)
    out = [b"\x93", packer.pack(float(batch.ts)), packer.pack_array_header(len(batch.events))]
    for event in batch.events:
        doc = _event_doc(event)
        if doc["type"] in _MAP16_EVENTS:
            out.append(b"\xde" + len(doc).to_bytes(2, "big"))
            out.extend(packer.pack(k) + packer.pack(v) for k, v in doc.items())
        else:
            out.append(packer.pack(doc))
    out.append(packer.pack(batch.data_parallel_rank))
    return b"".join(out)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventsError(f"block hash must be bytes or int, got {type(value).__name__}")


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list):
        raise KvEventsError("block_hashes must be a list")
    return [_hash(v) for v in value]


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _decode_event(raw: Any) -> KvEvent | None:
    """One event, map or array form; None for a kind this reader does not know (skipped)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        f = raw.get
        if kind == "BlockStored":
            args = [f("block_hashes"), f("parent_block_hash"), f("token_ids"), f("block_size")]
            extra = [f("lora_id"), f("medium"), f("lora_name"), f("group_idx")]
        elif kind == "BlockRemoved":
            args, extra = [f("block_hashes")], [f("medium"), f("group_idx")]
        elif kind == "AllBlocksCleared":
            return AllBlocksCleared()
        else:
            return None
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        # Array form: fields in declaration order (vLLM: block_hashes, parent_block_hash, token_ids,
        # block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...; SGLang stops at lora_id).
        kind, rest = raw[0], [*raw[1:], *[None] * 9]
        if kind == "BlockStored":
            if len(raw) < 5:
                raise KvEventsError("BlockStored needs 4 fields")
            args, extra = rest[:4], [rest[4], rest[5], rest[6], rest[8]]
        elif kind == "BlockRemoved":
            if len(raw) < 2:
                raise KvEventsError("BlockRemoved needs block_hashes")
            args, extra = [rest[0]], [rest[1], rest[2]]
        elif kind == "AllBlocksCleared":
            return AllBlocksCleared()
        else:
            return None
    else:
        raise KvEventsError("an event must be a map or a tagged array")
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(args[0]), _opt_str(extra[0]), _opt_int(extra[1]))
    hashes, parent, tokens, size = args
    if not isinstance(tokens, list):  # the ids themselves are checked where they are used
        raise KvEventsError("token_ids must be a list")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise KvEventsError("block_size must be a positive int")
    return BlockStored(
        _hashes(hashes),
        None if parent is None else _hash(parent),
        tokens,
        size,
        _opt_int(extra[0]),
        _opt_str(extra[1]),
        _opt_str(extra[2]),
        _opt_int(extra[3]),
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload frame, any of the forms in the module docstring. Raises KvEventsError."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KvEventsError("payload too large")
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KvEventsError(f"not msgpack: {exc}") from None
    if isinstance(doc, dict):
        ts, events, rank = doc.get("ts"), doc.get("events"), doc.get("data_parallel_rank")
    elif isinstance(doc, list) and len(doc) >= 2:
        ts, events, rank = doc[0], doc[1], doc[2] if len(doc) > 2 else None
    else:
        raise KvEventsError("a batch must be [ts, events, ...] or a map")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise KvEventsError("bad ts or events")
    decoded = [e for e in (_decode_event(raw) for raw in events) if e is not None]
    return KVEventBatch(float(ts), decoded, _opt_int(rank))


# -- translation --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Chain:
    """The service's chain state after some engine block: the last full index block's hash (the seed
    before the first) and the tokens and engine blocks of the index block not yet complete."""

    parent: bytes
    tokens: array[int] = field(default_factory=lambda: array("I"))  # uint32, 4 bytes a token
    blocks: tuple[EngineHash, ...] = ()


@dataclass(slots=True)
class _EngineBlock:
    after: _Chain
    members: list[bytes] = field(default_factory=list)  # index blocks that span this block


def chain_hash(parent: bytes, tokens: Sequence[int] | array[int]) -> bytes:
    """One index block's hash, as extproc.tokenization.block_hashes computes it."""
    ids = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _LITTLE:
        ids = array("I", ids)
        ids.byteswap()
    return blake2b(parent + ids.tobytes(), digest_size=8).digest()


@dataclass(slots=True)
class TranslatorStats:
    stored: int = 0  # engine blocks stored
    removed: int = 0  # engine blocks removed
    unknown_parent: int = 0  # stored blocks whose parent was never seen (started mid-stream, a gap)
    ignored: int = 0  # events for a LoRA, another medium or KV group
    overflows: int = 0  # the mapping passed max_engine_blocks and was dropped


class BlockTranslator:
    """Engine blocks in, the service's held index blocks out (see the module docstring)."""

    def __init__(self, block_tokens: int, *, seed: bytes = b"", max_engine_blocks: int = 1_000_000) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.seed = seed
        self.max_engine_blocks = max_engine_blocks
        self._engine: dict[EngineHash, _EngineBlock] = {}
        self._held: dict[bytes, tuple[EngineHash, ...]] = {}  # index block -> engine blocks it spans
        self._delta: dict[bytes, bool] = {}  # index block -> added (True) / removed since take_delta
        self._cleared = False
        self.stats = TranslatorStats()

    @property
    def held(self) -> Iterable[bytes]:
        return self._held.keys()

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, index_hash: bytes) -> bool:
        return index_hash in self._held

    def matched(self, hashes: Sequence[bytes]) -> int:
        """Leading index blocks of `hashes` the engine holds."""
        n = 0
        held = self._held
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def apply(self, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
                self.stats.ignored += 1
                return
            for h in event.block_hashes:
                self._removed(h)
        else:
            self.clear()

    def clear(self) -> None:
        """The engine dropped everything (AllBlocksCleared, a restart, a sequence gap)."""
        self._engine.clear()
        self._held.clear()
        self._delta.clear()
        self._cleared = True

    def take_delta(self) -> tuple[bool, list[bytes], list[bytes]]:
        """(cleared first, index blocks added, removed) since the last call."""
        cleared, delta = self._cleared, self._delta
        self._cleared, self._delta = False, {}
        added = [h for h, a in delta.items() if a]
        removed = [h for h, a in delta.items() if not a]
        return cleared, added, removed

    def _stored(self, ev: BlockStored) -> None:
        if (
            ev.lora_id is not None
            or ev.lora_name is not None
            or ev.medium not in (None, "GPU")
            or ev.group_idx not in (None, 0)
        ):
            self.stats.ignored += 1
            return
        bs = ev.block_size
        try:
            tokens = array("I", ev.token_ids)  # also the check: uint32 ids only
        except (TypeError, OverflowError, ValueError):
            tokens = array("I")
        if len(tokens) != len(ev.block_hashes) * bs or not tokens:
            self.stats.ignored += 1
            return
        engine = self._engine
        if ev.parent_block_hash is None:
            chain = _Chain(self.seed)
        else:
            parent = engine.get(ev.parent_block_hash)
            if parent is None:
                self.stats.unknown_parent += len(ev.block_hashes)
                return
            chain = parent.after
        bt = self.block_tokens
        for i, h in enumerate(ev.block_hashes):
            self.stats.stored += 1
            known = engine.get(h)
            if known is not None:  # stored again (vLLM's "full" report mode re-reports reused blocks)
                chain = known.after
                continue
            pending = chain.tokens + tokens[i * bs : (i + 1) * bs]
            spans = (*chain.blocks, h)
            parent_hash = chain.parent
            block = _EngineBlock(_Chain(parent_hash))
            engine[h] = block
            while len(pending) >= bt:
                index_hash = chain_hash(parent_hash, pending[:bt])
                if all(e in engine for e in spans):
                    for e in spans:
                        engine[e].members.append(index_hash)
                    if index_hash not in self._held:
                        self._held[index_hash] = spans
                        self._delta[index_hash] = True
                parent_hash = index_hash
                pending = pending[bt:]
                spans = (h,) if pending else ()
            block.after = _Chain(parent_hash, pending, spans if pending else ())
            chain = block.after
        if len(engine) > self.max_engine_blocks:
            self.stats.overflows += 1
            self.clear()

    def _removed(self, h: EngineHash) -> None:
        block = self._engine.get(h)
        if block is None:
            return
        # Set semantics: vLLM may hold one hash in two physical blocks and remove them one by one; the
        # first removal drops it here (a miss predicted, never a hit that is not there).
        self.stats.removed += 1
        del self._engine[h]
        held, delta = self._held, self._delta
        for index_hash in block.members:
            if held.pop(index_hash, None) is not None:
                delta[index_hash] = False


# -- configuration -------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class KvEventsSpec:
    """`kv_events:` of one instance (or of an Envoy cluster's `llm-extproc` metadata)."""

    port: int = 5557
    topic: str = ""
    host: str = ""  # "" : the instance's own host
    block_tokens: int = 64  # the service's index block (predicted-ttft's block_tokens)
    flush_s: float = 0.05  # deltas are batched this long
    full_interval_s: float = 1.0  # the full set is rewritten at most this often (when changed)
    heartbeat_s: float = 1.0  # an empty delta when nothing changed: the service's freshness signal
    max_engine_blocks: int = 1_000_000

    @property
    def full_ttl_ms(self) -> int:
        return int(max(10.0, 10 * max(self.full_interval_s, self.heartbeat_s)) * 1000)


def kv_events_spec(raw: Any, where: str) -> KvEventsSpec | None:
    if raw is None or raw is False:
        return None
    if raw is True:
        return KvEventsSpec()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'kv_events' must be a mapping (port, topic, block_tokens, ...)")
    check_keys(raw, KvEventsSpec.__dataclass_fields__, f"{where}: kv_events")
    kw: dict[str, Any] = {}
    for name, low, high in (
        ("port", 1, 65535),
        ("block_tokens", 1, 1 << 16),
        ("max_engine_blocks", 1, 1 << 30),
    ):
        if name in raw:
            kw[name] = int(number(raw[name], f"{where}: kv_events '{name}'", minimum=low, maximum=high))
    for name in ("flush_s", "full_interval_s", "heartbeat_s"):
        if name in raw:
            kw[name] = number(raw[name], f"{where}: kv_events '{name}'", minimum=0.001, maximum=60.0)
    for name in ("topic", "host"):
        if name in raw:
            if not isinstance(raw[name], str):
                raise ConfigError(f"{where}: kv_events '{name}' must be a string")
            kw[name] = raw[name]
    return KvEventsSpec(**kw)


# -- the subscription ------------------------------------------------------------------------------------


@dataclass(slots=True)
class SourceStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0  # sequence numbers skipped: the mapping was dropped (a resync)
    restarts: int = 0  # the sequence went back, or the connection dropped: the engine restarted
    bad: int = 0  # payloads that did not decode
    deltas: int = 0
    fulls: int = 0
    redis_errors: int = 0
    disconnects: int = 0  # the engine's socket dropped (what it holds is unknown until its next batch)
    connections: int = 0  # TCP connections made to the engine (ZMQ reconnects by itself)


class KvEventsSource:
    """One engine instance's KV events: SUB socket -> BlockTranslator -> Redis deltas and full set.

    What the published set is worth (`knowledge`): COMPLETE when every batch since the engine's first
    (seq 0) or its last AllBlocksCleared was seen; PARTIAL (a lower bound) when the subscription began
    mid-stream or batches were lost (a skipped sequence number clears the mapping: removals may be
    missing too; blocks stored before cannot be mapped any more, their parents being unknown, and the
    service unites the set with its own cache model); UNKNOWN while the engine's socket is down (a
    restart or the network; the next batch tells which: the same sequence, or a new one from 0).
    Gaps, restarts and disconnects are counted."""

    def __init__(
        self,
        upstream_id: str,
        address: str,
        spec: KvEventsSpec,
        redis: RedisSettings,
        client: Any,
        metrics: Any = None,
    ) -> None:
        self.upstream_id = upstream_id
        self.spec = spec
        self.redis = redis
        self.client = client
        self.metrics = metrics
        host = spec.host or address.rpartition(":")[0] or "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.endpoint = f"tcp://{host}:{spec.port}"
        self.translator = BlockTranslator(spec.block_tokens, max_engine_blocks=spec.max_engine_blocks)
        self.stats = SourceStats()
        self.epoch = random.getrandbits(48)  # a new publisher (or source) is a new epoch for readers
        self.seq = 0
        self.last_engine_seq: int | None = None
        self.last_engine_ts: float | None = None
        self.knowledge = UNKNOWN  # what the mapped set is worth (fleet/kv_index.py)
        self._known_before = UNKNOWN  # the knowledge before the socket dropped
        self._sent_knowledge = -1
        self._full_at = 0.0
        self._sent_at = 0.0
        self._dirty = True  # the full set differs from the last one written

    def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message [topic, seq, payload] (or [seq, payload] from a replay)."""
        if len(frames) < 2:
            self.stats.bad += 1
            return
        seq_frame, payload = frames[-2], frames[-1]
        if len(seq_frame) != 8:
            self.stats.bad += 1
            return
        seq = int.from_bytes(seq_frame, "big", signed=True)
        last = self.last_engine_seq
        if last is None:  # the first batch seen: only an engine's first one (0) says it started empty
            self.knowledge = COMPLETE if seq == 0 else PARTIAL
        elif seq == last + 1:
            if self.knowledge == UNKNOWN:  # the connection came back and nothing was missed
                self.knowledge = self._known_before
        elif seq <= last:  # a new engine process (its counter starts again)
            self.stats.restarts += 1
            self._count("restarts")
            self.translator.clear()
            self.knowledge = COMPLETE if seq == 0 else PARTIAL
        else:  # batches lost: removals may be missing too, so start over, as a lower bound
            self.stats.gaps += 1
            self._count("gaps")
            self.translator.clear()
            self.knowledge = PARTIAL
        self.last_engine_seq = seq
        try:
            batch = decode_batch(payload)
        except KvEventsError as exc:
            self.stats.bad += 1
            self._count("bad")
            log.debug("kv events from %s: %s", self.upstream_id, exc)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self._count("events", len(batch.events))
        for event in batch.events:
            self.translator.apply(event)
            if isinstance(event, AllBlocksCleared):
                self.knowledge = COMPLETE  # empty, and everything after is seen
        self.last_engine_ts = batch.ts
        self._dirty = True

    def disconnected(self) -> None:
        """The engine's socket went away (a restart, or the network): what it holds is unknown until
        its next batch says which (same sequence: nothing missed; back to 0: a new, empty engine)."""
        self.stats.disconnects += 1
        self._count("disconnects")
        if self.knowledge != UNKNOWN:
            self._known_before = self.knowledge
        self.knowledge = UNKNOWN

    def _count(self, what: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.kv_event(self.upstream_id, what, n)

    async def flush(self, now: float) -> bool:
        """Write what changed (a delta; the full set when due); a heartbeat when nothing did."""
        cleared, added, removed = self.translator.take_delta()
        changed = cleared or added or removed or self.knowledge != self._sent_knowledge
        if not changed and now - self._sent_at < self.spec.heartbeat_s:
            return True
        knowledge = self.knowledge
        self.seq += 1
        pipe_ops: list[tuple[str, Any]] = [
            (
                "publish",
                encode_delta(
                    self.upstream_id,
                    self.epoch,
                    self.seq,
                    added,
                    removed,
                    cleared,
                    self.last_engine_ts,
                    knowledge,
                ),
            )
        ]
        if (self._dirty and (cleared or now - self._full_at >= self.spec.full_interval_s)) or (
            now - self._full_at >= self.spec.full_ttl_ms / 3000
        ):
            pipe_ops.append(
                ("set", encode_full(self.upstream_id, self.epoch, self.seq, self.translator.held, knowledge))
            )
        try:
            async with asyncio.timeout(2.0):
                if is_cluster(self.client):
                    # A Cluster's pipelines refuse PUBLISH: SET, then PUBLISH (the full copy then
                    # already holds this delta's seq, which the service skips as outdated).
                    full = [data for op, data in pipe_ops if op == "set"]
                    await write_and_publish(
                        self.client,
                        [(kv_channel(self.redis), data) for op, data in pipe_ops if op == "publish"],
                        (kv_key(self.redis, self.upstream_id), full[0], self.spec.full_ttl_ms)
                        if full
                        else None,
                    )
                else:
                    async with self.client.pipeline(transaction=False) as pipe:
                        for op, data in pipe_ops:
                            if op == "publish":
                                pipe.publish(kv_channel(self.redis), data)
                            else:
                                pipe.set(kv_key(self.redis, self.upstream_id), data, px=self.spec.full_ttl_ms)
                        await pipe.execute()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The service will see a gap (or silence) and resync from the next full set.
            self.stats.redis_errors += 1
            self._count("redis_errors")
            log.debug("kv events publish for %s failed: %s", self.upstream_id, exc)
            self._full_at = 0.0
            self._dirty = True
            return False
        self._sent_at = now
        self._sent_knowledge = knowledge
        self.stats.deltas += 1
        if len(pipe_ops) > 1:
            self._full_at = now
            self._dirty = False
            self.stats.fulls += 1
        if self.metrics is not None:
            self.metrics.kv_index(self.upstream_id, len(self.translator))
        return True

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Subscribe and follow until cancelled (or `stop`); ZMQ reconnects on its own."""
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        stop = stop or asyncio.Event()
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)  # as vLLM's PUB side: a slow Redis write must not drop events
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        next_flush = loop.time() + self.spec.flush_s
        try:
            while not stop.is_set():
                timeout_ms = max(0, math.ceil((next_flush - loop.time()) * 1000))
                ready = dict(await poller.poll(timeout_ms))
                if sock in ready:
                    for _ in range(1000):  # drain what is there, bounded
                        try:
                            frames = await sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames)
                if monitor in ready:
                    while True:
                        try:
                            msg = await monitor.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        event = parse_monitor_message(msg)["event"]
                        if event == zmq.EVENT_DISCONNECTED:
                            self.disconnected()
                        elif event == zmq.EVENT_CONNECTED:
                            self.stats.connections += 1
                if loop.time() >= next_flush:
                    await self.flush(time.monotonic())
                    next_flush = loop.time() + self.spec.flush_s
        finally:
            with contextlib.suppress(Exception):
                sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)


class KvEventsRelay:
    """One `KvEventsSource` task per instance that has `kv_events`; follows the publisher's instances."""

    def __init__(self, redis: RedisSettings, client: Any, metrics: Any = None) -> None:
        self.redis = redis
        self.client = client
        self.metrics = metrics
        self.sources: dict[str, KvEventsSource] = {}
        self._tasks: dict[str, tuple[asyncio.Task[None], KvEventsSpec, str]] = {}

    def reconcile(self, instances: Iterable[tuple[str, str, KvEventsSpec | None]]) -> None:
        """(upstream id, address, spec) of every listed instance: start, restart or stop sources."""
        wanted = {uid: (address, spec) for uid, address, spec in instances if spec is not None}
        for uid, (task, spec, address) in list(self._tasks.items()):
            if wanted.get(uid) == (address, spec) and not task.done():
                continue
            task.cancel()
            del self._tasks[uid]
            self.sources.pop(uid, None)
        for uid, (address, spec) in wanted.items():
            if uid in self._tasks:
                continue
            source = KvEventsSource(uid, address, spec, self.redis, self.client, self.metrics)
            self.sources[uid] = source
            task = asyncio.create_task(self._run(source), name=f"kv-events {uid}")
            self._tasks[uid] = (task, spec, address)

    async def _run(self, source: KvEventsSource) -> None:
        try:
            await source.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events for %s stopped; restarted at the next reconcile", source.upstream_id)

    async def stop(self) -> None:
        tasks = [t for t, _, _ in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
