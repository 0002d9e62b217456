"""What the engines report, against what this service routed there and predicted.

Two figures per upstream, learnt from the engines' own cumulative counters in their snapshots
(`Load.counters`: prompt tokens of the requests that reached their first token, the number of first
tokens, and their summed TTFT seconds):

- **Token ratio**: the engine's tokens per token of this service's count. Without the engines'
  tokenizer the service counts UTF-8 bytes / 4, which is 0.5-2x an engine's count (code, CJK, IDs,
  other languages); KV capacity, block sizes and prefill throughput all come in the engine's units.
  Over each interval between two snapshots, the engine's mean prompt per first token is compared
  with the mean of this service's counts for the requests it sent there one observed TTFT earlier
  (when the requests that just reached their first token were sent). Means, not sums: other
  replicas' requests and requests in flight then cost nothing but noise.
- **TTFT error**: the engine's observed mean TTFT over the interval minus what this service
  predicted for the same requests. Positive: the engine is busier than the model thinks (most
  often a prefix holder whose queue is under-counted); its predictions are raised by that much, so
  its share of new work falls until what it delivers matches what was promised.

Both are decayed means over the last ~`window_s` seconds. An upstream with little data of its own
takes the ratio of its pool (every upstream this scorer has seen), so a new engine starts calibrated.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

MIN_RATIO = 0.1  # an engine counting 10x fewer or more tokens than the service: clamped, not trusted
MAX_RATIO = 10.0
PRIOR_TOKENS = 20_000.0  # service tokens of an upstream's own data worth as much as its pool's ratio
MIN_POOL_TOKENS = 5_000.0  # service tokens compared before the pool's ratio moves off 1
SENT_KEEP_S = 600.0  # own sends kept to compare with counters (a TTFT longer than this is not matched)
MAX_SENT = 10_000  # per upstream


@dataclass(slots=True)
class _Sent:
    """This service's sends to one upstream, oldest first: when, and running sums of its token
    counts and predicted TTFTs, so any window's sums are two bisections and two subtractions (a
    snapshot is matched on the request path: no scan of thousands of sends)."""

    times: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # running sums, through each send
    predicted: list[float] = field(default_factory=list)
    start: int = 0  # sends before this are dropped (kept in the lists until compacted)

    def add(self, when: float, tokens: float, predicted: float) -> None:
        self.times.append(when)
        self.tokens.append((self.tokens[-1] if self.tokens else 0.0) + tokens)
        self.predicted.append((self.predicted[-1] if self.predicted else 0.0) + predicted)
        times = self.times
        while self.start < len(times) and (
            times[self.start] < when - SENT_KEEP_S or len(times) - self.start > MAX_SENT
        ):
            self.start += 1
        if self.start > 1024 and self.start * 2 > len(times):
            keep = self.start - 1  # one before the first kept: its running sums are the base
            del times[:keep], self.tokens[:keep], self.predicted[:keep]
            self.start = 1

    def window(self, lo: float, hi: float) -> tuple[int, float, float]:
        """(sends, summed tokens, summed predicted seconds) sent in (lo, hi]."""
        times = self.times
        i0 = bisect_right(times, lo, self.start)
        i1 = bisect_right(times, hi, i0)
        if i1 <= i0:
            return 0, 0.0, 0.0
        before_t = self.tokens[i0 - 1] if i0 > 0 else 0.0
        before_p = self.predicted[i0 - 1] if i0 > 0 else 0.0
        return i1 - i0, self.tokens[i1 - 1] - before_t, self.predicted[i1 - 1] - before_p


@dataclass(slots=True)
class _Upstream:
    sent: _Sent = field(default_factory=_Sent)
    mark: tuple[float, float, float, float, int, int] | None = None  # at, prompt, first, ttft, insts, epoch
    engine_tokens: float = 0.0  # decayed sums of the matched intervals
    service_tokens: float = 0.0
    error_s: float = 0.0  # decayed sum of first tokens x (observed - predicted) TTFT
    error_weight: float = 0.0  # decayed sum of first tokens matched
    predicted_s: float = 0.0  # decayed sum of first tokens x predicted TTFT (for the relative error)
    at: float = 0.0  # when the sums were last decayed


@dataclass(slots=True)
class UpstreamFigures:
    """One upstream's calibration, as metrics and the explain header show it."""

    token_ratio: float  # engine tokens per service token (1 until learnt)
    ttft_error_s: float  # observed minus predicted mean TTFT, seconds (0 until learnt)
    relative_error: float  # that over the predicted mean
    samples: float  # first tokens matched, decayed


