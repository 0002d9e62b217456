"""Replicas that act as one (server/sync.py): the message logic between in-process replicas (messages
handed over by hand, a fake clock), then two real services sharing through a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
import redis.asyncio as aioredis

from extproc.config import config_from_dict
from extproc.fleet import RemoteInFlight
from extproc.fleet import snapshot_pb2 as spb
from extproc.lifecycle import Decision, RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.prefix import PrefixAffinityScorer
from extproc.scheduling.sharing import MAX_OUTBOX, RESET
from extproc.server import start
from extproc.server.app import RunningService
from extproc.server.sync import ReplicaSync
from extproc.settings import ConfigError, SyncSettings
from extproc.telemetry import Metrics
from extproc_lab.discrete_event.simulation import simulate, tokenize_requests
from extproc_lab.stack import RedisProcess

HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions"},
    session_header="s",
    user_header="u",
    priority_header="p",
)
CLUSTERS = [f"c{i}" for i in range(4)]
TENANTS = {name: f"Tenant {name} system prompt, words of its own. " * 120 for name in "ABCDEFGH"}  # ~1.4k tok
BOTH = {"scorers": [{"name": "predicted-ttft"}, {"name": "prefix-affinity", "weight": 0.5}]}


def body(tenant: str, q: int) -> bytes:
    messages = [{"role": "system", "content": TENANTS[tenant]}, {"role": "user", "content": f"question {q}"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 100})


class Clock:
    """Wall time plus what a test adds to `t`: the sync clock and the lifecycle's (time.time(), no
    fleet view) agree, as in a service, where peers' record times are checked against it."""

    def __init__(self) -> None:
        self._start = time.time()
        self.t = self._start

    def __call__(self) -> float:
        return self.t + (time.time() - self._start)


class Replica:
    """One service's lifecycle (static pool, so the configured profile decides) and its sync logic."""

    def __init__(self, name: str, clock: Clock, seed: int, **sync: Any) -> None:
        profile = {**BOTH, "picker": {"name": "max-score", "params": {"seed": seed}}}
        self.config = config_from_dict(
            {
                "pool": {"clusters": [{"name": c, "models": ["m"]} for c in CLUSTERS]},
                "metrics_listen": None,
                "scheduling": {"profiles": {"default": profile}},
            }
        )
        self.metrics = Metrics(["m"], CLUSTERS)
        self.lifecycle = RequestLifecycle(self.config, self.metrics)
        self.remote = RemoteInFlight(3.0, clock=clock)
        self.lifecycle.state.share(self.remote)
        settings = SyncSettings(**sync)
        self.sync = ReplicaSync(
            name,
            self.config.profiles,
            self.lifecycle.inflight,
            self.remote,
            self.metrics,
            settings,
            clock=clock,
        )

    def route(self, tenant: str, q: int = 0) -> Decision:
        return self.lifecycle.route(HEAD, body(tenant, q))

    def ttft(self) -> PredictedTtftScorer:
        scorer = self.config.profile.scorers[0][0]
        assert isinstance(scorer, PredictedTtftScorer)
        return scorer

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def send(src: Replica, *dsts: Replica) -> None:
    data = src.sync.outgoing(force=True)
    assert data is not None
    for d in dsts:
        assert d.sync.incoming(data)


def pinned(r: Replica) -> int:
    return sum(m.cache.pinned_blocks for m in r.ttft().predictor._models.values())


# -- the message logic ------------------------------------------------------------------------------
def test_a_decision_on_one_replica_steers_the_other() -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1), Replica("b", clock, seed=2)
    homes = {}
    for t in TENANTS:
        d = a.route(t)
        homes[t] = d.upstream.cluster
        a.lifecycle.finish(d, "response_end")
    send(a, b)
    on_b = {}
    for t in TENANTS:
        d = b.route(t, q=1)
        on_b[t] = d.upstream.cluster
        b.lifecycle.finish(d, "response_end")
    assert on_b == homes
    # The control: a replica that heard nothing places the same tenants elsewhere (by its own seed).
    alone = Replica("c", clock, seed=2)
    assert {t: alone.route(t, q=1).upstream.cluster for t in TENANTS} != homes


