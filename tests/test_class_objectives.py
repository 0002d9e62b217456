"""Class objectives: the batch limit learnt from snapshots (fleet/batch.py), the slot wait it adds to
predicted TTFT, and admission keeping places for higher classes (lifecycle/admission.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from builders import FixedBacklog, IdleState

from extproc.config import ConfigError
from extproc.fleet import Upstream
from extproc.fleet.batch import (
    KIND_MOST_STABLE_S,
    KIND_PROBE_AFTER_S,
    PROBE_AFTER_S,
    QUEUE_HOLD_S,
    BatchLimits,
)
from extproc.lifecycle.admission import Admission, Verdict
from extproc.openai import InferenceRequest, RequestError
from extproc.scheduling.ttft_predictor import slot_wait
from extproc.settings import Objective, admission_settings, objective_value


@dataclass(frozen=True)
class Snap:
    num_running: int
    num_waiting: int
    published_at: float
    counters: tuple[float | None, float, float] | None = None
    epoch: int = 0
    unknown: frozenset[str] = frozenset()
    kv_cache_usage: float = 0.5
    max_num_seqs: int | None = None
    kv_blocks_total: int = 0  # 0: the engines do not say (no kind: nothing shared)
    block_size: int = 16
    instances: int = 1
    gpu_speed: float | None = None


def test_the_limit_is_the_batch_seen_queueing_and_a_growing_batch_only_while_it_queues() -> None:
    b = BatchLimits()
    b.take("e", Snap(3, 0, 1.0))
    assert b.limit("e") is None  # never queued: unknown
    b.take("e", Snap(5, 2, 1.5))  # a burst of prefills over a step's token budget...
    assert b.limit("e") == 5  # ...or a limit: it holds while the queue is there (for admission)
    assert b.limit("e", published=True) is None  # not for a prediction's batch wait (slot_wait)
    b.take("e", Snap(7, 0, 2.0))  # the batch grew past it and nobody waits
    assert b.limit("e") is None
    b.take("e", Snap(7, 3, 2.5))
    b.take("e", Snap(7, 3, 3.0))  # the same batch while requests wait: a sequence cap
    assert b.limit("e") == 7
    assert b.limit("e", published=True) is None  # learnt: not a prediction's batch wait
    b.take("e", Snap(8, 0, 3.5))  # it ran 8 at once
    assert b.limit("e") == 8
    b.take("e", Snap(8, 0, 3.5))  # the same snapshot again: nothing new
    assert b.limit("e") == 8
    b.take("e", Snap(6, 1, 4.0, kv_cache_usage=0.95))  # the KV cache is full at 6
    assert b.limit("e") == 6
    assert b.limit("e", published=True) is None
    b.take("e", Snap(6, 0, 4.5, max_num_seqs=6, kv_cache_usage=0.95))  # the publisher's figure
    assert b.limit("e", published=True) == 6
    b.take("e", Snap(5, 1, 5.0, max_num_seqs=6, kv_cache_usage=0.95))  # the KV cache binds first
    assert b.limit("e") == 5 and b.limit("e", published=True) is None


def test_a_queue_at_the_most_run_stays_the_limit_after_it_clears_until_it_runs_more_or_time_passes() -> None:
    """Admission keeping lower classes back is what clears a batch's queue: read as no limit then,
    the next interval's arrivals would refill the batch ahead of critical requests. A queue at the
    most the engine ran is held QUEUE_HOLD_S after it clears (and shown to engines alike, whose cap
    then stays: `test_a_kinds_cap_stays_after_its_queues_clear_...`), unless the engine then runs
    more; a queue below a batch already run is not held."""
    b = BatchLimits()
    b.take("e", Snap(8, 3, 0.5))  # a cold engine's first queue, at the most it ran
    b.take("e", Snap(8, 0, 1.0))  # cleared: admission held requests back
    assert b.limit("e") == 8
    b.take("e", Snap(6, 0, 0.5 + QUEUE_HOLD_S - 0.25))
    assert b.limit("e") == 8
    b.take("e", Snap(6, 0, 0.5 + QUEUE_HOLD_S))  # no queue for QUEUE_HOLD_S: unknown again
    assert b.limit("e") is None
    b.take("e", Snap(8, 1, 5.0))
    b.take("e", Snap(9, 0, 5.5))  # it ran more: the queue was no limit
    assert b.limit("e") is None
    c = BatchLimits()
    c.take("e", Snap(14, 0, 1.0))
    c.take("e", Snap(9, 2, 1.5))  # below a batch it ran: a burst over the step's token budget
    c.take("e", Snap(9, 0, 2.0))
    assert c.limit("e") is None
    kind = {"kv_blocks_total": 600}
    d = BatchLimits()  # engines alike: both queued at their most, then cleared; a third starts there
    d.take_all({"a": Snap(8, 2, 0.5, **kind), "b": Snap(8, 1, 0.5, **kind), "c": Snap(0, 0, 0.5, **kind)})
    d.take_all({"a": Snap(8, 0, 1.0, **kind), "b": Snap(7, 0, 1.0, **kind), "c": Snap(2, 0, 1.0, **kind)})
    assert d.limit("c") == 8 and d.limit("c", shared=True) == 8
    later = 0.5 + QUEUE_HOLD_S
    d.take_all(
        {"a": Snap(8, 0, later, **kind), "b": Snap(7, 0, later, **kind), "c": Snap(2, 0, later, **kind)}
    )
    assert d.limit("c") == 8  # the holds are over; the kind's cap, shown twice, stays
    d.take_all({"a": Snap(9, 0, later + 0.5, **kind), "b": Snap(7, 0, later + 0.5, **kind)})
    assert d.limit("c") is None  # until an engine of the kind runs more


def test_a_queue_at_a_smaller_batch_than_one_already_run_is_no_sequence_cap() -> None:
    """A cap is one number: a 256-sequence engine that ran 14 at once and is then seen queueing at 9
    twice running (prefill bursts over the step's token budget) has no cap at 9. It counts only while
    the queue is there; at the size it ran before, the same two snapshots confirm a cap."""
    b = BatchLimits()
    b.take("e", Snap(14, 0, 1.0))
    b.take("e", Snap(9, 1, 1.5))
    b.take("e", Snap(9, 1, 2.0))
    assert b.limit("e") == 9  # while it queues
    b.take("e", Snap(9, 0, 2.5))
    assert b.limit("e") is None  # not a cap
    b.take("e", Snap(14, 2, 3.0))
    b.take("e", Snap(14, 2, 3.5))
    assert b.limit("e") == 14
    b.take("e", Snap(10, 0, 4.0))
    assert b.limit("e") == 14  # confirmed: it stays


def test_a_sequence_cap_is_a_queue_at_the_most_run_two_snapshots_running_until_a_larger_batch_runs() -> None:
    """A 256-sequence engine bound by its KV cache or its token budget queues at sizes that move
    with the prompts placed there; a sequence cap queues at one, the most the engine runs. Only the
    latter is a cap (`cap=True`, what placement keeps places by); one queue at the most it ever ran
    is not (a token budget or a burst of arrivals shows one at any size)."""
    b = BatchLimits()
    b.take("e", Snap(12, 0, 0.2))  # it ran 12 at once
    b.take("e", Snap(9, 1, 0.5, kv_cache_usage=0.95))  # the KV cache full at 9
    assert b.limit("e") == 9 and b.limit("e", cap=True) is None
    b.take("e", Snap(10, 2, 1.0, kv_cache_usage=0.95))
    assert b.limit("e") == 10 and b.limit("e", cap=True) is None  # below the most it ran
    b.take("e", Snap(12, 2, 1.5))
    assert b.limit("e", cap=True) is None  # one queue at the most it ran
    b.take("e", Snap(11, 0, 2.0))
    assert b.limit("e", cap=True) is None
    b.take("e", Snap(12, 1, 2.5))
    b.take("e", Snap(12, 1, 3.0))
    assert b.limit("e", cap=True) == 12  # two in a row at the most it ran: a cap
    b.take("e", Snap(8, 0, 3.5))  # below it, none waiting: still one
    assert b.limit("e", cap=True) == 12
    b.take("e", Snap(13, 0, 4.0))  # it ran more at once: it was not
    assert b.limit("e") == 13 and b.limit("e", cap=True) is None
    b.take("e", Snap(0, 0, 4.5, max_num_seqs=13))  # the publisher's figure is one
    assert b.limit("e", cap=True) == 13


def test_a_steady_queue_below_a_batch_already_run_is_no_cap() -> None:
    b = BatchLimits()
    b.take("e", Snap(14, 0, 1.0))
    for t in (1.5, 2.0, 2.5, 3.0):
        b.take("e", Snap(9, 1, t))  # a token budget holding the batch at 9 under overload
    assert b.limit("e") == 9 and b.limit("e", cap=True) is None


def test_a_queue_with_no_cache_room_for_one_more_request_is_no_sequence_cap() -> None:
    """An engine whose KV cache holds a few prompts queues at 3 with the cache 80 % used (a fourth
    prompt of the mean size would take it to 107 %): the cache's limit, which moves with the prompts
    placed there. It bounds admission's count, but it is no cap to keep places by, alone or shared
    by engines alike; the same queue with room in the cache is one."""
    kind = {"kv_blocks_total": 600}

    def queues(t: float, kv_a: float, kv_b: float) -> dict[str, Snap]:
        return {
            "a": Snap(3, 1, t, kv_cache_usage=kv_a, **kind),
            "b": Snap(3, 2, t, kv_cache_usage=kv_b, **kind),
        }

    b = BatchLimits()
    for t in (1.0, 1.5):
        b.take_all(queues(t, 0.8, 0.7))
    assert b.limit("a") == 3 and b.limit("b") == 3  # admission's count
    assert b.limit("a", cap=True) is None and b.limit("b", cap=True) is None
    b.take_all({**queues(2.0, 0.8, 0.7), "c": Snap(1, 0, 2.0, **kind)})
    assert b.limit("c", shared=True) is None and b.limit("c") is None
    d = BatchLimits()
    for t in (1.0, 1.5):
        d.take_all(queues(t, 0.6, 0.5))
    assert d.limit("a", cap=True) == 3  # room for one more: a sequence cap
    d.take_all({**queues(1.5, 0.6, 0.5), "c": Snap(1, 0, 1.5, **kind)})
    assert d.limit("c", shared=True) == 3


def test_engines_alike_start_from_the_sequence_cap_two_of_them_showed() -> None:
    """A cold fleet fills every batch within seconds: an engine that has shown nothing yet is read
    at the cap two engines of its kind (KV blocks, block size, instances, GPUs) showed, each steady
    there or queueing now at the most it ran, until it runs more itself; one engine's alone (maybe a
    prompt mix filling its KV cache), another kind, or engines that do not say their KV blocks share
    nothing."""
    b = BatchLimits()

    def snaps(t: float, a: tuple[int, int], b_: tuple[int, int], c: tuple[int, int]) -> dict[str, Snap]:
        return {
            "a": Snap(*a, t, kv_blocks_total=600),
            "b": Snap(*b_, t, kv_blocks_total=600),
            "c": Snap(*c, t, kv_blocks_total=600),
            "h": Snap(3, 0, t, kv_blocks_total=900),  # another kind (an H100 of the same model)
        }

    b.take_all(snaps(1.0, (8, 2), (3, 0), (3, 0)))
    b.take_all(snaps(1.5, (8, 2), (4, 0), (4, 0)))
    assert b.limit("a", cap=True) == 8  # two in a row at the most it ran: a's cap...
    assert b.limit("c") is None and b.limit("c", shared=True) is None  # ...not yet its kind's
    b.take_all(snaps(2.0, (8, 2), (8, 1), (5, 0)))  # b queues at its most, at a's cap
    assert b.limit("c") == 8 and b.limit("c", cap=True) == 8 and b.limit("c", shared=True) == 8
    assert b.limit("c", published=True) is None  # learnt: not a prediction's batch wait
    assert b.limit("h") is None  # another kind of engine
    b.take_all(snaps(2.5, (8, 2), (8, 1), (9, 0)))
    assert b.limit("c") is None  # it ran more: not its cap
    assert b.limit("a", shared=True) == 8
    d = BatchLimits()
    d.take_all({"a": Snap(8, 1, 1.0, kv_blocks_total=600), "b": Snap(6, 3, 1.0, kv_blocks_total=600)})
    d.take_all({"a": Snap(8, 1, 1.5, kv_blocks_total=600), "b": Snap(6, 3, 1.5, kv_blocks_total=600)})
    d.take_all({"a": Snap(8, 1, 2.0, kv_blocks_total=600), "b": Snap(6, 3, 2.0, kv_blocks_total=600)})
    d.take_all({"a": Snap(8, 1, 2.0, kv_blocks_total=600), "c": Snap(1, 0, 2.0, kv_blocks_total=600)})
    assert d.limit("c", shared=True) is None  # steady at 8 and at 6: no two agree
    e = BatchLimits()  # no KV blocks published: no kind
    for t in (1.0, 1.5):
        e.take_all({"a": Snap(8, 2, t), "b": Snap(8, 2, t), "c": Snap(3, 0, t)})
    assert e.limit("a", cap=True) == 8 and e.limit("c") is None


def test_two_engines_alike_queueing_at_their_most_at_one_size_show_a_cap_at_once() -> None:
    """Two engines of a kind queueing at the same size, each at the most it ever ran, show a cap as
    two snapshots of one engine do; at different sizes (a prefill burst, a KV cache) they do not."""
    kind = {"kv_blocks_total": 600}
    b = BatchLimits()
    b.take_all({"a": Snap(8, 1, 1.0, **kind), "b": Snap(8, 3, 1.0, **kind), "c": Snap(2, 0, 1.0, **kind)})
    assert b.limit("c", shared=True) == 8 and b.limit("c", cap=True) == 8
    d = BatchLimits()
    d.take_all({"a": Snap(8, 1, 1.0, **kind), "b": Snap(6, 3, 1.0, **kind), "c": Snap(2, 0, 1.0, **kind)})
    assert d.limit("c", shared=True) is None and d.limit("c") is None


def _kind(t: float, **engines: tuple[int, int]) -> dict[str, Snap]:
    return {name: Snap(*rw, t, kv_blocks_total=600) for name, rw in engines.items()}


def _cap_shown_twice(b: BatchLimits) -> float:
    """Engines alike show a cap of 8 two snapshots running (a and b queue at their most, then c and d
    while a and b are held), none of them twice itself: the kind's cap, no engine's own."""
    b.take_all(_kind(1.0, a=(8, 2), b=(8, 1), c=(3, 0), d=(3, 0), e=(2, 0)))
    b.take_all(_kind(1.5, a=(7, 0), b=(7, 0), c=(8, 1), d=(8, 2), e=(2, 0)))
    return 1.5


def test_a_kinds_cap_stays_after_its_queues_clear_until_an_engine_of_the_kind_runs_more() -> None:
    """Admission keeping lower classes below a cap is what clears the queues that showed it: were
    the cap to go with them (and each engine's hold after QUEUE_HOLD_S), the next second's arrivals
    would refill every batch ahead of critical requests. Shown two snapshots running (queues, or
    their holds, at that size), it stays; shown once, as engines under overload queue at sizes a
    token budget moves, it goes."""
    b = BatchLimits()
    t = _cap_shown_twice(b)
    end = t + 2 * QUEUE_HOLD_S
    while t < end:  # well below the cap, none waiting: nothing to probe
        t += 0.5
        b.take_all(_kind(t, a=(5, 0), b=(5, 0), c=(5, 0), d=(5, 0), e=(5, 0)))
    for name in "abcde":
        assert b.limit(name) == 8 and b.limit(name, cap=True) == 8 and b.limit(name, shared=True) == 8
    assert b.limit("e", published=True) is None  # learnt: still not a prediction's batch wait
    b.take_all(_kind(t + 0.5, a=(5, 0), b=(9, 0), c=(5, 0), d=(5, 0), e=(5, 0)))  # b ran 9 at once
    assert all(b.limit(n) is None and b.limit(n, shared=True) is None for n in "abcde")
    once = BatchLimits()
    once.take_all(_kind(1.0, a=(8, 2), b=(8, 1), e=(2, 0)))
    assert once.limit("e") == 8  # shown: used at once
    once.take_all(_kind(1.5, a=(6, 3), b=(7, 2), e=(2, 0)))  # queues at other sizes
    assert once.limit("e") is None


def test_a_kept_kind_cap_is_probed_on_one_engine_at_a_time() -> None:
    """A kept cap may be a token budget's, or the engines restarted with a larger one: once an
    engine of the kind has been full (at the place below the cap kept for critical requests, none
    waiting) for KIND_PROBE_AFTER_S, one engine is read two places above it (so that lower classes
    can fill one past the cap). Queued there, the cap stands and the next probe waits twice as long;
    run there, the cap goes."""
    b = BatchLimits()
    t = _cap_shown_twice(b)
    full = {n: (7, 0) for n in "abcde"}

    def full_until_probed() -> float:
        nonlocal t
        start = t
        while all(b.limit(n) == 8 for n in "abcde"):
            t += 0.5
            assert t - start < 200, "never probed"
            b.take_all(_kind(t, **full))
        return t - start

    first = full_until_probed()
    # (The clock starts once the holds of the queues that showed it are over.)
    assert KIND_PROBE_AFTER_S <= first <= KIND_PROBE_AFTER_S + QUEUE_HOLD_S + 1.0
    probed = [n for n in "abcde" if b.limit(n) == 10]
    assert len(probed) == 1 and all(b.limit(n) == 8 for n in "abcde" if n not in probed)
    t += 0.5
    b.take_all(_kind(t, **{**full, probed[0]: (8, 1)}))  # the ninth waited: a cap
    assert all(b.limit(n) == 8 for n in "abcde")
    assert full_until_probed() >= 2 * KIND_PROBE_AFTER_S
    probed = [n for n in "abcde" if b.limit(n) == 10]
    t += 0.5
    b.take_all(_kind(t, **{**full, probed[0]: (9, 0)}))  # the ninth ran: no cap of 8
    assert all(b.limit(n) is None for n in "abcde")


def test_a_wrong_kind_cap_goes_within_one_probe_for_a_fleet_without_critical_requests() -> None:
    """Critical requests go past a kept cap and show it wrong; standard ones stay one place below
    whatever limit admission reads. Engines that run 256 at once, held at a kept 8, each running
    every place admission leaves them: the probe finds it wrong within its wait."""
    b = BatchLimits()
    t = _cap_shown_twice(b)
    running = {n: 7 for n in "abcde"}
    while any(b.limit(n) is not None for n in "abcde"):
        t += 0.5
        assert t < 1.5 + QUEUE_HOLD_S + KIND_PROBE_AFTER_S + 2.0, "still held"
        b.take_all(_kind(t, **{n: (r, 0) for n, r in running.items()}))
        running = {n: int(b.limit(n) or 21) - 1 for n in "abcde"}
    assert all(b.limit(n, cap=True) is None and b.limit(n, shared=True) is None for n in "abcde")


def test_engines_alike_queueing_one_at_a_time_at_the_most_any_ran_show_a_cap() -> None:
    """At half load a prefix holder queues alone, one burst at a time, so no two queues of a kind
    overlap: two engines whose last queues were at the most any engine of the kind ran, that most
    unchanged for KIND_MOST_STABLE_S, show the kind's cap (kept, as if shown twice, until one runs
    more). Queues at sizes that grow with the load (a token budget's) show none."""
    b = BatchLimits()
    quiet = {n: (4, 0) for n in "abcd"}
    t = 1.0
    b.take_all(_kind(t, **{**quiet, "a": (8, 2)}))  # a queues at 8, alone
    t = 1.0 + QUEUE_HOLD_S + 2.0
    b.take_all(_kind(t, **quiet))  # its hold is over
    t += 0.5
    b.take_all(_kind(t, **{**quiet, "b": (8, 1)}))  # then b, alone
    assert b.limit("d", shared=True) is None  # 8 has been the most for less than KIND_MOST_STABLE_S
    while t + 0.5 < 1.0 + KIND_MOST_STABLE_S:
        t += 0.5
        b.take_all(_kind(t, **quiet))
        assert b.limit("d", shared=True) is None
    t += 0.5  # 8 the most for KIND_MOST_STABLE_S
    b.take_all(_kind(t, **quiet))
    assert all(b.limit(n, shared=True) == 8 and b.limit(n, cap=True) == 8 for n in "abcd")
    assert b.limit("d", published=True) is None  # learnt: still not a prediction's batch wait
    t += 0.5
    b.take_all(_kind(t, **{**quiet, "c": (9, 0)}))  # c ran 9 at once: no cap of 8
    assert all(b.limit(n, shared=True) is None for n in "abcd")
    for _ in range(2 * int(KIND_MOST_STABLE_S)):
        t += 0.5
        b.take_all(_kind(t, **quiet))
        assert all(b.limit(n, shared=True) is None for n in "abcd")  # the queues were below 9
    grows = BatchLimits()
    for t, queue in ((1.0, {"a": (20, 3)}), (6.0, {"b": (26, 2)}), (11.0, {"a": (26, 1)}), (12.0, {})):
        grows.take_all(_kind(t, **{**quiet, **queue}))
    assert grows.limit("d", shared=True) is None  # 26 the most since 6.0: not yet
    for n in range(2 * int(KIND_MOST_STABLE_S)):
        grows.take_all(_kind(12.5 + 0.5 * n, **quiet))
    assert grows.limit("d", shared=True) == 26  # a and b's last queues were both at 26, since 6.0


def test_critical_requests_leave_an_engine_whose_shared_cap_makes_them_wait() -> None:
    """The prediction charges only a published cap's wait (ttft_predictor.slot_wait); a critical
    request's candidates also count the wait for a place at the cap engines of its kind showed:
    a warm engine with two ahead of a place (2 s at one place a second) is not within its objective
    (one mean prefill) of an idle one where it is a cold prefill (0.5 s)."""

    class Shared(IdleState):
        def batch(
            self, uid: str, published: bool = False, cap: bool = False, shared: bool = False
        ) -> tuple[float, float | None, float | None]:
            occupancy = {"warm": 9.0, "idle": 3.0}[uid]
            return occupancy, None if published else 8.0, 1.0

    warm, idle = Upstream("warm", "warm", None, 1.0), Upstream("idle", "idle", None, 1.0)
    adm = Admission(
        admission_settings({"enabled": True}),
        lambda model: (warm, idle),
        Shared(),  # type: ignore[arg-type]
        prefill=FixedBacklog(lambda u: (0.0, 0.3)),
    )
    req = request("critical")
    req.prepared = {"predicted-ttft": {"warm": 0.1, "idle": 0.5}}
    assert adm.placeable(req, (warm, idle)) == (idle,)
    req.prepared = {"predicted-ttft": {"warm": 0.1, "idle": 0.5}}
    adm.state = IdleState()  # type: ignore[assignment]
    assert adm.placeable(req, (warm, idle)) == (warm,)  # no cap known: warm is the soonest


def test_placement_keeps_places_only_by_a_cap_while_admission_counts_every_limit() -> None:
    """Standard requests kept off an engine whose learnt limit is its KV cache's went to engines
    without their prefix, whose caches then filled at fewer sequences: the limits fell with each
    move (the priorities grid at 120 %: 0.5x of admission off). The count admitted still keeps
    places by every limit."""

    class Learnt(IdleState):
        def batch(
            self, uid: str, published: bool = False, cap: bool = False, shared: bool = False
        ) -> tuple[float, float | None, float | None]:
            occupancy, limit, turnover = self.batches[uid]
            return occupancy, None if cap and uid == "kv" else limit, turnover

    ups = (Upstream("kv", "kv", None, 1.0), Upstream("seq", "seq", None, 1.0))
    batches = {"kv": (8.0, 8.0, 1.0), "seq": (8.0, 8.0, 1.0)}
    adm = Admission(
        admission_settings({"enabled": True}),
        lambda model: ups,
        Learnt(batches),  # type: ignore[arg-type]
        prefill=FixedBacklog(lambda u: (0.0, 0.1)),
    )
    assert adm.decide(request("standard")) is Verdict.QUEUE  # no room by either limit
    assert adm.placeable(request("standard"), ups) == (ups[0],)  # placed by the cap only
    batches["kv"] = (5.0, 8.0, 1.0)
    assert adm.decide(request("standard")) is Verdict.ADMIT


def test_a_full_batch_with_none_waiting_is_probed_one_place_at_a_time() -> None:
    b = BatchLimits()
    b.take("e", Snap(4, 1, 0.0, kv_cache_usage=1.0))
    t = 0.5
    while t <= PROBE_AFTER_S + 0.5:  # 3 running, a place below the limit, nobody waiting
        b.take("e", Snap(3, 0, t))
        t += 0.5
    assert b.limit("e") == 5
    b.take("e", Snap(1, 0, t))  # far below: no probing
    assert b.limit("e") == 5


def test_a_failed_probe_goes_back_at_once_and_the_next_waits_twice_as_long() -> None:
    b = BatchLimits()
    b.take("e", Snap(8, 2, 0.0, kv_cache_usage=1.0))
    t = 0.0

    def full_until_probed() -> float:
        nonlocal t
        start = t
        while b.limit("e") == 8:
            t += 0.5
            b.take("e", Snap(7, 0, t))
        return t - start

    first = full_until_probed()
    assert b.limit("e") == 9
    t += 0.5
    b.take("e", Snap(8, 1, t))  # the ninth request queued: 8 it is
    assert b.limit("e") == 8
    assert full_until_probed() >= 2 * first - 0.5
    t += 0.5
    b.take("e", Snap(9, 0, t))  # this time the ninth ran: probing is back to its first pace
    assert b.limit("e") == 9
    assert full_until_probed() <= first


def test_a_published_limit_holds_from_the_first_snapshot_and_a_wrong_one_is_dropped() -> None:
    b = BatchLimits()
    b.take("e", Snap(0, 0, 0.0, max_num_seqs=8))
    assert b.limit("e") == 8  # before any queue: a cold fleet's first seconds
    t = 0.0
    while t < 30.0:  # full with nobody waiting: nothing is tried beyond the published figure
        t += 0.5
        b.take("e", Snap(8, 0, t, max_num_seqs=8))
    assert b.limit("e") == 8
    b.take("e", Snap(6, 2, t + 0.5, kv_cache_usage=0.95, max_num_seqs=8))  # the KV cache fills first
    assert b.limit("e") == 6
    b.take("e", Snap(12, 0, t + 1.0, max_num_seqs=8))  # it runs 12: the figure was wrong
    b.take("e", Snap(12, 0, t + 1.5, max_num_seqs=8))
    assert b.limit("e") == 12  # learnt from now on, not reset to the wrong figure
    t += 1.5
    while t < 40.0:  # a new figure is trusted again: places up to it are tried
        t += 0.5
        b.take("e", Snap(12, 0, t, max_num_seqs=16))
    assert 12 < (b.limit("e") or 0) <= 16


def test_turnover_is_first_tokens_per_second_and_a_restart_forgets() -> None:
    b = BatchLimits()
    b.take("e", Snap(8, 1, 0.0, (None, 100.0, 5.0)))
    assert b.turnover("e") is None
    b.take("e", Snap(8, 1, 1.0, (None, 102.0, 5.0)))
    assert b.limit("e") == 8
    assert b.turnover("e") == pytest.approx(2.0)
    b.take("e", Snap(8, 1, 2.0, (None, 102.0, 5.0)))
    assert 1.0 < (b.turnover("e") or 0) < 2.0  # smoothed, not replaced
    b.take("e", Snap(0, 0, 3.0, (None, 0.0, 0.0), epoch=1))  # restarted
    assert b.limit("e") is None and b.turnover("e") is None
    b.take("e", Snap(8, 1, 3.5, (None, 0.0, 0.0), unknown=frozenset({"num_waiting"})))
    b.take("e", Snap(8, 1, 4.0, (None, 0.0, 0.0), unknown=frozenset({"num_waiting"})))
    assert b.limit("e") is None  # a figure filled in from the fleet says nothing of this engine


def test_slot_wait_counts_the_requests_beyond_the_limit_over_the_turnover() -> None:
    state: Any = IdleState({"a": (7.0, 8.0, 2.0), "b": (10.0, 8.0, 2.0), "c": (10.0, None, 2.0)})
    assert slot_wait(state, "a") == 0.0  # a place is free
    assert slot_wait(state, "a", extra=1) == pytest.approx(0.5)
    assert slot_wait(state, "b") == pytest.approx(1.5)  # three ahead of a place, it included
    assert slot_wait(state, "c") == 0.0  # no limit known

    class Learnt(IdleState):
        """A limit learnt from queues, not published (fleet/batch.py: maybe a prefill burst, a
        token budget under overload, or a full KV cache)."""

        def batch(
            self, uid: str, published: bool = False, cap: bool = False, shared: bool = False
        ) -> tuple[float, float | None, float | None]:
            return 10.0, None if published else 8.0, 2.0

    # Not charged as a batch wait (charged, the pressure grid's overload cells went from 1.5-1.8x
    # to 8-18x of the best peer), while admission keeps its places by it.
    assert slot_wait(Learnt(), "a") == 0.0
    # A cap engines of its kind showed is counted where asked (admission's critical placement).
    assert slot_wait(Learnt(), "a", shared=True) == pytest.approx(1.5)


def request(klass: str, model: str = "m") -> InferenceRequest:
    priority = {"critical": 1, "standard": 0, "sheddable": -1}[klass]
    return InferenceRequest(
        api="chat",  # type: ignore[arg-type]
        model=model,
        stream=False,
        max_tokens=4,
        prompt_text="hello",
        prompt_token_ids=None,
        session=None,
        user="u1",
        priority=priority,
        body_bytes=10,
    )


def admission(batches: dict[str, tuple[float, float | None, float | None]], **settings: Any) -> Admission:
    ups = tuple(Upstream(uid, uid, None, 1.0) for uid in batches)
    return Admission(
        admission_settings({"enabled": True, **settings}),
        lambda model: ups,
        IdleState(batches),  # type: ignore[arg-type]
        prefill=FixedBacklog(lambda u: (0.0, 0.1)),
    )


def test_standard_leaves_a_place_for_critical_and_sheddable_one_more() -> None:
    # One engine, batch limit 8, one request a second finishing: no critical traffic seen yet.
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (5.0, 8.0, 1.0)}
    adm = admission(batches)
    assert adm.decide(request("sheddable")) is Verdict.ADMIT  # 5 + 1 leaves two places
    batches["e"] = (6.0, 8.0, 1.0)
    with pytest.raises(RequestError) as info:
        adm.decide(request("sheddable"))
    assert info.value.status == 429
    assert adm.decide(request("standard")) is Verdict.ADMIT  # 6 + 1 leaves one for a critical
    batches["e"] = (7.0, 8.0, 1.0)
    assert adm.decide(request("standard")) is Verdict.QUEUE
    batches["e"] = (12.0, 8.0, 1.0)
    assert adm.decide(request("critical")) is Verdict.ADMIT  # never held back here
    batches["e"] = (2.0, None, None)
    assert adm.decide(request("sheddable")) is Verdict.ADMIT  # no limit known: no class rule


