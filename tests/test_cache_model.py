"""The cache model against the engine model's own prefix cache, on the same request stream.

The simulated engine (extproc_lab.engines.model) implements vLLM's automatic prefix caching: paged
blocks, LRU eviction of unreferenced blocks, pinning while running, preemption. The service's
CacheModel only sees its own decisions and the engine's capacity. Here both see the same requests; at
each submission the model predicts how many prompt tokens the engine will find cached, and the engine
reports what it actually found at admission. The agreement is printed (run with -s) and bounded.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from extproc.scheduling.cache_model import CacheModel, Placement
from extproc.tokenization import block_hashes
from extproc_lab.bench.workloads import make_workload
from extproc_lab.engines.model import EngineModel
from extproc_lab.engines.profiles import PROFILES
from extproc_lab.engines.tokens import chat_to_tokens

BS = 16


def _agreement(workload: str, blocks: int, rate: float, **params: object) -> dict[str, float]:
    profile = dataclasses.replace(
        PROFILES["a10g-llama3-8b"], num_gpu_blocks=blocks, max_model_len=blocks * BS
    )
    engine = EngineModel(profile)
    model = CacheModel(blocks)
    wl = make_workload(workload, rate=rate, count=300, seed=3, **params)
    predicted: dict[str, int] = {}
    placements: dict[str, Placement] = {}
    actual: dict[str, int] = {}
    now = 0.0

    def run_until(t: float | None) -> None:
        nonlocal now
        while t is None or now < t:
            result = engine.step(now)
            if result is None:
                if t is not None:
                    now = t
                return
            now = result.ended_at
            for done in result.finished:
                actual[done.request_id] = done.cached_tokens
                model.release(placements.pop(done.request_id))

    for i, req in enumerate(wl.requests):
        run_until(req.arrival_s)
        ids = chat_to_tokens(req.body["messages"])
        if len(ids) >= profile.max_model_len - 1:
            continue
        hashes = block_hashes(ids, BS)
        predicted[str(i)] = min(model.matched(hashes) * BS, (len(ids) - 1) // BS * BS)
        max_tokens = req.body["max_tokens"]
        placements[str(i)] = model.place(hashes, math.ceil(max_tokens / BS))
        engine.submit(str(i), ids, max_tokens, now)
    run_until(None)
    pairs = [(predicted[k], actual[k]) for k in actual]
    exact = sum(p == a for p, a in pairs) / len(pairs)
    same_class = sum((p > 0) == (a > 0) for p, a in pairs) / len(pairs)
    err = sum(abs(p - a) for p, a in pairs) / max(1, sum(a for _, a in pairs))
    return {"requests": len(pairs), "exact": exact, "hit_or_miss": same_class, "token_error": err}


@pytest.mark.parametrize(
    ("workload", "blocks", "rate", "params", "min_exact", "min_hit_or_miss", "max_token_error"),
    [
        # 24 tenants x 1000-token prompts = 24k tokens of prefixes vs 9.6k of KV: constant eviction.
        ("shared-prefix", 600, 1.5, {"tenants": 24, "system_tokens": 1000}, 0.75, 0.8, 0.35),
        # Everything fits: the model must agree almost always.
        ("shared-prefix", 4000, 1.5, {"tenants": 8, "system_tokens": 1000}, 0.95, 0.99, 0.01),
        # Growing chats: each turn extends the last one's prefix, replies included. Brief pressure
        # evicts a few blocks: the engine's a history's last ones, and the model must lose the same
        # (tail first), not the history's first block, which ends the whole match (hit-or-miss
        # 0.977 that way); and a reply's blocks, which the next turn resends, must not count twice
        # (token error 0.022 that way, 0.012 now).
        ("multi-turn", 1200, 2.0, {"conversations": 12}, 0.85, 0.985, 0.018),
    ],
)
def test_cache_model_agrees_with_the_engine(
    workload: str,
    blocks: int,
    rate: float,
    params: dict[str, object],
    min_exact: float,
    min_hit_or_miss: float,
    max_token_error: float,
) -> None:
    got = _agreement(workload, blocks, rate, **params)
    print(f"\n{workload} blocks={blocks} rate={rate} {params}: {got}")
    assert got["requests"] > 200
    assert got["exact"] >= min_exact, got
    assert got["hit_or_miss"] >= min_hit_or_miss, got
    assert got["token_error"] <= max_token_error, got


def test_eviction_is_lru_and_pinned_blocks_stay() -> None:
    model = CacheModel(4)
    a = model.place([b"a1", b"a2"], 0)
    model.release(a)
    b = model.place([b"b1", b"b2"], 0)  # 4 used: a's blocks cached, b's pinned
    assert model.matched([b"a1", b"a2"]) == 2
    c = model.place([b"c1"], 0)  # needs room: the LRU evictable block goes, not pinned ones
    assert model.matched([b"a1", b"a2"]) == 1  # a's tail (a2) went first, as an engine frees it
    assert model.matched([b"b1", b"b2"]) == 2
    model.release(b)
    model.release(c)
    assert model.used_blocks == 4


def test_release_is_tail_first_so_a_prefix_is_eaten_from_its_end() -> None:
    model = CacheModel(10)
    model.release(model.place([b"p1", b"p2", b"p3", b"p4"], 2))
    # 6 evictable (2 output, then p4..p1); 7 pinned need 3 of them: the output and p4.
    model.place([b"q1", b"q2", b"q3", b"q4", b"q5", b"q6", b"q7"], 0)
    assert model.matched([b"p1", b"p2", b"p3", b"p4"]) == 3
    model.place([b"r1", b"r2"], 0)  # two more: p3, p2
    assert model.matched([b"p1", b"p2", b"p3", b"p4"]) == 1


def test_a_next_turn_takes_over_its_reply_blocks() -> None:
    model = CacheModel(20)
    model.release(model.place([b"h1", b"h2", b"h3"], 2))
    assert model.used_blocks == 5  # the prompt's 3 and the reply's 2, all evictable
    # The next turn resends the history, the reply included: its own blocks now hold those tokens.
    turn = model.place([b"h1", b"h2", b"h3", b"r1", b"r2", b"u1"], 1)
    assert model.used_blocks == 7 and model.pinned_blocks == 7
    model.release(turn)
    # A request that merely shares a prefix block takes over nothing: the reply was another's.
    model.release(model.place([b"s1", b"s2"], 2))
    model.place([b"s1", b"x1"], 0)
    assert model.used_blocks == 7 + 4 + 1


def test_output_blocks_take_room_and_reset_forgets() -> None:
    model = CacheModel(6)
    p = model.place([b"x1", b"x2"], 2)
    assert model.pinned_blocks == 4
    model.release(p)  # the two output blocks stay cached (anonymous), evictable
    assert model.used_blocks == 4 and model.pinned_blocks == 0
    q = model.place([b"y1", b"y2", b"y3", b"y4"], 0)  # evicts two: the output blocks (the tail)
    assert model.matched([b"x1", b"x2"]) == 2
    model.place([b"z1"], 0)  # then x2
    assert model.matched([b"x1", b"x2"]) == 1
    model.reset()
    assert model.used_blocks == 0
    model.release(q)  # placed before the reset: nothing to give back
    assert model.used_blocks == 0