def test_agreement_is_one_when_shared_and_low_when_not() -> None:
    """The sketch that follows each state dump: a replica that applied the other's decisions agrees
    with it (1.0 for both plugins); one that heard nothing and routed prompts of its own does not."""
    clock = Clock()
    a, b, c = Replica("a", clock, seed=1), Replica("b", clock, seed=2), Replica("c", clock, seed=3)
    for q, t in enumerate(TENANTS):
        a.lifecycle.finish(a.route(t), "response_end")
        text = f"Prompt {q} of c alone. " * 300
        other = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
        c.lifecycle.finish(c.lifecycle.route(HEAD, other), "response_end")  # its own prompts, unshared
    send(a, b)
    a.sync.state(), b.sync.state(), c.sync.state()  # each refreshes its sketch
    send(a, b, c)  # the next message carries a's sketch
    for key in b.sync.plugins:
        assert b.sample("llm_extproc_sync_agreement", plugin=key) == 1.0
        assert c.sample("llm_extproc_sync_agreement", plugin=key) < 0.7
    # Sent once per state dump, not with every message.
    send(a, b)
    assert "a" not in msgpack.unpackb(a.sync.outgoing(force=True) or b"\x80")


def test_remote_in_flight_counts_and_pins_follow_the_origin_and_expire() -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1), Replica("b", clock, seed=2)
    held = [a.route(t) for t in "ABCD"]
    send(a, b)
    by_cluster = Counter(d.upstream.cluster for d in held)
    for cluster, n in by_cluster.items():
        assert b.lifecycle.state.count(cluster) == n
        assert b.lifecycle.inflight.count(cluster) == 0  # its own count is untouched
    assert pinned(b) > 0
    # Two finish; the next message carries the full counts and the finishes.
    for d in held[:2]:
        a.lifecycle.finish(d, "response_end")
    send(a, b)
    assert sum(b.lifecycle.state.count(c) for c in CLUSTERS) == 2
    # Replica a goes silent (killed): its counts and pins vanish after expire_s, its blocks stay cached.
    clock.t += 2.0
    assert b.sync.expire() == []
    clock.t += 1.5
    assert b.sync.expire() == ["a"]
    assert sum(b.lifecycle.state.count(c) for c in CLUSTERS) == 0
    assert pinned(b) == 0
    assert sum(m.cache.used_blocks for m in b.ttft().predictor._models.values()) > 0


def test_a_lost_message_releases_the_origins_pins() -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1), Replica("b", clock, seed=2)
    d = a.route("A")
    send(a, b)
    assert pinned(b) > 0
    a.lifecycle.finish(d, "response_end")
    assert a.sync.outgoing(force=True) is not None  # the message with the finish is lost
    a.route("B")  # still in flight on a
    send(a, b)  # b sees the sequence skip: a's pins released, then the new pick pinned
    assert b.sample("llm_extproc_sync_messages_total", direction="gap") == 1
    assert pinned(b) == pinned(a)


def test_a_late_replica_starts_from_the_freshest_state() -> None:
    clock = Clock()
    a = Replica("a", clock, seed=1)
    homes = {}
    for t in TENANTS:
        d = a.route(t)
        homes[t] = d.upstream.cluster
        a.lifecycle.finish(d, "response_end")
    late = Replica("late", clock, seed=7)
    assert late.sync.load_state(a.sync.state())
    assert late.sync.loaded_from == "a"
    assert {t: late.route(t, q=3).upstream.cluster for t in TENANTS} == homes
    prefix = late.config.profile.scorers[1][0]
    assert isinstance(prefix, PrefixAffinityScorer) and sum(prefix.index_sizes().values()) > 0


def test_the_update_budget_drops_and_peers_release() -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1, max_updates_per_s=3), Replica("b", clock, seed=2)
    for t in TENANTS:
        a.route(t)  # 8 picks, all in flight
    data = a.sync.outgoing()
    assert data is not None
    message = msgpack.unpackb(data, strict_map_key=False)
    ttft_records = message["u"]["default/0:predicted-ttft"]
    assert len(ttft_records) == 4 and ttft_records[-1] == [RESET]
    assert a.sample("llm_extproc_sync_updates_dropped_total") > 0
    b.sync.incoming(data)
    assert pinned(b) == 0  # what a pinned and b may never see finish is not held
    assert sum(b.lifecycle.state.count(c) for c in CLUSTERS) == 8  # counts are exact regardless


