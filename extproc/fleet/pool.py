"""The static pool: which Envoy clusters (and endpoints) serve which models.

Live snapshots from Redis replace the static view in the fleet-state work; the routing code only
sees `Upstream` records and the per-model candidate lists built here once, so lookups on the hot
path are a dict access, not a scan of the fleet.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from extproc.settings import ConfigError, check_keys

WILDCARD = "*"


class RoutingMode(StrEnum):
    CLUSTER = "cluster"
    """Set x-llm-destination-cluster; Envoy's cluster load balancer picks the host."""
    ENDPOINT = "endpoint"
    """Also set x-gateway-destination-endpoint (ip:port) for override_host / ORIGINAL_DST."""


@dataclass(slots=True, frozen=True)
class Upstream:
    """One schedulable target: a whole cluster, or one endpoint of it."""

    id: str
    cluster: str
    address: str | None
    weight: float


@dataclass(slots=True, frozen=True)
class ClusterSpec:
    name: str
    models: tuple[str, ...]
    endpoints: tuple[str, ...] = ()
    weight: float = 1.0


@dataclass(slots=True)
class Pool:
    clusters: tuple[ClusterSpec, ...]
    mode: RoutingMode = RoutingMode.CLUSTER
    discovered: frozenset[str] = frozenset()
    """Clusters whose endpoints come from discovery (extproc.discovery): they may start empty."""
    _by_model: dict[str, tuple[Upstream, ...]] = field(init=False, default_factory=dict)
    _wildcard: tuple[Upstream, ...] = field(init=False, default=())
    _all: tuple[Upstream, ...] = field(init=False, default=())
    _departure_hooks: list[Callable[[tuple[str, ...]], object]] = field(
        init=False, default_factory=list, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ConfigError("pool: cluster names must be unique")
        self._index()

    def set_endpoints(self, cluster: str, endpoints: Iterable[str]) -> bool:
        """Replace one cluster's endpoints (discovery, at run time); False when nothing changed.
        The indices are rebuilt and swapped whole, so a decision never sees a half-updated pool."""
        found = next((c for c in self.clusters if c.name == cluster), None)
        if found is None:
            raise KeyError(f"pool has no cluster '{cluster}'")
        addresses = tuple(dict.fromkeys(parse_endpoint(e) for e in endpoints))
        if addresses == found.endpoints:
            return False
        spec = ClusterSpec(name=found.name, models=found.models, endpoints=addresses, weight=found.weight)
        before = {u.id for u in self._all}
        self.clusters = tuple(spec if c.name == cluster else c for c in self.clusters)
        self._index()
        gone = tuple(sorted(before.difference(u.id for u in self._all)))
        if gone:
            for hook in list(self._departure_hooks):
                hook(gone)
        return True

    def on_departure(self, hook: Callable[[tuple[str, ...]], object]) -> None:
        """Call `hook(upstream ids)` after set_endpoints() took upstreams out of the pool (state kept
        per upstream can go: extproc.lifecycle forgets it)."""
        self._departure_hooks.append(hook)

    def endpoint_count(self) -> int:
        return sum(1 for u in self._all if u.address is not None)

    def _index(self) -> None:
        by_model: dict[str, list[Upstream]] = {}
        wildcard: list[Upstream] = []
        everything: list[Upstream] = []
        for spec in self.clusters:
            ups = _upstreams(spec, self.mode, spec.name in self.discovered)
            everything.extend(ups)
            for model in spec.models:
                # A model stays known while its cluster has no endpoint (503, not 404).
                (wildcard if model == WILDCARD else by_model.setdefault(model, [])).extend(ups)
        self._by_model = {m: tuple(u) for m, u in by_model.items()}
        self._wildcard = tuple(wildcard)
        self._all = tuple(everything)

    def candidates(self, model: str) -> tuple[Upstream, ...] | None:
        """Upstreams serving `model`; None when no cluster serves it (unknown model)."""
        found = self._by_model.get(model)
        if found is not None:
            return found
        return self._wildcard or None

    def everything(self) -> tuple[Upstream, ...]:
        return self._all

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def cluster_names(self) -> list[str]:
        return [c.name for c in self.clusters]


def _upstreams(spec: ClusterSpec, mode: RoutingMode, discovered: bool = False) -> list[Upstream]:
    if mode is RoutingMode.CLUSTER:
        return [Upstream(id=spec.name, cluster=spec.name, address=None, weight=spec.weight)]
    if not spec.endpoints and not discovered:
        raise ConfigError(f"pool: cluster '{spec.name}' needs 'endpoints' in endpoint routing mode")
    return [
        Upstream(id=f"{spec.name}/{addr}", cluster=spec.name, address=addr, weight=spec.weight)
        for addr in spec.endpoints
    ]


def parse_endpoint(addr: str) -> str:
    """Validate an `ip:port` (or `[v6]:port`) literal. Envoy's override_host and ORIGINAL_DST need an IP,
    so a host name is refused here rather than failing at request time. Returns `addr` unchanged."""
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        want: type = ipaddress.IPv6Address
    else:
        want = ipaddress.IPv4Address
    try:
        ip_ok = isinstance(ipaddress.ip_address(host), want)
    except ValueError:
        ip_ok = False
    if not sep or not ip_ok or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pool: endpoint '{addr}' must be ip:port (IPv6 as [addr]:port)")
    return addr


CLUSTER_KEYS = ("name", "models", "endpoints", "weight")  # of each `pool.clusters` entry


def pool_from_config(raw: Iterable[Any], mode: RoutingMode, discovered: Iterable[str] = ()) -> Pool:
    specs: list[ClusterSpec] = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError("pool: each cluster needs a string 'name'")
        where = f"pool: cluster '{item['name']}'"
        check_keys(item, CLUSTER_KEYS, where)
        models = item.get("models")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            raise ConfigError(f"{where} needs a non-empty list of 'models'")
        endpoints = item.get("endpoints", [])
        if not isinstance(endpoints, list) or not all(isinstance(e, str) for e in endpoints):
            raise ConfigError(f"{where} 'endpoints' must be a list of ip:port")
        try:
            addresses = tuple(parse_endpoint(e) for e in endpoints)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{where} 'weight' must be a positive number")
        specs.append(
            ClusterSpec(name=item["name"], models=tuple(models), endpoints=addresses, weight=float(weight))
        )
    if not specs:
        raise ConfigError("pool: at least one cluster is required")
    return Pool(clusters=tuple(specs), mode=mode, discovered=frozenset(discovered))


def endpoint_host(addr: str) -> str:
    """The IP part of `ip:port` / `[v6]:port` (brackets kept, as a subset hint would write it)."""
    return addr.rpartition(":")[0] or addr


def within_subset(candidates: Iterable[Upstream], subset: frozenset[str]) -> tuple[Upstream, ...]:
    """The candidates a proxy's subset hint allows: an entry `ip:port` names one endpoint, a bare IP
    every port of that host. Cluster-mode upstreams (no address) never match: a hint names endpoints."""
    return tuple(
        u
        for u in candidates
        if u.address is not None and (u.address in subset or endpoint_host(u.address) in subset)
    )
