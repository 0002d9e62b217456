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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from extproc.config import ServiceConfig, config_from_dict
from extproc.fleet import FleetView, RemoteInFlight, decode
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.kv_index import KvIndex, decode_delta, encode_delta
from extproc.lifecycle import Decision, RequestLifecycle
from extproc.lifecycle.admission import Verdict, Waiter
from extproc.openai import InferenceRequest, RequestError, RequestHead
from extproc.openai.parse import parse_head
from extproc.publishers.kv_events import BlockTranslator
from extproc.publishers.prefill_rate import PrefillRate
from extproc.server.sync import ReplicaSync
from extproc.settings import DEFAULT_PROFILE
from extproc.telemetry import Metrics
from extproc_lab.bench.report import RequestRecord
from extproc_lab.discrete_event.references import (
    SGLANG_CACHE_AWARE,
    VLLM_ROUTER_CACHE_AWARE,
    CacheAwareConfig,
    CacheAwareRouter,
    routing_text,
)
from extproc_lab.engines.model import EngineModel, StepResult
from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.engines.tokens import chat_to_tokens, message_tokens

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
    replica: int = 0  # which llm-extproc replica routed it (replicas > 1)
    headers: dict[str, str] | None = None  # the request's own headers (priority, user, objective)
    request: InferenceRequest | None = None  # prepared by ExtprocPolicy.admit
    waiter: Waiter | None = None  # its place in the admission queue while it waits
    queued_s: float = 0.0  # time spent in the admission queue, added to its TTFT and E2E


class Policy(Protocol):
    name: str

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int: ...

    def finished(self, req: Pending) -> None: ...


@dataclass
class Fleet:
    engines: list[EngineModel]
    outstanding: list[int] = field(default_factory=list)
    # Per engine, its tokenizer where it counts differently from the workload's (None: the same).
    recount: Sequence[Callable[[list[int]], list[int]]] | None = None

    def __post_init__(self) -> None:
        self.outstanding = [0] * len(self.engines)

    def prompt(self, req: Pending, engine: int) -> list[int]:
        """`req`'s prompt in engine `engine`'s tokens."""
        return req.tokens if self.recount is None else self.recount[engine](req.tokens)


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
        prompt = self.fleet.prompt
        return min(range(len(engines)), key=lambda i: (engines[i].predicted_ttft(prompt(req, i), now), i))

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
_BASE_HEADERS = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


@dataclass(slots=True)
class _Replica:
    """One llm-extproc process: its own config (plugin instances), view and lifecycle."""

    config: ServiceConfig
    metrics: Metrics
    view: FleetView
    lifecycle: RequestLifecycle
    sync: ReplicaSync | None = None
    last_sent: float = -1e9
    flush_at: float | None = None  # when its next sync message is scheduled (None: none is)
    news: bool = False  # routed or finished something since its last message
    next_state: float = 0.0  # when it next dumps its state (and refreshes its agreement sketch)

    def mark(self) -> None:
        """InFlight.watch callback: a pick or a finish to publish (as server/sync.py is woken)."""
        self.news = True


