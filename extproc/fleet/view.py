"""The live fleet view: validated snapshots in, per-model candidates and per-upstream load out.

Writers (the Redis feed) call `apply`; a background task calls `rebuild` when something changed and
periodically for expiry. Readers on the request path only do dict lookups on the derived tables, so a
decision never waits on Redis or on a rebuild.

Two rules keep one broken instance from hurting the others:
- Unknown load is not idle load. An instance whose engine did not report its queue or KV usage gets
  the fleet's median for that figure (queues per unit of capacity weight), and the upstream's `Load`
  names the estimated fields in `unknown`, so scorers may discount them.
- A slightly late READY snapshot beats a 503. When a model has no fresh READY instance (say one
  neighbour is DOWN and the publisher was late for the rest), READY snapshots that expired less than
  `stale_ready_grace_ttls` of their own TTL ago are the candidates; each such decision is counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from extproc.fleet.accounting import InFlight, RemoteInFlight
from extproc.fleet.batch import BatchLimits
from extproc.fleet.gpus import gpu_speed
from extproc.fleet.pool import Pool, RoutingMode, Upstream
from extproc.fleet.snapshots import InstanceState
from extproc.fleet.tpot import SmoothedTpot
from extproc.settings import FORGET_AFTER_S, STALE_READY_GRACE_TTLS


@dataclass(slots=True)
class KvHeld:
    """What one engine holds by its own KV-cache events (fleet/kv_index.py): prefix-index block hashes.
    `complete`: every block it holds is known (events followed since its start or its last cache
    reset). False after a lost event batch or when the subscription began mid-stream: blocks stored
    before are missing, so `blocks` is only a lower bound."""

    blocks: set[bytes]
    complete: bool = True


class KvBlocks(Protocol):
    """The precise prefix index (fleet/kv_index.py KvIndex): per instance, what the engine holds."""

    def blocks(self, upstream_id: str) -> KvHeld | None: ...

    def holding(self, block: bytes) -> list[str]: ...


@dataclass(slots=True, frozen=True)
class Load:
    """What the engines last said about one schedulable upstream (a cluster or one endpoint)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # the fullest instance's, 0..1
    published_at: float  # oldest snapshot behind this figure (unix seconds)
    instances: int
    own_at_snapshot: int  # this process's in-flight requests there when the latest snapshot arrived
    # (with replica sync: the fleet-wide count, this process's plus the other replicas' reports)
    kv_blocks_total: int = 0  # summed over the instances; 0 when the engines do not say
    kv_blocks_free: int = 0
    block_size: int = 0  # tokens per KV block (the largest among the instances)
    epoch: int = 0  # bumped when an instance behind this upstream changes readiness (a restart goes
    # through DOWN or WARMING_UP): what a model of its cache learned before is gone
    unknown: frozenset[str] = frozenset()  # of num_running / num_waiting / kv_cache_usage: figures
    # some instance here did not report, filled in with the fleet median (never with 0)
    stale: bool = False  # from READY snapshots past their TTL, used within the stale-READY grace
    # LoRA: adapters with running or waiting requests on some instance here (the union); adapter slots
    # summed over the instances that publish them (0: none does) and, of those, the slots not taken
    # by a listed adapter (each instance counted alone, so one full instance cannot hide a free one).
    lora_adapters: frozenset[str] = frozenset()
    lora_slots: int = 0
    lora_slots_free: int = 0
    gpu_utilization: float | None = None  # the busiest GPU's, 0..1; None: no instance publishes it
    gpu_memory_usage: float | None = None  # the fullest GPU's, 0..1
    ttft_s: float | None = None  # engine-reported mean TTFT over the last publish interval, averaged
    tpot_s: float | None = None  # over the instances that report it; None: none does
    # Measured prefill throughput (uncached prompt tokens/s), summed over the instances (those not
    # measured yet counted at the measured ones' mean); None: no instance here is measured yet.
    prefill_tokens_per_s: float | None = None
    # Nominal prefill speed of its GPUs (fleet/gpus.py: dense tensor TFLOPS, only ratios count),
    # summed over the instances as prefill_tokens_per_s is; None: no instance's GPU is known.
    gpu_speed: float | None = None
    # The engines' cumulative counters (prompt tokens at first token, first tokens, TTFT seconds),
    # summed over the instances; None unless every instance publishes them (the prompt tokens alone
    # None unless every instance publishes those).
    counters: tuple[float | None, float, float] | None = None
    # The most requests the instances run at once, summed; None unless every instance says
    # (publisher `max_num_seqs:`, or the engine's own figure).
    max_num_seqs: int | None = None


