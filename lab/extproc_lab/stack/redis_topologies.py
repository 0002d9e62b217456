"""Redis as production runs it, on loopback: a master + replica watched by three Sentinels, and a
Redis Cluster of three masters (each with a replica), built from real `redis-server` processes.

Timeouts are short (1 s to declare a node down) so tests and benches see a failover in seconds.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from extproc_lab.stack.processes import RedisProcess, free_port, wait_port

DOWN_AFTER_MS = 1000  # Sentinel down-after-milliseconds and cluster-node-timeout


def redis_cli(port: int, *args: str, timeout: float = 5.0, password: str | None = None) -> str:
    """One `redis-cli` command against a loopback port; its stdout (errors as text, never raised)."""
    binary = shutil.which("redis-cli")
    if binary is None:
        raise FileNotFoundError("redis-cli not found: install it (apt-get install redis-tools)")
    auth = ["--no-auth-warning", "-a", password] if password else []
    done = subprocess.run(
        [binary, "-h", "127.0.0.1", "-p", str(port), *auth, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout}s")
        time.sleep(0.1)


def cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _info(port: int, *command: str, password: str | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in redis_cli(port, *command, password=password).splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            out[key] = value
    return out


class SentinelSet:
    """A master, one replica and three Sentinels (quorum 2) on loopback ports; with `password` the
    data nodes require it, with `sentinel_password` the Sentinels require theirs (as Helm charts
    with auth on run them)."""

    def __init__(
        self,
        folder: Path,
        master_name: str = "fleet",
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.master_name = master_name
        self.password = password
        self.sentinel_password = sentinel_password
        here = ["--dir", str(folder)]  # a replica's full sync writes an RDB file there, not in the cwd
        if password:  # either may be promoted: both sync from the other with it
            here += ["--masterauth", password]
        self.master = RedisProcess(folder / "master.log", password=password, extra_args=here)
        self.replica = RedisProcess(
            folder / "replica.log",
            password=password,
            extra_args=[*here, "--replicaof", "127.0.0.1", str(self.master.port)],
        )
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.master_name}/0"

    def start(self, timeout: float = 30.0) -> SentinelSet:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # no orphaned servers or Sentinels when the set does not come up
            raise

    def _start(self, timeout: float) -> SentinelSet:
        self.master.start()
        self.replica.start()
        _wait(
            lambda: (
                _info(self.replica.port, "INFO", "replication", password=self.password).get(
                    "master_link_status"
                )
                == "up"
            ),
            timeout,
            "replica in sync",
        )
        binary = self.master.binary
        for port in self.sentinel_ports:
            conf = self.folder / f"sentinel-{port}.conf"  # Sentinel rewrites its file: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.master_name} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.master_name} 5000\n"
                f"sentinel parallel-syncs {self.master_name} 1\n"
                + (f"sentinel auth-pass {self.master_name} {self.password}\n" if self.password else "")
                + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else "")
            )
            log = (self.folder / f"sentinel-{port}.log").open("ab")
            self.sentinels.append(
                subprocess.Popen(
                    [binary, str(conf), "--sentinel"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for port in self.sentinel_ports:
            wait_port("127.0.0.1", port, timeout)
        _wait(self._sentinels_agree, timeout, "Sentinels know each other and the replica")
        return self

    def _sentinels_agree(self) -> bool:
        for port in self.sentinel_ports:
            out = redis_cli(
                port, "SENTINEL", "MASTER", self.master_name, password=self.sentinel_password
            ).split("\n")
            fields = dict(zip(out[0::2], out[1::2], strict=False))
            if fields.get("num-other-sentinels") != "2" or fields.get("num-slaves") != "1":
                return False
        return True

    def master_port(self) -> int | None:
        """The port the Sentinels name as master now."""
        out = redis_cli(
            self.sentinel_ports[0],
            "SENTINEL",
            "GET-MASTER-ADDR-BY-NAME",
            self.master_name,
            password=self.sentinel_password,
        )
        lines = out.split()
        return int(lines[1]) if len(lines) == 2 and lines[1].isdigit() else None

    def kill_master(self) -> RedisProcess:
        """SIGKILL the current master; returns the process that is left to take over."""
        port = self.master_port()
        victim, survivor = (
            (self.master, self.replica) if port == self.master.port else (self.replica, self.master)
        )
        victim.kill()
        return survivor

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.replica.stop()
        self.master.stop()


class ClusterSet:
    """A Redis Cluster of `masters` primaries, each with `replicas_each` replicas, on loopback ports."""

    def __init__(self, folder: Path, masters: int = 3, replicas_each: int = 1) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.replicas_each = replicas_each
        self.nodes: list[RedisProcess] = []
        for i in range(masters * (1 + replicas_each)):
            port = cluster_port()
            self.nodes.append(
                RedisProcess(
                    folder / f"node-{i}.log",
                    port=port,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(folder / f"nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        str(DOWN_AFTER_MS),
                        "--cluster-replica-validity-factor",
                        "0",  # a replica always takes over (no data-age check on loopback)
                        "--dir",
                        str(folder),
                    ],
                )
            )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> ClusterSet:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # no orphaned nodes when the cluster does not form
            raise

    def _start(self, timeout: float) -> ClusterSet:
        for node in self.nodes:
            node.start()
        binary = shutil.which("redis-cli")
        if binary is None:
            raise FileNotFoundError("redis-cli not found: install it (apt-get install redis-tools)")
        create = subprocess.run(
            [
                binary,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas_each),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout}{create.stderr}")
        _wait(self.healthy, timeout, "cluster_state:ok on every node")
        return self

    def alive(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def healthy(self) -> bool:
        return all(_info(n.port, "CLUSTER", "INFO").get("cluster_state") == "ok" for n in self.alive())

    def master_of(self, key: str) -> RedisProcess:
        """The node serving `key`'s slot now."""
        slot = int(redis_cli(self.alive()[0].port, "CLUSTER", "KEYSLOT", key).strip())
        for line in redis_cli(self.alive()[0].port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for span in fields[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    port = int(fields[1].split("@")[0].rpartition(":")[2])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
