"""LoRA affinity and observed-latency exploration (UCB) in discrete models: the figures behind
docs/benchmarks.md ("LoRA and observed latency"), reproducible with

    python -m extproc_lab.bench.lora_latency --out out/lora-latency

which writes lora_latency.json and lora_latency.md. Two simulations, no network, a virtual clock; the
routers are the real scheduling profiles, the engines are models:

- LoRA: 6 instances, each an LRU of 4 adapter slots (an adapter with a running request is not evicted;
  a request whose adapter cannot get a slot waits, as vLLM's scheduler skips it), a batch of 16, 1-3 s
  per request plus 0.3 s to swap an adapter in; Poisson arrivals; snapshots every second. Targets: with
  10 adapters >= 90 % of requests land where their adapter is loaded, nobody above 2x the fair share.
- Slowdown: 6 engines with room in their batch; engine u0 runs 3x slower mid-run, then is restored.
  Targets: its share halves within 30 s and comes back (80 % of it) within 60 s of the restore.

tests/test_lora_latency_gpu.py runs these models at the same sizes and checks the targets; the live
counterpart of the slowdown (real Envoy, service, Redis, publisher, simulated engines) is
`python -m extproc_lab.bench.ucb_live`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extproc.fleet import Load, Upstream
from extproc.fleet.tpot import SmoothedTpot
from extproc.fleet.view import KvHeld
from extproc.openai import Api, InferenceRequest
from extproc.scheduling import profile_from_config


class ModelState:
    """A FleetState over dicts with a settable clock (virtual seconds): what the snapshots said, plus
    this router's own in-flight counts."""

    def __init__(self, loads: dict[str, Load] | None = None, t: float = 0.0) -> None:
        self.loads: dict[str, Load] = loads or {}
        self.counts: Counter[str] = Counter()
        self.t = t

    def count(self, upstream_id: str) -> int:
        return self.counts[upstream_id]

    def load(self, upstream_id: str) -> Load | None:
        return self.loads.get(upstream_id)

    def loads_of(self, upstreams: Sequence[Upstream]) -> list[Load | None]:
        return [self.loads.get(u.id) for u in upstreams]

    def pending(self, upstream_id: str) -> int:
        load = self.loads.get(upstream_id)
        own = self.counts[upstream_id]
        return own if load is None else max(0, own - load.own_at_snapshot)

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return 0.0, None, None  # no batch limit known

    def kv_blocks(self, upstream_id: str) -> KvHeld | None:
        return None

    def kv_holders(self, block: bytes) -> list[str]:
        return []

    def now(self) -> float:
        return self.t

    def smoothed_tpot(self, upstream_id: str, window_s: float) -> float | None:
        """Each load as it stands (a fixed table has no snapshot history to smooth)."""
        load = self.loads.get(upstream_id)
        return None if load is None else SmoothedTpot(window_s).take(upstream_id, load)

    def smoothed_running(self, upstream_id: str, window_s: float) -> float | None:
        load = self.loads.get(upstream_id)
        return None if load is None or self.smoothed_tpot(upstream_id, window_s) is None else load.num_running


def ld(**kw: Any) -> Load:
    """A Load with zero queues and one instance, published now (override any field)."""
    base: dict[str, Any] = {
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "published_at": 0.0,
        "instances": 1,
        "own_at_snapshot": 0,
    }
    base.update(kw)
    return Load(**base)


def up(uid: str) -> Upstream:
    return Upstream(id=uid, cluster=uid, address=None, weight=1.0)


def req(model: str) -> InferenceRequest:
    return InferenceRequest(
        api=Api.CHAT,
        model=model,
        stream=False,
        max_tokens=None,
        prompt_text="hello",
        prompt_token_ids=None,
        session=None,
        user=None,
        priority=0,
        body_bytes=0,
    )


# -- discrete simulation 1: LoRA affinity -----------------------------------------------------------------
# Recommended profile (docs/tuning.md): filter on slots, affinity first, load as the tie-breaker; the
# affinity's own bound (overload_ratio, overload_slack) is what keeps hot adapters from piling up.
LORA_PROFILE: dict[str, Any] = {
    "filters": ["lora-affinity"],
    "scorers": [{"name": "lora-affinity", "weight": 2.0}, {"name": "least-outstanding", "weight": 1.0}],
    "picker": {"name": "max-score", "params": {"seed": 1}},
}


