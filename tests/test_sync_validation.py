"""What replicas read from each other through Redis is checked before it is applied (server/sync.py,
sharing.PeerChecks; security issue 32): one test per finding, on the plain message logic, then one
through a real redis-server with a hostile writer on every key and on the sync channel."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
import redis.asyncio as aioredis

from extproc.config import config_from_dict
from extproc.fleet import RemoteInFlight, Upstream
from extproc.lifecycle import Decision, RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.prefix import PrefixAffinityScorer
from extproc.scheduling.ttft_predictor import SENT_WINDOW_S
from extproc.server.sync import MAX_COUNT, ReplicaSync
from extproc.settings import ConfigError, RedisSettings, SyncSettings
from extproc.telemetry import Metrics
from extproc_lab.stack import RedisProcess

# The names this change adds are imported where a test needs them, so that on the code before it
# each test fails on what it checks, not the whole module on an import.

HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions"},
    session_header="s",
    user_header="u",
    priority_header="p",
)
CLUSTERS = [f"c{i}" for i in range(4)]
TTFT = "default/0:predicted-ttft"
PREFIX = "default/1:prefix-affinity"
HASHES = bytes(range(8)) * 4  # four 8-byte block hashes
KEY = b"0123456789abcdef0123456789abcdef"


def body(q: int) -> bytes:
    messages = [
        {"role": "system", "content": "A tenant's prompt. " * 300},
        {"role": "user", "content": str(q)},
    ]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 100})


class Replica:
    """One service's lifecycle (static pool: c0..c3) and its sync logic on the wall clock, which is
    also the clock the plugins stamp their records with (no fleet view: time.time()). `known`: the
    sync is told the pool's upstream ids (`pool_upstreams`, as a service would be)."""

    def __init__(
        self,
        name: str,
        *,
        known: bool = False,
        key_file: Path | None = None,
        redis: RedisSettings | None = None,
    ) -> None:
        profile = {"scorers": [{"name": "predicted-ttft"}, {"name": "prefix-affinity", "weight": 0.5}]}
        self.config = config_from_dict(
            {
                "pool": {"clusters": [{"name": c, "models": ["m"]} for c in CLUSTERS]},
                "metrics_listen": None,
                "scheduling": {"profiles": {"default": profile}},
            }
        )
        self.metrics = Metrics(["m"], CLUSTERS)
        self.lifecycle = RequestLifecycle(self.config, self.metrics)
        self.remote = RemoteInFlight(3.0, clock=time.time)
        self.lifecycle.state.share(self.remote)
        extra: dict[str, Any] = {}
        if known:
            from extproc.server.sync import pool_upstreams

            extra["known_upstreams"] = pool_upstreams(self.config.pool)
        settings = SyncSettings(**({} if key_file is None else {"key_file": str(key_file)}))
        self.sync = ReplicaSync(
            name,
            self.config.profiles,
            self.lifecycle.inflight,
            self.remote,
            self.metrics,
            settings,
            redis,
            critical_rates=self.lifecycle.admission.own_critical_rates,
            waiting=self.lifecycle.admission.own_waiting,
            **extra,
        )
        self.lifecycle.admission.peer_critical_rate = self.remote.critical_rate  # as server/app.py
        self.lifecycle.admission.peer_waiting = self.remote.waiting
        self.lifecycle.admission.on_queue_change = self.sync.news

    def route(self, q: int = 0) -> Decision:
        return self.lifecycle.route(HEAD, body(q))

    def ttft(self) -> PredictedTtftScorer:
        scorer = self.config.profile.scorers[0][0]
        assert isinstance(scorer, PredictedTtftScorer)
        return scorer

    def prefix(self) -> PrefixAffinityScorer:
        scorer = self.config.profile.scorers[1][0]
        assert isinstance(scorer, PrefixAffinityScorer)
        return scorer

    def backlog(self, cluster: str) -> float:
        """Seconds of prefill predicted-ttft believes queued there (what admission and scores read)."""
        u = Upstream(cluster, cluster, None, 1.0)
        return self.ttft().backlog(u, self.lifecycle.state)[0]

    def rejected(self, reason: str) -> float:
        return (
            self.metrics.registry.get_sample_value("llm_extproc_sync_rejected_total", {"reason": reason}) or 0
        )

    def counted(self) -> dict[str, int]:
        return {c: self.lifecycle.state.count(c) for c in CLUSTERS}

    def upstream_labels(self) -> set[str]:
        return {
            s.labels["upstream"]
            for family in self.metrics.registry.collect()
            for s in family.samples
            if "upstream" in s.labels
        }


