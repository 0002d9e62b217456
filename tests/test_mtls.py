"""mTLS on the service's gRPC port (`tls:` in llm-extproc.yaml; envoy.yaml's commented `BEGIN mtls`
block on the llm-extproc clusters): only a client holding a certificate the configured CA signed
can open ext_proc, access-log or health streams. An attacker pod is a client on loopback without
that certificate."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from certs import Certs, Pair, make_certs
from gateway_stack import MODEL, Stack, service_config, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import config_from_dict
from extproc.server import app
from extproc.settings import ConfigError
from extproc_lab.stack import ENVOY_DIR, free_port

POOL = {"clusters": [{"name": "gpu-a", "models": ["m"]}]}
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_config(certs: Certs, *, mutual: bool = True) -> dict[str, Any]:
    tls: dict[str, Any] = {"cert_file": str(certs.server.cert), "key_file": str(certs.server.key)}
    if mutual:
        tls["client_ca_file"] = str(certs.ca)
    return tls


@pytest.fixture
async def service(certs: Certs) -> AsyncIterator[app.RunningService]:
    cfg = config_from_dict(
        {"pool": POOL, "listen": f"127.0.0.1:{free_port()}", "metrics_listen": None, "tls": tls_config(certs)}
    )
    running = await app.start(cfg)
    yield running
    await running.drain(0.5)
    await running.close()


async def health(port: int, credentials: grpc.ChannelCredentials | None) -> str:
    """The health status a client with these credentials gets, or the gRPC code that stopped it."""
    target = f"127.0.0.1:{port}"
    options = [("grpc.ssl_target_name_override", "llm-extproc")]
    channel = (
        grpc.aio.insecure_channel(target)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials, options=options)
    )
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=3
            )
        except grpc.aio.AioRpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def client(certs: Certs, pair: Pair | None) -> grpc.ChannelCredentials:
    if pair is None:
        return grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=pair.key.read_bytes(),
        certificate_chain=pair.cert.read_bytes(),
    )


async def test_only_a_client_with_a_certificate_from_the_ca_gets_in(
    service: app.RunningService, certs: Certs
) -> None:
    port = service.port
    assert await health(port, None) == "UNAVAILABLE"  # plaintext: no handshake
    assert await health(port, client(certs, None)) == "UNAVAILABLE"  # TLS without a certificate
    assert await health(port, client(certs, certs.stranger)) == "UNAVAILABLE"  # another CA's
    assert await health(port, client(certs, certs.client)) == "SERVING"


async def test_rotated_files_are_used_from_the_next_connection(tmp_path: Path) -> None:
    """A Secret rotated under the running service (new CA, new certificates): clients of the new CA
    get in, those of the old one no longer, without a restart."""
    old, new = make_certs(tmp_path / "old"), make_certs(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("ca.crt", "server.crt", "server.key"):
        shutil.copy(old.ca.parent / name, live / name)
    tls = {"cert_file": str(live / "server.crt"), "key_file": str(live / "server.key")}
    cfg = config_from_dict(
        {
            "pool": POOL,
            "listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": None,
            "tls": {**tls, "client_ca_file": str(live / "ca.crt")},
        }
    )
    running = await app.start(cfg)
    try:
        assert await health(running.port, client(old, old.client)) == "SERVING"
        for name in ("ca.crt", "server.crt", "server.key"):
            shutil.copy(new.ca.parent / name, live / name)
        assert await health(running.port, client(new, new.client)) == "SERVING"
        assert await health(running.port, client(old, old.client)) == "UNAVAILABLE"
    finally:
        await running.drain(0.5)
        await running.close()


@pytest.mark.parametrize(
    ("tls", "expected"),
    [
        ({"cert_file": "missing.crt", "key_file": "k"}, "cannot read"),
        ({"key_file": "k"}, "cert_file is required"),
        ({"cert_file": "{here}/notpem", "key_file": "{here}/notpem"}, "is not a PEM file"),
        ({"cert_file": "{cert}", "key_file": "{key}", "ca": "x"}, "unknown keys"),
    ],
)
def test_bad_tls_settings_are_config_errors(
    tmp_path: Path, certs: Certs, tls: dict[str, str], expected: str
) -> None:
    (tmp_path / "notpem").write_text("hello")
    values = {
        k: v.format(here=tmp_path, cert=certs.server.cert, key=certs.server.key) for k, v in tls.items()
    }
    with pytest.raises(ConfigError, match=expected):
        config_from_dict({"pool": POOL, "tls": values}, base_dir=tmp_path)


# -- through real Envoy, with the block shipped (commented) in envoy.yaml -----------------------------
def shipped_mtls_block(envoy_file: str = "envoy.yaml") -> dict[str, Any]:
    """The transport_socket between envoy.yaml's `# BEGIN mtls` and `# END mtls`, uncommented."""
    lines = (ENVOY_DIR / envoy_file).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# BEGIN mtls")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# END mtls")
    prefix = lines[start][: lines[start].index("#")] + "# "
    body = [line[len(prefix) :] if line.startswith(prefix) else "" for line in lines[start + 1 : end]]
    block = yaml.safe_load("\n".join(body))
    assert set(block) == {"transport_socket"}
    return block


def with_mtls(certs: Certs) -> Callable[[dict[str, Any]], None]:
    text = yaml.safe_dump(shipped_mtls_block())
    for name, path in (
        ("client.crt", certs.client.cert),
        ("client.key", certs.client.key),
        ("ca.crt", certs.ca),
    ):
        text = text.replace(f"/etc/envoy/tls/{name}", str(path))
    block = yaml.safe_load(text)

    def edit(cfg: dict[str, Any]) -> None:
        for cluster in cfg["static_resources"]["clusters"]:
            if cluster["name"].startswith("llm-extproc"):
                cluster.update(block)

    return edit


@pytest.mark.parametrize("envoy_file", ["envoy.yaml", "endpoint-picker.yaml"])
def test_the_shipped_block_is_the_same_in_both_envoy_configs(envoy_file: str) -> None:
    assert shipped_mtls_block(envoy_file) == shipped_mtls_block()


@pytest.mark.envoy
async def test_envoy_with_the_shipped_mtls_block_routes_and_releases(
    make_stack: Callable[..., Stack], certs: Certs
) -> None:
    """The shipped block, uncommented, with `tls:` in the service config: requests are routed
    (ext_proc over mTLS) and their in-flight counts released (the access log over mTLS); the
    health check passes (the stack waits for Envoy to see the service healthy)."""
    stack = make_stack(service=service_config(tls=tls_config(certs)), envoy_edit=with_mtls(certs))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            async with session.post(stack.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
    assert wait_until(lambda: stack.inflight() == 0, 10.0), stack.metrics()
    assert sum(e.stats.requests for e in stack.engines.engines) == 4
    assert await health(stack.service_port, None) == "UNAVAILABLE"  # and nobody else gets in
