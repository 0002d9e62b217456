"""LoRA adapters on the simulated engine (vLLM's slot rules and `lora_requests_info`) and the live LoRA
bench through real Envoy, service, Redis and publisher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from extproc.publishers.engines import normalize
from extproc_lab.engines import SimEngine


async def _ask(session: aiohttp.ClientSession, port: int, model: str, tokens: int = 20) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


async def test_adapters_share_the_slots_and_are_published_as_vllm_does() -> None:
    engine = SimEngine("e", "base", token_delay_s=0.01, lora_slots=2, lora_load_s=0.05)
    port = await engine.start("127.0.0.1", 0)
    assert engine.lora is not None
    running_seen: list[int] = []
    try:
        async with aiohttp.ClientSession() as session:
            requests = [asyncio.create_task(_ask(session, port, m)) for m in ("a", "b", "c")]
            published = None
            while not all(t.done() for t in requests):
                running_seen.append(len(engine.lora.running))
                if len(engine.lora.running) == 2 and engine.lora.waiting and published is None:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                        published = normalize("sim", await r.text())
                await asyncio.sleep(0.005)
            assert [t.result() for t in requests] == [200, 200, 200]
            # At most two adapters ran at once; the third waited for a slot, as vLLM's scheduler skips it.
            assert max(running_seen) == 2
            assert published is not None and published.max_lora == 2
            assert set(published.lora_adapters) == {"a", "b", "c"}  # two running, one waiting
            s = engine.stats
            assert (s.lora_hits, s.lora_misses, s.lora_loads) == (0, 3, 3)
            assert list(engine.lora.loaded) == ["b", "c"]  # "a" was evicted (least recent, idle)
            assert await _ask(session, port, "c") == 200  # in GPU memory: a hit, no load
            assert await _ask(session, port, "base") == 200  # the base model takes no slot
            assert (s.lora_hits, s.lora_misses, s.lora_loads) == (1, 3, 3)
            assert not engine.lora.running and not engine.lora.waiting
    finally:
        await engine.stop()


@pytest.mark.integration
async def test_lora_affinity_lands_where_the_adapter_is_loaded_live(tmp_path: Path) -> None:
    """The issue's LoRA target, live and short: 10 adapters, 6 engines of 4 slots; the recommended
    profile against load balancing alone on the same request stream."""
    from extproc_lab.bench.lora_live import run_policy

    short = {"rate": 12.0, "duration_s": 16.0, "warmup_s": 4.0}
    lora = await run_policy("lora", tmp_path / "lora", **short)
    plain = await run_policy("least-outstanding", tmp_path / "plain", **short)
    assert lora.errors == 0 and plain.errors == 0
    assert lora.requests > 100
    assert lora.landed_loaded >= 0.85, lora
    assert lora.landed_loaded > plain.landed_loaded + 0.2, (lora, plain)
    assert lora.max_share_vs_fair <= 2.0, lora
