"""The compose stack cannot run here (no Docker engine); check the parts it is built from."""

from __future__ import annotations

import inspect
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from extproc.cli import build_parser
from extproc.config import load_config
from extproc.settings import DEFAULT_PUBLISH_INTERVAL_S
from extproc_lab.bench.scenarios import start_publisher
from extproc_lab.discrete_event.class_objectives import Config
from extproc_lab.stack import ENVOY_DIR, find_envoy, load_envoy_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
STACK = ("envoy", "redis", "engines", "llm-extproc", "publisher")
IMAGE = "llm-extproc:local"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_dockerfile_copies_what_the_package_needs() -> None:
    text = DOCKERFILE.read_text()
    for needed in ("COPY pyproject.toml", "COPY extproc", "COPY envoy", "COPY lab", "pip install"):
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
    assert s["envoy"]["ports"][0] == f"{listener}:{listener}"
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


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    s = services()
    for name, svc in s.items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and len(test) > 1, name
        if test[1] == "python":  # the one-liners must at least compile
            compile(test[test.index("-c") + 1], f"{name} healthcheck", "exec")
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in s and cond == {"condition": "service_healthy"}, (name, dep)
    # Everything in Envoy's namespace starts after Envoy; the service and the publisher after what they use.
    for name in STACK[1:]:
        assert s[name]["network_mode"] == "service:envoy" and "envoy" in s[name]["depends_on"]
    assert {"redis", "engines"} <= set(s["llm-extproc"]["depends_on"])
    assert {"redis", "engines"} <= set(s["publisher"]["depends_on"])
    # No cycles: a start order exists.
    order: list[str] = []
    pending = dict(s)
    while pending:
        ready = [n for n, svc in pending.items() if set(svc.get("depends_on") or {}) <= set(order)]
        assert ready, f"dependency cycle among {sorted(pending)}"
        order += ready
        for n in ready:
            del pending[n]


def test_one_image_built_once() -> None:
    s = services()
    builders = [n for n, svc in s.items() if "build" in svc]
    assert builders == ["envoy"]
    assert s["envoy"]["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}
    ours = [n for n, svc in s.items() if svc.get("image") == IMAGE]
    assert sorted(ours) == sorted(["envoy", "engines", "llm-extproc", "llm-extproc-bulk", "publisher"])
    for name in ours:
        if name != "envoy":
            assert s[name]["pull_policy"] == "never", name


def test_image_runs_as_non_root() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    last_run = max(i for i, line in enumerate(lines) if line.startswith("RUN "))
    assert max(i for i, line in enumerate(lines) if line.startswith("USER ")) > last_run


def test_dockerignore_keeps_what_the_image_copies() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for heavy in (".git", ".venv", "out", "build"):
        assert heavy in patterns
    copied = [
        src
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
    ]
    assert copied
    for src in copied:
        top = src.split("/")[0]
        assert top not in patterns and f"/{top}" not in patterns, f"{src} is excluded from the context"


def test_metrics_and_admin_published_on_loopback() -> None:
    s = services()
    published = {p.rsplit(":", 1)[1]: p for p in s["envoy"]["ports"]}
    for port in ("9090", "9901", "9103"):
        assert published[port] == f"127.0.0.1:{port}:{port}"
    # Inside the namespace they listen on 0.0.0.0, or Docker's forwarding could not reach them.
    serve = build_parser().parse_args(s["llm-extproc"]["command"])
    assert serve.metrics_listen == "0.0.0.0:9090"
    pub = build_parser().parse_args(s["publisher"]["command"])
    assert pub.metrics_listen == "0.0.0.0:9103"
    cmd = s["envoy"]["command"]
    overlay = yaml.safe_load(cmd[cmd.index("--config-yaml") + 1])
    assert overlay == {"admin": {"address": {"socket_address": {"address": "0.0.0.0", "port_value": 9901}}}}
    # Healthchecks probe what those processes serve.
    assert "9090/readyz" in " ".join(s["llm-extproc"]["healthcheck"]["test"])
    assert "9901/ready" in " ".join(s["envoy"]["healthcheck"]["test"])
    assert "9103/metrics" in " ".join(s["publisher"]["healthcheck"]["test"])


@pytest.mark.integration
def test_envoy_accepts_the_admin_overlay() -> None:
    cmd = services()["envoy"]["command"]
    result = subprocess.run(
        [
            find_envoy(),
            "--mode",
            "validate",
            "-c",
            str(ENVOY_DIR / "envoy.yaml"),
            "--config-yaml",
            cmd[cmd.index("--config-yaml") + 1],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_monitoring_profile_shows_the_shipped_dashboard() -> None:
    s = services()
    monitoring = sorted(n for n, svc in s.items() if "monitoring" in svc.get("profiles", []))
    assert monitoring == ["grafana", "prometheus"]
    assert all("profiles" not in s[n] for n in STACK)  # the stack itself always starts
    for name in monitoring:
        host = s[name]["ports"][0]
        assert host.startswith("127.0.0.1:")
    # Grafana mounts the dashboard that deploy/monitoring ships, and provisions both.
    mounts = {m.split(":")[1]: ROOT / "compose" / m.split(":")[0] for m in s["grafana"]["volumes"]}
    dashboard = mounts["/var/lib/grafana/dashboards/llm-extproc.json"]
    assert dashboard.resolve() == (ROOT / "deploy" / "monitoring" / "grafana-dashboard.json").resolve()
    provider = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/dashboards"] / "llm-extproc.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    sources = yaml.safe_load((mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml").read_text())
    source = sources["datasources"][0]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"
    # Prometheus scrapes the jobs the dashboard filters on, at ports the stack publishes.
    prom_mount = next(
        m for m in s["prometheus"]["volumes"] if m.endswith(":/etc/prometheus/prometheus.yml:ro")
    )
    prom = yaml.safe_load((ROOT / "compose" / prom_mount.split(":")[0]).read_text())
    jobs = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in prom["scrape_configs"]
    }
    variables = {v["name"]: v for v in json.loads(dashboard.read_text())["templating"]["list"]}
    assert "llm-extproc" in variables["job"]["query"].split(",")
    assert jobs["llm-extproc"] == ["envoy:9090"] and jobs["llm-extproc-publisher"] == ["envoy:9103"]
    sim = build_parser().parse_args(s["engines"]["command"])
    assert sim.host == "0.0.0.0"
    assert jobs["engines"] == [f"envoy:{sim.port + i}" for i in range(sim.count)]


def test_the_shipped_publisher_snapshots_at_the_default_interval() -> None:
    """Compose's publisher runs the interval the benches measure (the lab's stacks and discrete-event
    benches read DEFAULT_PUBLISH_INTERVAL_S; Kubernetes': test_deploy): until 2026-12-06 it shipped
    1 s while every bench ran 0.5 s."""
    pub = build_parser().parse_args(services()["publisher"]["command"])
    assert pub.interval in (None, DEFAULT_PUBLISH_INTERVAL_S)
    assert Config().publish_interval_s == DEFAULT_PUBLISH_INTERVAL_S
    assert inspect.signature(start_publisher).parameters["interval_s"].default == DEFAULT_PUBLISH_INTERVAL_S
