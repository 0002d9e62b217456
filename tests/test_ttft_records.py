"""The replica records of `predicted-ttft` (extproc.scheduling.ttft_records): typed, versioned by
their length, checked against the receiver's PeerChecks."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from extproc.scheduling.sharing import PeerChecks, pack_hashes
from extproc.scheduling.ttft_records import Finish, Pick, Reset, decode

HASHES = [bytes([i]) * 8 for i in range(4)]


def checks(now: float = 100.0, known: tuple[str, ...] = ("u1",)) -> tuple[PeerChecks, Counter[str]]:
    rejected: Counter[str] = Counter()
    return PeerChecks(now=now, known=known, on_reject=lambda why, n: rejected.update({why: n})), rejected


def test_every_record_decodes_to_what_was_encoded() -> None:
    peers, rejected = checks()
    pick = Pick(7, "u1", HASHES, 3, 0.25, 99.5, 2)
    assert decode(pick.encode(), peers) == pick
    assert decode(Finish(7).encode(), peers) == Finish(7)
    assert decode(Reset().encode(), peers) == Reset()
    assert not rejected


def test_each_version_is_read_by_its_length() -> None:
    """Version 1 (7 fields, before demand counting) counts no demand; a newer replica's longer record
    is read as far as this version knows, so a rolling upgrade keeps sharing."""
    peers, rejected = checks()
    v2 = Pick(1, "u1", HASHES, 3, 0.25, 99.5, 4).encode()
    assert decode(v2[:7], peers) == Pick(1, "u1", HASHES, 3, 0.25, 99.5, 0)
    assert decode([*v2, "a later field"], peers) == Pick(1, "u1", HASHES, 3, 0.25, 99.5, 4)
    assert decode(["f", 1, "a later field"], peers) == Finish(1)
    assert not rejected


def test_a_time_ahead_of_the_receiver_becomes_its_now() -> None:
    peers, _ = checks()
    peers.ahead_s = 1.0
    pick = decode(Pick(1, "u1", HASHES, 3, 0.25, 100.5, 0).encode(), peers)
    assert isinstance(pick, Pick) and pick.at == 100.0


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ("p", "record"),
        ([], "record"),
        (["p", 1, "u1", pack_hashes(HASHES), 3, 0.25], "record"),  # too short for any version
        (["p", "1", "u1", pack_hashes(HASHES), 3, 0.25, 99.0, 0], "record"),  # serial not an int
        (["p", 1, "u1", b"123", 3, 0.25, 99.0, 0], "record"),  # not packed hashes
        (["p", 1, "u1", pack_hashes(HASHES), True, 0.25, 99.0, 0], "record"),  # a bool is no count
        (["p", 1, "u1", pack_hashes(HASHES), 3, math.nan, 99.0, 0], "record"),
        (["p", 1, "u1", pack_hashes(HASHES), 3, -1.0, 99.0, 0], "record"),
        (["p", 1, "u1", pack_hashes(HASHES), 3, 4000.0, 99.0, 0], "record"),  # an hour of prefill
        (["p", 1, 5, pack_hashes(HASHES), 3, 0.25, 99.0, 0], "record"),  # an id that is no string
        (["p", 1, "u9", pack_hashes(HASHES), 3, 0.25, 99.0, 0], "unknown_upstream"),
        (["p", 1, "u1", pack_hashes(HASHES), 3, 0.25, math.inf, 0], "time"),
        (["p", 1, "u1", pack_hashes(HASHES), 3, 0.25, 100.0 - 7200, 0], "time"),
        (["f", "1"], "record"),
        (["r", 1], "record"),
        (["x", 1], "record"),
    ],
)
def test_a_bad_record_is_skipped_and_counted_by_why(record: Any, reason: str) -> None:
    peers, rejected = checks()
    assert decode(record, peers) is None
    assert rejected == Counter({reason: 1})


def test_a_demand_figure_that_cannot_be_one_counts_none_but_the_pick_stands() -> None:
    peers, rejected = checks()
    for best in (-1, 5, 1.5, "2"):
        record = [*Pick(1, "u1", HASHES, 1 << 20, 0.25, 99.0, 0).encode()[:7], best]
        pick = decode(record, peers)
        assert isinstance(pick, Pick) and pick.best_matched == 0
        assert pick.output_blocks == 1 << 16  # a peer's output held is capped
    assert not rejected