def test_an_oversized_message_carries_counts_and_resets_only() -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1, max_message_bytes=200), Replica("b", clock, seed=2)
    a.route("A")
    data = a.sync.outgoing()
    assert data is not None and len(data) <= 200
    assert b.sync.incoming(data)
    assert pinned(b) == 0 and sum(b.lifecycle.state.count(c) for c in CLUSTERS) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"\x00garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"r": "x", "s": "1", "t": 0, "c": {}, "u": {}}),
        msgpack.packb(
            {
                "r": "x",
                "s": 1,
                "t": 0.0,
                "c": {"c0": "many", 3: 1},
                "u": {
                    "default/0:predicted-ttft": [
                        ["p", 1, "c0", b"123", 1, 0.1, 0.0],  # hashes not a multiple of 8 bytes
                        ["p", 2, "c0", b"12345678", 1, -5.0, 0.0],  # negative prefill
                        ["f", [1]],
                        "junk",
                        [],
                    ],
                    "no/such:plugin": [1],
                    7: [],
                },
            }
        ),
        b"x" * (600 * 1024),
    ],
)
def test_malformed_messages_never_raise(data: bytes) -> None:
    clock = Clock()
    b = Replica("b", clock, seed=2)
    b.sync.incoming(data)
    assert pinned(b) == 0
    assert sum(b.lifecycle.state.count(c) for c in CLUSTERS) == 0
    assert b.route("A").upstream.cluster in CLUSTERS


@pytest.mark.parametrize(
    "sketch",
    [
        "junk",
        {"default/0:predicted-ttft": "junk"},
        {"default/0:predicted-ttft": {"c0": "junk", 7: [b"x"], "c1": [1, None, b"12345678"]}},
        {"no/such:plugin": {"c0": [b"12345678"]}},
    ],
)
def test_a_malformed_agreement_sketch_is_ignored(sketch: Any) -> None:
    clock = Clock()
    a, b = Replica("a", clock, seed=1), Replica("b", clock, seed=2)
    b.lifecycle.finish(b.route("A"), "response_end")
    b.sync.state()  # b has a sketch of its own to compare with
    data = msgpack.unpackb(a.sync.outgoing(force=True))
    assert b.sync.incoming(msgpack.packb({**data, "a": sketch}))  # the rest of the message applies
    for key in b.sync.plugins:
        value = b.sample("llm_extproc_sync_agreement", plugin=key)
        assert 0.0 <= value <= 1.0
    assert b.route("B").upstream.cluster in CLUSTERS


def test_own_messages_are_ignored_and_nothing_is_recorded_without_a_consumer() -> None:
    clock = Clock()
    a = Replica("a", clock, seed=1)
    a.route("A")
    data = a.sync.outgoing()
    assert data is not None and not a.sync.incoming(data)
    assert sum(a.lifecycle.state.count(c) for c in CLUSTERS) == 1  # not counted twice
    lone = PredictedTtftScorer()
    assert not lone.predictor._outbox.active  # no sync: on_pick records nothing, nothing grows
    assert MAX_OUTBOX > 0


def test_pending_counts_only_growth_since_the_snapshot_fleet_wide() -> None:
    from builders import NOW, instance_state

    from extproc.fleet import FleetView, InFlight, SchedulingState, Upstream

    config = config_from_dict(
        {"pool": {"clusters": [{"name": "c0", "models": ["m"]}]}, "metrics_listen": None}
    )
    view = FleetView(config.pool, clock=lambda: NOW)
    inflight = InFlight()
    remote = RemoteInFlight(3.0, clock=lambda: NOW)
    state = SchedulingState(inflight, view)
    state.share(remote)
    remote.update("other", {"c0": 5})  # sent by another replica before the engine's snapshot
    view.apply(instance_state("c0/10.0.0.1:8000", "c0", "10.0.0.1:8000", num_running=5))
    view.rebuild()
    assert state.count("c0") == 5 and state.pending("c0") == 0  # the snapshot includes them
    remote.update("other", {"c0": 7})
    inflight.acquire(Upstream(id="c0", cluster="c0", address=None, weight=1.0))
    assert state.count("c0") == 8 and state.pending("c0") == 3


