"""The peers' cache_aware policies as discrete-event references: their decisions on hand-made cases."""

from __future__ import annotations

import dataclasses

import pytest

from extproc_lab.bench.report import summarize
from extproc_lab.bench.workloads import make_workload
from extproc_lab.discrete_event.references import (
    SGLANG_CACHE_AWARE,
    VLLM_ROUTER_CACHE_AWARE,
    ApproxTree,
    CacheAwareRouter,
    routing_text,
)
from extproc_lab.discrete_event.simulation import POLICIES, simulate, tokenize_requests
from extproc_lab.engines.profiles import PROFILES
from extproc_lab.engines.tokens import chat_to_tokens

SYSTEM_A = "You are the assistant of tenant A. " * 20
SYSTEM_B = "Tenant B wants short answers only. " * 20


def test_defaults_are_the_peers_command_line_defaults() -> None:
    assert (SGLANG_CACHE_AWARE.cache_threshold, SGLANG_CACHE_AWARE.balance_abs_threshold) == (0.3, 64)
    assert SGLANG_CACHE_AWARE.balance_rel_threshold == 1.5
    assert SGLANG_CACHE_AWARE.low_match == "smallest-tree"
    assert VLLM_ROUTER_CACHE_AWARE.low_match == "min-load"
    assert {"sglang-cache-aware", "vllm-router-cache-aware"} <= set(POLICIES)


def test_imbalanced_load_goes_to_the_shortest_queue_even_against_a_cache_hit() -> None:
    router = CacheAwareRouter(4)
    router.tree.insert(SYSTEM_A + "first question", 0)
    # max - min = 70 > 64 and 70 > 0 * 1.5: imbalanced, so the least-loaded worker wins.
    assert router.choose(SYSTEM_A + "second question", [70, 2, 0, 5], now=0.0) == 2
    assert router.decisions["imbalanced"] == 1
    # The text is still learned for the worker it went to.
    assert router.tree.prefix_match(SYSTEM_A + "x")[0] >= len(SYSTEM_A)


def test_both_thresholds_must_trip_for_imbalance() -> None:
    router = CacheAwareRouter(2)
    router.tree.insert(SYSTEM_A, 0)
    # 100 - 65 = 35 <= 64: balanced by the absolute rule, so the cache decides.
    assert router.choose(SYSTEM_A + "q", [100, 65], now=0.0) == 0
    # 195 - 130 = 65 > 64 but 195 <= 130 * 1.5: still balanced.
    assert router.choose(SYSTEM_A + "q", [195, 130], now=0.0) == 0
    # 196 > 195: now both trip.
    assert router.choose(SYSTEM_A + "q", [196, 130], now=0.0) == 1
    assert router.decisions["imbalanced"] == 1


def test_high_match_goes_to_the_worker_that_was_sent_the_prefix() -> None:
    router = CacheAwareRouter(3)
    first = router.choose(SYSTEM_A + "how do I reset my password?", [0, 0, 0], now=0.0)
    for loads in ([1, 0, 0], [0, 3, 1], [5, 0, 9]):
        assert router.choose(SYSTEM_A + "and my user name?", loads, now=0.0) == first
    assert router.decisions["cache-hit"] == 3


def test_low_match_goes_to_the_smallest_tree_for_sglang_and_least_load_for_vllm_router() -> None:
    sglang, vllm = CacheAwareRouter(3, SGLANG_CACHE_AWARE), CacheAwareRouter(3, VLLM_ROUTER_CACHE_AWARE)
    for router in (sglang, vllm):
        router.tree.insert("x" * 500, 0)
        router.tree.insert("y" * 200, 1)
    loads = [0, 5, 9]  # worker 2 has the smallest tree (0 characters) but the longest queue
    assert sglang.choose(SYSTEM_B, loads, now=0.0) == 2
    assert vllm.choose(SYSTEM_B, loads, now=0.0) == 0
    assert sglang.decisions["low-match"] == vllm.decisions["low-match"] == 1