@dataclass(slots=True)
class Calibration:
    window_s: float = 60.0  # the ratio's memory
    error_window_s: float = 15.0  # the TTFT error's: short, it has to follow a queue building up
    _ups: dict[str, _Upstream] = field(default_factory=dict)
    _pool_ratio: float = 1.0
    _pool_engine: float = 0.0  # decayed sums over every upstream, as each upstream's
    _pool_service: float = 0.0
    _pool_at: float = 0.0
    _ratios: dict[str, float] = field(default_factory=dict)  # per upstream, kept until new data

    def sent(self, uid: str, now: float, tokens: float, predicted_s: float) -> None:
        """This service sent a request of `tokens` (its own count) there, predicting `predicted_s`."""
        up = self._ups.get(uid)
        if up is None:
            up = self._ups[uid] = _Upstream(at=now)
        up.sent.add(now, tokens, predicted_s)

    def observe(
        self,
        uid: str,
        counters: tuple[float | None, float, float] | None,
        published_at: float,
        instances: int,
        epoch: int,
    ) -> None:
        """A snapshot's counters: match the interval since the last one with what was sent."""
        if counters is None:
            return
        up = self._ups.get(uid)
        if up is None:
            up = self._ups[uid] = _Upstream(at=published_at)
        prompt_or_none, first, ttft = counters
        prompt = -1.0 if prompt_or_none is None else prompt_or_none
        mark = up.mark
        if mark is not None and published_at <= mark[0]:
            return
        up.mark = (published_at, prompt, first, ttft, instances, epoch)
        if mark is None or (instances, epoch) != mark[4:]:
            return  # a first look, or the instances behind it changed: a new baseline
        d_prompt, d_first, d_ttft = prompt - mark[1], first - mark[2], ttft - mark[3]
        if d_first < 0 or d_ttft < 0:
            return  # counters went back: the engine restarted
        if prompt < 0 or mark[1] < 0:
            d_prompt = -1.0  # no prompt counter (now or then): the TTFT error alone
        if d_first <= 0:
            return
        observed = d_ttft / d_first
        # The requests that reached their first token in (mark, now] were sent ~one TTFT earlier.
        lo, hi = mark[0] - observed, published_at - observed
        n, tokens, predicted = up.sent.window(lo, hi)
        if not n:
            return
        self._decay(up, published_at)
        if tokens > 0 and d_prompt >= 0:
            service = d_first * tokens / n
            up.engine_tokens += d_prompt
            up.service_tokens += service
            self._update_ratios(uid, up, d_prompt, service, published_at)
        up.error_s += d_first * (observed - predicted / n)
        up.predicted_s += d_first * predicted / n
        up.error_weight += d_first

    def _decay(self, up: _Upstream, now: float) -> None:
        dt = now - up.at
        if dt <= 0:
            return
        up.at = now
        keep = math.exp(-dt / self.window_s)
        up.engine_tokens *= keep
        up.service_tokens *= keep
        keep = math.exp(-dt / self.error_window_s)
        up.error_s *= keep
        up.error_weight *= keep
        up.predicted_s *= keep

    def _update_ratios(self, uid: str, up: _Upstream, engine: float, service: float, now: float) -> None:
        dt = now - self._pool_at
        if dt > 0:
            keep = math.exp(-dt / self.window_s)
            self._pool_engine *= keep
            self._pool_service *= keep
            self._pool_at = now
        self._pool_engine += engine
        self._pool_service += service
        if self._pool_service >= MIN_POOL_TOKENS:
            self._pool_ratio = _clamp(self._pool_engine / self._pool_service)
        pool = self._pool_ratio
        own = (up.engine_tokens + PRIOR_TOKENS * pool) / (up.service_tokens + PRIOR_TOKENS)
        self._ratios[uid] = _clamp(own)

    def ratio(self, uid: str) -> float:
        """Engine tokens per token of this service's count there (the pool's until it has its own)."""
        return self._ratios.get(uid, self._pool_ratio)

    def error_s(self, uid: str) -> float:
        """How much later than predicted the engine's first tokens came, seconds (0 until known)."""
        up = self._ups.get(uid)
        if up is None or up.error_weight < 1.0:
            return 0.0
        return up.error_s / up.error_weight

    def relative_error(self, uid: str) -> float:
        up = self._ups.get(uid)
        if up is None or up.error_weight < 1.0 or up.predicted_s <= 0:
            return 0.0
        return up.error_s / up.predicted_s

    def figures(self) -> Iterator[tuple[str, UpstreamFigures]]:
        for uid, up in list(self._ups.items()):
            w = up.error_weight
            err = up.error_s / w if w >= 1.0 else 0.0
            rel = up.error_s / up.predicted_s if w >= 1.0 and up.predicted_s > 0 else 0.0
            yield uid, UpstreamFigures(self.ratio(uid), err, rel, w)

    def forget(self, uid: str) -> None:
        self._ups.pop(uid, None)
        self._ratios.pop(uid, None)


def _clamp(ratio: float) -> float:
    return min(MAX_RATIO, max(MIN_RATIO, ratio)) if math.isfinite(ratio) else 1.0
