"""The engine model of a simulated GPU inference server: continuous batching over a paged KV cache.

Pure logic in virtual time: no asyncio, no I/O, no wall clock. A driver (the simulated HTTP server,
a test, a benchmark) submits requests and calls `step(now)`; each call runs one scheduler iteration
the way vLLM V1 does and says how long it took on the profiled GPU, and the driver calls again at
`now + duration`. The same inputs always give the same events.

What is modelled (docs/simulator.md has the long version):
- Continuous batching: running sequences are scheduled first, in admission order (a decoding one
  takes one token of the step's budget, a partly prefilled one takes what is left of its prompt, up
  to the budget); then waiting ones are admitted FIFO while `max_num_seqs` and the budget allow.
  A prompt longer than the budget is prefilled in chunks over several steps; its first output token
  comes from the step that completes its prefill.
- Paged KV cache with automatic prefix caching: a full block's hash chains its parent's hash with the
  block's token ids; a new sequence reuses the longest run of cached blocks of its prompt (at most
  prompt length - 1 tokens, so the last prompt token is always computed, as in vLLM) and skips their
  prefill. Blocks whose last user finished stay cached, unreferenced, in an LRU queue and are evicted
  (least recently used first) only when a block is needed.
- Preemption by recompute: when a running sequence needs a block and none is free or evictable, the
  most recently admitted running sequence loses its blocks and goes back to the front of the waiting
  queue; when readmitted it prefills its prompt and the tokens it had generated (its full blocks may
  still be cached).
- Priority scheduling (`scheduling_policy="priority"`, vLLM's `--scheduling-policy priority`): the
  waiting queue is ordered by (priority, arrival), lower values first, and a running sequence that
  needs a block preempts the running one with the highest (priority, arrival) instead of the most
  recently admitted. As in vLLM V1, a waiting request never preempts a running one: a critical
  request skips the queue, not the batch.
- Step time: decode_base_s (every forward pass reads the weights once) + prefill_tokens x
  prefill_s_per_token, plus, if any sequence decodes, n_decoding x decode_s_per_seq + context_tokens x
  decode_s_per_kv_token, where context_tokens is the KV read by the decoding sequences.

KV-cache events (optional, `kv_events=True`): the pool records vLLM's `BlockStored` (each run of
newly cached full blocks, with its parent's hash and token ids), `BlockRemoved` (a cached block
evicted) and `AllBlocksCleared` (`reset_prefix_cache`), which a driver drains after each step
(`drain_kv_events`) and publishes in vLLM's wire format (server.py; extproc.publishers.kv_events).

A step costs O(running sequences + blocks allocated or freed + block hashes of newly full blocks and
of admitted prompts' lookups); nothing scans the cache. Token ids must fit in uint32.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from extproc.publishers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.engines.tokens import PIECE_VOCAB

ROOT_HASH = bytes(16)  # parent of a sequence's first block
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's identity: its parent's hash and its own token ids (so equal hashes mean equal
    prefixes). blake2b over little-endian uint32 ids: stable across processes, unlike `hash()`."""
    h = blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


# --- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token. `index` counts from 0 within the request's output."""

    request_id: str
    token_id: int
    index: int


@dataclass(frozen=True, slots=True)
class FirstTokenEvent:
    """The request's first output token; `ttft` is seconds from submit to the end of the step."""

    request_id: str
    ttft: float


