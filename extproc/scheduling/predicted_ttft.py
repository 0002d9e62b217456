"""`predicted-ttft`: score each candidate by the time to first token this request is predicted to see
there, in the engine's own units (tokens, blocks, prefill seconds), so cache affinity and load balance
are one number instead of two fighting scores: it counts work, not requests.

For a candidate u:

    ttft(u) = own(u)                        this request's own predicted TTFT there (the prepare
                                            stage's figure, scheduling/ttft_predictor.py: queued
                                            prefill, its uncached tokens, decode, KV room, batch)
            + evict(u)                      the blocks this placement pushes out of u's cache, as the
                                            prefill time someone will pay to bring them back
            + duplicate(u) - copy(u)        a cold copy of a prefix another candidate holds delays what
                                            queues behind it there; unless it relieves a much busier
                                            holder, when part of its prefill is discounted instead
            + footprint(u)                  a prefix no one holds goes where the cache is emptiest

These terms keep affinity and spreading honest without fixed bounds: a tenant stays with its holder
while the holder is not much busier than the rest, a prompt shared by all traffic spreads onto idle
engines, and a new prefix is placed as sglang-router's smallest-tree rule places it.

Scores are `(best + eps) / (ttft(u) + eps)`: 1 for the best candidate, falling with predicted delay.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.framework import PREDICTED_TTFT, SCORERS, FleetState
from extproc.scheduling.sharing import PeerChecks
from extproc.scheduling.ttft_predictor import DEFAULT_PREFILL_TOKENS_PER_S, TtftPredictor

# Scores are (best + this) / (ttft + this): candidates a few milliseconds apart score alike, whatever
# their ratio (an idle pool predicts ~0 everywhere).
SCORE_EPS_S = 0.005


@SCORERS.register("predicted-ttft")
@dataclass(slots=True)
class PredictedTtftScorer:
    """The placement costs over the predictor's per-candidate facts; the prepare stage, the pick
    and finish hooks and the replicas' sharing are the predictor's."""

    produces: ClassVar[tuple[str, ...]] = (PREDICTED_TTFT,)
    # Prefill throughput of one unit of capacity weight, the engine's tokens/s: the guess used until
    # the engines' counters measure it (scheduling/capacity.py). 8B-class model: ~34k on an H100,
    # ~2.4k on an A10G (docs/simulator.md).
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    block_tokens: int = 64  # tokens per index block (a multiple of the engine's block size)
    max_blocks: int = 2048  # prompts are matched on their first 128k tokens
    # Used before a snapshot says how much KV an upstream has: ~ an 8B model on an 80 GB GPU.
    default_kv_tokens: int = 400_000
    expected_output_tokens: int = 200  # KV room held for the output (capped by max_tokens)
    evict_weight: float = 0.5  # x the prefill seconds of the cached blocks a placement evicts
    duplicate_weight: float = 1.0  # x the prefill seconds of blocks another candidate has cached
    # A copy of a prefix another candidate holds, made where it evicts nothing and onto an engine far
    # less busy than the holder, is an investment: later requests of that prefix can go there too.
    # Charge only (1 - this x (1 - its load / the holder's)) of its prefill, so a hot prefix spreads
    # onto idle engines instead of queueing on its first holders.
    copy_discount: float = 0.9
    # A copy pays off only if later requests share that prefix: the discount is scaled by min(1,
    # recent requests whose longest held prefix ended at the same block / this), counts decayed over
    # `demand_window_s` (0: no scaling). A conversation's history is matched once per turn, each turn
    # one block further: no discount; a tenant's system prompt, matched by all its requests: in full.
    copy_demand: float = 5.0
    demand_window_s: float = 30.0
    # Each sequence running there slows the steps that prefill this prompt, in prefill-token
    # equivalents: ~6 on an A10G and ~11 on an H100 for an 8B model (step cost per decoding sequence,
    # including its KV reads, x the ~2-3 steps a first token spans, x prefill tokens per second).
    decode_tokens_per_running: float = 8.0
    footprint_weight: float = 0.25  # x this prompt's prefill x the cache's fill, for a prefix no one holds
    measured_rate: bool = True  # use the engines' measured prefill throughput where published
    rate_tolerance: float = 1.5  # measured rates this close to each other are one GPU type
    # Until an engine's prefill rate is measured, its GPU's nominal speed (snapshots' gpu_model,
    # fleet/gpus.py) orders it against the others; off: an unmeasured engine counts as the fastest.
    gpu_prior: bool = True
    # Charged when free KV cannot hold the uncached tokens: the wait for room in the request's own
    # TTFT, the rest as a placement cost (TtftPredictor._room_wait).
    room_penalty_s: float = 1.0
    # Pools larger than this are pre-selected (`_preselect`): the candidates holding the longest
    # prefix of the prompt plus a random sample of the others, up to this many, are predicted in
    # full and the rest score 0, so a decision's cost stops growing with the pool (0: predict all).
    max_evaluated: int = 64
    predictor: TtftPredictor = field(init=False)

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "block_tokens", "max_blocks", "default_kv_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"'{name}' must be positive")
        if self.max_evaluated < 0 or self.max_evaluated == 1:
            raise ValueError("'max_evaluated' must be 0 (all) or >= 2")
        if not self.rate_tolerance >= 1.0:
            raise ValueError("'rate_tolerance' must be >= 1")
        if not 0.0 <= self.copy_discount <= 1.0:
            raise ValueError("'copy_discount' must be in [0, 1]")
        if not self.demand_window_s > 0:
            raise ValueError("'demand_window_s' must be positive")
        for name in (
            "copy_demand",
            "expected_output_tokens",
            "evict_weight",
            "duplicate_weight",
            "decode_tokens_per_running",
            "footprint_weight",
            "room_penalty_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"'{name}' must be >= 0")
        self.predictor = TtftPredictor(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            block_tokens=self.block_tokens,
            max_blocks=self.max_blocks,
            default_kv_tokens=self.default_kv_tokens,
            expected_output_tokens=self.expected_output_tokens,
            decode_tokens_per_running=self.decode_tokens_per_running,
            measured_rate=self.measured_rate,
            rate_tolerance=self.rate_tolerance,
            gpu_prior=self.gpu_prior,
            room_penalty_s=self.room_penalty_s,
            max_evaluated=self.max_evaluated,
            count_demand=self.copy_demand > 0,
            demand_window_s=self.demand_window_s,
        )

    @property
    def calibration(self) -> Calibration:
        """The engines' counters against this scorer's sends (tokens per token of ours, TTFT error)."""
        return self.predictor.calibration

    def prompt_hash_spec(self) -> tuple[int, int]:
        return self.block_tokens, self.max_blocks

    def backlog(self, upstream: Upstream, state: FleetState) -> tuple[float, float]:
        """framework.PrefillQueue: the predictor's queued prefill at `upstream` and its mean prefill."""
        return self.predictor.backlog(upstream, state)

    # -- prepare and score ----------------------------------------------------------------------------
    def prepare(self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState) -> None:
        """framework.Producer: each candidate's own predicted TTFT, `request.prepared["predicted-ttft"]`."""
        self.predictor.prepare(request, candidates, state)

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        predicted = self._placed_costs(request, candidates, state)
        best = min(predicted)
        eps = SCORE_EPS_S
        return [(best + eps) / (p + eps) for p in predicted]

    def _placed_costs(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> list[float]:
        """Each candidate's own TTFT plus the placement costs relative to the others: the blocks it
        evicts, a copy of a prefix another candidate holds (or its discount), the footprint of a
        prefix nobody holds. Unevaluated candidates (outside a large pool's sample): infinite."""
        predictor = self.predictor
        pred, facts = predictor.facts(request, candidates, state)
        known = [f for f in facts if f is not None]
        if not known:
            return [math.inf] * len(candidates)
        now = state.now()
        bt = self.block_tokens
        best_matched = max(f.matched for f in known)
        pred.best_matched = best_matched
        discount = self.copy_discount
        if self.copy_demand > 0 and best_matched and discount:
            discount *= min(1.0, predictor.demand_at(pred.hashes[best_matched - 1], now) / self.copy_demand)
        # The least busy of the candidates holding the most of this prompt: what a copy would relieve.
        holder_running = min(f.running for f in known if f.matched == best_matched)
        predicted: list[float] = []
        for f in facts:
            if f is None:
                predicted.append(math.inf)
                continue
            rate = f.own_rate  # what the prediction used (this service's tokens per second)
            ttft = f.own + f.crowding + self.evict_weight * f.evicted * bt / rate
            m = f.matched
            if best_matched > m:
                # A copy of a prefix another candidate holds costs only where the cache has no room
                # for it (it evicts others, or waits for running requests to free blocks).
                copy_s = (best_matched - m) * bt / rate
                relief = 0.0
                if not f.over and holder_running > f.running:
                    relief = 1.0 - (f.running + 1) / (holder_running + 1)
                # A copy is penalised unless it relieves a much busier holder; then it is discounted.
                ttft += copy_s * (self.duplicate_weight * (1.0 - relief))
                ttft -= copy_s * discount * relief
            elif best_matched == 0 and self.footprint_weight:
                ttft += self.footprint_weight * f.uncached / rate * f.fill
            predicted.append(ttft)
        return predicted

    # -- hooks, sharing and reports: the predictor's state ---------------------------------------------
    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None:
        self.predictor.on_pick(request, upstream, state)

    def on_finish(self, request: InferenceRequest, upstream: Upstream) -> None:
        self.predictor.on_finish(request, upstream)

    def take_updates(self) -> list[Any]:
        return self.predictor.take_updates()

    def check_peers(self, checks: PeerChecks) -> None:
        self.predictor.check_peers(checks)

    def apply_updates(self, origin: str, updates: list[Any]) -> None:
        self.predictor.apply_updates(origin, updates)

    def forget_upstream(self, upstream_id: str) -> None:
        self.predictor.forget_upstream(upstream_id)

    def forget_origin(self, origin: str) -> None:
        self.predictor.forget_origin(origin)

    def dump(self) -> Any:
        return self.predictor.dump()

    def load(self, data: Any) -> None:
        self.predictor.load(data)

    def report(self) -> Iterator[tuple[str, str, float]]:
        return self.predictor.report()

    def index_sizes(self) -> dict[str, int]:
        return self.predictor.index_sizes()