@dataclass(slots=True, frozen=True)
class _Typical:
    """Fleet medians used in place of figures an instance did not report (queues per unit weight)."""

    running_per_weight: float = 0.0
    waiting_per_weight: float = 0.0
    kv_cache_usage: float = 0.0

    @classmethod
    def of(cls, instances: Iterable[InstanceState]) -> _Typical:
        running: list[float] = []
        waiting: list[float] = []
        kv: list[float] = []
        for i in instances:
            if i.num_running is not None:
                running.append(i.num_running / i.weight)
            if i.num_waiting is not None:
                waiting.append(i.num_waiting / i.weight)
            if i.kv_cache_usage is not None:
                kv.append(i.kv_cache_usage)
        # With no instance reporting a figure, every candidate gets the same 0: neutral between them.
        return cls(
            statistics.median(running) if running else 0.0,
            statistics.median(waiting) if waiting else 0.0,
            statistics.median(kv) if kv else 0.0,
        )


class FleetView:
    def __init__(
        self,
        pool: Pool,
        clock: Callable[[], float] = time.time,
        own_count: Callable[[str], int] = lambda _: 0,
        stale_ready_grace_ttls: float = STALE_READY_GRACE_TTLS,
    ) -> None:
        self.pool = pool
        self.clock = clock
        self.stale_ready_grace_ttls = stale_ready_grace_ttls
        # This process's in-flight count per upstream id, sampled as each snapshot arrives: requests
        # above that level were sent after the engine's figures were taken (see SchedulingState).
        self.own_count = own_count
        self._own_at_apply: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._static_models = {c.name: frozenset(c.models) for c in pool.clusters}
        self.known_clusters = frozenset(self._static_models)
        self._instances: dict[str, InstanceState] = {}
        self._candidates: dict[str, tuple[Upstream, ...]] = {}
        self._stale_ready: dict[str, tuple[Upstream, ...]] = {}
        self._fresh_models: frozenset[str] = frozenset()
        self._loads: dict[str, Load] = {}
        self._tpot: dict[float, SmoothedTpot] = {}  # by smoothing window, each fed every rebuild
        self.batches = BatchLimits()  # fed every rebuild
        self.dirty = False
        self.counts = {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}
        self.stale_ready_decisions = 0  # candidates() answers served from the stale-READY grace
        self._departure_hooks: list[Callable[[tuple[str, ...]], object]] = []

    def on_departure(self, hook: Callable[[tuple[str, ...]], object]) -> None:
        """Call `hook(upstream keys)` when rebuild() forgot the last instance behind them (expired
        FORGET_AFTER_S ago): what was kept per upstream can go (extproc.lifecycle forgets it)."""
        self._departure_hooks.append(hook)

    def upstream_keys(self) -> set[str]:
        """The schedulable upstreams some held instance (fresh or not yet forgotten) belongs to."""
        return {self._key(inst) for inst in self._instances.values()}

    @property
    def fresh_models(self) -> frozenset[str]:
        """Models some fresh snapshot says an instance serves (adapters listed as models included)."""
        return self._fresh_models

    # -- writers ---------------------------------------------------------------------------------
    def apply(self, state: InstanceState) -> bool:
        """Store a snapshot unless an equal-or-newer one from the same publisher is already held."""
        held = self._instances.get(state.upstream_id)
        if held is not None:
            if held.publisher_id == state.publisher_id and state.sequence <= held.sequence:
                return False
            if held.publisher_id != state.publisher_id and state.published_at < held.published_at:
                return False
        key = self._key(state)
        if held is not None and held.ready != state.ready:
            self._epochs[key] = self._epochs.get(key, 0) + 1
        self._instances[state.upstream_id] = state
        self._own_at_apply[key] = self.own_count(key)
        self.dirty = True
        return True

    def _key(self, state: InstanceState) -> str:
        """The schedulable upstream an instance belongs to: its endpoint, or its whole cluster."""
        if self.pool.mode is RoutingMode.ENDPOINT:
            return f"{state.cluster}/{state.address}"
        return state.cluster

    def rebuild(self) -> None:
        """Recompute the derived tables from fresh snapshots (O(instances); off the request path)."""
        now = self.clock()
        endpoint_mode = self.pool.mode is RoutingMode.ENDPOINT
        by_model: dict[str, dict[str, None]] = {}  # model -> ordered set of upstream keys
        fresh_models: set[str] = set()
        groups: dict[str, list[InstanceState]] = {}
        late: list[InstanceState] = []  # READY, expired, still within the grace
        counts = {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}
        forgotten: set[str] = set()  # upstream keys of instances forgotten in this pass
        for uid, inst in list(self._instances.items()):
            if not inst.fresh(now):
                counts["stale"] += 1
                if inst.ready and self._within_grace(inst, now):
                    late.append(inst)
                elif now - inst.expires_at > FORGET_AFTER_S:
                    del self._instances[uid]
                    forgotten.add(self._key(inst))
                continue
            models = self._models(inst)
            fresh_models.update(models)
            if not inst.ready:
                counts["fresh_not_ready"] += 1
                continue
            counts["fresh_ready"] += 1
            if endpoint_mode and inst.address is None:
                continue
            key = self._key(inst)
            groups.setdefault(key, []).append(inst)
            for m in models:
                by_model.setdefault(m, {})[key] = None
        # Late READY instances, only for models that fresh snapshots know but have no READY one for.
        late_groups: dict[str, list[InstanceState]] = {}
        late_by_model: dict[str, dict[str, None]] = {}
        for inst in late:
            wanted = [m for m in self._models(inst) if m in fresh_models and m not in by_model]
            if not wanted or (endpoint_mode and inst.address is None):
                continue
            counts["stale_ready"] += 1
            key = self._key(inst)
            late_groups.setdefault(key, []).append(inst)
            for m in wanted:
                late_by_model.setdefault(m, {})[key] = None
        typical = _Typical.of([i for insts in (*groups.values(), *late_groups.values()) for i in insts])
        upstreams: dict[str, Upstream] = {}
        loads: dict[str, Load] = {}
        for stale, table in ((False, groups), (True, late_groups)):
            for key, insts in table.items():
                if key in upstreams:  # cluster mode: the cluster's fresh instances speak for it
                    continue
                first = insts[0]
                upstreams[key] = Upstream(
                    id=key,
                    cluster=first.cluster,
                    address=first.address if endpoint_mode else None,
                    weight=sum(i.weight for i in insts),
                )
                loads[key] = self._load(key, insts, typical, stale)
        self._candidates = {m: tuple(upstreams[k] for k in keys) for m, keys in by_model.items()}
        self._stale_ready = {m: tuple(upstreams[k] for k in keys) for m, keys in late_by_model.items()}
        self._fresh_models = frozenset(fresh_models)
        self._loads = loads
        for smoothed in self._tpot.values():
            smoothed.take_all(loads)
        self.batches.take_all(loads)
        self.counts = counts
        self.dirty = False
        if forgotten:
            self._forget(forgotten - self.upstream_keys())

    def _forget(self, keys: set[str]) -> None:
        """No instance is left behind these upstream keys: drop what was kept per key, tell the hooks."""
        if not keys:
            return
        for key in keys:
            self._own_at_apply.pop(key, None)
            self._epochs.pop(key, None)
            for smoothed in self._tpot.values():
                smoothed.forget(key)
            self.batches.forget(key)
        gone = tuple(sorted(keys))
        for hook in list(self._departure_hooks):
            hook(gone)

    def _models(self, inst: InstanceState) -> frozenset[str]:
        return inst.models or self._static_models.get(inst.cluster, frozenset())

    def _within_grace(self, inst: InstanceState, now: float) -> bool:
        ttl = inst.expires_at - inst.published_at
        return now - inst.expires_at < self.stale_ready_grace_ttls * ttl

    def _load(self, key: str, insts: list[InstanceState], typical: _Typical, stale: bool) -> Load:
        """One upstream's figures: counts summed, KV usage the fullest; unknown figures estimated."""
        unknown: set[str] = set()
        running = waiting = 0
        kv = 0.0
        for i in insts:
            if i.num_running is None:
                unknown.add("num_running")
                running += round(typical.running_per_weight * i.weight)
            else:
                running += i.num_running
            if i.num_waiting is None:
                unknown.add("num_waiting")
                waiting += round(typical.waiting_per_weight * i.weight)
            else:
                waiting += i.num_waiting
            if i.kv_cache_usage is None:
                unknown.add("kv_cache_usage")
            kv = max(kv, typical.kv_cache_usage if i.kv_cache_usage is None else i.kv_cache_usage)
        return Load(
            num_running=running,
            num_waiting=waiting,
            kv_cache_usage=kv,
            published_at=min(i.published_at for i in insts),
            instances=len(insts),
            own_at_snapshot=self._own_at_apply.get(key, 0),
            kv_blocks_total=sum(i.kv_blocks_total for i in insts),
            kv_blocks_free=sum(i.kv_blocks_free for i in insts),
            block_size=max(i.block_size for i in insts),
            epoch=self._epochs.get(key, 0),
            unknown=frozenset(unknown),
            stale=stale,
            **_extra_signals(insts),
        )

    # -- readers (request path) ------------------------------------------------------------------
    def candidates(self, model: str) -> tuple[Upstream, ...] | None:
        """Ready upstreams for `model`; () when fresh snapshots say none is ready; None when there is
        no fresh information about the model at all (the caller falls back). With no fresh READY
        instance, READY snapshots within the stale-READY grace answer instead of ()."""
        found = self._candidates.get(model)
        if found is not None:
            return found
        late = self._stale_ready.get(model)
        if late:
            self.stale_ready_decisions += 1
            return late
        return () if model in self._fresh_models else None

    def load(self, upstream_id: str) -> Load | None:
        return self._loads.get(upstream_id)

    def loads_by_id(self) -> Mapping[str, Load]:
        """Every upstream's load by id (read-only: replaced, not changed, by rebuild())."""
        return self._loads

    def serves(self, model: str) -> bool:
        return model in self._fresh_models

    def smoothed_tpot(self, upstream_id: str, window_s: float) -> float | None:
        """The engines' TPOT there smoothed over `window_s` (fleet/tpot.py), as of the last rebuild; None
        while nothing is known. A window is smoothed from its first read on, with every rebuild's
        snapshots, whoever reads it and however often (readers name a few fixed windows)."""
        return self._smoothing(window_s).value(upstream_id)

    def smoothed_running(self, upstream_id: str, window_s: float) -> float | None:
        """The running requests behind smoothed_tpot(), smoothed with it; None where it is None."""
        return self._smoothing(window_s).running(upstream_id)

    def _smoothing(self, window_s: float) -> SmoothedTpot:
        smoothed = self._tpot.get(window_s)
        if smoothed is None:
            smoothed = self._tpot[window_s] = SmoothedTpot(window_s)
            smoothed.take_all(self._loads)
        return smoothed

    def instances(self) -> dict[str, InstanceState]:
        return self._instances


