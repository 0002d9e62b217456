"""Scheduling framework: filters -> weighted scorers -> picker, configured as named profiles."""

from extproc.scheduling import plugins as _plugins  # noqa: F401  (registers the built-ins)
from extproc.scheduling.framework import (
    FleetState,
    Profile,
    build,
    profile_from_config,
    register,
    registered,
)

DEFAULT_PROFILE = {
    "scorers": [{"name": "least-outstanding", "weight": 1.0}],
    "picker": "max-score",
}

__all__ = [
    "DEFAULT_PROFILE",
    "FleetState",
    "Profile",
    "build",
    "profile_from_config",
    "register",
    "registered",
]
