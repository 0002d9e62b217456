"""Small pieces the shared plugins (framework.SharedPlugin) have in common: a bounded outbox of
update records, a compact encoding of block-hash lists, and the checks another replica's records
must pass before a plugin applies them (`PeerChecks`).

Records are plain lists so msgpack carries them as they are; block hashes (8-byte blake2b digests,
see tokenization.hashing and prefix.prefix_hashes) travel as one concatenated `bytes` per request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

HASH_BYTES = 8
RESET = "r"  # record meaning "records before this were lost: release what I placed" (see Outbox)
MAX_OUTBOX = 50_000  # records held while nobody takes them (a stalled sync loop)
# Upstream ids taken from peers when the local pool is not known (PeerChecks.known is None): the
# first this many well-formed ids, so a hostile peer cannot grow per-upstream state without bound.
MAX_UPSTREAMS = 4096
MAX_UPSTREAM_ID = 256  # characters, as snapshots' ids (fleet/snapshots.py MAX_ID_LEN)
RECORD_MAX_AGE_S = 3600.0  # a peer's record stamped longer ago than this is not believed


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    return b"".join(hashes)


def unpack_hashes(blob: Any) -> list[bytes] | None:
    """The hashes of a packed blob, or None when it is not one (a malformed peer message)."""
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        return None
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


class Outbox:
    """Update records waiting for the sync loop. Records nothing until the first `take()` (no sync
    configured: no cost, no growth); past MAX_OUTBOX it keeps one RESET record instead, so peers
    release what this replica placed rather than hold pins whose finish they will never see."""

    __slots__ = ("_records", "dropped")

    def __init__(self) -> None:
        self._records: list[Any] | None = None
        self.dropped = 0

    @property
    def active(self) -> bool:
        return self._records is not None

    def add(self, record: list[Any]) -> None:
        records = self._records
        if records is None:
            return
        if len(records) >= MAX_OUTBOX:
            self.dropped += len(records)
            records.clear()
            records.append([RESET])
        records.append(record)

    def take(self) -> list[Any]:
        records = self._records or []
        self._records = []
        return records


def is_int(value: Any) -> TypeGuard[int]:
    """An int as msgpack decodes one (a bool is not a count)."""
    return type(value) is int


@dataclass(slots=True)
class PeerChecks:
    """What another replica's records and dumps must satisfy before a shared plugin applies them.
    server/sync.py binds one to every plugin (`PeerChecked`) and sets `now` and `known` before each
    message; a plugin used without sync keeps this default: well-formed ids, finite times.

    Plugins decode their own records and ask here; a check that fails counts the reason
    (`on_reject`) and the record is skipped, never raised."""

    now: float = math.nan
    """The receiver's clock (the fleet clock: unix or virtual seconds); NaN: no time window."""
    ahead_s: float = 0.0
    """Clock skew tolerated: a record up to this far ahead is taken as stamped now, not later."""
    max_age_s: float = RECORD_MAX_AGE_S
    known: Collection[str] | None = None
    """Upstream ids the local pool knows; None: any well-formed id, at most MAX_UPSTREAMS of them."""
    on_reject: Callable[[str, int], None] | None = None
    _taken: set[str] = field(default_factory=set)  # ids taken while `known` is None

    def upstream(self, uid: Any) -> bool:
        """Whether records about `uid` may be applied: an id this replica knows (others would grow
        per-upstream state and metric series for upstreams it will never route to)."""
        if not isinstance(uid, str):
            self.reject("record")
            return False
        known = self.known
        if known is not None:
            if uid in known:
                return True
        elif uid in self._taken:
            return True
        elif 0 < len(uid) <= MAX_UPSTREAM_ID and uid.isprintable() and len(self._taken) < MAX_UPSTREAMS:
            self._taken.add(uid)
            return True
        self.reject("unknown_upstream")
        return False

    def when(self, t: Any) -> float | None:
        """A record's time, checked: finite and within [now - max_age_s, now + ahead_s], then no
        later than now (a peer's clock a little ahead must not make an upstream look busy); None
        when it is not believed (counted)."""
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            self.reject("time")
            return None
        now = self.now
        if math.isnan(now):
            return float(t)
        if not now - self.max_age_s <= t <= now + self.ahead_s:
            self.reject("time")
            return None
        return min(float(t), now)

    def entries(self, n: int) -> bool:
        """Whether a dump of `n` upstreams is plausible: no more than this replica knows."""
        limit = len(self.known) if self.known is not None else MAX_UPSTREAMS
        if n <= limit:
            return True
        self.reject("too_many")
        return False

    def reject(self, reason: str, n: int = 1) -> None:
        if self.on_reject is not None and n:
            self.on_reject(reason, n)


@runtime_checkable
class PeerChecked(Protocol):
    """A shared plugin that checks peers' records against a PeerChecks (server/sync.py binds it)."""

    def check_peers(self, checks: PeerChecks) -> None: ...


def loaded_hashes(data: Any, peers: PeerChecks) -> Iterator[tuple[str, list[bytes]]]:
    """A peer's dumped per-upstream hashes (a plugin's `dump()`), checked as its records are: a
    mapping within the peers' entry bound, packed hashes, a known upstream; what fails is counted
    and skipped."""
    if not isinstance(data, dict):
        peers.reject("record")
        return
    if not peers.entries(len(data)):
        return
    for uid, blob in data.items():
        hashes = unpack_hashes(blob)
        if hashes is None:
            peers.reject("record")
        elif peers.upstream(uid) and hashes:
            yield uid, hashes
