"""Endpoint discovery: a pool cluster's endpoints learnt at run time instead of listed in the YAML.

`settings` (what config.py reads) has no network imports; `kubernetes` (EndpointSlices through the
API server) is imported by the server only when configured.
"""

from extproc.discovery.base import EndpointSource, PoolUpdater
from extproc.discovery.settings import DiscoverySettings, KubernetesDiscovery, discovery_settings

__all__ = ["DiscoverySettings", "EndpointSource", "KubernetesDiscovery", "PoolUpdater", "discovery_settings"]
