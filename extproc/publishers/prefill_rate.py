"""An instance's measured prefill throughput, from its engine's cumulative counters.

Each scrape gives one sample over the requests whose prefill ended since the last one:

    (prompt tokens - prompt tokens served from the prefix cache) / prefill seconds

The prefill seconds are the engine's per-request "first scheduled to first token" times (vLLM's
`request_prefill_time_seconds`): prompts prefilled in the same steps each count the shared time, and
steps that also decode count whole, so a busy interval's sample is low, by as much as the overlap.
The estimate is therefore an upper quantile of the recent samples, the rate seen when prefills ran
with little company (what `predicted-ttft` wants: it counts the queue and the decode load itself);
not the maximum, because the hit counter moves at admission and the prompt counter at the first
token, so a sample can be credited tokens whose cache hits fell in the previous one. That
misattribution is also why a sample spans `span` (3) scrapes that saw prefills end, not one: over
one interval a long, mostly cached prompt whose hits were debited a scrape earlier reads as several
times the GPU's rate (tests/test_prefill_rate.py builds such a case), and with few samples yet the
quantile is that spike: one engine of an identical fleet would pass for a faster GPU and be flooded.
Over three intervals the two halves cancel. `predicted-ttft` (scheduling/ttft_predictor.py) divides
uncached tokens by it: GPUs of different speeds in one pool get their share without a hand-set
`capacity_weight`.

Preemptions void a sample. A request preempted before its first token keeps its first scheduling
time (its prefill seconds then count the time it spent back in the queue) and its cached blocks are
counted as hits again when it is scheduled anew, so under KV pressure the samples fell far below the
GPU's rate and the engine, taken for the slowest of its pool, was left idle (notebook, "Preemptions
in the measured prefill rate"). Where the engine counts its preemptions (vLLM's `num_preemptions`),
a sample over scrapes that saw one is not taken; and an interval whose hits cover its prompt tokens
is no sample at all (it says nothing about the speed), not a zero that drags the quantile down.

An engine measured slow may then get no traffic at all (a slowdown, since repaired, or just the
slow GPU of a mixed pool at low load), and only traffic can measure it again. So a figure no
prefill has refreshed for `stale_after` scrapes relaxes: it doubles, up to the best this instance
has ever shown, and again every `stale_after` idle scrapes. A repaired engine is sent work again
step by step and its next samples tell; a slower GPU never claims more than it has shown, so it is
not flooded. The figure is not withdrawn instead: the scheduler reads no figure as "fast until
measured", and would send a slow GPU next to fast ones bursts it cannot take.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from extproc.fleet.snapshots import MAX_PREFILL_TOKENS_PER_S


@dataclass(slots=True)
class PrefillRate:
    window: int = 20  # samples remembered (10 s at the default 0.5 s interval, while prefilling)
    quantile: float = 0.8
    stale_after: int = 40  # scrapes without a prefill (20 s at the default 0.5 s interval)
    span: int = 3  # a sample covers this many scrapes that saw prefills end
    estimate: float | None = None
    best: float = 0.0  # the highest estimate so far: what relaxing may return to
    _idle: int = 0  # scrapes since the last sample (or the last relaxation)
    # (prompt tokens, cached tokens, prefill seconds, preemptions: 0 where the engine does not count them)
    _prev: tuple[float, float, float, float] | None = None
    _samples: deque[float] = field(init=False)
    _marks: deque[tuple[float, float, float, float]] = field(init=False)  # counters, last active scrapes

    def __post_init__(self) -> None:
        if self.span < 1 or self.window < 1:
            raise ValueError("'span' and 'window' must be >= 1")
        self._samples = deque(maxlen=self.window)
        self._marks = deque(maxlen=self.span)

    def update(
        self,
        prompt_tokens: float | None,
        cached_tokens: float,
        prefill_s: float | None,
        preemptions: float | None = None,
    ) -> float | None:
        """Feed one scrape's counters; the current estimate (None until a prefill was seen).

        `cached_tokens` is 0 for engines whose prompt counter leaves cached tokens out already
        (llama.cpp); `preemptions` is None where the engine does not count them. Counters that go
        backwards (a restart) restart the deltas, not the estimate: the GPU is the same."""
        if prompt_tokens is None or prefill_s is None:
            return self.estimate
        now = (prompt_tokens, cached_tokens, prefill_s, preemptions or 0.0)
        prev, self._prev = self._prev, now
        if prev is None or any(n < p for n, p in zip(now, prev, strict=True)):
            self._restart(now)
            return self.estimate
        if now[2] - prev[2] <= 0.0:  # no prefill ended since the last scrape
            self._idle += 1
            if self._idle >= self.stale_after and self.estimate is not None:
                self._idle = 0
                self.estimate = min(self.best, self.estimate * 2.0)
                self._samples.clear()  # new samples, not the slow ones, decide from here
                self._restart(now)
            return self.estimate
        self._idle = 0
        base = self._marks[0]
        if now[3] > base[3]:  # a preemption in the span: its prefills' times and hits are not the GPU's
            self._restart(now)
            return self.estimate
        self._marks.append(now)
        seconds = now[2] - base[2]
        tokens = (now[0] - base[0]) - (now[1] - base[1])
        if tokens <= 0.0:  # cache hits only (or hits counted ahead of their prompts): no sample
            return self.estimate
        self._samples.append(min(tokens / seconds, MAX_PREFILL_TOKENS_PER_S))
        ranked = sorted(self._samples)
        self.estimate = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        self.best = max(self.best, self.estimate)
        return self.estimate

    def _restart(self, now: tuple[float, float, float, float]) -> None:
        """The next sample's span begins at `now`."""
        self._marks.clear()
        self._marks.append(now)
