"""Behaviour of the simulated engine model (extproc_lab.engines.model), its profiles and its tokenizer.

The model runs in virtual time: each test drives it with a small loop that calls step(now) again at
now + duration. The `test` profile (32 blocks of 4 tokens, 4 sequences, 32 tokens per step) makes
eviction, queueing, chunked prefill and preemption happen with prompts of a few dozen tokens.
"""

from __future__ import annotations

import pytest

from extproc_lab.engines.model import EngineModel, FinishedEvent, StepResult
from extproc_lab.engines.profiles import PROFILES, TEST, GpuProfile
from extproc_lab.engines.tokens import chat_to_tokens, tokenize

H100 = PROFILES["h100-llama3-8b"]
A10G = PROFILES["a10g-llama3-8b"]


def prompt(seed: int, n: int) -> list[int]:
    """n distinct-looking token ids; different seeds give different first blocks."""
    return [(seed * 7919 + i * 104_729) % 50_000 for i in range(n)]


def drain(model: EngineModel, now: float = 0.0) -> tuple[list[StepResult], float]:
    """Step until idle; the virtual time at the end."""
    results: list[StepResult] = []
    while (r := model.step(now)) is not None:
        results.append(r)
        now = r.ended_at
        assert len(results) < 100_000
    return results, now


def finished(results: list[StepResult]) -> dict[str, FinishedEvent]:
    return {f.request_id: f for r in results for f in r.finished}


def run_one(
    model: EngineModel, rid: str, tokens: list[int], now: float, max_tokens: int = 1
) -> tuple[FinishedEvent, float]:
    model.submit(rid, tokens, max_tokens, now)
    results, now = drain(model, now)
    return finished(results)[rid], now


# --- prefix cache ------------------------------------------------------------------------------


def test_prefix_reuse_skips_prefill_and_shortens_ttft() -> None:
    m = EngineModel(TEST)
    shared = prompt(1, 36)
    first, now = run_one(m, "a", [*shared, 1, 2, 3, 4], 0.0)
    second, _ = run_one(m, "b", [*shared, 5, 6, 7, 8], now + 1.0)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 36  # the 9 full blocks of the shared prefix
    assert second.ttft < first.ttft
    assert m.prefix_cache_queries == 80 and m.prefix_cache_hits == 36


def test_only_full_blocks_are_cached() -> None:
    m = EngineModel(TEST)
    base = prompt(2, 10)  # 2 full blocks of 4 + 2 tokens
    run_one(m, "a", base, 0.0)
    assert m.cached_blocks == 2  # the partial third block is not cached
    assert m.cached_prefix_tokens([*base, 1, 2, 3, 4, 5, 6]) == 8  # the 3rd block never became full
    assert m.cached_prefix_tokens([*base[:8], 9, 9, 9]) == 8
    assert m.cached_prefix_tokens([*base[:7], 9, 9, 9, 9]) == 4  # 2nd block differs
    # A block's hash chains its parent's: the same second block after another first block misses.
    assert m.cached_prefix_tokens([9, 9, 9, 9, *base[4:8], 1]) == 0
    # At most len - 1 tokens hit (the last prompt token is always computed): 8 tokens -> 1 block.
    assert m.cached_prefix_tokens(base[:8]) == 4


def test_eviction_under_pressure_is_lru() -> None:
    m = EngineModel(TEST)  # 32 blocks; a 20-token prompt with 1 output token holds 5 of them
    p0, p1 = prompt(100, 20), prompt(101, 20)
    _, now = run_one(m, "p0", p0, 0.0)
    _, now = run_one(m, "p1", p1, now)
    again, now = run_one(m, "p0-again", p0, now)  # p0 is now more recently used than p1
    assert again.cached_tokens == 16
    flood = 0
    while m.cached_prefix_tokens(p1) > 0:  # one-block prompts: one block allocated (evicted) at a time
        _, now = run_one(m, f"flood-{flood}", prompt(200 + flood, 4), now)
        flood += 1
        assert flood < 40
    assert m.evicted_blocks > 0
    assert m.cached_prefix_tokens(p0) == 16  # the recently reused prefix survived
    late, _ = run_one(m, "p1-again", p1, now)
    assert late.cached_tokens == 0  # the early prefix no longer hits


