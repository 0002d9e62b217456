"""Endpoint discovery: a pool cluster's endpoints learnt at run time instead of listed in the YAML.

The settings (`discovery:`) are extproc.settings.DiscoverySettings; `kubernetes` (EndpointSlices
through the API server) is imported by the server only when configured.
"""

from extproc.discovery.base import EndpointSource, PoolUpdater

__all__ = ["EndpointSource", "PoolUpdater"]
