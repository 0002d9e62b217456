"""The fleet feed against a real redis-server: load at start, follow pub/sub, survive hostile data,
outages and restarts. No Envoy here; the request path is exercised through RequestLifecycle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from extproc.config import config_from_dict
from extproc.fleet import FleetView
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.redis_feed import RedisFeed, follow_channel
from extproc.lifecycle import RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.settings import RedisSettings
from extproc.telemetry import Metrics
from extproc_lab.stack import RedisProcess

POOL = {"clusters": [{"name": "gpu-a", "models": ["m"]}, {"name": "gpu-b", "models": ["m"]}]}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


def snapshot(
    upstream_id: str = "gpu-a/127.0.0.1:8001",
    cluster: str = "gpu-a",
    *,
    seq: int = 1,
    waiting: int = 0,
    ttl_ms: int = 2000,
    readiness: int = spb.READY,
    published: float | None = None,
    **fields: object,
) -> spb.UpstreamSnapshot:
    return spb.UpstreamSnapshot(
        upstream_id=upstream_id,
        cluster=cluster,
        address=upstream_id.partition("/")[2],
        engine="vllm",
        models=["m"],
        readiness=readiness,
        num_waiting=waiting,
        publisher_id="test",
        sequence=seq,
        published_at_ms=int((published or time.time()) * 1000),
        ttl_ms=ttl_ms,
        **fields,  # type: ignore[arg-type]
    )


class Harness:
    def __init__(self, url: str, resync: float = 5.0) -> None:
        self.config = config_from_dict(
            {
                "pool": POOL,
                "metrics_listen": None,
                "fleet": {"url": url, "resync_interval_s": resync},
                # These tests hold dozens of requests to see routing follow the engines' queues; with
                # admission on, the queues past its limits would be shed (tests/test_admission.py).
                "admission": {"enabled": False},
            }
        )
        assert self.config.fleet is not None
        self.settings: RedisSettings = self.config.fleet
        self.metrics = Metrics(["m"], ["gpu-a", "gpu-b"])
        self.view = FleetView(self.config.pool)
        self.feed = RedisFeed(self.settings, self.view, self.metrics)
        self.lifecycle = RequestLifecycle(self.config, self.metrics, self.view)
        self.client = aioredis.from_url(url)

    async def put(
        self, snap: spb.UpstreamSnapshot | bytes, *, key: str | None = None, publish: bool = True
    ) -> None:
        data = snap if isinstance(snap, bytes) else snap.SerializeToString()
        k = key or self.settings.key(snap.upstream_id if not isinstance(snap, bytes) else "raw")
        await self.client.set(k, data, px=5000)
        if publish:
            await self.client.publish(self.settings.channel, data)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def route_cluster(self, hold: bool = False) -> str:
        head = parse_head(
            {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
            session_header="x-session-id",
            user_header="x-user-id",
            priority_header="x-llm-priority",
        )
        d = self.lifecycle.route(head, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
        if not hold:
            d.lease.release()
        return d.upstream.cluster


@pytest.fixture
async def harness(redis_server: RedisProcess) -> AsyncIterator[Harness]:
    h = Harness(redis_server.url)
    yield h
    await h.feed.stop()
    await h.client.aclose()


async def until(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


async def test_loads_existing_keys_then_follows_the_channel(harness: Harness) -> None:
    await harness.put(snapshot(waiting=7), publish=False)  # present before the service starts
    harness.feed.start()
    assert await until(lambda: harness.view.load("gpu-a") is not None)
    assert harness.view.load("gpu-a").num_waiting == 7  # type: ignore[union-attr]
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", waiting=1))
    assert await until(lambda: harness.view.load("gpu-b") is not None)
    await harness.put(snapshot(seq=2, waiting=30))
    assert await until(lambda: harness.view.load("gpu-a").num_waiting == 30)  # type: ignore[union-attr]
    # Older sequences from the same publisher are ignored (replays, reordering).
    await harness.put(snapshot(seq=1, waiting=50))
    await asyncio.sleep(0.2)
    assert harness.view.load("gpu-a").num_waiting == 30  # type: ignore[union-attr]
    assert harness.sample("llm_extproc_snapshots_total", outcome="outdated", reason="") >= 1
    assert harness.sample("llm_extproc_redis_connected") == 1
    # Routing now follows the engines' queues: gpu-b has the shorter one...
    assert {harness.route_cluster() for _ in range(10)} == {"gpu-b"}
    # ...and requests this process has in flight since that snapshot count too: a burst spreads out.
    burst = [harness.route_cluster(hold=True) for _ in range(40)]
    assert 25 <= burst.count("gpu-b") <= 35, burst  # gpu-b: 1 queued; gpu-a: 30 queued


HOSTILE = [
    ("garbage", b"\xff\x00not a protobuf\x13\x37" * 10, "undecodable"),
    ("huge", b"\x0a" + b"\xff" * 70_000, "too_large"),
    ("unknown cluster", snapshot("evil/127.0.0.1:9", "evil").SerializeToString(), "unknown_cluster"),
    ("negative queue wrapped", snapshot(waiting=2**32 - 5).SerializeToString(), "bad_load"),
    ("nan kv", snapshot(kv_cache_usage=float("nan")).SerializeToString(), "bad_load"),
    ("kv above 1", snapshot(kv_cache_usage=7.0).SerializeToString(), "bad_load"),
    ("bad address", snapshot("gpu-a/not-an-ip:80").SerializeToString(), "bad_address"),
    ("far future", snapshot(published=time.time() + 3600).SerializeToString(), "bad_timestamp"),
    ("bad ttl", snapshot(ttl_ms=0).SerializeToString(), "bad_ttl"),
    ("bad id", snapshot("").SerializeToString(), "bad_id"),
    ("negative weight", snapshot(capacity_weight=-2.0).SerializeToString(), "bad_weight"),
]


@pytest.mark.parametrize(("name", "data", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_data_is_rejected_and_counted(
    harness: Harness, name: str, data: bytes, reason: str
) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", waiting=0))
    await harness.put(data, key=harness.settings.key(f"hostile-{name}"))
    assert await until(
        lambda: harness.sample("llm_extproc_snapshots_total", outcome="rejected", reason=reason) >= 1
    )
    await asyncio.sleep(0.1)
    # Nothing hostile entered the view; routing still works on the good snapshot.
    assert set(harness.view.instances()) == {"gpu-b/127.0.0.1:8002"}
    assert harness.route_cluster() == "gpu-b"


async def test_wrong_type_key_does_not_break_resync(harness: Harness) -> None:
    await harness.client.rpush(harness.settings.key("a-list"), b"x")  # MGET returns nil for it
    await harness.put(snapshot(), publish=False)
    harness.feed.start()
    assert await until(lambda: harness.view.load("gpu-a") is not None)


async def test_stale_snapshots_fall_back_to_weighted_round_robin(harness: Harness) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(ttl_ms=300, waiting=0))
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", ttl_ms=300, waiting=40))
    assert await until(lambda: harness.view.load("gpu-b") is not None)
    assert {harness.route_cluster() for _ in range(6)} == {"gpu-a"}
    assert await until(lambda: harness.view.candidates("m") is None, timeout=5)  # both expired
    picks = [harness.route_cluster() for _ in range(6)]
    assert sorted(picks) == ["gpu-a"] * 3 + ["gpu-b"] * 3  # equal weights: strict alternation
    assert harness.sample("llm_extproc_fallbacks_total", reason="no_fresh_snapshot") == 6


async def test_not_ready_instances_receive_nothing(harness: Harness) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(waiting=30))
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", readiness=spb.WARMING_UP))
    assert await until(lambda: harness.view.counts["fresh_not_ready"] == 1)
    assert {harness.route_cluster() for _ in range(10)} == {"gpu-a"}  # busy, but the only ready one
    await harness.put(snapshot(seq=2, readiness=spb.DRAINING))
    assert await until(lambda: harness.view.candidates("m") == ())
    from extproc.openai import RequestError

    with pytest.raises(RequestError) as err:
        harness.route_cluster()
    assert err.value.status == 503


async def test_redis_outage_and_recovery(redis_server: RedisProcess, harness: Harness) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(ttl_ms=1500))
    assert await until(lambda: harness.view.load("gpu-a") is not None)
    redis_server.stop()
    assert await until(lambda: harness.sample("llm_extproc_redis_connected") == 0)
    # Requests keep being decided from memory while Redis is away (latency: see bench-fleet)...
    assert harness.route_cluster() == "gpu-a"
    # ...and fall back once the last snapshot is stale.
    assert await until(lambda: harness.view.candidates("m") is None, timeout=5)
    harness.route_cluster()
    assert harness.sample("llm_extproc_fallbacks_total", reason="no_fresh_snapshot") >= 1
    redis_server.start()  # same port
    await harness.client.aclose()
    harness.client = aioredis.from_url(redis_server.url)
    await harness.put(snapshot(seq=5, waiting=2))
    assert await until(lambda: harness.view.load("gpu-a") is not None, timeout=15)
    assert harness.sample("llm_extproc_redis_connected") == 1
    assert harness.sample("llm_extproc_redis_reconnects_total") >= 1


@pytest.mark.integration
async def test_password_protected_redis(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path / "redis-auth.log", password="s3cret").start()
    try:
        h = Harness(f"redis://127.0.0.1:{server.port}/0")
        h.settings.password = "s3cret"
        h.client = aioredis.from_url(server.url)
        await h.put(snapshot(), publish=False)
        h.feed.start()
        assert await until(lambda: h.view.load("gpu-a") is not None)
        await h.feed.stop()
        await h.client.aclose()
    finally:
        server.stop()


async def test_a_down_instance_never_hides_the_others(harness: Harness) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(waiting=5))
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", waiting=0))
    assert await until(lambda: harness.view.counts["fresh_ready"] == 2)
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", seq=2, readiness=spb.DOWN))
    assert await until(lambda: harness.view.counts["fresh_not_ready"] == 1)
    assert {harness.route_cluster() for _ in range(10)} == {"gpu-a"}
    await harness.client.delete(harness.settings.key("gpu-b/127.0.0.1:8002"))
    await harness.feed.resync(harness.client)  # a resync that finds the DOWN key gone changes nothing
    assert {harness.route_cluster() for _ in range(5)} == {"gpu-a"}


async def test_late_ready_snapshot_routes_instead_of_503(harness: Harness) -> None:
    """gpu-a's publisher is late (its READY snapshot just expired) while gpu-b is freshly DOWN: the
    stale-READY grace routes to gpu-a instead of answering 503, and counts it."""
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(ttl_ms=1000))
    await harness.put(snapshot("gpu-b/127.0.0.1:8002", "gpu-b", readiness=spb.DOWN, ttl_ms=30_000))
    assert await until(lambda: harness.view.counts["stale_ready"] == 1, timeout=5)
    assert harness.route_cluster() == "gpu-a"
    assert await until(lambda: harness.sample("llm_extproc_stale_ready_decisions_total") >= 1)
    assert harness.sample("llm_extproc_fallbacks_total", reason="no_fresh_snapshot") == 0


async def test_unknown_load_through_the_feed(harness: Harness) -> None:
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(waiting=4, num_running=2, kv_cache_usage=0.5, load_presence=True))
    unknown = snapshot("gpu-b/127.0.0.1:8002", "gpu-b", load_presence=True)
    unknown.ClearField("num_waiting")  # the engine did not report it: unknown, not 0
    await harness.put(unknown)
    assert await until(lambda: harness.view.load("gpu-b") is not None)
    load = harness.view.load("gpu-b")
    assert load is not None and load.num_waiting == 4 and "num_waiting" in load.unknown


async def test_follow_channel_subscribes_again_after_redis_returns(redis_server: RedisProcess) -> None:
    """The one reconnect loop every subscriber shares (feed, KV index, relay, sync): subscribe, then
    load; messages in order; a lost Redis is reported, `connected` cleared, and the next connection
    subscribes and loads again; `running()` false ends the loop between connections."""
    settings = RedisSettings(url=redis_server.url, pool="follow")
    got: list[bytes] = []
    loads: list[float] = []
    lost: list[Exception] = []
    connected = asyncio.Event()
    running = True

    async def subscribed(client: object) -> None:
        loads.append(time.monotonic())

    task = asyncio.create_task(
        follow_channel(
            settings,
            "ch",
            got.append,
            on_subscribed=subscribed,
            on_lost=lost.append,
            connected=connected,
            running=lambda: running,
            poll_s=0.1,
        )
    )
    publisher = aioredis.from_url(redis_server.url)
    try:
        await asyncio.wait_for(connected.wait(), 5)
        await publisher.publish("ch", b"one")
        assert await until(lambda: got == [b"one"])
        redis_server.stop()
        assert await until(lambda: lost and not connected.is_set())
        redis_server.start()  # same port
        await asyncio.wait_for(connected.wait(), 10)
        assert len(loads) == 2
        await publisher.aclose()
        publisher = aioredis.from_url(redis_server.url)
        await publisher.publish("ch", b"two")
        assert await until(lambda: got == [b"one", b"two"])
        running = False
        redis_server.stop()  # the connection fails; the loop sees running() false and returns
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
        await publisher.aclose()


async def test_the_service_view_takes_the_configured_stale_ready_grace(redis_server: RedisProcess) -> None:
    from extproc.server.app import start

    raw = {
        "pool": {"clusters": [{"name": "gpu-a", "models": ["m"]}]},
        "listen": "127.0.0.1:0",
        "metrics_listen": None,
        "fleet": {"url": redis_server.url, "stale_ready_grace_ttls": 0},
    }
    running = await start(config_from_dict(raw))
    try:
        assert running.lifecycle.view is not None
        assert running.lifecycle.view.stale_ready_grace_ttls == 0.0
    finally:
        await running.stop(0)


async def test_cancel_until_done_ends_a_task_that_loses_a_cancellation() -> None:
    """What redis-py 8.1 can do to a follower: swallow one cancellation and carry on."""
    from extproc.fleet.redis_feed import cancel_until_done

    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done([task]), 5)
    assert task.cancelled() and swallowed == 1


async def test_a_failing_rebuild_loop_goes_on_and_fails_readiness_only_while_it_keeps_failing(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop that expires snapshots raises (a bug, a bad record): it is logged and started again
    instead of dying with the view frozen (stale instances still routed while /healthz says OK);
    while it keeps failing, `supervision.failing()` (read by /readyz and gRPC health) names it."""
    from extproc.telemetry import supervision

    monkeypatch.setattr(supervision, "BACKOFF_S", (0.01, 0.02))
    rebuild = harness.view.rebuild
    broken = {"on": True}

    def flaky() -> None:
        if broken["on"]:
            raise RuntimeError("boom")
        rebuild()

    monkeypatch.setattr(harness.view, "rebuild", flaky)
    harness.feed.start()
    await harness.feed.connected.wait()
    await harness.put(snapshot(ttl_ms=300, waiting=0))
    assert await until(lambda: any("fleet-rebuild" in f and "boom" in f for f in supervision.failing()))
    broken["on"] = False  # the loop is still there: once the cause is gone the view expires again
    assert await until(lambda: harness.view.candidates("m") is None, timeout=5)
    monkeypatch.setattr(supervision, "HEALTHY_RUN_S", 0.05)
    assert await until(lambda: not supervision.failing())
    await harness.feed.stop()
    assert not [s for s in supervision.loops() if s.name.startswith("fleet-")]  # stopped: gone