class Forger:
    """Messages as another replica (or an attacker on the channel) would publish them."""

    def __init__(self, origin: str = "x") -> None:
        self.origin = origin
        self.seq = 0

    def __call__(
        self,
        counts: dict[Any, Any] | None = None,
        updates: dict[Any, Any] | None = None,
        *,
        t: float | None = None,
        **extra: Any,
    ) -> bytes:
        self.seq += 1
        message = {
            "v": 1,
            "r": self.origin,
            "s": self.seq,
            "t": time.time() if t is None else t,
            "c": counts or {},
            "u": updates or {},
            **extra,
        }
        return bytes(msgpack.packb(message))


def pick(uid: str, when: float, prefill_s: float = 0.5, serial: int = 1) -> list[Any]:
    """A predicted-ttft pick record: serial, upstream, block hashes, output blocks, prefill, time, held."""
    return ["p", serial, uid, HASHES, 1, prefill_s, when, 0]


# -- one test per finding ---------------------------------------------------------------------------
def test_a_nan_time_in_a_record_does_not_stop_the_window_trim() -> None:
    """Was: `sent` is trimmed while its head is older than the window; NaN compares false, so one
    NaN record kept every later entry for good (1001 of 1001)."""
    b = Replica("b")
    now = time.time()
    old = now - SENT_WINDOW_S - 60  # past the window, still a believable record time
    records = [pick("c0", math.nan, serial=0), *(pick("c0", old, serial=i) for i in range(1, 1001))]
    assert b.sync.incoming(Forger()(updates={TTFT: records}))
    model = b.ttft().predictor._models["c0"]
    b.backlog("c0")  # reads the queue: trims the window
    assert len(model.sent) == 0
    assert math.isfinite(model.busy_until)
    assert b.rejected("time") == 1


@pytest.mark.parametrize("ahead_s", [1e6, math.inf, 60.0])
def test_a_future_time_does_not_make_an_upstream_look_busy(ahead_s: float) -> None:
    """Was: `busy_until = max(when, busy_until) + prefill`: a pick stamped in the future kept the
    upstream busy until then. Now: beyond the skew allowance (expire_s) it is dropped; within it, it
    counts as stamped now."""
    b = Replica("b")
    now = time.time()
    forge = Forger()
    records = [pick("c0", now + ahead_s, serial=1), pick("c0", now + 2.0, serial=2)]  # 2 s: clock skew
    assert b.sync.incoming(forge(updates={TTFT: records}))
    assert b.backlog("c0") <= 0.5 + 1e-6  # the in-skew pick's prefill only, from now
    assert b.rejected("time") == 1


def test_an_unknown_upstream_creates_no_state_and_no_metric_series() -> None:
    b = Replica("b", known=True)
    now = time.time()
    forge = Forger()
    message = forge(
        {"evil-0": 3, "c0": 2},
        {
            TTFT: [pick("evil-1", now), pick("c1", now, serial=2)],
            PREFIX: [["evil-2", HASHES], ["c1", HASHES]],
        },
    )
    assert b.sync.incoming(message)
    b.sync.sample()  # the per-upstream index gauge
    assert b.counted() == {"c0": 2, "c1": 0, "c2": 0, "c3": 0}
    assert b.remote.count("evil-0") == 0
    assert set(b.ttft().predictor._models) == {"c1"}
    assert set(b.prefix()._index) == {"c1"}
    assert b.upstream_labels() <= set(CLUSTERS)
    assert b.rejected("unknown_upstream") == 3
    # A state dump about upstreams this replica does not know: the same checks.
    a = Replica("a", known=True)
    a.prefix()._remember("c2", [HASHES[:8]])
    state = msgpack.unpackb(a.sync.state(), strict_map_key=False)
    state["p"][PREFIX]["evil-3"] = HASHES
    state["p"][TTFT] = {"evil-4": HASHES, "c3": HASHES}
    assert b.sync.load_state(msgpack.packb(state))
    assert set(b.prefix()._index) == {"c1", "c2"} and set(b.ttft().predictor._models) == {"c1", "c3"}
    assert b.rejected("unknown_upstream") == 5


