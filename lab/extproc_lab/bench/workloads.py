"""Named benchmark workloads: OpenAI chat requests with open-loop arrival times, generated locally.

Nothing is downloaded: prompt and reply text is pseudo-words drawn from a fixed vocabulary, at
``CHARS_PER_TOKEN`` (4) characters per token, so a request's size is known without a tokenizer (the
simulated engines count prompt tokens the same way, ``len(body) // 4``; a real BPE tokenizer will count
pseudo-words somewhat differently). Everything is deterministic from ``seed``: arrival times come from
one random stream and text from another, so changing ``rate`` rescales the arrivals of the Poisson
workloads without changing their requests.

Every request is ``{"model", "messages", "max_tokens", "stream": True, "stream_options":
{"include_usage": True}}`` so that the final SSE chunk carries ``usage`` (prompt, completion and cached
tokens) for the report. Arrivals are open loop: a request is sent at its time whether or not earlier
ones have finished, as real users would.

Length distributions (tokens; ``U[a, b]`` is uniform over integers, inclusive):

==============  ==============================  ==================================  =============  ==========
workload        arrivals                        prompt                              output         tag
==============  ==============================  ==================================  =============  ==========
shared-prefix   Poisson(rate)                   system 2000 (one per tenant, T=16)  U[50, 200]     tenant-NNN
                                                + user U[50, 200]; tenant ~ Zipf(1)
multi-turn      Poisson(rate): C conversations  history of earlier turns            U[50, 200]     conv-NNNN
                each Poisson(rate / C), mean    + user U[50, 200]; 10 turns, then
                gap (think time) C / rate = 2s  the slot starts a new conversation
long-context    Poisson(rate)                   95%: U[200, 1000];                  U[50, 200]     short/long
                                                exactly 5% of requests: U[8k, 30k]
bursty          on/off Poisson: 10% of each     U[100, 1000]                        U[50, 200]     burst/base
                10 s cycle at 5x rate, the
                rest at (1 - 0.5) / 0.9 x rate
==============  ==============================  ==================================  =============  ==========

Each factory takes ``rate`` (mean requests/s), ``count`` (requests), ``seed`` and ``model`` plus the
workload's own keyword parameters (defaults above); ``WORKLOADS`` maps the kebab-case names to them.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

CHARS_PER_TOKEN = 4
DEFAULT_MODEL = "sim-llama"

Range = tuple[int, int]


class WorkloadRequest(NamedTuple):
    """One request of a workload: when to send it (seconds from the start), what, and a grouping tag."""

    arrival_s: float
    body: dict[str, Any]
    tag: str


@dataclass(slots=True)
class Workload:
    """A named, fully generated request list; ``params`` are the effective parameters, for reports."""

    name: str
    params: dict[str, Any]
    requests: list[WorkloadRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    """Per-request headers, parallel to `requests` (empty: none), e.g. from `with_priorities`."""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request: how long sending takes, not counting the replies."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def arrivals(self) -> list[float]:
        return [r.arrival_s for r in self.requests]

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    def tags(self) -> list[str]:
        return [r.tag for r in self.requests]


# ---------------------------------------------------------------------------------------------- text


def _build_vocab(size: int = 4096) -> tuple[str, ...]:
    """Pronounceable pseudo-words (1-3 syllables), fixed for every run so text depends on the seed only."""
    rng = random.Random("extproc-bench-vocabulary")
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.choice((1, 1, 2, 2, 2, 3))
        words.add(
            "".join(
                rng.choice(consonants)
                + rng.choice(vowels)
                + (rng.choice(consonants) if rng.random() < 0.3 else "")
                for _ in range(syllables)
            )
        )
    return tuple(sorted(words))  # sorted: set order varies with hash randomisation


_VOCAB = _build_vocab()


def pseudo_text(rng: random.Random, tokens: int, prefix: str = "") -> str:
    """Space-separated pseudo-words of exactly ``tokens * CHARS_PER_TOKEN`` characters (``prefix`` included).

    Exact lengths keep prompt sizes predictable; random words make different texts diverge at once, so
    only deliberately shared text (system prompts, conversation history) forms common prefixes.
    """
    n_chars = max(0, tokens) * CHARS_PER_TOKEN
    parts = [prefix] if prefix else []
    length = len(prefix)
    while length < n_chars:
        chunk = " ".join(rng.choices(_VOCAB, k=max(8, (n_chars - length) // 4)))
        parts.append(chunk)
        length += len(chunk) + 1
    text = " ".join(parts)[:n_chars]
    if text.endswith(" "):
        text = text[:-1] + "a"
    return text


# ------------------------------------------------------------------------------------------- helpers


def _rngs(seed: int) -> tuple[random.Random, random.Random]:
    """Independent streams for arrivals and content, so the rate does not change the text."""
    return random.Random(f"{seed}:arrivals"), random.Random(f"{seed}:content")


def _poisson_arrivals(rng: random.Random, rate: float, count: int) -> list[float]:
    """Open-loop Poisson arrivals starting at t = 0."""
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _check(rate: float, count: int, *ranges: Range) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    for lo, hi in ranges:
        if not 0 < lo <= hi:
            raise ValueError(f"token range must satisfy 0 < low <= high, got ({lo}, {hi})")


# ----------------------------------------------------------------------------------------- workloads


def shared_prefix(
    *,
    rate: float,
    count: int,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    tenants: int = 16,
    system_tokens: int = 2000,
    user_tokens: Range = (50, 200),
    output_tokens: Range = (50, 200),
    zipf_s: float = 1.0,
) -> Workload:
    """Multi-tenant traffic: each tenant has its own long system prompt, tenant popularity is Zipf-like.

    Tests whether routing keeps each tenant's prefix on the instances that already hold it in KV cache.
    The distinct prefix text totals ``tenants * system_tokens`` tokens (``params["prefix_tokens_total"]``):
    32k at the defaults, which fits anywhere. To make the prefixes exceed a fleet's KV cache, choose
    ``tenants > fleet_kv_tokens / system_tokens``; e.g. Llama-3-8B in fp16 needs 128 KiB of KV per token,
    so 2000-token prompts take 250 MiB each and 512 tenants (1M tokens, 125 GiB) exceed the KV cache of
    several 80 GB GPUs, where cache-blind spreading evicts prefixes and prefix-aware routing should not.
    Tenant ``i`` (0-based) is chosen with weight ``1 / (i + 1) ** zipf_s``.
    """
    _check(rate, count, user_tokens, output_tokens, (system_tokens, system_tokens))
    if tenants < 1:
        raise ValueError(f"tenants must be >= 1, got {tenants}")
    arrivals_rng, rng = _rngs(seed)
    prompts = [
        pseudo_text(random.Random(f"{seed}:tenant:{i}"), system_tokens, prefix=f"[tenant-{i:03d}] ")
        for i in range(tenants)
    ]
    cum_weights = list(itertools.accumulate(1.0 / (i + 1) ** zipf_s for i in range(tenants)))
    requests = []
    for t in _poisson_arrivals(arrivals_rng, rate, count):
        tenant = rng.choices(range(tenants), cum_weights=cum_weights)[0]
        messages = [
            {"role": "system", "content": prompts[tenant]},
            {"role": "user", "content": pseudo_text(rng, rng.randint(*user_tokens))},
        ]
        requests.append(
            WorkloadRequest(t, _body(model, messages, rng.randint(*output_tokens)), f"tenant-{tenant:03d}")
        )
    params = {
        "rate": rate,
        "count": count,
        "seed": seed,
        "model": model,
        "tenants": tenants,
        "system_tokens": system_tokens,
        "user_tokens": list(user_tokens),
        "output_tokens": list(output_tokens),
        "zipf_s": zipf_s,
        "prefix_tokens_total": tenants * system_tokens,
    }
    return Workload("shared-prefix", params, requests)


def multi_turn(
    *,
    rate: float,
    count: int,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    conversations: int | None = None,
    think_time_s: float | None = None,
    turns: int = 10,
    user_tokens: Range = (50, 200),
    output_tokens: Range = (50, 200),
) -> Workload:
    """C concurrent chats whose every turn resends the whole history: each shares a prefix with its past.

    Turn k+1 carries turn k's messages, then the assistant reply (pseudo-text exactly ``max_tokens`` of
    turn k long, fixed in advance since the load is open loop), then a new user message. Turns of one
    conversation are separated by exponential think times; the next turn does not wait for the reply.

    With open-loop arrivals at ``rate``, C conversations and mean think time T are tied by C = rate * T
    (each conversation is Poisson at rate / C, so all of them together are Poisson at ``rate``). Give one
    of ``conversations`` or ``think_time_s`` (default T = 2 s, so C = round(2 * rate)); the effective
    value of both is in ``params``. After ``turns`` turns a conversation ends and its slot starts a new one,
    which keeps the history (at most ~``turns * 400`` tokens at the defaults) bounded.
    """
    _check(rate, count, user_tokens, output_tokens)
    if conversations is not None and think_time_s is not None:
        raise ValueError("give conversations or think_time_s, not both: conversations = rate * think time")
    if conversations is None:
        think = 2.0 if think_time_s is None else think_time_s
        if not think > 0:
            raise ValueError(f"think_time_s must be > 0, got {think}")
        conversations = max(1, round(rate * think))
    if conversations < 1 or turns < 1:
        raise ValueError(f"conversations and turns must be >= 1, got {conversations}, {turns}")
    mean_gap = conversations / rate
    arrivals_rng, rng = _rngs(seed)

    next_id = itertools.count()
    # Per slot: conversation id, turns sent, history (messages of the last request + the reply).
    slots: list[tuple[int, int, list[dict[str, str]]]] = [
        (next(next_id), 0, []) for _ in range(conversations)
    ]
    heap = [(arrivals_rng.expovariate(1 / mean_gap), s) for s in range(conversations)]
    heapq.heapify(heap)
    requests = []
    for _ in range(count):
        t, s = heapq.heappop(heap)
        conv, sent, history = slots[s]
        if sent == turns:
            conv, sent, history = next(next_id), 0, []
        messages = [*history, {"role": "user", "content": pseudo_text(rng, rng.randint(*user_tokens))}]
        n_out = rng.randint(*output_tokens)
        requests.append(
            WorkloadRequest(t, _body(model, [dict(m) for m in messages], n_out), f"conv-{conv:04d}")
        )
        slots[s] = (conv, sent + 1, [*messages, {"role": "assistant", "content": pseudo_text(rng, n_out)}])
        heapq.heappush(heap, (t + arrivals_rng.expovariate(1 / mean_gap), s))
    params = {
        "rate": rate,
        "count": count,
        "seed": seed,
        "model": model,
        "conversations": conversations,
        "think_time_s": mean_gap,
        "turns": turns,
        "user_tokens": list(user_tokens),
        "output_tokens": list(output_tokens),
    }
    return Workload("multi-turn", params, requests)


def long_context(
    *,
    rate: float,
    count: int,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    short_tokens: Range = (200, 1000),
    long_tokens: Range = (8000, 30000),
    long_fraction: float = 0.05,
    output_tokens: Range = (50, 200),
) -> Workload:
    """Mostly short prompts with a few very long ones: a long prefill stalls whatever shares its instance.

    Exactly ``round(long_fraction * count)`` requests, at random positions, are long, so the share is
    stable even for short runs. Prompts are single unrelated user messages (no shared prefixes).
    """
    _check(rate, count, short_tokens, long_tokens, output_tokens)
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    arrivals_rng, rng = _rngs(seed)
    long_positions = set(rng.sample(range(count), round(long_fraction * count)))
    requests = []
    for i, t in enumerate(_poisson_arrivals(arrivals_rng, rate, count)):
        is_long = i in long_positions
        prompt = pseudo_text(rng, rng.randint(*(long_tokens if is_long else short_tokens)))
        body = _body(model, [{"role": "user", "content": prompt}], rng.randint(*output_tokens))
        requests.append(WorkloadRequest(t, body, "long" if is_long else "short"))
    params = {
        "rate": rate,
        "count": count,
        "seed": seed,
        "model": model,
        "short_tokens": list(short_tokens),
        "long_tokens": list(long_tokens),
        "long_fraction": long_fraction,
        "long_requests": len(long_positions),
        "output_tokens": list(output_tokens),
    }
    return Workload("long-context", params, requests)


def bursty(
    *,
    rate: float,
    count: int,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    burst_factor: float = 5.0,
    burst_fraction: float = 0.1,
    period_s: float = 10.0,
    prompt_tokens: Range = (100, 1000),
    output_tokens: Range = (50, 200),
) -> Workload:
    """On/off arrivals: tests how routing and queues absorb sudden load at the same mean rate.

    Each ``period_s`` cycle is off for ``(1 - burst_fraction) * period_s`` at the base rate, then on for
    the rest at ``burst_factor * rate``; the base rate ``rate * (1 - burst_factor * burst_fraction) /
    (1 - burst_fraction)`` keeps the mean at ``rate`` (so ``burst_factor * burst_fraction <= 1``).
    Within each phase arrivals are Poisson. Starting in the off phase gives a short warm-up.
    """
    _check(rate, count, prompt_tokens, output_tokens)
    if not (0 < burst_fraction < 1 and burst_factor >= 1 and period_s > 0):
        raise ValueError("need 0 < burst_fraction < 1, burst_factor >= 1 and period_s > 0")
    if burst_factor * burst_fraction > 1:
        raise ValueError(f"burst_factor * burst_fraction must be <= 1, got {burst_factor * burst_fraction}")
    base_rate = rate * (1 - burst_factor * burst_fraction) / (1 - burst_fraction)
    burst_rate = rate * burst_factor
    off_s = (1 - burst_fraction) * period_s
    arrivals_rng, rng = _rngs(seed)

    requests: list[WorkloadRequest] = []
    t, cycle, on = 0.0, 0, False
    while len(requests) < count:
        # Unit-rate exponential "work", spent across phases at each phase's rate (piecewise Poisson).
        # Phase ends come from the cycle index, not from t, so rounding cannot stall the loop.
        work = arrivals_rng.expovariate(1.0)
        while True:
            phase_rate = burst_rate if on else base_rate
            phase_end = cycle * period_s + (period_s if on else off_s)
            if phase_rate * (phase_end - t) >= work:
                t += work / phase_rate
                break
            work -= phase_rate * (phase_end - t)
            t = phase_end
            cycle, on = (cycle + 1, False) if on else (cycle, True)
        prompt = pseudo_text(rng, rng.randint(*prompt_tokens))
        body = _body(model, [{"role": "user", "content": prompt}], rng.randint(*output_tokens))
        requests.append(WorkloadRequest(t, body, "burst" if on else "base"))
    params = {
        "rate": rate,
        "count": count,
        "seed": seed,
        "model": model,
        "burst_factor": burst_factor,
        "burst_fraction": burst_fraction,
        "period_s": period_s,
        "base_rate": base_rate,
        "burst_rate": burst_rate,
        "prompt_tokens": list(prompt_tokens),
        "output_tokens": list(output_tokens),
    }
    return Workload("bursty", params, requests)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "long-context": long_context,
    "bursty": bursty,
}


PRIORITY_MIX: dict[str, float] = {"critical": 0.2, "standard": 0.5, "sheddable": 0.3}


def with_priorities(
    workload: Workload,
    mix: dict[str, float] | None = None,
    *,
    seed: int = 0,
    priority_header: str = "x-llm-priority",
    user_header: str = "x-user-id",
) -> Workload:
    """The same requests, each given a priority class drawn from `mix` (class -> share, seeded,
    independent of the workload's own randomness) as its priority header, and its tag as its user
    (the admission queue's tenant). Tags become `<class>/<tag>`, so reports can split by class."""
    mix = dict(mix or PRIORITY_MIX)
    if not mix or any(w < 0 for w in mix.values()) or not sum(mix.values()) > 0:
        raise ValueError(f"priority mix must have non-negative shares summing above 0, got {mix}")
    rng = random.Random(f"{seed}:priorities")
    classes = list(mix)
    cum = list(itertools.accumulate(mix[c] for c in classes))
    requests, headers = [], []
    for r in workload.requests:
        klass = rng.choices(classes, cum_weights=cum)[0]
        requests.append(WorkloadRequest(r.arrival_s, r.body, f"{klass}/{r.tag}"))
        headers.append({priority_header: klass, user_header: r.tag})
    params = {**workload.params, "priority_mix": mix, "priority_seed": seed}
    return Workload(workload.name, params, requests, headers)


def make_workload(name: str, **kwargs: Any) -> Workload:
    """Build a workload by its registry name, with a helpful error for unknown names."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return factory(**kwargs)


def max_in_window(arrivals: list[float], window_s: float = 1.0) -> int:
    """Most arrivals in any ``window_s``-long window (sorted arrivals): how bursty a schedule is."""
    best = 0
    for i, t in enumerate(arrivals):
        best = max(best, bisect.bisect_right(arrivals, t + window_s) - i)
    return best
