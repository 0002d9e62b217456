"""Built-in scheduling plugins. Importing this module registers them."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import FILTERS, PICKERS, SCORERS, FleetState


@FILTERS.register("max-inflight")
@dataclass(slots=True)
class MaxInflightFilter:
    """Drops upstreams already holding `limit` requests per unit of capacity weight."""

    limit: int = 256

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        return [u for u in candidates if state.count(u.id) < self.limit * u.weight]


@SCORERS.register("least-outstanding")
@dataclass(slots=True)
class LeastOutstandingScorer:
    """1.0 for the upstream with the fewest outstanding requests per unit of weight, 0.0 for the most."""

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        return _inverse_minmax([state.count(u.id) / u.weight for u in candidates])


@FILTERS.register("saturation")
@dataclass(slots=True)
class SaturationFilter:
    """Drops upstreams whose engines report a nearly full KV cache or a long queue (defaults as in the
    seed routers: KV < 0.9, queue < 100). When that would drop everyone, keeps everyone: the
    least-loaded of a saturated fleet is still the best answer unless the profile sheds."""

    kv_cache_max: float = 0.9
    queue_max: int = 100
    keep_all_if_empty: bool = True

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        kept = []
        for u in candidates:
            load = state.load(u.id)
            if load is None or (
                load.kv_cache_usage < self.kv_cache_max and load.num_waiting / u.weight < self.queue_max
            ):
                kept.append(u)
        if not kept and self.keep_all_if_empty:
            return candidates
        return kept


@SCORERS.register("queue-depth")
@dataclass(slots=True)
class QueueDepthScorer:
    """Fewest queued requests per unit of capacity: the engine's reported waiting queue plus the growth
    of this process's in-flight count there since that report (own in-flight when there is no
    snapshot). Min-max scaled."""

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        depths = []
        for u in candidates:
            load = state.load(u.id)
            queued = state.pending(u.id) + (load.num_waiting if load is not None else 0)
            depths.append(queued / u.weight)
        return _inverse_minmax(depths)


@SCORERS.register("kv-cache-usage")
@dataclass(slots=True)
class KvCacheUsageScorer:
    """Emptiest KV cache: 1 - usage. 0.5 for upstreams without a snapshot (no information)."""

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        out = []
        for u in candidates:
            load = state.load(u.id)
            out.append(0.5 if load is None else 1.0 - load.kv_cache_usage)
        return out


def _inverse_minmax(values: Sequence[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - x) / span for x in values]


@SCORERS.register("session-affinity")
@dataclass(slots=True)
class SessionAffinityScorer:
    """1.0 for the upstream a session hashes to (rendezvous hashing, stable as upstreams come and go)."""

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        key = request.session or request.user
        if not key:
            return [0.0] * len(candidates)
        best = max(range(len(candidates)), key=lambda i: _rendezvous(key, candidates[i].id))
        return [1.0 if i == best else 0.0 for i in range(len(candidates))]


def _rendezvous(key: str, upstream_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{upstream_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class _SeededPicker:
    """Pickers that draw at random; `seed` makes a run repeatable."""

    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)


@PICKERS.register("max-score")
@dataclass(slots=True)
class MaxScorePicker(_SeededPicker):
    """Highest total score; ties broken at random so replicas with equal views do not herd."""

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream:
        top = max(scores)
        best = [i for i, s in enumerate(scores) if s >= top - 1e-9]
        return candidates[best[0] if len(best) == 1 else self._rng.choice(best)]


@PICKERS.register("weighted-random")
@dataclass(slots=True)
class WeightedRandomPicker(_SeededPicker):
    """Random choice with probability proportional to score (uniform when all scores are zero)."""

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream:
        if sum(scores) <= 0:
            return self._rng.choice(list(candidates))
        return self._rng.choices(list(candidates), weights=list(scores), k=1)[0]


@PICKERS.register("weighted-round-robin")
@dataclass(slots=True)
class WeightedRoundRobinPicker:
    """Smooth weighted round robin by capacity weight, ignoring scores: the fallback when no fresh
    fleet information exists (every request still succeeds, spread by configured capacity)."""

    _current: dict[str, float] = field(init=False, default_factory=dict)

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: its running weight goes."""
        self._current.pop(upstream_id, None)

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream:
        total = 0.0
        best: Upstream | None = None
        for u in candidates:
            cur = self._current.get(u.id, 0.0) + u.weight
            self._current[u.id] = cur
            total += u.weight
            if best is None or cur > self._current[best.id]:
                best = u
        assert best is not None
        self._current[best.id] -= total
        return best