def test_the_known_upstreams_are_the_pools_and_those_its_snapshots_name() -> None:
    from builders import NOW, instance_state

    from extproc.fleet import FleetView
    from extproc.server.sync import pool_upstreams

    raw = {"clusters": [{"name": "c0", "models": ["m"], "endpoints": ["10.0.0.1:8000"]}]}
    config = config_from_dict({"pool": raw, "routing": "endpoint", "metrics_listen": None})
    view = FleetView(config.pool, clock=lambda: NOW)
    known = pool_upstreams(config.pool, view)
    assert known() == {"c0/10.0.0.1:8000"}
    view.apply(instance_state("c0/10.0.0.2:8000", "c0", "10.0.0.2:8000"))
    view.apply(instance_state("c0/bare", "c0", None))  # no address: no endpoint to route to
    assert known() == {"c0/10.0.0.1:8000", "c0/10.0.0.2:8000"}
    cluster_mode = config_from_dict({"pool": raw, "metrics_listen": None})
    assert pool_upstreams(cluster_mode.pool, FleetView(cluster_mode.pool))() == {"c0"}


def test_without_a_known_pool_peers_add_at_most_max_upstreams_ids() -> None:
    """An embedder that passes no `known_upstreams` (the discrete-event mode) still bounds what
    peers can make it hold: the first MAX_UPSTREAMS well-formed ids, and no count map larger."""
    b = Replica("b")
    forge = Forger()
    now = time.time()
    for start in range(0, 10_000, 2_000):  # messages within max_message_bytes
        flood = [pick(f"evil-{i}", now, serial=i) for i in range(start, start + 2_000)]
        assert b.sync.incoming(forge(updates={TTFT: flood}))
    assert len(b.ttft().predictor._models) < 10_000
    from extproc.scheduling.sharing import MAX_UPSTREAMS

    assert len(b.ttft().predictor._models) == MAX_UPSTREAMS
    assert b.rejected("unknown_upstream") == 10_000 - MAX_UPSTREAMS
    assert not b.sync.incoming(forge({f"evil-{i}": 1 for i in range(MAX_UPSTREAMS + 1)}))
    assert b.rejected("too_many") == 1


def test_absurd_counts_are_rejected() -> None:
    """Was: any count up to 1e6 from any origin. Now: ints in [0, MAX_COUNT] for known upstreams,
    entry by entry; the rest of the message applies."""
    b = Replica("b")
    forge = Forger()
    assert b.sync.incoming(forge({"c0": 1_000_000, "c1": 5, "c2": -1, "c3": True}))
    assert b.counted() == {"c0": 0, "c1": 5, "c2": 0, "c3": 0}
    assert b.sync.incoming(forge({"c0": 2.5, "c1": MAX_COUNT}))
    assert b.counted() == {"c0": 0, "c1": MAX_COUNT, "c2": 0, "c3": 0}
    assert b.rejected("count") == 4  # 1e6, -1, a bool, a float
    assert MAX_COUNT < 1_000_000
    # More count entries than upstreams this replica knows: the message is dropped whole.
    c = Replica("c", known=True)
    assert not c.sync.incoming(Forger("y")({f"c{i % 4}{'x' * i}": 1 for i in range(5)}))
    assert c.rejected("too_many") == 1


