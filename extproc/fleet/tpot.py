"""The engines' time per output token (TPOT), smoothed once per snapshot where snapshots arrive (the
fleet view's rebuild), so every reader (admission's TPOT gate, `slo-tpot`, `decode-speed`) sees the
same figure, whoever reads first and however often."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from extproc.settings import DEFAULT_TPOT_WINDOW_S


class TpotReport(Protocol):
    """What is read of `fleet.view.Load` (a protocol: the view imports this module)."""

    @property
    def tpot_s(self) -> float | None: ...
    @property
    def num_running(self) -> int: ...
    @property
    def unknown(self) -> frozenset[str]: ...
    @property
    def published_at(self) -> float: ...
    @property
    def epoch(self) -> int: ...


MAX_TRACKED_UPSTREAMS = 4096  # smoothed figures kept; all dropped at once beyond (a churning fleet)


@dataclass(slots=True)
class _Smoothed:
    published_at: float  # of the last snapshot taken in
    epoch: int
    value: float
    running: float  # num_running smoothed the same way: the batch `value` was measured on


class SmoothedTpot:
    """Per upstream, the snapshots' TPOT (`Load.tpot_s`: the mean gap between tokens over one publish
    interval) smoothed over `window_s` of snapshot time; each snapshot is taken in once, a restart
    (new epoch) starts afresh.

    The interval means are averaged over time, not weighted by their tokens: an interval that holds
    one long prefill step (one token per sequence, a huge mean) weighs as much as one of twenty
    ordinary steps, so the figure reads high while cold prefills crowd the engine, which is when one
    more request hurts most (notebook/benchmarks-history.md, "TPOT-aware admission", compares this
    with the token-weighted mean, smoothing 1 / TPOT)."""

    __slots__ = ("_seen", "window_s")

    def __init__(self, window_s: float = DEFAULT_TPOT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._seen: dict[str, _Smoothed] = {}

    def value(self, upstream_id: str) -> float | None:
        """The figure as of the last snapshot taken in, or None while nothing is known (no report yet,
        or idle)."""
        seen = self._seen.get(upstream_id)
        return None if seen is None else seen.value

    def running(self, upstream_id: str) -> float | None:
        """The engines' running requests smoothed alongside (same weights), so a reader can tell how
        far the batch has grown or shrunk since the figure was measured; None with no figure."""
        seen = self._seen.get(upstream_id)
        return None if seen is None else seen.running

    def forget(self, upstream_id: str) -> None:
        self._seen.pop(upstream_id, None)

    def take_all(self, loads: Mapping[str, TpotReport]) -> None:
        for upstream_id, load in loads.items():
            self.take(upstream_id, load)

    def take(self, upstream_id: str, load: TpotReport) -> float | None:
        """Take in `load`'s snapshot unless already taken; the figure after it (as value())."""
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
            self._seen[upstream_id] = _Smoothed(load.published_at, load.epoch, tpot, load.num_running)
            return tpot
        dt = max(0.0, load.published_at - seen.published_at)
        weight = 1.0 - math.exp(-dt / self.window_s)
        seen.value += weight * (tpot - seen.value)
        seen.running += weight * (load.num_running - seen.running)
        seen.published_at = load.published_at
        return seen.value
