"""The live fleet view: validated snapshots in, per-model candidates and per-upstream load out.

Writers (the Redis feed) call `apply`; a background task calls `rebuild` when something changed and
periodically for expiry. Readers on the request path only do dict lookups on the derived tables, so a
decision never waits on Redis or on a rebuild.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from extproc.fleet.accounting import InFlight
from extproc.fleet.pool import Pool, RoutingMode, Upstream
from extproc.fleet.snapshots import InstanceState
from extproc.settings import FORGET_AFTER_S


@dataclass(slots=True, frozen=True)
class Load:
    """What the engines last said about one schedulable upstream (a cluster or one endpoint)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # the fullest instance's, 0..1
    published_at: float  # oldest snapshot behind this figure (unix seconds)
    instances: int
    own_at_snapshot: int  # this process's in-flight requests there when the latest snapshot arrived
    kv_blocks_total: int = 0  # summed over the instances; 0 when the engines do not say
    kv_blocks_free: int = 0
    block_size: int = 0  # tokens per KV block (the largest among the instances)
    epoch: int = 0  # bumped when an instance behind this upstream changes readiness (a restart goes
    # through DOWN or WARMING_UP): what a model of its cache learned before is gone


class FleetView:
    def __init__(
        self,
        pool: Pool,
        clock: Callable[[], float] = time.time,
        own_count: Callable[[str], int] = lambda _: 0,
    ) -> None:
        self.pool = pool
        self.clock = clock
        # This process's in-flight count per upstream id, sampled as each snapshot arrives: requests
        # above that level were sent after the engine's figures were taken (see SchedulingState).
        self.own_count = own_count
        self._own_at_apply: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._static_models = {c.name: frozenset(c.models) for c in pool.clusters}
        self.known_clusters = frozenset(self._static_models)
        self._instances: dict[str, InstanceState] = {}
        self._candidates: dict[str, tuple[Upstream, ...]] = {}
        self._fresh_models: frozenset[str] = frozenset()
        self._loads: dict[str, Load] = {}
        self.dirty = False
        self.counts = {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0}

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
        counts = {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0}
        for uid, inst in list(self._instances.items()):
            if not inst.fresh(now):
                counts["stale"] += 1
                if now - inst.expires_at > FORGET_AFTER_S:
                    del self._instances[uid]
                continue
            models = inst.models or self._static_models.get(inst.cluster, frozenset())
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
        upstreams: dict[str, Upstream] = {}
        loads: dict[str, Load] = {}
        for key, insts in groups.items():
            first = insts[0]
            upstreams[key] = Upstream(
                id=key,
                cluster=first.cluster,
                address=first.address if endpoint_mode else None,
                weight=sum(i.weight for i in insts),
            )
            loads[key] = Load(
                num_running=sum(i.num_running for i in insts),
                num_waiting=sum(i.num_waiting for i in insts),
                kv_cache_usage=max(i.kv_cache_usage for i in insts),
                published_at=min(i.published_at for i in insts),
                instances=len(insts),
                own_at_snapshot=self._own_at_apply.get(key, 0),
                kv_blocks_total=sum(i.kv_blocks_total for i in insts),
                kv_blocks_free=sum(i.kv_blocks_free for i in insts),
                block_size=max(i.block_size for i in insts),
                epoch=self._epochs.get(key, 0),
            )
        self._candidates = {m: tuple(upstreams[k] for k in keys) for m, keys in by_model.items()}
        self._fresh_models = frozenset(fresh_models)
        self._loads = loads
        self.counts = counts
        self.dirty = False

    # -- readers (request path) ------------------------------------------------------------------
    def candidates(self, model: str) -> tuple[Upstream, ...] | None:
        """Ready upstreams for `model`; () when fresh snapshots say none is ready; None when there is
        no fresh information about the model at all (the caller falls back)."""
        found = self._candidates.get(model)
        if found is not None:
            return found
        return () if model in self._fresh_models else None

    def load(self, upstream_id: str) -> Load | None:
        return self._loads.get(upstream_id)

    def serves(self, model: str) -> bool:
        return model in self._fresh_models

    def instances(self) -> dict[str, InstanceState]:
        return self._instances


class SchedulingState:
    """What scheduling plugins read: own in-flight counts, the engines' last word, and what was sent
    since. Works without a fleet view (static pool): load() is then None everywhere."""

    __slots__ = ("inflight", "view")

    def __init__(self, inflight: InFlight, view: FleetView | None) -> None:
        self.inflight = inflight
        self.view = view

    def count(self, upstream_id: str) -> int:
        return self.inflight.count(upstream_id)

    def load(self, upstream_id: str) -> Load | None:
        return self.view.load(upstream_id) if self.view is not None else None

    def now(self) -> float:
        return self.view.clock() if self.view is not None else time.time()

    def pending(self, upstream_id: str) -> int:
        """Requests the engines' figures do not include yet: how far this process's in-flight count
        there has grown since the snapshot arrived (sent since, minus finished since), so a burst
        between two snapshots spreads out. With no snapshot: everything this process has there."""
        own = self.inflight.count(upstream_id)
        load = self.load(upstream_id)
        if load is None:
            return own
        return max(0, own - load.own_at_snapshot)
