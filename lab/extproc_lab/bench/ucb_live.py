"""The slowdown target live: one engine of four slowed 3x mid-run, then restored, through real processes.

Each policy gets its own four simulated engines (fixed-cost: `token_delay_s` per output token and per
256 prompt bytes, so a 3x larger delay is a 3x slower prefill and decode; the engines publish their
TTFT histogram, `vllm:time_to_first_token_seconds`, which the publisher turns into interval means):

- `latency-ucb`: Envoy + llm-extproc + Redis + publisher, profile latency-ucb (weight 2) + queue-depth (1),
  the one docs/tuning.md recommends;
- `default`: the same stack with the default profile (predicted-ttft);
- `envoy-round-robin`, `envoy-least-request`: Envoy alone over the same kind of engines.

All policies run at the same time, each in its own process (its own engines, stack, publisher and
Poisson stream of requests), and engine 0 of every fleet is slowed at the same moment and restored at
the same moment: the figures are side by side in one run (same machine load). Share: engine 0's share
of the requests sent in 5 s windows; baseline: its share between the warm-up and the slowdown;
"halved": first window (ending that long after the slowdown) at or below half of it; "regained": first
window after the restore at or above 80 % of it.

    python -m extproc_lab.bench.ucb_live --out out/ucb-live
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from extproc.publishers import InstanceSpec
from extproc_lab.bench.scenarios import MODEL, Baselines, _n_cluster_gateway, start_publisher
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway, local_redis


def ucb_profile(
    load_scorer: str = "queue-depth", half_life_s: float = 10.0, c: float = 0.3
) -> dict[str, Any]:
    """latency-ucb (weight 2) next to a load scorer (weight 1), as docs/tuning.md recommends."""
    return {
        "scorers": [
            {"name": "latency-ucb", "weight": 2.0, "params": {"c": c, "half_life_s": half_life_s}},
            {"name": load_scorer, "weight": 1.0},
        ],
        "picker": "max-score",
    }


# Service-side policies: name -> scheduling profile (None: the service's default profile).
PROFILES: dict[str, dict[str, Any] | None] = {
    "latency-ucb": ucb_profile(),
    "latency-ucb+least-outstanding": ucb_profile("least-outstanding"),
    "latency-ucb-half-life-5": ucb_profile(half_life_s=5.0),
    "default": None,
    "least-outstanding": {"scorers": ["least-outstanding"], "picker": "max-score"},
}
ENVOY_POLICIES = ("envoy-round-robin", "envoy-least-request")
POLICIES = (*PROFILES, *ENVOY_POLICIES)
DEFAULT_POLICIES = ("latency-ucb", "latency-ucb+least-outstanding", "default", "envoy-round-robin")
WINDOW_S = 5.0
KEEP_DECISIONS = 50  # /debug/decisions: saved next to the logs at each phase change


@dataclass(slots=True)
class Timeline:
    """Seconds from the start of the load: baseline from `warmup_s` to `slow_at`, engine 0 slow from
    `slow_at` to `restore_at`, then restored until `end`."""

    warmup_s: float = 10.0
    slow_at: float = 50.0
    restore_at: float = 110.0
    end: float = 185.0


@dataclass(slots=True)
class LiveSlowdown:
    policy: str
    requests: int
    errors: int
    baseline: float
    halved_after_s: float | None
    slowed_share: float  # from slow_at + 30 s to restore_at
    regained_after_s: float | None
    share_after: float  # from restore_at + 30 s to the end
    windows: list[tuple[float, float]] = field(default_factory=list)  # (window end, share)
    scrape_failures: int = 0  # publisher scrapes that failed (a loaded machine): each takes an
    # engine out of the candidates until its next good scrape, which disturbs the shares


@dataclass(slots=True)
class _Target:
    policy: str
    url: str
    group: EngineGroup
    workdir: Path
    debug_url: str | None = None  # /debug/decisions of the service, when there is one
    sent: list[tuple[float, str | None]] = field(default_factory=list)  # (at, engine name or None)

    def save_decisions(self, label: str) -> None:
        """The service's last decisions with every candidate's per-plugin scores (explain.keep_last)."""
        if self.debug_url is None:
            return
        try:
            with urllib.request.urlopen(self.debug_url, timeout=5) as r:
                (self.workdir / f"decisions-{label}.json").write_bytes(r.read())
        except OSError as exc:
            print(f"{self.policy}: /debug/decisions: {exc}")


async def _start(policy: str, workdir: Path, delay_s: float, stops: list[Any]) -> _Target:
    """The policy's own four engines, and Envoy alone or Envoy + service + Redis + publisher."""
    group = EngineGroup([delay_s] * 4, MODEL)
    stops.append(group.close)
    workdir.mkdir(parents=True, exist_ok=True)
    if policy.startswith("envoy-"):
        lb = {"envoy-round-robin": "ROUND_ROBIN", "envoy-least-request": "LEAST_REQUEST"}[policy]
        base = Baselines(workdir, group.ports, [lb])
        stops.append(base.stop)
        return _Target(policy, base.start()[0].url, group, workdir)
    redis, _ = local_redis(workdir / "redis.log")
    stops.append(redis.stop)
    clusters = {f"gpu-{i}": [p] for i, p in enumerate(group.ports)}
    gw: LocalGateway = _n_cluster_gateway(
        workdir,
        clusters,
        redis.url,
        PROFILES[policy],
        service_extra={"explain": {"keep_last": KEEP_DECISIONS}},
    )
    start_publisher(
        redis.url,
        [InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim") for c, p in clusters.items()],
        stops,
        interval_s=1.0,
        scrape_timeout_s=0.8,  # a loaded machine: a late scrape must not read as a dead engine
    )
    gw.start()
    stops.append(gw.stop)
    debug = f"http://127.0.0.1:{gw.metrics_port}/debug/decisions"
    return _Target(policy, gw.url, group, workdir, debug)


async def _drive(target: _Target, rate: float, t0: float, end: float, seed: int, max_tokens: int) -> int:
    """Poisson arrivals at `rate` until `end` s after `t0`; returns the number of errors."""
    rng = random.Random(seed)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 20}],
        "max_tokens": max_tokens,
    }
    errors = 0
    url = target.url + "/v1/chat/completions"

    async def one(session: aiohttp.ClientSession, at: float) -> None:
        nonlocal errors
        try:
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                target.sent.append((at, r.headers.get("x-sim-engine") if r.status == 200 else None))
        except (TimeoutError, aiohttp.ClientError):
            errors += 1
            target.sent.append((at, None))

    tasks = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        at = rng.expovariate(rate)
        while at < end:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, at)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return errors


