"""`discovery:` in the service YAML: where a pool cluster's endpoints come from at run time.

No network imports here: config.py reads these settings, the server starts the watcher
(extproc.discovery.kubernetes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.settings import ConfigError, check_keys, integer, mapping, number, string

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_TOKEN_FILE = str(SERVICE_ACCOUNT_DIR / "token")
DEFAULT_CA_FILE = str(SERVICE_ACCOUNT_DIR / "ca.crt")


def _default_api_server() -> str:
    """In a pod: the API server Kubernetes names in the environment."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def _default_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(slots=True, frozen=True)
class KubernetesDiscovery:
    """EndpointSlices (discovery.k8s.io/v1) selected by label, listed then watched through the API
    server's HTTP API with the pod's service-account token (RBAC: get/list/watch endpointslices)."""

    cluster: str
    """The pool cluster (endpoint routing mode) whose endpoints this fills."""
    label_selector: str
    """Which EndpointSlices, e.g. `kubernetes.io/service-name=vllm` (the Service's slices)."""
    namespace: str
    api_server: str
    port: int | None = None
    """The model servers' port; None: the slice's port named `port_name`, else its first port."""
    port_name: str | None = None
    token_file: str | None = DEFAULT_TOKEN_FILE
    """Read again for every request (projected tokens rotate); None: no Authorization header."""
    ca_file: str | None = DEFAULT_CA_FILE
    """CA for an https API server; None: the system's CAs."""
    watch_timeout_s: int = 300
    """Each watch asks the API server to end after this long; the next one resumes where it ended."""
    retry_max_s: float = 10.0
    """Errors back off from 0.5 s up to this."""


@dataclass(slots=True, frozen=True)
class DiscoverySettings:
    kubernetes: KubernetesDiscovery | None = None

    def clusters(self) -> tuple[str, ...]:
        return (self.kubernetes.cluster,) if self.kubernetes is not None else ()


def _optional_path(section: dict[str, Any], key: str, where: str, default: str | None) -> str | None:
    if key not in section:
        return default
    value = section[key]
    return None if value is None else string(value, f"{where}.{key}")


def discovery_settings(raw: Any) -> DiscoverySettings | None:
    """None when the YAML has no `discovery:` (static endpoints only)."""
    if raw is None:
        return None
    where = "config: 'discovery'"
    section = mapping(raw, where)
    check_keys(section, ("kubernetes",), where)
    if section.get("kubernetes") is None:
        return DiscoverySettings()
    where = f"{where}.kubernetes"
    k8s = mapping(section["kubernetes"], where)
    check_keys(k8s, KubernetesDiscovery.__dataclass_fields__, where)
    for required in ("cluster", "label_selector"):
        if required not in k8s:
            raise ConfigError(f"{where} needs '{required}'")
    port = None
    if k8s.get("port") is not None:
        port = integer(k8s["port"], f"{where}.port", minimum=1)
        if port > 65535:
            raise ConfigError(f"{where}.port must be a port number, got {port}")
    port_name = string(k8s["port_name"], f"{where}.port_name") if k8s.get("port_name") is not None else None
    if port is not None and port_name is not None:
        raise ConfigError(f"{where}: give 'port' or 'port_name', not both")
    api_server = string(k8s.get("api_server") or _default_api_server(), f"{where}.api_server")
    if not api_server.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.api_server must be an http:// or https:// URL, got {api_server!r}")
    settings = KubernetesDiscovery(
        cluster=string(k8s["cluster"], f"{where}.cluster"),
        label_selector=string(k8s["label_selector"], f"{where}.label_selector"),
        namespace=string(k8s.get("namespace") or _default_namespace(), f"{where}.namespace"),
        api_server=api_server.rstrip("/"),
        port=port,
        port_name=port_name,
        token_file=_optional_path(k8s, "token_file", where, DEFAULT_TOKEN_FILE),
        ca_file=_optional_path(k8s, "ca_file", where, DEFAULT_CA_FILE),
        watch_timeout_s=integer(k8s.get("watch_timeout_s", 300), f"{where}.watch_timeout_s", minimum=1),
        retry_max_s=number(k8s.get("retry_max_s", 10.0), f"{where}.retry_max_s", minimum=0.5),
    )
    return DiscoverySettings(kubernetes=settings)
