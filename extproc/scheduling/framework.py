"""The scheduling seam: filters narrow the candidates, weighted scorers rate them, a picker chooses.

Every plugin is small, single-purpose and registered once under a kebab-case name, so profiles are
data (YAML), not code. Scores are in [0, 1] (checked: one per candidate, clamped); a profile's total
score is the weighted sum. Plugins that learn from decisions implement `on_pick` / `on_finish`; the
profile collects them when it is built, so the request path never probes for them.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from extproc.fleet import Load, Upstream
from extproc.fleet.view import KvHeld
from extproc.openai import InferenceRequest
from extproc.scheduling.explain import Explanation
from extproc.settings import ConfigError, number


class FleetState(Protocol):
    """What plugins may read about upstreams (implemented by extproc.fleet.SchedulingState)."""

    def count(self, upstream_id: str) -> int:
        """Requests this process routed there and has not seen finish."""
        ...

    def load(self, upstream_id: str) -> Load | None:
        """The engines' last published load, or None without a fresh snapshot."""
        ...

    def loads_of(self, upstreams: Sequence[Upstream]) -> Sequence[Load | None]:
        """load() of each, in one call: what a plugin reading a whole large pool uses."""
        ...

    def pending(self, upstream_id: str) -> int:
        """Requests sent there that the last snapshot does not include yet."""
        ...

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        """(requests there now: the engines' running and waiting plus what was sent since, or this
        process's in-flight count where larger; the batch it runs before queueing; requests per
        second that get their first token there). The last two are None while unknown
        (fleet/batch.py): the engines never queued, or publish no first-token counter. With
        `published`, the limit only where it is the publisher's `max_num_seqs` (BatchLimits.limit):
        what a request waits for whatever its prompt; with `cap`, also where the engines showed a
        steady sequence cap; with `shared`, only the sequence cap engines of its kind showed."""
        ...

    def kv_blocks(self, upstream_id: str) -> KvHeld | None:
        """The prefix-index block hashes the engine holds by its own KV events (exact when
        `complete`, a lower bound otherwise), or None when there is no fresh set (no events, out of
        sync, the engine's socket gone): plugins fall back to their own model."""
        ...

    def kv_holders(self, block: bytes) -> Sequence[str]:
        """Upstream ids whose engines' KV events show `block` held, in one pass (a large pool's
        pre-selection): a superset of where kv_blocks() shows it; empty without KV events."""
        ...

    def smoothed_tpot(self, upstream_id: str, window_s: float) -> float | None:
        """The engines' time per output token there, smoothed over `window_s` of snapshot time once
        per snapshot (the same figure for every reader), or None while nothing is known (no report,
        idle, no fresh snapshot)."""
        ...

    def smoothed_running(self, upstream_id: str, window_s: float) -> float | None:
        """The engines' running requests there, smoothed with smoothed_tpot() (the batch that figure
        was measured on), or None where smoothed_tpot() is None."""
        ...

    def now(self) -> float:
        """The fleet's clock (unix seconds; virtual time in the discrete-event mode), the one snapshots'
        `published_at` is measured on."""
        ...


class Filter(Protocol):
    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]: ...


class Scorer(Protocol):
    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]: ...


class Picker(Protocol):
    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream: ...


@runtime_checkable
class PickHook(Protocol):
    """A plugin that learns from each decision (e.g. which upstream now caches a prompt's prefix)."""

    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None: ...


@runtime_checkable
class FinishHook(Protocol):
    """A plugin that learns when a routed request ends (response done, or the stream closed)."""

    def on_finish(self, request: InferenceRequest, upstream: Upstream) -> None: ...


@runtime_checkable
class Reporting(Protocol):
    """A plugin with figures of its own for /metrics and the explain header (the calibration of
    `predicted-ttft`, the drops of `bounded-load`). `report()` runs on the metrics server's thread at
    scrape time: it copies what it reads in one step (the event loop changes it meanwhile)."""

    def report(self) -> Iterator[tuple[str, str, float]]:
        """(figure name, upstream id, value) rows; telemetry/metrics.py says what each name means."""
        ...


PREDICTED_TTFT = "predicted-ttft"
"""The prepared figure of a request's own predicted time to first token on each candidate, seconds:
the queue ahead, its uncached prefill, the decode load and the waits for a batch place and for KV
room, without the placement costs a scorer adds for other requests (what `slo-ttft` and admission's
placement compare). A candidate without a figure (a large pool's unsampled one) counts as never."""


