"""KV-cache events: vLLM's wire format, the engine -> index block translation, the precise index's
agreement with the engine model, and the live path (sim engine ZMQ -> publisher -> Redis -> service).

Wire format: tests/data/vllm-0.33.0-kv-events.json holds payloads encoded by vLLM 0.33.0's own
msgspec classes (see its `made_by`); the decoder must read them and the simulated engine's encoder must
reproduce them byte for byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from extproc.config import config_from_dict
from extproc.fleet import InFlight, SchedulingState, Upstream
from extproc.fleet.kv_index import (
    COMPLETE,
    PARTIAL,
    UNKNOWN,
    KvIndex,
    decode_delta,
    encode_delta,
    encode_full,
)
from extproc.fleet.view import KvHeld
from extproc.openai.parse import Api, InferenceRequest
from extproc.publishers import Publisher, load_publisher_config
from extproc.publishers.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTranslator,
    KVEventBatch,
    KvEventsError,
    KvEventsSource,
    KvEventsSpec,
    decode_batch,
    encode_batch,
    kv_events_spec,
)
from extproc.scheduling.cache_model import CacheModel, Placement
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.server.app import start
from extproc.settings import ConfigError, RedisSettings
from extproc.tokenization import block_hashes
from extproc_lab.bench.workloads import make_workload
from extproc_lab.engines.model import EngineModel
from extproc_lab.engines.profiles import PROFILES
from extproc_lab.engines.server import SimEngine
from extproc_lab.engines.tokens import chat_to_tokens
from extproc_lab.stack import RedisProcess

CAPTURE = json.loads((Path(__file__).parent / "data" / "vllm-0.33.0-kv-events.json").read_text())
H = [bytes([i]) * 32 for i in range(1, 6)]


# -- wire format ---------------------------------------------------------------------------------------


def test_decodes_vllm_capture() -> None:
    b0, b1, b2, b3 = (decode_batch(bytes.fromhex(p)) for p in CAPTURE["payloads"])
    assert b0.ts == 1764567890.25 and b0.data_parallel_rank == 0
    s0, s1 = b0.events
    assert isinstance(s0, BlockStored) and isinstance(s1, BlockStored)
    assert list(s0.block_hashes) == [H[0], H[1]] and s0.parent_block_hash is None
    assert list(s0.token_ids) == list(range(32)) and s0.block_size == 16 and s0.group_idx == 0
    assert s0.medium == "GPU" and s0.lora_id is None
    assert s1.parent_block_hash == H[1] and list(s1.token_ids) == list(range(32, 48))
    assert b1.events == [BlockRemoved([H[2]], "GPU", 0)]
    assert b2.events == [AllBlocksCleared()]
    assert b3.data_parallel_rank is None
    assert b3.events[0].block_hashes == [2**63 + 5]  # type: ignore[union-attr]


def test_encoder_reproduces_vllm_bytes() -> None:
    ours = [
        KVEventBatch(
            1764567890.25,
            [
                BlockStored([H[0], H[1]], None, list(range(32)), 16, group_idx=0),
                BlockStored([H[2]], H[1], list(range(32, 48)), 16),
            ],
            0,
        ),
        KVEventBatch(1764567890.5, [BlockRemoved([H[2]], "GPU", 0)], 0),
        KVEventBatch(1764567891.0, [AllBlocksCleared()], 0),
        KVEventBatch(1764567892.0, [BlockStored([2**63 + 5], None, list(range(16)), 16)]),
    ]
    assert [encode_batch(b).hex() for b in ours] == CAPTURE["payloads"]


def test_decodes_array_like_events_and_rejects_garbage() -> None:
    # SGLang (and vLLM before events became maps): [ts, events] with tagged arrays, int hashes.
    payload = msgpack.packb(
        [
            2.5,
            [
                ["BlockStored", [11, 12], None, list(range(8)), 4, None],
                ["BlockRemoved", [12]],
                ["AllBlocksCleared"],
                ["SomethingNew", 1],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored([11, 12], None, list(range(8)), 4, None, None, None, None),
        BlockRemoved([12], None, None),
        AllBlocksCleared(),
    ]
    for bad in (b"\xc1", msgpack.packb({"x": 1}), msgpack.packb([1.0, [["BlockStored", [1]]]])):
        with pytest.raises(KvEventsError):
            decode_batch(bad)


# -- translation ---------------------------------------------------------------------------------------


def _engine_blocks(tokens: list[int], bs: int) -> list[bytes]:
    return [h for h in block_hashes(tokens, bs, seed=b"engine")]  # any chained hash stands in


@pytest.mark.parametrize(("bs", "bt"), [(16, 64), (16, 16), (16, 40), (32, 16)])
def test_translator_hashes_as_the_service_does(bs: int, bt: int) -> None:
    rng = random.Random(bs * 100 + bt)
    tr = BlockTranslator(bt)
    shared = [rng.randrange(50_000) for _ in range(5 * bs)]
    prompts = [shared + [rng.randrange(50_000) for _ in range(rng.randrange(0, 12 * bs))] for _ in range(6)]
    for tokens in prompts:
        eh = _engine_blocks(tokens, bs)
        # stored in uneven pieces, as steps and chunked prefill do
        start = 0
        while start < len(eh):
            end = min(len(eh), start + rng.randrange(1, 4))
            tr.apply(
                BlockStored(
                    eh[start:end], eh[start - 1] if start else None, tokens[start * bs : end * bs], bs
                )
            )
            start = end
    want: set[bytes] = set()
    for tokens in prompts:
        full = len(tokens) // bs * bs  # only full engine blocks are cached
        want.update(block_hashes(tokens[:full], bt))
    assert set(tr.held) == want
    for tokens in prompts:
        assert tr.matched(block_hashes(tokens, bt)) == (len(tokens) // bs * bs) // bt
    # Removing an engine block drops every index block it is part of, and only those.
    victim = prompts[0]
    eh = _engine_blocks(victim, bs)
    tr.apply(BlockRemoved([eh[-1]]))
    last_end = len(eh) * bs
    expect = sum(1 for i in range(1, last_end // bt + 1) if i * bt <= last_end - bs)
    assert tr.matched(block_hashes(victim, bt)) == expect
    tr.apply(BlockRemoved([eh[0]]))
    assert all(tr.matched(block_hashes(p, bt)) == 0 for p in prompts) or bt > bs * 5
    tr.apply(AllBlocksCleared())
    assert len(tr) == 0 and tr.take_delta()[0] is True


def test_translator_skips_unknown_parents_lora_and_bounds_memory() -> None:
    tr = BlockTranslator(16, max_engine_blocks=8)
    tokens = list(range(64))
    eh = _engine_blocks(tokens, 16)
    tr.apply(BlockStored(eh[2:], eh[1], tokens[32:], 16))  # parent never seen: nothing learnt
    assert len(tr) == 0 and tr.stats.unknown_parent == 2
    tr.apply(BlockStored(eh, None, tokens, 16, lora_id=3))
    assert len(tr) == 0 and tr.stats.ignored == 1
    tr.apply(BlockStored(eh, None, tokens, 16, medium="CPU"))
    assert len(tr) == 0
    more = list(range(1000, 1160))
    tr.apply(BlockStored(_engine_blocks(more, 16), None, more, 16))  # 10 blocks > 8: dropped
    assert len(tr) == 0 and tr.stats.overflows == 1


# -- the precise index against the engine model --------------------------------------------------------

BS = 16
BT = 64  # predicted-ttft's block_tokens


def _agreement(
    workload: str, blocks: int, rate: float, lag_s: float = 0.0, **params: Any
) -> dict[str, float]:
    """Replay one workload into one engine model. At each submission (the routing decision) predict
    the prompt's cached prefix, in index blocks, two ways: from the KV-event index and from the
    approximate CacheModel (learnt from decisions alone, sized from the engine's capacity). Events
    reach the index `lag_s` virtual seconds after the step that made them.

    Two truths: `state` is what the engine holds at that moment (`cached_prefix_tokens`): what an
    index can know; `outcome` is what the request finds at its admission, after queueing, when the
    engine may have evicted or computed more. For `outcome` the precise index is united with the
    router's own placements not yet reported, as predicted-ttft does."""
    profile = dataclasses.replace(
        PROFILES["a10g-llama3-8b"], num_gpu_blocks=blocks, max_model_len=blocks * BS
    )
    engine = EngineModel(profile, kv_events=True)
    translator = BlockTranslator(BT)
    model = CacheModel(blocks * BS // BT)
    wl = make_workload(workload, rate=rate, count=300, seed=3, **params)
    index_only: dict[str, int] = {}
    united: dict[str, int] = {}
    approx: dict[str, int] = {}
    state: dict[str, int] = {}
    cap: dict[str, int] = {}
    placements: dict[str, Placement] = {}
    actual: dict[str, int] = {}
    in_flight: list[tuple[float, list[Any]]] = []  # (deliver at, events)
    now = 0.0

    def deliver(t: float) -> None:
        while in_flight and in_flight[0][0] <= t:
            for ev in in_flight.pop(0)[1]:
                translator.apply(ev)

    def run_until(t: float | None) -> None:
        nonlocal now
        while t is None or now < t:
            result = engine.step(now)
            if result is None:
                if t is not None:
                    now = t
                deliver(now)
                return
            now = result.ended_at
            in_flight.append((now + lag_s, engine.drain_kv_events()))
            deliver(now)
            for done in result.finished:
                actual[done.request_id] = done.cached_tokens
                model.release(placements.pop(done.request_id))

    for i, req in enumerate(wl.requests):
        run_until(req.arrival_s)
        ids = chat_to_tokens(req.body["messages"])
        if len(ids) >= profile.max_model_len - 1:
            continue
        hashes = block_hashes(ids, BT)
        key = str(i)
        cap[key] = (len(ids) - 1) // BS * BS // BT  # whole index blocks the engine could serve
        state[key] = engine.cached_prefix_tokens(ids) // BT
        index_only[key] = min(translator.matched(hashes), cap[key])
        united[key] = min(model.matched_with(hashes, translator.holds), cap[key])
        approx[key] = min(model.matched(hashes), cap[key])
        placements[key] = model.place(hashes, math.ceil(req.body["max_tokens"] / BT))
        engine.submit(key, ids, req.body["max_tokens"], now)
    run_until(None)
    keys = list(actual)
    outcome = {k: min(actual[k] // BT, cap[k]) for k in keys}

    def share(pred: dict[str, int], truth: dict[str, int]) -> float:
        return round(sum(pred[k] == truth[k] for k in keys) / len(keys), 3)

    return {
        "requests": len(keys),
        "state_precise": share(index_only, state),
        "state_approx": share(approx, state),
        "outcome_precise": share(united, outcome),
        "outcome_approx": share(approx, outcome),
    }


CASES = [
    # 24 tenants x 1000-token prompts = 24k tokens of prefixes vs 9.6k of KV: constant eviction.
    ("shared-prefix", 600, 1.5, {"tenants": 24, "system_tokens": 1000}),
    ("shared-prefix", 4000, 1.5, {"tenants": 8, "system_tokens": 1000}),
    # Growing chats: each turn extends the last one's prefix, replies included.
    ("multi-turn", 1200, 2.0, {"conversations": 12}),
    ("multi-turn", 500, 2.0, {"conversations": 12}),
]


@pytest.mark.parametrize(("workload", "blocks", "rate", "params"), CASES)
def test_precise_index_agrees_with_the_engine(
    workload: str, blocks: int, rate: float, params: dict[str, Any]
) -> None:
    got = _agreement(workload, blocks, rate, **params)
    lagged = _agreement(workload, blocks, rate, lag_s=0.1, **params)
    print(f"\n{workload} blocks={blocks} rate={rate} {params}:\n  lag 0: {got}\n  lag 0.1 s: {lagged}")
    assert got["requests"] > 200
    assert got["state_precise"] == 1.0, got  # the index holds exactly what the engine holds
    assert lagged["state_precise"] >= 0.9, lagged  # 100 ms of event lag: the newest blocks are missed
    assert got["state_precise"] >= got["state_approx"], got
    assert got["outcome_precise"] >= got["outcome_approx"] - 0.02, got


# -- the service's index ------------------------------------------------------------------------------


def _h(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_index_applies_deltas_in_order_and_resyncs_from_full_sets() -> None:
    clock = [0.0]
    index = KvIndex(stale_after_s=3.0, clock=lambda: clock[0])
    uid = "c0/10.0.0.1:8000"

    def delta(
        seq: int,
        added: tuple[int, ...] = (),
        removed: tuple[int, ...] = (),
        cleared: bool = False,
        k: int = 2,
    ) -> str:
        blob = encode_delta(uid, 7, seq, [_h(i) for i in added], [_h(i) for i in removed], cleared, None, k)
        d = decode_delta(blob)
        assert d is not None
        return index.apply_delta(d)

    def held() -> set[bytes] | None:
        got = index.blocks(uid)
        return None if got is None else got.blocks

    assert delta(5, (1, 2)) == "buffered" and held() is None  # no start point yet
    assert index.apply_full(encode_full(uid, 7, 5, [_h(1), _h(2)]))
    assert held() == {_h(1), _h(2)}
    assert index.holding(_h(2)) == [uid, "c0"]  # the cluster's only instance: its id too
    assert index.holding(_h(3)) == []
    assert delta(6, (3,), (1,)) == "applied" and held() == {_h(2), _h(3)}
    assert delta(6, (9,)) == "old"
    assert delta(8, (4,)) == "buffered" and held() is None and index.gaps == 1  # 7 was lost
    assert index.out_of_sync() == [uid]
    assert index.apply_full(encode_full(uid, 7, 7, [_h(2), _h(3), _h(5)]))  # buffered 8 replays after it
    assert held() == {_h(2), _h(3), _h(5), _h(4)}
    assert delta(9, (), (), cleared=True) == "applied" and held() == set()  # engine restarted
    assert delta(10, (1,), k=1) == "applied"  # the publisher lost events: a lower bound now
    assert index.holding(_h(1)) == [uid, "c0"]
    got = index.blocks(uid)
    assert got is not None and got.blocks == {_h(1)} and not got.complete
    assert delta(11, k=0) == "applied" and index.blocks(uid) is None  # the engine's socket is down
    assert index.holding(_h(1)) == []
    assert delta(12, k=2) == "applied" and held() == {_h(1)}
    clock[0] = 3.5
    assert index.blocks(uid) is None  # no word (not even a heartbeat) for longer than stale_after_s
    assert index.holding(_h(1)) == []
    assert delta(13) == "applied" and held() == {_h(1)}  # a heartbeat
    # A new publisher epoch starts over from its first clear or full set.
    d = decode_delta(encode_delta(uid, 8, 1, [_h(1)], [], False, None))
    assert d is not None and index.apply_delta(d) == "buffered" and index.blocks(uid) is None
    assert decode_delta(b"junk") is None and not index.apply_full(msgpack.packb({"u": uid}))
    assert decode_delta(encode_delta(uid, 8, 2, [], [], False, None, 5)) is None


def test_instances_that_left_are_forgotten() -> None:
    """The index keeps a set per instance: one whose publisher went silent (no delta, no heartbeat)
    for `forget_after_s` is dropped at the feed's next prune, its gauge series with it; one whose
    endpoint discovery takes out of the pool is dropped at once. The sizes return to the baseline."""
    from extproc.discovery import PoolUpdater
    from extproc.fleet.kv_index import KvIndexFeed
    from extproc.lifecycle import RequestLifecycle
    from extproc.telemetry import Metrics

    clock = [0.0]
    index = KvIndex(stale_after_s=3.0, clock=lambda: clock[0], forget_after_s=300.0)
    metrics = Metrics(["m"], ["c0"])
    feed = KvIndexFeed(RedisSettings(), index, metrics)
    alive = "c0/10.0.0.1:8000"

    def heartbeat(uid: str, seq: int) -> None:
        d = decode_delta(encode_delta(uid, 1, seq, [], [], False, None))
        assert d is not None and index.apply_delta(d) == "applied"

    assert index.apply_full(encode_full(alive, 1, 1, [_h(1), _h(2)]))
    feed.maintain(0.0)
    baseline = index.sizes()
    pods = [f"c0/10.1.0.{i}:8000" for i in range(40)]
    for i, uid in enumerate(pods):
        assert index.apply_full(encode_full(uid, 1, 1, [_h(100 + i), _h(200 + i)]))
    feed.maintain(1.0)
    assert len(index.sizes()) == 41
    series = "llm_extproc_kv_index_blocks"
    assert metrics.registry.get_sample_value(series, {"upstream": pods[0]}) == 2
    for t in range(60, 361, 60):  # the pods' publishers stopped; the live one heartbeats
        clock[0] = float(t)
        heartbeat(alive, t // 60 + 1)
        feed.maintain(float(t))  # the feed prunes every PRUNE_EVERY_S of its own loop's time
    assert index.sizes() == baseline and index.out_of_sync() == []
    assert index._by_cluster == {"c0": [alive]}
    assert index.holding(_h(1)) == [alive, "c0"]  # the cluster's only instance again
    assert metrics.registry.get_sample_value(series, {"upstream": pods[0]}) is None

    # Discovery takes endpoints out of the pool: the lifecycle forgets their sets at once.
    cfg = config_from_dict(
        {
            "routing": "endpoint",
            "metrics_listen": None,
            "pool": {"clusters": [{"name": "c0", "models": ["m"], "endpoints": ["10.0.0.1:8000"]}]},
        }
    )
    lc = RequestLifecycle(cfg, metrics)
    lc.state.kv = index
    update = PoolUpdater(cfg.pool)
    update("c0", ("10.0.0.1:8000", *(p.partition("/")[2] for p in pods)))
    for i, uid in enumerate(pods):
        assert index.apply_full(encode_full(uid, 1, 1, [_h(300 + i)]))
    assert len(index.sizes()) == 41
    update("c0", ("10.0.0.1:8000",))
    assert index.sizes() == baseline


def test_kv_events_config() -> None:
    assert kv_events_spec(None, "x") is None
    assert kv_events_spec(True, "x") == KvEventsSpec()
    spec = kv_events_spec({"port": 6000, "topic": "kv-events", "block_tokens": 32}, "x")
    assert spec == KvEventsSpec(port=6000, topic="kv-events", block_tokens=32)
    for bad in ({"port": 0}, {"nope": 1}, {"topic": 3}, "5557"):
        with pytest.raises(ConfigError):
            kv_events_spec(bad, "x")


def test_source_counts_gaps_and_restarts() -> None:
    source = KvEventsSource(
        "c/1.2.3.4:8000", "1.2.3.4:8000", KvEventsSpec(block_tokens=16), RedisSettings(), None
    )
    tokens = list(range(32))
    eh = _engine_blocks(tokens, 16)

    def send(seq: int, *events: Any) -> None:
        source.handle([b"", seq.to_bytes(8, "big"), encode_batch(KVEventBatch(1.0, list(events), 0))])

    assert source.knowledge == UNKNOWN  # nothing heard yet
    send(0, BlockStored(eh, None, tokens, 16))  # an engine's first batch: it started empty
    assert len(source.translator) == 2 and source.knowledge == COMPLETE
    send(2, BlockRemoved([eh[1]]))  # seq 1 lost: what was mapped may be wrong, so it is dropped
    assert source.stats.gaps == 1 and len(source.translator) == 0 and source.knowledge == PARTIAL
    send(3, BlockStored(eh, None, tokens, 16))
    source.disconnected()  # the socket dropped: unknown until the next batch says why
    assert source.knowledge == UNKNOWN and len(source.translator) == 2
    send(4, AllBlocksCleared())  # the network, not a restart; and the engine reset its cache
    assert source.knowledge == COMPLETE and len(source.translator) == 0
    send(5, BlockStored(eh, None, tokens, 16))
    source.disconnected()
    send(0, BlockStored(eh[:1], None, tokens[:16], 16))  # seq went back: a new engine process
    assert source.stats.restarts == 1 and len(source.translator) == 1 and source.knowledge == COMPLETE
    late = KvEventsSource("c/x:1", "1.2.3.4:1", KvEventsSpec(block_tokens=16), RedisSettings(), None)
    late.handle([b"", (7).to_bytes(8, "big"), encode_batch(KVEventBatch(1.0, [], 0))])
    assert late.knowledge == PARTIAL  # joined mid-stream: the engine may hold blocks stored before
    source.handle([b"", b"\x00", b""])
    assert source.stats.bad == 1


# -- live: simulated engine (ZMQ) -> llm-extproc publish -> Redis -> the service ------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_live_index_fills_predicts_exactly_and_clears_on_restart(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    profile = PROFILES["a10g-llama3-8b"]
    engine = SimEngine("e0", "m", profile=profile, time_scale=20.0, kv_events_port=0)
    port = await engine.start("127.0.0.1", 0)
    kv_port = engine.kv_events_port
    assert kv_port
    address = f"127.0.0.1:{port}"
    uid = f"c0/{address}"
    config_file = tmp_path / "publisher.yaml"
    config_file.write_text(
        json.dumps(
            {
                "redis": {"url": redis_server.url},
                "interval_s": 0.2,
                "instances": [
                    {
                        "cluster": "c0",
                        "address": address,
                        "models": ["m"],
                        "kv_events": {"port": kv_port, "flush_s": 0.02, "heartbeat_s": 0.2},
                    }
                ],
            }
        )
    )
    publisher = Publisher(load_publisher_config(str(config_file)))
    stop = asyncio.Event()
    publishing = asyncio.create_task(publisher.run(stop))
    service = await start(
        config_from_dict(
            {
                "pool": {"clusters": [{"name": "c0", "models": ["m"], "endpoints": [address]}]},
                "routing": "endpoint",
                "listen": "127.0.0.1:0",
                "metrics_listen": None,
                "fleet": {"url": redis_server.url},
            }
        )
    )
    state = service.lifecycle.state
    scorer = PredictedTtftScorer()
    messages = [
        {"role": "system", "content": "You are a careful assistant for the billing team. " * 60},
        {"role": "user", "content": "Why was I charged twice this month?"},
    ]
    ids = chat_to_tokens(messages)  # the service must tokenize as the engine does (here: the same ids)
    hashes = block_hashes(ids, scorer.block_tokens)

    def request() -> InferenceRequest:
        return InferenceRequest(Api.CHAT, "m", False, 4, "", ids, None, None, 0, 0, prompt_tokens=len(ids))

    async def chat(session: aiohttp.ClientSession, msgs: list[dict[str, str]] | None = None) -> None:
        body = {"model": "m", "messages": msgs or messages, "max_tokens": 4}
        async with session.post(f"http://{address}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.read()

    def complete(at_least: int) -> bool:
        held = state.kv_blocks(uid)
        return held is not None and held.complete and len(held.blocks) >= at_least

    def engine_cached_blocks() -> int:
        assert engine.driver is not None
        return engine.driver.model.cached_prefix_tokens(ids) // scorer.block_tokens

    try:
        await _until(lambda: publisher.kv_events is not None and uid in publisher.kv_events.sources)
        assert publisher.kv_events is not None
        source = publisher.kv_events.sources[uid]
        await _until(lambda: source.stats.connections >= 1)
        await asyncio.sleep(0.3)  # the subscription reaches the engine's PUB socket
        assert state.kv_blocks(uid) is None  # no batch seen yet: unknown, the cache model decides
        async with aiohttp.ClientSession() as session:
            await chat(session)
            cached = engine_cached_blocks()
            assert cached == (len(ids) - 1) // 16 * 16 // scorer.block_tokens > 10
            await _until(lambda: complete(cached))
            upstream = service.lifecycle.config.pool.candidates("m")[0]
            scorer.score(request(), [upstream], state)
            # The predicted uncached prefill is exactly what the engine would compute.
            assert scorer.predictor._last.facts[uid].uncached == len(ids) - cached * scorer.block_tokens
            assert set(hashes[:cached]) <= state.kv_blocks(uid).blocks  # type: ignore[union-attr]
            # Learnt from deltas, or from the full copy when the subscription started after them.
            assert any(
                service.metrics.registry.get_sample_value(
                    "llm_extproc_kv_index_messages_total", {"outcome": outcome}
                )
                for outcome in ("applied", "full")
            )
            reg = service.metrics.registry
            lag_n = reg.get_sample_value("llm_extproc_kv_event_lag_seconds_count") or 0.0
            lag_sum = reg.get_sample_value("llm_extproc_kv_event_lag_seconds_sum") or 0.0
            assert lag_n > 0
            print(
                f"\nevent lag, engine batch -> service: mean {lag_sum / lag_n * 1000:.1f} ms over {lag_n:.0f}"
            )

            # A restart: the engine's socket goes away (and its sequence starts again at 0).
            await engine.stop()
            await _until(lambda: state.kv_blocks(uid) is None)  # unknown: its socket went away
            engine = SimEngine("e0", "m", profile=profile, time_scale=20.0, kv_events_port=kv_port)
            assert await engine.start("127.0.0.1", port) == port
            # ZMQ's slow joiner: events published before the subscription reaches the new engine are
            # lost (vLLM's too), so wait for the reconnection before sending work.
            source = publisher.kv_events.sources[uid]
            await _until(lambda: source.stats.connections >= 2)
            await asyncio.sleep(0.3)
            other = [{"role": "user", "content": "An unrelated question about the weather today. " * 20}]
            await chat(session, other)  # seq 0 again: a new engine, empty at its start
            await _until(lambda: complete(1))
            assert hashes[0] not in state.kv_blocks(uid).blocks  # type: ignore[union-attr]
            scorer.score(request(), [upstream], state)
            assert scorer.predictor._last.facts[uid].uncached == len(ids)  # the old engine's blocks are gone
            await chat(session)
            await _until(lambda: complete(cached))

            # A lost batch: the publisher sees the sequence gap, drops its mapping and clears the set.
            assert engine.kv_publisher is not None
            engine.kv_publisher.skip_next = 1
            messages[1]["content"] = "And why is the second charge bigger than the first one? " * 8
            await chat(session)  # its new blocks' batch is the one skipped
            messages[1]["content"] = "Please refund the second charge to the card I paid with. " * 8
            await chat(session)  # this one arrives after the gap
            await _until(
                lambda: (
                    publisher.metrics.value(
                        "llm_extproc_publisher_kv_events_total", upstream=uid, kind="gaps"
                    )
                    >= 1
                )
            )
            await _until(lambda: (h := state.kv_blocks(uid)) is not None and not h.complete)
            held = state.kv_blocks(uid)
            assert held is not None and len(held.blocks) < cached  # a lower bound, the rest unmapped
        restarts = publisher.metrics.value(
            "llm_extproc_publisher_kv_events_total", upstream=uid, kind="restarts"
        )
        assert restarts >= 1
    finally:
        stop.set()
        await publishing
        await service.stop(0)
        await engine.stop()


def test_predicted_ttft_reads_the_engines_set_only_when_it_can_match_it() -> None:
    """Complete set: the engine's word (plus own pinned placements). Incomplete: whichever of the set
    and the cache model says more. No token ids (text estimate): the cache model alone."""
    up = [
        Upstream("c0/10.0.0.1:1", "c0", "10.0.0.1:1", 1.0),
        Upstream("c0/10.0.0.2:1", "c0", "10.0.0.2:1", 1.0),
    ]
    ids = list(range(1000, 1000 + 64 * 10 + 5))
    hashes = block_hashes(ids, 64)
    sets: dict[str, KvHeld] = {}

    class Index:
        def blocks(self, upstream_id: str) -> KvHeld | None:
            return sets.get(upstream_id)

    state = SchedulingState(InFlight(), None)
    state.kv = Index()

    def uncached(token_ids: list[int] | None) -> dict[str, int]:
        scorer = PredictedTtftScorer()
        req = InferenceRequest(Api.CHAT, "m", False, 4, "x" * 2600, token_ids, None, None, 0, 0)
        scorer.score(req, up, state)
        return {uid: f.uncached for uid, f in scorer.predictor._last.facts.items()}

    assert uncached(ids) == {up[0].id: len(ids), up[1].id: len(ids)}
    sets[up[0].id] = KvHeld(set(hashes[:6]))
    sets[up[1].id] = KvHeld(set(hashes[1:9]))  # the first block evicted: nothing usable
    assert uncached(ids) == {up[0].id: len(ids) - 6 * 64, up[1].id: len(ids)}
    assert uncached(None) == {up[0].id: 2600 // 4, up[1].id: 2600 // 4}  # text: the engines' sets unused
    # The cache model believes up[1] holds the prompt (sent there, finished: cached, evictable).
    scorer = PredictedTtftScorer()
    req = InferenceRequest(Api.CHAT, "m", False, 4, "", ids, None, None, 0, 0)
    scorer.on_pick(req, up[1], state)
    scorer.on_finish(req, up[1])

    def rescored() -> int:
        scorer.predictor._last = type(scorer.predictor._last)()
        scorer.score(req, up, state)
        return scorer.predictor._last.facts[up[1].id].uncached

    sets[up[1].id] = KvHeld(set())  # complete: the engine evicted it, whatever the model believes
    assert rescored() == len(ids)
    sets[up[1].id] = KvHeld(set(), complete=False)  # a lower bound: the model's belief counts
    assert rescored() == len(ids) - 10 * 64


def test_a_large_pool_pre_selects_the_holders_the_engines_report() -> None:
    """Past `max_evaluated` candidates, an engine whose KV events show the prompt's first block is
    among those predicted, found by one pass over the index (kv_holders), though this router never
    sent it the prompt; a set that is not synced counts for nothing."""
    clock = [0.0]
    index = KvIndex(clock=lambda: clock[0])
    ups = [Upstream(f"c{i}/10.0.0.{i}:1", f"c{i}", f"10.0.0.{i}:1", 1.0) for i in range(40)]
    ids = list(range(5000, 5000 + 64 * 20))
    hashes = block_hashes(ids, 64)
    holder, lost = ups[17].id, ups[23].id
    assert index.apply_full(encode_full(holder, 1, 1, hashes))
    d = decode_delta(encode_delta(lost, 1, 4, hashes, [], False, None))
    assert d is not None and index.apply_delta(d) == "buffered"  # no full set yet: not synced
    state = SchedulingState(InFlight(), None)
    state.kv = index
    assert state.kv_holders(hashes[0]) == [holder, "c17"]
    req = InferenceRequest(Api.CHAT, "m", False, 4, "", ids, None, None, 0, 0)
    for seed in range(20):
        scorer = PredictedTtftScorer(max_evaluated=6)
        scorer.predictor._rng.seed(seed)
        scores = dict(zip((u.id for u in ups), scorer.score(req, ups, state), strict=True))
        assert scores[holder] == 1.0, seed  # predicted, and the best: the whole prompt is cached there
        assert sum(1 for v in scores.values() if v > 0) == 6


def test_fleet_bench_measures_decisions_with_holders_by_kv_events() -> None:
    """`bench-fleet`'s KV-event case runs through the lifecycle with token ids and sets up holders in
    the index (a check that the bench runs; timings are the bench's output, not asserted)."""
    from extproc_lab.bench.fleet_state import decision_latency

    r = decision_latency(20, "endpoint", 30, held_share=0.5, prompt_words=300)
    assert r["candidates"] == 20 and 0 < int(r["kv_holders"]) < 20