def analyse(policy: str, sent: Sequence[tuple[float, str | None]], errors: int, tl: Timeline) -> LiveSlowdown:
    """Engine 0's share: baseline, when it halved, the slowed share, when it came back."""
    slow = "engine-0"

    def share(a: float, b: float) -> float:
        picks = [name for at, name in sent if a <= at < b and name is not None]
        return sum(1 for name in picks if name == slow) / max(1, len(picks))

    baseline = share(tl.warmup_s, tl.slow_at)
    halved = next(
        (k for k in range(1, 61) if share(tl.slow_at + k - WINDOW_S, tl.slow_at + k) <= baseline / 2), None
    )
    regained = next(
        (
            k
            for k in range(1, int(tl.end - tl.restore_at) + 1)
            if share(tl.restore_at + k - WINDOW_S, tl.restore_at + k) >= 0.8 * baseline
        ),
        None,
    )
    windows = []
    t = WINDOW_S
    while t <= tl.end:
        windows.append((t, round(share(t - WINDOW_S, t), 3)))
        t += WINDOW_S
    return LiveSlowdown(
        policy=policy,
        requests=len(sent),
        errors=errors,
        baseline=baseline,
        halved_after_s=None if halved is None else float(halved),
        slowed_share=share(tl.slow_at + 30, tl.restore_at),
        regained_after_s=None if regained is None else float(regained),
        share_after=share(tl.restore_at + 30, tl.end),
        windows=windows,
    )


async def run_policy(
    policy: str,
    workdir: Path,
    *,
    timeline: Timeline,
    rate: float,
    delay_s: float,
    factor: float,
    max_tokens: int,
    seed: int,
    go_file: Path | None = None,
) -> tuple[list[tuple[float, str | None]], int]:
    """One policy's stack and load (this process). With `go_file`: write `ready` in `workdir` once the
    stack is up, wait for the parent to write the common start time (unix seconds) there, so every
    policy's load (and its slowdown) starts at the same moment."""
    tl = timeline
    stops: list[Any] = []
    try:
        target = await _start(policy, workdir, delay_s, stops)
        await asyncio.sleep(2.0)  # first snapshots in, Envoy health checks passed
        start_at = time.time()
        if go_file is not None:
            (workdir / "ready").write_text("1")
            while not go_file.exists():
                await asyncio.sleep(0.05)
            start_at = float(go_file.read_text())
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        engine = target.group.engines[0]

        async def schedule() -> None:
            await asyncio.sleep(max(0.0, t0 + tl.slow_at - time.perf_counter()))
            engine.token_delay_s = delay_s * factor
            await asyncio.to_thread(target.save_decisions, "just-before-slowdown")
            await asyncio.sleep(max(0.0, t0 + tl.restore_at - time.perf_counter()))
            engine.token_delay_s = delay_s
            await asyncio.to_thread(target.save_decisions, "end-of-slowdown")

        timer = asyncio.create_task(schedule())
        errors = await _drive(target, rate, t0, tl.end, seed, max_tokens)
        await timer
        await asyncio.to_thread(target.save_decisions, "end")
        return target.sent, errors
    finally:
        for stop in reversed(stops):
            res = stop()
            if asyncio.iscoroutine(res):
                await res


