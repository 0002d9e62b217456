"""Admission control without Envoy: priority classes, the saturation signal (with and without
snapshots), the fair queue, timeouts, cancellation, and the slo-ttft and slo-tpot filters, through the real
RequestLifecycle (real pool, in-flight accounting, fleet view and metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from builders import NOW, FixedBacklog, IdleState, instance_state

from extproc.config import config_from_dict
from extproc.fleet import FleetView
from extproc.lifecycle import Decision, RequestLifecycle
from extproc.lifecycle.admission import (
    NO_ROUTE,
    FairQueue,
    PriorityClass,
    RouteAdmission,
    Waiter,
    priority_class,
    route_admission,
)
from extproc.openai import InferenceRequest, RequestError
from extproc.openai.parse import parse_head
from extproc.settings import ConfigError, admission_settings
from extproc.telemetry import Metrics

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def lifecycle(admission: dict[str, Any] | None = None, view: bool = False, **extra: Any) -> RequestLifecycle:
    raw: dict[str, Any] = {
        "pool": {"clusters": [{"name": "a", "models": ["m"]}, {"name": "b", "models": ["m"]}]},
        "metrics_listen": None,
        "scheduling": {"profiles": {"default": {"scorers": ["least-outstanding"]}}},
        **extra,
    }
    if admission is not None:
        raw["admission"] = {"enabled": True, **admission}  # opt-in (off by default)
    cfg = config_from_dict(raw)
    fleet = FleetView(cfg.pool, clock=lambda: NOW) if view else None
    return RequestLifecycle(cfg, Metrics(["m"], ["a", "b"]), fleet)


def head(
    priority: str | None = None, user: str | None = None, slo: str | None = None, tpot: str | None = None
) -> Any:
    headers = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    if priority is not None:
        headers["x-llm-priority"] = priority
    if user is not None:
        headers["x-user-id"] = user
    if slo is not None:
        headers["x-llm-ttft-slo-ms"] = slo
    if tpot is not None:
        headers["x-llm-tpot-slo-ms"] = tpot
    return parse_head(
        headers,
        session_header="x-session-id",
        user_header="x-user-id",
        priority_header="x-llm-priority",
        ttft_slo_header="x-llm-ttft-slo-ms",
        tpot_slo_header="x-llm-tpot-slo-ms",
    )


BODY = orjson.dumps(CHAT)


def count(lc: RequestLifecycle, klass: str, decision: str, reason: str) -> float:
    value = lc.metrics.registry.get_sample_value(
        "llm_extproc_admission_total", {"priority": klass, "decision": decision, "reason": reason}
    )
    return value or 0.0


async def route(lc: RequestLifecycle, priority: str | None = None, **kw: Any) -> Decision:
    return await lc.route_async(head(priority, **kw), BODY)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- classes and route settings ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "klass"),
    [
        (5, PriorityClass.CRITICAL),
        (1, PriorityClass.CRITICAL),
        (0, PriorityClass.STANDARD),
        (-1, PriorityClass.SHEDDABLE),
    ],
)
def test_priority_class(value: int, klass: PriorityClass) -> None:
    assert priority_class(value) is klass


@pytest.mark.parametrize(("raw", "value"), [("critical", 1), ("Sheddable", -1), ("standard", 0), ("-3", -3)])
def test_priority_header_accepts_class_names(raw: str, value: int) -> None:
    assert head(raw).priority == value


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "nan", "inf", "3600001"])
@pytest.mark.parametrize("which", ["slo", "tpot"])
def test_bad_slo_header_is_400(raw: str, which: str) -> None:
    with pytest.raises(RequestError) as info:
        head(**{which: raw})
    name = "x-llm-ttft-slo-ms" if which == "slo" else "x-llm-tpot-slo-ms"
    assert (info.value.status, info.value.param) == (400, name)
    assert name in info.value.message


def test_slo_headers_are_read() -> None:
    h = head(slo="250", tpot=" 80.5 ")
    assert (h.ttft_slo_ms, h.tpot_slo_ms) == (250.0, 80.5)
    assert (head().ttft_slo_ms, head().tpot_slo_ms) == (None, None)


def test_route_metadata_fixes_caps_and_defaults() -> None:
    fixed = route_admission([("x-llm-priority", b"sheddable"), ("x-llm-profile", "p")])
    capped = route_admission([("x-llm-max-priority", "standard"), ("x-llm-ttft-slo-ms", "800")])
    assert fixed == RouteAdmission(fixed=-1)
    assert capped == RouteAdmission(cap=0, ttft_slo_ms=800.0)
    assert route_admission([("x-llm-profile", "p")]) is NO_ROUTE
    assert route_admission([("x-llm-priority", "urgent!"), ("x-llm-ttft-slo-ms", "-1")]) == RouteAdmission()
    decode = route_admission([("x-llm-tpot-slo-ms", "75")])
    assert decode == RouteAdmission(tpot_slo_ms=75.0)
    assert route_admission([("x-llm-tpot-slo-ms", "fast")]) == RouteAdmission()  # logged, ignored
    # The service's cap for clients (admission.client_max_priority) applies where a route sets none;
    # a route's own cap replaces it (up or down); a misspelt cap fails closed, at sheddable.
    assert route_admission([], client_cap=0) == RouteAdmission(cap=0)
    assert route_admission([("x-llm-profile", "p")], client_cap=0) is route_admission([], client_cap=0)
    assert route_admission([("x-llm-max-priority", "critical")], client_cap=0) == RouteAdmission(cap=1)
    assert route_admission([("x-llm-max-priority", "urgent")], client_cap=0) == RouteAdmission(cap=-1)
    assert route_admission([("x-llm-priority", "urgent")], client_cap=0) == RouteAdmission(cap=0)

    lc = lifecycle()
    req = lc.prepare(head("critical"), BODY, fixed)
    assert req.priority == -1  # the client cannot raise a fixed class
    req = lc.prepare(head("critical", slo="100"), BODY, capped)
    assert (req.priority, req.ttft_slo_ms) == (0, 100.0)  # capped; the client's own objective wins
    req = lc.prepare(head("sheddable"), BODY, capped)
    assert (req.priority, req.ttft_slo_ms) == (-1, 800.0)  # a lower class is kept; route's objective
    assert lc.prepare(head(), BODY, decode).tpot_slo_ms == 75.0  # the route's TPOT objective
    assert lc.prepare(head(tpot="40"), BODY, decode).tpot_slo_ms == 40.0  # the client's wins


# -- the fair queue ----------------------------------------------------------------------------------
def waiter(tenant: str, n: int) -> Waiter:
    return Waiter("m", tenant, PriorityClass.STANDARD, float(n), lambda err: None)


def test_fair_queue_round_robin_across_tenants() -> None:
    q = FairQueue()
    items = [waiter("a", 1), waiter("a", 2), waiter("a", 3), waiter("b", 4), waiter("c", 5), waiter("c", 6)]
    for w in items:
        q.push(w)
    order = []
    while (w := q.pop()) is not None:
        order.append((w.tenant, int(w.since)))
    assert order == [("a", 1), ("b", 4), ("c", 5), ("a", 2), ("c", 6), ("a", 3)]
    assert len(q) == 0


def test_fair_queue_remove() -> None:
    q = FairQueue()
    a, b, c = waiter("a", 1), waiter("b", 2), waiter("a", 3)
    for w in (a, b, c):
        q.push(w)
    assert q.remove(b) and not q.remove(b)
    assert len(q) == 2 and "b" not in q.tenants
    assert [q.pop(), q.pop(), q.pop()] == [a, c, None]


def test_fair_queue_newest_first_and_older_than() -> None:
    q = FairQueue()
    a1, a2, b3, a4 = waiter("a", 1), waiter("a", 2), waiter("b", 3), waiter("a", 4)
    for w in (a1, a2, b3, a4):
        q.push(w)
    assert q.pop(newest=True) is a4  # a's turn, its newest; then b's
    assert q.older_than(2.5) == [a1, a2]  # each tenant's oldest first, the round keeps b
    assert len(q) == 1 and "a" not in q.tenants
    assert q.older_than(2.5) == []
    assert q.pop(newest=True) is b3 and q.pop() is None


# -- admission through the lifecycle (own in-flight counts: no snapshots) ----------------------------
async def test_saturation_sheds_sheddable_queues_standard_admits_critical() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 5})
    first, second = await route(lc), await route(lc)  # one per cluster: now saturated
    with pytest.raises(RequestError) as info:
        await route(lc, "sheddable")
    err = info.value
    assert (err.status, err.code, err.retry_after) == (429, "saturated", 1)
    assert orjson.loads(err.body())["error"]["type"] == "rate_limit_error"

    queued = asyncio.create_task(route(lc, "standard"))
    await settle()
    assert not queued.done() and lc.admission.queued == 1
    critical = await route(lc, "critical")  # over the threshold, ahead of the queue
    with pytest.raises(RequestError):
        await route(lc, "sheddable")  # still shed while someone waits

    lc.finish(critical, "response_end")  # frees room only back to the cap (2 in flight): no grant
    await settle()
    assert not queued.done()
    lc.finish(first, "response_end")
    decision = await asyncio.wait_for(queued, 1)
    assert decision.upstream.cluster == first.upstream.cluster
    assert lc.admission.queued == 0
    assert count(lc, "standard", "queued", "saturated") == 1
    assert count(lc, "standard", "admitted", "dequeued") == 1
    assert count(lc, "critical", "admitted", "critical") == 1
    assert count(lc, "sheddable", "shed", "saturated") == 2
    assert (
        lc.metrics.registry.get_sample_value(
            "llm_extproc_admission_queue_wait_seconds_count", {"outcome": "admitted"}
        )
        == 1
    )
    lc.finish(second, "response_end")
    lc.finish(decision, "response_end")


async def test_queue_is_fair_across_tenants() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 5})
    held = [await route(lc), await route(lc)]
    order: list[str] = []

    async def one(user: str) -> Decision:
        d = await route(lc, user=user)
        order.append(user)
        return d

    tasks = []
    for user in ("alice", "alice", "alice", "bob"):  # alice floods first, bob arrives last
        tasks.append(asyncio.create_task(one(user)))
        await settle()
    assert lc.admission.queued == 4
    for _ in range(4):
        lc.finish(held.pop(0), "response_end")
        await settle()
        held.extend(t.result() for t in tasks if t.done() and t.result() not in held)
    assert order == ["alice", "bob", "alice", "alice"]


async def test_queue_timeout_is_429_and_bounded_queue() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 0.05, "max_queued": 1, "retry_after_s": 3})
    await route(lc)
    await route(lc)
    waiting = asyncio.create_task(route(lc))
    await settle()
    with pytest.raises(RequestError) as full:
        await route(lc)
    assert (full.value.status, full.value.code, full.value.retry_after) == (429, "queue_full", 3)
    with pytest.raises(RequestError) as late:
        await waiting
    assert (late.value.status, late.value.code) == (429, "queue_timeout")
    assert lc.admission.queued == 0
    assert count(lc, "standard", "shed", "queue_timeout") == 1
    assert count(lc, "standard", "shed", "queue_full") == 1


async def test_an_overloaded_queue_serves_newest_first_and_sheds_the_stale() -> None:
    """Once the queue has stayed non-empty for `overload_after_s`, arrivals outpace capacity: a FIFO
    queue would then only hand out requests that already waited ~max_wait_s (late for any TTFT
    objective). Served newest first, with waiters older than `overload_wait_s` shed at once, an
    admitted request has waited little and the others learn it early."""
    now = [0.0]
    lc = lifecycle(
        {"max_inflight_per_weight": 1, "max_wait_s": 5, "overload_after_s": 0.5, "overload_wait_s": 0.2}
    )
    lc.admission.clock = lambda: now[0]
    held = [await route(lc), await route(lc)]  # one per cluster: saturated
    stale = asyncio.create_task(route(lc, user="u"))
    await settle()
    now[0] = 0.3  # busy 0.3 s: a burst still, FIFO
    assert not lc.admission.overloaded("m")
    older = asyncio.create_task(route(lc, user="u"))
    await settle()
    now[0] = 0.6  # busy 0.6 s: overloaded; `stale` (0.6 s) and `older` (0.3 s) are past 0.2 s
    fresh = asyncio.create_task(route(lc, user="u"))
    await settle()
    assert lc.admission.overloaded("m")
    for task in (stale, older):
        with pytest.raises(RequestError) as info:
            await task
        assert (info.value.status, info.value.code) == (429, "queue_timeout")
        assert "overloaded" in info.value.message
    assert lc.admission.queued == 1 and count(lc, "standard", "shed", "queue_timeout") == 2
    now[0] = 0.65
    newest = asyncio.create_task(route(lc, user="u"))
    await settle()
    lc.finish(held.pop(0), "response_end")  # one grant: the newest waiter, not the oldest
    assert (await asyncio.wait_for(newest, 1)).request.user == "u"
    assert not fresh.done() and lc.admission.queued == 1
    lc.finish(held.pop(0), "response_end")
    await asyncio.wait_for(fresh, 1)
    assert lc.admission.queued == 0 and not lc.admission.overloaded("m")  # empty: the mode resets


async def test_a_burst_shorter_than_overload_after_s_stays_fifo() -> None:
    now = [0.0]
    lc = lifecycle(
        {"max_inflight_per_weight": 1, "max_wait_s": 5, "overload_after_s": 1.0, "overload_wait_s": 0.1}
    )
    lc.admission.clock = lambda: now[0]
    held = [await route(lc), await route(lc)]
    first = asyncio.create_task(route(lc, user="first"))
    await settle()
    now[0] = 0.5  # `first` waited past overload_wait_s, but the queue has been busy 0.5 s only
    second = asyncio.create_task(route(lc, user="second"))
    await settle()
    lc.finish(held.pop(0), "response_end")
    assert (await asyncio.wait_for(first, 1)).request.user == "first"
    assert not second.done()
    lc.finish(held.pop(0), "response_end")
    await asyncio.wait_for(second, 1)


async def test_overload_mode_off_keeps_fifo_up_to_max_wait() -> None:
    now = [0.0]
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 5, "overload_wait_s": None})
    lc.admission.clock = lambda: now[0]
    held = [await route(lc), await route(lc)]
    first = asyncio.create_task(route(lc, user="a"))
    await settle()
    now[0] = 3.0
    second = asyncio.create_task(route(lc, user="a"))
    await settle()
    assert not lc.admission.overloaded("m") and lc.admission.queued == 2
    lc.finish(held.pop(0), "response_end")
    await asyncio.wait_for(first, 1)
    assert not second.done()
    lc.finish(held.pop(0), "response_end")
    await asyncio.wait_for(second, 1)


async def test_client_gone_while_queued_leaves_the_queue() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 5})
    first = await route(lc)
    await route(lc)
    gone = asyncio.create_task(route(lc, user="gone"))
    await settle()
    stays = asyncio.create_task(route(lc, user="stays"))
    await settle()
    gone.cancel()
    await settle()
    assert gone.cancelled() and lc.admission.queued == 1
    assert count(lc, "standard", "abandoned", "client_gone") == 1
    lc.finish(first, "response_end")
    assert (await asyncio.wait_for(stays, 1)).request.user == "stays"


async def test_a_grant_whose_client_left_passes_to_the_next() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 5})
    first = await route(lc)
    await route(lc)
    a = asyncio.create_task(route(lc, user="a"))
    await settle()
    b = asyncio.create_task(route(lc, user="b"))
    await settle()
    lc.finish(first, "response_end")  # grants a; a's client goes away before it runs
    a.cancel()
    await settle()
    assert a.cancelled()
    assert (await asyncio.wait_for(b, 1)).request.user == "b"
    assert lc.admission.queued == 0


def test_sync_route_cannot_wait_so_refuses() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1})
    lc.route(head(), BODY)
    lc.route(head(), BODY)
    with pytest.raises(RequestError) as info:
        lc.route(head(), BODY)
    assert (info.value.status, info.value.code) == (429, "saturated")
    lc.route(head("critical"), BODY)


async def test_disabled_admits_everything() -> None:
    lc = lifecycle({"enabled": False, "max_inflight_per_weight": 1})
    for _ in range(4):
        await route(lc, "sheddable")


# -- the signal from snapshots ---------------------------------------------------------------------
_sequence = iter(range(1, 1_000_000))


def publish(
    lc: RequestLifecycle,
    waiting: int,
    kv: float = 0.0,
    tpot: float | None = None,
    ago: float = 0.0,
    running: int = 0,
) -> None:
    assert lc.view is not None
    seq = next(_sequence)
    for cluster in ("a", "b"):
        state = instance_state(
            f"{cluster}/x",
            cluster,
            None,
            num_waiting=waiting,
            num_running=running,
            kv_cache_usage=kv,
            tpot_s=tpot,
            sequence=seq,
            published_at=NOW - ago,
            expires_at=NOW - ago + 3.0,
        )
        assert lc.view.apply(state)
    lc.view.rebuild()


async def test_snapshot_queue_depth_is_the_signal() -> None:
    lc = lifecycle({"max_waiting_per_weight": 8, "max_kv_usage": 0.95}, view=True)
    publish(lc, waiting=8)  # every engine reports 8 waiting per unit weight
    with pytest.raises(RequestError):
        await route(lc, "sheddable")
    publish(lc, waiting=3)
    decisions = [await route(lc, "sheddable") for _ in range(10)]  # 5 of headroom each
    with pytest.raises(RequestError):
        await route(lc, "sheddable")  # what was sent since the snapshot counts as queued
    for d in decisions:
        lc.finish(d, "response_end")
    publish(lc, waiting=0, kv=0.97)  # empty queues, but KV cache full
    with pytest.raises(RequestError):
        await route(lc, "sheddable")


async def test_decode_speed_is_a_signal_smoothed_over_the_window() -> None:
    """`max_tpot_s`: an engine whose time per output token reaches `tpot_margin` (0.9) of the
    objective takes no more (sheddable shed). One interval slowed by a long prefill step does not
    close it, a lasting slowdown does; an interval without a token keeps what was known while
    sequences run there, and forgets it once the engine is idle (else a drained fleet would stay
    closed)."""
    lc = lifecycle({"max_tpot_s": 0.1, "tpot_window_s": 5.0}, view=True)
    publish(lc, waiting=0, tpot=0.05, ago=2.5, running=20)
    lc.finish(await route(lc, "sheddable"), "response_end")
    publish(lc, waiting=0, tpot=0.4, ago=2.0, running=20)  # 0.05 + (1 - e^-0.1) x 0.35 = 0.083
    lc.finish(await route(lc, "sheddable"), "response_end")
    publish(lc, waiting=0, tpot=0.3, ago=0.5, running=20)  # 0.083 + (1 - e^-0.3) x 0.217 = 0.139
    with pytest.raises(RequestError) as shed:
        await route(lc, "sheddable")
    assert shed.value.status == 429
    assert count(lc, "sheddable", "shed", "saturated") == 1
    publish(lc, waiting=0, tpot=None, ago=0.25, running=20)  # a step longer than the interval
    with pytest.raises(RequestError):
        await route(lc, "sheddable")
    lc.finish(await route(lc, "critical"), "response_end")  # critical: admitted anyway
    publish(lc, waiting=0, tpot=None, ago=0.0, running=0)  # drained: idle
    lc.finish(await route(lc, "sheddable"), "response_end")
    off = lifecycle({}, view=True)  # the same snapshots without the setting: not a signal
    publish(off, waiting=0, tpot=0.3)
    off.finish(await route(off, "sheddable"), "response_end")


@pytest.mark.parametrize(("margin", "admitted"), [(None, False), (1.0, True)])
async def test_the_tpot_gate_closes_short_of_the_objective(margin: float | None, admitted: bool) -> None:
    """Decoding at 95 ms against a 100 ms objective: under it, but past the default margin (0.9),
    so the gate is closed; `tpot_margin: 1.0` gates at the objective itself."""
    extra = {} if margin is None else {"tpot_margin": margin}
    lc = lifecycle({"max_tpot_s": 0.1, "tpot_window_s": 5.0, **extra}, view=True)
    publish(lc, waiting=0, tpot=0.095, running=20)
    if admitted:
        lc.finish(await route(lc, "sheddable"), "response_end")
    else:
        with pytest.raises(RequestError):
            await route(lc, "sheddable")


# -- slo-ttft ----------------------------------------------------------------------------------------
def slo_lifecycle() -> RequestLifecycle:
    return lifecycle(
        scheduling={
            "profiles": {
                "default": {
                    "filters": ["slo-ttft"],
                    "scorers": [{"name": "predicted-ttft", "params": {"prefill_tokens_per_s": 1000}}],
                }
            }
        }
    )


async def test_slo_ttft_sheds_only_requests_that_opted_in() -> None:
    lc = slo_lifecycle()
    long_prompt = dict(CHAT, messages=[{"role": "user", "content": "word " * 4000}])  # ~5k tokens: ~5 s
    body = orjson.dumps(long_prompt)
    with pytest.raises(RequestError) as info:
        await lc.route_async(head(slo="500"), body)
    err = info.value
    assert (err.status, err.code, err.retry_after) == (429, "slo_unattainable", 1)
    assert "500 ms" in err.message
    assert count(lc, "standard", "shed", "slo_unattainable") == 1
    assert await lc.route_async(head(slo="60000"), body)  # a reachable objective: routed
    assert await lc.route_async(head(), body)  # no objective: never shed for it
    assert await lc.route_async(head(slo="500"), BODY)  # a short prompt meets 500 ms


async def test_slo_ttft_keeps_only_candidates_that_meet_it() -> None:
    lc = slo_lifecycle()
    long_prompt = orjson.dumps(dict(CHAT, messages=[{"role": "user", "content": "word " * 1500}]))
    busy = await lc.route_async(head(), long_prompt)  # ~2 s of prefill queued on one cluster
    for _ in range(5):
        d = await lc.route_async(head(slo="1000"), BODY)
        assert d.upstream.cluster != busy.upstream.cluster
        lc.finish(d, "response_end")


def test_slo_ttft_needs_predicted_ttft() -> None:
    with pytest.raises(ConfigError, match="predicted-ttft"):
        lifecycle(scheduling={"profiles": {"default": {"filters": ["slo-ttft"], "scorers": ["queue-depth"]}}})


# -- slo-tpot ----------------------------------------------------------------------------------------
def publish_tpot(
    lc: RequestLifecycle, tpots: dict[str, float | None], running: int = 4, at: float = 0.0
) -> None:
    """One snapshot per cluster with its own TPOT (seconds; None: no figure reported), published
    `at` seconds after NOW."""
    assert lc.view is not None
    seq = next(_sequence)
    for cluster, tpot in tpots.items():
        state = instance_state(
            f"{cluster}/x",
            cluster,
            None,
            num_waiting=0,
            num_running=running,
            tpot_s=tpot,
            sequence=seq,
            published_at=NOW + at,
            expires_at=NOW + at + 3.0,
        )
        assert lc.view.apply(state)
    lc.view.rebuild()


def tpot_lifecycle(scorers: list[Any] | None = None) -> RequestLifecycle:
    profile = {"filters": ["slo-tpot"], "scorers": scorers or ["least-outstanding"]}
    return lifecycle(view=True, scheduling={"profiles": {"default": profile}})


async def test_slo_tpot_does_not_narrow_and_decode_speed_steers() -> None:
    """While one upstream decodes within the objective, the filter routes as usual (it never
    narrows: measured, notebook/benchmarks-history.md, "TPOT objectives per request"); `decode-speed`,
    reading the request's objective, steers."""
    lc = tpot_lifecycle()  # no decode-speed: least-outstanding alone decides
    publish_tpot(lc, {"a": 0.15, "b": 0.05})
    clusters = {(await lc.route_async(head(tpot="100"), BODY)).upstream.cluster for _ in range(6)}
    assert clusters == {"a", "b"}  # held requests alternate: not restricted to b
    steered = tpot_lifecycle(["least-outstanding", {"name": "decode-speed", "weight": 2.0}])
    publish_tpot(steered, {"a": 0.15, "b": 0.05})
    clusters = {(await steered.route_async(head(tpot="100"), BODY)).upstream.cluster for _ in range(6)}
    assert clusters == {"b"}
    plain = {(await steered.route_async(head(), BODY)).upstream.cluster for _ in range(6)}
    assert plain == {"a"}  # no objective: decode-speed adds nothing (a has fewer in flight)