def test_sync_config() -> None:
    pool = {"clusters": [{"name": "c0", "models": ["m"]}]}
    assert config_from_dict({"pool": pool}).sync == SyncSettings()
    cfg = config_from_dict({"pool": pool, "sync": {"enabled": False, "interval_s": 0.05}})
    assert not cfg.sync.enabled and cfg.sync.interval_s == 0.05
    for bad in (
        {"interval_s": 0},
        {"enabled": "yes"},
        {"expire_s": 0.1},
        {"nope": 1},
        {"max_message_bytes": 0},
    ):
        with pytest.raises(ConfigError, match="sync"):
            config_from_dict({"pool": pool, "sync": bad})


# -- the discrete-event mode ------------------------------------------------------------------------
def test_des_replicas_share_what_they_learn() -> None:
    from extproc_lab.bench.report import summarize
    from extproc_lab.bench.workloads import make_workload
    from extproc_lab.engines.profiles import PROFILES

    wl = make_workload("multi-turn", rate=4.0, count=240, seed=0, conversations=24)
    reqs = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    tokens = tokenize_requests(reqs)
    fleet = [PROFILES["a10g-llama3-8b"]] * 4
    hit = {}
    for label, kw in (("one", {}), ("shared", {"replicas": 4}), ("alone", {"replicas": 4, "share": False})):
        run = simulate(reqs, fleet, "llm-extproc", tokens=tokens, **kw)
        hit[label] = summarize(label, run.records, run.virtual_s).prefix_cache_hit_rate or 0.0
    assert hit["shared"] >= hit["one"] - 0.05, hit
    assert hit["alone"] < hit["shared"] - 0.1, hit


# -- two real services through a real redis-server --------------------------------------------------
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


def service_config(url: str) -> dict[str, Any]:
    return {
        "pool": {"clusters": [{"name": c, "models": ["m"]} for c in CLUSTERS]},
        "listen": "127.0.0.1:0",
        "metrics_listen": None,
        "release_on": "stream_end",
        "fleet": {"url": url},
        "scheduling": {"profiles": {"default": BOTH}},
        "sync": {"interval_s": 0.01, "heartbeat_s": 0.1, "expire_s": 0.6, "state_interval_s": 0.2},
    }


async def put_snapshots(url: str, password: str | None = None) -> None:
    client = aioredis.from_url(url, password=password)
    for i, c in enumerate(CLUSTERS):
        snap = spb.UpstreamSnapshot(
            upstream_id=f"{c}/127.0.0.1:{9000 + i}",
            cluster=c,
            address=f"127.0.0.1:{9000 + i}",
            engine="vllm",
            models=["m"],
            readiness=spb.READY,
            kv_blocks_total=4000,
            block_size=16,
            publisher_id="test",
            sequence=1,
            published_at_ms=int(time.time() * 1000),
            ttl_ms=120_000,
        )
        await client.set(f"llm-extproc:default:snap:{snap.upstream_id}", snap.SerializeToString(), px=120_000)
    await client.aclose()


async def until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


@pytest.fixture
async def services(redis_server: RedisProcess) -> AsyncIterator[list[RunningService]]:
    await put_snapshots(redis_server.url)
    started: list[RunningService] = []
    for _ in range(2):
        running = await start(config_from_dict(service_config(redis_server.url)))
        started.append(running)
    yield started
    for running in started:
        if running.phase != "stopped":
            await running.stop(0)


def total(running: RunningService) -> int:
    return sum(running.lifecycle.state.count(c) for c in CLUSTERS)


