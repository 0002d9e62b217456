"""Redis as production runs it: Sentinel (master + replica + 3 Sentinels) and Cluster (3 masters, a
replica each), real `redis-server` processes on loopback, real Envoy, two service replicas and the
publisher. The master holding the fleet's keys is killed under load: requests keep succeeding (on the
local view, then on the static pool's fallback, counted) and the view is fresh again after failover."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from gateway_stack import MODEL, Stack, service_config, wait_until
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import AuthenticationError
from redis_errors import ping_error

from extproc.doctor import _redis_hint
from extproc.fleet.redis_feed import redis_client, redis_pubsub_client, write_and_publish
from extproc.lifecycle import RequestLifecycle
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc.settings import ConfigError, RedisSettings, redis_settings, redis_topology
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import RedisProcess
from extproc_lab.stack.redis_topologies import ClusterSet, SentinelSet

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
INTERVAL = 0.2
TTL = 0.4  # short, so a failover outage (>= 1 s to declare the master down) outlives the snapshots
FRESH = 'llm_extproc_fleet_instances{state="fresh_ready"}'
FALLBACK = 'llm_extproc_fallbacks_total{reason="no_fresh_snapshot"}'
SYNC_RECEIVED = 'llm_extproc_sync_messages_total{direction="received"}'


# -- settings: URLs and keys -------------------------------------------------------------------------
def test_standalone_keys_and_url_unchanged() -> None:
    s = redis_settings({"url": "redis://u:p@10.0.0.1:6380/2", "pool": "gpu"}, "fleet")
    assert redis_topology(s).kind == "standalone"
    assert s.key("a") == "llm-extproc:gpu:snap:a"
    assert s.channel == "llm-extproc:gpu:events"


def test_sentinel_url_and_keys() -> None:
    s = redis_settings({"url": "redis+sentinel://:pw@h1:26379,h2:26380/mymaster/3"}, "fleet")
    t = redis_topology(s)
    assert (t.kind, t.nodes, t.master_name, t.db, t.password) == (
        "sentinel",
        (("h1", 26379), ("h2", 26380)),
        "mymaster",
        3,
        "pw",
    )
    assert s.prefix == "llm-extproc:default"  # one master holds everything: no hash tag needed
    by_keys = redis_settings({"sentinels": ["h1:26379"], "master_name": "m"}, "fleet")
    assert redis_topology(by_keys).nodes == (("h1", 26379),)


def test_sentinel_tls_follows_the_data_nodes_unless_set_and_is_only_for_sentinel() -> None:
    assert redis_settings({"url": "rediss+sentinel://h1:26379/m/0"}, "fleet").sentinel_tls is None
    s = redis_settings({"url": "rediss+sentinel://h1:26379/m/0", "sentinel_tls": False}, "fleet")
    assert s.sentinel_tls is False and redis_topology(s).tls  # data nodes TLS, Sentinels plain
    with pytest.raises(ConfigError, match="sentinel_tls is for Sentinel"):
        redis_settings({"url": "rediss://h1:6379/0", "sentinel_tls": True}, "fleet")
    with pytest.raises(ConfigError, match="sentinel_tls"):
        redis_settings({"url": "redis+sentinel://h1:26379/m/0", "sentinel_tls": "yes"}, "fleet")


def test_sentinels_have_their_own_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Sentinels' password and ACL user are apart from the data nodes' (Helm charts with auth
    on protect both); from the YAML (a quoted string, never echoed) or the environment."""
    url = "redis+sentinel://:data@h1:26379/m/0"
    s = redis_settings({"url": url, "sentinel_password": "s3", "sentinel_username": "watch"}, "fleet")
    assert (s.sentinel_password, s.sentinel_username, redis_topology(s).password) == ("s3", "watch", "data")
    with pytest.raises(ConfigError, match="quote it") as err:
        redis_settings({"url": url, "sentinel_password": 4711}, "fleet")
    assert "4711" not in str(err.value)
    with pytest.raises(ConfigError, match="for Sentinel"):
        redis_settings({"url": "redis://h1:6379/0", "sentinel_password": "s3"}, "fleet")
    monkeypatch.setenv("SENTINEL_PW", "from-env")
    env = "SENTINEL_PW"
    assert redis_settings({"url": url}, "f", sentinel_password_env=env).sentinel_password == "from-env"
    given = redis_settings({"url": url, "sentinel_password": "yaml"}, "f", sentinel_password_env=env)
    assert given.sentinel_password == "yaml"  # the YAML's wins, as for the data nodes' password
    plain = redis_settings({"url": "redis://h1:6379/0"}, "f", sentinel_password_env=env)
    assert plain.sentinel_password is None  # one server: no Sentinel to log in to
    assert redis_settings({"url": url}, "f").sentinel_password is None