async def test_slo_tpot_sheds_when_no_upstream_decodes_fast_enough() -> None:
    lc = tpot_lifecycle()
    publish_tpot(lc, {"a": 0.15, "b": 0.12})
    for priority in ("critical", "standard"):  # an objective it set itself: any class
        with pytest.raises(RequestError) as info:
            await lc.route_async(head(priority, tpot="100"), BODY)
        err = info.value
        assert (err.status, err.code, err.retry_after) == (429, "slo_unattainable", 1)
        assert "time per output token of 100 ms; the best predicted is 120 ms" in err.message
        assert "(the limit is 0.9 x the objective: 90 ms)" in err.message
    assert count(lc, "critical", "shed", "slo_unattainable") == 1
    assert count(lc, "standard", "shed", "slo_unattainable") == 1
    assert await lc.route_async(head(), BODY)  # no objective: routed
    assert await lc.route_async(head(tpot="140"), BODY)  # b within 0.9 x 140 ms (the margin)
    with pytest.raises(RequestError):
        await lc.route_async(head(tpot="130"), BODY)  # within 130 ms, not within 0.9 x 130
    publish_tpot(lc, {"a": 0.15, "b": None}, running=0, at=0.5)  # b drained: idle, nothing says it is slow
    assert await lc.route_async(head(tpot="100"), BODY)