def test_kv_usage_counts_referenced_blocks_only() -> None:
    m = EngineModel(TEST)
    m.submit("a", prompt(3, 20), 4, 0.0)
    r = m.step(0.0)
    assert r is not None
    assert m.kv_usage == pytest.approx(5 / 32)  # the 20 computed tokens; the 21st gets a block next step
    assert m.free_blocks == 27
    drain(m, r.ended_at)
    assert m.kv_usage == 0.0 and m.free_blocks == 32
    assert m.cached_blocks == 5  # cached but unreferenced: counted as free


# --- batching and budget -----------------------------------------------------------------------


def test_queueing_when_full_is_fifo() -> None:
    m = EngineModel(TEST)  # max_num_seqs 4
    ids = [f"r{i}" for i in range(7)]
    for rid in ids:
        m.submit(rid, prompt(int(rid[1:]), 4), 3, 0.0)
    first = m.step(0.0)
    assert first is not None
    assert m.num_running == 4 and m.num_waiting == 3
    assert first.admitted == ids[:4]
    rest, _ = drain(m, first.ended_at)
    results = [first, *rest]
    assert [rid for r in results for rid in r.admitted] == ids  # FIFO admission
    assert [e.request_id for r in results for e in r.first_tokens] == ids
    done = finished(results)
    assert sorted(done) == ids and all(f.completion_tokens == 3 for f in done.values())
    assert m.idle and m.num_running == 0 and m.num_waiting == 0


def test_token_budget_chunks_a_long_prefill() -> None:
    m = EngineModel(TEST)  # 32 tokens per step
    m.submit("long", prompt(4, 90), 2, 0.0)
    now, steps = 0.0, []
    while not steps or not steps[-1].first_tokens:
        r = m.step(now)
        assert r is not None
        steps.append(r)
        now = r.ended_at
    assert [r.prefill_tokens for r in steps] == [32, 32, 26]
    assert [len(r.tokens) for r in steps] == [0, 0, 1]  # first token in the step that ends the prefill


def test_decoding_sequences_share_the_budget_with_a_prefill() -> None:
    m = EngineModel(TEST)
    m.submit("short", prompt(5, 4), 10, 0.0)
    r = m.step(0.0)
    assert r is not None and r.first_tokens
    m.submit("long", prompt(6, 80), 2, r.ended_at)
    r = m.step(r.ended_at)
    assert r is not None
    assert r.num_decoding == 1 and r.prefill_tokens == 31


def test_preemption_when_blocks_run_out() -> None:
    m = EngineModel(TEST)  # 32 blocks; 4 requests growing to 48 tokens need 48
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        m.submit(rid, prompt(10 + i, 8), 40, 0.0)
    results, _ = drain(m)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "r3"  # the most recently admitted goes first
    assert m.preemptions_total == len(preempted)
    done = finished(results)
    assert sorted(done) == ids
    assert all(f.completion_tokens == 40 for f in done.values())
    assert sum(f.preemptions for f in done.values()) == len(preempted)
    for rid in ids:  # recomputation neither repeats nor skips output tokens
        assert [e.index for r in results for e in r.tokens if e.request_id == rid] == list(range(40))
    assert m.kv_usage == 0.0


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    m = EngineModel(TEST, scheduling_policy="priority")  # max_num_seqs 4
    order = [("s0", 1), ("s1", 0), ("s2", 0), ("s3", 0), ("late", 0), ("crit", -1), ("low", 1), ("s5", 0)]
    for i, (rid, prio) in enumerate(order[:4]):
        m.submit(rid, prompt(70 + i, 4), 3, 0.0, priority=prio)
    first = m.step(0.0)
    assert first is not None
    for i, (rid, prio) in enumerate(order[4:]):
        m.submit(rid, prompt(74 + i, 4), 3, first.ended_at, priority=prio)
    rest, _ = drain(m, first.ended_at)
    results = [first, *rest]
    admitted = [rid for r in results for rid in r.admitted]
    # The first four fill the slots (the sheddable s0 last, and it keeps its slot: a waiting request
    # never preempts); then the critical request jumps the queue and the sheddable one goes last.
    assert admitted == ["s1", "s2", "s3", "s0", "crit", "late", "s5", "low"]
    assert sorted(finished(results)) == sorted(rid for rid, _ in order)