def test_no_sheddable_request_goes_in_while_standard_ones_wait() -> None:
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (8.0, 8.0, 1.0)}  # full
    adm = admission(batches)
    waiting = request("standard")
    assert adm.decide(waiting) is Verdict.QUEUE
    told: list[Any] = []
    adm.enqueue(waiting, told.append)
    batches["e"] = (2.0, 8.0, 1.0)  # a snapshot shows room, before any finish dispatched it
    with pytest.raises(RequestError):
        adm.decide(request("sheddable"))
    assert adm.dispatch("m") == 1 and told == [None]  # the room went to the standard request
    assert adm.decide(request("sheddable")) is Verdict.ADMIT  # and once none waits, sheddable goes


def test_the_critical_rate_is_not_underestimated_in_its_first_window() -> None:
    clock = [100.0]
    adm = admission({"e": (0.0, 8.0, 1.0)})
    adm.clock = lambda: clock[0]
    for _ in range(6):  # four critical requests a second for three seconds
        for _ in range(2):
            adm.decide(request("critical"))
        clock[0] += 0.5
    assert adm.critical_rate("m") == pytest.approx(4.0, rel=0.2)  # not the 1.1/s a 10 s window holds
    clock[0] += 60.0  # none since: it decays away
    assert adm.critical_rate("m") < 0.05