class _ExtraSignals(TypedDict):
    lora_adapters: frozenset[str]
    lora_slots: int
    lora_slots_free: int
    gpu_utilization: float | None
    gpu_memory_usage: float | None
    ttft_s: float | None
    tpot_s: float | None
    prefill_tokens_per_s: float | None
    gpu_speed: float | None
    counters: tuple[float | None, float, float] | None
    max_num_seqs: int | None


def _extra_signals(insts: list[InstanceState]) -> _ExtraSignals:
    """LoRA adapters and slots, GPU utilisation and latency means of one upstream's instances."""
    adapters: set[str] = set()
    slots = free = 0
    gpu: list[float] = []
    memory: list[float] = []
    ttft: list[float] = []
    tpot: list[float] = []
    prefill: list[float] = []
    nominal: list[float] = []
    counters: tuple[float | None, float, float] | None = (0.0, 0.0, 0.0)
    seqs: int | None = 0
    for i in insts:
        seqs = None if seqs is None or i.max_num_seqs is None else seqs + i.max_num_seqs
        if counters is not None:
            c = i.counters
            if c is None:
                counters = None
            else:
                prompt = None if counters[0] is None or c[0] is None else counters[0] + c[0]
                counters = (prompt, counters[1] + c[1], counters[2] + c[2])
        adapters.update(i.lora_adapters)
        if i.max_lora is not None:
            slots += i.max_lora
            free += max(0, i.max_lora - len(i.lora_adapters))
        if i.gpu_utilization is not None:
            gpu.append(i.gpu_utilization)
        if i.gpu_memory_usage is not None:
            memory.append(i.gpu_memory_usage)
        if i.ttft_s is not None:
            ttft.append(i.ttft_s)
        if i.tpot_s is not None:
            tpot.append(i.tpot_s)
        if i.prefill_tokens_per_s is not None:
            prefill.append(i.prefill_tokens_per_s)
        speed = gpu_speed(i.gpu_model)
        if speed is not None:
            nominal.append(speed)
    return {
        "lora_adapters": frozenset(adapters),
        "lora_slots": slots,
        "lora_slots_free": free,
        "gpu_utilization": max(gpu) if gpu else None,
        "gpu_memory_usage": max(memory) if memory else None,
        "ttft_s": sum(ttft) / len(ttft) if ttft else None,
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "prefill_tokens_per_s": sum(prefill) * len(insts) / len(prefill) if prefill else None,
        "gpu_speed": sum(nominal) * len(insts) / len(nominal) if nominal else None,
        "counters": counters if insts else None,
        "max_num_seqs": seqs if insts else None,
    }


