"""The service's own in-flight accounting: requests it sent to each upstream and has not seen finish."""

from __future__ import annotations

import time
from collections.abc import Callable

from extproc.fleet.pool import Upstream

# Told the cluster and +1/-1 on every change (the in-flight gauge per cluster).
ChangeHook = Callable[[str, int], None]
# Other replicas tracked at once: a fleet runs a handful; a flood of forged replica ids (an unsigned
# sync channel) must not grow the tables (server/sync.py drops what `admits` refuses).
MAX_ORIGINS = 256


class Lease:
    """One routed request's hold on an upstream. `release()` is idempotent: the response path and the
    stream's end may both try, and only the first counts."""

    __slots__ = ("_accounting", "released", "upstream")

    def __init__(self, accounting: InFlight, upstream: Upstream) -> None:
        self._accounting = accounting
        self.upstream = upstream
        self.released = False

    def release(self) -> bool:
        if self.released:
            return False
        self.released = True
        self._accounting._decrement(self.upstream)
        return True


class InFlight:
    """Outstanding requests per upstream id. Single-threaded (event loop) use only."""

    __slots__ = ("_counts", "_hook", "_watch")

    def __init__(self, on_change: ChangeHook | None = None) -> None:
        self._counts: dict[str, int] = {}
        self._hook = on_change
        self._watch: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None]) -> None:
        """Also call `callback()` after every change (replica sync: news to publish)."""
        self._watch = callback

    def acquire(self, upstream: Upstream) -> Lease:
        self._counts[upstream.id] = self._counts.get(upstream.id, 0) + 1
        if self._hook is not None:
            self._hook(upstream.cluster, 1)
        if self._watch is not None:
            self._watch()
        return Lease(self, upstream)

    def count(self, upstream_id: str) -> int:
        return self._counts.get(upstream_id, 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        """A copy of every nonzero count (what replicas publish to each other)."""
        return dict(self._counts)

    def _decrement(self, upstream: Upstream) -> None:
        left = self._counts.get(upstream.id, 0) - 1
        if left > 0:
            self._counts[upstream.id] = left
        else:
            self._counts.pop(upstream.id, None)
        if self._hook is not None:
            self._hook(upstream.cluster, -1)
        if self._watch is not None:
            self._watch()


class RemoteInFlight:
    """Other replicas' in-flight requests per upstream, as each last reported its *full* count (not
    deltas: a lost message costs nothing once the next arrives). A replica silent for `expire_s` is
    dropped, so the counts of one that died or lost Redis vanish instead of pinning upstreams.

    `count()` is a dict lookup on the summed table (the request path); `update`/`expire` run in the
    sync task. Single-threaded (event loop) use only. At most `max_origins` replicas are held; the
    caller checks `admits()` before `update()`."""

    __slots__ = (
        "_by_origin",
        "_critical",
        "_seen",
        "_total",
        "_waiting",
        "clock",
        "expire_s",
        "max_origins",
    )

    def __init__(
        self,
        expire_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        max_origins: int = MAX_ORIGINS,
    ) -> None:
        self.expire_s = expire_s
        self.clock = clock
        self.max_origins = max_origins
        self._by_origin: dict[str, dict[str, int]] = {}
        self._seen: dict[str, float] = {}
        self._total: dict[str, int] = {}
        self._critical: dict[str, dict[str, float]] = {}  # origin: {model: critical requests / s}
        self._waiting: dict[str, dict[str, int]] = {}  # origin: {model: standard requests waiting}

    def update_critical(self, origin: str, rates: dict[str, float]) -> None:
        """`origin`'s critical arrival rates by model now (models it does not list: 0). Call after
        `update()` for the same message (expiry follows its counts)."""
        if rates:
            self._critical[origin] = dict(rates)
        else:
            self._critical.pop(origin, None)

    def update_waiting(self, origin: str, waiting: dict[str, int]) -> None:
        """`origin`'s standard requests waiting in its admission queue by model now (absent: none)."""
        if waiting:
            self._waiting[origin] = dict(waiting)
        else:
            self._waiting.pop(origin, None)

    def waiting(self, model: str) -> int:
        """The other replicas' standard requests waiting for `model`, as each last reported."""
        return sum(w.get(model, 0) for w in self._waiting.values())

    def critical_rate(self, model: str) -> float:
        """The other replicas' critical requests per second for `model`, as each last reported."""
        return sum(rates.get(model, 0.0) for rates in self._critical.values())

    def update(self, origin: str, counts: dict[str, int]) -> None:
        """`origin`'s full in-flight counts now (upstreams it does not list: 0)."""
        self._seen[origin] = self.clock()
        old = self._by_origin.get(origin)
        if old == counts:
            return
        self._add(old, -1)
        self._add(counts, 1)
        self._by_origin[origin] = dict(counts)

    def admits(self, origin: str) -> bool:
        """Whether `origin`'s counts may be held: one already held, or room for another."""
        return origin in self._seen or len(self._seen) < self.max_origins

    def forget(self, origin: str) -> bool:
        self._seen.pop(origin, None)
        self._critical.pop(origin, None)
        self._waiting.pop(origin, None)
        old = self._by_origin.pop(origin, None)
        self._add(old, -1)
        return old is not None

    def expire(self) -> list[str]:
        """Drop replicas not heard from within expire_s; returns their ids."""
        deadline = self.clock() - self.expire_s
        gone = [o for o, t in self._seen.items() if t < deadline]
        for origin in gone:
            self.forget(origin)
        return gone

    def origins(self) -> list[str]:
        return list(self._seen)

    def count(self, upstream_id: str) -> int:
        return self._total.get(upstream_id, 0)

    def _add(self, counts: dict[str, int] | None, sign: int) -> None:
        if not counts:
            return
        total = self._total
        for uid, n in counts.items():
            left = total.get(uid, 0) + sign * n
            if left > 0:
                total[uid] = left
            else:
                total.pop(uid, None)