@dataclass(frozen=True, slots=True)
class FinishedEvent:
    """The request produced its last token and released its KV blocks."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    completion_tokens: int
    preemptions: int
    ttft: float
    latency: float  # seconds from submit to the end of the step that produced the last token


@dataclass(slots=True)
class StepResult:
    """One scheduler iteration. Everything in it happens at `ended_at` (= started_at + duration)."""

    started_at: float
    duration: float
    prefill_tokens: int = 0  # prompt (or recomputed) tokens computed this step
    num_decoding: int = 0  # sequences that decoded one token
    context_tokens: int = 0  # KV tokens read by the decoding sequences
    tokens: list[TokenEvent] = field(default_factory=list)
    first_tokens: list[FirstTokenEvent] = field(default_factory=list)
    finished: list[FinishedEvent] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # moved from waiting to running, in order
    preempted: list[str] = field(default_factory=list)  # moved from running back to waiting

    @property
    def ended_at(self) -> float:
        return self.started_at + self.duration


# --- KV cache --------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Block:
    """One physical KV block. `hash` is set while the block holds a cached full block."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class _BlockPool:
    """Blocks, the free queue in eviction order, and the hash -> block map of cached full blocks.

    A block with ref_count 0 is in `free` whether or not it still holds cached data: allocating pops
    the front (the least recently used) and evicts its hash. Freed blocks with cached data go to the
    back; freed blocks without data go to the front, since evicting them loses nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, _Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, _Block] = {}
        self.evictions = 0  # cached blocks whose data was dropped to make room
        self.events: list[KvEvent] | None = None  # KV-cache events since the last drain, when enabled

    @property
    def num_free(self) -> int:
        return len(self.free)

    def longest_hit(self, hashes: Sequence[bytes], count: int) -> list[_Block]:
        """The cached blocks of the longest run of hits among the first `count` hashes."""
        hits: list[_Block] = []
        for i in range(count):
            block = self.cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[_Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[_Block]:
        out: list[_Block] = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.hash is not None:
                if self.cached.get(block.hash) is block:
                    del self.cached[block.hash]
                    self.evictions += 1
                    if self.events is not None:  # one event per evicted block, as vLLM sends them
                        self.events.append(BlockRemoved([block.hash], "GPU", 0))
                block.hash = None
            block.ref_count = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[_Block]) -> None:
        # Tail first, as vLLM does: a sequence's last blocks are the least likely to be shared, so
        # among its blocks they become the first to be evicted.
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = block
                if block.hash is None:
                    self.free.move_to_end(block.block_id, last=False)

    def cache(self, block: _Block, h: bytes) -> bool:
        """True when `block` now holds the cached copy of `h`."""
        # An identical block computed concurrently by another sequence is not de-duplicated (vLLM
        # doesn't either); the first one stays the cached copy.
        if block.hash is None and h not in self.cached:
            self.cached[h] = block
            block.hash = h
            return True
        return False

    def reset(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache); refused while any block is in use."""
        if any(b.ref_count for b in self.blocks):
            return False
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True


# --- sequences -------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Seq:
    """One request inside the engine. `tokens` is prompt + generated; KV exists for the first
    `num_computed` of them; `hashes` memoises the hashes of its full blocks (tokens only grow)."""

    request_id: str
    prompt_len: int
    max_tokens: int  # already capped so that prompt + output fits max_model_len
    submitted_at: float
    tokens: list[int]
    num_computed: int = 0
    blocks: list[_Block] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of `blocks` registered in the prefix cache
    output_count: int = 0
    cached_tokens: int | None = None
    preemptions: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None  # end of the step that sampled its latest token
    scheduled_at: float | None = None  # start of the step that first ran it (vLLM's prefill phase start)
    priority: int = 0  # lower runs first under the priority policy (vLLM's request field)
    arrival: int = 0  # submission order: the tie-break among equal priorities

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


def _order(seq: _Seq) -> tuple[int, int]:
    return seq.order


def next_token(last_token: int, position: int) -> int:
    """The "model": a deterministic id from the previous token and the position, in [0, PIECE_VOCAB)."""
    return (last_token * 2_654_435_761 + position * 40_503 + 12_345) % PIECE_VOCAB


