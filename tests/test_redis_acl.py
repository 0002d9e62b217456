"""The shipped Kubernetes Redis (deploy/kubernetes/redis.yaml) runs with ACLs: no default user, one
user `llm-extproc` limited to the `llm-extproc:*` keys and channels and to no admin or dangerous
command. Everything the service and the publisher do in Redis must work under that user: here a
real redis-server started with the manifest's own arguments, a publisher writing snapshots, two
services following them, sharing decisions and relaying releases, all authenticated as in the
manifests (user in the URL, password from LLM_EXTPROC_REDIS_PASSWORD)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import AuthenticationError, NoPermissionError
from test_replica_sync import HEAD, TENANTS, body, put_snapshots, service_config, total, until

from extproc.config import config_from_dict
from extproc.server import start
from extproc.settings import ENV_REDIS_PASSWORD
from extproc.telemetry import supervision
from extproc_lab.stack import RedisProcess

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def manifest_redis_args(password: str) -> list[str]:
    """redis-server's arguments in deploy/kubernetes/redis.yaml, with the Secret's value put in."""
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "redis.yaml").read_text())
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "redis-server"
    return [a.replace("$(REDIS_PASSWORD)", password) for a in args[1:]]


@pytest.fixture
def acl_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RedisProcess, str]]:
    password = secrets.token_hex(16)
    server = RedisProcess(tmp_path / "redis.log", extra_args=manifest_redis_args(password)).start()
    monkeypatch.setenv(ENV_REDIS_PASSWORD, password)
    yield server, password
    server.stop()


async def test_the_service_works_under_the_shipped_acl_user(acl_redis: tuple[RedisProcess, str]) -> None:
    server, password = acl_redis
    url = f"redis://llm-extproc@127.0.0.1:{server.port}/0"
    # The ACL is in force: no default user, nothing outside llm-extproc:*, no admin commands.
    anonymous = aioredis.from_url(f"redis://127.0.0.1:{server.port}/0")
    with pytest.raises(AuthenticationError):
        await anonymous.ping()
    await anonymous.aclose()
    user = aioredis.from_url(url, password=password)
    with pytest.raises(NoPermissionError):
        await user.set("elsewhere", b"x")
    with pytest.raises(NoPermissionError):
        await user.flushall()
    await user.aclose()

    await put_snapshots(url, password)
    config: dict[str, Any] = {**service_config(url), "release_on": "access_log"}  # the relay too
    services = [await start(config_from_dict(config)) for _ in range(2)]
    try:
        a, b = services
        for s in services:  # each follows the snapshots (SCAN, MGET, SUBSCRIBE) as that user
            assert await until(lambda s=s: bool(s.lifecycle.view.candidates("m")))  # type: ignore[union-attr]
            assert s.metrics.registry.get_sample_value("llm_extproc_redis_connected") == 1
        held = [a.lifecycle.route(HEAD, body(t, 0)) for t in TENANTS]
        assert await until(lambda: total(b) == len(TENANTS))  # replica sync: PUBLISH / SUBSCRIBE
        assert b.metrics.registry.get_sample_value(
            "llm_extproc_sync_rejected_total", {"reason": "error"}
        ) in (
            None,
            0.0,
        )
        for d in held:
            a.lifecycle.finish(d, "response_end")
        assert await until(lambda: total(b) == 0)
        await asyncio.sleep(0.3)  # a state dump (SET) has been written and read as that user
        keys = [k async for k in aioredis.from_url(url, password=password).scan_iter(match="llm-extproc:*")]
        assert any(b":sync:state:" in k for k in keys), keys
        # No loop met a refusal along the way (a NOPERM is an error that restarts or reconnects one).
        assert not [(x.name, x.last_error) for x in supervision.loops() if x.total_failures]
        for s in services:
            assert not s.metrics.registry.get_sample_value("llm_extproc_redis_reconnects_total")
    finally:
        for s in services:
            await s.stop(0)
