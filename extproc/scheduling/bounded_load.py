"""`bounded-load`: a floor under whatever the scorers believe. No candidate gets new work while it holds
more than `factor` times its share of the work in flight, in the spirit of consistent hashing with
bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018): a model that under-counts a prefix holder's
queue can stack affinity onto it only up to that bound, and the request goes to the best-scored of
the others instead.

A candidate's load is the requests at its engine: the engine's running and waiting requests from its
last snapshot plus what was sent there since (the service's own in-flight count without a
snapshot). Its share is its prefill capacity over the candidates' (scheduling/capacity.py: capacity
weight times measured speed, so an H100 next to A10Gs gets its own share), of all the requests in
flight plus this one. `slack` requests on top keep a nearly idle pool from being forced round robin.

The bound holds only where it hurts: a candidate over it whose engine last reported no waiting
request keeps its place. Its batch still takes new work at once, and a prefix holder running many
cheap, cached requests is where they belong: forcing them off it makes cold copies of long prompts
elsewhere (docs/tuning.md, "The floor: `bounded-load`").

The least loaded candidate (per unit of capacity) is always within the bound, so the filter never
empties the list. Drops are counted per upstream (`llm_extproc_bounded_load_dropped`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.capacity import prefill_rates
from extproc.scheduling.framework import FILTERS, FleetState

RATE_TOLERANCE = 1.5  # as predicted-ttft's default: measured rates this close are one GPU type


@dataclass(slots=True)
class _PoolView:
    """Per candidate, in order: id, the engine's running + waiting (-1: no snapshot), this
    process's in-flight count when that snapshot arrived, factor x its capacity share, and whether
    its engine reports requests waiting."""

    ids: list[str]
    base: list[int]
    own_at: list[int]
    bound_shares: list[float]
    queueing: list[bool]


@FILTERS.register("bounded-load")
@dataclass(slots=True)
class BoundedLoadFilter:
    factor: float = 2.0  # x a candidate's share of the requests in flight
    slack: float = 1.0  # requests allowed above that
    _held: tuple[Sequence[Upstream], Sequence[Load | None]] = field(init=False, default=((), ()))
    _view: _PoolView | None = field(init=False, default=None)
    _dropped: dict[str, int] = field(init=False, default_factory=dict)

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: its drop count goes (the counter's series with it)."""
        self._dropped.pop(upstream_id, None)

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError("'factor' must be >= 1 (below 1 every candidate could be over its share)")
        if not self.slack >= 0.0:
            raise ValueError("'slack' must be >= 0")

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        if len(candidates) < 2:
            return candidates
        pool = self._pool_view(candidates, state.loads_of(candidates))
        # Per decision only the in-flight counts are read: the engines' figures are the view's.
        count = state.count
        queued = [
            count(uid) if base < 0 else base + max(0, count(uid) - own)
            for uid, base, own in zip(pool.ids, pool.base, pool.own_at, strict=True)
        ]
        total = sum(queued) + 1.0
        slack = self.slack
        over = [
            i
            for i, (q, share) in enumerate(zip(queued, pool.bound_shares, strict=True))
            if q > total * share + slack and pool.queueing[i]
        ]
        if not over:
            return candidates
        dropped = self._dropped
        for i in over:
            uid = pool.ids[i]
            dropped[uid] = dropped.get(uid, 0) + 1
        out = set(over)
        return [u for i, u in enumerate(candidates) if i not in out]

    def _pool_view(self, candidates: Sequence[Upstream], loads: Sequence[Load | None]) -> _PoolView:
        """What the engines said about the candidates, and their shares; kept while the view's
        candidates and loads are the same objects (replaced, not changed, when it is rebuilt)."""
        held_candidates, held_loads = self._held
        if self._view is not None and candidates is held_candidates and loads is held_loads:
            return self._view
        rates = prefill_rates(candidates, loads, configured=1.0, tolerance=RATE_TOLERANCE)
        capacity = sum(rates.values())
        view = _PoolView(
            ids=[u.id for u in candidates],
            base=[-1 if load is None else load.num_running + load.num_waiting for load in loads],
            own_at=[0 if load is None else load.own_at_snapshot for load in loads],
            bound_shares=[self.factor * rates[u.id] / capacity for u in candidates],
            # Without a snapshot nothing says it is not queueing: the bound holds.
            queueing=[load is None or load.num_waiting > 0 for load in loads],
        )
        if isinstance(candidates, tuple) and isinstance(loads, tuple):
            self._held, self._view = (candidates, loads), view
        return view

    def report(self) -> Iterator[tuple[str, str, float]]:
        """(figure, upstream id, value) for /metrics: how often each upstream was over its bound."""
        for uid, n in list(self._dropped.items()):
            yield "bounded_load_dropped", uid, float(n)