def run(
    policies: Sequence[str] = DEFAULT_POLICIES,
    *,
    timeline: Timeline | None = None,
    rate: float = 12.0,
    delay_s: float = 0.02,
    factor: float = 3.0,
    max_tokens: int = 8,
    workdir: Path = Path("out/ucb-live/logs"),
    startup_timeout_s: float = 90.0,
) -> list[LiveSlowdown]:
    """Every policy at once, each in its own process (its own GIL: engines, publisher and load of one
    policy do not slow another's) on its own four engines; engine 0 of each slowed by `factor` at the
    same moment."""
    tl = timeline or Timeline()
    workdir.mkdir(parents=True, exist_ok=True)
    go = workdir / "go"
    go.unlink(missing_ok=True)
    children = []
    for seed, policy in enumerate(policies, 1):
        d = workdir / policy
        d.mkdir(parents=True, exist_ok=True)
        for f in ("ready", "sent.json"):
            (d / f).unlink(missing_ok=True)
        args = {
            "policy": policy,
            "timeline": asdict(tl),
            "rate": rate,
            "delay_s": delay_s,
            "factor": factor,
            "max_tokens": max_tokens,
            "seed": seed,
            "go": str(go),
        }
        log = (d / "child.log").open("wb")
        cmd = [
            sys.executable,
            "-m",
            "extproc_lab.bench.ucb_live",
            "--child",
            json.dumps(args),
            "--out",
            str(d),
        ]
        children.append((policy, d, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not all((d / "ready").exists() for _, d, _ in children):
            failed = [p for p, _, proc in children if proc.poll() is not None]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(
                    f"policies did not start: {failed or 'timeout'} (see {workdir}/*/child.log)"
                )
            time.sleep(0.1)
        go.write_text(repr(time.time() + 1.0))
        results = []
        for policy, d, proc in children:
            if proc.wait(tl.end + 120) != 0:
                raise RuntimeError(f"{policy} failed (see {d}/child.log)")
            doc = json.loads((d / "sent.json").read_text())
            sent = [(float(at), name) for at, name in doc["sent"]]
            result = analyse(policy, sent, int(doc["errors"]), tl)
            result.scrape_failures = (d / "child.log").read_text(errors="replace").count("READY -> ")
            results.append(result)
        return results
    finally:
        for _, _, proc in children:  # SIGINT: the child's cleanup stops its Envoy, service and Redis
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for _, _, proc in children:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _child(raw: str, out: Path) -> int:
    args = json.loads(raw)
    sent, errors = asyncio.run(
        run_policy(
            args["policy"],
            out,
            timeline=Timeline(**args["timeline"]),
            rate=args["rate"],
            delay_s=args["delay_s"],
            factor=args["factor"],
            max_tokens=args["max_tokens"],
            seed=args["seed"],
            go_file=Path(args["go"]),
        )
    )
    (out / "sent.json").write_text(json.dumps({"sent": sent, "errors": errors}))
    return 0


def _s(value: float | None) -> str:
    return "not within the window" if value is None else f"{value:.0f} s"


def markdown(results: Sequence[LiveSlowdown], tl: Timeline, rate: float, factor: float) -> str:
    lines = [
        f"Live: 4 simulated engines per policy, engine-0 {factor:g}x slower from {tl.slow_at:g} s to "
        f"{tl.restore_at:g} s, {rate:g} req/s per policy (Poisson), all policies at once",
        "",
        "| policy | requests | errors | baseline share | halved after | share, slowed (from +30 s) "
        "| regained after | share, from restore +30 s | failed scrapes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.requests} | {r.errors} | {r.baseline:.3f} | {_s(r.halved_after_s)} "
            f"| {r.slowed_share:.3f} | {_s(r.regained_after_s)} | {r.share_after:.3f} | {r.scrape_failures} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One engine slowed 3x, live, side by side (latency-ucb et al.)")
    p.add_argument(
        "--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated, from: " + ", ".join(POLICIES)
    )
    p.add_argument("--rate", type=float, default=12.0, help="requests per second per policy")
    p.add_argument("--factor", type=float, default=3.0, help="how much slower engine-0 gets")
    p.add_argument("--slow-at", type=float, default=50.0, help="seconds into the load")
    p.add_argument("--restore-at", type=float, default=110.0, help="seconds into the load")
    p.add_argument("--end", type=float, default=185.0, help="seconds of load")
    p.add_argument("--out", default="out/ucb-live", help="output folder (ucb_live.json, .md, logs/)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one policy's process (JSON arguments)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, Path(args.out))
    policies = [x for x in args.policies.split(",") if x]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}")
    tl = Timeline(slow_at=args.slow_at, restore_at=args.restore_at, end=args.end)
    out = Path(args.out)
    load_before = os.getloadavg()
    results = run(policies, timeline=tl, rate=args.rate, factor=args.factor, workdir=out / "logs")
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "load_average_before_after": [load_before, os.getloadavg()],
        "cpus": os.cpu_count(),
        "timeline": asdict(tl),
        "rate": args.rate,
        "factor": args.factor,
        "profiles": {p: PROFILES.get(p, "envoy") for p in policies},
    }
    (out / "ucb_live.json").write_text(
        json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2)
    )
    text = markdown(results, tl, args.rate, args.factor)
    (out / "ucb_live.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
