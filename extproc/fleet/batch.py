"""How many requests an upstream's engines run at once before they queue, and how fast those
requests turn over, learnt from snapshots (the fleet view's rebuild feeds every one in once).

An engine with a full batch (vLLM's `--max-num-seqs`, or the KV cache) makes a new request wait for
a running one to finish: seconds per request ahead, not the milliseconds of a prefill queue. The
engines do not publish their batch limit, but they show it: a snapshot with requests waiting was
taken at the limit, so its running count is the limit for that mix of prompts; where it queued at
the most it ever ran, still for QUEUE_HOLD_S after the queue clears (admission keeping requests back
is what clears it) unless the engine runs more. The turnover is the rate at which requests reach
their first token (the engines' counter), the rate at which waiting requests get a place once the
batch is full. Where the publisher says how many requests the engines run at once (`max_num_seqs`),
that is the limit from the first snapshot on (a cold fleet fills its batches within seconds, before
any queue shows them), lowered where the KV cache fills first. A limit is a sequence cap
(`limit(cap=True)`) only where it does not move with the prompts: published, or queues at one size
that is the most the engines ever ran, snapshot after snapshot, or the size at which two engines
alike (one deployment's replicas) queue at their most (`limit(shared=True)`), each with room in the
KV cache for one more request of the mean size there: at once, or one at a time at the most any of
them ran, unchanged for KIND_MOST_STABLE_S. One engine's one queue is not a cap: a token
budget or a burst of arrivals shows one at any size; nor is a queue with no room in the cache, which
an engine holding a few long prompts shows well below KV_FULL. A kind's cap stays after the queues
that showed it clear (admission holding lower classes below it is what clears them: dropped, the
batches refilled ahead of critical requests) until an engine of the kind runs more, as a probe lets
one engine do after KIND_PROBE_AFTER_S full with none waiting."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

TURNOVER_WINDOW_S = 10.0  # the turnover's smoothing (snapshot time)
KV_FULL = 0.9  # KV-cache usage at which a queue is the cache's limit
PROBE_AFTER_S = 3.0  # full with none waiting this long: one more place is tried
STEADY_QUEUES = 2  # queueing snapshots in a row at one batch size that show a sequence cap
AGREEING_ENGINES = 2  # engines of a kind at one cap (steady or queueing at their most) that show it
PROBE_BACKOFF_MAX_S = 48.0  # a probe that failed (a queue at the old limit) doubles the wait to this
QUEUE_HOLD_S = 3.0  # a queue at the most run stays admission's limit this long after it clears
KIND_CAP_RUNS = 2  # snapshots in a row showing a kind's cap before it stays once no queue shows it
KIND_FULL = 1.0  # an engine within this of its kind's cap, none waiting, is full (the critical place kept)
KIND_PROBE_AFTER_S = 10.0  # full this long at a kept cap: one engine of the kind is read above it
KIND_PROBE_PLACES = 2.0  # how far above: the place admission keeps for critical requests, and one
KIND_PROBE_BACKOFF_MAX_S = 80.0  # a probe that queued at the cap doubles the wait, up to this
KIND_PROBE_WINDOW_S = 5.0  # a probe that neither ran past the cap nor queued in this long ends
KIND_MOST_STABLE_S = 10.0  # the most any engine of a kind ran, unchanged this long: queues at it show a cap
MAX_TRACKED_UPSTREAMS = 4096


class BatchReport(Protocol):
    """What is read of `fleet.view.Load` (a protocol: the view imports this module)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def unknown(self) -> frozenset[str]: ...
    @property
    def published_at(self) -> float: ...
    @property
    def epoch(self) -> int: ...
    @property
    def counters(self) -> tuple[float | None, float, float] | None: ...
    @property
    def max_num_seqs(self) -> int | None: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def instances(self) -> int: ...
    @property
    def gpu_speed(self) -> float | None: ...


Kind = tuple[int, int, int, float | None]  # engines alike: KV blocks, block size, instances, GPU speed


