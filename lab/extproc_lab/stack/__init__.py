"""Running the gateway's real parts on loopback: Envoy and the service as processes."""

from extproc_lab.stack.processes import (
    ENVOY_DIR,
    EnvoyProcess,
    LocalGateway,
    RedisProcess,
    ServiceProcess,
    baseline_envoy_config,
    body_mode_edit,
    ext_proc_filter,
    find_envoy,
    free_port,
    load_envoy_config,
    local_redis,
    refusing_port,
    render_envoy_config,
    wait_port,
)

__all__ = [
    "ENVOY_DIR",
    "EnvoyProcess",
    "LocalGateway",
    "RedisProcess",
    "ServiceProcess",
    "baseline_envoy_config",
    "body_mode_edit",
    "ext_proc_filter",
    "find_envoy",
    "free_port",
    "load_envoy_config",
    "local_redis",
    "refusing_port",
    "render_envoy_config",
    "wait_port",
]