class ExtprocPolicy:
    """The service's RequestLifecycle over a FleetView fed by snapshots of the simulated engines.

    With `replicas` > 1, that many independent service processes (each its own profile, view and
    counts) take the requests in turn, as behind one Envoy; with `share`, they exchange the real
    replica-sync messages (server/sync.py) when `sync()` is called, delivered by the simulation."""

    name = "llm-extproc"

    def __init__(
        self,
        fleet: Fleet,
        model: str,
        service: dict[str, Any] | None,
        clock: Callable[[], float],
        replicas: int = 1,
        share: bool = True,
        token_ids: bool = False,
        prefill_counters: bool = True,
        gpu_names: str = "right",
        max_num_seqs: bool = False,
    ) -> None:
        self.fleet = fleet
        self.token_ids = token_ids
        self.prefill_counters = prefill_counters
        self.gpu_names = gpu_names
        self.max_num_seqs = max_num_seqs
        n = len(fleet.engines)
        self.replicas: list[_Replica] = []
        for r in range(max(1, replicas)):
            # The default profile with its random tie-breaks seeded (per replica): a run is repeatable.
            picker = {**SEEDED_PICKER, "params": {"seed": r}}
            raw: dict[str, Any] = {
                "pool": {"clusters": [{"name": f"engine-{i}", "models": [model]} for i in range(n)]},
                "metrics_listen": None,
                "scheduling": {"profiles": {"default": {**DEFAULT_PROFILE, "picker": picker}}},
                # Off (the service's default too) unless the run asks for it (`service={"admission":
                # {"enabled": True, ...}}`): the routing benches compare placement with every
                # request served, as the references serve them.
                "admission": {"enabled": False},
                **(service or {}),
            }
            config = config_from_dict(raw)
            metrics = Metrics([model], [f"engine-{i}" for i in range(n)])
            view = FleetView(config.pool, clock=clock)
            lifecycle = RequestLifecycle(config, metrics, view)
            lifecycle.admission.clock = clock  # queue waits in virtual seconds (admission_wait)
            replica = _Replica(config, metrics, view, lifecycle)
            if replicas > 1 and share:
                remote = RemoteInFlight(config.sync.expire_s, clock=clock)
                replica.lifecycle.state.share(remote)
                replica.lifecycle.admission.peer_critical_rate = remote.critical_rate
                replica.lifecycle.admission.peer_waiting = remote.waiting
                replica.lifecycle.admission.on_queue_change = replica.mark
                replica.sync = ReplicaSync(
                    f"r{r}",
                    config.profiles,
                    replica.lifecycle.inflight,
                    remote,
                    metrics,
                    config.sync,
                    clock=clock,
                    critical_rates=replica.lifecycle.admission.own_critical_rates,
                    waiting=replica.lifecycle.admission.own_waiting,
                )
                replica.lifecycle.inflight.watch(replica.mark)
            self.replicas.append(replica)
        first = self.replicas[0]
        self.config, self.metrics, self.view, self.lifecycle = (
            first.config,
            first.metrics,
            first.view,
            first.lifecycle,
        )
        self._turn = itertools.cycle(range(len(self.replicas)))
        self.head = parse_head(
            {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
            session_header="x-session-id",
            user_header="x-user-id",
            priority_header="x-llm-priority",
        )
        self.sequence = 0
        self._prefill_rates = [PrefillRate() for _ in fleet.engines]
        self._itl_seen = [(0.0, 0) for _ in fleet.engines]  # inter-token (sum, count) at the last publish
        self._ttft_seen = [(0.0, 0) for _ in fleet.engines]  # first-token (sum, count) at the last publish

    def publish(self, now: float, ttl_s: float) -> None:
        """What `llm-extproc publish` would write for every engine at `now`, through decode()."""
        for i, e in enumerate(self.fleet.engines):
            self.sequence += 1
            # The publisher's estimate from the counters a scrape would read (vLLM's names).
            rate = None
            if self.prefill_counters:
                rate = self._prefill_rates[i].update(
                    e.prompt_tokens_total, e.prefix_cache_hits, e.prefill_time_sum, e.preemptions_total
                )
            snap = spb.UpstreamSnapshot(
                upstream_id=f"engine-{i}/{_address(i)}",
                cluster=f"engine-{i}",
                address=_address(i),
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
                gpu_model=_gpu_name(e.profile.gpu, i, self.gpu_names),
            )
            if rate is not None:
                snap.prefill_tokens_per_s = rate
            if self.max_num_seqs:  # the publisher's `max_num_seqs:` configured to the engine's
                snap.max_num_seqs = e.profile.max_num_seqs
            # The engine's counters as the publisher copies them (vLLM's prompt_tokens_total and
            # time_to_first_token_seconds histogram); the prompt counter goes with the prefill ones.
            snap.first_tokens_total = e.ttft_count
            snap.ttft_seconds_total = e.ttft_sum
            if self.prefill_counters:
                snap.prompt_tokens_total = e.prompt_tokens_total
            # The publisher's TPOT: the mean inter-token gap over the interval since the last scrape.
            itl_sum, itl_count = self._itl_seen[i]
            if e.itl_count > itl_count:
                snap.tpot_seconds = (e.itl_sum - itl_sum) / (e.itl_count - itl_count)
            self._itl_seen[i] = (e.itl_sum, e.itl_count)
            # And its TTFT: the mean over the requests whose first token came in the interval.
            ttft_sum, ttft_count = self._ttft_seen[i]
            if e.ttft_count > ttft_count:
                snap.ttft_seconds = (e.ttft_sum - ttft_sum) / (e.ttft_count - ttft_count)
            self._ttft_seen[i] = (e.ttft_sum, e.ttft_count)
            data = snap.SerializeToString()
            for replica in self.replicas:
                replica.view.apply(decode(data, replica.view.known_clusters, now=now))
        for replica in self.replicas:
            replica.view.rebuild()

    def choose(self, req: Pending, body: dict[str, Any], now: float) -> int:
        if req.request is None:  # not through admit(): RequestLifecycle.route()'s steps, in order
            req.replica = next(self._turn)
            lifecycle = self.replicas[req.replica].lifecycle
            req.request = self._prepare(lifecycle, req, body)
            lifecycle.admission.admit_now(req.request)
        req.decision = self.replicas[req.replica].lifecycle.schedule(req.request)
        return int(req.decision.upstream.cluster.removeprefix("engine-"))

    def _prepare(self, lifecycle: RequestLifecycle, req: Pending, body: dict[str, Any]) -> InferenceRequest:
        request = lifecycle.prepare(self._head(lifecycle, req), orjson.dumps(body))
        if self.token_ids:
            # What the service has when `tokenizers:` holds the engines' own tokenizer: the ids the
            # engine will see (needed to match the engines' KV events); the first engine's where
            # engines count differently.
            ids = self.fleet.prompt(req, 0)
            request.prompt_token_ids = array("I", ids)
            request.prompt_tokens = len(ids)
        return request

    def index_kv(self, clock: Callable[[], float]) -> None:
        """Give every replica a precise prefix index, fed by `deliver_kv` (the engines' KV events)."""
        for replica in self.replicas:
            replica.lifecycle.state.kv = KvIndex(clock=clock)

    def deliver_kv(self, data: bytes) -> None:
        """One publisher delta (fleet/kv_index.py wire format) reaches every replica."""
        delta = decode_delta(data)
        for replica in self.replicas:
            kv = replica.lifecycle.state.kv
            if isinstance(kv, KvIndex) and delta is not None:
                kv.apply_delta(delta)

    @property
    def admits(self) -> bool:
        return self.config.admission.enabled

    def admit(
        self, req: Pending, body: dict[str, Any], granted: Callable[[Pending, RequestError | None], None]
    ) -> bool:
        """The service's admission for one arrival, in virtual time: True to route it now; False
        when it waits in the queue (`granted(req, None)` is called when capacity frees for it,
        `granted(req, error)` when admission sheds it from the queue). Raises the 429 of a request
        shed at once."""
        req.replica = next(self._turn)
        lifecycle = self.replicas[req.replica].lifecycle
        req.request = self._prepare(lifecycle, req, body)
        if lifecycle.admission.decide(req.request) is Verdict.ADMIT:
            return True
        req.waiter = lifecycle.admission.enqueue(req.request, lambda err: granted(req, err))
        return False

    def expire(self, req: Pending) -> bool:
        """Its max wait passed: True when it was still queued (it is now shed, 429)."""
        assert req.waiter is not None
        return self.replicas[req.replica].lifecycle.admission.expire(req.waiter)

    def started(self, req: Pending) -> None:
        assert req.waiter is not None
        self.replicas[req.replica].lifecycle.admission.started(req.waiter)

    def dispatch(self) -> None:
        """New snapshots may have freed room: wake waiters."""
        for replica in self.replicas:
            replica.lifecycle.admission.dispatch_all()

    def _head(self, lifecycle: RequestLifecycle, req: Pending) -> RequestHead:
        if not req.headers:
            return self.head
        return lifecycle.read_head({**_BASE_HEADERS, **req.headers})

    def finished(self, req: Pending) -> None:
        if req.decision is not None:
            self.replicas[req.replica].lifecycle.finish(req.decision, "response_end")

    def engine_priority(self, req: Pending) -> int:
        """The number `engine_priority:` writes into the request's body (0 when it is off)."""
        ep = self.config.engine_priority
        if ep is None or req.decision is None:
            return 0
        value = ep.value_for(req.decision.upstream.cluster, req.decision.request.priority)
        return 0 if value is None else value

    @property
    def sharing(self) -> bool:
        return any(r.sync is not None for r in self.replicas)

    def flushes(self, now: float) -> list[tuple[int, float]]:
        """Sync messages to schedule, as server/sync.py's publish loop sends them: news after a quiet
        spell at once, then at most one message per sync.interval_s. (replica, when) pairs."""
        out: list[tuple[int, float]] = []
        for i, r in enumerate(self.replicas):
            if r.sync is not None and r.news and r.flush_at is None:
                r.flush_at = max(now, r.last_sent + r.sync.settings.interval_s)
                out.append((i, r.flush_at))
        return out

    def sync(self, now: float, only: int | None = None) -> list[tuple[int, bytes]]:
        """Replica `only`'s scheduled message, or (None) the heartbeat tick of all: each replica's
        message if it has news or owes a heartbeat, by replica."""
        out: list[tuple[int, bytes]] = []
        for i, replica in enumerate(self.replicas):
            if replica.sync is None or (only is not None and i != only):
                continue
            if only is not None:
                replica.flush_at = None
            replica.sync.expire()
            if now >= replica.next_state:  # as the publish loop: the dump itself is not delivered
                replica.next_state = now + replica.sync.settings.state_interval_s
                replica.sync.state()
            force = now - replica.last_sent >= replica.sync.settings.heartbeat_s
            data = replica.sync.outgoing(force=force)
            replica.news = False
            if data is not None:
                replica.last_sent = now
                out.append((i, data))
        return out

    def deliver(self, origin: int, data: bytes) -> None:
        for i, replica in enumerate(self.replicas):
            if i != origin and replica.sync is not None:
                replica.sync.incoming(data)


@dataclass(slots=True)
class DesRun:
    policy: str
    records: list[RequestRecord]
    virtual_s: float
    wall_s: float
    metrics: Metrics | None = None  # llm-extproc's (the first replica's), for the tests to read


KV_FLUSH_S = 0.05  # the publisher's kv_events flush_s default
KV_HEARTBEAT_S = 1.0  # its heartbeat_s default: an empty delta keeps an idle engine's set fresh


POLICIES = (
    "llm-extproc",
    "round-robin",
    "least-request",
    "sglang-cache-aware",
    "vllm-router-cache-aware",
    "exact-ttft",
    "clairvoyant-affinity",
)
# llm-extproc run another way, by name, so that a grid can put it beside the default in every cell
# (`--policies ...,llm-extproc-kv-events`): with the engines' KV events (and the token ids they need),
# or with token ids alone (a service with the engines' tokenizer but no events).
VARIANTS: dict[str, dict[str, bool]] = {
    "llm-extproc-kv-events": {"kv_events": True},
    "llm-extproc-token-ids": {"token_ids": True},
}
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
    replicas: int = 1,
    share: bool = True,
    sync_delay_s: float = 0.002,
    headers: Sequence[dict[str, str] | None] | None = None,
    kv_events: bool = False,
    token_ids: bool | None = None,
    kv_flush_s: float = KV_FLUSH_S,
    kv_delay_s: float = 0.002,
    scheduling_policy: str = "fcfs",
    preemption_threshold: int | None = None,
    recount: Sequence[Callable[[list[int]], list[int]]] | None = None,
    prefill_counters: bool = True,
    gpu_names: str = "right",
    max_num_seqs: bool = False,
) -> DesRun:
    """Run one policy over the workload on fresh engines; every request gets a record.

    `tokens` (from `tokenize_requests`) saves re-tokenizing the same workload for every policy;
    `peer_configs` overrides the peers' cache_aware parameters by policy name. `replicas` runs that
    many llm-extproc processes taking requests in turn; with `share` they exchange replica-sync
    messages as the service does (at once after a quiet spell, then at most one per `sync.interval_s`
    of virtual time, heartbeats every `sync.heartbeat_s`), each delivered `sync_delay_s` later
    (Redis pub/sub on a LAN). `headers` gives each request its own headers
    (priority class, user, TTFT objective); with `service={"admission": {...}}` the llm-extproc
    policy admits, queues and sheds as the service does, in virtual time (a queued request's wait
    counts in its TTFT).

    `kv_events` (llm-extproc only): the engines publish their KV-cache events and the service
    tokenizes as they do (it gets each request's token ids), as a deployment with the engines'
    tokenizer and `kv_events:` in the publisher runs. Every `kv_flush_s` the events of each engine go
    through the publisher's translation (publishers/kv_events.py `BlockTranslator`) into a delta in
    the Redis wire format, applied `kv_delay_s` later to every replica's `KvIndex`: the precise index
    predicted-ttft reads, with the publisher's flush as its lag. `token_ids` (default: `kv_events`)
    gives the service the token ids without the events (prefix hashes of tokens, not of text).

    `scheduling_policy` is the engines' (vLLM's `--scheduling-policy`): with "priority" and
    `service={"engine_priority": {...}}`, llm-extproc's requests reach the engines with their class's
    number; every other policy's requests carry none (0), as the peers send none.
    `preemption_threshold` (with "priority"): SGLang's rule, a waiting request preempts running ones
    more than this much lower in priority (None: vLLM's, it never does).

    `recount` gives each engine its own tokenizer (engine tokens from `tokens`), for engines that
    count differently from the service's estimate; `prefill_counters` False publishes no prefill
    counters (no measured prefill rate); `gpu_names` "missing" or "wrong" changes what the
    snapshots say the GPU is (`_gpu_name`); `max_num_seqs` publishes each engine's batch limit (the
    publisher's `max_num_seqs:` set to the engine's --max-num-seqs)."""
    started = time.perf_counter()
    name, variant = policy, VARIANTS.get(policy)
    if variant is not None:  # llm-extproc with options, under its own name (a grid's extra row)
        policy, kv_events, token_ids = (
            "llm-extproc",
            variant.get("kv_events", kv_events),
            variant.get("token_ids"),
        )
    with_events = kv_events and policy == "llm-extproc"
    fleet = Fleet(
        [
            EngineModel(
                p,
                kv_events=with_events,
                scheduling_policy=scheduling_policy,
                preemption_threshold=preemption_threshold,
            )
            for p in profiles
        ],
        recount=recount,
    )
    now = 0.0
    chosen: Policy
    extproc: ExtprocPolicy | None = None
    if policy == "llm-extproc":
        extproc = ExtprocPolicy(
            fleet,
            model,
            service,
            clock=lambda: now,
            replicas=replicas,
            share=share,
            token_ids=with_events if token_ids is None else token_ids,
            prefill_counters=prefill_counters,
            gpu_names=gpu_names,
            max_num_seqs=max_num_seqs,
        )
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
        known = ", ".join((*POLICIES, *VARIANTS))
        raise ValueError(f"unknown policy {policy!r}; choose from {known}")

    # Event queue: (time, order, kind, payload). Kinds: 0 publish, 1 step end, 2 arrival,
    # 3 replica sync heartbeat tick, 4 a sync message delivered (payload: its key in `in_transit`),
    # 5 a queued request granted capacity by admission, 6 a queued request's deadline (or its shed),
    # 7 one replica's scheduled sync message (payload: the replica), 8 the KV-event publisher's
    # flush, 9 its delta delivered (payload: its key in `in_transit_kv`).
    admits = extproc is not None and extproc.admits
    queued: dict[int, Pending] = {}  # waiting in the admission queue, by request index

    swept: dict[int, str] = {}  # queued requests admission shed (not at their deadline): the 429's code

    def granted(req: Pending, err: RequestError | None) -> None:
        if err is None:
            heapq.heappush(events, (now, next(seq), 5, req.index))
        else:
            swept[req.index] = err.code or "shed"
            heapq.heappush(events, (now, next(seq), 6, req.index))

    seq = itertools.count()
    events: list[tuple[float, int, int, int]] = []
    for i, (arrival, _, _) in enumerate(requests):
        heapq.heappush(events, (arrival, next(seq), 2, i))
    if extproc is not None:
        heapq.heappush(events, (0.0, next(seq), 0, 0))
    heartbeat = extproc.config.sync.heartbeat_s if extproc is not None else 0.0
    sharing = extproc is not None and extproc.sharing
    if sharing:
        heapq.heappush(events, (0.0, next(seq), 3, 0))
    in_transit: dict[int, tuple[int, bytes]] = {}
    in_transit_kv: dict[int, bytes] = {}
    kv_feed: _KvFeed | None = None
    if with_events and extproc is not None:
        extproc.index_kv(lambda: now)
        kv_feed = _KvFeed(len(fleet.engines))
        heapq.heappush(events, (0.0, next(seq), 8, 0))
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
        if sharing:
            assert extproc is not None
            for replica, when in extproc.flushes(now):
                heapq.heappush(events, (when, next(seq), 7, replica))
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0 and extproc is not None:
            extproc.publish(now, ttl_s=3 * publish_interval_s)
            if admits:
                extproc.dispatch()
            heapq.heappush(events, (now + publish_interval_s, next(seq), 0, 0))
        elif kind in (3, 7) and extproc is not None:
            for message in extproc.sync(now, only=payload if kind == 7 else None):
                key = next(seq)
                in_transit[key] = message
                heapq.heappush(events, (now + sync_delay_s, key, 4, key))
            if kind == 3:
                heapq.heappush(events, (now + heartbeat, next(seq), 3, 0))
        elif kind == 4 and extproc is not None:
            extproc.deliver(*in_transit.pop(payload))
        elif kind == 8 and kv_feed is not None:
            for data in kv_feed.flush(fleet.engines, now):
                key = next(seq)
                in_transit_kv[key] = data
                heapq.heappush(events, (now + kv_delay_s, key, 9, key))
            heapq.heappush(events, (now + kv_flush_s, next(seq), 8, 0))
        elif kind == 9 and extproc is not None:
            extproc.deliver_kv(in_transit_kv.pop(payload))
        elif kind == 6 and extproc is not None:  # a queued request's max wait is over
            req = queued.pop(payload, None)
            code = swept.pop(payload, None)
            if req is not None and (code is not None or extproc.expire(req)):
                records.append(_failed(req, 429, code or "queue_timeout"))
                records[-1].e2e_s = now - req.arrival  # when the 429 went out
                remaining -= 1
        elif kind in (2, 5):
            arrival, body, tag = requests[payload]
            if kind == 2:
                prompt = tokens[payload] if tokens is not None else chat_to_tokens(body["messages"])
                req = Pending(payload, tag, arrival, prompt, int(body.get("max_tokens") or 16))
                req.headers = headers[payload] if headers is not None else None
            else:  # 5: a queued request was granted capacity
                req = queued.pop(payload)
                assert extproc is not None
                extproc.started(req)
                req.queued_s = now - req.arrival
            try:
                if kind == 2 and admits:
                    assert extproc is not None
                    if not extproc.admit(req, body, granted):
                        queued[payload] = req
                        deadline = now + extproc.config.admission.max_wait_s
                        heapq.heappush(events, (deadline, next(seq), 6, payload))
                        continue
                engine = chosen.choose(req, body, now)
                priority = extproc.engine_priority(req) if extproc is not None else 0
                fleet.engines[engine].submit(
                    str(payload), fleet.prompt(req, engine), req.max_tokens, now, priority
                )
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
                        ttft_s=done.ttft + req.queued_s,
                        e2e_s=done.latency + req.queued_s,
                        prompt_tokens=done.prompt_tokens,
                        completion_tokens=done.completion_tokens,
                        cached_tokens=done.cached_tokens,
                    )
                )
            start_step(payload, now)
    records.sort(key=lambda r: r.arrival_s)
    metrics = extproc.metrics if extproc is not None else None
    return DesRun(name, records, now, time.perf_counter() - started, metrics)


