"""Prefix-cache affinity: send a request where its prompt's prefix was sent before.

An approximate index learned from this process's own decisions: the prompt text is cut into blocks
of `block_chars` characters whose hashes chain (a block's hash covers everything before it, as the
engines' KV-cache block hashes do over token ids), and each upstream remembers, LRU-bounded, the
block hashes of the prompts routed to it. A candidate scores the fraction of the prompt's leading
blocks it holds. Text blocks stand in for token blocks until the service tokenizes prompts; they
match the same shared prefixes (system prompts, chat history), at a coarser grain.

Bounded affinity: a candidate whose queue is far above the least-loaded candidate's scores 0, so a
hot shared prefix spills onto more instances instead of collapsing the fleet onto one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import SCORERS, FleetState
from extproc.scheduling.sharing import RESET, Outbox, PeerChecks, loaded_hashes, pack_hashes, unpack_hashes


def prefix_hashes(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the full `block_chars` blocks of `text` (at most `max_blocks`)."""
    out: list[bytes] = []
    parent = b""
    # Only the blocks hashed are encoded (a character is at least one byte, so this many characters
    # cover them): a multi-megabyte prompt is not copied whole on the event loop.
    data = text[: block_chars * max_blocks].encode("utf-8", "surrogatepass")
    for start in range(0, min(len(data) // block_chars, max_blocks) * block_chars, block_chars):
        parent = blake2b(parent + data[start : start + block_chars], digest_size=8).digest()
        out.append(parent)
    return out


@SCORERS.register("prefix-affinity")
@dataclass(slots=True)
class PrefixAffinityScorer:
    block_chars: int = 256
    max_blocks: int = 512  # prompts beyond 128 KiB of text are matched on their first 128 KiB
    # Per upstream, LRU. ~ the engine's KV capacity in blocks of this size: an H100 serving an 8B model
    # holds ~440k tokens ~ 1.75 MB of text ~ 6.8k blocks of 256 chars. ~100 bytes per entry.
    capacity_blocks: int = 8192
    # No affinity for a candidate whose queue exceeds ratio x the least-loaded candidate's + slack:
    # a hot prefix spills over before its holder's queue grows long (notebook/benchmarks-history.md,
    # "Multi-turn chat").
    overload_ratio: float = 2.0
    overload_slack: float = 16.0
    _index: dict[str, OrderedDict[bytes, None]] = field(init=False, default_factory=dict)
    _last: tuple[InferenceRequest | None, list[bytes]] = field(init=False, default=(None, []))
    _outbox: Outbox = field(init=False, default_factory=Outbox)  # picks for the other replicas
    _peers: PeerChecks = field(init=False, default_factory=PeerChecks)  # what their records must pass

    def _hashes(self, request: InferenceRequest) -> list[bytes]:
        """Hashed once per request: score() and on_pick() of the same decision share them."""
        if self._last[0] is not request:
            self._last = (request, prefix_hashes(request.prompt_text, self.block_chars, self.max_blocks))
        return self._last[1]

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        hashes = self._hashes(request)
        if not hashes:
            return [0.0] * len(candidates)
        queues = [_queue(u, state) for u in candidates]
        bound = min(queues) * self.overload_ratio + self.overload_slack
        scores = []
        for u, q in zip(candidates, queues, strict=True):
            held = self._index.get(u.id)
            if held is None or q > bound:
                scores.append(0.0)
                continue
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            scores.append(n / len(hashes))
        return scores

    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: FleetState) -> None:
        """The chosen engine will cache this prompt: remember its blocks there (most recent last)."""
        hashes = self._hashes(request)
        if not hashes:
            return
        self._remember(upstream.id, hashes)
        if self._outbox.active:
            self._outbox.add([upstream.id, pack_hashes(hashes)])

    def _remember(self, upstream_id: str, hashes: Sequence[bytes]) -> None:
        held = self._index.setdefault(upstream_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    # -- shared between replicas (framework.SharedPlugin; server/sync.py) ---------------------------
    def take_updates(self) -> list[Any]:
        return self._outbox.take()

    def check_peers(self, checks: PeerChecks) -> None:
        self._peers = checks

    def apply_updates(self, origin: str, updates: list[Any]) -> None:
        """Another replica's picks: their prompts' blocks now sit at those upstreams too. Records
        of another shape, or about upstreams this replica does not know, are skipped (counted)."""
        peers = self._peers
        for record in updates:
            if record == [RESET]:  # nothing is held per replica: nothing to release
                continue
            hashes = unpack_hashes(record[1]) if isinstance(record, list) and len(record) == 2 else None
            if hashes is None:
                peers.reject("record")
            elif peers.upstream(record[0]) and hashes:
                self._remember(record[0], hashes[: self.max_blocks])

    def forget_upstream(self, upstream_id: str) -> None:
        """framework.UpstreamMemory: the blocks remembered there go."""
        self._index.pop(upstream_id, None)

    def forget_origin(self, origin: str) -> None:
        """Nothing is held per replica: what it taught about the upstreams stays true."""

    def dump(self) -> Any:
        return {uid: pack_hashes(list(held)) for uid, held in self._index.items()}

    def load(self, data: Any) -> None:
        """Another replica's index, checked as its records are (known upstreams, packed hashes)."""
        for uid, hashes in loaded_hashes(data, self._peers):
            # Least recent first, as dumped; merged under what this replica learnt itself.
            held = self._index.setdefault(uid, OrderedDict())
            mine = list(held)
            self._remember(uid, hashes[-self.capacity_blocks :])
            self._remember(uid, mine)

    def index_sizes(self) -> dict[str, int]:
        return {uid: len(held) for uid, held in self._index.items()}


def _queue(u: Upstream, state: FleetState) -> float:
    """Requests at the upstream per unit of capacity: reported running + waiting + not yet reported."""
    load = state.load(u.id)
    reported = load.num_running + load.num_waiting if load is not None else 0
    return (reported + state.pending(u.id)) / u.weight