async def test_slo_tpot_smooths_the_engines_figure() -> None:
    """One slow interval does not close an upstream that decoded fast before it (the same smoothing
    as admission's TPOT gate: over `window_s`, 2 s by default)."""
    lc = tpot_lifecycle()
    publish_tpot(lc, {"a": 0.15, "b": 0.05})
    assert await lc.route_async(head(tpot="100"), BODY)
    publish_tpot(lc, {"a": 0.15, "b": 0.3}, at=0.5)  # b: one 0.5 s interval at 300 ms
    # smoothed: 0.05 + (1 - exp(-0.25)) x 0.25 = 0.105 s: over 0.9 x 100 ms, under 0.9 x 120 ms
    assert await lc.route_async(head(tpot="120"), BODY)
    with pytest.raises(RequestError):
        await lc.route_async(head(tpot="100"), BODY)


async def test_slo_tpot_takes_in_every_candidates_snapshots() -> None:
    """b's slow spell counts even while a, read first, was within the objective: every candidate's
    figure is read on every decision (smoothing only takes in the snapshots it reads)."""
    lc = tpot_lifecycle()
    publish_tpot(lc, {"a": 0.05, "b": 0.3})
    assert await lc.route_async(head(tpot="100"), BODY)
    publish_tpot(lc, {"a": 0.05, "b": 0.3}, at=0.5)
    assert await lc.route_async(head(tpot="100"), BODY)
    publish_tpot(lc, {"a": 0.6, "b": 0.08}, at=1.0)
    # a: 0.05 + (1 - exp(-0.25)) x 0.55 = 0.17 s; b: 0.3 + (1 - exp(-0.25)) x (0.08 - 0.3) = 0.25 s
    # (read afresh, b would be 0.08 s: within)
    with pytest.raises(RequestError) as info:
        await lc.route_async(head(tpot="100"), BODY)
    assert "the best predicted is" in info.value.message