def prepared_figure(
    request: InferenceRequest, name: str, candidates: Sequence[Upstream]
) -> list[float] | None:
    """The decision's prepared figure `name` for each candidate (infinite for one the producer left
    out: a large pool's unsampled candidate), or None when nothing produced it."""
    figures = (request.prepared or {}).get(name)
    if figures is None:
        return None
    return [figures.get(u.id, math.inf) for u in candidates]


@runtime_checkable
class Producer(Protocol):
    """A plugin that prepares figures for a request once per decision (the prepare stage, before
    admission's placement and the profile's filters): for each name in `produces`, a value per
    candidate in `request.prepared[name]`, by upstream id. Its readers (plugins that list the name
    in `consumes`, admission) read them there by name and never call it, so any plugin producing
    the name can take its place; a profile with a consumer but no producer is refused at load."""

    produces: ClassVar[tuple[str, ...]]

    def prepare(self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState) -> None:
        """Write this request's figures for `candidates` (a large pool's sample of them may do)."""
        ...


@runtime_checkable
class Consumer(Protocol):
    """A plugin that reads prepared figures (`request.prepared[name]`) for each name in `consumes`."""

    consumes: ClassVar[tuple[str, ...]]


@runtime_checkable
class PrefillQueue(Protocol):
    """A plugin that models the prefill queued at each upstream (`predicted-ttft`): a figure of the
    upstream, not of one request, which admission's saturation signal reads between decisions too
    (a finished request wakes a waiter) through `Profile.backlog`."""

    def backlog(self, upstream: Upstream, state: FleetState) -> tuple[float, float]:
        """(seconds of prefill queued at `upstream`, mean prefill seconds of a request sent there)."""
        ...


@runtime_checkable
class PromptHashing(Protocol):
    """A plugin that hashes the prompt's token ids in blocks (`predicted-ttft`). For a long prompt
    the lifecycle hashes them off the event loop before scheduling (`InferenceRequest.block_hashes`),
    and the plugin uses those when the block size is its own."""

    def prompt_hash_spec(self) -> tuple[int, int]:
        """(tokens per block, the most blocks hashed)."""
        ...


@runtime_checkable
class SharedPlugin(Protocol):
    """A plugin whose learned state replicas share (server/sync.py carries it through Redis), so N
    replicas behind one Envoy route as one: each publishes its own decisions, applies the others'.

    Updates are small msgpack-able records (lists of str / int / float / bytes); a plugin records
    them only once `take_updates` has been called (a consumer exists), and bounds what it holds."""

    def take_updates(self) -> list[Any]:
        """This process's own picks / finishes since the last call (and starts recording them)."""
        ...

    def apply_updates(self, origin: str, updates: list[Any]) -> None:
        """Apply another replica's records, in the order it took them."""
        ...

    def forget_origin(self, origin: str) -> None:
        """That replica vanished, or some of its records were lost: release what it placed (holds
        that would otherwise never end), keep what was learnt about the upstreams' caches."""
        ...

    def dump(self) -> Any:
        """A compact, msgpack-able copy of what was learnt, for a replica that starts late."""
        ...

    def load(self, data: Any) -> None:
        """Merge another replica's dump (a late start or a reconnect)."""
        ...

    def index_sizes(self) -> dict[str, int]:
        """Entries held per upstream id (sampled into a gauge)."""
        ...


@runtime_checkable
class UpstreamMemory(Protocol):
    """A plugin that keeps state per upstream id (a cache model, learnt latencies, counters): told
    when an upstream has left for good (discovery took the endpoint out of the pool, or its snapshots
    stopped long ago, fleet/view.py), so a pool whose endpoints come and go does not grow that state
    without bound. An id that comes back later starts afresh."""

    def forget_upstream(self, upstream_id: str) -> None: ...


# Told (plugin kind, plugin name, seconds) after each plugin call: the per-plugin time histogram.
PluginTimer = Callable[[str, str, float], None]