@dataclass(slots=True)
class _Batch:
    published_at: float
    epoch: int
    limit: float | None = None  # confirmed: seen twice, or with the KV cache full (None before)
    full_since: float | None = None  # since when it runs at the limit with none waiting
    probe_after: float = PROBE_AFTER_S  # how long full with none waiting before the next probe
    probed_from: float | None = None  # the confirmed limit before the probe now open
    queued_at: float | None = None  # running requests at the last snapshot, if it queued
    most: float = 0.0  # the most requests seen running at once (since the engines started)
    queue_size: float | None = None  # running requests at the last snapshot that queued (any episode)
    queue_runs: int = 0  # snapshots in a row, of those that queued, at `queue_size`
    steady: float | None = None  # a sequence cap: STEADY_QUEUES queues at this size; cleared by a larger
    # batch with none waiting (a larger one that queues becomes the cap after STEADY_QUEUES of its own)
    first_tokens: float | None = None  # the engines' cumulative count at the last snapshot
    turnover: float | None = None  # first tokens per second, smoothed over TURNOVER_WINDOW_S
    cap: float | None = None  # the published most requests at once (max_num_seqs), while trusted
    kind: Kind | None = None  # None: the engines do not say their KV blocks
    published_cap: float | None = None  # the figure last published (a wrong one is not trusted again)
    cache_queue: bool = False  # the last queue was the KV cache's: no room for one more request there
    held: float | None = None  # the running count of the last queue at the most run (QUEUE_HOLD_S)
    held_at: float = 0.0  # when that queue was last seen
    running: float = 0.0  # at the last snapshot
    waiting: bool = False  # requests waited at the last snapshot
    top_queue: float | None = None  # the batch of its last queue at the most it ran, with cache room
    # (cleared once it runs more with none waiting)


@dataclass(slots=True, eq=False)
class _KindCap:
    """The sequence cap engines of one kind showed (`BatchLimits._share`) and its probe."""

    cap: float
    runs: int = 1  # snapshots in a row that showed it
    full_since: float | None = None  # since when an engine of the kind is full with none waiting
    probe_after: float = KIND_PROBE_AFTER_S
    probing: _Batch | None = None  # the engine read KIND_PROBE_PLACES above the cap
    probe_since: float = 0.0

    def probe_failed(self) -> None:
        """The probed engine queued at the cap: the next probe waits twice as long."""
        self.probing, self.full_since = None, None
        self.probe_after = min(2.0 * self.probe_after, KIND_PROBE_BACKOFF_MAX_S)