@pytest.mark.parametrize("params", [{"margin": 0}, {"window_s": 0}, {"retry_after_s": 0}, {"speed": 1}])
def test_slo_tpot_bad_params(params: dict[str, Any]) -> None:
    profile = {"filters": [{"name": "slo-tpot", "params": params}], "scorers": ["least-outstanding"]}
    with pytest.raises(ConfigError, match="slo-tpot"):
        lifecycle(scheduling={"profiles": {"default": profile}})


# -- configuration -----------------------------------------------------------------------------------
def test_admission_settings_defaults_and_errors() -> None:
    s = admission_settings(None)
    assert not s.enabled  # opt-in: it turns saturation into 429s
    assert s.max_wait_s < 2.0  # below Envoy's 2 s ext_proc message_timeout
    assert admission_settings({"enabled": True}).enabled
    assert admission_settings({"max_kv_usage": 0.9, "max_queued": 0}).max_queued == 0
    assert s.overload_wait_s is not None and s.overload_wait_s < s.max_wait_s
    assert admission_settings({"overload_wait_s": None}).overload_wait_s is None
    for bad in (
        {"max_wait_s": 0},
        {"max_queued": -1},
        {"enabled": "yes"},
        {"max_kv_usage": 1.5},
        {"max_tpot_s": 0},
        {"tpot_window_s": 0},
        {"tpot_margin": 0},
        {"tpot_margin": 1.5},
        {"retry_after_s": 0},
        {"overload_wait_s": 0},
        {"overload_after_s": -1},
        {"max_wait": 1},
    ):
        with pytest.raises(ConfigError):
            admission_settings(bad)


