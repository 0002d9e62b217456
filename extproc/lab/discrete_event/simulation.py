"""Discrete-event mode: hundreds of simulated engines in virtual time, no sockets.

The `llm-extproc` policy is the service's own code path, not a copy: every request goes through
`RequestLifecycle.route()` (OpenAI parsing, admission, the configured scheduling profile), and the
fleet view is fed with real `UpstreamSnapshot` bytes built from the engines' state every
`publish_interval_s`, exactly as `llm-extproc publish` would write them. Reference policies read the
engines' exact state instead:

- `exact-ttft`: greedy least predicted TTFT from exact state (queue and prefix-cache contents). It
  optimises each request's own TTFT at its arrival; under KV-cache pressure this scatters tenants
  across engines and loses cache reuse, so it is a reference, not a bound.
- `clairvoyant-affinity`: knows the whole workload in advance; packs request groups (tenants,
  conversations: the workload's tags) onto engines by their total prompt tokens (largest first, onto
  the least-loaded engine) and sends every request of a group to its engine. Perfect prefix locality
  with balanced total work: a stronger reference for cache-heavy workloads, still not a proven bound
  (it ignores burstiness within the run).
- `round-robin`, `least-request` (exact outstanding counts, like an ideal least-connections).
- `sglang-cache-aware`, `vllm-router-cache-aware`: the peers' `cache_aware` policies (approximate
  character radix tree learned from their own decisions, load-imbalance fallback), written from their
  documentation in `references.py`, with their command-line defaults.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from extproc.config import config_from_dict
from extproc.fleet import FleetView, decode
from extproc.fleet import snapshot_pb2 as spb
from extproc.lab.bench.report import RequestRecord
from extproc.lab.discrete_event.references import (
    SGLANG_CACHE_AWARE,
    VLLM_ROUTER_CACHE_AWARE,
    CacheAwareConfig,
    CacheAwareRouter,
    routing_text,
)
from extproc.lab.engines.model import EngineModel, StepResult
from extproc.lab.engines.profiles import GpuProfile
from extproc.lab.engines.tokens import chat_to_tokens, message_tokens
from extproc.lifecycle import Decision, RequestLifecycle
from extproc.openai import RequestError
from extproc.openai.parse import parse_head
from extproc.settings import DEFAULT_PROFILE
from extproc.telemetry import Metrics

Request = tuple[float, dict[str, Any], str]  # (arrival_s, OpenAI chat body, tag)


@dataclass(slots=True)
class Pending:
    index: int
    tag: str
    arrival: float
    tokens: list[int]
    max_tokens: int
    engine: int = -1
    ttft: float | None = None
    decision: Decision | None = None  # the llm-extproc policy's, holding its in-flight lease


class Policy(Protocol):
    name: str

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int: ...

    def finished(self, req: Pending) -> None: ...


@dataclass
class Fleet:
    engines: list[EngineModel]
    outstanding: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outstanding = [0] * len(self.engines)


class RoundRobin:
    name = "round-robin"

    def __init__(self, fleet: Fleet) -> None:
        self._next = itertools.cycle(range(len(fleet.engines)))

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        return next(self._next)

    def finished(self, req: Pending) -> None:
        pass


class LeastRequest:
    name = "least-request"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        out = self.fleet.outstanding
        return min(range(len(out)), key=lambda i: (out[i], i))

    def finished(self, req: Pending) -> None:
        pass


class ExactTtft:
    name = "exact-ttft"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        engines = self.fleet.engines
        return min(range(len(engines)), key=lambda i: (engines[i].predicted_ttft(req.tokens, now), i))

    def finished(self, req: Pending) -> None:
        pass


class PeerCacheAware:
    """A peer router's `cache_aware` policy (references.py) over the router's own outstanding counts."""

    def __init__(self, fleet: Fleet, name: str, config: CacheAwareConfig) -> None:
        self.name = name
        self.fleet = fleet
        self.router = CacheAwareRouter(len(fleet.engines), config)

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        return self.router.choose(routing_text(body), self.fleet.outstanding, now)

    def finished(self, req: Pending) -> None:
        pass


class ClairvoyantAffinity:
    name = "clairvoyant-affinity"

    def __init__(
        self, fleet: Fleet, requests: Sequence[Request], tokens: Sequence[Sequence[int]] | None = None
    ) -> None:
        work: dict[str, int] = {}
        for i, (_, body, tag) in enumerate(requests):
            n = len(tokens[i]) if tokens is not None else len(chat_to_tokens(body["messages"]))
            work[tag] = work.get(tag, 0) + n + int(body.get("max_tokens") or 0)
        load = [(0, i) for i in range(len(fleet.engines))]
        heapq.heapify(load)
        self.home: dict[str, int] = {}
        for tag, w in sorted(work.items(), key=lambda kv: (-kv[1], kv[0])):
            total, i = heapq.heappop(load)
            self.home[tag] = i
            heapq.heappush(load, (total + w, i))

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        return self.home[req.tag]

    def finished(self, req: Pending) -> None:
        pass


SEEDED_PICKER = {"name": "max-score", "params": {"seed": 0}}


class ExtprocPolicy:
    """The service's RequestLifecycle over a FleetView fed by snapshots of the simulated engines."""

    name = "llm-extproc"

    def __init__(
        self, fleet: Fleet, model: str, service: dict[str, Any] | None, clock: Callable[[], float]
    ) -> None:
        self.fleet = fleet
        n = len(fleet.engines)
        raw: dict[str, Any] = {
            "pool": {"clusters": [{"name": f"engine-{i}", "models": [model]} for i in range(n)]},
            "metrics_listen": None,
            # The default profile with its random tie-breaks seeded: a run is repeatable.
            "scheduling": {"profiles": {"default": {**DEFAULT_PROFILE, "picker": SEEDED_PICKER}}},
            **(service or {}),
        }
        self.config = config_from_dict(raw)
        self.metrics = Metrics([model], [f"engine-{i}" for i in range(n)])
        self.view = FleetView(self.config.pool, clock=clock)
        self.lifecycle = RequestLifecycle(self.config, self.metrics, self.view)
        self.head = parse_head(
            {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
            session_header="x-session-id",
            user_header="x-user-id",
            priority_header="x-llm-priority",
        )
        self.sequence = 0

    def publish(self, now: float, ttl_s: float) -> None:
        """What `llm-extproc publish` would write for every engine at `now`, through decode()."""
        for i, e in enumerate(self.fleet.engines):
            self.sequence += 1
            snap = spb.UpstreamSnapshot(
                upstream_id=f"engine-{i}/10.0.{i // 250}.{i % 250 + 1}:8000",
                cluster=f"engine-{i}",
                address=f"10.0.{i // 250}.{i % 250 + 1}:8000",
                engine="sim",
                readiness=spb.READY if e.ready(now) else spb.WARMING_UP,
                num_running=e.num_running,
                num_waiting=e.num_waiting,
                kv_cache_usage=e.kv_usage,
                kv_blocks_total=e.profile.num_gpu_blocks,
                kv_blocks_free=e.free_blocks,
                block_size=e.profile.block_size,
                max_model_len=e.profile.max_model_len,
                publisher_id="des",
                sequence=self.sequence,
                published_at_ms=int(now * 1000) + 1,
                ttl_ms=max(100, int(ttl_s * 1000)),
            )
            self.view.apply(decode(snap.SerializeToString(), self.view.known_clusters, now=now))
        self.view.rebuild()

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        req.decision = self.lifecycle.route(self.head, orjson.dumps(body))
        return int(req.decision.upstream.cluster.removeprefix("engine-"))

    def finished(self, req: Pending) -> None:
        if req.decision is not None:
            self.lifecycle.finish(req.decision, "response_end")


@dataclass(slots=True)
class DesRun:
    policy: str
    records: list[RequestRecord]
    virtual_s: float
    wall_s: float


POLICIES = (
    "llm-extproc",
    "round-robin",
    "least-request",
    "sglang-cache-aware",
    "vllm-router-cache-aware",
    "exact-ttft",
    "clairvoyant-affinity",
)
PEER_CONFIGS: dict[str, CacheAwareConfig] = {
    "sglang-cache-aware": SGLANG_CACHE_AWARE,
    "vllm-router-cache-aware": VLLM_ROUTER_CACHE_AWARE,
}


def tokenize_requests(requests: Sequence[Request]) -> list[list[int]]:
    """Every request's prompt token ids, tokenizing each distinct message once (system prompts and chat
    histories repeat across requests): the same ids as `chat_to_tokens`, much faster for a workload."""
    cache: dict[tuple[str, str], list[int]] = {}
    out: list[list[int]] = []
    for _, body, _ in requests:
        ids: list[int] = []
        for message in body["messages"]:
            role, content = str(message.get("role", "")), message.get("content")
            if isinstance(content, str):
                key = (role, content)
                part = cache.get(key)
                if part is None:
                    part = cache[key] = message_tokens(role, content)
                ids.extend(part)
            else:
                ids.extend(message_tokens(role, content))
        ids.extend(_GENERATION_PROMPT)
        out.append(ids)
    return out


_GENERATION_PROMPT = chat_to_tokens([], add_generation_prompt=True)


def simulate(
    requests: Sequence[Request],
    profiles: Sequence[GpuProfile],
    policy: str,
    *,
    model: str = "sim-llama",
    publish_interval_s: float = 1.0,
    service: dict[str, Any] | None = None,
    tokens: Sequence[list[int]] | None = None,
    peer_configs: dict[str, CacheAwareConfig] | None = None,
) -> DesRun:
    """Run one policy over the workload on fresh engines; every request gets a record.

    `tokens` (from `tokenize_requests`) saves re-tokenizing the same workload for every policy;
    `peer_configs` overrides the peers' cache_aware parameters by policy name."""
    started = time.perf_counter()
    fleet = Fleet([EngineModel(p) for p in profiles])
    now = 0.0
    chosen: Policy
    extproc: ExtprocPolicy | None = None
    if policy == "llm-extproc":
        extproc = ExtprocPolicy(fleet, model, service, clock=lambda: now)
        chosen = extproc
    elif policy == "round-robin":
        chosen = RoundRobin(fleet)
    elif policy == "least-request":
        chosen = LeastRequest(fleet)
    elif policy == "exact-ttft":
        chosen = ExactTtft(fleet)
    elif policy == "clairvoyant-affinity":
        chosen = ClairvoyantAffinity(fleet, requests, tokens)
    elif policy in PEER_CONFIGS:
        chosen = PeerCacheAware(
            fleet, policy, (peer_configs or PEER_CONFIGS).get(policy, PEER_CONFIGS[policy])
        )
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")

    # Event queue: (time, order, kind, payload). Kinds: 0 publish, 1 step end, 2 arrival.
    seq = itertools.count()
    events: list[tuple[float, int, int, int]] = []
    for i, (arrival, _, _) in enumerate(requests):
        heapq.heappush(events, (arrival, next(seq), 2, i))
    if extproc is not None:
        heapq.heappush(events, (0.0, next(seq), 0, 0))
    stepping = [False] * len(fleet.engines)
    pending: dict[str, Pending] = {}
    records: list[RequestRecord] = []
    remaining = len(requests)

    step_results: dict[int, StepResult] = {}  # the step each busy engine is running

    def start_step(i: int, t: float) -> None:
        result = fleet.engines[i].step(t)
        if result is None:
            stepping[i] = False
            return
        stepping[i] = True
        heapq.heappush(events, (t + result.duration, next(seq), 1, i))
        step_results[i] = result

    while events and remaining > 0:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0 and extproc is not None:
            extproc.publish(now, ttl_s=3 * publish_interval_s)
            heapq.heappush(events, (now + publish_interval_s, next(seq), 0, 0))
        elif kind == 2:
            arrival, body, tag = requests[payload]
            prompt = tokens[payload] if tokens is not None else chat_to_tokens(body["messages"])
            req = Pending(payload, tag, arrival, prompt, int(body.get("max_tokens") or 16))
            try:
                engine = chosen.choose(req, body, now)
                fleet.engines[engine].submit(str(payload), prompt, req.max_tokens, now)
            except (RequestError, ValueError) as exc:
                status = exc.status if isinstance(exc, RequestError) else 400
                records.append(_failed(req, status, str(exc)[:80]))
                chosen.finished(req)
                remaining -= 1
                continue
            req.engine = engine
            fleet.outstanding[engine] += 1
            pending[str(payload)] = req
            if not stepping[engine]:
                start_step(engine, now)
        elif kind == 1:
            result = step_results.pop(payload)
            for ev in result.first_tokens:
                pending[ev.request_id].ttft = ev.ttft
            for done in result.finished:
                req = pending.pop(done.request_id)
                fleet.outstanding[req.engine] -= 1
                chosen.finished(req)
                remaining -= 1
                records.append(
                    RequestRecord(
                        tag=req.tag,
                        served_by=f"engine-{req.engine}",
                        status=200,
                        error=None,
                        arrival_s=req.arrival,
                        ttft_s=done.ttft,
                        e2e_s=done.latency,
                        prompt_tokens=done.prompt_tokens,
                        completion_tokens=done.completion_tokens,
                        cached_tokens=done.cached_tokens,
                    )
                )
            start_step(payload, now)
    records.sort(key=lambda r: r.arrival_s)
    return DesRun(policy, records, now, time.perf_counter() - started)


def _failed(req: Pending, status: int, error: str) -> RequestRecord:
    return RequestRecord(
        tag=req.tag, served_by=None, status=status, error=error, arrival_s=req.arrival, ttft_s=None, e2e_s=0.0
    )


def run_simulations(
    *,
    workload: str,
    policies: Sequence[str],
    profiles: Sequence[str],
    engines: int,
    rate: float,
    count: int,
    seed: int = 0,
    slo: Any = None,
    publish_interval_s: float = 1.0,
    params: dict[str, Any] | None = None,
    out_dir: Any = None,
) -> int:
    """`llm-extproc simulate`: every policy over the same workload on fresh engines; table + JSON + PNGs."""
    from pathlib import Path

    from extproc.lab.bench.report import format_table, plot, summarize, write_json
    from extproc.lab.bench.workloads import make_workload
    from extproc.lab.engines.profiles import PROFILES

    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise ValueError(f"unknown profiles {unknown}; known: {sorted(PROFILES)}")
    fleet = [PROFILES[profiles[i % len(profiles)]] for i in range(engines)]
    wl = make_workload(workload, rate=rate, count=count, seed=seed, **(params or {}))
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    reports, by_policy = [], {}
    tokens = tokenize_requests(requests)
    for policy in policies:
        run = simulate(requests, fleet, policy, publish_interval_s=publish_interval_s, tokens=tokens)
        reports.append(
            summarize(
                policy, run.records, run.virtual_s, slo, instances=[f"engine-{i}" for i in range(engines)]
            )
        )
        by_policy[policy] = run.records
        print(f"  {policy}: {len(requests)} requests, {run.virtual_s:.0f} s simulated in {run.wall_s:.1f} s")
    print(format_table(reports))
    out = Path(out_dir or "out/simulate")
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "workload": wl.name,
        "params": wl.params,
        "engines": engines,
        "profiles": list(profiles),
        "publish_interval_s": publish_interval_s,
        "mode": "discrete-event (virtual time)",
    }
    path = write_json(out / f"{workload}.json", reports, meta)
    try:
        plot(out / workload, by_policy, slo=slo)
    except ImportError as exc:
        print(f"(no plots: {exc})")
    print(f"results: {path}")
    return 0
