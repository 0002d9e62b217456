"""Named workloads: deterministic, open-loop arrivals at the requested rate, and the intended shape."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest

from extproc_lab.bench.workloads import (
    CHARS_PER_TOKEN,
    WORKLOADS,
    Workload,
    make_workload,
    max_in_window,
    multi_turn,
    pseudo_text,
)

RATE = 5.0


def build(name: str, count: int = 1000, seed: int = 7, **kwargs: Any) -> Workload:
    return WORKLOADS[name](rate=RATE, count=count, seed=seed, model="m", **kwargs)


def tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


def test_registry_names() -> None:
    assert set(WORKLOADS) == {"shared-prefix", "multi-turn", "long-context", "bursty"}
    with pytest.raises(KeyError, match="shared-prefix"):
        make_workload("nope", rate=1.0, count=1)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_from_seed(name: str) -> None:
    a, b, other = build(name, 200), build(name, 200), build(name, 200, seed=8)
    assert a.requests == b.requests
    assert a.bodies() != other.bodies()
    assert a.arrivals() != other.arrivals()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_count_arrivals_and_rate(name: str) -> None:
    w = build(name, 2000)
    assert len(w) == 2000 == len(w.bodies()) == len(w.tags())
    arrivals = w.arrivals()
    assert all(b >= a for a, b in itertools.pairwise(arrivals))
    assert arrivals[0] >= 0
    measured = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert measured == pytest.approx(RATE, rel=0.15)  # ~2000 arrivals: sd ~2%, bursty adds phase error


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bodies_are_streaming_chat_requests(name: str) -> None:
    for body in build(name, 50).bodies():
        assert body["model"] == "m"
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert 50 <= body["max_tokens"] <= 200
        assert body["messages"][-1]["role"] == "user"
        assert all(m["content"] for m in body["messages"])


def test_pseudo_text_exact_length_and_words() -> None:
    import random

    text = pseudo_text(random.Random(1), 123, prefix="[x] ")
    assert len(text) == 123 * CHARS_PER_TOKEN
    assert text.startswith("[x] ") and not text.endswith(" ")
    assert len(text.split()) > 60
    assert pseudo_text(random.Random(1), 0) == ""


def test_shared_prefix_tenants() -> None:
    w = build("shared-prefix", 1000, tenants=8)
    by_tenant: dict[str, set[str]] = defaultdict(set)
    for r in w:
        system, user = r.body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert tokens(system["content"]) == 2000
        assert 50 <= tokens(user["content"]) <= 200
        by_tenant[r.tag].add(system["content"])
    assert all(len(prompts) == 1 for prompts in by_tenant.values())  # one identical prompt per tenant
    prompts = [next(iter(p)) for p in by_tenant.values()]
    assert len(set(prompts)) == len(prompts) == 8  # and tenants differ, from the first characters
    assert len({p[:20] for p in prompts}) == 8
    counts = sorted((sum(1 for t in w.tags() if t == tag) for tag in by_tenant), reverse=True)
    assert counts[0] > 3 * counts[-1]  # Zipf: tenant-000 is far more popular than the last
    assert w.tags().count("tenant-000") == counts[0]
    assert w.params["prefix_tokens_total"] == 8 * 2000


def test_shared_prefix_tenant_prompts_do_not_depend_on_count_or_rate() -> None:
    a = WORKLOADS["shared-prefix"](rate=1.0, count=50, seed=3)
    b = WORKLOADS["shared-prefix"](rate=9.0, count=500, seed=3)
    prompts_a = {r.tag: r.body["messages"][0]["content"] for r in a}
    prompts_b = {r.tag: r.body["messages"][0]["content"] for r in b}
    assert all(prompts_b[t] == p for t, p in prompts_a.items())


def test_multi_turn_history_grows_by_reply_and_user_turn() -> None:
    w = build("multi-turn", 600, turns=6)
    conversations: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in w:
        conversations[r.tag].append(r.body)
    assert len(conversations) > w.params["conversations"]  # finished ones were replaced
    longest = 0
    for bodies in conversations.values():
        assert len(bodies) <= 6
        assert len(bodies[0]["messages"]) == 1
        for prev, nxt in itertools.pairwise(bodies):
            n = len(prev["messages"])
            assert nxt["messages"][:n] == prev["messages"]
            reply, user = nxt["messages"][n:]
            assert reply["role"] == "assistant" and tokens(reply["content"]) == prev["max_tokens"]
            assert user["role"] == "user" and 50 <= tokens(user["content"]) <= 200
        longest = max(longest, len(bodies))
    assert longest == 6


def test_multi_turn_conversations_from_think_time() -> None:
    w = multi_turn(rate=4.0, count=100)
    assert w.params["conversations"] == 8 and w.params["think_time_s"] == pytest.approx(2.0)
    w = multi_turn(rate=4.0, count=100, conversations=3)
    assert w.params["think_time_s"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="not both"):
        multi_turn(rate=4.0, count=10, conversations=3, think_time_s=1.0)


def test_multi_turn_think_time_between_turns() -> None:
    w = build("multi-turn", 3000, think_time_s=2.0)
    last: dict[str, float] = {}
    gaps = []
    for r in w:
        if r.tag in last:
            gaps.append(r.arrival_s - last[r.tag])
        last[r.tag] = r.arrival_s
    assert sum(gaps) / len(gaps) == pytest.approx(2.0, rel=0.1)


def test_long_context_share() -> None:
    w = build("long-context", 1000)
    long = [r for r in w if r.tag == "long"]
    assert len(long) == 50 == w.params["long_requests"]
    for r in w:
        n = tokens(r.body["messages"][0]["content"])
        assert (8000 <= n <= 30000) if r.tag == "long" else (200 <= n <= 1000)
    positions = [i for i, r in enumerate(w) if r.tag == "long"]
    assert positions[0] < 500 < positions[-1]  # spread through the run, not bunched


def test_bursty_has_bursts() -> None:
    w = build("bursty", 2000)
    arrivals = w.arrivals()
    assert max_in_window(arrivals, 1.0) >= 3 * RATE
    burst = sum(1 for t in w.tags() if t == "burst")
    assert burst / len(w) == pytest.approx(0.5, abs=0.06)  # 10% of the time at 5x: half the requests
    smooth = build("long-context", 2000).arrivals()
    assert max_in_window(arrivals) > max_in_window(smooth) + RATE


def test_bursty_rejects_impossible_mean() -> None:
    with pytest.raises(ValueError, match="<= 1"):
        make_workload("bursty", rate=1.0, count=10, burst_factor=20.0, burst_fraction=0.1)
