"""Discrete-event stand-ins for the peer routers' `cache_aware` policies, written from their documented
behaviour (no code copied). The peers are Rust binaries that run in wall-clock time; these run in the
DES's virtual time next to `llm-extproc`, on the same engines and requests.

**sglang-router `cache_aware`** (package `sglang-router` 0.3.2; the policy's module comment in
`sgl-router/src/policies/cache_aware.rs` and its `tree.rs`, github.com/sgl-project/sglang):

- The router keeps one *approximate* radix tree over request **text** (characters, not tokens), shared by
  all workers, each node remembering which workers ("tenants") were sent text through it and when. It
  learns only from its own routing decisions; it never reads the engines' caches.
- Load is the number of requests the router has outstanding at each worker. The system is *imbalanced*
  when ``max_load - min_load > balance_abs_threshold`` **and** ``max_load > min_load *
  balance_rel_threshold``; then the request goes to the least-loaded worker (its text is still inserted
  for that worker).
- Otherwise the longest prefix match over the tree gives a matched length and a worker holding it; if
  ``matched_chars / len(text) > cache_threshold`` the request goes there, else to the worker with the
  **smallest tree** (fewest characters: "most available cache capacity"). The text is inserted for the
  chosen worker.
- Every ``eviction_interval_secs`` a background task evicts least-recently-used leaves of each worker
  whose tree holds more than ``max_tree_size`` characters, down to that size.
- The routing text of a chat request is the text content of its messages joined by single spaces
  (``ChatCompletionRequest::extract_text_for_routing``).

Defaults, verified against ``python -m sglang_router.launch_router --help`` of sglang-router 0.3.2 and
its ``router_args.py`` (``RouterArgs``): ``cache_threshold 0.3``, ``balance_abs_threshold 64``,
``balance_rel_threshold 1.5``, ``eviction_interval_secs 60``, ``max_tree_size 2**26``. (Older
releases' ``Router`` class and the Rust library's ``CacheAwareConfig::default()`` use 0.5 / 32 /
1.0001-1.1 / 30-60 s / 10 000-2**24; a router started from the command line, as the live bench does,
gets the CLI values above, so those are ours.)

**vllm-router `cache_aware`** (package `vllm-router` 0.1.17, a fork of sglang's router;
`src/policies/cache_aware.rs` of github.com/vllm-project/router): the same tree, load test and
defaults (``vllm-router --help``: 0.3 / 64 / 1.5, ``eviction_interval_secs 120``, ``max_tree_size``
2**25 characters per worker) with one documented difference: when the match is at or below
``cache_threshold`` the request goes to the **least-loaded** worker, not the one with the smallest tree.
(Newer vllm-router versions add an exact-match session map keyed by a session header; the workloads
here send none, so the history text is what is matched, as above.)

Where the peers leave a choice to hash-map iteration order (which of several workers holding the
matched node; ties between equally small trees or equal loads) these stand-ins take the most recently
used worker, and the lowest index, so runs are deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from extproc_lab.engines.tokens import content_text


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """One peer's cache_aware parameters (see the module docstring for sources)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**26  # characters per worker
    low_match: Literal["smallest-tree", "min-load"] = "smallest-tree"


SGLANG_CACHE_AWARE = CacheAwareConfig()
VLLM_ROUTER_CACHE_AWARE = CacheAwareConfig(
    eviction_interval_s=120.0, max_tree_size=2**25, low_match="min-load"
)


def routing_text(body: Mapping[str, Any]) -> str:
    """The text a peer router matches for a chat request: message contents joined by one space."""
    parts: list[str] = []
    for message in body.get("messages") or ():
        if isinstance(message, Mapping):
            text = " ".join(content_text(message.get("content")))
            if text:
                parts.append(text)
    if not parts and isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    return " ".join(parts)