def test_more_critical_traffic_keeps_more_places() -> None:
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (6.0, 8.0, 1.0)}
    adm = admission(batches)
    clock = [0.0]
    adm.clock = lambda: clock[0]
    assert adm.decide(request("standard")) is Verdict.ADMIT
    for _ in range(10):  # one critical request a second over the rate window, at one engine
        adm.decide(request("critical"))
        clock[0] += 1.0
    assert adm.critical_rate("m") == pytest.approx(1.0, rel=0.15)
    assert adm.decide(request("standard")) is Verdict.QUEUE  # 1 + round(2 x 1 / 1) = 3 kept


def test_the_other_replicas_critical_traffic_keeps_places_too() -> None:
    """Behind N replicas each sees 1/N of the critical arrivals; the places are kept for all of them
    (the others' rates come through replica sync: `peer_critical_rate`)."""
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (6.0, 8.0, 1.0)}
    adm = admission(batches)
    assert adm.decide(request("standard")) is Verdict.ADMIT  # alone: 6 + 1 leaves one for a critical
    adm.peer_critical_rate = lambda model: 1.0 if model == "m" else 0.0  # one a second elsewhere
    assert adm.critical_rate("m") == 1.0
    assert adm.decide(request("standard")) is Verdict.QUEUE  # 1 + round(2 x 1 / 1) = 3 kept