def test_cluster_url_puts_the_pool_in_one_hash_slot() -> None:
    s = redis_settings({"url": "redis+cluster://h1:7000,h2:7001", "pool": "gpu"}, "fleet")
    t = redis_topology(s)
    assert (t.kind, t.nodes) == ("cluster", (("h1", 7000), ("h2", 7001)))
    assert s.key("a") == "{llm-extproc:gpu}:snap:a"
    assert s.channel == "{llm-extproc:gpu}:events"
    flagged = redis_settings({"url": "redis://h1:7000", "cluster": True, "key_prefix": "x:{t}"}, "f")
    assert redis_topology(flagged).kind == "cluster"
    assert flagged.key("a") == "x:{t}:snap:a"  # an operator's own hash tag is kept


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"url": "redis+sentinel://h1:26379"}, "master name"),
        ({"url": "redis+sentinel:///m/0"}, "at least one"),
        ({"url": "redis+cluster://h1:7000/1"}, "only database 0"),
        ({"url": "redis+cluster://h1"}, "host:port"),
        ({"sentinels": ["h1:1"], "master_name": "m", "cluster": True}, "not both"),
        ({"cluster": "yes"}, "true or false"),
        ({"url": "http://h1:1"}, "must be a redis://"),
    ],
)
def test_bad_topologies_are_config_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        redis_settings(raw, "fleet")