async def test_predicted_prefill_queue_is_a_signal_without_snapshots() -> None:
    lc = lifecycle(
        {"max_predicted_wait_s": 1.0},
        scheduling={
            "profiles": {
                "default": {"scorers": [{"name": "predicted-ttft", "params": {"prefill_tokens_per_s": 1000}}]}
            }
        },
    )
    for word in ("alpha ", "beta "):  # ~2 s of prefill queued on one upstream, then on the other
        prompt = orjson.dumps(dict(CHAT, messages=[{"role": "user", "content": word * 1500}]))
        await lc.route_async(head("sheddable"), prompt)
    with pytest.raises(RequestError) as info:
        await lc.route_async(head("sheddable"), BODY)
    assert info.value.code == "saturated"
    assert await lc.route_async(head("critical"), BODY)


# -- the discrete-event mode drives the same Admission in virtual time -------------------------------
def test_des_admission_sheds_sheddable_first_and_counts_queue_time() -> None:
    from extproc_lab.bench.workloads import make_workload, with_priorities
    from extproc_lab.discrete_event.simulation import simulate
    from extproc_lab.engines.profiles import PROFILES

    wl = with_priorities(make_workload("shared-prefix", rate=8.0, count=300, seed=1, tenants=4), seed=1)
    assert [h["x-llm-priority"] for h in wl.headers] == [t.split("/")[0] for t in wl.tags()]
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    profiles = [PROFILES["a10g-llama3-8b"]] * 2
    service = {"admission": {"enabled": True, "max_inflight_per_weight": 8, "max_wait_s": 1.5}}
    run = simulate(requests, profiles, "llm-extproc", service=service, headers=wl.headers)
    by_class: dict[str, list[Any]] = {}
    for r in run.records:
        by_class.setdefault(r.tag.split("/")[0], []).append(r)
    shed = {k: [r for r in v if r.status == 429] for k, v in by_class.items()}
    assert len(run.records) == 300
    assert shed["sheddable"] and not shed["critical"]
    first_sheddable = min(r.arrival_s for r in shed["sheddable"])  # shed on arrival
    assert all(r.arrival_s + r.e2e_s >= first_sheddable for r in shed["standard"])  # after waiting
    assert all(r.error == "queue_timeout" for r in shed["standard"])
    # the queue's wait metric is in the run's virtual seconds: a waiter shed from the queue waited at
    # least the overload wait (served newest first, the stale ones are shed then) and at most max_wait_s
    assert run.metrics is not None
    timeouts = run.metrics.registry.get_sample_value(
        "llm_extproc_admission_queue_wait_seconds_count", {"outcome": "timeout"}
    )
    waited = run.metrics.registry.get_sample_value(
        "llm_extproc_admission_queue_wait_seconds_sum", {"outcome": "timeout"}
    )
    assert timeouts == len(shed["standard"])
    assert waited == pytest.approx(sum(r.e2e_s for r in shed["standard"]))
    assert all(0.25 <= r.e2e_s <= 1.5 for r in shed["standard"])
    # every request placed by the profile (not by the fallback before the first snapshot) has its
    # predicted TTFT counted under its class, and critical requests were predicted sooner than the
    # classes held back for them
    metric = run.metrics.registry.get_sample_value
    predicted: dict[str, float] = {}
    placed = 0.0
    for klass in by_class:
        count = metric("llm_extproc_predicted_ttft_seconds_count", {"priority": klass}) or 0.0
        predicted[klass] = (
            metric("llm_extproc_predicted_ttft_seconds_sum", {"priority": klass}) or 0.0
        ) / count
        placed += count
    fallbacks = metric("llm_extproc_fallbacks_total", {"reason": "no_fresh_snapshot"}) or 0.0
    assert placed + fallbacks == sum(1 for r in run.records if r.ok) and fallbacks < 5
    assert predicted["critical"] < predicted["standard"], predicted
    # without admission (the default in this mode) everything is served
    plain = simulate(requests, profiles, "llm-extproc", headers=wl.headers)
    assert all(r.ok for r in plain.records)