def test_fcfs_policy_refuses_priorities_and_unknown_policies() -> None:
    m = EngineModel(TEST)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        m.submit("a", prompt(80, 4), 3, 0.0, priority=-1)
    m.submit("b", prompt(81, 4), 3, 0.0, priority=0)  # 0 is the default and always accepted
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineModel(TEST, scheduling_policy="lifo")


def test_priority_policy_preempts_the_lowest_priority_even_when_already_scheduled() -> None:
    m = EngineModel(TEST, scheduling_policy="priority")  # 32 blocks: four sequences growing to 48 need 48
    prios = {"r0": 1, "r1": -1, "r2": 0, "r3": -1}  # r0, admitted first, is the sheddable one
    for i, (rid, prio) in enumerate(prios.items()):
        m.submit(rid, prompt(90 + i, 8), 40, 0.0, priority=prio)
    results, _ = drain(m)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "r0"  # not r3, the most recently admitted (FCFS's victim)
    assert "r1" not in preempted and "r3" not in preempted  # the critical ones are never the victims
    done = finished(results)
    assert sorted(done) == sorted(prios)
    for rid in prios:  # a victim that was already scheduled in its step neither repeats nor skips tokens
        assert [e.index for r in results for e in r.tokens if e.request_id == rid] == list(range(40))
    assert max(done["r1"].latency, done["r3"].latency) < done["r0"].latency
    assert m.kv_usage == 0.0


def test_a_waiting_request_preempts_lower_priorities_only_past_the_threshold() -> None:
    """SGLang's rule (`preemption_threshold`): no slot or blocks for a waiting request, and running
    ones more than that much lower in priority give way; vLLM's (no threshold): it waits."""

    def run(threshold: int | None) -> tuple[list[str], list[str]]:
        m = EngineModel(TEST, scheduling_policy="priority", preemption_threshold=threshold)  # 4 slots
        for i in range(4):
            m.submit(f"low{i}", prompt(110 + i, 4), 30, 0.0, priority=10 if i < 2 else 5)
        first = m.step(0.0)
        assert first is not None and len(first.admitted) == 4
        m.submit("crit", prompt(120, 4), 3, first.ended_at, priority=0)
        r = m.step(first.ended_at)
        assert r is not None
        return r.admitted, r.preempted

    assert run(None) == ([], [])  # every slot taken: the critical request waits
    admitted, preempted = run(9)
    assert admitted == ["crit"] and preempted == ["low1"]  # the lowest priority, latest arrival first
    assert run(10) == ([], [])  # no running request is more than 10 below it
    with pytest.raises(ValueError, match="preemption_threshold"):
        EngineModel(TEST, preemption_threshold=10)  # needs the priority policy


def test_a_waiting_request_preempts_for_blocks_in_the_step_that_admits_it() -> None:
    m = EngineModel(TEST, scheduling_policy="priority", preemption_threshold=1)  # 32 blocks of 4 tokens
    m.submit("low", prompt(130, 40), 20, 0.0, priority=1)  # 10 blocks, growing to 15
    m.submit("mid", prompt(131, 40), 20, 0.0, priority=0)
    results, now = [], 0.0
    while m.free_blocks >= 8:  # until its first chunk (30 tokens: 8 blocks) no longer fits
        r = m.step(now)
        assert r is not None and not r.finished
        results.append(r)
        now = r.ended_at
    m.submit("crit", prompt(132, 48), 2, now, priority=-1)
    results2, _ = drain(m, now)
    preempted = [rid for r in results2 for rid in r.preempted]
    assert preempted[0] == "low"  # the lowest priority gave way, not "mid"
    step = next(r for r in results2 if "crit" in r.admitted)
    assert step.preempted == ["low"]  # in the step that admitted the critical request: for its blocks
    done = finished(results + results2)
    assert sorted(done) == ["crit", "low", "mid"]
    assert done["crit"].latency < done["mid"].latency
    for rid in ("low", "mid"):  # recomputation neither repeats nor skips output tokens
        assert [e.index for r in results + results2 for e in r.tokens if e.request_id == rid] == list(
            range(20)
        )


