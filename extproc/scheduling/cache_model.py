"""A model of one engine's prefix cache, bounded by that engine's real KV capacity.

Engines (vLLM, SGLang) keep a finished request's full KV blocks cached, unreferenced, in an LRU queue
and evict the least recently used ones only when a new request needs room; blocks of running requests
are pinned. A router that assumes an engine still holds everything ever sent to it sends tenants to
engines that evicted them long ago. So this model does what the engine does, in
the units the engine uses:

- capacity: `kv_blocks_total x block_size` tokens from the engine's snapshot, in index blocks of
  `block_tokens` tokens (several engine blocks: fewer hashes per request);
- a routed request pins its prompt's blocks plus room for its output until it finishes;
- a finished request's blocks become evictable, most recent last, freed tail first as the engines
  free them, and its output's blocks join them (they take cache room too); a later prompt that
  contains the request's last prompt block (a chat's next turn, which resends the reply) holds the
  reply's tokens in its own blocks, so the reply's blocks are dropped then, not counted twice;
- eviction takes the least recently used evictable block when pinned + evictable exceed capacity;
- `reset()` forgets everything (the engine restarted or changed readiness).

It sees only this process's decisions: other replicas' traffic and the engine's own preemptions are
invisible, which is why it is a model and its hit predictions are measured against the engine model
in the tests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Placement:
    """What one routed request holds in a cache model until it finishes."""

    hashes: tuple[bytes, ...]
    output_blocks: int
    epoch: int


@dataclass(slots=True)
class CacheModel:
    capacity_blocks: int
    _pinned: dict[bytes, int] = field(default_factory=dict)  # hash -> requests holding it
    _evictable: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # LRU first
    _anonymous_pinned: int = 0  # output blocks of running requests (not hashable: not known yet)
    _anonymous_serial: int = 0
    epoch: int = 0  # bumped by reset(): placements made before it are released as no-ops
    # A finished request's reply blocks by its prompt's last block: a later prompt that extends it
    # (the next turn of a chat) holds those tokens in its own blocks, so the reply's go.
    _replies: dict[bytes, list[bytes]] = field(default_factory=dict)

    @property
    def used_blocks(self) -> int:
        return len(self._pinned) + self._anonymous_pinned + len(self._evictable)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned) + self._anonymous_pinned

    def maps(self) -> tuple[Mapping[bytes, int], Mapping[bytes, None]]:
        """The two maps a held block is in (pinned, evictable): the same objects for the model's life
        (reset() clears them), so a caller scanning many models can keep them."""
        return self._pinned, self._evictable

    def matched(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` the engine is predicted to hold (pinned or cached)."""
        n = 0
        pinned, evictable = self._pinned, self._evictable
        for h in hashes:
            if h not in pinned and h not in evictable:
                break
            n += 1
        return n

    def matched_with(self, hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
        """Leading blocks of `hashes` the engine holds by its own word (`held`: the KV-event index,
        extproc.fleet.kv_index) or that requests placed here pin (their blocks may not be computed,
        or reported, yet); the model's evictable blocks are not consulted."""
        n = 0
        pinned = self._pinned
        for h in hashes:
            if h not in pinned and not held(h):
                break
            n += 1
        return n

    def place(self, hashes: Sequence[bytes], output_blocks: int) -> Placement:
        """A request was routed here: pin its prompt blocks (reusing cached ones) and its output room."""
        pinned, evictable = self._pinned, self._evictable
        replies = self._replies
        for h in hashes:
            held = pinned.get(h)
            if held is not None:
                pinned[h] = held + 1
            else:
                evictable.pop(h, None)
                pinned[h] = 1
            if replies:
                reply = replies.pop(h, None)
                if reply is not None:
                    for key in reply:
                        evictable.pop(key, None)
        self._anonymous_pinned += output_blocks
        self._evict()
        return Placement(tuple(hashes), output_blocks, self.epoch)

    def release(self, placement: Placement) -> None:
        """The request finished: its blocks stay cached, evictable, most recently used last, and
        tail first as the engines free them (vLLM frees a sequence's blocks in reverse; SGLang's radix
        tree evicts leaves): its output, then its prompt from the last block to the first, so a
        prefix is eaten from its end and its first blocks, the ones other prompts share, go last.
        Freed head first, the model would lose a prefix's first block before the rest and, since a
        match stops at the first missing block, take the whole prefix for evicted while the engine
        still held nearly all of it (notebook/benchmarks-history.md, "Tail-first release in the cache
        model")."""
        if placement.epoch != self.epoch:
            return  # reset() since it was placed: those blocks are gone already
        pinned, evictable = self._pinned, self._evictable
        self._anonymous_pinned = max(0, self._anonymous_pinned - placement.output_blocks)
        reply = []
        for _ in range(placement.output_blocks):
            self._anonymous_serial += 1
            key = self._anonymous_serial.to_bytes(9, "little")  # 9 bytes: never a real hash
            evictable[key] = None
            reply.append(key)
        if reply and placement.hashes:
            replies = self._replies
            replies[placement.hashes[-1]] = reply
            if len(replies) > self.capacity_blocks:
                del replies[next(iter(replies))]
        for h in reversed(placement.hashes):
            held = pinned.get(h)
            if held is None:
                continue
            if held > 1:
                pinned[h] = held - 1
            else:
                del pinned[h]
                evictable[h] = None
        self._evict()

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks != self.capacity_blocks:
            self.capacity_blocks = capacity_blocks
            self._evict()

    def reset(self) -> None:
        self.epoch += 1
        self._pinned.clear()
        self._evictable.clear()
        self._replies.clear()
        self._anonymous_pinned = 0

    def held(self) -> list[bytes]:
        """Prompt block hashes held, least recently used first, pinned ones last (output blocks,
        which have no hash, left out): what a replica hands a late-starting one."""
        return [h for h in self._evictable if len(h) != 9] + list(self._pinned)

    def _evict(self) -> None:
        over = self.used_blocks - self.capacity_blocks
        evictable = self._evictable
        while over > 0 and evictable:
            evictable.popitem(last=False)
            over -= 1
