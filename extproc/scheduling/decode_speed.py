"""Decode speed: the `decode-speed` scorer, on the engines' own time per output token (TPOT) as the
fleet view smooths it (fleet/tpot.py; admission's TPOT gate reads the same figure).

`predicted-ttft` prices prefill work, not decode speed. An engine that holds more hot tenants than it
can decode for keeps its requests' TTFT low while their TPOT runs over the objective, and nothing in
that cost moves them: such an engine can stay slow for a whole run while the others have room to
spare (notebook/benchmarks-history.md, "TPOT-aware admission"). `decode-speed` scores such an engine
down, so new and moved placements go where tokens come fast enough; weighted against
`predicted-ttft`, a request still stays with its prefix unless its holder is close to the objective.

The smoothed figure lags the batch it was measured on by seconds. Read as it stands, the one engine
that has just come under the objective after a spell of shedding scores alone above 0 and takes
every request until it is over again (notebook/benchmarks-history.md, "Smoothing in the fleet view"). So the
figure is scaled to the batch there now: `batch_share` of it grows with the running requests
(those in the latest snapshot plus those sent since, over the batch the figure was measured on),
the rest is the fixed cost of a decode step (reading the weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import SCORERS, FleetState
from extproc.settings import DEFAULT_TPOT_WINDOW_S


@SCORERS.register("decode-speed")
@dataclass(slots=True)
class DecodeSpeedScorer:
    """1.0 while an upstream's TPOT is at most `full_below` x the objective, falling linearly to 0.0
    at the objective and beyond; the TPOT is the fleet view's smoothed figure scaled to the batch
    there now (`batch_share`, above; 0 reads the figure as it stands). The objective is the
    request's own (`x-llm-tpot-slo-ms`, or its route's), else `tpot_objective_s`; with neither,
    every candidate scores 0.0, which adds nothing to any total (so it can sit in the default
    profile without moving a request that set no objective, whatever the picker). With an
    objective, unknown (no snapshot, no TPOT reported, idle) is neutral: 1.0. Weight it against
    `predicted-ttft` (the default profile's 0.6: notebook/benchmarks-history.md, "Decode speed in
    placement"): the weight decides how slow a prefix holder must get before a request leaves it for
    a cold prefill elsewhere."""

    tpot_objective_s: float | None = None
    full_below: float = 0.8
    window_s: float = DEFAULT_TPOT_WINDOW_S  # the smoothing's time constant (fleet/tpot.py)
    # The share of TPOT that grows with the running batch; the rest is the fixed cost of a step
    # (reading the weights). Why 0.5: notebook/benchmarks-history.md, "Room for the requests sent since".
    batch_share: float = 0.5

    def __post_init__(self) -> None:
        if self.tpot_objective_s is not None and not self.tpot_objective_s > 0:
            raise ValueError("'tpot_objective_s' must be a number of seconds above 0")
        if not 0.0 <= self.full_below < 1.0:
            raise ValueError(f"'full_below' must be within [0, 1), got {self.full_below}")
        if not self.window_s > 0:
            raise ValueError(f"'window_s' must be a number of seconds above 0, got {self.window_s}")
        if not 0.0 <= self.batch_share <= 1.0:
            raise ValueError(f"'batch_share' must be within [0, 1], got {self.batch_share}")

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
        share = self.batch_share
        out = []
        for u, load in zip(candidates, state.loads_of(candidates), strict=True):
            tpot = None if load is None else state.smoothed_tpot(u.id, self.window_s)
            if tpot is not None and share > 0.0 and load is not None:
                measured_on = state.smoothed_running(u.id, self.window_s)
                if measured_on:
                    now = load.num_running + state.pending(u.id)
                    tpot *= 1.0 + share * (now / measured_on - 1.0)
            if tpot is None or tpot <= start:
                out.append(1.0)
            else:
                out.append(max(0.0, (objective - tpot) / span))
        return out
