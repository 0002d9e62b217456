"""Admission: priority classes, a saturation signal per model, and a bounded fair queue.

Each request has a class from its priority (`x-llm-priority`, or the route's metadata, which can fix
or cap it): critical (> 0), standard (0, the default), sheddable (< 0). A model is *saturated* when
none of its candidates has headroom, in the engines' own units (see `Admission.room`): per unit of
capacity weight, fewer than `max_waiting_per_weight` requests waiting at the engine (its last
snapshot's count plus what was sent since), fewer than `max_inflight_per_weight` requests this
process has in flight there (the only signal without snapshots) and, when `max_predicted_wait_s` is
set, a predicted prefill queue below it (the default profile's `predicted-ttft` model: engines admit
requests into their running batch at once and prefill them in chunks, so their waiting count misses
most of a prefill backlog) and, when `max_tpot_s` is set, a time per output token below
`tpot_margin` of it (the engines' own, as the fleet view smooths it: `fleet.tpot.SmoothedTpot`; at
deep overload it is decode speed, not the prefill queue, that decides whether requests meet their
objective). Then:

- sheddable: 429 `saturated` with Retry-After, at once;
- standard: waits in the model's queue, round robin across tenants (user, else session), and is
  admitted as capacity frees (a routed request finishing, `RequestLifecycle.finish`); 429
  `queue_timeout` after `max_wait_s`, 429 `queue_full` when `max_queued` wait already;
- critical: admitted, over the threshold if need be (never queued, never shed here).

Once the queue has not been empty for `overload_after_s` (overload, not a burst), each tenant's
newest waiter goes first and waiters older than `overload_wait_s` get 429 `queue_timeout` at the
next arrival or finish: first come, first served, every admitted request would have waited
~`max_wait_s` already (adaptive LIFO; notebook/benchmarks-history.md, "Overload: newest waiters first").

Class objectives (`objectives`, docs/tuning.md): before any of that, where an upstream's batch limit
is known (fleet/batch.py), a standard request goes there only while a critical request sent after it
would still get a place in the batch within critical's objective (one place kept, more as critical
requests arrive faster than places free), and within standard's own; a sheddable request keeps one
more place for each higher class. Critical requests go where their own predicted TTFT is within
their objective of the soonest candidate. Engines serving first come, first served cannot separate
the classes once requests wait there; this keeps them from waiting there. Admission counts places
by every limit; placement keeps them only where the limit is a sequence cap (published, or shown
steady: `BatchLimits.limit(cap=True)`). A limit learnt from a full KV cache or a token budget moves
with the prompts placed there: kept by it, standard requests left their prefix holders for engines
whose caches then filled at fewer sequences, and the limits fell with each move.

A new arrival never overtakes the queue: while a model's queue is not empty, standard arrivals
queue behind it and sheddable ones are shed (sheddable ones also while another replica's queue holds
standard requests: replica sync shares the counts). The queue is event-loop safe (asyncio futures, no
thread waits) and a waiter whose client goes away (its stream is cancelled) leaves it. The same
object serves the discrete-event mode, which drives it with virtual-time callbacks instead of
futures (`enqueue`, `expire`, `started`, `abandon`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Protocol

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest, RequestError
from extproc.openai.errors import shed
from extproc.openai.parse import parse_slo_ms
from extproc.scheduling import FleetState
from extproc.scheduling.framework import PREDICTED_TTFT, prepared_figure
from extproc.scheduling.ttft_predictor import slot_wait
from extproc.settings import (
    MAX_PRIORITY_METADATA_KEY,
    OBJECTIVES_METADATA_KEY,
    PRIORITY_METADATA_KEY,
    PRIORITY_NAMES,
    TPOT_SLO_METADATA_KEY,
    TTFT_SLO_METADATA_KEY,
    AdmissionSettings,
    ClassObjectives,
    ConfigError,
    Objective,
    RouteObjectives,
    route_objectives,
)
from extproc.telemetry import Metrics

log = logging.getLogger("extproc.admission")
CRITICAL_RATE_WINDOW_S = 10.0  # critical arrivals are counted over about this long
MAX_ROUTE_OBJECTIVES = 4096  # merged (model, route objectives) kept; more: started afresh


class PriorityClass(StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


def priority_class(priority: int) -> PriorityClass:
    if priority > 0:
        return PriorityClass.CRITICAL
    if priority < 0:
        return PriorityClass.SHEDDABLE
    return PriorityClass.STANDARD


@dataclass(slots=True, frozen=True)
class RouteAdmission:
    """What a route's metadata says about admission (settings: PRIORITY_METADATA_KEY and friends).

    `fixed`: the route's class, whatever the client sends; `cap`: the highest class its clients may
    ask for (a client's lower class is kept); `ttft_slo_ms` / `tpot_slo_ms`: the objectives for
    requests whose client set none; `objectives`: class objectives over the model's
    (`admission.objectives`)."""

    fixed: int | None = None
    cap: int | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    objectives: RouteObjectives = ()

    def apply(self, request: InferenceRequest) -> None:
        if self.fixed is not None:
            request.priority = self.fixed
        elif self.cap is not None and request.priority > self.cap:
            request.priority = self.cap
        if request.ttft_slo_ms is None and self.ttft_slo_ms is not None:
            request.ttft_slo_ms = self.ttft_slo_ms
        if request.tpot_slo_ms is None and self.tpot_slo_ms is not None:
            request.tpot_slo_ms = self.tpot_slo_ms
        request.route_objectives = self.objectives


NO_ROUTE = RouteAdmission()
_ROUTE_KEYS = frozenset(
    {
        PRIORITY_METADATA_KEY,
        MAX_PRIORITY_METADATA_KEY,
        TTFT_SLO_METADATA_KEY,
        TPOT_SLO_METADATA_KEY,
        OBJECTIVES_METADATA_KEY,
    }
)
_LOWEST = PRIORITY_NAMES["sheddable"]
_capped: dict[int | None, RouteAdmission] = {None: NO_ROUTE}  # a route without metadata, per cap
_warned: set[str] = set()


def route_priority(value: str) -> int | None:
    """A metadata priority value (class name or integer), or None when it is neither."""
    text = value.strip().lower()
    if text in PRIORITY_NAMES:
        return PRIORITY_NAMES[text]
    try:
        return int(text)
    except ValueError:
        return None


def route_admission(
    metadata: Iterable[tuple[str, str | bytes]], client_cap: int | None = None
) -> RouteAdmission:
    """The route's admission settings from its gRPC initial metadata (ExtProcPerRoute
    grpc_initial_metadata in envoy.yaml), with `client_cap` (`admission.client_max_priority`) as
    the cap of a route that sets none. Malformed values are logged once (`check-config
    --envoy-config` finds them before traffic does) and fail closed: a bad cap caps clients at
    sheddable, a bad fixed class or objective is left out."""
    found: dict[str, str] = {}
    for key, value in metadata:
        if key in _ROUTE_KEYS:
            found[key] = value if isinstance(value, str) else value.decode("utf-8", "replace")
    if not found:
        route = _capped.get(client_cap)
        if route is None:
            route = _capped[client_cap] = RouteAdmission(cap=client_cap)
        return route
    fixed = None
    cap = client_cap
    if PRIORITY_METADATA_KEY in found:
        fixed = route_priority(found[PRIORITY_METADATA_KEY])
        if fixed is None:
            _warn(PRIORITY_METADATA_KEY, found[PRIORITY_METADATA_KEY], "left out")
    if MAX_PRIORITY_METADATA_KEY in found:
        cap = route_priority(found[MAX_PRIORITY_METADATA_KEY])
        if cap is None:
            cap = _LOWEST
            _warn(MAX_PRIORITY_METADATA_KEY, found[MAX_PRIORITY_METADATA_KEY], "clients capped at sheddable")
    objectives: RouteObjectives = ()
    if OBJECTIVES_METADATA_KEY in found:
        try:
            objectives = route_objectives(found[OBJECTIVES_METADATA_KEY], OBJECTIVES_METADATA_KEY)
        except ConfigError:
            _warn(OBJECTIVES_METADATA_KEY, found[OBJECTIVES_METADATA_KEY], "left out")
    return RouteAdmission(
        fixed=fixed,
        cap=cap,
        ttft_slo_ms=_route_slo(found, TTFT_SLO_METADATA_KEY),
        tpot_slo_ms=_route_slo(found, TPOT_SLO_METADATA_KEY),
        objectives=objectives,
    )


def route_metadata_errors(key: str, value: str) -> str | None:
    """Why a route's metadata value is not valid (None when it is or the key is not ours): what
    `check-config --envoy-config` reports for each ext_proc metadata entry of an envoy.yaml."""
    if key in (PRIORITY_METADATA_KEY, MAX_PRIORITY_METADATA_KEY):
        if route_priority(value) is None:
            return f"{key}={value!r}: must be one of {', '.join(PRIORITY_NAMES)} or an integer"
    elif key in (TTFT_SLO_METADATA_KEY, TPOT_SLO_METADATA_KEY):
        try:
            parse_slo_ms(value, key)
        except RequestError:
            return f"{key}={value!r}: must be a number of milliseconds above 0"
    elif key == OBJECTIVES_METADATA_KEY:
        try:
            route_objectives(value, key)
        except ConfigError as exc:
            return str(exc)
    return None


def _route_slo(found: dict[str, str], key: str) -> float | None:
    if key not in found:
        return None
    try:
        return parse_slo_ms(found[key], key)
    except RequestError:
        _warn(key, found[key], "left out")
        return None


def _warn(key: str, value: str, consequence: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.error(
            "route metadata %s=%r is not valid (%s); check envoy.yaml with "
            "`llm-extproc check-config --envoy-config`",
            key,
            value[:64],
            consequence,
        )


class Verdict(Enum):
    ADMIT = "admit"
    QUEUE = "queue"


class WaiterState(Enum):
    QUEUED = "queued"
    GRANTED = "granted"
    DONE = "done"


class PrefillBacklog(Protocol):
    """What admission reads of the prefill queued per upstream: the default profile
    (`Profile.backlog`, from its PrefillQueue plugin, predicted-ttft)."""

    def backlog(self, upstream: Upstream, state: FleetState) -> tuple[float, float] | None:
        """(seconds of prefill queued there, mean prefill seconds per request), None unknown."""
        ...


Notify = Callable[[RequestError | None], None]
"""Told once: None when the waiter is granted capacity, else the error that ends it (timeout)."""


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request."""

    model: str
    tenant: str
    klass: PriorityClass
    since: float
    notify: Notify
    state: WaiterState = WaiterState.QUEUED