# --- step time ---------------------------------------------------------------------------------


def decode_step_duration(prompts: list[list[int]]) -> float:
    """Duration of the first step in which every sequence decodes and none prefills."""
    m = EngineModel(TEST)
    for i, p in enumerate(prompts):
        m.submit(f"r{i}", p, 5, 0.0)
    now = 0.0
    while (r := m.step(now)) is not None:
        if r.prefill_tokens == 0:
            assert r.num_decoding == len(prompts)
            return r.duration
        now = r.ended_at
    raise AssertionError("no decode step")


def test_decode_step_time_grows_with_batch_and_context() -> None:
    one = decode_step_duration([prompt(20, 8)])
    four = decode_step_duration([prompt(20 + i, 8) for i in range(4)])
    long_context = decode_step_duration([prompt(20, 80)])
    assert four > one
    assert long_context > one


def test_inter_token_gaps_are_the_steps_between_a_sequences_tokens() -> None:
    """vLLM's inter_token_latency_seconds: one gap per token after the first, summing to the time
    from first token to last; a prefill sharing the batch lengthens the gaps of those decoding."""
    m = EngineModel(TEST)
    m.submit("a", prompt(50, 8), 6, 0.0)
    results, _ = drain(m)
    done = finished(results)["a"]
    assert m.itl_count == 5
    assert m.itl_sum == pytest.approx(done.latency - done.ttft)
    alone = m.itl_sum / m.itl_count
    m = EngineModel(TEST)
    m.submit("a", prompt(51, 8), 6, 0.0)
    m.submit("b", prompt(52, 28), 1, 0.0)  # a 28-token prefill in the first steps' budget
    drain(m)
    assert m.itl_sum / m.itl_count > alone


def test_ttft_counters_sum_each_requests_first_token_time() -> None:
    """vLLM's time_to_first_token_seconds: one observation per request, submitted to first token
    (what the discrete-event snapshots' interval-mean TTFT is made of)."""
    m = EngineModel(TEST)
    m.submit("a", prompt(60, 8), 3, 0.0)
    m.submit("b", prompt(61, 28), 2, 0.05)
    results, _ = drain(m)
    done = finished(results)
    assert m.ttft_count == 2
    assert m.ttft_sum == pytest.approx(done["a"].ttft + done["b"].ttft)
    firsts = {f.request_id: f.ttft for r in results for f in r.first_tokens}
    assert m.ttft_sum == pytest.approx(sum(firsts.values()))


# --- determinism, limits, estimates ------------------------------------------------------------


def mixed_run() -> list[StepResult]:
    m = EngineModel(TEST)
    shared = prompt(30, 24)
    for i in range(6):
        m.submit(f"r{i}", [*shared, *prompt(40 + i, 4 + i)], 40 + 5 * i, 0.01 * i)
    results, now = drain(m)
    m.submit("late", [*shared, 1, 2, 3], 5, now + 0.5)
    more, _ = drain(m, now + 0.5)
    return results + more


def test_identical_runs_give_identical_events() -> None:
    a, b = mixed_run(), mixed_run()
    assert a == b
    assert any(r.preempted for r in a) and any(f.cached_tokens for r in a for f in r.finished)


def test_prompt_too_long_and_output_capped() -> None:
    m = EngineModel(TEST)  # max_model_len 96
    with pytest.raises(ValueError, match="max_model_len"):
        m.submit("too-long", prompt(50, 96), 1, 0.0)
    with pytest.raises(ValueError):
        m.submit("empty", [], 1, 0.0)
    m.submit("ok", prompt(50, 95), 10, 0.0)
    with pytest.raises(ValueError, match="already"):
        m.submit("ok", prompt(51, 4), 1, 0.0)
    assert finished(drain(m)[0])["ok"].completion_tokens == 1  # prompt + output <= max_model_len


