"""The model behind `predicted-ttft` (scheduling/predicted_ttft.py): what each candidate holds of a
prompt and how much prefill is queued there, so it predicts the time to first token this request
would see on each, in the engine's own units (tokens, blocks, prefill seconds). The scorer adds the
costs a placement puts on others; this class keeps the state and the per-candidate facts.

For a candidate u, the request's own predicted TTFT is

    own(u) = wait(u)                        prefill work queued ahead, in seconds
           + uncached(u) / rate(u)          this prompt's tokens u does not hold in its prefix cache
           + decode(u)                      running sequences slow every step that prefills
           + room(u)                        u's free KV cannot hold those tokens: they wait for room
           + batch(u)                       a place in a batch at its published max_num_seqs

- `uncached(u)` comes from a model of u's cache (`CacheModel`) bounded by u's real KV capacity from its
  snapshots, LRU like the engine's, with running requests' blocks pinned; reset when u changes
  readiness (a restart). Where u's engine publishes KV-cache events (fleet/kv_index.py) and the prompt
  was tokenized, the engine's exact set replaces the model's guess (united with pinned blocks).
- `wait(u)` is a virtual prefill queue: each routed request adds its uncached prefill time; the queue
  drains in real time at `rate(u)`. Snapshots correct it: one reporting W waiting has at least W
  average prefills queued. One reporting none waiting may still be prefilling (engines that prefill in
  chunks count those prompts as running), so what the queue held before that snapshot is cut to a
  share (`BACKLOG_KEPT`) rather than dropped: repeated snapshots with none waiting drain it, and a
  busy engine stays busy in the model through the first seconds, when the prompts are cold.
- `rate(u)` is the engine's measured prefill throughput (scheduling/capacity.py: alike GPUs share one
  figure, so a busy engine's low readings are not taken for a slower GPU; the configured
  `prefill_tokens_per_s` until measured), so GPUs of different speeds get their share without
  hand-set weights. Where it moves past `RATE_RESCALE` (the first measurement of a GPU faster than
  the configured figure), the seconds already queued are re-read at the new rate.
- Tokens are this service's count (token ids with a tokenizer, bytes/4 without), converted into the
  engine's wherever they meet an engine figure (KV capacity, prefill rate) by the ratio learnt from the
  engine's own prompt-token counter (scheduling/calibration.py). The same calibration compares each
  request's predicted TTFT with what the engine then reports (metrics, explain header, doctor).

Other replicas' picks and finishes (scheduling/ttft_records.py) move the same caches and queues.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.cache_model import CacheModel, Placement
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.capacity import prefill_rates
from extproc.scheduling.framework import PREDICTED_TTFT, FleetState
from extproc.scheduling.prefix import prefix_hashes
from extproc.scheduling.sharing import Outbox, PeerChecks, loaded_hashes, pack_hashes
from extproc.scheduling.ttft_records import Finish, Pick, Reset, decode
from extproc.tokenization import block_hashes, estimate_tokens

DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0  # an A10G-class GPU on an 8B model, erring low
BYTES_PER_TOKEN = 4  # the estimate used when a request carries no token ids (see tokenization)
MAX_TRACKED = 200_000  # routed requests remembered until they finish
SENT_WINDOW_S = 60.0  # recent sends kept per upstream
MAX_DEMAND_KEYS = 100_000  # prefix ends whose recent demand is counted (copy_demand), least recent out
# The least share of `room_penalty_s` a request's own KV-room wait is, however fast the engine turns
# its batch over (notebook/benchmarks-history.md, "Preemptions in the measured prefill rate, and the
# KV-room wait").
ROOM_WAIT_FLOOR = 0.1
# The share of the prefill queued before a snapshot with no request waiting that is kept past it
# (notebook/benchmarks-history.md, "The prefill backlog past a snapshot with none waiting").
BACKLOG_KEPT = 0.8
# An engine's prefill rate moving by more than this factor (its first measurement, a slowed GPU)
# re-reads the seconds queued there at the new rate: they were computed at the old one.
RATE_RESCALE = 1.25


@dataclass(slots=True)
class _UpstreamModel:
    cache: CacheModel
    epoch: int = 0
    busy_until: float = 0.0  # when the prefill work sent here is predicted to be done
    snapshot_at: float = 0.0  # published_at of the last snapshot used for a correction
    rate: float = 0.0  # the prefill rate (engine tokens/s) the queued seconds were computed at
    sent: deque[tuple[float, float]] = field(default_factory=deque)  # (when, prefill seconds) recent
    mean_prefill_s: float = 0.0  # moving mean of the prefill seconds of requests sent here


@dataclass(slots=True)
class _HeldRates:
    """Prefill rates of one candidate set, kept while its objects stand (they are immutable and
    replaced when the view is rebuilt; held here, their ids cannot be reused meanwhile)."""

    candidates: tuple[Upstream, ...]
    loads: tuple[Load | None, ...]
    key: tuple[tuple[int, ...], tuple[int, ...]]
    rates: dict[str, float]


_Scan = tuple[int, Mapping[bytes, int], Mapping[bytes, None]]  # candidate index, its cache's two maps


@dataclass(slots=True)
class Facts:
    """One candidate's figures for one request, computed once per decision (prepare) and read by
    the scorer (with the placement costs relative to the other candidates) and on_pick()."""

    matched: int  # leading blocks of the prompt it holds
    running: int  # sequences there (running + waiting + sent since)
    rate: float  # its prefill tokens/s, engine tokens
    uncached: int  # this prompt's tokens it does not hold, this service's count
    own: float  # this request's own predicted TTFT there
    evicted: int  # cached blocks this placement would push out
    own_rate: float  # its prefill tokens/s, this service's count (rate over the token ratio)
    over: bool  # the placement would evict (the cache has no room for it)
    fill: float  # the share of its cache in use
    crowding: float  # the room penalty beyond the wait for room: what a full engine costs others


@dataclass(slots=True)
class Prediction:
    """One request's numbers: hashed once, its candidates' facts computed once per decision."""

    request: InferenceRequest | None = None
    hashes: list[bytes] = field(default_factory=list)
    tokens: int = 0  # in this service's count (token ids, or the bytes/4 estimate)
    facts: dict[str, Facts] = field(default_factory=dict)
    # The decision's prepared figures the facts were written into (request.prepared); None: computed
    # outside a prepare stage, so good for one call only.
    store: dict[str, dict[str, float]] | None = None
    prepared_for: Sequence[Upstream] = ()  # the candidates prepare() was given (score's usual set)
    best_matched: int = 0  # leading blocks held by the candidate holding the most of the prompt


@dataclass(slots=True)
class TtftPredictor:
    """Per-candidate facts for one request and the state they come from (cache models, virtual
    prefill queues, prefill rates, prefix demand, replicas' placements). Built by the scorer from its
    parameters (documented there)."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    block_tokens: int = 64
    max_blocks: int = 2048
    default_kv_tokens: int = 400_000
    expected_output_tokens: int = 200
    decode_tokens_per_running: float = 8.0
    measured_rate: bool = True
    rate_tolerance: float = 1.5
    gpu_prior: bool = True
    room_penalty_s: float = 1.0
    max_evaluated: int = 64
    count_demand: bool = True  # count each pick's longest held prefix (demand_at)
    demand_window_s: float = 30.0
    _rng: random.Random = field(init=False, default_factory=random.Random)
    _models: dict[str, _UpstreamModel] = field(init=False, default_factory=dict)
    _last: Prediction = field(init=False, default_factory=Prediction)
    _placed: dict[int, tuple[InferenceRequest, str, Placement, int]] = field(init=False, default_factory=dict)
    # Sharing between replicas (framework.SharedPlugin): own picks and finishes for the others, and
    # the others' placements here, by replica and that replica's serial, until their finish arrives.
    _outbox: Outbox = field(init=False, default_factory=Outbox)
    _serial: int = field(init=False, default=0)
    _remote: dict[str, dict[int, tuple[str, Placement]]] = field(init=False, default_factory=dict)
    _peers: PeerChecks = field(init=False, default_factory=PeerChecks)  # what their records must pass
    # The last two sets' prefill rates (a decision's whole set and what its filters left of it).
    _rates_held: list[_HeldRates] = field(init=False, default_factory=list)
    # _preselect's scan list: (index, pinned, evictable) per candidate with a model, kept while the
    # candidates object and the set of models stay the same.
    _scan_key: tuple[int, int] = field(init=False, default=(0, -1))
    _scan_held: Sequence[Upstream] = field(init=False, default=())
    _scan: list[_Scan] = field(init=False, default_factory=list)
    _index_held: Sequence[Upstream] = field(init=False, default=())
    _index: dict[str, int] = field(init=False, default_factory=dict)
    _demand: OrderedDict[bytes, tuple[float, float]] = field(init=False, default_factory=OrderedDict)
    # The engines' counters against this service's sends: tokens per token of ours, TTFT error.
    calibration: Calibration = field(init=False, default_factory=Calibration)

    # -- the request's blocks -----------------------------------------------------------------------
    def predict(self, request: InferenceRequest) -> Prediction:
        """Hashed once per request: prepare(), the scorer and on_pick() of the same decision share it."""
        last = self._last
        if last.request is request:
            return last
        ids = request.prompt_token_ids
        held = request.block_hashes
        if ids and held is not None and held[0] == self.block_tokens:  # hashed off the event loop
            hashes = held[1][: self.max_blocks]
            tokens = request.prompt_tokens or len(ids)
        elif ids:
            hashes = block_hashes(ids, self.block_tokens, self.max_blocks)
            tokens = request.prompt_tokens or len(ids)
        else:
            text = request.prompt_text
            hashes = prefix_hashes(text, self.block_tokens * BYTES_PER_TOKEN, self.max_blocks)
            tokens = max(1, estimate_tokens(text, BYTES_PER_TOKEN))  # no copy for ASCII text
        self._last = Prediction(request, hashes, tokens)
        return self._last

    def _model(self, upstream_id: str, load: Load | None) -> _UpstreamModel:
        model = self._models.get(upstream_id)
        if model is None:
            model = self._models[upstream_id] = _UpstreamModel(
                CacheModel(self.default_kv_tokens // self.block_tokens)
            )
        if load is not None:
            if load.epoch != model.epoch:
                model.cache.reset()
                model.epoch = load.epoch
                model.busy_until = 0.0
            if load.counters is not None:
                self.calibration.observe(
                    upstream_id, load.counters, load.published_at, load.instances, load.epoch
                )
            if load.kv_blocks_total and load.block_size:
                # The engine's KV in tokens of this service's count: its blocks x its block size, over
                # its tokens per token of ours (calibration).
                kv_tokens = load.kv_blocks_total * load.block_size / self.calibration.ratio(upstream_id)
                model.cache.resize(max(1, int(kv_tokens) // self.block_tokens))
        return model

    def backlog(self, upstream: Upstream, state: FleetState) -> tuple[float, float]:
        """(seconds of prefill queued at `upstream`, mean prefill seconds of a request sent there):
        the saturation signal admission reads (lifecycle/admission.py), in the engine's units."""
        model = self._model(upstream.id, state.load(upstream.id))
        return self._wait(model, state.load(upstream.id), state.now()), model.mean_prefill_s

    def _wait(self, model: _UpstreamModel, load: Load | None, now: float, rate: float = 0.0) -> float:
        """Seconds of prefill queued ahead at `rate` (the engine's prefill tokens/s, when known),
        with the engine's last word applied."""
        if rate and model.rate and not 1 / RATE_RESCALE <= rate / model.rate <= RATE_RESCALE:
            _rescale(model, model.rate / rate, now)
        if rate and not model.rate:
            model.rate = rate
        sent = model.sent
        while sent and sent[0][0] < now - SENT_WINDOW_S:
            sent.popleft()
        if load is not None and load.published_at > model.snapshot_at and "num_waiting" not in load.unknown:
            # (an estimated queue, the fleet's median standing in for one the engine did not
            # report, says nothing about this engine: keep the model's own account)
            model.snapshot_at = load.published_at
            since = load.published_at
            # The queue as it would be had it been empty at the snapshot, then fed what was sent since.
            refill = since
            sent_since = 0.0
            for t, s in sent:
                if t > since:
                    refill = max(refill, t) + s
                    sent_since += s
            if load.num_waiting == 0:
                # What was queued before the snapshot, a share of it kept: none waiting is not none
                # in prefill.
                left = max(0.0, model.busy_until - since - sent_since)
                model.busy_until = min(model.busy_until, refill + BACKLOG_KEPT * left)
            else:
                floor = refill + load.num_waiting * model.mean_prefill_s
                model.busy_until = max(model.busy_until, floor)
        return max(0.0, model.busy_until - now)

    # -- the facts of a decision ------------------------------------------------------------------
    def prepare(self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState) -> None:
        """framework.Producer: this request's own predicted TTFT on each candidate (a large pool's
        sample of them: `_preselect`), written into `request.prepared["predicted-ttft"]` and kept,
        with what it is made of, for the scorer and on_pick() of the same decision."""
        pred = self.predict(request)
        pred.store = request.prepared
        pred.prepared_for = candidates
        pred.facts = {}
        self._add_facts(request, pred, candidates, state, sample=True)
        # The prefix demand a pick counts (copy_demand) is this set's longest match until a score
        # over the candidates left says otherwise.
        pred.best_matched = max((f.matched for f in pred.facts.values()), default=0)

    def facts(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> tuple[Prediction, list[Facts | None]]:
        """The facts of each candidate: those the decision's prepare stage computed, plus any
        candidate it did not or whose prefill rate differs among these candidates (a profile used
        without the stage computes them all here, anew)."""
        pred = self.predict(request)
        if pred.store is None or pred.store is not request.prepared:  # no prepare stage: this call's
            pred.store = None
            pred.facts = {}
            self._add_facts(request, pred, candidates, state, sample=True)
        elif candidates is not pred.prepared_for:  # the filters narrowed the set prepared
            facts = pred.facts
            # Prefill rates are compared within the candidates scored (capacity.py groups alike
            # GPUs among them): where the filters left a set whose grouping differs, the candidates
            # whose rate moved are predicted again.
            rates = self._rates(candidates, state.loads_of(candidates))
            moved = [u for u in candidates if (f := facts.get(u.id)) is not None and f.rate != rates[u.id]]
            if moved:
                self._add_facts(request, pred, moved, state, sample=False, pool=candidates)
            missing = [u for u in candidates if u.id not in facts]
            if missing and (
                not self.max_evaluated
                or len(candidates) <= self.max_evaluated
                or not any(u.id in facts for u in candidates)  # none of its sample left: a new one
            ):
                self._add_facts(
                    request, pred, missing, state, sample=len(missing) == len(candidates), pool=candidates
                )
        facts = pred.facts
        return pred, [facts.get(u.id) for u in candidates]

    def _add_facts(
        self,
        request: InferenceRequest,
        pred: Prediction,
        candidates: Sequence[Upstream],
        state: FleetState,
        sample: bool,
        pool: Sequence[Upstream] | None = None,
    ) -> None:
        """Facts for `candidates` (for at most `max_evaluated` of them when `sample`), written into
        the decision's prepared figures when there are some. Prefill rates are compared over `pool`
        (the candidates themselves by default)."""
        if not candidates:
            return
        loads = state.loads_of(candidates)
        # Rates over the whole set (cached while the view stands): a sample's slowest is not the pool's.
        rates = self._rates(candidates, loads) if pool is None else self._rates(pool, state.loads_of(pool))
        if sample and self.max_evaluated and len(candidates) > self.max_evaluated:
            chosen = self._preselect(request, pred.hashes, candidates, state)
            candidates = [candidates[i] for i in chosen]
            loads = [loads[i] for i in chosen]
        now = state.now()
        bt = self.block_tokens
        new_output = math.ceil(self._output_tokens(request) / bt)
        ratio = self.calibration.ratio
        figures = None
        if pred.store is not None:
            figures = pred.store.setdefault(PREDICTED_TTFT, {})
        facts = pred.facts
        # Every snapshot is taken in (calibration, cache sizes) before any figure is read: the pool's
        # token ratio, which an upstream without its own reads, moves with each.
        models = [self._model(u.id, load) for u, load in zip(candidates, loads, strict=True)]
        for u, load, model in zip(candidates, loads, models, strict=True):
            m = self._matched(request, pred.hashes, model, u.id, state)
            running = self._running(u, load, state)
            engine_rate = rates[u.id]  # the engine's tokens per second
            rate = engine_rate / ratio(u.id)  # tokens of this service's count per second
            uncached = pred.tokens - min(m * bt, pred.tokens - 1)
            ttft = self._wait(model, load, now, engine_rate) + uncached / rate
            ttft += self.decode_tokens_per_running * running / engine_rate
            ttft += slot_wait(state, u.id)
            cache = model.cache
            new_blocks = len(pred.hashes) - m + new_output
            deficit = new_blocks - (cache.capacity_blocks - cache.pinned_blocks)
            crowding = 0.0
            if deficit > 0:
                wait = self._room_wait(u.id, deficit, running, cache.pinned_blocks, state)
                ttft += wait
                crowding = self.room_penalty_s - wait
            over = max(0, cache.used_blocks + new_blocks - cache.capacity_blocks)
            evicted = min(over, cache.used_blocks - cache.pinned_blocks)
            facts[u.id] = Facts(
                matched=m,
                running=running,
                rate=engine_rate,
                uncached=uncached,
                own=ttft,
                evicted=evicted,
                own_rate=rate,
                over=over > 0,
                fill=cache.used_blocks / cache.capacity_blocks,
                crowding=crowding,
            )
            if figures is not None:
                figures[u.id] = ttft

    def _room_wait(
        self, upstream_id: str, deficit: int, running: int, pinned: int, state: FleetState
    ) -> float:
        """Seconds until the engine frees the KV blocks a request lacks: the requests that must finish
        first (the deficit over the blocks one of them pins) over the requests a second that get their
        first token there (the batch's turnover, fleet/batch.py), within ROOM_WAIT_FLOOR-1x
        `room_penalty_s`; the penalty itself while the turnover is unknown. A fast engine with a full
        cache is nearer to room than a slow one: where critical requests are placed by their own
        predicted TTFT, charged the flat penalty they left the H100s of a mixed fleet for A10G queues."""
        penalty = self.room_penalty_s
        if running <= 0 or pinned <= 0:
            return penalty
        turnover = state.batch(upstream_id)[2]
        if not turnover:
            return penalty
        return min(penalty, max(ROOM_WAIT_FLOOR * penalty, deficit * running / (turnover * pinned)))

    def _preselect(
        self,
        request: InferenceRequest,
        hashes: list[bytes],
        candidates: Sequence[Upstream],
        state: FleetState,
    ) -> list[int]:
        """Indices of at most `max_evaluated` candidates worth predicting in a large pool: those that
        hold this prompt's first block (the longest matches first, at most half of the places when
        many do, so a prefix every engine holds still leaves room for idle ones), then a random sample
        of the rest. Random, not least-loaded: replicas sampling the same "least loaded" engines would
        herd onto them between snapshots, and a random handful already finds a near-best cold engine
        (power of d choices)."""
        k = self.max_evaluated
        holders: list[int] = []
        if hashes:
            h0 = hashes[0]
            # ~1000 candidates a decision: plain dict lookups over a kept list, no calls per candidate.
            scan = self._scan_list(candidates)
            holders = [i for i, pinned, evictable in scan if h0 in pinned or h0 in evictable]
            if request.prompt_token_ids:  # the engines' own KV events may know more
                kv_ids = state.kv_holders(h0)
                if kv_ids:
                    seen = set(holders)
                    index = self._index_of(candidates)
                    for uid in kv_ids:
                        i = index.get(uid)
                        if i is None or i in seen:
                            continue
                        if (held := state.kv_blocks(uid)) is not None and h0 in held.blocks:
                            holders.append(i)
                            seen.add(i)
        if len(holders) > k // 2:
            # A prefix held by most of a large pool (a shared system prompt): rank a random 2k of its
            # holders, not all, so the match walks stay bounded; shuffled so equal matches have no
            # fixed favourite.
            holders = self._rng.sample(holders, min(len(holders), 2 * k))
            lengths = {}
            for i in holders:
                uid = candidates[i].id
                lengths[i] = self._ranked_depth(request, hashes, uid, state)
            holders.sort(key=lengths.__getitem__, reverse=True)
            del holders[k // 2 :]
        # The random rest: a sample of all indices, less the holders it drew (k draws, not a pass
        # over the pool).
        taken = set(holders)
        n = len(candidates)
        need = min(n - len(taken), k - len(holders))
        drawn = self._rng.sample(range(n), min(n, need + len(taken)))
        return holders + [i for i in drawn if i not in taken][:need]

    def _ranked_depth(
        self, request: InferenceRequest, hashes: list[bytes], uid: str, state: FleetState
    ) -> int:
        """Leading blocks `uid` holds, to rank a large pool's holders: the sources `_matched` reads,
        probed by galloping and bisection (O(log n) lookups instead of n), which assumes that the
        prefix of a held block is held, as in an engine's prefix cache but for the order evictions
        happen in. The candidates kept are then matched exactly (`_predicted`)."""
        pinned, evictable = self._model(uid, None).cache.maps()
        held = state.kv_blocks(uid) if request.prompt_token_ids else None
        if held is None:
            return _leading(hashes, lambda h: h in pinned or h in evictable)
        blocks = held.blocks
        if held.complete:
            return _leading(hashes, lambda h: h in pinned or h in blocks)
        return _leading(hashes, lambda h: h in pinned or h in evictable or h in blocks)

    def _index_of(self, candidates: Sequence[Upstream]) -> dict[str, int]:
        """Candidate index by upstream id, kept for an immutable candidates tuple."""
        if self._index_held is not candidates:
            index = {u.id: i for i, u in enumerate(candidates)}
            if not isinstance(candidates, tuple):
                return index
            self._index, self._index_held = index, candidates
        return self._index

    def _scan_list(self, candidates: Sequence[Upstream]) -> list[_Scan]:
        """Kept for an immutable candidates tuple (the view's, until it is rebuilt) while no model is
        added; built anew for anything else."""
        key = (id(candidates), len(self._models))
        if key != self._scan_key or self._scan_held is not candidates:
            models = self._models
            scan = [(i, *m.cache.maps()) for i, u in enumerate(candidates) if (m := models.get(u.id))]
            if not isinstance(candidates, tuple):
                return scan
            self._scan, self._scan_key, self._scan_held = scan, key, candidates
        return self._scan

    def _rates(self, candidates: Sequence[Upstream], loads: Sequence[Load | None]) -> dict[str, float]:
        """Prefill tokens/s per candidate, in the engines' tokens (scheduling/capacity.py), over the
        whole pool: a sample's slowest is not the pool's."""
        # The same objects give the same rates. The same two tuples (the view's candidates,
        # loads_of()'s answer) are the common case: no per-candidate work at all.
        held = self._rates_held
        for entry in held:
            if candidates is entry.candidates and loads is entry.loads:
                return entry.rates
        key = (tuple(map(id, candidates)), tuple(map(id, loads)))
        for entry in held:
            if key == entry.key:
                return entry.rates
        rates = prefill_rates(
            candidates,
            loads,
            configured=self.prefill_tokens_per_s,
            tolerance=self.rate_tolerance,
            measured=self.measured_rate,
            gpu_prior=self.gpu_prior,
        )
        held.insert(0, _HeldRates(tuple(candidates), tuple(loads), key, rates))
        del held[2:]
        return rates

    # -- a pick and its finish -----------------------------------------------------------------------
    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None:
        pred = self.predict(request)
        now = state.now()
        load = state.load(upstream.id)
        model = self._model(upstream.id, load)
        facts = pred.facts.get(upstream.id)
        if facts is None:  # picked without a prediction (a profile used without its stages)
            cached = self._matched(request, pred.hashes, model, upstream.id, state) * self.block_tokens
            uncached = pred.tokens - min(cached, pred.tokens - 1)
            rate = self._rates((upstream,), (load,))[upstream.id]
            prefill_s = uncached * self.calibration.ratio(upstream.id) / rate
            own = self._wait(model, load, now, rate) + prefill_s
        else:
            prefill_s = facts.uncached * self.calibration.ratio(upstream.id) / facts.rate
            own = facts.own
        self.calibration.sent(upstream.id, now, pred.tokens, own)
        request.predicted_ttft_s = own
        model.busy_until = max(now, model.busy_until) + prefill_s
        model.sent.append((now, prefill_s))
        model.mean_prefill_s += (prefill_s - model.mean_prefill_s) * 0.1
        output_blocks = math.ceil(self._output_tokens(request) / self.block_tokens)
        placement = model.cache.place(pred.hashes, output_blocks)
        if self.count_demand and pred.best_matched:
            self._count_demand(pred.hashes[pred.best_matched - 1], now)
        self._serial += 1
        if self._outbox.active:
            pick = Pick(
                self._serial, upstream.id, pred.hashes, output_blocks, prefill_s, now, pred.best_matched
            )
            self._outbox.add(pick.encode())
        placed = self._placed
        placed[id(request)] = (request, upstream.id, placement, self._serial)
        if len(placed) > MAX_TRACKED:  # finishes that never came (should not happen): drop the oldest
            del placed[next(iter(placed))]

    def _decayed(self, count: float, at: float, now: float) -> float:
        """A demand count taken at `at`, as of `now` (never grown for an older `now`)."""
        return count * math.exp(-max(0.0, now - at) / self.demand_window_s)

    def demand_at(self, key: bytes, now: float) -> float:
        held = self._demand.get(key)
        return 0.0 if held is None else self._decayed(*held, now)

    def _count_demand(self, key: bytes, now: float) -> None:
        """One more request whose longest held prefix ended at `key` (own or another replica's,
        whose record may be older than the last count: then counted at the newer time)."""
        demand = self._demand
        count, at = demand.pop(key, (0.0, now))
        demand[key] = (self._decayed(count, at, now) + 1.0, max(at, now))
        if len(demand) > MAX_DEMAND_KEYS:
            demand.popitem(last=False)  # the prefix end counted least recently

    @staticmethod
    def _matched(
        request: InferenceRequest, hashes: list[bytes], model: _UpstreamModel, uid: str, state: FleetState
    ) -> int:
        """Leading blocks cached there: by the engine's own KV events when the state has a fresh set
        and the prompt was tokenized (token-id hashes are what the publisher maps engine blocks to),
        united with blocks this router's placements pin (not computed or not reported yet);
        otherwise from the cache model learnt from decisions."""
        held = state.kv_blocks(uid) if request.prompt_token_ids else None
        if held is None:
            return model.cache.matched(hashes)
        n = model.cache.matched_with(hashes, held.blocks.__contains__)
        # An incomplete set (events lost, or followed from mid-stream) misses what was stored before.
        return n if held.complete else max(n, model.cache.matched(hashes))

    @staticmethod
    def _running(u: Upstream, load: Load | None, state: FleetState) -> int:
        """Sequences at u: the engine's running + waiting and what was sent since (own count without
        snapshots)."""
        if load is not None:
            return load.num_running + load.num_waiting + state.pending(u.id)
        return state.count(u.id)

    def _output_tokens(self, request: InferenceRequest) -> int:
        if request.max_tokens is None:
            return self.expected_output_tokens
        return min(request.max_tokens, self.expected_output_tokens)

    def on_finish(self, request: InferenceRequest, upstream: Upstream) -> None:
        placed = self._placed.pop(id(request), None)
        if placed is None:
            return
        model = self._models.get(placed[1])
        if model is not None:
            model.cache.release(placed[2])
        if self._outbox.active:
            self._outbox.add(Finish(placed[3]).encode())

    # -- shared between replicas (framework.SharedPlugin; server/sync.py) ---------------------------
    def take_updates(self) -> list[Any]:
        return self._outbox.take()

    def check_peers(self, checks: PeerChecks) -> None:
        self._peers = checks

    def apply_updates(self, origin: str, updates: list[Any]) -> None:
        """Another replica's picks place blocks in the cache models and add their prefill to the
        virtual queues, as this replica's own do; its finishes release them. Records of another
        shape, about upstreams this replica does not know, or stamped with a time it does not
        believe (NaN, far off; `PeerChecks.when`) are skipped and counted (ttft_records.decode)."""
        remote = self._remote.setdefault(origin, {})
        peers = self._peers
        for raw in updates:
            record = decode(raw, peers)
            if isinstance(record, Pick):
                self._apply_pick(remote, record)
            elif isinstance(record, Finish):
                held = remote.pop(record.serial, None)
                if held is not None:
                    model = self._models.get(held[0])
                    if model is not None:
                        model.cache.release(held[1])
            elif isinstance(record, Reset):
                self.forget_origin(origin)
                remote = self._remote.setdefault(origin, {})

    def _apply_pick(self, remote: dict[int, tuple[str, Placement]], pick: Pick) -> None:
        uid, when, prefill_s, hashes = pick.upstream_id, pick.at, pick.prefill_s, pick.hashes
        model = self._model(uid, None)
        model.busy_until = max(when, model.busy_until) + prefill_s
        model.sent.append((when, prefill_s))
        model.mean_prefill_s += (prefill_s - model.mean_prefill_s) * 0.1
        placement = model.cache.place(hashes[: self.max_blocks], pick.output_blocks)
        old = remote.pop(pick.serial, None)
        if old is not None:  # a serial seen twice (a restarted peer reusing its id): release the old
            held = self._models.get(old[0])
            if held is not None:
                held.cache.release(old[1])
        remote[pick.serial] = (uid, placement)
        best = pick.best_matched  # the longest prefix any candidate held, for copy_demand
        if self.count_demand and best:
            self._count_demand(hashes[best - 1], when)
        if len(remote) > MAX_TRACKED:
            uid0, placement0 = remote.pop(next(iter(remote)))
            if (m := self._models.get(uid0)) is not None:
                m.cache.release(placement0)

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: its cache model, virtual queue and calibration go (pins other
        replicas hold there are released into nothing when they end)."""
        self._models.pop(upstream_id, None)
        self.calibration.forget(upstream_id)

    def forget_origin(self, origin: str) -> None:
        """Release every block that replica's requests pinned: the blocks stay cached (evictable)."""
        for uid, placement in (self._remote.pop(origin, None) or {}).values():
            model = self._models.get(uid)
            if model is not None:
                model.cache.release(placement)

    def dump(self) -> Any:
        return {uid: pack_hashes(m.cache.held()) for uid, m in self._models.items()}

    def load(self, data: Any) -> None:
        """Another replica's cache models, into the upstreams this one has learnt nothing about yet
        (checked as records are: known upstreams, packed hashes)."""
        for uid, hashes in loaded_hashes(data, self._peers):
            cache = self._model(uid, None).cache
            if cache.used_blocks:
                continue
            cache.release(cache.place(hashes[-cache.capacity_blocks :], 0))

    def report(self) -> Iterator[tuple[str, str, float]]:
        """The calibration per upstream (framework.Reporting): the engine's tokens per token of this
        service's count, and how much later (seconds, and relative) than predicted first tokens came."""
        for uid, f in list(self.calibration.figures()):
            yield "token_ratio", uid, f.token_ratio
            if f.samples >= 1.0:
                yield "ttft_error_s", uid, f.ttft_error_s
                yield "ttft_relative_error", uid, f.relative_error

    def index_sizes(self) -> dict[str, int]:
        return {uid: m.cache.used_blocks for uid, m in self._models.items()}


def _rescale(model: _UpstreamModel, factor: float, now: float) -> None:
    """The seconds queued at `model`, and those of its recent sends, times `factor` (the old rate
    over the new): the same prefill work at another speed."""
    if model.busy_until > now:
        model.busy_until = now + (model.busy_until - now) * factor
    model.sent = deque((t, s * factor) for t, s in model.sent)
    model.mean_prefill_s *= factor
    model.rate /= factor


def slot_wait(state: FleetState, upstream_id: str, extra: int = 0, shared: bool = False) -> float:
    """Seconds a request sent to `upstream_id` now (after `extra` more) waits for a place in its
    engines' batch: the requests beyond the batch limit, ahead of it and it, over the turnover
    (fleet/batch.py); 0 while either is unknown. Only a published limit (`max_num_seqs`) counts: a
    learnt one may be a burst of prefills, which the prefill queue (`_wait`) counts already, a
    batch a token budget holds at one size under overload, or a full KV cache that a request whose
    blocks are cached still fits (the room term counts KV). Charged for those, warm requests went to
    cold engines: the pressure grid's overload cells went from 1.5-1.8x to 8-18x of the best peer.
    With `shared`, instead the cap engines of its kind showed (none where one is published)."""
    occupancy, limit, turnover = state.batch(upstream_id, published=not shared, shared=shared)
    if limit is None or not turnover:
        return 0.0
    ahead = occupancy + extra + 1 - limit
    return ahead / turnover if ahead > 0 else 0.0


def _leading(hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many leading `hashes` are held, if every held block's predecessors are: doubling steps
    until a miss, then bisection between the last hit and that miss."""
    n = len(hashes)
    if not n or not held(hashes[0]):
        return 0
    lo, step = 1, 1  # hashes[:lo] are held
    while True:
        probe = lo + step
        if probe >= n:
            if held(hashes[n - 1]):
                return n
            hi = n - 1  # hashes[n - 1] missing: the answer is in [lo, n - 1]
            break
        if not held(hashes[probe - 1]):
            hi = probe - 1  # the answer is in [lo, probe - 1]
            break
        lo, step = probe, step * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo
