"""Prefix-cache affinity: the approximate index learned from decisions, and its load bound."""

from __future__ import annotations

from collections import Counter

from builders import AFFINITY_PROFILE

from extproc.config import config_from_dict
from extproc.fleet import InFlight, SchedulingState, Upstream
from extproc.lifecycle import RequestLifecycle
from extproc.openai import Api, InferenceRequest
from extproc.openai.parse import parse_head
from extproc.scheduling import plugin_name, profile_from_config
from extproc.scheduling.prefix import PrefixAffinityScorer, prefix_hashes
from extproc.telemetry import Metrics

SYSTEM_A = "Tenant A system prompt. " * 100
SYSTEM_B = "Tenant B has a different prompt. " * 100


def req(text: str) -> InferenceRequest:
    return InferenceRequest(Api.CHAT, "m", False, None, text, None, None, None, 0, len(text))


def ups(n: int) -> list[Upstream]:
    return [Upstream(f"u{i}", f"u{i}", None, 1.0) for i in range(n)]


def test_hashes_chain_over_full_blocks() -> None:
    a = prefix_hashes(SYSTEM_A + "question one", 256, 512)
    b = prefix_hashes(SYSTEM_A + "a different question entirely", 256, 512)
    assert len(a) == len((SYSTEM_A + "question one").encode()) // 256
    assert a[: len(SYSTEM_A) // 256] == b[: len(SYSTEM_A) // 256]  # shared prefix, same hashes
    assert prefix_hashes("short", 256, 512) == []
    # Chained: the same block text after a different prefix hashes differently.
    assert (
        prefix_hashes("x" * 256 + "y" * 256, 256, 512)[1] != prefix_hashes("z" * 256 + "y" * 256, 256, 512)[1]
    )
    assert len(prefix_hashes("x" * 10_000, 256, 4)) == 4


def test_scores_follow_where_the_prefix_went() -> None:
    scorer = PrefixAffinityScorer()
    state = SchedulingState(InFlight(), None)
    cands = ups(3)
    first = req(SYSTEM_A + "q1")
    assert list(scorer.score(first, cands, state)) == [0.0, 0.0, 0.0]
    scorer.on_pick(first, cands[1], state)
    scores = scorer.score(req(SYSTEM_A + "q2, longer than the first one"), cands, state)
    assert scores[0] == scores[2] == 0.0 and scores[1] > 0.8
    assert list(scorer.score(req(SYSTEM_B + "q"), cands, state)) == [0.0, 0.0, 0.0]


def test_no_affinity_for_an_overloaded_candidate() -> None:
    scorer = PrefixAffinityScorer(overload_ratio=1.5, overload_slack=2)
    inflight = InFlight()
    state = SchedulingState(inflight, None)
    cands = ups(2)
    scorer.on_pick(req(SYSTEM_A), cands[0], state)
    leases = [inflight.acquire(cands[0]) for _ in range(3)]  # 3 > 0 * 1.5 + 2
    assert list(scorer.score(req(SYSTEM_A + "q"), cands, state)) == [0.0, 0.0]
    leases.pop().release()  # 2 <= bound
    assert scorer.score(req(SYSTEM_A + "q"), cands, state)[0] > 0.9


def test_index_is_lru_bounded() -> None:
    scorer = PrefixAffinityScorer(capacity_blocks=20)
    state = SchedulingState(InFlight(), None)
    u = ups(1)[0]
    scorer.on_pick(req(SYSTEM_A), u, state)  # 9 blocks
    scorer.on_pick(req(SYSTEM_B), u, state)  # 12 blocks: 21 > 20, oldest of A evicted
    assert len(scorer._index[u.id]) == 20
    assert scorer.score(req(SYSTEM_A), [u, ups(2)[1]], state)[0] == 0.0  # A's first block is gone
    assert scorer.score(req(SYSTEM_B), [u, ups(2)[1]], state)[0] == 1.0


def test_tenants_stick_and_a_hot_prefix_spills() -> None:
    """Through the real lifecycle and a text-affinity profile: each tenant sticks to one upstream while load
    is even; one shared prompt under a growing burst spreads instead of collapsing onto one."""
    cfg = config_from_dict(
        {
            "pool": {"clusters": [{"name": f"c{i}", "models": ["m"]} for i in range(4)]},
            "metrics_listen": None,
            "scheduling": {"profiles": {"default": AFFINITY_PROFILE}},
        }
    )
    assert plugin_name(cfg.profile.scorers[0][0]) == "prefix-affinity"
    lc = RequestLifecycle(cfg, Metrics(["m"], [f"c{i}" for i in range(4)]))
    head = parse_head(
        {":method": "POST", ":path": "/v1/chat/completions"},
        session_header="s",
        user_header="u",
        priority_header="p",
    )

    def body(system: str, q: int) -> bytes:
        import orjson

        return orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{q}"}],
            }
        )

    homes: dict[str, set[str]] = {"A": set(), "B": set()}
    for q in range(10):
        for name, system in (("A", SYSTEM_A), ("B", SYSTEM_B)):
            d = lc.route(head, body(system, q))
            homes[name].add(d.upstream.cluster)
            d.lease.release()
    assert len(homes["A"]) == 1 and len(homes["B"]) == 1
    held = [lc.route(head, body(SYSTEM_A, q)) for q in range(40)]  # a burst, all in flight
    spread = Counter(d.upstream.cluster for d in held)
    # Bounded: the affine upstream takes ~2 x least + 16 before the prefix spills to others.
    assert len(spread) >= 3 and max(spread.values()) <= 20, spread


def test_affinity_profile_builds() -> None:
    assert profile_from_config("d", AFFINITY_PROFILE).scorers[0][1] == 3.0
