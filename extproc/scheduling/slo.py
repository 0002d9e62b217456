"""`slo-ttft` and `slo-tpot`: a request's own TTFT / TPOT objective, met where predicted, else 429.

`slo-ttft`, for the time to first token:

A request opts in with an objective (`x-llm-ttft-slo-ms`, or the route's metadata); without one this
filter passes everything through. With one, it reads this request's own predicted TTFT on every
candidate from the decision's prepared figures (`predicted-ttft`, written once by the profile's
`predicted-ttft` scorer in the prepare stage: the same prediction that scores them, no second model)
and keeps those within the objective. When none is, the request is shed at once with 429
`slo_unattainable` (and Retry-After): a request that asked for a first token within 300 ms is better
told now than served in 3 s. The predictions are only as good as `prefill_tokens_per_s`: set it to
the GPUs' real prefill rate (docs/tuning.md).

`slo-tpot`, for the time per output token (`x-llm-tpot-slo-ms`, or the route's metadata): sheds the
request with 429 `slo_unattainable` when no candidate's engines decode within `margin` (0.9) x the
objective now (their own inter-token latency from the snapshots, smoothed over `window_s` by the
fleet view: fleet/tpot.py, the figure admission's TPOT gate reads); an engine that reports no
figure (idle, or no snapshot yet) counts as within. It does not narrow the candidates:
`decode-speed` steers the request (see the class).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.openai.errors import slo_unattainable
from extproc.scheduling.framework import FILTERS, PREDICTED_TTFT, FleetState, prepared_figure
from extproc.settings import DEFAULT_TPOT_MARGIN, DEFAULT_TPOT_WINDOW_S


@FILTERS.register("slo-ttft")
@dataclass(slots=True)
class SloTtftFilter:
    consumes: ClassVar[tuple[str, ...]] = (PREDICTED_TTFT,)
    # Keep candidates whose prediction is within objective x this (below 1: a safety margin).
    margin: float = 1.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ValueError("'margin' must be positive")
        if self.retry_after_s < 1:
            raise ValueError("'retry_after_s' must be >= 1")

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        slo_ms = request.ttft_slo_ms
        if slo_ms is None or not candidates:
            return candidates
        predicted = prepared_figure(request, PREDICTED_TTFT, candidates)
        if predicted is None:
            return candidates
        limit = slo_ms / 1000.0 * self.margin
        kept = [u for u, p in zip(candidates, predicted, strict=True) if p <= limit]
        if not kept:
            raise slo_unattainable(slo_ms, min(predicted) * 1000.0, self.retry_after_s, margin=self.margin)
        return kept


@FILTERS.register("slo-tpot")
@dataclass(slots=True)
class SloTpotFilter:
    """Sheds a request with a TPOT objective when no candidate decodes within it; never narrows.

    It does not narrow to the candidates under the objective: the smoothed figure lags by seconds,
    so every request with an objective would land on the few engines under it, which then slow down,
    and their prefixes would be left behind (notebook/benchmarks-history.md, "TPOT objectives per
    request"). Steering is `decode-speed`'s job (in the default profile: it reads the request's
    objective)."""

    # Shed when every candidate's smoothed TPOT is above objective x this: below 1 leaves room for
    # what this request and those sent with it add before the figure shows it (why 0.9:
    # notebook/benchmarks-history.md, "Room for the requests sent since").
    margin: float = DEFAULT_TPOT_MARGIN  # the same share as admission's TPOT gate
    window_s: float = DEFAULT_TPOT_WINDOW_S  # the smoothing's time constant (fleet/tpot.py)
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ValueError("'margin' must be positive")
        if self.retry_after_s < 1:
            raise ValueError("'retry_after_s' must be >= 1")
        if not self.window_s > 0:
            raise ValueError(f"'window_s' must be a number of seconds above 0, got {self.window_s}")

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        slo_ms = request.tpot_slo_ms
        if slo_ms is None or not candidates:
            return candidates
        limit = slo_ms / 1000.0 * self.margin
        best: float | None = None
        for u, load in zip(candidates, state.loads_of(candidates), strict=True):
            tpot = None if load is None else state.smoothed_tpot(u.id, self.window_s)
            if tpot is None or tpot <= limit:
                return candidates  # one can: route as usual
            if best is None or tpot < best:
                best = tpot
        best_ms = None if best is None else best * 1000.0
        raise slo_unattainable(
            slo_ms, best_ms, self.retry_after_s, measure="time per output token", margin=self.margin
        )
