"""Scheduling framework: filters -> weighted scorers -> picker, configured as named profiles."""

from extproc.scheduling import plugins as _plugins  # noqa: F401  (registers the built-ins)
from extproc.scheduling import prefix as _prefix  # noqa: F401
from extproc.scheduling.framework import (
    FleetState,
    Profile,
    build,
    profile_from_config,
    register,
    registered,
)

# Used when the config defines no profile. Prefix affinity dominates among candidates that are not
# overloaded (it zeroes itself beyond that bound); load scorers decide the rest. Without live fleet
# state, load() is None everywhere and the load part is least outstanding requests on own counts.
DEFAULT_PROFILE = {
    "filters": ["saturation"],
    "scorers": [
        {"name": "prefix-affinity", "weight": 3.0},
        {"name": "queue-depth", "weight": 1.0},
        {"name": "kv-cache-usage", "weight": 0.5},
        {"name": "least-outstanding", "weight": 0.5},
    ],
    "picker": "max-score",
}

# Used for a model whose snapshots are all stale (or absent while a fleet view is configured).
FALLBACK_PROFILE = {"picker": "weighted-round-robin"}

__all__ = [
    "DEFAULT_PROFILE",
    "FALLBACK_PROFILE",
    "FleetState",
    "Profile",
    "build",
    "profile_from_config",
    "register",
    "registered",
]