@dataclass(slots=True)
class FairQueue:
    """Waiters of one model: FIFO per tenant, round robin across tenants (a tenant with many queued
    requests gets one turn per round, like everyone else). Removal of any waiter is supported."""

    tenants: dict[str, deque[Waiter]] = field(default_factory=dict)
    size: int = 0
    busy_since: float = 0.0  # when it last went from empty to not empty
    swept_at: float = 0.0  # when waiters past the overload wait were last shed

    def __len__(self) -> int:
        return self.size

    def push(self, waiter: Waiter) -> None:
        q = self.tenants.get(waiter.tenant)
        if q is None:
            q = self.tenants[waiter.tenant] = deque()
        q.append(waiter)
        self.size += 1

    def pop(self, newest: bool = False) -> Waiter | None:
        """The next tenant's oldest waiter (its newest with `newest`); that tenant moves to the back
        of the round."""
        if not self.tenants:
            return None
        tenant = next(iter(self.tenants))
        q = self.tenants.pop(tenant)
        waiter = q.pop() if newest else q.popleft()
        if q:
            self.tenants[tenant] = q  # re-inserted: last in the round
        self.size -= 1
        return waiter

    def older_than(self, since: float) -> list[Waiter]:
        """Remove and return the waiters queued before `since` (each tenant's are in arrival order)."""
        out: list[Waiter] = []
        for tenant in [t for t, q in self.tenants.items() if q[0].since < since]:
            q = self.tenants[tenant]
            while q and q[0].since < since:
                out.append(q.popleft())
            if not q:
                del self.tenants[tenant]
        self.size -= len(out)
        return out

    def remove(self, waiter: Waiter) -> bool:
        q = self.tenants.get(waiter.tenant)
        if q is None:
            return False
        try:
            q.remove(waiter)
        except ValueError:
            return False
        if not q:
            del self.tenants[waiter.tenant]
        self.size -= 1
        return True


