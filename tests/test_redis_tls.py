"""Redis over TLS (`rediss://` with `tls_ca_file`, docs/fleet-state.md), against a real redis-server
serving only a TLS port with a certificate from the tests' own CA: the service's feed reads snapshots
and follows the channel through it, and a certificate the client cannot verify is refused with a
hint that names the setting. Sentinel too: a Sentinel serving only a TLS port, which
`rediss+sentinel://` reaches over TLS (and `sentinel_tls: false` does not)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from certs import Certs, make_certs
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_errors import ping_error

from extproc.config import config_from_dict
from extproc.doctor import _redis_hint
from extproc.fleet import FleetView
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.redis_feed import RedisFeed, redis_client
from extproc.settings import RedisSettings
from extproc.telemetry import Metrics
from extproc_lab.stack import RedisProcess
from extproc_lab.stack.processes import free_port, wait_port

pytestmark = pytest.mark.integration
PASSWORD = "tls-pw"


@dataclass(frozen=True)
class TlsRedis:
    server: RedisProcess
    certs: Certs

    @property
    def url(self) -> str:
        return f"rediss://:{PASSWORD}@127.0.0.1:{self.server.port}/0"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    folder = tmp_path_factory.mktemp("redis-tls")
    certs = make_certs(folder / "certs")
    port = free_port()
    tls = [
        *("--port", "0", "--tls-port", str(port)),  # TLS only: a plain client gets nothing
        *("--tls-cert-file", str(certs.server.cert), "--tls-key-file", str(certs.server.key)),
        *("--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no"),
    ]
    server = RedisProcess(folder / "redis.log", port=port, password=PASSWORD, extra_args=tls).start()
    yield TlsRedis(server, certs)
    server.stop()


@pytest.fixture(scope="module")
def tls_sentinel(tls_redis: TlsRedis) -> Iterator[str]:
    """One Sentinel (quorum 1) on a TLS-only port, watching the TLS-only server over TLS; its
    rediss+sentinel:// URL."""
    folder = tls_redis.server.log_path.parent
    port = free_port()
    certs = tls_redis.certs
    conf = folder / f"sentinel-{port}.conf"
    conf.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ndir {folder}\n"
        f"tls-cert-file {certs.server.cert}\ntls-key-file {certs.server.key}\n"
        f"tls-ca-cert-file {certs.ca}\ntls-auth-clients no\ntls-replication yes\n"
        f"sentinel monitor fleet 127.0.0.1 {tls_redis.server.port} 1\n"
        f"sentinel auth-pass fleet {PASSWORD}\n"
    )
    with (folder / f"sentinel-{port}.log").open("ab") as log:
        proc = subprocess.Popen([tls_redis.server.binary, str(conf), "--sentinel"], stdout=log, stderr=log)
    try:
        wait_port("127.0.0.1", port, 10)
        yield f"rediss+sentinel://:{PASSWORD}@127.0.0.1:{port}/fleet/0"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_sentinels_on_a_tls_port_are_reached_over_tls(tls_sentinel: str, tls_redis: TlsRedis) -> None:
    ca = str(tls_redis.certs.ca)
    client = redis_client(RedisSettings(url=tls_sentinel, tls_ca_file=ca))
    try:
        await client.set("sentinel-tls", b"1")
        assert await client.get("sentinel-tls") == b"1"  # the master named by a TLS-only Sentinel
    finally:
        await client.aclose()
    # Told the Sentinels are plain TCP, the client cannot ask them: no master (the setting is used).
    plain = RedisSettings(url=tls_sentinel, tls_ca_file=ca, sentinel_tls=False)
    assert "fleet.sentinel_tls" in _redis_hint(await ping_error(plain, MasterNotFoundError))


def snapshot(seq: int, waiting: int) -> spb.UpstreamSnapshot:
    return spb.UpstreamSnapshot(
        upstream_id="gpu-a/127.0.0.1:8001",
        cluster="gpu-a",
        address="127.0.0.1:8001",
        engine="vllm",
        models=["m"],
        readiness=spb.READY,
        num_waiting=waiting,
        publisher_id="tls-test",
        sequence=seq,
        published_at_ms=int(time.time() * 1000),
        ttl_ms=5000,
    )


async def test_the_feed_reads_and_follows_snapshots_over_tls(tls_redis: TlsRedis) -> None:
    config = config_from_dict(
        {
            "pool": {"clusters": [{"name": "gpu-a", "models": ["m"]}]},
            "metrics_listen": None,
            "fleet": {"url": tls_redis.url, "tls_ca_file": str(tls_redis.certs.ca)},
        }
    )
    assert config.fleet is not None
    settings = config.fleet
    writer = redis_client(settings)
    view = FleetView(config.pool)
    feed = RedisFeed(settings, view, Metrics(["m"], ["gpu-a"]))
    try:
        await writer.set(settings.key("gpu-a/127.0.0.1:8001"), snapshot(1, 3).SerializeToString(), px=5000)
        feed.start()  # the resync reads the key...
        await asyncio.wait_for(feed.connected.wait(), 10)
        await _until(lambda: (load := view.load("gpu-a")) is not None and load.num_waiting == 3)
        # ...and the channel brings the next one (SUBSCRIBE over TLS too).
        await writer.publish(settings.channel, snapshot(2, 9).SerializeToString())
        await _until(lambda: (load := view.load("gpu-a")) is not None and load.num_waiting == 9)
    finally:
        await feed.stop()
        await writer.aclose()


async def test_a_certificate_the_client_cannot_verify_is_refused_with_a_hint(tls_redis: TlsRedis) -> None:
    # no tls_ca_file: the system's CAs only
    err = await ping_error(RedisSettings(url=tls_redis.url), RedisConnectionError)
    assert "CERTIFICATE_VERIFY_FAILED" in str(err)
    assert "fleet.tls_ca_file" in _redis_hint(err)
    assert PASSWORD not in str(err)


async def _until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not reached"
        await asyncio.sleep(0.02)
