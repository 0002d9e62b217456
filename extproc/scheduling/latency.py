"""Observed-latency exploration: prefer upstreams that have been answering fast, and keep probing the
others so one that recovers gets its traffic back (UCB1-style, over a sliding exponential window).

For each upstream the scorer keeps, with weights that halve every `half_life_s` seconds:
- Q: the mean observed latency (TTFT, plus `tpot_tokens` x TPOT when that is set), from the engines'
  own interval means in snapshots (`Load.ttft_s` / `Load.tpot_s`, each weighted by the requests this
  process sent there since the previous one) and from `observe()` (per-request timings, e.g. what Envoy
  reports; see docs/tuning.md);
- n: the requests this process sent there (its picks).

    score(u) = (q(u) + c * sqrt(ln(1 + N) / n(u))) / max over candidates of the same
    q(u)     = (best latency + floor) / (latency(u) + floor)      1.0 for an upstream never observed

where N is the decayed number of picks over every upstream. A degraded upstream's q drops as soon as a
snapshot reports it, so it loses share; while it gets little traffic its n decays, its bonus grows and it
is probed again; once those probes come back fast its q (old observations having faded) recovers.
Because the weights decay with time, not with the number of observations, a long-avoided upstream's
first new observation dominates its estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import SCORERS, FleetState

MIN_PICKS = 1e-3  # an upstream never picked (or not for many half-lives): the largest bonus
MAX_ARMS = 4096  # upstreams tracked; the least recently picked are forgotten beyond this


@dataclass(slots=True)
class _Decayed:
    """A sum whose terms lose half their weight every half-life (kept as value-at-`at`)."""

    value: float = 0.0
    at: float = 0.0

    def get(self, now: float, rate: float) -> float:
        if now <= self.at or not self.value:
            return self.value
        return self.value * math.exp(-rate * (now - self.at))

    def add(self, amount: float, now: float, rate: float) -> None:
        self.value = self.get(now, rate) + amount
        self.at = max(now, self.at)


@dataclass(slots=True)
class _Arm:
    picks: _Decayed = field(default_factory=_Decayed)
    latency_sum: _Decayed = field(default_factory=_Decayed)  # weight x latency
    latency_weight: _Decayed = field(default_factory=_Decayed)
    picks_since_snapshot: int = 0
    snapshot: tuple[float, float | None] | None = None  # (published_at, ttft) of the last one read
    epoch: int = 0
    last_pick: float = 0.0

    def latency(self) -> float | None:
        """The weighted mean: sum and weight always decay together (same `at`), so their ratio at any
        later time is the ratio of the stored values."""
        weight = self.latency_weight.value
        if weight <= 1e-12:
            return None
        return self.latency_sum.value / weight

    def forget_latency(self) -> None:
        self.latency_sum = _Decayed()
        self.latency_weight = _Decayed()


@SCORERS.register("latency-ucb")
@dataclass(slots=True)
class LatencyUcbScorer:
    c: float = 0.3  # exploration weight
    half_life_s: float = 10.0  # observations and picks lose half their weight in this time
    tpot_tokens: float = 0.0  # latency = ttft + tpot_tokens x tpot (0: TTFT alone)
    floor_s: float = 0.005  # added to latencies before comparing them, so 1 ms vs 2 ms is no 2x
    _rate: float = field(init=False, repr=False)
    _arms: dict[str, _Arm] = field(init=False, repr=False, default_factory=dict)
    _total: _Decayed = field(init=False, repr=False, default_factory=_Decayed)
    _now: float = field(init=False, repr=False, default=0.0)

    def __post_init__(self) -> None:
        if self.c < 0 or self.half_life_s <= 0 or self.tpot_tokens < 0 or self.floor_s <= 0:
            raise ValueError("c >= 0, half_life_s > 0, tpot_tokens >= 0 and floor_s > 0 are required")
        self._rate = math.log(2.0) / self.half_life_s

    # -- observations ------------------------------------------------------------------------------
    def observe(
        self,
        upstream_id: str,
        ttft_s: float,
        tpot_s: float | None = None,
        *,
        weight: float = 1.0,
        now: float | None = None,
    ) -> None:
        """One latency observation for an upstream: a single request's time to first token (and time
        per output token), or a mean over `weight` requests. `now` defaults to the fleet clock as last
        seen by this scorer. Values that are not finite and non-negative are ignored."""
        if not (math.isfinite(ttft_s) and ttft_s >= 0 and math.isfinite(weight) and weight > 0):
            return
        latency = ttft_s
        if self.tpot_tokens:
            if tpot_s is None or not math.isfinite(tpot_s) or tpot_s < 0:
                return
            latency += self.tpot_tokens * tpot_s
        at = self._now if now is None else now
        arm = self._arm(upstream_id)
        arm.latency_sum.add(weight * latency, at, self._rate)
        arm.latency_weight.add(weight, at, self._rate)

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: its arm (latencies and picks) goes."""
        self._arms.pop(upstream_id, None)

    def _arm(self, upstream_id: str) -> _Arm:
        arm = self._arms.get(upstream_id)
        if arm is None:
            if len(self._arms) >= MAX_ARMS:
                oldest = min(self._arms, key=lambda k: self._arms[k].last_pick)
                del self._arms[oldest]
            arm = self._arms[upstream_id] = _Arm()
        return arm

    def _read_snapshot(self, upstream_id: str, arm: _Arm, load: Load, now: float) -> None:
        """Take the engines' interval mean from a snapshot not read before; a restart (new epoch)
        forgets what was observed of the instance's previous life."""
        if load.epoch != arm.epoch:
            arm.epoch = load.epoch
            arm.forget_latency()
        key = (load.published_at, load.ttft_s)
        if key == arm.snapshot:
            return
        arm.snapshot = key
        if load.ttft_s is not None:
            self.observe(
                upstream_id, load.ttft_s, load.tpot_s, weight=max(1, arm.picks_since_snapshot), now=now
            )
            arm.picks_since_snapshot = 0

    # -- the plugin --------------------------------------------------------------------------------
    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        now = self._now = state.now()
        rate = self._rate
        arms = []
        latencies: list[float | None] = []
        for u in candidates:
            arm = self._arm(u.id)
            load = state.load(u.id)
            if load is not None:
                self._read_snapshot(u.id, arm, load, now)
            arms.append(arm)
            latencies.append(arm.latency())
        known = [x for x in latencies if x is not None]
        best = min(known) if known else 0.0
        log_total = math.log1p(self._total.get(now, rate))
        raw = []
        for arm, latency in zip(arms, latencies, strict=True):
            q = 1.0 if latency is None else (best + self.floor_s) / (latency + self.floor_s)
            n = max(arm.picks.get(now, rate), MIN_PICKS)
            raw.append(q + self.c * math.sqrt(log_total / n))
        top = max(raw)
        return [x / top for x in raw] if top > 0 else [1.0] * len(raw)

    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None:
        now = self._now = state.now()
        arm = self._arm(upstream.id)
        arm.picks.add(1.0, now, self._rate)
        arm.picks_since_snapshot += 1
        arm.last_pick = now
        self._total.add(1.0, now, self._rate)
