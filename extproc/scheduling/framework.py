"""The scheduling seam: filters narrow the candidates, weighted scorers rate them, a picker chooses.

Every plugin is small, single-purpose and registered under a kebab-case name, so profiles are data
(YAML), not code. Scores are in [0, 1]; a profile's total score is the weighted sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest


class FleetState(Protocol):
    """What plugins may read about upstreams (implemented by extproc.fleet.SchedulingState)."""

    def count(self, upstream_id: str) -> int:
        """Requests this process routed there and has not seen finish."""
        ...

    def load(self, upstream_id: str) -> Load | None:
        """The engines' last published load, or None without a fresh snapshot."""
        ...

    def pending(self, upstream_id: str) -> int:
        """Requests sent there that the last snapshot does not include yet."""
        ...


class Filter(Protocol):
    name: str

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[Upstream]: ...


class Scorer(Protocol):
    name: str

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]: ...


class Picker(Protocol):
    name: str

    def pick(
        self, request: InferenceRequest, candidates: Sequence[Upstream], scores: Sequence[float]
    ) -> Upstream: ...


PluginFactory = Callable[..., Any]
_REGISTRY: dict[str, dict[str, PluginFactory]] = {"filter": {}, "scorer": {}, "picker": {}}


def register(kind: str, name: str) -> Callable[[PluginFactory], PluginFactory]:
    """Register a plugin factory under a kebab-case name; parameters come from the profile YAML."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown plugin kind '{kind}'")

    def wrap(factory: PluginFactory) -> PluginFactory:
        if name in _REGISTRY[kind]:
            raise ValueError(f"{kind} '{name}' registered twice")
        _REGISTRY[kind][name] = factory
        return factory

    return wrap


def registered(kind: str) -> list[str]:
    return sorted(_REGISTRY[kind])


def build(kind: str, name: str, params: dict[str, Any] | None = None) -> Any:
    try:
        factory = _REGISTRY[kind][name]
    except KeyError:
        known = ", ".join(registered(kind)) or "none"
        raise ValueError(f"unknown {kind} '{name}' (known: {known})") from None
    try:
        return factory(**(params or {}))
    except TypeError as exc:
        raise ValueError(f"{kind} '{name}': bad parameters: {exc}") from None


@dataclass(slots=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker

    def schedule(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Upstream | None:
        """Pick one upstream, or None when the filters leave nobody."""
        for f in self.filters:
            candidates = f.filter(request, candidates, state)
        if not candidates:
            return None
        if len(candidates) == 1:
            self._picked(request, candidates[0], state)
            return candidates[0]
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(request, candidates, state)):
                totals[i] += weight * s
        chosen = self.picker.pick(request, candidates, totals)
        self._picked(request, chosen, state)
        return chosen

    def _picked(self, request: InferenceRequest, chosen: Upstream, state: FleetState) -> None:
        """Scorers that learn from decisions (e.g. prefix affinity) hear which upstream was chosen."""
        for scorer, _ in self.scorers:
            on_pick = getattr(scorer, "on_pick", None)
            if on_pick is not None:
                on_pick(request, chosen, state)


def profile_from_config(name: str, raw: dict[str, Any]) -> Profile:
    """Build a profile from YAML: entries are a plugin name or {name, weight, params}."""
    if not isinstance(raw, dict):
        raise ValueError(f"profile '{name}' must be a mapping")
    filters = tuple(build("filter", *_entry(e)) for e in raw.get("filters", []) or [])
    scorers: list[tuple[Scorer, float]] = []
    for e in raw.get("scorers", []) or []:
        plugin_name, params = _entry(e)
        weight = e.get("weight", 1.0) if isinstance(e, dict) else 1.0
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"profile '{name}': scorer '{plugin_name}' weight must be a number >= 0")
        scorers.append((build("scorer", plugin_name, params), float(weight)))
    picker_raw = raw.get("picker", "max-score")
    picker = build("picker", *_entry(picker_raw))
    return Profile(name=name, filters=filters, scorers=tuple(scorers), picker=picker)


def _entry(e: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(e, str):
        return e, {}
    if isinstance(e, dict) and isinstance(e.get("name"), str):
        params = e.get("params") or {}
        if not isinstance(params, dict):
            raise ValueError(f"plugin '{e['name']}': 'params' must be a mapping")
        return e["name"], params
    raise ValueError(f"plugin entry must be a name or a mapping with 'name', got {e!r}")
