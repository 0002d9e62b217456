"""Fleet state: which upstreams exist, what they serve, their live load, and what the service sent."""

from extproc.fleet.accounting import InFlight, Lease, RemoteInFlight
from extproc.fleet.pool import ClusterSpec, Pool, RoutingMode, Upstream, pool_from_config
from extproc.fleet.snapshots import InstanceState, SnapshotRejected, decode
from extproc.fleet.view import FleetView, Load, SchedulingState

__all__ = [
    "ClusterSpec",
    "FleetView",
    "InFlight",
    "InstanceState",
    "Lease",
    "Load",
    "Pool",
    "RemoteInFlight",
    "RoutingMode",
    "SchedulingState",
    "SnapshotRejected",
    "Upstream",
    "decode",
    "pool_from_config",
]