P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[P]):
    """Plugin factories of one kind by kebab-case name; parameters come from the profile YAML."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.factories: dict[str, Callable[..., P]] = {}
        self.names_by_type: dict[type, str] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator; the factory (usually the plugin's class) is returned unchanged."""

        def wrap(factory: F) -> F:
            if name in self.factories:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self.factories[name] = factory
            if isinstance(factory, type):
                self.names_by_type[factory] = name
            return factory

        return wrap

    def build(self, name: str, params: dict[str, Any] | None = None) -> P:
        try:
            factory = self.factories[name]
        except KeyError:
            known = ", ".join(sorted(self.factories)) or "none"
            raise ConfigError(f"unknown {self.kind} '{name}' (known: {known})") from None
        try:
            return factory(**(params or {}))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.kind} '{name}': bad parameters: {exc}") from None

    def names(self) -> list[str]:
        return sorted(self.factories)


FILTERS: Registry[Filter] = Registry("filter")
SCORERS: Registry[Scorer] = Registry("scorer")
PICKERS: Registry[Picker] = Registry("picker")
_REGISTRIES: dict[str, Registry[Any]] = {"filter": FILTERS, "scorer": SCORERS, "picker": PICKERS}


def register(kind: str, name: str) -> Callable[[F], F]:
    """Register a plugin factory of `kind` (filter, scorer, picker) under `name`."""
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown plugin kind '{kind}'")
    return _REGISTRIES[kind].register(name)


def registered(kind: str) -> list[str]:
    return _REGISTRIES[kind].names()


def build_filter(name: str, params: dict[str, Any] | None = None) -> Filter:
    return FILTERS.build(name, params)


def build_scorer(name: str, params: dict[str, Any] | None = None) -> Scorer:
    return SCORERS.build(name, params)


def build_picker(name: str, params: dict[str, Any] | None = None) -> Picker:
    return PICKERS.build(name, params)


def producers_of(figure: str) -> list[str]:
    """The registered plugins that produce a prepared figure, as "kind 'name'"."""
    return [
        f"{kind} '{name}'"
        for kind, registry in _REGISTRIES.items()
        for name, factory in sorted(registry.factories.items())
        if figure in getattr(factory, "produces", ())
    ]


def plugin_name(plugin: object) -> str:
    """The name a plugin was registered under (its class name when built outside the registry)."""
    for registry in _REGISTRIES.values():
        found = registry.names_by_type.get(type(plugin))
        if found is not None:
            return found
    return type(plugin).__name__


