"""Small pieces the shared plugins (framework.SharedPlugin) have in common: a bounded outbox of
update records and a compact encoding of block-hash lists.

Records are plain lists so msgpack carries them as they are; block hashes (8-byte blake2b digests,
see tokenization.hashing and prefix.prefix_hashes) travel as one concatenated `bytes` per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HASH_BYTES = 8
RESET = "r"  # record meaning "records before this were lost: release what I placed" (see Outbox)
MAX_OUTBOX = 50_000  # records held while nobody takes them (a stalled sync loop)


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
