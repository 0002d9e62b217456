"""The records `predicted-ttft` shares with the other replicas (framework.SharedPlugin, carried by
server/sync.py), as typed values: what a pick placed and queued, and when it finished.

On the wire a record is a msgpack list whose first item is its kind. Fields are only ever appended,
so a record's length is its version, and a replica reads every version up to its own (a rolling
upgrade mixes them); a longer record, from a newer replica, is read as far as this one knows.

| kind | version (length) | fields after the kind |
|---|---|---|
| pick `"p"` | 1 (7) | serial, upstream id, packed block hashes, output blocks, prefill seconds, sent at |
| pick `"p"` | 2 (8) | the same, then the longest prefix any candidate held (blocks; `copy_demand`) |
| finish `"f"` | 1 (2) | the pick's serial |
| reset `"r"` | 1 (1) | (sharing.RESET: the sender lost records; release what it placed) |

Decoding checks a record against the receiver's `PeerChecks` and counts what fails there: its
shape and ranges ("record"), then a pick's upstream (one this replica knows) and time (believable,
and no later than the receiver's now, which it becomes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.scheduling.sharing import RESET, PeerChecks, is_int, pack_hashes, unpack_hashes

PICK = "p"
FINISH = "f"
PICK_V1_FIELDS = 7  # a replica from before demand counting
PICK_FIELDS = 8  # this version's
MAX_REMOTE_PREFILL_S = 3600.0  # a peer's pick predicting more prefill than this is not believed
MAX_OUTPUT_BLOCKS = 1 << 16  # a peer's output blocks are taken up to this many


@dataclass(slots=True, frozen=True)
class Pick:
    """A replica routed a request: its prompt's blocks are now cached (and pinned) at the upstream,
    and its prefill queued there from `at`."""

    serial: int  # the sender's own count of its picks: its finish names it
    upstream_id: str
    hashes: list[bytes]  # the prompt's block hashes, in order
    output_blocks: int  # KV blocks held for the output
    prefill_s: float  # the prefill time it added to the upstream's queue
    at: float  # when, on the fleet clock (as the receiver believes it: PeerChecks.when)
    best_matched: int = 0  # leading blocks held by the candidate holding the most; 0 from version 1

    def encode(self) -> list[Any]:
        return [
            PICK,
            self.serial,
            self.upstream_id,
            pack_hashes(self.hashes),
            self.output_blocks,
            self.prefill_s,
            self.at,
            self.best_matched,
        ]


@dataclass(slots=True, frozen=True)
class Finish:
    """The request of the sender's pick `serial` ended: its blocks are no longer pinned."""

    serial: int

    def encode(self) -> list[Any]:
        return [FINISH, self.serial]


@dataclass(slots=True, frozen=True)
class Reset:
    """The sender lost records (its outbox overflowed): release everything it placed."""

    def encode(self) -> list[Any]:
        return [RESET]


Record = Pick | Finish | Reset


def decode(record: Any, peers: PeerChecks) -> Record | None:
    """A peer's record, typed and checked; None (counted by `peers`) when it is not to be applied."""
    if isinstance(record, list) and record:
        kind, n = record[0], len(record)
        if kind == PICK and n >= PICK_V1_FIELDS:
            return _pick(record, peers)
        if kind == FINISH and n >= 2 and is_int(record[1]):
            return Finish(record[1])
        if kind == RESET and n == 1:
            return Reset()
    peers.reject("record")
    return None


def _pick(record: list[Any], peers: PeerChecks) -> Pick | None:
    serial, uid, blob, output_blocks, prefill_s, at = record[1:PICK_V1_FIELDS]
    hashes = unpack_hashes(blob)
    if (
        hashes is None
        or not is_int(serial)
        or not is_int(output_blocks)
        or not isinstance(prefill_s, int | float)
        or isinstance(prefill_s, bool)
        or not 0 <= prefill_s < MAX_REMOTE_PREFILL_S  # (NaN fails too)
    ):
        peers.reject("record")
        return None
    if not peers.upstream(uid):
        return None
    believed = peers.when(at)
    if believed is None:
        return None
    best = record[PICK_V1_FIELDS] if len(record) >= PICK_FIELDS else 0
    if not is_int(best) or not 0 <= best <= len(hashes):
        best = 0  # a figure that cannot be one counts no demand; the placement still stands
    output_blocks = max(0, min(output_blocks, MAX_OUTPUT_BLOCKS))
    return Pick(serial, uid, hashes, output_blocks, float(prefill_s), believed, best)