@dataclass(slots=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    pick_hooks: tuple[PickHook, ...] = field(init=False, default=())
    finish_hooks: tuple[FinishHook, ...] = field(init=False, default=())
    # Plugins replicas share, by a key stable across replicas with the same config ("<i>:<name>").
    shared: tuple[tuple[str, SharedPlugin], ...] = field(init=False, default=())
    # What to hash a long prompt with before scheduling (PromptHashing), if any plugin wants it.
    hash_spec: tuple[int, int] | None = field(init=False, default=None)
    reporting: tuple[Reporting, ...] = field(init=False, default=())
    # Plugins with state per upstream id, told when an upstream has left (UpstreamMemory).
    forgetting: tuple[UpstreamMemory, ...] = field(init=False, default=())
    # The prepare stage: plugins that write figures by name (Producer), and the names they write.
    producers: tuple[Producer, ...] = field(init=False, default=())
    produced: frozenset[str] = field(init=False, default=frozenset())
    # The model of the prefill queued per upstream (PrefillQueue), the first plugin with one.
    prefill_queue: PrefillQueue | None = field(init=False, default=None)
    _labels: tuple[tuple[str, ...], tuple[str, ...], str] = field(init=False, default=((), (), ""))

    def __post_init__(self) -> None:
        plugins = [*self.filters, *(s for s, _ in self.scorers), self.picker]
        self.reporting = tuple(p for p in plugins if isinstance(p, Reporting))
        self.forgetting = tuple(p for p in plugins if isinstance(p, UpstreamMemory))
        self.pick_hooks = tuple(p for p in plugins if isinstance(p, PickHook))
        self.finish_hooks = tuple(p for p in plugins if isinstance(p, FinishHook))
        self.shared = tuple(
            (f"{i}:{plugin_name(p)}", p) for i, p in enumerate(plugins) if isinstance(p, SharedPlugin)
        )
        self.producers = tuple(p for p in plugins if isinstance(p, Producer))
        self.produced = frozenset(name for p in self.producers for name in p.produces)
        self.prefill_queue = next((p for p in plugins if isinstance(p, PrefillQueue)), None)
        hashing = [p for p in plugins if isinstance(p, PromptHashing)]
        self.hash_spec = hashing[0].prompt_hash_spec() if hashing else None
        self._labels = (
            tuple(plugin_name(f) for f in self.filters),
            tuple(plugin_name(s) for s, _ in self.scorers),
            plugin_name(self.picker),
        )
        for p in plugins:
            if isinstance(p, Consumer):
                missing = [name for name in p.consumes if name not in self.produced]
                if missing:
                    raise ConfigError(
                        f"profile '{self.name}': plugin '{plugin_name(p)}' reads the prepared figure "
                        f"'{missing[0]}', which no plugin of the profile produces "
                        f"(add one that does: {', '.join(producers_of(missing[0])) or 'none registered'})"
                    )

    def prepare(
        self,
        request: InferenceRequest,
        candidates: Sequence[Upstream],
        state: FleetState,
        timer: PluginTimer | None = None,
    ) -> None:
        """The prepare stage: a fresh `request.prepared`, filled by every producer for `candidates`
        (the decision's, before admission's placement narrows them). The lifecycle calls it and
        clears `request.prepared` when the decision is made; `schedule` calls it itself when no
        caller did."""
        request.prepared = {}
        clock = time.perf_counter
        for producer in self.producers:
            t0 = clock()
            producer.prepare(request, candidates, state)
            if timer is not None:
                timer("prepare", plugin_name(producer), clock() - t0)

    def backlog(self, upstream: Upstream, state: FleetState) -> tuple[float, float] | None:
        """(seconds of prefill queued at `upstream`, mean prefill seconds of a request sent there)
        by the profile's PrefillQueue; None without one."""
        queue = self.prefill_queue
        return None if queue is None else queue.backlog(upstream, state)

    def forget_upstream(self, upstream_id: str) -> None:
        """The upstream has left for good: every plugin drops what it kept about it."""
        for plugin in self.forgetting:
            plugin.forget_upstream(upstream_id)

    def schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[Upstream],
        state: FleetState,
        timer: PluginTimer | None = None,
        explain: Explanation | None = None,
        ranked: list[tuple[float, Upstream]] | None = None,
    ) -> Upstream | None:
        """Pick one upstream, or None when the filters leave nobody. With `explain`, what every plugin
        returned is recorded in it as well (extproc.scheduling.explain; the decision is the same). With
        `ranked`, the scored candidates are appended to it as (total, upstream):
        the endpoint picker's fallbacks (lifecycle/endpoints.py)."""
        if request.prepared is None:  # no prepare stage ran (a direct call): this decision's own
            self.prepare(request, candidates, state, timer)
            try:
                return self._schedule(request, candidates, state, timer, explain, ranked)
            finally:
                request.prepared = None
        return self._schedule(request, candidates, state, timer, explain, ranked)

    def _schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[Upstream],
        state: FleetState,
        timer: PluginTimer | None,
        explain: Explanation | None,
        ranked: list[tuple[float, Upstream]] | None,
    ) -> Upstream | None:
        filter_names, scorer_names, picker_name = self._labels
        if explain is not None:  # what each plugin said, kept as given (views built when read)
            explain.begin(self.name, filter_names, self._weights(scorer_names), picker_name, candidates)
        clock = time.perf_counter
        for f, fname in zip(self.filters, filter_names, strict=True):
            t0 = clock()
            candidates = f.filter(request, candidates, state)
            if timer is not None:
                timer("filter", fname, clock() - t0)
            if explain is not None:
                explain.kept.append(tuple(candidates))
        if not candidates:
            return None
        if len(candidates) == 1:
            if explain is not None:
                explain.picked = candidates[0]
            self._picked(request, candidates[0], state)
            return candidates[0]
        totals = [0.0] * len(candidates)
        for (scorer, weight), sname in zip(self.scorers, scorer_names, strict=True):
            t0 = clock()
            scores = scorer.score(request, candidates, state)
            if timer is not None:
                timer("scorer", sname, clock() - t0)
            if len(scores) != len(candidates):
                raise RuntimeError(
                    f"scorer '{sname}' returned {len(scores)} scores for {len(candidates)} candidates"
                )
            # Clamped to [0, 1] (NaN fails both tests: 0) so one scorer cannot outweigh the weights;
            # inline, as this runs per candidate and scorer (1000s of candidates a decision).
            totals = [
                t + weight * (1.0 if s >= 1.0 else s if s > 0.0 else 0.0)
                for t, s in zip(totals, scores, strict=True)
            ]
            if explain is not None:
                explain.raw.append(tuple(scores))
        if ranked is not None:
            ranked.extend(zip(totals, candidates, strict=True))
        t0 = clock()
        chosen = self.picker.pick(request, candidates, totals)
        if timer is not None:
            timer("picker", picker_name, clock() - t0)
        if explain is not None:
            explain.scored_ids = tuple(u.id for u in candidates)
            explain.totals = totals
            explain.picked = chosen
            explain.reporting = self.reporting
        self._picked(request, chosen, state)
        return chosen

    def _weights(self, scorer_names: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
        return tuple((n, w) for n, (_, w) in zip(scorer_names, self.scorers, strict=True))

    def _picked(self, request: InferenceRequest, chosen: Upstream, state: FleetState) -> None:
        for hook in self.pick_hooks:
            hook.on_pick(request, chosen, state)

    def finished(self, request: InferenceRequest, upstream: Upstream) -> None:
        for hook in self.finish_hooks:
            hook.on_finish(request, upstream)


PROFILE_KEYS = ("filters", "scorers", "picker")
ENTRY_KEYS = ("name", "params")  # of a plugin entry given as a mapping; a scorer's has a weight too
SCORER_ENTRY_KEYS = ("name", "weight", "params")


def plugin_parameters() -> dict[str, dict[str, tuple[str, ...]]]:
    """Every registered plugin's parameters (its factory's keyword arguments, the keys of an entry's
    `params:`), by kind and name: what the docs are checked against."""
    found: dict[str, dict[str, tuple[str, ...]]] = {}
    for kind, registry in _REGISTRIES.items():
        for name, factory in sorted(registry.factories.items()):
            if dataclasses.is_dataclass(factory):
                fields = dataclasses.fields(factory)
                params = tuple(f.name for f in fields if f.init and not f.name.startswith("_"))
            else:
                code = inspect.signature(factory).parameters
                params = tuple(
                    n for n, p in code.items() if p.kind is p.KEYWORD_ONLY or p.default is not p.empty
                )
            found.setdefault(kind, {})[name] = params
    return found


def profile_from_config(name: str, raw: Any) -> Profile:
    """Build a profile from YAML: entries are a plugin name or {name, weight, params}."""
    where = f"profile '{name}'"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - set(PROFILE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(PROFILE_KEYS)})")
    filters = tuple(
        build_filter(*_entry(e, f"{where}.filters")) for e in _list(raw.get("filters"), f"{where}.filters")
    )
    scorers: list[tuple[Scorer, float]] = []
    for e in _list(raw.get("scorers"), f"{where}.scorers"):
        plugin, params = _entry(e, f"{where}.scorers", SCORER_ENTRY_KEYS)
        weight = e.get("weight", 1.0) if isinstance(e, dict) else 1.0
        weight = number(weight, f"{where}: scorer '{plugin}' weight", minimum=0.0)
        if math.isinf(weight):
            raise ConfigError(f"{where}: scorer '{plugin}' weight must be finite")
        scorers.append((build_scorer(plugin, params), weight))
    picker = build_picker(*_entry(raw.get("picker", "max-score"), f"{where}.picker"))
    return Profile(name=name, filters=filters, scorers=tuple(scorers), picker=picker)


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list")
    return value


def _entry(e: Any, where: str, keys: tuple[str, ...] = ENTRY_KEYS) -> tuple[str, dict[str, Any]]:
    if isinstance(e, str):
        return e, {}
    if isinstance(e, dict) and isinstance(e.get("name"), str):
        unknown = set(e) - set(keys)
        if unknown:
            raise ConfigError(
                f"{where}: plugin '{e['name']}': unknown keys {sorted(unknown)} (known: {', '.join(keys)})"
            )
        params = e.get("params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"plugin '{e['name']}': 'params' must be a mapping")
        return e["name"], params
    raise ConfigError(f"{where}: plugin entry must be a name or a mapping with 'name', got {e!r}")