def test_a_sheddable_request_is_shed_while_standard_ones_wait_at_another_replica() -> None:
    """Each replica queues its own standard requests; one with an empty queue would serve a
    sheddable request into the room they wait for. The others' waiters come through replica sync
    (`peer_waiting`), and this replica's queue changes are news for it (`on_queue_change`)."""
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (2.0, 8.0, 1.0)}  # room
    adm = admission(batches)
    waiting = {"m": 0}
    adm.peer_waiting = lambda model: waiting.get(model, 0)
    assert adm.decide(request("sheddable")) is Verdict.ADMIT
    waiting["m"] = 3
    with pytest.raises(RequestError) as info:
        adm.decide(request("sheddable"))
    assert info.value.status == 429
    assert adm.decide(request("standard")) is Verdict.ADMIT  # standard ones still go where there is room
    assert adm.decide(request("sheddable", model="other")) is Verdict.ADMIT  # another model's queue
    told: list[int] = []
    adm.on_queue_change = lambda: told.append(adm.queued)
    batches["e"] = (8.0, 8.0, 1.0)
    waiter = request("standard")
    assert adm.decide(waiter) is Verdict.QUEUE
    adm.enqueue(waiter, lambda err: None)
    assert adm.own_waiting() == {"m": 1} and told == [1]
    batches["e"] = (2.0, 8.0, 1.0)
    assert adm.dispatch("m") == 1 and adm.own_waiting() == {} and told == [1, 0]


