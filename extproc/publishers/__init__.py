"""Publishers: scrape engines' /metrics, normalise per engine, and publish snapshots to Redis.

`publisher` runs the instances' schedules and writes the snapshots; `config` is what it reads
(YAML or Envoy's admin API, `envoy_admin`); `scrape` reads pages within its limits; `engines`
normalises each engine's metric names; `snapshot_fields` bounds-checks the figures."""

from extproc.publishers.config import InstanceSpec, PublisherConfig, load_publisher_config
from extproc.publishers.envoy_admin import discover_from_envoy
from extproc.publishers.publisher import Publisher

__all__ = ["InstanceSpec", "Publisher", "PublisherConfig", "discover_from_envoy", "load_publisher_config"]
