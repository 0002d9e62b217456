"""Instances from Envoy's admin API: the clusters envoy.yaml tags with `llm-extproc` filter metadata,
so envoy.yaml can stay the single source of truth for the fleet."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from extproc.publishers.config import InstanceSpec, instance_from_dict

log = logging.getLogger("extproc.publisher")

METADATA_NAMESPACE = "llm-extproc"


async def discover_from_envoy(session: aiohttp.ClientSession, admin: str) -> list[InstanceSpec]:
    """Instances of every Envoy cluster tagged with `llm-extproc` filter metadata, with current hosts."""
    async with session.get(f"{admin}/config_dump", params={"resource": "static_clusters"}) as r:
        dump = await r.json(content_type=None)
    async with session.get(f"{admin}/config_dump", params={"resource": "dynamic_active_clusters"}) as r:
        dynamic = await r.json(content_type=None) if r.status == 200 else {"configs": []}
    tagged: dict[str, dict[str, Any]] = {}
    for entry in dump.get("configs", []) + dynamic.get("configs", []):
        cluster = entry.get("cluster", {})
        meta = cluster.get("metadata", {}).get("filter_metadata", {}).get(METADATA_NAMESPACE)
        if isinstance(meta, dict) and isinstance(cluster.get("name"), str):
            tagged[cluster["name"]] = meta
    async with session.get(f"{admin}/clusters", params={"format": "json"}) as r:
        status = await r.json(content_type=None)
    out: list[InstanceSpec] = []
    for cs in status.get("cluster_statuses", []):
        meta = tagged.get(cs.get("name"))
        if meta is None:
            continue
        for host in cs.get("host_statuses", []):
            sock = host.get("address", {}).get("socket_address", {})
            if "address" not in sock or "port_value" not in sock:
                continue
            eds = host.get("health_status", {}).get("eds_health_status")
            try:
                out.append(
                    instance_from_dict(
                        {
                            **{
                                k: meta[k]
                                for k in (
                                    "engine",
                                    "models",
                                    "capacity_weight",
                                    "metrics_path",
                                    "health_path",
                                    "dcgm_url",
                                    "dcgm_gpus",
                                    "gpu",
                                    "max_num_seqs",
                                    "kv_events",
                                )
                                if k in meta
                            },
                            "cluster": cs["name"],
                            "address": f"{sock['address']}:{sock['port_value']}",
                            "draining": eds == "DRAINING",
                        }
                    )
                )
            except ValueError as exc:
                log.warning("envoy discovery: skipping a host of %s: %s", cs.get("name"), exc)
    return out
