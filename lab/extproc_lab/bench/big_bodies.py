"""`llm-extproc bench-big-bodies`: what concurrent 15 MB request bodies do to everyone else's latency.

Real Envoy (the shipped envoy.yaml, BUFFERED) in front of `llm-extproc serve` and simulated engines,
all on loopback. Small chat requests are sent at a fixed rate (open loop: a slow answer never delays
the next request) first alone, then while `bodies` clients each send big bodies back to back: a chat
whose content is a ~15 MB legal text, or one with a ~15 MB base64 image part (also legal; its prompt
text is tiny), or (hostile) ~500k one-character messages sent chunked, which the service refuses
(400 `too_many_messages`). Reported per phase: the small requests' latency (p50/p99/max) and
errors, the ext_proc time Envoy's access log gives for them, the big bodies' statuses (504 =
Envoy's 2 s ext_proc message timeout), and the service's RSS (itself and its body workers) before,
at peak and after the storm.

Isolation, so the figures are the gateway's: big and small requests go to different engines (a big
body's 15 MB JSON parse on the engine would otherwise delay the small requests there), and the load
generator of big bodies and the engines run at nice 10 (on a real deployment neither shares the
gateway's CPUs). `--service` YAML overrides (e.g. `bodies: {offload_bytes: 100000000}` to parse on the
event loop as before) compare configurations.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from extproc_lab.stack import ENVOY_DIR, LocalGateway
from extproc_lab.stack.processes import find_envoy, free_port, wait_port

SMALL_MODEL = "sim-llama"
BIG_MODEL = "legal-docs"
LAYOUTS = ("single", "bulk")
KINDS = ("text", "image", "messages")
NICE = 10
_WORDS = 5000


def big_body(kind: str, size: int, seed: int = 0) -> bytes:
    """A legal chat body of about `size` bytes: a long text, or a short question with a base64 image."""
    rng = random.Random(seed)
    if kind == "text":
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(_WORDS)]
        parts: list[str] = []
        total = 0
        while total < size:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) + ". "
            parts.append(sentence)
            total += len(sentence)
        text = "".join(parts)[: size - 200]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Summarise the contract below."},
            {"role": "user", "content": text},
        ]
    elif kind == "image":
        image = base64.b64encode(rng.randbytes((size - 300) * 3 // 4)).decode()
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What does this scanned page say?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
                ],
            }
        ]
    elif kind == "messages":  # hostile: ~29 bytes per one-character message (sent chunked)
        messages = [{"role": "user", "content": "x"}] * max(1, (size - 100) // 29)
    else:
        raise ValueError(f"unknown body kind {kind!r}; known: {', '.join(KINDS)}")
    return orjson.dumps({"model": BIG_MODEL, "max_tokens": 1, "messages": messages})


SMALL_BODY = orjson.dumps(
    {"model": SMALL_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "What is a lease?"}]}
)


# -- the big-body clients: a separate, niced process --------------------------------------------
def _send_big(
    url: str, kind: str, size: int, clients: int, stop: Any, done: Synchronized[int], statuses: Any
) -> None:
    """Entry point of the sender process: `clients` loops, each posting big bodies back to back."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
    body = big_body(kind, size)

    async def chunks() -> Any:  # no content-length: Envoy sends it to the main process, whatever its size
        for at in range(0, len(body), 1 << 20):
            yield body[at : at + (1 << 20)]

    async def loop(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            data: Any = chunks() if kind == "messages" else body
            try:
                async with session.post(url, data=data, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError):
                status = 0
            with done.get_lock():
                done.value += 1
            statuses.put(status)

    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(loop(session) for _ in range(clients)))

    asyncio.run(main())


class BigSender:
    """The sender process and what it reports."""

    def __init__(self, url: str, kind: str, size: int, clients: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._done: Synchronized[int] = ctx.Value("i", 0)
        self._statuses = ctx.Queue()
        self._proc = ctx.Process(
            target=_send_big,
            args=(url, kind, size, clients, self._stop, self._done, self._statuses),
            daemon=True,
        )

    def start(self) -> None:
        self._proc.start()

    @property
    def done(self) -> int:
        return self._done.value

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self, timeout: float = 60.0) -> dict[str, int]:
        self._stop.set()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
        counts: dict[str, int] = {}
        while True:
            try:
                status = self._statuses.get(timeout=0.2)
            except Exception:
                break
            counts[str(status)] = counts.get(str(status), 0) + 1
        return counts


# -- small requests: open loop ---------------------------------------------------------------------
@dataclass(slots=True)
class Probe:
    started: float
    latency_s: float
    status: int


async def probe(url: str, seconds: float, rate: float) -> list[Probe]:
    """Small requests at `rate` per second for `seconds`, each on its own task (open loop)."""
    results: list[Probe] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> None:
            t0 = time.perf_counter()
            status = 0
            try:
                async with session.post(
                    url, data=SMALL_BODY, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError):
                pass
            results.append(Probe(time.time(), time.perf_counter() - t0, status))

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        n = 0
        while (elapsed := time.perf_counter() - start) < seconds:
            tasks.append(asyncio.create_task(one()))
            n += 1
            await asyncio.sleep(max(0.0, n / rate - elapsed))
        await asyncio.gather(*tasks)
    return results


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def latency_summary(probes: list[Probe]) -> dict[str, Any]:
    ok = [p.latency_s * 1000 for p in probes if p.status == 200]
    statuses: dict[str, int] = {}
    for p in probes:
        if p.status != 200:
            statuses[str(p.status)] = statuses.get(str(p.status), 0) + 1
    return {
        "requests": len(probes),
        "p50_ms": round(_pct(ok, 0.5), 2),
        "p99_ms": round(_pct(ok, 0.99), 2),
        "max_ms": round(max(ok, default=0.0), 2),
        "errors": statuses,
    }


# -- the service's memory --------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` in MiB (0 when it is gone or /proc is absent)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def service_rss(pid: int) -> dict[str, float]:
    workers = _children(pid)
    return {"service_mb": round(rss_mb(pid), 1), "workers_mb": round(sum(rss_mb(w) for w in workers), 1)}


class RssSampler:
    """The service's peak RSS while a phase runs."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak = {"service_mb": 0.0, "workers_mb": 0.0}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            now = service_rss(self.pid)
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            await asyncio.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


# -- Envoy's view of the small requests ------------------------------------------------------------
def ext_proc_times(envoy_log: Path, cluster: str, since: float, until: float) -> dict[str, Any]:
    """ext_proc time (headers + body round trips, ms) of the requests Envoy sent to `cluster`
    between two wall-clock times, from the shipped envoy.yaml's JSON access log."""
    values: list[float] = []
    if envoy_log.exists():
        for line in envoy_log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("cluster") != cluster:
                continue
            try:
                stamp = datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()
            except (KeyError, ValueError):
                continue
            if not since <= stamp <= until:
                continue
            total = 0.0
            for key in ("ext_proc_header_us", "ext_proc_body_us"):
                with contextlib.suppress(TypeError, ValueError):
                    total += float(entry.get(key)) / 1000
            values.append(total)
    return {
        "requests": len(values),
        "p50_ms": round(_pct(values, 0.5), 2),
        "p99_ms": round(_pct(values, 0.99), 2),
    }


# -- the stack ---------------------------------------------------------------------------------------
def _port_pair() -> int:
    """A free port whose successor is free too (`llm-extproc sim` serves on port, port + 1...)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Engines:
    """Simulated engines answering at once (`llm-extproc sim`, fixed cost), one process, niced."""

    def __init__(self, log_path: Path, model: str) -> None:
        self.port = _port_pair()
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "extproc.cli",
                "sim",
                "--model",  # engines answer 404 for a model they do not serve, as vLLM does
                model,
                "--port",
                str(self.port),
                "--count",
                "1",
                "--token-delay-ms",
                "0",
                "--max-batch",
                "0",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, NICE)
        wait_port("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def service_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shipped service config without Redis: big bodies' model on gpu-a, small on gpu-b."""
    cfg: dict[str, Any] = yaml.safe_load((ENVOY_DIR / "llm-extproc.yaml").read_text())
    cfg.pop("fleet", None)
    cfg["pool"] = {
        "clusters": [
            {"name": "gpu-a", "models": [BIG_MODEL]},
            {"name": "gpu-b", "models": [SMALL_MODEL]},
        ]
    }
    cfg.update(overrides or {})
    return cfg