@dataclass
class LoraEngine:
    """An engine model: `slots` adapters in GPU memory (LRU; an adapter with a running request cannot
    be evicted), a batch of `batch` concurrent requests, a swap-in cost, FIFO waiting that skips
    requests whose adapter cannot get a slot yet (as vLLM's scheduler does beyond max_loras)."""

    slots: int = 4
    batch: int = 16
    swap_s: float = 0.3
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    running: list[tuple[float, str]] = field(default_factory=list)  # (ends at, adapter)
    waiting: deque[tuple[str, float]] = field(default_factory=deque)  # (adapter, service time)

    def _evictable(self) -> list[str]:
        busy = {a for _, a in self.running}
        return [a for a in self.gpu if a not in busy]

    def _can_start(self, adapter: str) -> bool:
        if len(self.running) >= self.batch:
            return False
        return adapter in self.gpu or len(self.gpu) < self.slots or bool(self._evictable())

    def _start(self, adapter: str, service: float, now: float) -> None:
        if adapter not in self.gpu:
            if len(self.gpu) >= self.slots:
                del self.gpu[self._evictable()[0]]
            self.gpu[adapter] = None
            service += self.swap_s
        self.gpu.move_to_end(adapter)
        self.running.append((now + service, adapter))

    def step(self, now: float) -> int:
        """Advance to `now`; returns how many requests finished."""
        before = len(self.running)
        self.running = [r for r in self.running if r[0] > now]
        finished = before - len(self.running)
        still: deque[tuple[str, float]] = deque()
        for adapter, service in self.waiting:
            if self._can_start(adapter):
                self._start(adapter, service, now)
            else:
                still.append((adapter, service))
        self.waiting = still
        return finished

    def listed(self) -> frozenset[str]:
        """What vLLM's lora_requests_info would list: adapters with running or waiting requests."""
        return frozenset({a for _, a in self.running} | {a for a, _ in self.waiting})


@dataclass
class LoraResult:
    requests: int
    landed_loaded: float  # share of requests routed where their adapter was in GPU memory
    max_share: float  # the busiest instance's requests over the fair share (1.0 = perfectly even)
    max_window_share: float  # the same over the worst 10 s window
    shares: dict[str, float]


def simulate_lora(
    profile: dict[str, Any] | None = None,
    *,
    instances: int = 6,
    adapters: int = 10,
    rate: float = 30.0,
    duration: float = 240.0,
    zipf: float = 1.0,
    seed: int = 1,
    publish_s: float = 1.0,
) -> LoraResult:
    """Poisson arrivals at `rate` req/s; adapter popularity ~ 1/rank^zipf; service 1-3 s, plus 0.3 s
    when the adapter must be swapped in. The router is the real profile; the fleet state is rebuilt
    from the engine models every `publish_s` (as snapshots), plus the router's own in-flight counts
    in between."""
    rng = random.Random(seed)
    prof = profile_from_config("lora", profile or LORA_PROFILE)
    ups = [up(f"u{i}") for i in range(instances)]
    engines = {u.id: LoraEngine() for u in ups}
    state = ModelState(t=0.0)
    names = [f"adapter-{k}" for k in range(adapters)]
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    requests = {m: req(m) for m in names}
    dt, t = 0.02, 0.0
    next_arrival, next_publish = rng.expovariate(rate), 0.0
    landed = 0
    routed: list[tuple[float, str]] = []
    while t < duration:
        t += dt
        state.t = t
        for uid, e in engines.items():
            state.counts[uid] -= e.step(t)
        if t >= next_publish:
            next_publish += publish_s
            for uid, e in engines.items():
                listed = e.listed()
                state.loads[uid] = ld(
                    num_running=len(e.running),
                    num_waiting=len(e.waiting),
                    published_at=t,
                    own_at_snapshot=state.counts[uid],
                    lora_adapters=listed,
                    lora_slots=e.slots,
                    lora_slots_free=max(0, e.slots - len(listed)),
                )
        while next_arrival <= t:
            next_arrival += rng.expovariate(rate)
            model = rng.choices(names, weights=weights)[0]
            chosen = prof.schedule(requests[model], ups, state)
            assert chosen is not None
            engine = engines[chosen.id]
            landed += model in engine.gpu
            routed.append((t, chosen.id))
            state.counts[chosen.id] += 1
            engine.waiting.append((model, rng.uniform(1.0, 3.0)))
            engine.step(t)
    total = Counter(uid for _, uid in routed)
    fair = len(routed) / instances
    worst = 0.0
    for start in range(0, int(duration), 10):
        window = Counter(uid for at, uid in routed if start <= at < start + 10)
        if sum(window.values()) >= 10 * instances:
            worst = max(worst, max(window.values()) / (sum(window.values()) / instances))
    return LoraResult(
        requests=len(routed),
        landed_loaded=landed / len(routed),
        max_share=max(total.values()) / fair,
        max_window_share=worst,
        shares={uid: total[uid] / fair for uid in sorted(total)},
    )


