"""LRU cache of token ids per prompt segment, so a multi-turn chat tokenizes only what is new.

Keys are (tokenizer name, blake2b-128 of the segment text): the text itself is not kept, so an entry
costs its ids (4 bytes a token, array('I')) plus a fixed overhead. Bounded by entries and by bytes.
Thread-safe: segments are looked up on the event loop and filled from the tokenizer thread pool.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CacheKey = tuple[str, bytes]

ENTRY_OVERHEAD = 200  # bytes: key tuple + digest + OrderedDict node + array header, rounded up


@dataclass(slots=True)
class CacheStats:
    """Counters since start, for metrics: hits/misses count segments, *_tokens the tokens in them."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SegmentCache:
    """LRU map from segment key to its token ids (array('I'))."""

    def __init__(self, max_entries: int = 65_536, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[CacheKey, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get_many(self, keys: Sequence[CacheKey]) -> list[array[int] | None]:
        """Ids per key (None on a miss); hits become most recently used. Counts hits only: the
        caller counts misses when it stores them (put_many), with their token counts."""
        out: list[array[int] | None] = []
        with self._lock:
            data = self._data
            for key in keys:
                ids = data.get(key)
                if ids is not None:
                    data.move_to_end(key)
                    self._stats.hits += 1
                    self._stats.hit_tokens += len(ids)
                out.append(ids)
        return out

    def put_many(self, items: Sequence[tuple[CacheKey, array[int]]]) -> None:
        """Store freshly encoded segments (each one a miss), evicting least recently used entries.
        A segment larger than a quarter of the byte budget is not kept: it would flush the rest."""
        with self._lock:
            stats, data = self._stats, self._data
            for key, ids in items:
                stats.misses += 1
                stats.miss_tokens += len(ids)
                size = len(ids) * 4 + ENTRY_OVERHEAD
                if size * 4 > self.max_bytes or self.max_entries == 0:
                    continue
                old = data.pop(key, None)
                if old is not None:  # filled concurrently by another request
                    stats.bytes -= len(old) * 4 + ENTRY_OVERHEAD
                data[key] = ids
                stats.bytes += size
                while len(data) > self.max_entries or stats.bytes > self.max_bytes:
                    _, evicted = data.popitem(last=False)
                    stats.bytes -= len(evicted) * 4 + ENTRY_OVERHEAD
                    stats.evictions += 1

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        with self._lock:
            s = self._stats
            return CacheStats(
                hits=s.hits,
                misses=s.misses,
                hit_tokens=s.hit_tokens,
                miss_tokens=s.miss_tokens,
                evictions=s.evictions,
                entries=len(self._data),
                bytes=s.bytes,
            )

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._stats.bytes = 0