class _KvFeed:
    """`llm-extproc publish`'s KV-event relay for the simulated engines: per engine a translator,
    a sequence and the time of its last message (fleet/kv_index.py deltas, epoch 1)."""

    def __init__(self, engines: int, block_tokens: int = 64) -> None:
        self.translators = [BlockTranslator(block_tokens) for _ in range(engines)]
        self.seq = [-1] * engines
        self.sent = [-1e9] * engines

    def flush(self, engines: Sequence[EngineModel], now: float) -> list[bytes]:
        out: list[bytes] = []
        for i, engine in enumerate(engines):
            tr = self.translators[i]
            for ev in engine.drain_kv_events():
                tr.apply(ev)
            cleared, added, removed = tr.take_delta()
            first = self.seq[i] < 0
            if not (first or cleared or added or removed or now - self.sent[i] >= KV_HEARTBEAT_S):
                continue
            self.seq[i] += 1
            self.sent[i] = now
            uid = f"engine-{i}/{_address(i)}"
            # The first message of the epoch is a full state (cleared, then what the engine holds).
            out.append(encode_delta(uid, 1, self.seq[i], added, removed, cleared or first, None))
        return out


_OTHER_GPU = {"NVIDIA A10G": "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3": "NVIDIA A10G"}


def _gpu_name(gpu: str, i: int, names: str) -> str:
    """What engine `i`'s snapshot says its GPU is: its own name ("right"), none ("missing"), or for
    odd engines the other GPU's ("wrong": half an A10G fleet claims H100s; a mixed one looks uniform)."""
    if names == "missing":
        return ""
    if names == "wrong" and i % 2 == 1:
        return _OTHER_GPU.get(gpu, gpu)
    return gpu


def _address(i: int) -> str:
    return f"10.0.{i // 250}.{i % 250 + 1}:8000"


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

    from extproc_lab.bench.report import format_table, plot, summarize, write_json
    from extproc_lab.bench.workloads import make_workload
    from extproc_lab.engines.profiles import PROFILES

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
