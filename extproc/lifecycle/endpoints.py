"""Endpoint-picker rules applied around a scheduling decision (endpoint routing mode).

- The proxy's subset hint narrows the candidates before any plugin sees them; nothing eligible in
  it is a 503 (the protocol's MUST), never a pick outside it.
- Fallbacks: the next-best candidates by the profile's total score, sent after the chosen one in
  `x-gateway-destination-endpoint` (`a,b,c`); Envoy's override_host load balancer goes down that list
  on retries.
- Served: when the proxy reports that another endpoint served (a retry went down the list), the
  request's in-flight lease moves there, so least-outstanding counts follow the real load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from extproc.fleet import InFlight, Lease, Pool, Upstream
from extproc.fleet.pool import within_subset
from extproc.openai import RequestError
from extproc.scheduling.explain import Explanation

log = logging.getLogger("extproc.endpoints")


class Routed(Protocol):
    """What a routed request's Decision (router.py) offers here."""

    upstream: Upstream
    lease: Lease
    fallbacks: tuple[Upstream, ...]


def no_endpoint_in_subset(model: str | None, subset: frozenset[str]) -> RequestError:
    """The protocol's 503. The body goes to the client: it counts the hint's entries but never lists
    them (they are the pool's IP addresses); the list is logged here instead."""
    what = f"model '{model}'" if model else "this request"
    n = len(subset)
    log.info(
        "no endpoint in the subset hint can serve %s; the hint's %d entries: %s",
        what,
        n,
        ", ".join(sorted(subset)[:16])[:600] or "(empty)",
    )
    if n:
        message = f"None of the {n} endpoints in the gateway's subset hint can serve {what}."
    else:
        message = f"The gateway's subset hint is empty: no endpoint can serve {what}."
    return RequestError(
        503,
        message,
        err_type="service_unavailable_error",
        code="no_endpoint_in_subset",
        retry_after=1,
    )


def in_subset(
    candidates: Sequence[Upstream], subset: frozenset[str], model: str | None
) -> tuple[Upstream, ...]:
    """The candidates inside the hint; raises the protocol's 503 when none is."""
    kept = within_subset(candidates, subset)
    if not kept:
        raise no_endpoint_in_subset(model, subset)
    return kept


def ranked_fallbacks(
    scored: Sequence[tuple[float, Upstream]], chosen: Upstream, limit: int
) -> tuple[Upstream, ...]:
    """Up to `limit` other candidates that survived the filters, best total score first (a candidate
    list the filters cut to one has no fallback). `scored`: (total, upstream) as Profile.schedule
    reports them with `ranked=`, or `explained()` of an Explanation."""
    if limit <= 0:
        return ()
    rest = [(t, u) for t, u in scored if u.id != chosen.id and u.address is not None]
    rest.sort(key=lambda tu: tu[0], reverse=True)  # stable: equal totals keep candidate order
    return tuple(u for _, u in rest[:limit])


def explained(why: Explanation) -> list[tuple[float, Upstream]]:
    """The (total, upstream) pairs of an explained decision's scored candidates."""
    if not why.scored:
        return []
    return [(r.total, r.upstream) for r in why.candidates if r.dropped_by is None]


def destination(upstream: Upstream, fallbacks: Sequence[Upstream] = ()) -> str | None:
    """The `x-gateway-destination-endpoint` value: the chosen `ip:port`, then the fallbacks."""
    if upstream.address is None:
        return None
    if not fallbacks:
        return upstream.address
    return ",".join([upstream.address, *(f.address for f in fallbacks if f.address is not None)])


def move_to_served(inflight: InFlight, pool: Pool, decision: Routed, served: str) -> str:
    """The proxy says `served` (ip:port) served the request: move the in-flight lease there if it is
    not the chosen endpoint. Returns the outcome (a metric label): `chosen`, `fallback` (one of the
    listed fallbacks; the lease moved), `other` (an endpoint the picker did not list; moved if the
    pool knows it) or `released` (the request already ended: nothing to move)."""
    chosen = decision.upstream
    if chosen.address == served:
        return "chosen"
    target = next((f for f in decision.fallbacks if f.address == served), None)
    outcome = "fallback" if target is not None else "other"
    if target is None:
        target = next(
            (u for u in pool.everything() if u.address == served and u.cluster == chosen.cluster),
            None,
        )
    if decision.lease.released or target is None:
        return "released" if decision.lease.released else outcome
    # Only the lease moves: `decision.upstream` stays the pick, so plugins' on_finish matches their
    # on_pick (their learnt state is about where they sent it).
    decision.lease.release()
    decision.lease = inflight.acquire(target)
    return outcome