def test_a_looser_critical_objective_lets_lower_classes_queue_at_the_engine() -> None:
    # Critical may wait 2 turnovers beyond the batch ("3x" of a 1 s unloaded TTFT, one a second).
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (8.0, 8.0, 1.0)}
    adm = admission(batches, objectives={"critical": "3x", "standard": "10x"})
    adm.prefill = FixedBacklog(lambda u: (0.0, 1.0))
    assert adm.decide(request("standard")) is Verdict.ADMIT
    batches["e"] = (9.0, 8.0, 1.0)
    assert adm.decide(request("standard")) is Verdict.QUEUE


def test_objectives_per_model_start_from_the_defaults_and_apply_to_that_model_only() -> None:
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (8.0, 8.0, 1.0)}
    adm = admission(batches, objectives={"standard": "10x", "models": {"batch-llm": {"critical": "3x"}}})
    adm.prefill = FixedBacklog(lambda u: (0.0, 1.0))
    objectives = adm.settings.objectives
    assert objectives.for_model("batch-llm").standard == Objective(factor=10.0)  # from the defaults above
    assert objectives.for_model("batch-llm").critical == Objective(factor=3.0)
    assert objectives.for_model("chat") is objectives and objectives.for_model(None) is objectives
    # a full batch: critical there may wait two turnovers for batch-llm, not at all for the others
    assert adm.decide(request("standard", model="batch-llm")) is Verdict.ADMIT
    assert adm.decide(request("standard", model="chat")) is Verdict.QUEUE


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"models": {"m": {"critical": "fast"}}}, r"admission.objectives.models.m.critical"),
        ({"models": {"m": {"vip": "1x"}}}, r"admission.objectives.models.m.*unknown"),
        ({"models": {"m": {"models": {}}}}, r"admission.objectives.models.m.*unknown"),
        ({"models": ["m"]}, r"admission.objectives.models"),
        ({"models": {"m": "2x"}}, r"admission.objectives.models.m"),
    ],
)
def test_bad_objectives_per_model_name_the_key(raw: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        admission_settings({"objectives": raw}, "admission")


def test_a_standard_request_past_its_own_objective_waits_in_the_router() -> None:
    # A best-effort critical class: only standard's own objective (1x: no wait) holds it back.
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (7.0, 8.0, 1.0)}
    adm = admission(batches, objectives={"critical": None, "standard": "1x"})
    assert adm.decide(request("standard")) is Verdict.ADMIT
    batches["e"] = (8.0, 8.0, 1.0)
    assert adm.decide(request("standard")) is Verdict.QUEUE


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1x", Objective(factor=1.0)),
        ("4x", Objective(factor=4.0)),
        ("500ms", Objective(seconds=0.5)),
        ("2s", Objective(seconds=2.0)),
        (1.5, Objective(seconds=1.5)),
        (None, Objective()),
        ("best-effort", Objective()),
    ],
)
def test_objective_values(raw: Any, expected: Objective) -> None:
    assert objective_value(raw, "x") == expected