def _common_prefix(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and `text[start:]` (binary search over C-level compares)."""
    if text.startswith(edge, start):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - start)  # answer in [lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[int, int] = {}  # tenant -> logical time of last access


class ApproxTree:
    """A multi-tenant radix tree over characters, as the peers' routers keep: which worker was sent which
    text, sized per worker in characters, LRU leaves evicted on demand. Tenants are worker indexes."""

    def __init__(self, tenants: int) -> None:
        self.root = _Node("", None)
        self.size = [0] * tenants  # characters held per tenant
        self._tick = 0
        for t in range(tenants):
            self.root.tenants[t] = 0

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def insert(self, text: str, tenant: int) -> None:
        """Record that `text` was sent to `tenant`: every node on its path gains (or refreshes) it."""
        tick = self._now()
        node = self.root
        node.tenants[tenant] = tick
        i, n = 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[tenant] = tick
                node.children[text[i]] = leaf
                self.size[tenant] += n - i
                return
            k = _common_prefix(child.text, text, i)
            if k < len(child.text):  # split: node -> mid (shared part) -> child (the rest)
                mid = _Node(child.text[:k], node)
                mid.tenants = dict(child.tenants)
                child.text = child.text[k:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[text[i]] = mid
                child = mid
            if tenant not in child.tenants:
                self.size[tenant] += len(child.text)
            child.tenants[tenant] = tick
            node = child
            i += k

    def prefix_match(self, text: str) -> tuple[int, int | None]:
        """(characters of `text` matched, a tenant holding the deepest matched node): the longest path
        in the tree, a partial edge counting as far as it matches. The tenant is the node's most recently
        used one, whose access time is then refreshed up to the root. None when nothing is held."""
        node = self.root
        i, n = 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_prefix(child.text, text, i)
            i += k
            node = child
            if k < len(child.text):
                break
        if not node.tenants:
            return i, None
        tenant = max(node.tenants.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        tick = self._now()
        walk: _Node | None = node
        while walk is not None:
            walk.tenants[tenant] = tick
            walk = walk.parent
        return i, tenant

    def smallest_tenant(self) -> int:
        """The tenant holding the fewest characters (lowest index on ties)."""
        return min(range(len(self.size)), key=lambda t: (self.size[t], t))

    def evict(self, max_size: int) -> None:
        """For each tenant holding more than `max_size` characters, drop its least recently used leaves
        (nodes it holds that none of their children hold for it) until it holds at most `max_size`."""
        for tenant in range(len(self.size)):
            if self.size[tenant] > max_size:
                self._evict_tenant(tenant, max_size)

    def _evict_tenant(self, tenant: int, max_size: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        order = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and tenant in node.tenants and self._is_leaf_for(node, tenant):
                heap.append((node.tenants[tenant], order, node))
                order += 1
        heapq.heapify(heap)
        while heap and self.size[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            if tenant not in node.tenants:
                continue
            del node.tenants[tenant]
            self.size[tenant] -= len(node.text)
            parent = node.parent
            assert parent is not None
            if not node.tenants:
                del parent.children[node.text[0]]
            if parent is not self.root and tenant in parent.tenants and self._is_leaf_for(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], order, parent))
                order += 1

    @staticmethod
    def _is_leaf_for(node: _Node, tenant: int) -> bool:
        return all(tenant not in c.tenants for c in node.children.values())

    def nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


class CacheAwareRouter:
    """The decision rule of a peer's cache_aware policy over `len(loads)` workers (module docstring).

    `choose(text, loads, now)` returns the worker index; `loads` are the router's outstanding requests
    per worker. Eviction runs when `now` passes each multiple of `eviction_interval_s`."""

    def __init__(self, workers: int, config: CacheAwareConfig = SGLANG_CACHE_AWARE) -> None:
        self.config = config
        self.tree = ApproxTree(workers)
        self._next_eviction = config.eviction_interval_s
        self.decisions = {"imbalanced": 0, "cache-hit": 0, "low-match": 0}

    def choose(self, text: str, loads: Sequence[int], now: float) -> int:
        cfg = self.config
        while cfg.eviction_interval_s > 0 and now >= self._next_eviction:
            self.tree.evict(cfg.max_tree_size)
            self._next_eviction += cfg.eviction_interval_s
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen = _least_loaded(loads)
            self.decisions["imbalanced"] += 1
        else:
            matched, tenant = self.tree.prefix_match(text)
            rate = matched / len(text) if text else 0.0
            if tenant is not None and rate > cfg.cache_threshold:
                chosen = tenant
                self.decisions["cache-hit"] += 1
            else:
                self.decisions["low-match"] += 1
                if cfg.low_match == "smallest-tree":
                    chosen = self.tree.smallest_tenant()
                else:
                    chosen = _least_loaded(loads)
        self.tree.insert(text, chosen)
        return chosen


def _least_loaded(loads: Sequence[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))