class BatchLimits:
    """Per upstream: the batch limit and the turnover (see the module docstring); None while unknown
    (the engines never queued, or publish no first-token counter)."""

    __slots__ = ("_most", "_seen", "_shown")

    def __init__(self) -> None:
        self._seen: dict[str, _Batch] = {}
        self._shown: dict[Kind, _KindCap] = {}  # the sequence cap engines of a kind showed (`_share`)
        self._most: dict[Kind, tuple[float, float]] = {}  # per kind: the most any engine ran, since when

    def limit(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> float | None:
        """The confirmed limit, or the running count of the last snapshot if it queued (a cold fleet's
        engines fill within seconds of their first queue), or that of a queue at the most it ran until it
        runs more or QUEUE_HOLD_S pass (admission holding lower classes back is what clears the queue; the
        limit gone then, the next interval's arrivals would refill the batch ahead of critical requests), or
        else the sequence cap engines of its kind showed (`_share`); None otherwise. With `published`, only
        the count of sequences the publisher gave (`max_num_seqs`) while it is the limit: one learnt from
        queues may be a burst of prefills over the step's token budget, a batch held at one size by a token
        budget under overload, or a full KV cache where a request sharing cached blocks still fits. With
        `cap`, the limit only while it is a sequence cap: published, or `STEADY_QUEUES` queueing snapshots
        in a row at one size no smaller than any run before and not run past since with none waiting, with
        room in the KV cache for one more request, or its kind's. Not a full KV cache's or a token budget's
        limit (they move with the prompts placed there: placement that keeps places by them moves requests
        off their prefix holders; shared, a cache's limit bounded engines alike that had room, and admission
        shed requests they could have run: notebook/benchmarks-history.md, "A cache's queue is not a cap"),
        nor one engine's single queue at the most it ran (on multi-turn chats, kept by it, conversations
        left the engines holding them: "One queue is not a cap"). With `shared`, only its kind's cap (not a
        published one): what engines alike showed, the surest of the learnt ones."""
        seen = self._seen.get(upstream_id)
        if seen is None:
            return None
        is_published = seen.cap is not None and seen.limit == seen.cap
        if published:
            return seen.limit if is_published else None
        if shared:
            return self._sibling(seen)
        if cap and seen.steady is None and not is_published:
            return self._sibling(seen)
        if seen.limit is not None:
            return seen.limit
        if seen.queued_at is not None:
            return seen.queued_at
        return seen.held if seen.held is not None else self._sibling(seen)

    def source(self, upstream_id: str) -> tuple[float | None, str]:
        """Admission's limit for `upstream_id` (`limit()`) and where it comes from, for operators
        (`llm_extproc_batch_limit`): "published" (`max_num_seqs`), "sequence_cap" (learnt, and kept
        places count there: steady or its kind's), "queue" (a queue or a full KV cache: it bounds how
        many are admitted only), "none" (unknown: the classes do not separate there yet)."""
        if (published := self.limit(upstream_id, published=True)) is not None:
            return published, "published"
        if (cap := self.limit(upstream_id, cap=True)) is not None:
            return cap, "sequence_cap"
        if (limit := self.limit(upstream_id)) is not None:
            return limit, "queue"
        return None, "none"

    def _sibling(self, seen: _Batch) -> float | None:
        """The sequence cap engines of its kind showed, unless it ran more itself (`_share`); more for
        the engine the kind's probe is on."""
        if seen.kind is None or seen.cap is not None:
            return None
        shown = self._shown.get(seen.kind)
        if shown is None or seen.most > shown.cap:
            return None
        return shown.cap + KIND_PROBE_PLACES if shown.probing is seen else shown.cap

    def turnover(self, upstream_id: str) -> float | None:
        seen = self._seen.get(upstream_id)
        return None if seen is None else seen.turnover

    def forget(self, upstream_id: str) -> None:
        self._seen.pop(upstream_id, None)

    def take_all(self, loads: Mapping[str, BatchReport]) -> None:
        for upstream_id, load in loads.items():
            self.take(upstream_id, load)
        self._share(loads)

    def _share(self, loads: Mapping[str, BatchReport]) -> None:
        """The sequence cap each kind of engine showed (the same KV blocks, block size, instances and
        GPUs: one configuration, as a deployment's replicas run): a size at which AGREEING_ENGINES of
        the kind have a steady cap or queue (now, or held: `limit`) at the most they ever ran, with
        room in the cache (not `cache_queue`). An engine that has shown nothing itself is read at that cap
        (`_sibling`): a cold fleet fills every batch within seconds, before each engine's own queues
        show its cap, and a queue ahead of a cap costs seconds a request. One engine's alone is not
        shared: on engines bound by their KV cache or token budget such a queue is often a prompt
        mix's (notebook/benchmarks-history.md, "Caps shared by engines alike"). The largest shown,
        and only for an engine that never ran more. Kept once no queue shows it (`_keep`)."""
        shown: dict[Kind, float] = {}
        queues: dict[tuple[Kind, float], int] = {}
        kinds: dict[Kind, list[_Batch]] = {}
        now = 0.0
        seen_all = self._seen
        for upstream_id in loads:
            seen = seen_all.get(upstream_id)
            if seen is None or seen.kind is None:
                continue
            kinds.setdefault(seen.kind, []).append(seen)
            now = max(now, seen.published_at)
            size = seen.steady
            queued = seen.queued_at if seen.queued_at is not None else seen.held
            if size is None and queued is not None and queued >= seen.most and not seen.cache_queue:
                size = queued
            if size is not None:
                n = queues[(seen.kind, size)] = queues.get((seen.kind, size), 0) + 1
                if n >= AGREEING_ENGINES:
                    shown[seen.kind] = max(shown.get(seen.kind, 0.0), size)
        self._keep(shown, self._queued_at_most(kinds, now), kinds, now)

    def _queued_at_most(self, kinds: dict[Kind, list[_Batch]], now: float) -> dict[Kind, float]:
        """Per kind, the most any of its engines ran, where that has not changed for
        KIND_MOST_STABLE_S and AGREEING_ENGINES of them queued at it (each its last queue at its
        most, with room in the cache), at any time: engines alike that queue at the most any ran
        show a sequence cap even when their queues never overlap (at half load a prefix holder
        queues alone, one burst at a time, and critical requests followed their prefix into its
        queue: notebook/benchmarks-history.md, "Queues at the most run, one at a time"). The
        stability leaves out a token budget's queues, at sizes that grow with the load."""
        old = self._most
        self._most = found = {}
        shown: dict[Kind, float] = {}
        for kind, engines in kinds.items():
            most = max(e.most for e in engines)
            before = old.get(kind)
            since = before[1] if before is not None and before[0] == most else now
            found[kind] = (most, since)
            if now - since < KIND_MOST_STABLE_S:
                continue
            if sum(e.top_queue == most for e in engines) >= AGREEING_ENGINES:
                shown[kind] = most
        return shown

    def _keep(
        self,
        shown: dict[Kind, float],
        queued_at_most: dict[Kind, float],
        kinds: dict[Kind, list[_Batch]],
        now: float,
    ) -> None:
        """Each kind's cap from what its engines show now (`shown`), or the one they showed
        KIND_CAP_RUNS snapshots running before: its queues cleared because admission keeps lower
        classes below it (dropped, the next second's arrivals refilled every batch ahead of critical
        requests: notebook/benchmarks-history.md, "A kind's cap kept"). One shown once is a burst's
        or an overload's (a token budget holding the batches at one size) and goes with it; one
        shown by queues at different times (`queued_at_most`) is kept as if shown twice. Kept
        until an engine of the kind runs more; and since a cap kept may be a budget's, or the
        engines restarted with a larger one, an engine full for `probe_after` with none waiting is
        read KIND_PROBE_PLACES above it (admission still keeps one place for critical requests): it
        runs past the cap (the cap goes) or queues (the next probe waits twice as long). `kinds`:
        this round's engines by kind; `now`: its newest snapshot's time."""
        kept: dict[Kind, _KindCap] = {}
        for kind, engines in kinds.items():
            old = self._shown.get(kind)
            size = shown.get(kind)
            if size is not None:  # shown now
                if old is None or old.cap != size:
                    old = _KindCap(size)
                else:
                    old.runs += 1
                    if old.probing is not None:  # the probed engine queued at the cap with another
                        old.probe_failed()
                old.full_since = None
                kept[kind] = old
                continue
            earlier = queued_at_most.get(kind)
            if earlier is not None:
                if old is None or old.cap != earlier:
                    old = _KindCap(earlier, runs=KIND_CAP_RUNS)
                else:
                    old.runs = max(old.runs, KIND_CAP_RUNS)
            if old is None or old.runs < KIND_CAP_RUNS or any(e.most > old.cap for e in engines):
                continue
            kept[kind] = old
            probe = old.probing
            if probe is not None:
                if not any(e is probe for e in engines) or now - old.probe_since >= KIND_PROBE_WINDOW_S:
                    old.probing, old.full_since = None, None  # no verdict: the place was not taken
                elif probe.waiting:  # it queued at the cap: a cap it is
                    old.probe_failed()
                continue
            full = [e for e in engines if not e.waiting and e.running >= old.cap - KIND_FULL]
            if not full:
                old.full_since = None
            elif old.full_since is None:
                old.full_since = now
            elif now - old.full_since >= old.probe_after:
                old.probing, old.probe_since = full[0], now
        self._shown = kept

    def take(self, upstream_id: str, load: BatchReport) -> None:
        """Take in `load`'s snapshot unless already taken."""
        seen = self._seen.get(upstream_id)
        if seen is not None and seen.epoch != load.epoch:  # restarted (maybe reconfigured)
            seen = None
        if seen is None:
            if len(self._seen) >= MAX_TRACKED_UPSTREAMS:
                self._seen.clear()
            seen = self._seen[upstream_id] = _Batch(load.published_at, load.epoch)
        elif seen.published_at >= load.published_at:
            return
        dt = load.published_at - seen.published_at
        seen.published_at = load.published_at
        total = load.kv_blocks_total
        seen.kind = (total, load.block_size, load.instances, load.gpu_speed) if total > 0 else None
        cap = None if load.max_num_seqs is None else float(load.max_num_seqs)
        if cap != seen.published_cap:
            seen.published_cap = seen.cap = cap
            if cap is not None and (seen.limit is None or seen.limit > cap):
                seen.limit, seen.probed_from = cap, None
        if "num_running" not in load.unknown and "num_waiting" not in load.unknown:
            kv = load.kv_cache_usage if "kv_cache_usage" not in load.unknown else 0.0
            self._limit(seen, float(load.num_running), load.num_waiting, kv, load.published_at)
        counters = load.counters
        if counters is None:
            seen.first_tokens = None
            return
        first = counters[1]
        if seen.first_tokens is not None and first >= seen.first_tokens and dt > 0:
            rate = (first - seen.first_tokens) / dt
            if seen.turnover is None:
                seen.turnover = rate
            else:
                seen.turnover += (1.0 - math.exp(-dt / TURNOVER_WINDOW_S)) * (rate - seen.turnover)
        seen.first_tokens = first

    @staticmethod
    def _limit(seen: _Batch, running: float, waiting: int, kv_usage: float, at: float) -> None:
        limit = seen.limit
        most = seen.most
        seen.running, seen.waiting = running, waiting > 0
        seen.most = max(most, running)
        if waiting > 0 and running > 0:
            # Queueing: a limit, confirmed when the KV cache is full or the batch stayed the same
            # size while requests waited (a sequence cap) two snapshots running, at a size no smaller
            # than any it ran before (a cap is one number: a 256-sequence engine seen queueing twice
            # at 9 is a burst of prefills over each step's token budget; taken for a cap, admission
            # held standard requests at half load). Otherwise used only while the queue is there
            # (limit() reads `queued_at`).
            seen.full_since = None
            # The cache's queue, not a sequence cap, where one more request of the mean size there
            # would take it past KV_FULL (an engine with room for few prompts queues well below it).
            seen.cache_queue = kv_usage * (running + 1.0) >= KV_FULL * running
            if seen.probed_from is not None and running <= seen.probed_from:
                # The probe failed: back to the limit it started from, and the next one waits
                # twice as long (each probe costs the request that queues behind the batch).
                seen.limit = seen.probed_from
                seen.probe_after = min(2.0 * seen.probe_after, PROBE_BACKOFF_MAX_S)
                seen.probed_from = None
            elif kv_usage >= KV_FULL or (seen.queued_at == running and running >= most):
                seen.limit = running
            seen.queued_at = running
            # Held after the queue clears where it was at the most run (a burst below a batch
            # already run is not): admission holding lower classes back is what clears it.
            if running >= most:
                seen.held, seen.held_at = running, at
            else:
                seen.held = None
            # A sequence cap (limit(cap=True)): STEADY_QUEUES queues in a row at one size, the most run,
            # with room in the cache.
            seen.queue_runs = seen.queue_runs + 1 if running == seen.queue_size else 1
            seen.queue_size = running
            if seen.queue_runs >= STEADY_QUEUES and running >= most and not seen.cache_queue:
                seen.steady = running
            if running >= most and not seen.cache_queue:
                seen.top_queue = running
            return
        seen.queued_at = None
        if seen.held is not None and (running > seen.held or at - seen.held_at >= QUEUE_HOLD_S):
            seen.held = None
        if seen.steady is not None and running > seen.steady:
            seen.steady = None  # it ran more: the queues were not a cap
        if seen.top_queue is not None and running > seen.top_queue:
            seen.top_queue = None
        if limit is None:  # not confirmed yet: nothing to raise or probe
            return
        if running > limit or (seen.probed_from is not None and running > seen.probed_from):
            seen.limit = limit = max(limit, running)  # it runs that many at once
            seen.probe_after, seen.probed_from = PROBE_AFTER_S, None
            if seen.cap is not None and running > seen.cap:
                seen.cap = None  # the published figure is wrong: learnt like any other
        if running >= limit - 1:
            # Near the limit with no one waiting (admission holds lower classes a place below it):
            # it may take more. One more place is tried after `probe_after` of this (a limit too
            # high costs the requests that then queue at the engine, and shows at once).
            if seen.full_since is None:
                seen.full_since = at
            if seen.cap is not None and limit >= seen.cap:
                seen.full_since = None  # at the published limit: nothing to try
            elif at - seen.full_since >= seen.probe_after:
                if seen.probed_from is None:
                    seen.probed_from = limit
                seen.limit = limit + 1
                seen.full_since = None
        else:
            seen.full_since = None