async def run_phase(
    gw: LocalGateway,
    *,
    kind: str | None,
    clients: int,
    size: int,
    seconds: float,
    rate: float,
    settle_s: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Small requests for `seconds`, alone (`kind` None) or during a storm of big bodies."""
    assert gw.service.proc is not None
    pid = gw.service.proc.pid
    url = gw.url + "/v1/chat/completions"
    before = service_rss(pid)
    sender = None
    if kind is not None:
        sender = BigSender(url, kind, size, clients)
        sender.start()
        deadline = time.monotonic() + 60
        while sender.done == 0:  # wait until the storm is on
            if not sender.alive or time.monotonic() > deadline:
                sender.stop()
                raise RuntimeError("the big-body sender did not get an answer within 60 s (or died)")
            await asyncio.sleep(0.1)
    since = time.time()
    with RssSampler(pid) as sampler:
        probes = await probe(url, seconds, rate)
    until = time.time()
    big: dict[str, int] = {}
    if sender is not None:
        big = sender.stop()
    await asyncio.sleep(settle_s)
    small = latency_summary(probes)
    after = service_rss(pid)
    result: dict[str, Any] = {
        "kind": kind or "none",
        "big_clients": clients if kind else 0,
        "small": small,
        "small_ext_proc": ext_proc_times(gw.workdir / "envoy.log", "gpu-b", since, until),
        "big_statuses": big,
        "rss_before": before,
        "rss_peak": sampler.peak,
        "rss_after": after,
    }
    log(
        f"{result['kind']:>6}: small p50 {small['p50_ms']:.1f} ms p99 {small['p99_ms']:.1f} ms "
        f"max {small['max_ms']:.1f} ms errors {small['errors'] or 0}; big {big or '-'}; "
        f"RSS {before['service_mb']:.0f} -> peak {sampler.peak['service_mb']:.0f} -> "
        f"{after['service_mb']:.0f} MiB (+ workers {after['workers_mb']:.0f})"
    )
    return result


async def run_big_bodies_bench(
    out_dir: Path,
    *,
    kinds: tuple[str, ...] = KINDS,
    clients: int = 8,
    size_mb: float = 15.0,
    seconds: float = 15.0,
    rate: float = 20.0,
    settle_s: float = 5.0,
    service: dict[str, Any] | None = None,
    layouts: tuple[str, ...] = LAYOUTS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the phases (baseline, then one storm per kind) for each layout, one after the other in this
    run; write `big-bodies.json` under out_dir. Layouts: `single` (one service process does
    everything) and `bulk` (envoy.yaml's big-body route sends bodies >= 1 MiB to a second,
    niced `serve --role bulk` process)."""
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise ValueError(f"unknown layouts {bad}; known: {', '.join(LAYOUTS)}")
    find_envoy()
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown body kinds {unknown}; known: {', '.join(KINDS)}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    size = int(size_mb * 1_000_000)
    big_engine, small_engine = (
        Engines(out_dir / "engines-big.log", BIG_MODEL),
        Engines(out_dir / "engines-small.log", SMALL_MODEL),
    )
    cfg = service_config(service)
    phases: list[dict[str, Any]] = []
    try:
        for layout in layouts:
            log(f"layout {layout}")
            gw = LocalGateway(
                out_dir / f"gateway-{layout}",
                clusters={"gpu-a": [big_engine.port], "gpu-b": [small_engine.port]},
                service=cfg,
                bulk=layout == "bulk",
            )
            ran: list[dict[str, Any]] = []
            try:
                gw.start()
                url = gw.url + "/v1/chat/completions"
                await probe(url, 2.0, rate)  # warm-up
                phase_kinds: list[str | None] = [None, *kinds]
                for kind in phase_kinds:
                    ran.append(
                        await run_phase(
                            gw,
                            kind=kind,
                            clients=clients,
                            size=size,
                            seconds=seconds,
                            rate=rate,
                            settle_s=settle_s,
                            log=log,
                        )
                    )
            finally:
                gw.stop()
            base = ran[0]["small"]
            for phase in ran:
                phase["layout"] = layout
            for phase in ran[1:]:
                phase["added_p50_ms"] = round(phase["small"]["p50_ms"] - base["p50_ms"], 2)
                phase["added_p99_ms"] = round(phase["small"]["p99_ms"] - base["p99_ms"], 2)
                phase["big_504"] = phase["big_statuses"].get("504", 0)
            phases.extend(ran)
    finally:
        big_engine.stop()
        small_engine.stop()
    report = {
        "body_bytes": size,
        "big_clients": clients,
        "small_rate_per_s": rate,
        "seconds_per_phase": seconds,
        "cpus": os.cpu_count(),
        "service_overrides": service or {},
        "phases": phases,
    }
    path = out_dir / "big-bodies.json"
    path.write_text(json.dumps(report, indent=2))
    for phase in (p for p in phases if p["kind"] != "none"):
        log(
            f"{phase['layout']:>6} {phase['kind']:>6}: added p50 {phase['added_p50_ms']:+.1f} ms, added p99 "
            f"{phase['added_p99_ms']:+.1f} ms, 504s {phase['big_504']}"
        )
    log(f"results: {path}")
    return report