async def test_admitted_requests_go_where_there_is_headroom() -> None:
    lc = lifecycle(
        {"max_inflight_per_weight": 1},
        scheduling={"profiles": {"default": {"scorers": ["session-affinity"]}}},
    )

    async def one(priority: str) -> str:
        headers = {":method": "POST", ":path": "/v1/chat/completions", "x-session-id": "s1"}
        headers["x-llm-priority"] = priority
        return (await lc.route_async(lc.read_head(headers), BODY)).upstream.id

    home = await one("standard")  # session affinity's favourite
    assert await one("standard") != home  # the favourite is full: the other upstream, not a pile-up
    assert await one("critical") == home  # critical may go over the threshold, to its favourite


async def test_below_saturation_a_long_predicted_queue_does_not_move_a_request_off_its_prefix() -> None:
    """The predicted prefill queue restricts placement only while requests wait in the model's
    queue: below that, a request stays with its prefix holder if the scheduler says so, even over
    `max_predicted_wait_s`, instead of being sent to a cold engine."""
    lc = lifecycle(
        {"max_predicted_wait_s": 1.0},
        scheduling={
            "profiles": {
                "default": {"scorers": [{"name": "predicted-ttft", "params": {"prefill_tokens_per_s": 1000}}]}
            }
        },
    )
    words = "alpha " * 800  # ~1.2 s of prefill at 1000 tokens/s
    holder = await lc.route_async(
        head(), orjson.dumps(dict(CHAT, messages=[{"role": "user", "content": words}]))
    )
    wait, _ = lc.admission._backlog(holder.upstream)
    assert wait > 1.0  # over the threshold: no headroom by the predicted queue
    assert lc.admission.room("m") > 0 and lc.admission.queue_length("m") == 0  # not saturated
    again = orjson.dumps(dict(CHAT, messages=[{"role": "user", "content": words + "and one more"}]))
    assert (await lc.route_async(head(), again)).upstream.id == holder.upstream.id


