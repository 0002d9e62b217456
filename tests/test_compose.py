"""The compose stack cannot run here (no Docker engine); check the parts it is built from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.cli import build_parser
from extproc.config import load_config
from extproc.lab.stack import ENVOY_DIR, load_envoy_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_dockerfile_copies_what_the_package_needs() -> None:
    text = DOCKERFILE.read_text()
    for needed in ("COPY pyproject.toml", "COPY extproc", "COPY envoy", "pip install"):
        assert needed in text
    for path in ("pyproject.toml", "README.md", "extproc", "envoy"):
        assert (ROOT / path).exists()


@pytest.mark.parametrize("name", ["llm-extproc", "engines", "publisher"])
def test_service_commands_parse(name: str) -> None:
    args = build_parser().parse_args(services()[name]["command"])
    assert args.func is not None


def test_files_referenced_in_the_image_exist() -> None:
    for svc in services().values():
        for arg in [*svc.get("command", []), *svc.get("entrypoint", [])]:
            if isinstance(arg, str) and arg.startswith("/app/"):
                assert (ROOT / arg.removeprefix("/app/")).exists(), arg


def test_ports_line_up_with_the_configs() -> None:
    s = services()
    envoy_cfg = load_envoy_config(ENVOY_DIR / "envoy.yaml")
    listener = envoy_cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert s["envoy"]["ports"] == [f"{listener}:{listener}"]
    cmd = s["llm-extproc"]["command"]
    listen = cmd[cmd.index("--listen") + 1]
    extproc = next(c for c in envoy_cfg["static_resources"]["clusters"] if c["name"] == "llm-extproc")
    sock = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    assert listen == f"{sock['address']}:{sock['port_value']}"
    # The engines listen where envoy.yaml's GPU clusters point.
    sim = build_parser().parse_args(s["engines"]["command"])
    gpu_ports = sorted(
        c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "port_value"
        ]
        for c in envoy_cfg["static_resources"]["clusters"]
        if c["name"].startswith("gpu-")
    )
    assert gpu_ports == [sim.port + i for i in range(sim.count)]
    assert load_config(ENVOY_DIR / "llm-extproc.yaml").pool.models() == [sim.model]
    for name in ("llm-extproc", "engines", "redis", "publisher"):
        assert s[name]["network_mode"] == "service:envoy"
    # Publisher, service and Redis agree on where Redis is and which pool they share.
    fleet = load_config(ENVOY_DIR / "llm-extproc.yaml").fleet
    assert fleet is not None
    pub = build_parser().parse_args(s["publisher"]["command"])
    assert pub.redis_url == fleet.url and pub.pool == fleet.pool
    assert "6379" in fleet.url and "6379" in s["redis"]["command"]
    admin = envoy_cfg["admin"]["address"]["socket_address"]
    assert pub.envoy_admin == f"http://{admin['address']}:{admin['port_value']}"
