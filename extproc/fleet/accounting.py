"""The service's own in-flight accounting: requests it sent to each upstream and has not seen finish."""

from __future__ import annotations

from collections.abc import Callable

from extproc.fleet.pool import Upstream

# Told the cluster and +1/-1 on every change (the in-flight gauge per cluster).
ChangeHook = Callable[[str, int], None]


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

    __slots__ = ("_counts", "_hook")

    def __init__(self, on_change: ChangeHook | None = None) -> None:
        self._counts: dict[str, int] = {}
        self._hook = on_change

    def acquire(self, upstream: Upstream) -> Lease:
        self._counts[upstream.id] = self._counts.get(upstream.id, 0) + 1
        if self._hook is not None:
            self._hook(upstream.cluster, 1)
        return Lease(self, upstream)

    def count(self, upstream_id: str) -> int:
        return self._counts.get(upstream_id, 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def _decrement(self, upstream: Upstream) -> None:
        left = self._counts.get(upstream.id, 0) - 1
        if left > 0:
            self._counts[upstream.id] = left
        else:
            self._counts.pop(upstream.id, None)
        if self._hook is not None:
            self._hook(upstream.cluster, -1)
