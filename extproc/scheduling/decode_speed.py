"""Decode speed: the engines' own time per output token (TPOT), smoothed, for admission's TPOT gate
(`admission.max_tpot_s`) and for the `decode-speed` scorer.

`predicted-ttft` prices prefill work, not decode speed. An engine that holds more hot tenants than it
can decode for keeps its requests' TTFT low while their TPOT runs over the objective, and nothing in
that cost moves them: in the priorities bench at 120 % load (seed 7) one of four engines decoded at
a TPOT p90 of 103-140 ms for the whole run while the others ran at ~60 ms, and a third of the
requests missed a 100 ms objective. `decode-speed` scores such an engine down, so new and moved
placements go where tokens come fast enough; weighted against `predicted-ttft`, a request still
stays with its prefix unless its holder is close to the objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import SCORERS, FleetState
from extproc.settings import DEFAULT_TPOT_WINDOW_S

MAX_TRACKED_UPSTREAMS = 4096  # smoothed figures kept; all dropped at once beyond (a churning fleet)


@dataclass(slots=True)
class _Smoothed:
    published_at: float  # of the last snapshot read
    epoch: int
    value: float


class SmoothedTpot:
    """Per upstream, the snapshots' TPOT (`Load.tpot_s`: the mean gap between tokens over one publish
    interval) smoothed over `window_s` of snapshot time; each snapshot is read once, a restart (new
    epoch) starts afresh.

    The interval means are averaged over time, not weighted by their tokens: an interval that holds
    one long prefill step (one token per sequence, a huge mean) weighs as much as one of twenty
    ordinary steps, so the figure reads high while cold prefills crowd the engine, which is when one
    more request hurts most. Against the token-weighted mean (smoothing 1 / TPOT), admission's gate
    at 0.09 s in the priorities bench at 160 % load: 5 308 good requests against 4 504 (three seeds;
    docs/benchmarks.md, "TPOT-aware admission")."""

    __slots__ = ("_seen", "window_s")

    def __init__(self, window_s: float = DEFAULT_TPOT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._seen: dict[str, _Smoothed] = {}

    def read(self, upstream_id: str, load: Load) -> float | None:
        """The smoothed TPOT in seconds, or None while nothing is known (no report yet, or idle)."""
        seen = self._seen.get(upstream_id)
        if seen is not None and seen.epoch != load.epoch:  # restarted: what it was is gone
            del self._seen[upstream_id]
            seen = None
        if seen is not None and seen.published_at == load.published_at:
            return seen.value
        tpot = load.tpot_s
        if tpot is None or not math.isfinite(tpot) or tpot < 0:
            if load.num_running == 0 or "num_running" in load.unknown:
                # Idle (or it does not say): no one decodes there, so nothing is slow. Kept, the last
                # figure would close an upstream for good once admission's gate had drained it.
                self._seen.pop(upstream_id, None)
                return None
            # Running but no token in the interval: one step longer than the interval.
            return seen.value if seen is not None else None
        if seen is None:
            if len(self._seen) >= MAX_TRACKED_UPSTREAMS:
                self._seen.clear()
            self._seen[upstream_id] = _Smoothed(load.published_at, load.epoch, tpot)
            return tpot
        dt = max(0.0, load.published_at - seen.published_at)
        seen.value += (1.0 - math.exp(-dt / self.window_s)) * (tpot - seen.value)
        seen.published_at = load.published_at
        return seen.value


@SCORERS.register("decode-speed")
@dataclass(slots=True)
class DecodeSpeedScorer:
    """1.0 while an upstream's smoothed TPOT is at most `full_below` x the objective, falling
    linearly to 0.0 at the objective and beyond. The objective is the request's own (`x-llm-tpot-
    slo-ms`, or its route's), else `tpot_objective_s`; with neither, every candidate scores 0.0,
    which adds nothing to any total (so it can sit in the default profile without moving a request
    that set no objective, whatever the picker). With an objective, unknown (no snapshot, no TPOT
    reported, idle) is neutral: 1.0. Weight it against
    `predicted-ttft` (0.6 in docs/benchmarks.md, "Decode speed in placement"): the weight decides
    how slow a prefix holder must get before a request leaves it for a cold prefill elsewhere."""

    tpot_objective_s: float | None = None
    full_below: float = 0.8
    window_s: float = DEFAULT_TPOT_WINDOW_S
    _tpot: SmoothedTpot = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tpot_objective_s is not None and not self.tpot_objective_s > 0:
            raise ValueError("'tpot_objective_s' must be a number of seconds above 0")
        if not 0.0 <= self.full_below < 1.0:
            raise ValueError(f"'full_below' must be within [0, 1), got {self.full_below}")
        self._tpot = SmoothedTpot(self.window_s)

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        objective = self.tpot_objective_s
        if request.tpot_slo_ms is not None:
            objective = request.tpot_slo_ms / 1000.0
        if objective is None:
            return [0.0] * len(candidates)
        start = self.full_below * objective
        span = objective - start
        out = []
        for u, load in zip(candidates, state.loads_of(candidates), strict=True):
            tpot = None if load is None else self._tpot.read(u.id, load)
            if tpot is None or tpot <= start:
                out.append(1.0)
            else:
                out.append(max(0.0, (objective - tpot) / span))
        return out