def test_replicas_add_each_others_critical_arrival_rates() -> None:
    """Admission keeps places for the fleet's critical traffic, and each replica sees only its share
    of the arrivals: each publishes its own rate per model ("k") and adds the others' (before, three
    replicas each kept the places of a third of the critical requests)."""
    a, b = Replica("a"), Replica("b")
    for _ in range(20):
        a.lifecycle.admission._count_critical("m")
    own = a.lifecycle.admission.own_critical_rate("m")
    assert own > 0 and b.lifecycle.admission.critical_rate("m") == 0
    message = a.sync.outgoing(force=True)
    assert message is not None and msgpack.unpackb(message)["k"] == {"m": pytest.approx(own, rel=1e-3)}
    assert b.sync.incoming(message)
    assert b.lifecycle.admission.critical_rate("m") == pytest.approx(own, rel=1e-3)
    assert b.lifecycle.admission.own_critical_rate("m") == 0  # what b publishes is its own only
    b.lifecycle.admission._count_critical("m")
    assert b.lifecycle.admission.critical_rate("m") > own
    # A message without "k" says the replica has none now; a silent replica's rate expires with it.
    assert b.sync.incoming(Forger("a2")({"c0": 1}, k={"m": 3.0}))
    assert b.remote.critical_rate("m") == pytest.approx(own + 3.0, rel=1e-3)
    assert b.sync.incoming(Forger("a2")({"c0": 1}))
    assert b.remote.critical_rate("m") == pytest.approx(own, rel=1e-3)
    b.remote.forget("a")
    assert b.remote.critical_rate("m") == 0


def test_replicas_tell_each_other_of_standard_requests_waiting() -> None:
    """A sheddable request is shed while standard ones wait at any replica (lifecycle/admission.py):
    each publishes its waiters by model ("w"), at once when its queue changes."""
    a, b = Replica("a"), Replica("b")
    queue: dict[str, int] = {}
    a.sync.waiting = lambda: dict(queue)
    first = a.sync.outgoing(force=True)
    assert first is not None and "w" not in msgpack.unpackb(first)
    assert a.sync.outgoing() is None  # nothing new
    queue["m"] = 2
    message = a.sync.outgoing()  # a queue that changed is news, without any in-flight change
    assert message is not None and msgpack.unpackb(message)["w"] == {"m": 2}
    assert b.sync.incoming(first) and b.sync.incoming(message)
    assert b.lifecycle.admission.peer_waiting is not None
    assert b.lifecycle.admission.peer_waiting("m") == 2 and b.remote.waiting("other") == 0
    queue.clear()
    assert b.sync.incoming(a.sync.outgoing())  # type: ignore[arg-type]
    assert b.remote.waiting("m") == 0
    forge = Forger()
    assert b.sync.incoming(forge({"c0": 1}, w={"m": 4, "neg": -1, "f": 1.5, 7: 1, "big": MAX_COUNT + 1}))
    assert b.remote.waiting("m") == 4 and b.rejected("waiting") == 4
    assert b.sync.incoming(forge({"c0": 1}, w="lots")) and b.remote.waiting("m") == 0
    assert b.rejected("waiting") == 5
    assert b.sync.incoming(forge({"c0": 1}, w={"m": 6})) and b.remote.waiting("m") == 6
    b.remote.forget("x")  # a replica silent for expire_s: its waiters go with its counts
    assert b.remote.waiting("m") == 0


def test_bad_critical_rates_are_dropped_and_the_message_still_applies() -> None:
    b = Replica("b")
    forge = Forger()
    rates = {"ok": 2.0, "neg": -1.0, "nan": math.nan, 5: 1.0, "x" * 300: 1.0, "big": 1e9, "t": True}
    assert b.sync.incoming(forge({"c1": 3}, k=rates))
    assert b.remote.critical_rate("ok") == 2.0
    assert all(b.remote.critical_rate(m) == 0 for m in ("neg", "nan", "big", "t"))
    assert b.rejected("rate") == 6
    assert b.sync.incoming(forge({"c1": 4}, k=[1, 2]))  # not a map: the field goes, the counts apply
    assert b.counted()["c1"] == 4 and b.remote.critical_rate("ok") == 0
    assert b.rejected("rate") == 7
    assert b.sync.incoming(forge({"c1": 4}, k={f"m{i}": 1.0 for i in range(2000)}))  # too many
    assert b.remote.critical_rate("m1") == 0 and b.rejected("rate") == 8