@pytest.mark.parametrize("raw", ["0.5x", "fast", -1, 0, "0ms", True, [1]])
def test_bad_objectives_are_config_errors_naming_the_key(raw: Any) -> None:
    with pytest.raises(ConfigError, match=r"admission.objectives.critical"):
        admission_settings({"objectives": {"critical": raw}}, "admission")
    with pytest.raises(ConfigError, match="unknown"):
        admission_settings({"objectives": {"vip": "1x"}}, "admission")


def test_objective_budgets() -> None:
    assert Objective(factor=4.0).budget(0.5) == pytest.approx(1.5)
    assert Objective(seconds=2.0).budget(0.5) == pytest.approx(1.5)
    assert Objective(seconds=0.2).budget(0.5) == 0.0
    assert Objective().budget(0.5) is None


def test_past_capacity_the_classes_separate_and_goodput_holds_in_the_des() -> None:
    """Issue 33's shape in virtual time (small: 300 requests): engines with 8-sequence batches, at
    50 % and 200 % of their capacity. Without admission every class queues at the engines; with it
    critical requests keep their place, sheddable ones are shed first, and goodput holds; with the
    batch limit published (`max_num_seqs`) the cold start is separated too."""
    from extproc_lab.bench.priorities import row_stats
    from extproc_lab.discrete_event.class_objectives import (
        CELLS,
        CONFIGURED,
        NO_ADMISSION,
        OURS,
        Config,
        class_checks,
        markdown,
        run_row,
        workload,
    )

    cfg = Config(count=300)
    cell = CELLS["s6-a10g"]
    loads: dict[str, Any] = {}
    for load in (0.5, 2.0):
        wl = workload(cell, cfg, 7.5 * load)
        rows = {
            row: row_stats(row, run_row(cell, cfg, wl, row), wl.duration_s, cfg.slo, cfg.warmup)
            for row in (OURS, CONFIGURED, NO_ADMISSION, "round-robin")
        }
        loads[f"{load:g}"] = {"rate_rps": 7.5 * load, "window_s": wl.duration_s, "policies": rows}
    low, high = loads["0.5"]["policies"], loads["2"]["policies"]
    assert low[OURS]["ok"] == 300  # nothing shed at half the capacity
    ours, none = high[OURS], high[NO_ADMISSION]
    assert ours["goodput_rps"] > 1.5 * none["goodput_rps"], (ours["goodput_rps"], none["goodput_rps"])
    k = ours["classes"]
    assert k["critical"]["shed"] == 0 and k["sheddable"]["shed"] > 0
    assert k["critical"]["ttft_p50_ms"] < 0.1 * none["classes"]["critical"]["ttft_p50_ms"]
    assert k["critical"]["ttft_p50_ms"] < k["standard"]["ttft_p50_ms"]
    checks = class_checks(loads, OURS)
    assert checks["loads"]["2"]["critical_shed"] == 0 and checks["loads"]["2"]["sheddable_first"]
    assert checks["loads"]["2"]["goodput"] > checks["loads"]["2"]["best_peer_goodput"]
    configured = class_checks(loads, CONFIGURED)["loads"]["2"]
    # (a 300-request run: its p99 is the third-slowest of ~60 critical requests; x4.5 learnt, x1.6
    # with the limit published, on this seed)
    learnt = checks["loads"]["2"]["critical_p99_ratio"]
    assert configured["critical_p99_ratio"] < min(2.0, 0.4 * learnt), (configured, learnt)
    assert configured["critical_shed"] == 0
    result = {
        "config": {"count": 300, "seed": 0, "slo_ttft_s": 2.0, "admission": cfg.admission},
        "cells": {
            "s6-a10g": {
                "capacity_rps": 7.5,
                "capacity_by": "given",
                "loads": loads,
                "checks": {row: class_checks(loads, row) for row in (OURS, CONFIGURED, NO_ADMISSION)}
                | {"llm-extproc (+ engine priority)": checks},
            }
        },
    }
    assert "| s6-a10g | llm-extproc |" in markdown(result)