class EngineModel:
    """One simulated engine (one GPU, one model) in virtual seconds. See the module docstring."""

    def __init__(
        self,
        profile: GpuProfile,
        *,
        clock_start: float = 0.0,
        ready_at: float = 0.0,
        kv_events: bool = False,
        scheduling_policy: str = "fcfs",
        preemption_threshold: int | None = None,
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, not {scheduling_policy!r}"
            )
        if preemption_threshold is not None and (scheduling_policy != "priority" or preemption_threshold < 0):
            raise ValueError("preemption_threshold needs the priority policy and must be >= 0")
        self.profile = profile
        self.by_priority = scheduling_policy == "priority"
        # SGLang's priority scheduling (not vLLM's): a waiting request that cannot be admitted
        # (no free slot or blocks) preempts running ones more than this much lower in priority.
        self.preemption_threshold = preemption_threshold
        self.clock = clock_start  # the latest time seen; time never runs backwards
        self.ready_at = ready_at
        self._pool = _BlockPool(profile.num_gpu_blocks)
        if kv_events:
            self._pool.events = []
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admission order
        self._waiting_tokens = 0  # sum of len(tokens) over waiting sequences (all to be computed)
        self._arrivals = 0
        # Running-batch summary as of the end of the last step (for predicted_ttft, O(1) to read).
        self._next_decoding = 0
        self._next_context = 0
        self._prefill_left = 0
        # Counters, cumulative, named after vLLM's.
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served from the cache
        self.prompt_tokens_total = 0
        self.prefill_time_sum = 0.0  # seconds from first scheduled to first token, summed over requests
        self.prefill_count = 0
        self.generation_tokens_total = 0
        # vLLM's inter_token_latency_seconds: the gap between a sequence's consecutive tokens.
        self.itl_sum = 0.0
        self.itl_count = 0
        # vLLM's time_to_first_token_seconds: submitted to first token, per request.
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.preemptions_total = 0
        self.steps = 0
        self.busy_s = 0.0  # sum of step durations

    # --- requests ------------------------------------------------------------------------------

    def submit(
        self, request_id: str, prompt_tokens: list[int], max_tokens: int, now: float, priority: int = 0
    ) -> None:
        """Queue a request. Its output is capped so that prompt + output fits max_model_len. A
        non-zero `priority` needs the priority policy (vLLM rejects it otherwise)."""
        now = self._advance(now)
        limit = self.profile.max_model_len - 1
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already submitted")
        if not prompt_tokens:
            raise ValueError("prompt must have at least one token")
        if len(prompt_tokens) > limit:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens exceeds max_model_len - 1 = {limit}")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if priority != 0 and not self.by_priority:
            raise ValueError("priority scheduling is not enabled on this engine")
        self._arrivals += 1
        seq = _Seq(
            request_id=request_id,
            prompt_len=len(prompt_tokens),
            max_tokens=min(max_tokens, self.profile.max_model_len - len(prompt_tokens)),
            submitted_at=now,
            tokens=list(prompt_tokens),
            priority=priority,
            arrival=self._arrivals,
        )
        self._seqs[request_id] = seq
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: _Seq, *, front: bool) -> None:
        """FCFS: a new request at the back, a preempted one at the front. Priority: by (priority,
        arrival), found from the back (most arrivals share the lowest class's order)."""
        self._waiting_tokens += len(seq.tokens)
        if not self.by_priority:
            if front:
                self._waiting.appendleft(seq)
            else:
                self._waiting.append(seq)
            return
        key = seq.order
        i = len(self._waiting)
        while i > 0 and self._waiting[i - 1].order > key:
            i -= 1
        self._waiting.insert(i, seq)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request (client went away): its blocks are released. False if unknown/finished."""
        self._advance(now)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.blocks:  # running
            self._running.remove(seq)
            self._pool.release(seq.blocks)
            seq.blocks = []
            self._summarise_running()
        else:
            self._waiting.remove(seq)
            self._waiting_tokens -= len(seq.tokens)
        self.requests_aborted += 1
        return True

    # --- scheduling ----------------------------------------------------------------------------

    def step(self, now: float) -> StepResult | None:
        """Run one scheduler iteration starting at `now`; None when there is nothing to do.

        Before `ready_at` nothing runs: the result is an empty step lasting until `ready_at`.
        """
        now = self._advance(now)
        if not self._running and not self._waiting:
            return None
        if now < self.ready_at:
            return StepResult(started_at=now, duration=self.ready_at - now)
        p = self.profile
        result = StepResult(started_at=now, duration=0.0)
        budget = p.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []

        # 1. Running sequences, in admission order; preempt from the back when blocks run out.
        # Under the priority policy a victim may be one already scheduled in this step: it leaves
        # `scheduled` and gives its tokens back; the scheduled ones stay a prefix of `_running`.
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            preempted = len(result.preempted)
            fits = self._make_room(seq, n, result, scheduled)
            if len(result.preempted) != preempted and self.by_priority:
                budget = self._budget_left(scheduled)
            if not fits:
                # seq itself was preempted (FCFS: the ones after it already were). vLLM stops here
                # under the priority policy too (its PR 26765, to go on, was not merged).
                break
            scheduled.append((seq, n))
            budget -= n
            i = len(scheduled)

        # 2. Waiting sequences, FIFO; none in a step that had to preempt (as in vLLM).
        if not result.preempted:
            while self._waiting and budget > 0:
                seq = self._waiting[0]
                if len(self._running) >= p.max_num_seqs:
                    if not self._preempt_for(seq, 0, result, scheduled):
                        break  # every slot taken (by requests it may not preempt)
                    budget = self._budget_left(scheduled)
                n = self._admit(seq, budget)
                if n == 0 and self._preempt_for(seq, self._admission_plan(seq, budget)[3], result, scheduled):
                    budget = self._budget_left(scheduled)
                    n = self._admit(seq, budget)
                if n == 0:
                    break  # not enough free blocks: the head waits, and so does everyone behind it
                self._waiting.popleft()
                self._waiting_tokens -= len(seq.tokens)
                self._running.append(seq)
                if seq.scheduled_at is None:
                    seq.scheduled_at = now
                result.admitted.append(seq.request_id)
                scheduled.append((seq, n))
                budget -= n

        if not scheduled and not result.preempted:
            raise RuntimeError("scheduler made no progress")  # cannot happen: see GpuProfile checks

        # 3. Cost of the step.
        for seq, n in scheduled:
            if seq.output_count > 0 and n == 1 and seq.num_computed == len(seq.tokens) - 1:
                result.num_decoding += 1
                result.context_tokens += len(seq.tokens)
            else:
                result.prefill_tokens += n
        result.duration = self._step_cost(result.prefill_tokens, result.num_decoding, result.context_tokens)
        end = now + result.duration

        # 4. Run it: KV computed, full blocks cached, a token sampled where a sequence is caught up.
        done = False
        for seq, n in scheduled:
            seq.num_computed += n
            self._cache_full_blocks(seq)
            if seq.num_computed < len(seq.tokens):
                continue  # prefill chunk, more to come
            token = next_token(seq.tokens[-1], len(seq.tokens))
            seq.tokens.append(token)
            seq.output_count += 1
            self.generation_tokens_total += 1
            if seq.last_token_at is not None:
                self.itl_sum += end - seq.last_token_at
                self.itl_count += 1
            seq.last_token_at = end
            result.tokens.append(TokenEvent(seq.request_id, token, seq.output_count - 1))
            if seq.first_token_at is None:
                seq.first_token_at = end
                self.prompt_tokens_total += seq.prompt_len
                # vLLM's request_prefill_time_seconds: first scheduled to first token.
                self.prefill_time_sum += end - (seq.scheduled_at if seq.scheduled_at is not None else now)
                self.prefill_count += 1
                result.first_tokens.append(FirstTokenEvent(seq.request_id, end - seq.submitted_at))
                self.ttft_sum += end - seq.submitted_at
                self.ttft_count += 1
            if seq.output_count >= seq.max_tokens:
                result.finished.append(self._finish(seq, end))
                done = True
        if done:
            self._running = [s for s in self._running if s.blocks]
        self._summarise_running()
        self.steps += 1
        self.busy_s += result.duration
        return result

    def _make_room(self, seq: _Seq, n: int, result: StepResult, scheduled: list[tuple[_Seq, int]]) -> bool:
        """Blocks for `n` more tokens of a running sequence, preempting the most recently admitted
        running sequence (priority policy: the highest (priority, arrival), which may already be
        scheduled in this step: it leaves the step) until they fit. False when `seq` itself had to go."""
        while not self._grow(seq, n):
            if self.by_priority:
                victim = max(self._running, key=_order)
                self._leave_step(victim, scheduled)
            else:
                victim = self._running.pop()
            self._preempt(victim)
            result.preempted.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _leave_step(self, victim: _Seq, scheduled: list[tuple[_Seq, int]]) -> None:
        """A running sequence about to be preempted leaves the batch, and this step if it was in it."""
        self._running.remove(victim)
        scheduled[:] = [(s, k) for s, k in scheduled if s is not victim]

    def _budget_left(self, scheduled: list[tuple[_Seq, int]]) -> int:
        """The step's token budget less what `scheduled` takes (recounted after a victim left)."""
        return self.profile.max_num_batched_tokens - sum(k for _, k in scheduled)

    def _preempt_for(
        self, seq: _Seq, blocks: int, result: StepResult, scheduled: list[tuple[_Seq, int]]
    ) -> bool:
        """With `preemption_threshold`: preempt the lowest-priority running sequences more than that
        much below waiting `seq` until `blocks` blocks and a slot are free for it; nothing when they
        would not be enough (SGLang's rule). False when nothing was preempted."""
        threshold = self.preemption_threshold
        if threshold is None:
            return False
        slot = len(self._running) >= self.profile.max_num_seqs
        lower = [s for s in self._running if s.priority - seq.priority > threshold]
        lower.sort(key=_order, reverse=True)
        chosen: list[_Seq] = []
        freed = 0
        for victim in lower:
            if freed >= blocks and (chosen or not slot):
                break
            chosen.append(victim)
            freed += sum(1 for b in victim.blocks if b.ref_count == 1)
        if not chosen or freed < blocks:
            return False
        for victim in chosen:
            self._leave_step(victim, scheduled)
            self._preempt(victim)
            result.preempted.append(victim.request_id)
        return True

    def _grow(self, seq: _Seq, n: int) -> bool:
        need = self._blocks_for(seq.num_computed + n) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self._pool.num_free:
            return False
        seq.blocks.extend(self._pool.allocate(need))
        return True

    def _preempt(self, seq: _Seq) -> None:
        self._pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self._enqueue(seq, front=True)

    def _admission_plan(self, seq: _Seq, budget: int) -> tuple[list[_Block], int, int, int]:
        """(cached blocks it would reuse, its first chunk's tokens, new blocks that chunk needs,
        blocks missing for them now) for admitting waiting `seq`; no state changes."""
        bs = self.profile.block_size
        count = (len(seq.tokens) - 1) // bs
        hits = self._pool.longest_hit(self._full_hashes(seq, count), count)
        cached = len(hits) * bs
        n = min(len(seq.tokens) - cached, budget)
        need = self._blocks_for(cached + n) - len(hits)
        reclaimed = sum(1 for b in hits if b.ref_count == 0)  # hits that sit in the free queue
        return hits, n, need, max(0, need - (self._pool.num_free - reclaimed))

    def _admit(self, seq: _Seq, budget: int) -> int:
        """Give a waiting sequence its cached prefix and blocks for its first chunk; the chunk's size,
        or 0 if the blocks are not there (then nothing changes)."""
        hits, n, need, missing = self._admission_plan(seq, budget)
        if missing:
            return 0
        cached = len(hits) * self.profile.block_size
        self._pool.touch(hits)
        seq.blocks = [*hits, *self._pool.allocate(need)]
        seq.num_computed = cached
        seq.num_cached_blocks = len(hits)
        if seq.cached_tokens is None:
            seq.cached_tokens = cached
        self.prefix_cache_queries += len(seq.tokens)
        self.prefix_cache_hits += cached
        return n

    def _finish(self, seq: _Seq, end: float) -> FinishedEvent:
        self._pool.release(seq.blocks)
        seq.blocks = []
        del self._seqs[seq.request_id]
        self.requests_finished += 1
        assert seq.first_token_at is not None
        return FinishedEvent(
            request_id=seq.request_id,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens or 0,
            completion_tokens=seq.output_count,
            preemptions=seq.preemptions,
            ttft=seq.first_token_at - seq.submitted_at,
            latency=end - seq.submitted_at,
        )

    def _cache_full_blocks(self, seq: _Seq) -> None:
        full = seq.num_computed // self.profile.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._full_hashes(seq, full)
        pool = self._pool
        events = pool.events
        run_start = -1  # first block of the current run of newly cached blocks (events only)
        for i in range(seq.num_cached_blocks, full):
            if pool.cache(seq.blocks[i], hashes[i]):
                if run_start < 0:
                    run_start = i
            elif events is not None and run_start >= 0:
                self._stored(seq, hashes, run_start, i)
                run_start = -1
        if events is not None and run_start >= 0:
            self._stored(seq, hashes, run_start, full)
        seq.num_cached_blocks = full

    def _stored(self, seq: _Seq, hashes: list[bytes], start: int, end: int) -> None:
        """A BlockStored event for blocks [start, end) of `seq`, just cached."""
        assert self._pool.events is not None
        bs = self.profile.block_size
        self._pool.events.append(
            BlockStored(
                hashes[start:end],
                hashes[start - 1] if start else None,
                seq.tokens[start * bs : end * bs],
                bs,
                group_idx=0,
            )
        )

    def drain_kv_events(self) -> list[KvEvent]:
        """KV-cache events since the last call (empty unless built with kv_events=True)."""
        events = self._pool.events
        if not events:
            return []
        self._pool.events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's /reset_prefix_cache; False while requests run."""
        return self._pool.reset()

    def _full_hashes(self, seq: _Seq, count: int) -> list[bytes]:
        """The sequence's block hashes, at least its first `count` full blocks' (computed once each)."""
        bs = self.profile.block_size
        hashes = seq.hashes
        while len(hashes) < count:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else ROOT_HASH, seq.tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.profile.block_size)

    def _step_cost(self, prefill_tokens: int, num_decoding: int, context_tokens: int) -> float:
        """Every forward pass reads all the weights once (decode_base_s), whether it prefills, decodes or
        both; prefill adds compute per token, decode adds per-sequence and per-context-token costs."""
        p = self.profile
        cost = p.decode_base_s + prefill_tokens * p.prefill_s_per_token
        if num_decoding:
            cost += num_decoding * p.decode_s_per_seq + context_tokens * p.decode_s_per_kv_token
        return cost

    def _summarise_running(self) -> None:
        decoding = context = prefill_left = 0
        for seq in self._running:
            left = len(seq.tokens) - seq.num_computed
            if seq.output_count > 0 and left == 1:
                decoding += 1
                context += len(seq.tokens)
            else:
                prefill_left += left
        self._next_decoding, self._next_context, self._prefill_left = decoding, context, prefill_left

    def _advance(self, now: float) -> float:
        if now > self.clock:
            self.clock = now
        return self.clock

    # --- introspection -------------------------------------------------------------------------

    def ready(self, now: float) -> bool:
        """False while the model is "loading" (before `ready_at`): a server answers /health with 503."""
        return now >= self.ready_at

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_blocks(self) -> int:
        """Blocks not held by a running sequence, including cached ones that could be evicted."""
        return self._pool.num_free

    @property
    def cached_blocks(self) -> int:
        """Blocks currently holding a cached full block (referenced or not)."""
        return len(self._pool.cached)

    @property
    def evicted_blocks(self) -> int:
        return self._pool.evictions

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks held by running sequences, as vLLM's kv_cache_usage_perc: cached blocks
        that nobody references count as free."""
        return 1.0 - self._pool.num_free / self.profile.num_gpu_blocks

    def cached_prefix_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """Prompt tokens that would be served from the prefix cache if admitted now (no state change).

        Same rule as admission: whole blocks only, at most len(prompt) - 1 tokens."""
        bs = self.profile.block_size
        parent = ROOT_HASH
        hit = 0
        for i in range((len(prompt_tokens) - 1) // bs):
            parent = block_hash(parent, prompt_tokens[i * bs : (i + 1) * bs])
            if parent not in self._pool.cached:
                break
            hit += bs
        return hit

    def predicted_ttft(self, prompt_tokens: Sequence[int], now: float) -> float:
        """A cheap estimate of the TTFT a prompt submitted now would see. An estimate, not a promise:

        every token queued ahead (waiting prompts counted without cache hits, unfinished prefills of
        running sequences) plus this prompt's uncached tokens is prefilled at prefill_s_per_token, in
        steps of (budget - decoding sequences) tokens that each also pay the current batch's decode
        cost; if all `max_num_seqs` slots are taken, add the decode steps until a slot frees up for
        this request (see _slot_wait_s; the only part that is not O(1) plus the cache lookup); before
        `ready_at`, add the wait until then. It knows every request's max_tokens, which a real engine
        does not, and ignores preemption and future arrivals.
        """
        p = self.profile
        own = len(prompt_tokens) - self.cached_prefix_tokens(prompt_tokens)
        ahead = self._waiting_tokens + self._prefill_left + own
        per_step = max(1, p.max_num_batched_tokens - self._next_decoding)
        steps = math.ceil(ahead / per_step)
        decode_step = self._step_cost(0, self._next_decoding, self._next_context)
        estimate = ahead * p.prefill_s_per_token + steps * decode_step
        if len(self._running) + len(self._waiting) >= p.max_num_seqs:
            estimate += self._slot_wait_s()
        return estimate + max(0.0, self.ready_at - max(now, self.clock))

    def _slot_wait_s(self) -> float:
        """When every sequence slot will be taken: decode steps until one frees up for a newcomer,
        by list scheduling of the waiting queue (FIFO) onto the slots as running sequences finish,
        each step costing a full batch's decode. O((running + waiting) log max_num_seqs)."""
        p = self.profile
        slots = [s.max_tokens - s.output_count for s in self._running]
        slots.extend([0] * (p.max_num_seqs - len(slots)))
        heapq.heapify(slots)
        for seq in self._waiting:
            heapq.heappush(slots, heapq.heappop(slots) + seq.max_tokens - seq.output_count)
        if self._next_decoding:
            mean_context = self._next_context / self._next_decoding
        else:
            mean_context = self._waiting_tokens / max(1, len(self._waiting))
        full_step = self._step_cost(0, p.max_num_seqs, int(p.max_num_seqs * mean_context))
        return slots[0] * full_step
