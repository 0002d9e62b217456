"""LoRA affinity: send a request that names a LoRA adapter where that adapter already sits in GPU memory.

With vLLM (and SGLang) a LoRA adapter is requested by putting its name in the request's `model`. An
engine holds at most `max_lora` adapters in GPU memory at once; a request for another one waits until
a slot frees and the adapter is loaded (swapped in for the least recently used one when no request of
that one is running). What the plugins know per upstream:

- the adapters the engines list with running or waiting requests (vLLM's `lora_requests_info`), which
  occupy a slot each and cannot be swapped out while their requests run: `Load.lora_adapters`;
- the adapter slots the engines publish (`Load.lora_slots`, `Load.lora_slots_free`);
- what this process sent there itself: a small LRU of adapters per upstream, trimmed to its slots, so an
  adapter whose requests all finished (vLLM then stops listing it, though it stays in GPU memory until a
  new one evicts it) still counts as loaded.

A model is treated as an adapter when the profile lists it (`adapters`) or some engine has listed it;
anything else (the base model, an adapter nobody has reported yet) scores neutral and is never
filtered, so base-model traffic is not pushed around by adapter slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import FILTERS, SCORERS, FleetState

MAX_LEARNED_ADAPTERS = 4096  # adapter names remembered from snapshots (oldest forgotten first)
MAX_TRACKED_PER_UPSTREAM = 64  # LRU bound where an upstream publishes no slot count


@dataclass(slots=True)
class _Adapters:
    """Which model names are LoRA adapters: configured, or listed by some engine."""

    configured: frozenset[str] = frozenset()
    learned: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _seen: dict[str, Load] = field(default_factory=dict)  # the Load last learned from, per upstream

    def learn(self, upstream_id: str, load: Load) -> bool:
        """Remember the adapters of a Load not seen before; True when it is new (a fresh snapshot)."""
        if self._seen.get(upstream_id) is load:
            return False
        self._seen[upstream_id] = load
        for name in load.lora_adapters:
            if name not in self.learned:
                self.learned[name] = None
                if len(self.learned) > MAX_LEARNED_ADAPTERS:
                    self.learned.popitem(last=False)
        return True

    def known(self, model: str | None) -> bool:
        return model is not None and (model in self.configured or model in self.learned)

    def forget(self, upstream_id: str) -> None:
        self._seen.pop(upstream_id, None)


@FILTERS.register("lora-affinity")
@dataclass(slots=True)
class LoraAffinityFilter:
    """Drops candidates that cannot take the adapter now: they publish adapter slots, every slot is held
    by another adapter with running or waiting requests (pinned), and the requested adapter is not among
    them. Keeps every candidate when that would drop them all (the request then waits for a slot
    somewhere rather than failing), and filters nothing for a model not known to be an adapter."""

    adapters: Sequence[str] = ()
    _names: _Adapters = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._names = _Adapters(configured=frozenset(self.adapters))

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: the snapshot last learnt from there goes (its adapters stay known)."""
        self._names.forget(upstream_id)

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]:
        adapter = request.model
        loads = [state.load(u.id) for u in candidates]
        for u, load in zip(candidates, loads, strict=True):
            if load is not None:
                self._names.learn(u.id, load)
        if not self._names.known(adapter):
            return candidates
        kept = [u for u, load in zip(candidates, loads, strict=True) if _can_take(load, adapter)]
        return kept if kept else candidates


@dataclass(slots=True)
class _Slots:
    """This process's view of one upstream's adapter slots: adapter -> when last sent or listed, least
    recent first, at most `capacity` of them (the engines evict the least recently used too)."""

    recent: OrderedDict[str, float] = field(default_factory=OrderedDict)
    capacity: int = 0  # 0: unknown
    epoch: int = 0

    def touch(self, adapter: str, now: float) -> None:
        self.recent[adapter] = now
        self.recent.move_to_end(adapter)
        limit = self.capacity or MAX_TRACKED_PER_UPSTREAM
        while len(self.recent) > limit:
            self.recent.popitem(last=False)

    def expire(self, before: float) -> None:
        while self.recent:
            adapter, at = next(iter(self.recent.items()))
            if at >= before:
                break
            del self.recent[adapter]