def test_a_route_sets_its_own_class_objectives_over_the_models() -> None:
    """`x-llm-objectives` route metadata: the route's standard requests are admitted under its own
    objectives (here a looser critical one, so they may take the place kept for critical requests);
    other routes keep the model's. Malformed values are left out at run time and reported by
    check-config."""
    from extproc.lifecycle.admission import RouteAdmission, route_admission, route_metadata_errors
    from extproc.settings import Objective

    route = route_admission([("x-llm-objectives", "critical=3x, standard=best-effort")])
    assert route == RouteAdmission(
        cap=None, objectives=(("critical", Objective(factor=3.0)), ("standard", Objective()))
    )
    # A full batch of 8, one request a second finishing, a 1 s unloaded TTFT.
    batches: dict[str, tuple[float, float | None, float | None]] = {"e": (8.0, 8.0, 1.0)}
    adm = admission(batches, objectives={"models": {"m": {"critical": "2x"}}})
    adm.prefill = FixedBacklog(lambda u: (0.0, 1.0))
    plain, looser = request("standard"), request("standard")
    route.apply(looser)
    assert adm.decide(plain) is Verdict.QUEUE  # the model's 2x: one place beyond, kept for critical
    assert adm.decide(looser) is Verdict.ADMIT  # the route's 3x: two beyond, one of them kept
    batches["e"] = (9.0, 8.0, 1.0)
    assert adm.decide(looser) is Verdict.QUEUE
    assert adm.objectives("m", looser.route_objectives).critical == Objective(factor=3.0)
    assert adm.objectives("m", looser.route_objectives).sheddable == Objective()  # the model's
    assert adm.objectives("other", ()).critical == Objective(factor=1.0)  # the top level's
    for bad in ("critical=fast", "urgent=2x", "critical=2x,critical=3x", "2x"):
        assert route_admission([("x-llm-objectives", bad)]) == RouteAdmission()  # logged, left out
        problem = route_metadata_errors("x-llm-objectives", bad)
        assert problem is not None and "x-llm-objectives" in problem
    assert route_metadata_errors("x-llm-objectives", "sheddable=30s") is None


