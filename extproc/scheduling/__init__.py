"""Scheduling framework: filters -> weighted scorers -> picker, configured as named profiles."""

from extproc.scheduling import bounded_load as _bounded_load  # noqa: F401
from extproc.scheduling import decode_speed as _decode_speed  # noqa: F401
from extproc.scheduling import gpu as _gpu  # noqa: F401
from extproc.scheduling import latency as _latency  # noqa: F401
from extproc.scheduling import lora as _lora  # noqa: F401
from extproc.scheduling import plugins as _plugins  # noqa: F401  (registers the built-ins)
from extproc.scheduling import predicted_ttft as _predicted_ttft  # noqa: F401
from extproc.scheduling import prefix as _prefix  # noqa: F401
from extproc.scheduling import slo as _slo  # noqa: F401  (after predicted_ttft)
from extproc.scheduling.framework import (
    FILTERS,
    PICKERS,
    SCORERS,
    Filter,
    FinishHook,
    FleetState,
    Picker,
    PickHook,
    PluginTimer,
    Profile,
    Reporting,
    Scorer,
    SharedPlugin,
    UpstreamMemory,
    build_filter,
    build_picker,
    build_scorer,
    plugin_name,
    profile_from_config,
    register,
    registered,
)

__all__ = [
    "FILTERS",
    "PICKERS",
    "SCORERS",
    "Filter",
    "FinishHook",
    "FleetState",
    "PickHook",
    "Picker",
    "PluginTimer",
    "Profile",
    "Reporting",
    "Scorer",
    "SharedPlugin",
    "UpstreamMemory",
    "build_filter",
    "build_picker",
    "build_scorer",
    "plugin_name",
    "profile_from_config",
    "register",
    "registered",
]