async def test_two_services_route_as_one_through_redis(services: list[RunningService]) -> None:
    a, b = services
    for s in services:
        assert s.sync is not None
        assert await until(lambda s=s: s.lifecycle.view.candidates("m"))  # type: ignore[union-attr]
    homes: dict[str, str] = {}
    held = []
    for t in TENANTS:
        d = a.lifecycle.route(HEAD, body(t, 0))
        homes[t] = d.upstream.cluster
        held.append(d)
    assert len(set(homes.values())) > 1
    # b hears a's decisions and counts within a few sync intervals...
    assert await until(lambda: total(b) == len(TENANTS))
    assert b.lifecycle.inflight.total() == 0
    # ...and sends the same tenants where a sent them.
    for t in TENANTS:
        d = b.lifecycle.route(HEAD, body(t, 1))
        assert d.upstream.cluster == homes[t], t
        b.lifecycle.finish(d, "response_end")
    assert b.metrics.registry.get_sample_value("llm_extproc_sync_messages_total", {"direction": "received"})
    # a is killed with requests in flight: b drops its counts once a has been silent for expire_s.
    assert a.sync is not None
    await a.sync.stop()  # what b sees of a kill -9: silence
    assert total(b) == len(TENANTS)
    assert await until(lambda: total(b) == 0, timeout=5.0)
    assert b.metrics.registry.get_sample_value("llm_extproc_sync_remote_replicas") == 0


async def test_two_services_share_critical_rates_and_standard_waiters(services: list[RunningService]) -> None:
    """Through a real Redis, as server/app.py wires them: a replica's critical arrivals count in the
    other's places kept, and its standard waiters make the other shed sheddable requests."""
    from builders import chat_request

    a, b = services
    for _ in range(10):
        a.lifecycle.admission._count_critical("m")
    assert await until(lambda: b.lifecycle.admission.critical_rate("m") > 0)
    assert b.lifecycle.admission.own_critical_rate("m") == 0
    waiter = chat_request(user="u1")  # standard
    assert a.sync is not None and a.lifecycle.admission.on_queue_change == a.sync.news  # at once
    queued = a.lifecycle.admission.enqueue(waiter, lambda err: None)
    peer_waiting = b.lifecycle.admission.peer_waiting
    assert peer_waiting is not None
    assert await until(lambda: peer_waiting("m") == 1)
    a.lifecycle.admission.abandon(queued)
    assert await until(lambda: peer_waiting("m") == 0)


async def test_a_late_service_loads_the_shared_state(redis_server: RedisProcess) -> None:
    await put_snapshots(redis_server.url)
    first = await start(config_from_dict(service_config(redis_server.url)))
    late: RunningService | None = None
    try:
        assert await until(lambda: first.lifecycle.view.candidates("m"))  # type: ignore[union-attr]
        homes = {}
        for t in TENANTS:
            d = first.lifecycle.route(HEAD, body(t, 0))
            homes[t] = d.upstream.cluster
            first.lifecycle.finish(d, "response_end")
        client = aioredis.from_url(redis_server.url)
        assert first.sync is not None
        key = first.sync.state_key(first.sync.replica)

        async def written_after_routing() -> bool:  # the first dump (empty) is written at start
            blob = await client.get(key)
            dumps = msgpack.unpackb(blob, strict_map_key=False)["p"] if blob else {}
            return bool(dumps.get("default/0:predicted-ttft"))

        assert await until_async(written_after_routing)
        await client.aclose()
        late = await start(config_from_dict(service_config(redis_server.url)))
        assert late.sync is not None
        assert await until(lambda: late.sync.loaded_from == first.sync.replica)  # type: ignore[union-attr]
        assert await until(lambda: late.lifecycle.view.candidates("m"))  # type: ignore[union-attr]
        await first.stop(0)  # nothing more comes from it: the late replica routes on the loaded state
        assert {t: late.lifecycle.route(HEAD, body(t, 2)).upstream.cluster for t in TENANTS} == homes
    finally:
        for s in (first, late):
            if s is not None and s.phase != "stopped":
                await s.stop(0)