def test_predicted_ttft_grows_with_queue_and_shrinks_with_cache() -> None:
    m = EngineModel(H100)
    probe = prompt(60, 2000)
    estimates = [m.predicted_ttft(probe, 0.0)]
    for i in range(3):
        for j in range(5):
            m.submit(f"q{i}-{j}", prompt(70 + 5 * i + j, 3000), 100, 0.0)
        estimates.append(m.predicted_ttft(probe, 0.0))
    assert estimates == sorted(estimates) and len(set(estimates)) == len(estimates)

    # Once every sequence slot is taken, the wait for a slot (decode steps) dominates.
    small = EngineModel(TEST)  # max_num_seqs 4
    waits = []
    for i in range(5):
        waits.append(small.predicted_ttft(prompt(62, 8), 0.0))
        small.submit(f"s{i}", prompt(63 + i, 8), 30, 0.0)
    assert waits[4] - waits[3] > 10 * (waits[3] - waits[2])

    warm = EngineModel(H100)
    _, now = run_one(warm, "seed", probe, 0.0)
    assert warm.cached_prefix_tokens(probe) == 1984
    assert warm.predicted_ttft(probe, now) < warm.predicted_ttft(prompt(61, 2000), now)


def test_readiness_delays_work() -> None:
    m = EngineModel(TEST, ready_at=5.0)
    assert not m.ready(0.0) and not m.ready(4.99) and m.ready(5.0)
    m.submit("a", prompt(80, 8), 2, 0.0)
    assert m.predicted_ttft(prompt(81, 8), 0.0) >= 5.0
    wait = m.step(0.0)
    assert wait is not None and wait.duration == 5.0 and not wait.tokens and not wait.admitted
    results, _ = drain(m, wait.ended_at)
    assert finished(results)["a"].ttft > 5.0


def test_abort_releases_blocks() -> None:
    m = EngineModel(TEST)
    m.submit("a", prompt(90, 12), 50, 0.0)
    m.submit("b", prompt(91, 12), 50, 0.0)
    r = m.step(0.0)
    assert r is not None and m.num_running == 2 and m.free_blocks == 32 - 6
    assert m.abort("a", r.ended_at) and not m.abort("a", r.ended_at)
    assert m.num_running == 1 and m.free_blocks == 32 - 3
    assert m.abort("b", r.ended_at)
    assert m.idle and m.kv_usage == 0.0 and m.step(r.ended_at) is None


# --- profiles and tokenizer --------------------------------------------------------------------


def test_profiles_are_consistent() -> None:
    assert {"h100-llama3-8b", "a10g-llama3-8b", "test"} <= set(PROFILES)
    for p in PROFILES.values():
        assert p.max_model_len <= p.kv_capacity_tokens and p.sources
    assert H100.num_gpu_blocks * H100.block_size > A10G.num_gpu_blocks * A10G.block_size
    for cost in ("prefill_s_per_token", "decode_base_s", "decode_s_per_seq", "decode_s_per_kv_token"):
        assert getattr(H100, cost) < getattr(A10G, cost)
    with pytest.raises(ValueError):
        GpuProfile("bad", 1, 1, 1, 4, 5, 0.0, 0.0, 0.0, 0.0, "")  # 5 > one block of 4


def test_tokenizer_is_stable() -> None:
    # Computed once and written down: any change in the tokenizer breaks every stored prefix.
    ids = [39580, 37126, 16552, 25839, 47332, 6817, 24130, 21796, 13248, 27017, 5280]
    assert tokenize("Hello, world! Tokenizers split long words.") == ids
    assert chat_to_tokens([{"role": "user", "content": "Hi there"}]) == [
        *[50000, 11919, 50001, 7757, 675, 50002],
        *[50000, 1966, 3415, 43626, 50001],
    ]
    text = "The quick brown fox jumps over the lazy dog, again and again, until it is tired. " * 20
    assert 3.5 <= len(text) / len(tokenize(text)) <= 4.5


def test_multi_turn_chats_share_the_earlier_turns_prefix() -> None:
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a prime."}, {"type": "image_url"}]},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another?"}]
    first, second = chat_to_tokens(turn1), chat_to_tokens(turn2)
    assert second[: len(first)] == first
    assert chat_to_tokens([{"role": "user", "content": "Name a prime."}]) == chat_to_tokens(
        [{"role": "user", "content": [{"type": "text", "text": "Name a prime."}]}]
    )