async def test_unknown_model_is_404_not_saturation() -> None:
    lc = lifecycle({"max_inflight_per_weight": 1, "max_wait_s": 0.05})
    await route(lc)
    await route(lc)
    with pytest.raises(RequestError) as info:
        await lc.route_async(head(), orjson.dumps(dict(CHAT, model="nope")))
    assert info.value.status == 404


def test_priorities_bench_reports_the_tail_after_warm_up_apart() -> None:
    """The bench's "after warm-up" p99 leaves out the first share of requests by arrival order (the
    same requests at every load), and only that: shed requests and the whole-run p99 are unchanged."""
    from extproc_lab.bench.priorities import class_stats, warmup_end_s
    from extproc_lab.bench.report import RequestRecord, Slo

    def rec(i: int, ttft: float, klass: str = "critical", status: int = 200) -> RequestRecord:
        return RequestRecord(f"{klass}/t", "e0", status, None, float(i), ttft, ttft + 1.0, 100, 10)

    # 100 critical requests one second apart; the first five are slow cold starts.
    records = [rec(i, 2.0 if i < 5 else 0.1 + i / 10_000) for i in range(100)]
    records.append(rec(50, 0.0, "sheddable", 429))
    assert warmup_end_s(records, 0.0) == 0.0 and warmup_end_s(records, 0.1) == 10.0
    stats = class_stats(records, Slo(ttft_s=1.0, tpot_s=0.5), warmup=0.1)["critical"]
    assert stats["ttft_p99_ms"] == pytest.approx(2000.0)
    assert stats["ttft_p99_steady_ms"] == pytest.approx(1000 * (0.1 + 99 / 10_000), rel=1e-3)
    assert stats["ok"] == 100 and stats["good"] == 95
    whole = class_stats(records, Slo(ttft_s=1.0, tpot_s=0.5))["critical"]
    assert whole["ttft_p99_steady_ms"] == whole["ttft_p99_ms"]