def test_match_rate_must_exceed_the_threshold() -> None:
    cfg = dataclasses.replace(SGLANG_CACHE_AWARE, cache_threshold=0.5)
    for text, expected in (("a" * 50 + "c" * 50, 1), ("a" * 50 + "c" * 49, 0)):
        router = CacheAwareRouter(2, cfg)
        router.tree.insert("a" * 50, 0)
        router.tree.insert("b" * 10, 1)
        # Exactly 50 % matched is not above the threshold: the smallest tree (worker 1) gets it.
        assert router.choose(text, [0, 0], now=0.0) == expected


def test_tree_counts_characters_per_worker_and_matches_partial_edges() -> None:
    tree = ApproxTree(2)
    tree.insert("hello world", 0)
    tree.insert("hello there", 1)
    tree.insert("hello world, again", 0)
    assert tree.size == [len("hello world, again"), len("hello there")]
    assert tree.prefix_match("hello wor") == (9, 0)
    assert tree.prefix_match("hello th") == (8, 1)
    matched, _ = tree.prefix_match("help")
    assert matched == 3
    assert tree.prefix_match("zzz") == (0, 1)  # the root holds every worker: nothing matched
    assert tree.smallest_tenant() == 1


def test_eviction_keeps_each_worker_within_its_bound_dropping_least_recently_used_leaves() -> None:
    tree = ApproxTree(2)
    texts = [f"prompt {i:03d} " + "z" * 100 for i in range(20)]
    for t in texts:
        tree.insert(t, 0)
    tree.insert("other worker text", 1)
    tree.prefix_match(texts[0])  # touch the oldest: it becomes the most recently used
    before_nodes = tree.nodes()
    tree.evict(500)
    assert tree.size[0] <= 500
    assert tree.size[1] == len("other worker text")  # under the bound: untouched
    assert tree.prefix_match(texts[0]) == (len(texts[0]), 0)  # recently used survived
    assert tree.prefix_match(texts[1])[0] < len(texts[1])  # least recently used went
    assert tree.prefix_match(texts[-1]) == (len(texts[-1]), 0)
    assert tree.nodes() < before_nodes  # nodes that no worker holds are removed


def test_router_evicts_on_its_interval_in_virtual_time() -> None:
    cfg = dataclasses.replace(SGLANG_CACHE_AWARE, eviction_interval_s=10.0, max_tree_size=300)
    router = CacheAwareRouter(1, cfg)
    for i in range(10):
        router.choose(f"text {i} " + "q" * 100, [0], now=1.0)
    assert router.tree.size[0] > 300
    router.choose("late", [0], now=10.5)  # the eviction due at t=10 runs first
    assert router.tree.size[0] <= 300 + len("late")


def test_routing_text_joins_message_contents() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            {"role": "assistant", "content": "b"},
        ]
    }
    assert routing_text(body) == "sys a b"


def test_tokenize_requests_matches_chat_to_tokens() -> None:
    wl = make_workload("multi-turn", rate=5.0, count=30, seed=2)
    reqs = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    assert tokenize_requests(reqs) == [chat_to_tokens(b["messages"]) for _, b, _ in reqs]


@pytest.mark.parametrize("policy", ["sglang-cache-aware", "vllm-router-cache-aware"])
def test_peer_policies_keep_tenants_together_in_the_des(policy: str) -> None:
    # 48 tenants x ~1.8k-token system prompts (85k tokens) over 2 A10Gs holding 34k tokens each.
    a10g = PROFILES["a10g-llama3-8b"]
    wl = make_workload("shared-prefix", rate=4.0, count=240, seed=3, tenants=48)
    reqs = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    tokens = tokenize_requests(reqs)
    hit = {}
    for name in ("round-robin", policy):
        run = simulate(reqs, [a10g] * 2, name, tokens=tokens)
        assert len(run.records) == 240 and all(r.ok for r in run.records)
        hit[name] = summarize(name, run.records, run.virtual_s).prefix_cache_hit_rate
    assert hit[policy] > hit["round-robin"] + 0.1, hit