def replace_scorer_params(profile: dict[str, Any], name: str, params: dict[str, Any]) -> dict[str, Any]:
    scorers = [{**s, "params": params} if s.get("name") == name else s for s in profile["scorers"]]
    return {**profile, "scorers": scorers}


# -- discrete simulation 2: one instance slowed 3x, then restored ----------------------------------------
def latency_profile(load_scorer: str) -> dict[str, Any]:
    return {
        "scorers": [{"name": "latency-ucb", "weight": 2.0}, {"name": load_scorer, "weight": 1.0}],
        "picker": {"name": "max-score", "params": {"seed": 1}},
    }


@dataclass
class SlowdownResult:
    baseline: float  # the slowed instance's share over the minute before the slowdown
    halved_after_s: float | None  # first 5 s window (ending that long after) with share <= baseline / 2
    slowed_share: float  # its share from 30 s after the slowdown to the restore
    regained_after_s: float | None  # first 5 s window after the restore with share >= 0.8 x baseline
    share_after: float  # its share from 60 s after the restore to the end


def simulate_slowdown(
    profile: dict[str, Any],
    *,
    instances: int = 6,
    rate: float = 30.0,
    slow_at: float = 120.0,
    restore_at: float = 240.0,
    end: float = 360.0,
    factor: float = 3.0,
    slow_decode: bool = True,
    seed: int = 1,
    publish_s: float = 1.0,
) -> SlowdownResult:
    """Engines without queueing (continuous batching with room): TTFT = 0.15 s x (1 + 0.03 x running)
    +-20 %, then 1-3 s of decode; instance u0 runs `factor` x slower (TTFT, and decode unless
    `slow_decode` is False) between `slow_at` and `restore_at`. Snapshots every `publish_s` carry each
    engine's running count and mean TTFT over the interval, as the publisher computes it."""
    rng = random.Random(seed)
    prof = profile_from_config("latency", profile)
    ups = [up(f"u{i}") for i in range(instances)]
    state = ModelState(t=0.0)
    running: dict[str, list[tuple[float, float]]] = {u.id: [] for u in ups}  # (ends at, ttft)
    first_tokens: dict[str, list[tuple[float, float]]] = {u.id: [] for u in ups}  # (at, ttft)
    request = req("m")
    dt, t = 0.02, 0.0
    next_arrival, next_publish = rng.expovariate(rate), publish_s
    routed: list[tuple[float, str]] = []
    while t < end:
        t += dt
        state.t = t
        for uid, rs in running.items():
            still = [r for r in rs if r[0] > t]
            state.counts[uid] -= len(rs) - len(still)
            running[uid] = still
        if t >= next_publish:
            next_publish += publish_s
            for uid in running:
                seen = [x for at, x in first_tokens[uid] if at <= t]
                first_tokens[uid] = [(at, x) for at, x in first_tokens[uid] if at > t]
                state.loads[uid] = ld(
                    num_running=len(running[uid]),
                    published_at=t,
                    own_at_snapshot=state.counts[uid],
                    ttft_s=sum(seen) / len(seen) if seen else None,
                )
        while next_arrival <= t:
            next_arrival += rng.expovariate(rate)
            chosen = prof.schedule(request, ups, state)
            assert chosen is not None
            slow = factor if chosen.id == "u0" and slow_at <= t < restore_at else 1.0
            ttft = slow * 0.15 * (1 + 0.03 * len(running[chosen.id])) * rng.uniform(0.8, 1.2)
            decode = (slow if slow_decode else 1.0) * rng.uniform(1.0, 3.0)
            running[chosen.id].append((t + ttft + decode, ttft))
            first_tokens[chosen.id].append((t + ttft, ttft))
            state.counts[chosen.id] += 1
            routed.append((t, chosen.id))

    def share(a: float, b: float) -> float:
        picks = [uid for at, uid in routed if a <= at < b]
        return sum(1 for uid in picks if uid == "u0") / max(1, len(picks))

    baseline = share(slow_at - 60, slow_at)
    halved = next((k for k in range(1, 121) if share(slow_at + k - 5, slow_at + k) <= baseline / 2), None)
    regained = next(
        (k for k in range(1, 121) if share(restore_at + k - 5, restore_at + k) >= 0.8 * baseline), None
    )
    return SlowdownResult(
        baseline=baseline,
        halved_after_s=None if halved is None else float(halved),
        slowed_share=share(slow_at + 30, restore_at),
        regained_after_s=None if regained is None else float(regained),
        share_after=share(restore_at + 60, end),
    )