_LoadsHeld = tuple[tuple[Upstream, ...], Mapping[str, Load], tuple[Load | None, ...]]


class SchedulingState:
    """What scheduling plugins read: in-flight counts, the engines' last word, and what was sent
    since. Works without a fleet view (static pool): load() is then None everywhere.

    With replica sync (`share()`), counts are fleet-wide: this process's own plus what the other
    replicas last reported (server/sync.py), so N replicas do not each see an idle upstream."""

    __slots__ = ("_loads_held", "inflight", "kv", "remote", "view")

    def __init__(self, inflight: InFlight, view: FleetView | None) -> None:
        self.inflight = inflight
        self.view = view
        self.remote: RemoteInFlight | None = None
        self.kv: KvBlocks | None = None  # the precise prefix index from engines' KV events, if fed
        # loads_of()'s last answer for a candidates tuple: (that tuple, the view's loads, the answer)
        self._loads_held: _LoadsHeld | None = None

    def kv_blocks(self, upstream_id: str) -> KvHeld | None:
        """The index block hashes the engine holds, from its KV events: None unless that set is synced
        and fresh, and, for a whole cluster, unless the cluster is one instance (Envoy picks within)."""
        kv = self.kv
        if kv is None:
            return None
        if "/" not in upstream_id:
            load = self.load(upstream_id)
            if load is None or load.instances != 1:
                return None
        return kv.blocks(upstream_id)

    def kv_holders(self, block: bytes) -> list[str]:
        """Upstream ids whose engines' KV events say they hold `block`: a superset of the candidates
        for which kv_blocks() would show it (check those with kv_blocks()); [] without events."""
        kv = self.kv
        return [] if kv is None else kv.holding(block)

    def share(self, remote: RemoteInFlight) -> None:
        """Count the other replicas' in-flight requests too, in count() and pending(); the view then
        samples the fleet-wide count as each snapshot arrives (own_at_snapshot): the engine's figures
        already include what any replica sent before, only the growth since is pending."""
        self.remote = remote
        if self.view is not None:
            self.view.own_count = self.count

    def count(self, upstream_id: str) -> int:
        remote = self.remote
        if remote is None:
            return self.inflight.count(upstream_id)
        return self.inflight.count(upstream_id) + remote.count(upstream_id)

    def load(self, upstream_id: str) -> Load | None:
        return self.view.load(upstream_id) if self.view is not None else None

    def loads_of(self, upstreams: Sequence[Upstream]) -> Sequence[Load | None]:
        """Kept while the candidates tuple and the view's loads are the same objects (both are
        replaced, not changed, when the view is rebuilt): one lookup per candidate per rebuild, not
        per decision, for a pool of 1000."""
        if self.view is None:
            return (None,) * len(upstreams)
        by_id = self.view.loads_by_id()
        held = self._loads_held
        if held is not None and held[0] is upstreams and held[1] is by_id:
            return held[2]
        get = by_id.get
        loads = tuple(get(u.id) for u in upstreams)
        if isinstance(upstreams, tuple):
            self._loads_held = (upstreams, by_id, loads)
        return loads

    def now(self) -> float:
        return self.view.clock() if self.view is not None else time.time()

    def smoothed_tpot(self, upstream_id: str, window_s: float) -> float | None:
        return self.view.smoothed_tpot(upstream_id, window_s) if self.view is not None else None

    def smoothed_running(self, upstream_id: str, window_s: float) -> float | None:
        return self.view.smoothed_running(upstream_id, window_s) if self.view is not None else None

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        view = self.view
        if view is None:
            return float(self.count(upstream_id)), None, None
        load = view.load(upstream_id)
        own = self.count(upstream_id)
        if load is None:
            occupancy = float(own)
        else:
            occupancy = float(max(own, load.num_running + load.num_waiting + own - load.own_at_snapshot))
        batches = view.batches
        return occupancy, batches.limit(upstream_id, published, cap, shared), batches.turnover(upstream_id)

    def pending(self, upstream_id: str) -> int:
        """Requests the engines' figures do not include yet: how far the in-flight count there (this
        process's, plus the other replicas' with sync) has grown since the snapshot arrived (sent
        since, minus finished since), so a burst between two snapshots spreads out. With no
        snapshot: everything in flight there."""
        own = self.count(upstream_id)
        load = self.load(upstream_id)
        if load is None:
            return own
        return max(0, own - load.own_at_snapshot)