@pytest.mark.parametrize("version", [2, None, "1", True])
def test_a_message_of_another_version_is_dropped(version: Any) -> None:
    b = Replica("b")
    message = msgpack.unpackb(Forger()({"c0": 3}))
    if version is None:
        del message["v"]  # a replica from before versioning
    else:
        message["v"] = version
    assert not b.sync.incoming(msgpack.packb(message))
    assert b.counted()["c0"] == 0
    assert b.rejected("version") == 1
    assert (
        b.metrics.registry.get_sample_value("llm_extproc_sync_messages_total", {"direction": "rejected"}) == 1
    )
    # What this replica sends carries the version.
    assert msgpack.unpackb(Replica("a").sync.outgoing(force=True) or b"\x80")["v"] == 1


@pytest.mark.parametrize(
    "t",
    [math.nan, math.inf, -math.inf, 60.0, -60.0, 1e18],
)
def test_a_message_stamped_far_from_now_is_dropped(t: float) -> None:
    """A message more than expire_s (3 s) from the receiver's clock: its counts would have expired."""
    b = Replica("b")
    sent_at = t if not math.isfinite(t) or abs(t) >= 1e9 else time.time() + t
    assert not b.sync.incoming(Forger()({"c0": 3}, t=sent_at))
    assert b.counted()["c0"] == 0 and b.rejected("time") == 1


def test_replays_and_a_flood_of_replica_ids_are_dropped() -> None:
    b = Replica("b")
    forge = Forger("a")
    first = forge({"c0": 1})
    assert b.sync.incoming(first) and b.sync.incoming(forge({"c0": 2}))
    assert not b.sync.incoming(first)  # an old message again: not a restart (no later time)
    assert b.counted()["c0"] == 2 and b.rejected("replay") == 1
    from extproc.fleet.accounting import MAX_ORIGINS

    for i in range(MAX_ORIGINS + 10):
        b.sync.incoming(Forger(f"r{i}")({"c1": 1}))
    assert len(b.remote.origins()) == MAX_ORIGINS
    assert b.rejected("origins") == 11  # "a" holds one of the places


def test_bad_records_are_skipped_one_by_one() -> None:
    b = Replica("b", known=True)
    now = time.time()
    records = [
        ["p", True, "c0", HASHES, 1, 0.5, now, 0],  # a bool is not a serial
        ["p", 1, "c0", HASHES, 1, math.nan, now, 0],
        ["p", 2, "c0", HASHES, 1, 0.5, "now", 0],
        ["f", 1.0],
        ["r", "extra"],
        {"p": 1},
        pick("c2", now, serial=3),  # the one good record still applies
    ]
    assert b.sync.incoming(
        Forger()(updates={TTFT: records, PREFIX: [["c0"], ["c0", b"short"]], "nope:x": []})
    )
    assert set(b.ttft().predictor._models) == {"c2"}
    assert b.rejected("record") == 7 and b.rejected("time") == 1 and b.rejected("unknown_plugin") == 1


class Broken(PrefixAffinityScorer):
    """A plugin whose decoding has a bug."""

    def apply_updates(self, origin: str, updates: list[Any]) -> None:
        raise ValueError("a decoding bug")


def test_a_failing_plugin_never_raises_out_of_incoming() -> None:
    """A check missed somewhere must not end the receive loop (follow_channel would reconnect and
    lose messages): counted as `error`."""
    b = Replica("b")
    b.sync.plugins[PREFIX] = Broken()
    assert not b.sync.incoming(Forger()(updates={PREFIX: [["c0", HASHES]]}))
    assert b.rejected("error") == 1
    assert b.sync.incoming(Forger("y")({"c1": 1}))  # the next message applies