@SCORERS.register("lora-affinity")
@dataclass(slots=True)
class LoraAffinityScorer:
    """1.0 where the adapter is in GPU memory (listed by the engine, or sent there recently and not
    evicted since by the LRU model), `free_slot_score` where a slot is free (or the slots are unknown),
    `swap_score` where loading it evicts another adapter. Bounded: a candidate whose queue exceeds
    `overload_ratio` x the least-loaded candidate's + `overload_slack` gets 0, so a hot adapter spreads
    onto more instances instead of piling onto its first holders. Base-model requests score 1.0
    everywhere (neutral)."""

    free_slot_score: float = 0.5
    swap_score: float = 0.1
    # An adapter sent somewhere counts as still loaded there this long after its last request (engines
    # keep it until another adapter needs its slot; this bounds what other replicas' traffic may have
    # changed unseen).
    memory_s: float = 300.0
    default_slots: int = 0  # slots assumed where the engines publish none (0: unknown)
    overload_ratio: float = 2.0
    overload_slack: float = 4.0
    adapters: Sequence[str] = ()
    _names: _Adapters = field(init=False, repr=False)
    _slots: dict[str, _Slots] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("free_slot_score", "swap_score"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.memory_s <= 0 or self.overload_ratio < 1.0:
            raise ValueError("memory_s must be > 0 and overload_ratio >= 1")
        if self.overload_slack < 0 or self.default_slots < 0:
            raise ValueError("overload_slack and default_slots must be >= 0")
        self._names = _Adapters(configured=frozenset(self.adapters))

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: its slot model goes (its adapters stay known)."""
        self._slots.pop(upstream_id, None)
        self._names.forget(upstream_id)

    def _sync(self, upstream_id: str, load: Load | None, now: float) -> _Slots:
        """The upstream's slot model, corrected by a new snapshot: listed adapters are in memory now."""
        slots = self._slots.get(upstream_id)
        if slots is None:
            slots = self._slots[upstream_id] = _Slots(capacity=self.default_slots)
        if load is not None and self._names.learn(upstream_id, load):
            if load.epoch != slots.epoch:  # the engine restarted: its GPU memory is empty
                slots.recent.clear()
                slots.epoch = load.epoch
            slots.capacity = load.lora_slots or self.default_slots
            slots.expire(now - self.memory_s)
            for adapter in sorted(load.lora_adapters):  # a set: sorted, so every process agrees
                slots.touch(adapter, now)
        return slots

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        now = state.now()
        adapter = request.model
        loads = [state.load(u.id) for u in candidates]
        models = [self._sync(u.id, load, now) for u, load in zip(candidates, loads, strict=True)]
        if adapter is None or not self._names.known(adapter):
            return [1.0] * len(candidates)
        queues = [_queue(u, load, state) for u, load in zip(candidates, loads, strict=True)]
        bound = min(queues) * self.overload_ratio + self.overload_slack
        fresh_after = now - self.memory_s
        scores = []
        for load, slots, queue in zip(loads, models, queues, strict=True):
            if queue > bound:
                scores.append(0.0)
                continue
            sent_at = slots.recent.get(adapter)
            if (load is not None and adapter in load.lora_adapters) or (
                sent_at is not None and sent_at >= fresh_after
            ):
                scores.append(1.0)
            elif _has_free_slot(slots, load):
                scores.append(self.free_slot_score)
            else:
                scores.append(self.swap_score)
        return scores

    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None:
        """The adapter will be loaded there (if it was not): the most recent in that upstream's LRU."""
        adapter = request.model
        if adapter is None or not self._names.known(adapter):
            return
        now = state.now()
        slots = self._sync(upstream.id, state.load(upstream.id), now)
        slots.expire(now - self.memory_s)
        slots.touch(adapter, now)


def _can_take(load: Load | None, adapter: str | None) -> bool:
    """Not every published slot held by another adapter with requests (or nothing published)."""
    if load is None or load.lora_slots == 0 or load.lora_slots_free > 0:
        return True
    return adapter in load.lora_adapters


def _has_free_slot(slots: _Slots, load: Load | None) -> bool:
    """Unknown capacity counts as free; else fewer adapters held (by the LRU model, at least the listed
    ones) than slots, and the engines report a free slot when they report slots at all."""
    if not slots.capacity:
        return True
    if load is not None and load.lora_slots and load.lora_slots_free == 0:
        return False
    return len(slots.recent) < slots.capacity


def _queue(u: Upstream, load: Load | None, state: FleetState) -> float:
    """Requests at the upstream per unit of capacity: reported running + waiting + sent since."""
    reported = load.num_running + load.num_waiting if load is not None else 0
    return (reported + state.pending(u.id)) / u.weight
