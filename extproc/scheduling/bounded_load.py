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
cheap, cached requests is where they belong (forcing cold copies of 4-8k-token prompts off such
holders cost up to 1.5x the TTFT geomean in the routing grid's long-prompt and chat cells).

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


@FILTERS.register("bounded-load")
@dataclass(slots=True)
class BoundedLoadFilter:
    factor: float = 2.0  # x a candidate's share of the requests in flight
    slack: float = 1.0  # requests allowed above that
    _held: tuple[Sequence[Upstream], Sequence[Load | None]] = field(init=False, default=((), ()))
    _shares: list[float] = field(init=False, default_factory=list)
    _dropped: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError("'factor' must be >= 1 (below 1 every candidate could be over its share)")
        if not self.slack >= 0.0:
            raise ValueError("'slack' must be >= 0")

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        n = len(candidates)
        if n < 2:
            return candidates
        loads = state.loads_of(candidates)
        shares = self._capacity_shares(candidates, loads)
        queued = [
            state.count(u.id) if load is None else load.num_running + load.num_waiting + state.pending(u.id)
            for u, load in zip(candidates, loads, strict=True)
        ]
        total = sum(queued) + 1.0
        factor, slack = self.factor, self.slack
        kept = [
            u
            for u, q, s, load in zip(candidates, queued, shares, loads, strict=True)
            if q <= factor * total * s + slack or (load is not None and load.num_waiting == 0)
        ]
        if len(kept) == n:
            return candidates
        dropped = self._dropped
        through = {u.id for u in kept}
        for u in candidates:
            if u.id not in through:
                dropped[u.id] = dropped.get(u.id, 0) + 1
        return kept

    def _capacity_shares(self, candidates: Sequence[Upstream], loads: Sequence[Load | None]) -> list[float]:
        """Each candidate's prefill capacity over the candidates' total; kept while the view's
        candidates and loads are the same objects (replaced, not changed, when it is rebuilt)."""
        held_candidates, held_loads = self._held
        if candidates is held_candidates and loads is held_loads:
            return self._shares
        rates = prefill_rates(candidates, loads, configured=1.0, tolerance=RATE_TOLERANCE)
        total = sum(rates.values())
        shares = [rates[u.id] / total for u in candidates]
        if isinstance(candidates, tuple) and isinstance(loads, tuple):
            self._held, self._shares = (candidates, loads), shares
        return shares

    def report(self) -> Iterator[tuple[str, str, float]]:
        """(figure, upstream id, value) for /metrics: how often each upstream was over its bound."""
        for uid, n in list(self._dropped.items()):
            yield "bounded_load_dropped", uid, float(n)