# -- a shared key -----------------------------------------------------------------------------------
@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "sync.key"
    path.write_bytes(KEY + b"\n")
    return path


def test_with_a_key_only_signed_messages_and_dumps_apply(key_file: Path, tmp_path: Path) -> None:
    a, b = Replica("a", key_file=key_file), Replica("b", key_file=key_file)
    other_key = tmp_path / "other.key"
    other_key.write_bytes(b"another key, as long as the first")
    stranger, unsigned = Replica("s", key_file=other_key), Replica("u")
    for r in (a, stranger, unsigned):
        r.route()
    signed = a.sync.outgoing(force=True)
    assert signed is not None
    assert b.sync.incoming(signed)
    assert sum(b.counted().values()) == 1
    for bad in (
        unsigned.sync.outgoing(force=True),  # no signature
        stranger.sync.outgoing(force=True),  # another key
        signed[:-1] + bytes([signed[-1] ^ 1]),  # tampered signature
        Forger("a")({"c0": 99}) + signed[-32:],  # another message under a's signature
        signed[:-32],  # the signature cut off
        b"",
    ):
        assert not b.sync.incoming(bad)
    assert b.rejected("signature") == 6
    assert sum(b.counted().values()) == 1
    # State dumps are signed too, under another context: a message is not a dump, nor the reverse.
    assert b.sync.load_state(a.sync.state())
    assert not b.sync.load_state(unsigned.sync.state())
    assert not b.sync.load_state(signed)
    assert not b.sync.incoming(a.sync.state())
    assert b.rejected("signature") == 9
    # A replica without the key cannot read signed messages (the tag is trailing data).
    assert not unsigned.sync.incoming(a.sync.outgoing(force=True))


def test_the_sync_key_comes_from_a_file_or_the_environment(key_file: Path, tmp_path: Path) -> None:
    from extproc.server.sync import KEY_ENV, sync_key

    assert sync_key(SyncSettings(key_file=str(key_file)), env={}) == KEY  # the newline stripped
    assert sync_key(SyncSettings(), env={KEY_ENV: KEY.decode()}) == KEY
    assert sync_key(SyncSettings(), env={}) is None
    short = tmp_path / "short.key"
    short.write_bytes(b"tooshort")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        sync_key(SyncSettings(key_file=str(short)), env={})
    with pytest.raises(ConfigError, match="key_file"):
        sync_key(SyncSettings(key_file=str(tmp_path / "missing")), env={})
    pool = {"clusters": [{"name": "c0", "models": ["m"]}]}
    assert config_from_dict({"pool": pool, "sync": {"key_file": str(key_file)}}).sync.key_file == str(
        key_file
    )
    relative = config_from_dict({"pool": pool, "sync": {"key_file": "sync.key"}}, base_dir=tmp_path)
    assert relative.sync.key_file == str(key_file)  # to the config file's folder, as other files
    for bad in ({"key_file": 3}, {"key": "in the yaml"}):
        with pytest.raises(ConfigError, match="sync"):
            config_from_dict({"pool": pool, "sync": bad})


def test_peer_checks_alone_are_permissive_but_finite() -> None:
    """A plugin used without sync (tests, tools): any well-formed id, any finite time."""
    from extproc.scheduling.sharing import PeerChecks

    checks = PeerChecks()
    assert checks.upstream("c0") and not checks.upstream("") and not checks.upstream(3)
    assert checks.when(5.0) == 5.0 and checks.when(math.nan) is None and checks.when(True) is None


# -- through a real redis-server --------------------------------------------------------------------
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


async def until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