async def until_async(probe: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await probe():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_redis_down_routes_on_the_local_view(
    services: list[RunningService], redis_server: RedisProcess
) -> None:
    a, _ = services
    assert await until(lambda: a.lifecycle.view.candidates("m"))  # type: ignore[union-attr]
    redis_server.stop()
    for q in range(20):
        d = a.lifecycle.route(HEAD, body("A", q))
        assert d.upstream.cluster in CLUSTERS
        a.lifecycle.finish(d, "response_end")
    samples = a.metrics.registry.get_sample_value
    assert await until(lambda: (samples("llm_extproc_sync_messages_total", {"direction": "failed"}) or 0) > 0)


def test_a_stalled_sync_loop_bounds_the_outbox_with_a_reset() -> None:
    from extproc.scheduling.sharing import Outbox

    box = Outbox()
    box.add(["p"])
    assert box.take() == []  # nothing recorded before the first take
    for i in range(MAX_OUTBOX + 5):
        box.add(["f", i])
    records = box.take()
    assert records[0] == [RESET] and len(records) == 6 and box.dropped == MAX_OUTBOX
    assert records[-1] == ["f", MAX_OUTBOX + 4]


def test_the_replicas_bench_writes_json_and_markdown(tmp_path: Path) -> None:
    import json

    from extproc_lab.discrete_event import replicas

    assert (
        replicas.main(
            ["--scenarios", "chats", "--count-scale", "0.03", "--engines", "2", "--out", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "replicas.json").read_text())
    assert [r["setup"] for r in result["rows"]] == ["1 replica", "4 shared", "4 alone"]
    assert all(r["report"]["ok"] == r["report"]["requests"] for r in result["rows"])
    assert {v["setup"] for v in result["verdicts"]} == {"4 shared", "4 alone"}
    assert "| des | chats | 4 shared |" in (tmp_path / "replicas.md").read_text()


async def test_stop_ends_the_loops_while_news_keeps_coming(redis_server: RedisProcess) -> None:
    from extproc.settings import RedisSettings

    r = Replica("a", Clock(), seed=1, interval_s=0.001, heartbeat_s=0.01)
    sync = ReplicaSync(
        "a",
        r.config.profiles,
        r.lifecycle.inflight,
        r.remote,
        r.metrics,
        r.sync.settings,
        RedisSettings(url=redis_server.url),
    )
    sync.start()
    await asyncio.wait_for(sync.connected.wait(), 5)
    busy = True

    async def news() -> None:  # a pick and a finish at every turn of the loop, as under load
        while busy:
            r.lifecycle.finish(r.route("A"), "response_end")
            await asyncio.sleep(0)

    spam = asyncio.create_task(news())
    await asyncio.sleep(0.2)
    for _ in range(20):  # each stop may land on a wake-up: none may hang
        await asyncio.wait_for(sync.stop(), 5)
        sync.start()
        await asyncio.sleep(0.01)
    busy = False
    await spam
    await asyncio.wait_for(sync.stop(), 5)
    assert (
        r.metrics.registry.get_sample_value("llm_extproc_sync_messages_total", {"direction": "sent"}) or 0
    ) > 0


def test_live_agreement_samples_are_summarised_after_the_warm_up() -> None:
    from extproc_lab.discrete_event.replicas import AGREEMENT_WARMUP_S, agreement_summary

    w = AGREEMENT_WARMUP_S
    samples = [
        (w - 1, 0, "predicted-ttft", 0.1),  # warm-up: left out
        (w + 1, 0, "predicted-ttft", 0.9),
        (w + 2, 1, "predicted-ttft", 0.7),
        (w + 3, 1, "prefix-affinity", 1.0),
    ]
    summary = agreement_summary(samples)
    assert summary is not None
    assert summary["predicted-ttft"] == pytest.approx({"mean": 0.8, "min": 0.7, "samples": 2.0})
    assert summary["prefix-affinity"] == {"mean": 1.0, "min": 1.0, "samples": 1.0}
    assert agreement_summary(samples[:1]) is None


async def test_the_agreement_sampler_reads_each_replicas_gauges(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc_lab.bench import scenarios

    monkeypatch.setattr(scenarios, "AGREEMENT_EVERY_S", 0.01)

    class Gateway:
        def metrics(self, replica: int = 0) -> dict[str, float]:
            if replica == 1:
                raise OSError("not answering")  # skipped, the sampler goes on
            return {
                'llm_extproc_sync_agreement{plugin="predicted-ttft"}': 0.5,
                'llm_extproc_requests_total{model="m"}': 3.0,
            }

    out: list[tuple[float, int, str, float]] = []
    task = asyncio.create_task(scenarios._sample_agreement(Gateway(), 2, out))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(out) >= 2
    assert {(r, p, v) for _, r, p, v in out} == {(0, "predicted-ttft", 0.5)}
