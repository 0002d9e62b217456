"""Why a request went where it went: an opt-in record of one scheduling decision.

`Profile.schedule(..., explain=Explanation())` records, while it decides (one code path: the decision
is the same), what each filter kept, each scorer's raw scores and the totals the picker saw. The
per-candidate view is built only when read: per candidate, the first filter that dropped it, and per
scorer the raw score, the weight and the weighted contribution `weight x clamp(raw)`, which add up to
the total. Without an Explanation the framework records nothing (a few `is None` tests per decision).

Two ways out, both off by default (`explain:` in the service YAML, `settings.ExplainSettings`):
- a response header, `x-llm-decision`: by default (`detail: summary`) the chosen cluster, the profile
  and the number of candidates, nothing else: the header goes to clients, and upstream addresses or
  per-upstream scores (those of the prefix scorers say whose prompts an engine caches: a side channel
  between tenants) are not theirs to see. `detail: full`, for routes whose clients the operator
  trusts, adds the top candidates by id with their totals and per-scorer contributions, compact and
  bounded. The service sets it as a *request* header with the route; envoy.yaml's
  `response_headers_to_add` copies `%REQ(x-llm-decision)%` onto the response (nothing is added when
  the request has none), so no response phase of ext_proc is needed;
- `/debug/decisions` on the metrics port: the last `keep_last` decisions with every candidate's scores
  (`DecisionLog`, JSON).
"""

from __future__ import annotations

import heapq
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.fleet import Upstream

DECISION_HEADER = "x-llm-decision"
"""Set on the routed request; envoy.yaml copies it onto the response (`%REQ(x-llm-decision)%`)."""
MAX_HEADER_BYTES = 512
TOP_CANDIDATES = 3
EXPLAINED_FIGURES = ("token_ratio", "ttft_error_s")  # reporting plugins' figures shown per upstream


@dataclass(slots=True)
class CandidateExplanation:
    upstream: Upstream
    dropped_by: str | None = None
    """The filter that removed this candidate; None when it reached the scorers."""
    raw: list[float] = field(default_factory=list)
    """Per scorer (the profile's order), the score as the plugin returned it."""
    contributions: list[float] = field(default_factory=list)
    """Per scorer, weight x clamp(raw): what the total adds up."""
    total: float = 0.0