async def test_a_hostile_writer_on_every_key_and_the_channel_costs_no_request(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """For 2 s an attacker with access to the (unauthenticated) Redis publishes garbage and forged
    messages on the sync channel and overwrites every llm-extproc:* key: every request is routed,
    the receive loop never loses its connection, b's state stays sane and a's real decisions still
    arrive; then a late replica loads a real dump, not the forged ones stamped later."""
    from extproc.fleet.accounting import MAX_ORIGINS

    settings = RedisSettings(url=redis_server.url)
    fast = SyncSettings(interval_s=0.01, heartbeat_s=0.1, state_interval_s=0.2)
    a, b = Replica("a", known=True, redis=settings), Replica("b", known=True, redis=settings)
    for r in (a, b):
        r.sync.settings = fast
        r.sync.start()
        await asyncio.wait_for(r.sync.connected.wait(), 5)
    channel = b.sync.channel
    client = aioredis.from_url(redis_server.url)
    forge = Forger("a")  # posing as a, too

    def hostile() -> list[bytes]:
        t = time.time()
        return [
            b"\x00garbage" * 20,
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"v": 1, "r": "x", "s": 1, "t": math.nan, "c": {"c0": 9}, "u": {}}),
            forge({"c0": 1_000_000, "evil": 5}),
            forge(updates={TTFT: [pick("c1", t + 1e6), pick("c1", math.nan, serial=2)]}),
            forge(updates={TTFT: [pick("evil-up", t)], PREFIX: [["evil-up", HASHES]]}),
            msgpack.packb({"v": 2, "r": "y", "s": 1, "t": t, "c": {"c2": 50}, "u": {}}),
            Forger(f"id-{int(t * 1e6)}")({"c3": 100_000}),
        ]

    routed = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        for data in hostile():
            await client.publish(channel, data)
        async for key in client.scan_iter(match="llm-extproc:*"):
            await client.set(key, b"\xc1garbage", keepttl=True)
        for q in range(5):
            d = b.route(q)
            assert d.upstream.cluster in CLUSTERS
            b.lifecycle.finish(d, "response_end")
            routed += 1
        await asyncio.sleep(0.01)
    try:
        assert routed >= 50
        assert b.sync.connected.is_set() and "connection lost" not in caplog.text
        # Sane: counts only for known upstreams and bounded; no unknown upstream held; no upstream
        # made to look busy by a future or NaN time.
        assert set(b.remote._total) <= set(CLUSTERS)
        assert all(n <= MAX_COUNT * MAX_ORIGINS for n in b.remote._total.values())
        assert b.remote.count("c0") < 1_000_000
        assert set(b.ttft().predictor._models) <= set(CLUSTERS) and set(b.prefix()._index) <= set(CLUSTERS)
        assert all(b.backlog(c) < 60 for c in CLUSTERS)
        assert all(math.isfinite(m.busy_until) for m in b.ttft().predictor._models.values())
        for reason in ("undecodable", "version", "time", "count", "unknown_upstream"):
            assert b.rejected(reason) > 0, reason
        # a's real decisions still arrive.
        held = [a.route(q) for q in range(3)]
        assert await until(lambda: sum(b.remote._by_origin.get("a", {}).values()) == 3)
        for d in held:
            a.lifecycle.finish(d, "response_end")
        assert await until(lambda: not b.remote._by_origin.get("a"))

        # A late replica: forged dumps stamped later than the real ones (the future, NaN, another
        # version, a key of another type) lose to the freshest believable dump.
        future = {"v": 1, "r": "evil", "t": time.time() + 1e6, "p": {PREFIX: {"evil": HASHES}}}
        await client.set(b.sync.state_key("future"), msgpack.packb(future))
        await client.set(b.sync.state_key("nan"), msgpack.packb({**future, "t": math.nan}))
        await client.set(b.sync.state_key("v2"), msgpack.packb({**future, "v": 2, "t": time.time() + 1}))
        await client.rpush(b.sync.state_key("list"), b"x")
        await client.set(a.sync.state_key("a"), a.sync.state())
        late = Replica("late", known=True, redis=settings)
        late.sync.start()
        try:
            assert await until(lambda: late.sync.loaded_from is not None, timeout=5)
            assert late.sync.loaded_from in ("a", "b")
            assert "evil" not in late.prefix()._index
        finally:
            await late.sync.stop()
    finally:
        for r in (a, b):
            await r.sync.stop()
        await client.aclose()
