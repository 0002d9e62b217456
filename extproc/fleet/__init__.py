"""Fleet state: which upstreams exist, what they serve, and what the service has sent them."""

from extproc.fleet.accounting import InFlight, Lease
from extproc.fleet.pool import ClusterSpec, Pool, RoutingMode, Upstream, pool_from_config

__all__ = ["ClusterSpec", "InFlight", "Lease", "Pool", "RoutingMode", "Upstream", "pool_from_config"]
