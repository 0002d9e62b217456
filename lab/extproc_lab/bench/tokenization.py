"""`llm-extproc bench-tokenization`: what the tokenization stage costs on the request path.

Nothing is downloaded: a byte-level BPE (32k vocabulary) is trained here on the workloads' pseudo-text
and given a Llama-3-style chat template, so the figures are for a real `tokenizers` model of ordinary
size, not for any particular published one. Measured through `RequestLifecycle.route_async`, the path
the ext_proc stream takes:

- encode throughput (tokens/s) of uncached prompts of ~1k and ~8k tokens and of a 200 KB prompt;
- the latency tokenization adds to a routing decision (with a tokenizer vs the estimate), p50/p99, for
  each size, uncached and repeated;
- the per-segment cache's hit rate over multi-turn chats (each turn resends the history);
- the longest event-loop stall while 200 KB prompts are routed, seen by a 1 ms ticker.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from extproc.config import config_from_dict
from extproc.lifecycle import RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.server.app import freeze_heap
from extproc.settings import GIL_SWITCH_INTERVAL_S
from extproc.telemetry import Metrics
from extproc_lab.bench.workloads import pseudo_text

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_STYLE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions"},
    session_header="x-session-id",
    user_header="x-user-id",
    priority_header="x-llm-priority",
)


def train_tokenizer(folder: Path, vocab_size: int = 32_000, seed: int = 0) -> dict[str, str]:
    """A byte-level BPE trained on pseudo-text, saved with a chat template; returns its config entry."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = [pseudo_text(rng, 400) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": LLAMA3_STYLE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        )
    )
    return {"tokenizer_json": "tokenizer.json", "tokenizer_config": "tokenizer_config.json"}


def _lifecycle(folder: Path, tokenizer: dict[str, str] | None) -> RequestLifecycle:
    raw: dict[str, Any] = {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "metrics_listen": None}
    if tokenizer is not None:
        raw["tokenizers"] = {"m": tokenizer}
    cfg = config_from_dict(raw, base_dir=folder)
    return RequestLifecycle(cfg, Metrics(["m"], ["a"]))


def _chat(messages: list[dict[str, str]]) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages})


async def _timed_route(lc: RequestLifecycle, body: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    d = await lc.route_async(HEAD, body)
    elapsed = time.perf_counter() - t0
    lc.finish(d, "response_end")
    return elapsed, d.request.prompt_tokens or 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _sizes(folder: Path, tokenizer: dict[str, str], runs: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    exact, estimate = _lifecycle(folder, tokenizer), _lifecycle(folder, None)
    rows = []
    for label, tokens in (("1k tokens", 1000), ("8k tokens", 8000), ("200 KB", 51_000)):
        texts = [pseudo_text(rng, tokens) for _ in range(runs)]
        if label == "200 KB":
            texts = [t[:200_000] for t in texts]
        bodies = [_chat([{"role": "user", "content": t}]) for t in texts]
        cold, counts = [], []
        for b in bodies:
            s, n = await _timed_route(exact, b)
            cold.append(s)
            counts.append(n)
        warm = [(await _timed_route(exact, b))[0] for b in bodies]
        base = [(await _timed_route(estimate, b))[0] for b in bodies]
        base_p50 = statistics.median(base)
        rows.append(
            {
                "prompt": label,
                "tokens": int(statistics.median(counts)),
                "tokens_per_s_uncached": sum(counts) / sum(c - b for c, b in zip(cold, base, strict=True)),
                "added_ms_p50_uncached": (statistics.median(cold) - base_p50) * 1000,
                "added_ms_p99_uncached": (_pct(cold, 0.99) - base_p50) * 1000,
                "added_ms_p50_repeat": (statistics.median(warm) - base_p50) * 1000,
                "added_ms_p99_repeat": (_pct(warm, 0.99) - base_p50) * 1000,
                "estimate_route_ms_p50": base_p50 * 1000,
            }
        )
    return rows


async def _multi_turn(folder: Path, tokenizer: dict[str, str], chats: int, turns: int) -> dict[str, Any]:
    rng = random.Random(2)
    lc = _lifecycle(folder, tokenizer)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": pseudo_text(rng, 300)}] for _ in range(chats)
    ]
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": pseudo_text(rng, rng.randint(50, 200))})
            await _timed_route(lc, _chat(history))
            history.append({"role": "assistant", "content": pseudo_text(rng, rng.randint(50, 200))})
    sample = lc.metrics.registry.get_sample_value
    hit = sample("llm_extproc_tokenized_tokens_total", {"cache": "hit"}) or 0.0
    miss = sample("llm_extproc_tokenized_tokens_total", {"cache": "miss"}) or 0.0
    return {"conversations": chats, "turns": turns, "token_hit_rate": hit / max(1.0, hit + miss)}


async def _stall(folder: Path, tokenizer: dict[str, str], prompts: int) -> dict[str, Any]:
    rng = random.Random(3)
    lc = _lifecycle(folder, tokenizer)
    freeze_heap()  # as `llm-extproc serve` does once started
    bodies = [
        _chat([{"role": "user", "content": pseudo_text(rng, 51_000)[:200_000]}]) for _ in range(prompts)
    ]
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - t0 - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        for b in bodies:
            await _timed_route(lc, b)
    finally:
        done.set()
        await task
        gc.unfreeze()  # this process goes on (tests): what it frees later must be collectable
    return {"prompts_200kb": prompts, "max_event_loop_stall_ms": worst * 1000}


async def run_tokenization_bench(out_dir: Path, runs: int = 20) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as `llm-extproc serve` runs
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llm-extproc-tok-") as tmp:
        folder = Path(tmp)
        print("training a 32k-vocabulary byte-level BPE on pseudo-text (nothing is downloaded)...")
        tokenizer = train_tokenizer(folder)
        sizes = await _sizes(folder, tokenizer, runs)
        turns = await _multi_turn(folder, tokenizer, chats=40, turns=10)
        stall = await _stall(folder, tokenizer, prompts=10)
    header = ("prompt", "tokens", "tok/s", "+ms p50", "+ms p99", "repeat p50", "repeat p99")
    print(f"{header[0]:<10} " + " ".join(f"{h:>10}" for h in header[1:]))
    for r in sizes:
        print(
            f"{r['prompt']:<10} {r['tokens']:>10} {r['tokens_per_s_uncached']:>10.0f} "
            f"{r['added_ms_p50_uncached']:>10.2f} {r['added_ms_p99_uncached']:>10.2f} "
            f"{r['added_ms_p50_repeat']:>10.2f} {r['added_ms_p99_repeat']:>10.2f}"
        )
    print(
        f"multi-turn ({turns['conversations']} chats x {turns['turns']} turns): "
        f"{turns['token_hit_rate']:.1%} of prompt tokens from the per-segment cache"
    )
    print(
        f"longest event-loop stall while routing {stall['prompts_200kb']} x 200 KB: "
        f"{stall['max_event_loop_stall_ms']:.2f} ms"
    )
    path = out_dir / "tokenization.json"
    path.write_text(json.dumps({"sizes": sizes, "multi_turn": turns, "event_loop": stall}, indent=2))
    print(f"results: {path}")
    return 0