# -- placement while requests wait: the predicted queue must not turn warm requests into cold ones ----
def _request(priority: int = 0) -> Any:
    from extproc.openai import InferenceRequest

    return InferenceRequest(
        api="chat",  # type: ignore[arg-type]
        model="m",
        stream=False,
        max_tokens=4,
        prompt_text="hello",
        prompt_token_ids=None,
        session=None,
        user="u1",
        priority=priority,
        body_bytes=10,
    )


def test_while_saturated_a_request_keeps_a_full_candidate_where_it_would_wait_no_longer() -> None:
    """While requests wait, an admitted one goes only where the predicted prefill queue is under
    `max_predicted_wait_s`, unless a full candidate is no slower for it by its own predicted TTFT
    (its prefix is cached there): moving it would make a cold prefill, more work for a fleet that
    has none to spare."""
    from extproc.fleet import Upstream
    from extproc.lifecycle.admission import Admission

    a, b = Upstream("a", "a", None, 1.0), Upstream("b", "b", None, 1.0)
    backlog = {"a": 1.2, "b": 0.3}  # a: over the 1.0 s threshold; b: room
    own = {"a": 1.25, "b": 1.5}  # the request's prefix is cached on a: sooner there even so
    settings = admission_settings({"enabled": True, "max_predicted_wait_s": 1.0})
    adm = Admission(
        settings,
        lambda model: (a, b),
        IdleState(),  # type: ignore[arg-type]
        prefill=FixedBacklog(lambda u: (backlog[u.id], 0.2)),
    )

    def prepared(priority: int = 0) -> InferenceRequest:
        """A request whose decision's prepare stage predicted `own` (framework.PREDICTED_TTFT)."""
        req = _request(priority=priority)
        req.prepared = {"predicted-ttft": own}
        return req

    request = prepared()
    assert adm.placeable(request, (a, b)) == (a, b)  # nobody waits: the scheduler decides
    adm.enqueue(_request(), lambda err: None)  # saturated: someone waits
    assert adm.placeable(request, (a, b)) == (a, b)  # a is full but no slower for this request
    own["a"] = 2.4  # not cached on a after all: a cold prefill behind a's queue
    assert adm.placeable(request, (a, b)) == (b,)
    assert adm.placeable(_request(), (a, b)) == (b,)  # nothing prepared: headroom alone decides
    # critical: wherever its own TTFT is within its objective of the soonest (1x: one prefill)
    assert adm.placeable(prepared(priority=1), (a, b)) == (b,)
    assert adm.placeable(_request(priority=1), (a, b)) == (a, b)  # nothing prepared: anywhere
    own["a"] = 1.6
    assert adm.placeable(prepared(priority=1), (a, b)) == (a, b)
    own["a"] = 2.4
    backlog["b"] = 1.1  # nobody has room: all of them
    assert adm.placeable(request, (a, b)) == (a, b)


def test_while_saturated_the_tpot_gate_closes_a_candidate_however_warm() -> None:
    """The own-TTFT exception is for the prefill queue only: an engine decoding over `max_tpot_s`
    stays closed to an admitted request even where its prefix would make it the fastest."""
    from types import SimpleNamespace

    from extproc.fleet import Upstream
    from extproc.lifecycle.admission import Admission

    class Decoding(IdleState):
        tpot = {"a": 0.12, "b": 0.05}

        def load(self, uid: str) -> Any:
            return SimpleNamespace(num_waiting=0, kv_cache_usage=0.1)

        def smoothed_tpot(self, uid: str, window_s: float) -> float:
            return self.tpot[uid]

    a, b = Upstream("a", "a", None, 1.0), Upstream("b", "b", None, 1.0)
    state = Decoding()
    settings = admission_settings({"enabled": True, "max_predicted_wait_s": 1.0, "max_tpot_s": 0.1})
    adm = Admission(
        settings,
        lambda model: (a, b),
        state,  # type: ignore[arg-type]
        prefill=FixedBacklog(lambda u: (1.2 if u.id == "a" else 0.3, 0.2)),
    )
    adm.enqueue(_request(), lambda err: None)
    request = _request()
    request.prepared = {"predicted-ttft": {"a": 1.25, "b": 1.5}}
    assert adm.placeable(request, (a, b)) == (b,)  # a: warm, but decoding at 120 ms
    state.tpot["a"] = 0.08
    assert adm.placeable(request, (a, b)) == (a, b)  # only its prefill queue is long: kept


async def test_a_decision_predicts_each_candidate_once_for_admission_the_filter_and_the_scorer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prepare stage: a critical request with a TTFT objective, admission on, is read by
    admission's soonest rule, the slo-ttft filter and the scorer, from one prediction per candidate
    (each of them predicted it again before), and the figures are not kept past the decision."""
    from extproc.scheduling.ttft_predictor import TtftPredictor

    lc = lifecycle({}, scheduling={})  # the default profile: slo-ttft, predicted-ttft, ...
    computed: list[str] = []
    add_facts = TtftPredictor._add_facts

    def counting(self: TtftPredictor, request: Any, pred: Any, candidates: Any, *a: Any, **k: Any) -> None:
        computed.extend(u.id for u in candidates)
        add_facts(self, request, pred, candidates, *a, **k)

    monkeypatch.setattr(TtftPredictor, "_add_facts", counting)
    decision = await route(lc, "critical", slo="60000")
    assert sorted(computed) == ["a", "b"]  # once each
    assert decision.request.predicted_ttft_s is not None and decision.request.prepared is None
    lc.finish(decision, "response_end")