async def test_each_upstreams_batch_limit_and_its_source_are_exported(harness: Harness) -> None:
    """`llm_extproc_batch_limit{upstream,source}`: what admission's class rule counts on, so an
    operator sees where the classes do not separate yet (`none`) and where a limit is only learnt."""
    harness.feed.start()
    await harness.feed.connected.wait()

    def limit(upstream: str, source: str) -> float | None:
        return harness.metrics.registry.get_sample_value(
            "llm_extproc_batch_limit", {"upstream": upstream, "source": source}
        )

    await harness.put(snapshot(num_running=3, waiting=0, kv_cache_usage=0.3, load_presence=True))
    b = "gpu-b/127.0.0.1:8002"
    await harness.put(snapshot(b, "gpu-b", num_running=2, max_num_seqs=6, load_presence=True))
    assert await until(lambda: limit("gpu-a", "none") == 0 and limit("gpu-b", "published") == 6)
    # gpu-a queues at 5 running with room in its cache: a limit for admission's count, not yet a cap.
    await harness.put(snapshot(seq=2, num_running=5, waiting=3, kv_cache_usage=0.3, load_presence=True))
    assert await until(lambda: limit("gpu-a", "queue") == 5)
    assert limit("gpu-a", "none") is None  # one series per upstream: the old source's is gone
    # The same batch queueing again: a steady sequence cap, where places are kept for critical requests.
    await harness.put(snapshot(seq=3, num_running=5, waiting=2, kv_cache_usage=0.3, load_presence=True))
    assert await until(lambda: limit("gpu-a", "sequence_cap") == 5)
    assert limit("gpu-a", "queue") is None