@dataclass(slots=True)
class Explanation:
    """One decision, recorded by Profile.schedule as the plugins answered: the candidates offered, what
    each filter kept, each scorer's raw scores over the scored candidates, the totals the picker saw.
    The per-candidate view (`candidates`) is built when read (header, /debug/decisions), not while
    deciding. `scored` is False when the filters left one candidate (picked without running the
    scorers: total 0, no contributions)."""

    profile: str = ""
    model: str | None = None
    filters: tuple[str, ...] = ()
    scorers: tuple[tuple[str, float], ...] = ()
    picker: str = ""
    offered: tuple[Upstream, ...] = ()
    kept: list[tuple[Upstream, ...]] = field(default_factory=list)
    """Per filter (in order), the candidates it let through."""
    raw: list[tuple[float, ...]] = field(default_factory=list)
    """Per scorer (in order), its scores over the scored candidates (`scored_ids` order)."""
    scored_ids: tuple[str, ...] = ()
    totals: list[float] = field(default_factory=list)
    picked: Upstream | None = None
    at: float = 0.0
    # The profile's plugins with figures of their own (framework.Reporting): the picked upstream's
    # calibration goes into the header, every candidate's into /debug/decisions.
    reporting: tuple[Any, ...] = ()
    _rows: list[CandidateExplanation] | None = field(default=None, init=False, repr=False)

    def begin(
        self,
        profile: str,
        filters: tuple[str, ...],
        scorers: tuple[tuple[str, float], ...],
        picker: str,
        offered: Sequence[Upstream],
    ) -> None:
        self.profile, self.filters, self.scorers, self.picker = profile, filters, scorers, picker
        self.offered = tuple(offered)

    @property
    def scored(self) -> bool:
        return bool(self.scored_ids)

    @property
    def candidates(self) -> list[CandidateExplanation]:
        """Every candidate offered: the filter that dropped it, or its raw scores, contributions
        (weight x clamp(raw), as the framework adds them) and total."""
        if self._rows is not None:
            return self._rows
        rows = {u.id: CandidateExplanation(u) for u in self.offered}
        current = self.offered
        for fname, kept in zip(self.filters, self.kept, strict=False):
            if len(kept) != len(current):
                through = {u.id for u in kept}
                for u in current:
                    row = rows.get(u.id)
                    if u.id not in through and row is not None and row.dropped_by is None:
                        row.dropped_by = fname
            current = kept
        by_id = {u.id: u for u in current}
        for i, uid in enumerate(self.scored_ids):
            row = rows.setdefault(uid, CandidateExplanation(by_id[uid]))
            row.raw = [float(scores[i]) for scores in self.raw]
            row.contributions = []
            total = 0.0
            for (_, weight), raw in zip(self.scorers, row.raw, strict=False):
                contribution = weight * _clamp(raw)
                row.contributions.append(contribution)
                total += contribution
            row.total = self.totals[i] if i < len(self.totals) else total
        self._rows = list(rows.values())
        return self._rows

    def scorer_labels(self) -> list[str]:
        """Scorer names, made unique (a profile may use one scorer twice): `name`, `name#2`, ..."""
        seen: dict[str, int] = {}
        out = []
        for name, _ in self.scorers:
            seen[name] = seen.get(name, 0) + 1
            out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
        return out

    def survivors(self) -> list[CandidateExplanation]:
        return [c for c in self.candidates if c.dropped_by is None]

    def ranked(self) -> list[CandidateExplanation]:
        """Survivors, best total first; the picked one first among equals."""
        picked = self.picked.id if self.picked is not None else None
        return sorted(self.survivors(), key=lambda c: (-c.total, c.upstream.id != picked))

    def header_value(self, top: int = TOP_CANDIDATES, max_bytes: int = MAX_HEADER_BYTES) -> str:
        """`<picked>; profile=<p>; candidates=<n>, <id>; total=<t>; <scorer>=<contribution>; ..., ...`
        for the `top` best candidates (4 decimals; contributions add up to the total within rounding).
        Candidates that do not fit in `max_bytes` are left out, whole. Built from the raw record for
        those candidates only (this runs on the request path)."""
        picked = self.picked.id if self.picked is not None else "none"
        survivors = self.kept[-1] if self.kept else self.offered
        out = f"{_token(picked)}; profile={_token(self.profile)}; candidates={len(survivors)}"
        for name, value in self.figures(picked).items():
            out += f"; {_token(name)}={value:.4g}"
        names = [_token(name) for name in self.scorer_labels()]
        ids, totals = self.scored_ids, self.totals
        if ids:
            best = heapq.nsmallest(top, range(len(ids)), key=lambda i: (-totals[i], ids[i] != picked))
        else:
            best = []
        items = []
        for i in best:
            parts = [_token(ids[i]), f"total={totals[i]:.4f}"]
            for name, (_, weight), scores in zip(names, self.scorers, self.raw, strict=False):
                parts.append(f"{name}={weight * _clamp(scores[i]):.4f}")
            items.append("; ".join(parts))
        if not ids and self.picked is not None:
            items.append(f"{_token(picked)}; total=0.0000")
        for item in items:
            if len(out) + 2 + len(item) > max_bytes:
                break
            out = f"{out}, {item}"
        return out[:max_bytes]

    def summary_value(self) -> str:
        """`<picked cluster>; profile=<p>; candidates=<n>`: what a client may read (`detail: summary`),
        no upstream address and no score."""
        picked = self.picked.cluster if self.picked is not None else "none"
        survivors = self.kept[-1] if self.kept else self.offered
        return f"{_token(picked)}; profile={_token(self.profile)}; candidates={len(survivors)}"

    def figures(self, upstream_id: str) -> dict[str, float]:
        """The reporting plugins' figures about one upstream (e.g. its token ratio, its TTFT error)."""
        out: dict[str, float] = {}
        for plugin in self.reporting:
            for name, uid, value in plugin.report():
                if uid == upstream_id and name in EXPLAINED_FIGURES:
                    out[name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        labels = self.scorer_labels()
        return {
            "at": self.at,
            "profile": self.profile,
            "model": self.model,
            "picked": self.picked.id if self.picked is not None else None,
            "filters": list(self.filters),
            "scorers": [{"name": n, "weight": w} for n, (_, w) in zip(labels, self.scorers, strict=True)],
            "picker": self.picker,
            "scored": self.scored,
            "candidates": [
                {
                    "id": c.upstream.id,
                    "cluster": c.upstream.cluster,
                    "dropped_by": c.dropped_by,
                    "figures": self.figures(c.upstream.id),
                    "total": c.total,
                    "scores": {
                        name: {"raw": raw, "weight": weight, "contribution": contribution}
                        for name, (_, weight), raw, contribution in zip(
                            labels, self.scorers, c.raw, c.contributions, strict=False
                        )
                    },
                }
                for c in self.candidates
            ],
        }


def _clamp(score: float) -> float:
    """As the framework clamps scores before weighting them (NaN and below 0: 0; above 1: 1)."""
    if score >= 1.0:
        return 1.0
    if score > 0.0:
        return float(score)
    return 0.0


_UNSAFE = re.compile(r"[^\x21-\x7e]|[,;=]")


def _token(text: str) -> str:
    """Header-safe: printable ASCII without spaces or the list separators (`,` `;` `=`)."""
    return _UNSAFE.sub("_", text[:128])


def new_explanation(model: str | None) -> Explanation:
    return Explanation(model=model, at=time.time())


class DecisionLog:
    """The last `keep_last` explanations, for /debug/decisions. Written on the event loop, read on the
    metrics server's thread: the lock guards only an append and a copy (microseconds); the JSON is
    built on the reader's thread, never on the request path."""

    __slots__ = ("_items", "_lock")

    def __init__(self, keep_last: int) -> None:
        self._items: deque[Explanation] = deque(maxlen=keep_last)
        self._lock = threading.Lock()

    def add(self, explanation: Explanation) -> None:
        with self._lock:
            self._items.append(explanation)

    def last(self) -> list[Explanation]:
        """Newest first."""
        with self._lock:
            items = list(self._items)
        items.reverse()
        return items

    def page(self) -> tuple[int, str, bytes]:
        """The metrics server's /debug/decisions (a telemetry.metrics.Page), on its thread."""
        items = self.last()
        body = orjson.dumps({"keep_last": self._items.maxlen, "decisions": [e.to_dict() for e in items]})
        return 200, "application/json", body
