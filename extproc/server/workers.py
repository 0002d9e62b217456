"""`llm-extproc serve --workers N`: N service processes on one host, watched by a supervisor.

One Python process routes on one core (the GIL); N workers use N. Each worker is a full
`llm-extproc serve` in its own interpreter (a fresh process, not a fork: gRPC's threads do not
survive fork), with its own replica id (random, as any replica's) and its own metrics port
(`metrics_listen` port + i). They share the fleet's state through Redis as separate replicas do.

Ports: by default every worker listens on the same address (gRPC sets SO_REUSEPORT) and the kernel
spreads *connections* over them. Envoy holds few, long-lived HTTP/2 connections to the ext_proc
cluster (one per Envoy worker thread), so the spread of *streams* can be uneven; with
`ports="consecutive"` worker i listens on port + i instead and envoy.yaml lists those N endpoints
(Envoy then balances streams itself; docs/tuning.md).

The supervisor forwards SIGTERM/SIGINT (a second one too, so the phased shutdown in server/app.py
works as for one process), restarts a worker that exits on its own, and gives up (stops the others,
exits non-zero) when workers keep dying: more than `max_restarts` restarts within `window_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

log = logging.getLogger("extproc.workers")

ENV_WORKER = "LLM_EXTPROC_WORKER"  # set in each worker: its index (logs, debugging)
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
POLL_S = 0.2
STOP_TIMEOUT_S = 60.0  # announce (6 s) + drain (30 s) + margin; then SIGKILL


def offset_port(address: str, offset: int) -> str:
    """`host:port` with the port moved by `offset` (port 0 stays 0: the OS picks)."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset if int(port) else 0}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(slots=True)
class Worker:
    index: int
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        env = dict(os.environ, **{ENV_WORKER: str(self.index)})
        # Own session: a Ctrl-C reaches the supervisor only, which forwards it once.
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent, start_new_session=True)
        log.info("worker %d started (pid %d)", self.index, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive() and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


@dataclass(slots=True)
class Supervisor:
    """Runs the workers until a signal, or until they keep dying (exit code 1)."""

    commands: Sequence[list[str]]
    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    workers: list[Worker] = field(default_factory=list)
    _signals: list[int] = field(default_factory=list)
    _restarts: deque[float] = field(default_factory=deque)

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        self._signals.append(sig)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.workers = [Worker(i, list(argv)) for i, argv in enumerate(self.commands)]
        for w in self.workers:
            w.start()
        forwarded = 0
        failed = False
        while True:
            if len(self._signals) > forwarded:
                for signum in self._signals[forwarded:]:
                    name = signal.Signals(signum).name
                    log.info("supervisor: %s, forwarded to %d workers", name, len(self.workers))
                    for w in self.workers:
                        w.signal(signum)
                forwarded = len(self._signals)
            if forwarded:  # stopping: wait for every worker, SIGKILL the ones that overstay
                return self._wait_all(failed)
            for w in self.workers:
                if w.alive():
                    continue
                code = w.proc.returncode if w.proc is not None else None
                now = time.monotonic()
                while self._restarts and now - self._restarts[0] > self.window_s:
                    self._restarts.popleft()
                if len(self._restarts) >= self.max_restarts:
                    log.error(
                        "supervisor: worker %d exited (%s); %d restarts within %.0f s, giving up",
                        w.index,
                        code,
                        len(self._restarts),
                        self.window_s,
                    )
                    failed = True
                    self._signals.append(signal.SIGTERM)
                    break
                self._restarts.append(now)
                w.restarts += 1
                log.warning("supervisor: worker %d exited (%s); restarting it", w.index, code)
                w.start()
            time.sleep(POLL_S)

    def _wait_all(self, failed: bool) -> int:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        forwarded = len(self._signals)
        codes: list[int | None] = []
        for w in self.workers:
            while w.alive() and time.monotonic() < deadline:
                if len(self._signals) > forwarded:  # a second SIGTERM: skip the announce period
                    for other in self.workers:
                        for signum in self._signals[forwarded:]:
                            other.signal(signum)
                    forwarded = len(self._signals)
                time.sleep(0.05)
            if w.alive() and w.proc is not None:
                log.warning("supervisor: worker %d did not stop in time; killing it", w.index)
                w.proc.kill()
            codes.append(w.proc.wait() if w.proc is not None else None)
        log.info("supervisor: all workers stopped (exit codes %s)", codes)
        return 1 if failed or any(c not in (0, None, -signal.SIGTERM) for c in codes) else 0


def worker_commands(
    serve_args: Sequence[str],
    workers: int,
    listen: str,
    metrics_listen: str | None,
    ports: str = "shared",
) -> list[list[str]]:
    """The `llm-extproc serve` command line of each worker: the supervisor's own options, with the
    listen address (shared, or port + i) and the metrics address (port + i) of that worker."""
    commands = []
    for i in range(workers):
        argv = [sys.executable, "-m", "extproc.cli", "serve", *serve_args]
        argv += ["--listen", listen if ports == "shared" else offset_port(listen, i)]
        if metrics_listen:
            argv += ["--metrics-listen", offset_port(metrics_listen, i)]
        commands.append(argv)
    return commands