PICKER: dict[str, Any] = {"name": "max-score", "params": {"seed": 1}}


def lora_rows(seeds: Sequence[int] = (2, 3)) -> list[dict[str, Any]]:
    """The LoRA table: popularity, profile, landed where loaded, busiest / fair (run, worst window)."""
    runs: list[tuple[str, str, LoraResult]] = [
        ("10, uniform", "recommended", simulate_lora(zipf=0.0)),
        ("10, Zipf (s = 1)", "recommended", simulate_lora(zipf=1.0)),
    ]
    runs += [(f"10, Zipf, seed {s}", "recommended", simulate_lora(seed=s)) for s in seeds]
    forgetful = replace_scorer_params(LORA_PROFILE, "lora-affinity", {"memory_s": 0.001})
    runs.append(("10, Zipf", "recommended, memory_s ~ 0 (published lists only)", simulate_lora(forgetful)))
    plain = {"scorers": ["least-outstanding"], "picker": PICKER}
    runs.append(("10, Zipf", "least-outstanding alone", simulate_lora(plain)))
    runs.append(("40, Zipf (more adapters than the 24 slots)", "recommended", simulate_lora(adapters=40)))
    return [{"adapters": a, "profile": p, **asdict(r)} for a, p, r in runs]


def slowdown_rows(seeds: Sequence[int] = (2, 3, 4)) -> list[dict[str, Any]]:
    rows = []
    for slow_decode in (True, False):
        slowed = "TTFT + decode" if slow_decode else "TTFT only"
        for scorer in ("queue-depth", "least-outstanding"):
            for name, prof in (
                (f"latency-ucb 2 + {scorer} 1", latency_profile(scorer)),
                (f"{scorer} alone", {"scorers": [scorer], "picker": PICKER}),
            ):
                r = simulate_slowdown(prof, slow_decode=slow_decode)
                row: dict[str, Any] = {"slowed": slowed, "profile": name, "seed": 1, **asdict(r)}
                rows.append(row)
            for seed in seeds:
                r = simulate_slowdown(latency_profile(scorer), slow_decode=slow_decode, seed=seed)
                rows.append(
                    {"slowed": slowed, "profile": f"latency-ucb 2 + {scorer} 1", "seed": seed, **asdict(r)}
                )
    return rows


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def markdown(lora: list[dict[str, Any]], slow: list[dict[str, Any]]) -> str:
    lines = [
        "### LoRA affinity (model)",
        "",
        "| adapters, popularity | profile | requests | landed where loaded | busiest / fair, run "
        "| busiest / fair, worst 10 s window |",
        "|---|---|---|---|---|---|",
    ]
    for r in lora:
        lines.append(
            f"| {r['adapters']} | {r['profile']} | {r['requests']} | {100 * r['landed_loaded']:.1f} % "
            f"| {r['max_share']:.2f} | {r['max_window_share']:.2f} |"
        )
    lines += [
        "",
        "### One engine of six slowed 3x, then restored (model)",
        "",
        "| slowed | profile | seed | baseline share | halved after | share, slowed (from +30 s) "
        "| regained after | share, from restore +60 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in slow:
        lines.append(
            f"| {r['slowed']} | {r['profile']} | {r['seed']} | {r['baseline']:.3f} "
            f"| {_s(r['halved_after_s'])} | {r['slowed_share']:.3f} "
            f"| {_s(r['regained_after_s'])} | {r['share_after']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="LoRA affinity and latency-ucb in discrete models")
    p.add_argument("--out", default="out/lora-latency", help="output folder (lora_latency.json, .md)")
    args = p.parse_args(argv)
    lora, slow = lora_rows(), slowdown_rows()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_latency.json").write_text(json.dumps({"lora": lora, "slowdown": slow}, indent=2))
    text = markdown(lora, slow)
    (out / "lora_latency.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