class Admission:
    """Admission control for one service process (see the module docstring).

    `candidates(model)` gives who may serve a model (the lifecycle's own lookup); `state` is the
    scheduling state plugins read; `prefill` the prefill queued per upstream (the default profile),
    and a request's own predicted TTFT per candidate is read from the decision's prepared figures
    (`request.prepared`). Metrics are optional (the unit tests run without)."""

    __slots__ = (
        "_candidates",
        "_critical",
        "_granted",
        "_queued",
        "_queues",
        "_route_objectives",
        "clock",
        "metrics",
        "on_queue_change",
        "peer_critical_rate",
        "peer_waiting",
        "prefill",
        "settings",
        "state",
    )

    def __init__(
        self,
        settings: AdmissionSettings,
        candidates: Callable[[str], Sequence[Upstream]],
        state: FleetState,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill: PrefillBacklog | None = None,
    ) -> None:
        self.settings = settings
        self.prefill = prefill
        self._candidates = candidates
        self.state = state
        self.metrics = metrics
        self.clock = clock
        self._queues: dict[str, FairQueue] = {}
        self._granted: dict[str, int] = {}  # woken waiters not yet scheduled, per model
        self._queued = 0
        self._critical: dict[str, tuple[float, float, float]] = {}  # model -> (rate, when, since)
        # The other replicas' critical requests per second by model (RemoteInFlight.critical_rate),
        # set where replica sync runs.
        self.peer_critical_rate: Callable[[str], float] | None = None
        # The standard requests the other replicas hold waiting, by model (RemoteInFlight.waiting),
        # and who to tell when this one's queue changes (replica sync), both set where sync runs.
        self.peer_waiting: Callable[[str], int] | None = None
        self.on_queue_change: Callable[[], None] | None = None
        # (model, a route's objectives) -> the objectives merged: routes x models, few
        self._route_objectives: dict[tuple[str | None, RouteObjectives], ClassObjectives] = {}

    # -- the signal ------------------------------------------------------------------------------
    def room(
        self, model: str, klass: PriorityClass = PriorityClass.STANDARD, route: RouteObjectives = ()
    ) -> float:
        """Headroom of the model's candidates for a request of `klass` (of a route with `route`'s
        objectives), in requests, less what was granted and not yet scheduled: > 0 admits; <= 0 is
        saturation (for that class)."""
        try:
            candidates = self._candidates(model)
        except RequestError:
            return 0.0
        total = 0.0
        share = self.critical_rate(model) / max(1, len(candidates))
        for u in candidates:
            free = self.headroom(u, klass=klass, critical_share=share, model=model, route=route)
            if free > 0:
                total += free
        return total - self._granted.get(model, 0)

    def class_room(
        self,
        u: Upstream,
        klass: PriorityClass,
        critical_share: float = 0.0,
        model: str | None = None,
        route: RouteObjectives = (),
        caps_only: bool = False,
    ) -> float:
        """Requests of `klass` that `u` can take while a request of each higher class sent after
        them would still meet its objective there (the module docstring's "Class objectives"):
        unbounded for critical requests and while `u`'s batch limit is unknown (with `caps_only`,
        while it is not a sequence cap: fleet/batch.py). `critical_share`: critical requests per
        second expected to arrive at `u`; the objectives are the model's, with `route`'s (a route's
        `x-llm-objectives`) in their place."""
        if klass is PriorityClass.CRITICAL:
            return math.inf
        occupancy, limit, turnover = self.state.batch(u.id, cap=caps_only)
        if limit is None:
            return math.inf
        unloaded = self._backlog(u)[1]
        objectives = self.objectives(model, route)
        free = math.inf
        # Places kept for critical requests: one, and one more per half a critical request expected
        # to arrive there per request that finishes there.
        kept = 1
        if turnover:
            kept += round(2.0 * critical_share / turnover)
        # (objective, places kept for later requests of that class or higher)
        bounds: tuple[tuple[Objective, int], ...]
        if klass is PriorityClass.STANDARD:
            bounds = ((objectives.critical, kept), (objectives.standard, 0))
        else:
            bounds = ((objectives.critical, kept + 1), (objectives.standard, 1), (objectives.sheddable, 0))
        for objective, reserved in bounds:
            budget = objective.budget(unloaded)
            if budget is None:
                continue
            places = math.floor(budget * turnover) if turnover else 0  # beyond the batch, within it
            free = min(free, math.floor(limit) + places - reserved - occupancy)
        return free

    def headroom(
        self,
        u: Upstream,
        predicted: bool = True,
        klass: PriorityClass | None = None,
        critical_share: float = 0.0,
        model: str | None = None,
        route: RouteObjectives = (),
        caps_only: bool = False,
    ) -> float:
        """Requests `u` can still take before it counts as saturated (<= 0: none); without the
        predicted prefill queue when `predicted` is false (the engines' own counts and caps only);
        for a request of `klass`, within what class_room() leaves it (`caps_only`: as there)."""
        s = self.settings
        state = self.state
        w = u.weight
        free = s.max_inflight_per_weight * w - state.count(u.id)
        if klass is not None:
            free = min(free, self.class_room(u, klass, critical_share, model, route, caps_only))
        load = state.load(u.id)
        if load is not None:
            waiting = load.num_waiting + state.pending(u.id)
            free = min(free, s.max_waiting_per_weight * w - waiting)
            if s.max_kv_usage is not None and load.kv_cache_usage >= s.max_kv_usage:
                return 0.0
        if predicted and self.decoding_slowly(u):
            return 0.0
        if predicted and s.max_predicted_wait_s is not None and self.prefill is not None:
            wait, per_request = self._backlog(u)
            left = s.max_predicted_wait_s - wait
            if left <= 0:
                return 0.0
            if per_request > 0:
                free = min(free, left / per_request)
        return free

    def decoding_slowly(self, u: Upstream) -> bool:
        """The TPOT gate: `u`'s engines decode at or above `tpot_margin` x `max_tpot_s` (smoothed)."""
        s = self.settings
        if s.max_tpot_s is None or self.state.load(u.id) is None:
            return False
        tpot = self.state.smoothed_tpot(u.id, s.tpot_window_s)
        return tpot is not None and tpot >= s.tpot_margin * s.max_tpot_s

    def placeable(self, request: InferenceRequest, candidates: tuple[Upstream, ...]) -> tuple[Upstream, ...]:
        """Where an admitted request may go: standard and sheddable requests only to candidates with
        headroom (admission counted the model's total headroom, so scheduling must not then pile onto
        a saturated favourite); critical ones anywhere; all of them when none has headroom.

        The predicted prefill queue counts here only while the model is saturated (requests wait in its
        queue), and even then it does not take a candidate away from a request that would wait there no
        longer than where there is headroom (its own predicted TTFT, the prepared `predicted-ttft` figure:
        the queue plus its uncached prefill). A move off its prefix holder turns a warm request into a
        cold prefill, which is more work for the fleet just when it has none to spare: with the holder
        taken away regardless, each admitted request would become a cold prefill that fills another engine
        (notebook/benchmarks-history.md, "Priorities across fleets and workloads", which also says where
        the rule costs). Below saturation the scheduler weighs every move itself: a cold prefill sent
        elsewhere slows everything there, critical requests first (notebook/benchmarks-history.md,
        "Priorities and SLOs"). The engines' own counts and caps always restrict, and so does the TPOT
        gate while saturated (one more sequence there slows every running one, however warm it is).
        The places kept for higher classes restrict only by sequence caps (the module docstring)."""
        klass = priority_class(request.priority)
        if not self.settings.enabled:
            return candidates
        if klass is PriorityClass.CRITICAL:
            return self._soonest(request, candidates)
        share = self.critical_rate(request.model) / max(1, len(candidates))
        model, route = request.model, request.route_objectives
        open_ = tuple(u for u in candidates if self.headroom(u, False, klass, share, model, route, True) > 0)
        open_ = open_ or candidates
        if request.model is None or self.queue_length(request.model) == 0:  # not saturated
            return open_
        with_room = [self.headroom(u, True, klass, share, model, route, True) > 0 for u in open_]
        if not any(with_room):
            return open_
        ttft = prepared_figure(request, PREDICTED_TTFT, open_)
        if all(with_room) or ttft is None:
            return tuple(u for u, ok in zip(open_, with_room, strict=True) if ok)
        best = min(t for t, ok in zip(ttft, with_room, strict=True) if ok)
        return tuple(
            u
            for u, t, ok in zip(open_, ttft, with_room, strict=True)
            if ok or (t <= best and not self.decoding_slowly(u))
        )

    def _soonest(self, request: InferenceRequest, candidates: tuple[Upstream, ...]) -> tuple[Upstream, ...]:
        """A critical request's candidates: those where its own predicted TTFT is within its
        objective, or else the soonest (the scorer's placement costs, which spare other requests'
        caches, do not outweigh a critical request's wait)."""
        ttft = prepared_figure(request, PREDICTED_TTFT, candidates) if len(candidates) > 1 else None
        if ttft is None:
            return candidates
        ttft = [t + self._cap_wait(u) for u, t in zip(candidates, ttft, strict=True)]
        best = min(ttft)
        unloaded = min(self._backlog(u)[1] for u in candidates)
        budget = self.objectives(request.model, request.route_objectives).critical.budget(unloaded)
        bound = best + (budget or 0.0) + unloaded
        return tuple(u for u, t in zip(candidates, ttft, strict=True) if t <= bound)

    def _cap_wait(self, u: Upstream) -> float:
        """Seconds a request sent to `u` now waits for a place in a batch at the sequence cap its
        kind of engine showed (fleet/batch.py; the prediction counts published caps only:
        ttft_predictor.slot_wait). Not one engine's own queues: on engines bound by their KV cache
        or token budget those move with the prompts, and charged for them critical requests left
        their prefix holders as cold prefills (notebook/benchmarks-history.md, "Caps shared by
        engines alike")."""
        return slot_wait(self.state, u.id, shared=True)  # no shared cap where one is published

    def _backlog(self, u: Upstream) -> tuple[float, float]:
        """(prefill seconds queued at `u`, mean prefill seconds per request); zeros unknown."""
        found = None if self.prefill is None else self.prefill.backlog(u, self.state)
        return (0.0, 0.0) if found is None else found

    def objectives(self, model: str | None, route: RouteObjectives = ()) -> ClassObjectives:
        """The class objectives of a request for `model` on a route with `route`'s: the model's
        (`admission.objectives.models`, else the top level), with the route's in their place."""
        base = self.settings.objectives.for_model(model)
        if not route:
            return base
        key = (model, route)
        found = self._route_objectives.get(key)
        if found is None:
            if len(self._route_objectives) >= MAX_ROUTE_OBJECTIVES:
                self._route_objectives.clear()
            found = self._route_objectives[key] = base.over(route)
        return found

    def critical_rate(self, model: str | None) -> float:
        """Critical requests per second for `model` across the replicas: this one's
        (`own_critical_rate`) and those the others last reported (replica sync). Each replica sees
        only its share of the arrivals; counted alone, N replicas kept the places of 1/N of the
        critical traffic (notebook/benchmarks-history.md, "Critical arrivals across replicas")."""
        own = self.own_critical_rate(model)
        peers = self.peer_critical_rate
        return own if peers is None else own + peers(model or "")

    def own_waiting(self) -> dict[str, int]:
        """Standard requests waiting in this replica's queues by model (what replica sync publishes:
        a sheddable request at another replica is shed while they wait)."""
        return {model: len(q) for model, q in self._queues.items() if q}

    def own_critical_rates(self) -> dict[str, float]:
        """This replica's critical requests per second by model (what replica sync publishes)."""
        return {model: rate for model in self._critical if (rate := self.own_critical_rate(model)) > 0.0}

    def own_critical_rate(self, model: str | None) -> float:
        """Critical requests per second for `model` at this replica, decayed over
        CRITICAL_RATE_WINDOW_S."""
        held = self._critical.get(model or "")
        if held is None:
            return 0.0
        rate, at, since = held
        now = self.clock()
        # Counted for less than the window, the decayed count is short of the rate by the share
        # of the window not yet seen (a cold start would otherwise keep too few places).
        seen = 1.0 - math.exp(-max(1.0, now - since) / CRITICAL_RATE_WINDOW_S)
        return rate * math.exp(-max(0.0, now - at) / CRITICAL_RATE_WINDOW_S) / seen

    def _count_critical(self, model: str) -> None:
        now = self.clock()
        rate, at, since = self._critical.get(model, (0.0, now, now))
        decay = math.exp(-max(0.0, now - at) / CRITICAL_RATE_WINDOW_S)
        self._critical[model] = (rate * decay + 1.0 / CRITICAL_RATE_WINDOW_S, now, since)

    @property
    def queued(self) -> int:
        return self._queued

    def queue_length(self, model: str) -> int:
        q = self._queues.get(model)
        return len(q) if q is not None else 0

    # -- decide ----------------------------------------------------------------------------------
    def decide(self, request: InferenceRequest) -> Verdict:
        """ADMIT or QUEUE; raises the 429 of a request shed now. Only model requests are subject
        to admission (others are answered or routed as before)."""
        model = request.model
        klass = priority_class(request.priority)
        if not self.settings.enabled or model is None:
            return Verdict.ADMIT
        if not self._candidates(model):  # 404 (raised here) or 503 (scheduling's): not saturation
            return Verdict.ADMIT
        if klass is PriorityClass.CRITICAL:
            self._count_critical(model)
        ahead = self.queue_length(model)
        if klass is PriorityClass.SHEDDABLE and (
            ahead or (self.peer_waiting is not None and self.peer_waiting(model))
        ):
            # Standard requests are waiting, here or at another replica: room that frees is theirs
            # (even where a sweep of the queue is about to shed its oldest ones for waiting too long).
            raise self._shed(klass, "saturated", "All upstreams for this model are saturated.")
        if ahead:
            self.dispatch(model)  # a snapshot may have freed room since the last finish
            ahead = self.queue_length(model)
        free = not ahead and self.room(model, klass, request.route_objectives) > 0
        if free:
            self._count(klass, "admitted", "free")
            return Verdict.ADMIT
        if klass is PriorityClass.CRITICAL:
            self._count(klass, "admitted", "critical")
            return Verdict.ADMIT
        if klass is PriorityClass.SHEDDABLE:
            raise self._shed(klass, "saturated", "All upstreams for this model are saturated.")
        return Verdict.QUEUE

    def admit_now(self, request: InferenceRequest) -> None:
        """For callers that cannot wait (RequestLifecycle.route): a request that would queue is shed."""
        if self.decide(request) is Verdict.QUEUE:
            klass = priority_class(request.priority)
            raise self._shed(klass, "saturated", "All upstreams for this model are saturated.")

    def enqueue(self, request: InferenceRequest, notify: Notify) -> Waiter:
        """Queue a request `decide` answered QUEUE for; raises 429 `queue_full` at the bound."""
        klass = priority_class(request.priority)
        if self._queued >= self.settings.max_queued:
            raise self._shed(klass, "queue_full", "The admission queue is full.")
        model = request.model or ""
        tenant = request.user or request.session or ""
        waiter = Waiter(model, tenant, klass, self.clock(), notify)
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = FairQueue(busy_since=waiter.since)
        elif not q and not self._recently_swept(q):
            q.busy_since = waiter.since  # left empty by a sweep long ago: a new busy period
        q.push(waiter)
        self._queued += 1
        self._count(klass, "queued", "saturated")
        self._gauge()
        self._sweep(model, q)
        return waiter

    def overloaded(self, model: str) -> bool:
        """The model's queue has not been empty for `overload_after_s`: arrivals outpace capacity,
        not a burst. Its waiters are then served newest first and shed past `overload_wait_s`."""
        s = self.settings
        q = self._queues.get(model)
        if s.overload_wait_s is None or q is None:
            return False
        return self.clock() - q.busy_since >= s.overload_after_s

    def _recently_swept(self, q: FairQueue) -> bool:
        """A sweep emptied `q` less than `overload_after_s` ago: the overload it found goes on."""
        s = self.settings
        return s.overload_wait_s is not None and self.clock() - q.swept_at < s.overload_after_s

    def _sweep(self, model: str, q: FairQueue) -> None:
        """While overloaded: 429 `queue_timeout` for the waiters queued longer than `overload_wait_s`
        (at most every quarter of it). Served newest first, they would only ever time out."""
        wait = self.settings.overload_wait_s
        if wait is None or not self.overloaded(model):
            return
        now = self.clock()
        if now - q.swept_at < wait / 4:
            return
        q.swept_at = now
        late = q.older_than(now - wait)
        if not late:
            return
        self._queued -= len(late)  # an emptied queue stays: the fleet is still overloaded
        self._gauge()
        for waiter in late:
            waiter.state = WaiterState.DONE
            self._time_out(
                waiter,
                f"The fleet is overloaded: this request waited {wait:g} s without capacity freeing for it.",
            )

    def dispatch(self, model: str | None) -> int:
        """Grant capacity to queued waiters of `model` while it has room (a lease was released, or
        a snapshot may have changed the signal); returns how many were woken."""
        if model is None:
            return 0
        q = self._queues.get(model)
        if q is None:
            return 0
        self._sweep(model, q)
        newest = self.overloaded(model)
        woken = 0
        while q and self.room(model, PriorityClass.STANDARD) > 0:
            waiter = q.pop(newest)
            if waiter is None:
                break
            self._queued -= 1
            waiter.state = WaiterState.GRANTED
            self._granted[model] = self._granted.get(model, 0) + 1
            woken += 1
            waiter.notify(None)
        if not q and (woken or not self._recently_swept(q)):
            del self._queues[model]  # served to the end: the busy period is over
        if woken:
            self._gauge()
        return woken

    def dispatch_all(self) -> int:
        return sum(self.dispatch(model) for model in list(self._queues))

    def started(self, waiter: Waiter) -> None:
        """A granted waiter goes on to schedule (call right before it; no await in between)."""
        if waiter.state is WaiterState.GRANTED:
            self._ungrant(waiter.model)
            waiter.state = WaiterState.DONE
            self._count(waiter.klass, "admitted", "dequeued")
            self._wait(waiter, "admitted")

    def expire(self, waiter: Waiter) -> bool:
        """`max_wait_s` has passed: a still-queued waiter leaves with 429 `queue_timeout`."""
        if waiter.state is not WaiterState.QUEUED or not self._remove(waiter):
            return False
        self._time_out(
            waiter,
            f"The fleet stayed saturated for {self.settings.max_wait_s:g} s while this request waited.",
        )
        return True

    def _time_out(self, waiter: Waiter, message: str) -> None:
        """A waiter taken off the queue unserved: 429 `queue_timeout`, counted and told."""
        err = self._shed(waiter.klass, "queue_timeout", message)
        self._wait(waiter, "timeout")
        waiter.notify(err)

    def abandon(self, waiter: Waiter) -> None:
        """The client went away: leave the queue, or hand a grant not yet used to the next waiter."""
        if waiter.state is WaiterState.QUEUED:
            if self._remove(waiter):
                self._count(waiter.klass, "abandoned", "client_gone")
                self._wait(waiter, "abandoned")
        elif waiter.state is WaiterState.GRANTED:
            waiter.state = WaiterState.DONE
            self._ungrant(waiter.model)
            self._count(waiter.klass, "abandoned", "client_gone")
            self.dispatch(waiter.model)
        waiter.state = WaiterState.DONE

    # -- the event-loop path ---------------------------------------------------------------------
    async def admit(self, request: InferenceRequest) -> None:
        """Return when the request may be scheduled; raise its 429 when it is shed. Waiting holds no
        thread: a future resolved by `dispatch` (or failed by the timer)."""
        if self.decide(request) is Verdict.ADMIT:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def notify(err: RequestError | None) -> None:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)

        waiter = self.enqueue(request, notify)
        timer = loop.call_later(self.settings.max_wait_s, self.expire, waiter)
        try:
            await fut
        except asyncio.CancelledError:
            self.abandon(waiter)
            raise
        finally:
            timer.cancel()
        self.started(waiter)

    # -- helpers ---------------------------------------------------------------------------------
    def _remove(self, waiter: Waiter) -> bool:
        q = self._queues.get(waiter.model)
        if q is None or not q.remove(waiter):
            return False
        if not q:
            del self._queues[waiter.model]
        self._queued -= 1
        waiter.state = WaiterState.DONE
        self._gauge()
        return True

    def _ungrant(self, model: str) -> None:
        left = self._granted.get(model, 0) - 1
        if left > 0:
            self._granted[model] = left
        else:
            self._granted.pop(model, None)

    def _shed(self, klass: PriorityClass, reason: str, message: str) -> RequestError:
        self._count(klass, "shed", reason)
        return shed(reason, message, self.settings.retry_after_s)

    def _count(self, klass: PriorityClass, decision: str, reason: str) -> None:
        m = self.metrics
        if m is not None:
            m.admission_by(klass.value, decision, reason).inc()

    def _gauge(self) -> None:
        """The queue changed: its gauge, and news for replica sync (`own_waiting`)."""
        m = self.metrics
        if m is not None:
            m.admission_queue.set(self._queued)
        if self.on_queue_change is not None:
            self.on_queue_change()

    def _wait(self, waiter: Waiter, outcome: str) -> None:
        m = self.metrics
        if m is not None:
            m.admission_wait.labels(outcome=outcome).observe(max(0.0, self.clock() - waiter.since))