def test_class_checks_of_a_run_without_a_peer_row() -> None:
    """`class_objectives_live --rows llm-extproc`: no peer ran, so the best peer is none (0, "-")."""
    from extproc_lab.bench.classes import OURS, class_checks

    def stats(good: float, p99: float) -> dict[str, Any]:
        classes = {
            "critical": {"ttft_p99_ms": p99, "ttft_p99_steady_ms": p99, "shed": 0},
            "standard": {"shed": 2},
            "sheddable": {"shed": 5},
        }
        return {"goodput_rps": good, "classes": classes}

    loads = {
        "0.5": {"policies": {OURS: stats(3.0, 100.0)}},
        "2": {"policies": {OURS: stats(6.0, 300.0)}},
    }
    at_2x = class_checks(loads, OURS)["loads"]["2"]
    assert (at_2x["best_peer"], at_2x["best_peer_goodput"]) == ("-", 0.0)
    assert at_2x["critical_p99_ratio"] == pytest.approx(3.0) and at_2x["sheddable_first"]


def test_the_class_bench_runs_under_other_objectives_and_rejects_bad_ones() -> None:
    """`--objectives` (the trade of critical latency for goodput, docs/tuning.md): pairs as a route's
    `x-llm-objectives` over the shipped admission; a malformed one is a usage error, not a run."""
    from extproc_lab.discrete_event.class_objectives import SHIPPED_ADMISSION, main, with_objectives

    got = with_objectives(SHIPPED_ADMISSION, "critical=300ms, Standard=best-effort")
    assert got == {**SHIPPED_ADMISSION, "objectives": {"critical": "300ms", "standard": "best-effort"}}
    assert admission_settings(got).objectives.critical == objective_value("300ms", "t")
    assert "objectives" not in SHIPPED_ADMISSION  # not changed in place
    with pytest.raises(SystemExit):
        main(["--objectives", "critical=fast", "--loads", "0.5", "--count", "10"])
    with pytest.raises(SystemExit):
        main(["--objectives", "critical=1x,critical=2x", "--loads", "0.5", "--count", "10"])


def test_the_class_bench_runs_its_own_rows_once() -> None:
    """`--rows llm-extproc` (no peers, as the notes' commands use it) must not run llm-extproc twice."""
    from extproc_lab.discrete_event.class_objectives import OURS, Config, rows

    cfg = Config()
    cfg.references = (OURS, "round-robin")
    got = rows(cfg)
    assert got.count(OURS) == 1 and got[-1] == "round-robin" and len(got) == 5


def test_a_limits_source_says_what_admission_counts_on() -> None:
    """`BatchLimits.source` (exported as `llm_extproc_batch_limit{source}`): published, a learnt
    sequence cap, a queue that bounds admission only, or none."""
    b = BatchLimits()
    assert b.source("e") == (None, "none")
    b.take("e", Snap(3, 0, 1.0))
    assert b.source("e") == (None, "none")
    b.take("e", Snap(5, 2, 1.5))
    assert b.source("e") == (5, "queue")
    b.take("e", Snap(5, 2, 2.0))
    assert b.source("e") == (5, "sequence_cap")
    b.take("p", Snap(2, 0, 2.5, max_num_seqs=8))
    assert b.source("p") == (8, "published")


def test_the_class_benches_refuse_fewer_than_one_replica() -> None:
    from extproc_lab.bench.class_objectives_live import main as live_main
    from extproc_lab.discrete_event.class_objectives import main

    for run in (main, live_main):
        with pytest.raises(SystemExit):
            run(["--replicas", "0", "--loads", "0.5", "--count", "10"])
