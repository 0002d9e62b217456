"""Built-in scheduling plugins. Importing this module registers them."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import FleetState, register


@register("filter", "max-inflight")
@dataclass(slots=True)
class MaxInflightFilter:
    """Drops upstreams already holding `limit` requests per unit of capacity weight."""

    limit: int = 256
    name: str = "max-inflight"

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        return [u for u in candidates if state.count(u.id) < self.limit * u.weight]


@register("scorer", "least-outstanding")
@dataclass(slots=True)
class LeastOutstandingScorer:
    """1.0 for the upstream with the fewest outstanding requests per unit of weight, 0.0 for the most."""

    name: str = "least-outstanding"

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        loads = [state.count(u.id) / u.weight for u in candidates]
        lo, hi = min(loads), max(loads)
        if hi == lo:
            return [1.0] * len(loads)
        span = hi - lo
        return [(hi - x) / span for x in loads]


@register("scorer", "session-affinity")
@dataclass(slots=True)
class SessionAffinityScorer:
    """1.0 for the upstream a session hashes to (rendezvous hashing, stable as upstreams come and go)."""

    name: str = "session-affinity"

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


@register("picker", "max-score")
@dataclass(slots=True)
class MaxScorePicker:
    """Highest total score; ties broken at random so replicas with equal views do not herd."""

    seed: int | None = None
    name: str = "max-score"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream:
        top = max(scores)
        best = [i for i, s in enumerate(scores) if s >= top - 1e-9]
        return candidates[best[0] if len(best) == 1 else self._rng.choice(best)]


@register("picker", "weighted-random")
@dataclass(slots=True)
class WeightedRandomPicker:
    """Random choice with probability proportional to score (uniform when all scores are zero)."""

    seed: int | None = None
    name: str = "weighted-random"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream:
        if sum(scores) <= 0:
            return self._rng.choice(list(candidates))
        return self._rng.choices(list(candidates), weights=list(scores), k=1)[0]