# -- live topologies -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines() -> Iterator[EngineGroup]:
    group = EngineGroup([0.005, 0.005], MODEL, max_batch=4)
    yield group
    group.close()


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path_factory.mktemp("sentinel")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSet]:
    c = ClusterSet(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def sentinel_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    folder = tmp_path_factory.mktemp("sentinel-auth")
    s = SentinelSet(folder, password="data-pw", sentinel_password="sentinel-pw").start()
    yield s
    s.stop()


async def _round_trip(url: str, **credentials: str) -> None:
    """Snapshot keys load back (SCAN + MGET) and a PUBLISH reaches a subscriber, in this topology."""
    settings = RedisSettings(url=url, pool="rt", **credentials)
    client, sub = redis_client(settings), redis_pubsub_client(settings)
    pubsub = sub.pubsub(ignore_subscribe_messages=True)
    # The data client's own pubsub() subscribes too, in every topology (Cluster included).
    direct = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(settings.channel)
        await direct.subscribe(settings.channel)
        for uid in ("a", "b", "c"):
            snapshot = (settings.key(uid), uid.encode(), 5000)
            await write_and_publish(client, [(settings.channel, uid)], snapshot)
        keys = sorted([k async for k in client.scan_iter(match=f"{settings.prefix}:snap:*")])
        assert keys == [settings.key(u).encode() for u in ("a", "b", "c")]
        assert await client.mget(keys) == [b"a", b"b", b"c"]
        for subscriber in (pubsub, direct):
            got: list[bytes] = []
            deadline = time.monotonic() + 5
            while len(got) < 3 and time.monotonic() < deadline:
                msg = await subscriber.get_message(timeout=0.5)
                if msg is not None:
                    got.append(msg["data"])
            assert got == [b"a", b"b", b"c"]
    finally:
        await direct.aclose()
        await pubsub.aclose()
        await sub.aclose()
        await client.aclose()


async def test_sentinel_round_trip(sentinel: SentinelSet) -> None:
    await _round_trip(sentinel.url)


@pytest.mark.integration
async def test_sentinels_with_a_password_of_their_own(sentinel_with_auth: SentinelSet) -> None:
    """Sentinels with `requirepass` of their own and data nodes with another: the round trip works
    with both; without the Sentinels' the master is not found and doctor names the setting."""
    s = sentinel_with_auth
    await _round_trip(s.url, sentinel_password="sentinel-pw")
    err = await ping_error(RedisSettings(url=s.url, pool="rt"), MasterNotFoundError)
    assert "sentinel-pw" not in str(err) and "data-pw" not in str(err)
    assert "fleet.sentinel_password" in _redis_hint(err)
    wrong = RedisSettings(url=s.url.replace("data-pw", "nope"), sentinel_password="sentinel-pw")
    assert "fleet.password" in _redis_hint(await ping_error(wrong, AuthenticationError))


async def test_cluster_round_trip(cluster: ClusterSet) -> None:
    await _round_trip(cluster.url)


class Load:
    """Closed-loop chat requests through Envoy until stopped; every status is kept."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        self.url = url + "/v1/chat/completions"
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(concurrency)]

    async def _client(self) -> None:
        async with aiohttp.ClientSession() as s:
            while not self._stop.is_set():
                try:
                    async with s.post(self.url, json=CHAT) as r:
                        body = await r.read()
                        self.statuses[r.status] += 1
                        if r.status != 200:
                            self.errors.append(body[:300].decode(errors="replace"))
                except aiohttp.ClientError:
                    self.statuses[0] += 1

    async def stop(self) -> Counter[int]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.statuses


async def _failover_under_load(
    engines: EngineGroup,
    tmp_path: Path,
    url: str,
    kill: Callable[[], object],
    failed_over: Callable[[], bool],
) -> None:
    engines.reset()
    for e in engines.engines:
        e.ready = True
        e.token_delay_s = 0.005
    fleet = {"url": url, "pool": "topo", "resync_interval_s": 2.0}
    stack = Stack(engines, tmp_path / "gw", service=service_config(fleet=fleet), replicas=2)
    specs = [InstanceSpec(c, engines.address(i), "sim") for i, c in enumerate(["gpu-a", "gpu-b"])]
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=url, pool="topo"), instances=specs, interval_s=INTERVAL, ttl_s=TTL
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    await asyncio.to_thread(stack.start)

    def relayed(direction: str) -> float:
        key = f'llm_extproc_relayed_releases_total{{direction="{direction}"}}'
        return sum(stack.metrics(r).get(key, 0.0) for r in range(2))

    def fresh_everywhere() -> bool:
        return all(stack.metrics(r).get(FRESH) == len(specs) for r in range(2))

    def synced() -> list[float]:  # each replica's count of the other's sync messages applied
        return [stack.metrics(r).get(SYNC_RECEIVED, 0.0) for r in range(2)]

    try:
        assert await asyncio.to_thread(wait_until, fresh_everywhere, 15), stack.logs()
        load = Load(stack.url)
        await asyncio.sleep(1.0)
        fallbacks_before = sum(stack.metrics(r).get(FALLBACK, 0.0) for r in range(2))
        kill()
        killed_at = time.monotonic()
        assert await asyncio.to_thread(wait_until, failed_over, 20), "no failover"
        failover_s = time.monotonic() - killed_at
        synced_at_failover = synced()
        assert await asyncio.to_thread(wait_until, fresh_everywhere, 15), stack.logs()
        converged_s = time.monotonic() - killed_at - failover_s
        # The replicas hear each other again: each applies a sync message sent after the failover.
        assert await asyncio.to_thread(
            wait_until, lambda: all(n > b for n, b in zip(synced(), synced_at_failover, strict=True)), 15
        ), stack.logs()
        sync_s = time.monotonic() - killed_at - failover_s
        applied_before = relayed("applied")
        await asyncio.sleep(1.0)
        statuses = await load.stop()
        print(
            f"failover after {failover_s:.2f}s, view fresh {converged_s:.2f}s later, replicas synced "
            f"{sync_s:.2f}s later; {dict(statuses)}"
        )
        # Every request succeeded through the outage: local view, then the counted fallback.
        assert set(statuses) == {200}, (statuses, load.errors[:3])
        assert statuses[200] > 50
        fallbacks = sum(stack.metrics(r).get(FALLBACK, 0.0) for r in range(2)) - fallbacks_before
        assert fallbacks > 0
        # Access-log tickets of the other replica travel through the new master again (tickets relayed
        # during the outage were dropped, counted; those leases expire instead).
        assert await asyncio.to_thread(wait_until, lambda: relayed("applied") > applied_before, 5)
    finally:
        stop.set()
        await task
        await asyncio.to_thread(stack.stop)


@pytest.mark.envoy
@pytest.mark.slow
async def test_sentinel_master_killed_under_load(
    engines: EngineGroup, sentinel: SentinelSet, tmp_path: Path
) -> None:
    old = sentinel.master_port()
    await _failover_under_load(
        engines,
        tmp_path,
        sentinel.url,
        sentinel.kill_master,
        lambda: sentinel.master_port() not in (None, old),
    )


@pytest.mark.envoy
@pytest.mark.slow
async def test_standalone_redis_restarted_under_load(engines: EngineGroup, tmp_path: Path) -> None:
    """One plain redis-server (no persistence) stopped for 2 s and started again on its port, empty:
    the publisher and the replicas' state dumps fill it again."""
    redis = RedisProcess(tmp_path / "redis.log").start()
    restarted = threading.Event()

    def restart() -> None:
        redis.stop()
        time.sleep(2.0)
        redis.start()
        restarted.set()

    try:
        await _failover_under_load(
            engines,
            tmp_path,
            redis.url,
            lambda: threading.Thread(target=restart, daemon=True).start(),
            restarted.is_set,
        )
    finally:
        redis.stop()


@pytest.mark.envoy
@pytest.mark.slow
async def test_cluster_master_killed_under_load(
    engines: EngineGroup, cluster: ClusterSet, tmp_path: Path
) -> None:
    victim = cluster.master_of(RedisSettings(url=cluster.url, pool="topo").key("x"))

    def failed_over() -> bool:
        try:
            return cluster.healthy() and cluster.master_of("{llm-extproc:topo}:snap:x") is not victim
        except LookupError:  # the slot has no master for now
            return False

    await _failover_under_load(engines, tmp_path, cluster.url, victim.kill, failed_over)


# -- the access-log relay across an outage ---------------------------------------------------------------
@pytest.mark.integration
async def test_relay_holds_tickets_until_redis_and_the_owner_are_back(tmp_path: Path) -> None:
    """A ticket relayed while Redis is down, or while its owner is not subscribed yet (a failover's
    reconnect), is delivered once both are back instead of leaking the owner's lease."""
    from test_completions import lifecycle, routed

    from extproc.server.completions import PendingReleases
    from extproc.server.relay import ReleaseRelay
    from extproc_lab.stack import RedisProcess

    redis = RedisProcess(tmp_path / "redis.log").start()
    settings = RedisSettings(url=redis.url, pool="relay")
    owner_lc, sender_lc = lifecycle(), lifecycle()
    owner = PendingReleases(owner_lc, 60.0, replica="owner")
    sender_relay = ReleaseRelay(settings, PendingReleases(sender_lc, 60.0, replica="sender"))
    owner_relay = ReleaseRelay(settings, owner)
    streams = [await routed(owner_lc, owner) for _ in range(2)]
    for s in streams:
        s.close()
    assert owner_lc.inflight.total() == 2

    def relayed(lc: RequestLifecycle, direction: str) -> float:
        sample = lc.metrics.registry.get_sample_value(
            "llm_extproc_relayed_releases_total", {"direction": direction}
        )
        return sample or 0.0

    sender_relay.start()
    try:
        redis.stop()  # Redis down: the first ticket cannot be published
        assert streams[0].ticket is not None and streams[1].ticket is not None
        sender_relay.forward(streams[0].ticket)
        await asyncio.sleep(0.5)
        redis.start()  # back, but the owner is not listening yet: PUBLISH reaches nobody
        sender_relay.forward(streams[1].ticket)
        await asyncio.sleep(1.0)
        assert owner_lc.inflight.total() == 2
        owner_relay.start()  # the owner subscribes (as after its reconnect): both arrive
        deadline = time.monotonic() + 10
        while owner_lc.inflight.total() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert owner_lc.inflight.total() == 0
        assert relayed(owner_lc, "applied") == 2
        assert relayed(sender_lc, "sent") == 2 and relayed(sender_lc, "dropped") == 0
    finally:
        await sender_relay.stop()
        await owner_relay.stop()
        redis.stop()
