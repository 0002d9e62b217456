"""A pool cluster's endpoints from Kubernetes EndpointSlices: list, then watch, through the API
server's HTTP API (aiohttp; no client library needed for two GETs).

The usual list-then-watch contract: the list's `resourceVersion` starts the watch; every event moves
it on (BOOKMARK events only move it); a watch that ends normally is resumed from there; `410 Gone`
(the version is too old, as an HTTP status or an ERROR event) means the list is read again. Between
them the set of ready endpoints (condition `ready` true or unset, address types IPv4/IPv6) of all
selected slices is reported to the pool whenever it changes. Errors back off and retry; the pool
keeps its last endpoints meanwhile (a flaky API server must not empty the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.settings import KubernetesDiscovery
from extproc.telemetry import Metrics
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.discovery.kubernetes")

SOURCE = "kubernetes"
_READ_BUFFER = 8 * 1024 * 1024  # one watch event is one line: a slice of 1000 endpoints fits


class Gone(Exception):
    """The resourceVersion is too old (HTTP 410): list again."""


def slice_endpoints(obj: Mapping[str, Any], port: int | None, port_name: str | None) -> tuple[str, ...]:
    """The ready `ip:port` endpoints of one EndpointSlice object."""
    kind = obj.get("addressType", "IPv4")
    if kind not in ("IPv4", "IPv6"):
        return ()  # FQDN slices: Envoy's override_host needs IPs
    chosen = port
    if chosen is None:
        for p in obj.get("ports") or ():
            if p.get("port") is None:
                continue
            if port_name is None or p.get("name") == port_name:
                chosen = int(p["port"])
                break
    if chosen is None:
        return ()
    out: list[str] = []
    for ep in obj.get("endpoints") or ():
        conditions = ep.get("conditions") or {}
        if conditions.get("ready") is False:  # unset counts as ready (the API's rule)
            continue
        for addr in ep.get("addresses") or ():
            out.append(f"[{addr}]:{chosen}" if kind == "IPv6" else f"{addr}:{chosen}")
    return tuple(out)


class EndpointSliceWatcher:
    """Keeps one pool cluster's endpoints equal to the ready endpoints of the selected slices."""

    def __init__(
        self,
        settings: KubernetesDiscovery,
        on_change: Callable[[str, tuple[str, ...]], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.cluster = settings.cluster
        self.on_change = on_change
        self.metrics = metrics
        self._slices: dict[str, tuple[str, ...]] = {}
        self._reported: tuple[str, ...] | None = None
        self._synced = False
        self._task: asyncio.Task[None] | None = None
        self.resource_version = ""
        self.relists = 0

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def url(self) -> str:
        s = self.settings
        return f"{s.api_server}/apis/discovery.k8s.io/v1/namespaces/{s.namespace}/endpointslices"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            supervised("k8s-endpointslices", self._run), name="k8s-endpointslices"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = 0.5
        async with aiohttp.ClientSession(read_bufsize=_READ_BUFFER) as session:
            while True:
                try:
                    if not self.resource_version:
                        await self._list(session)
                    await self._watch(session)
                    delay = 0.5
                except Gone:
                    self.relists += 1
                    self._count("relist")
                    log.info(
                        "EndpointSlice watch: resourceVersion %s is gone; listing again",
                        self.resource_version,
                    )
                    self.resource_version = ""
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # network, TLS, auth, malformed answers: retry, keep the pool
                    self._count("error")
                    log.warning(
                        "EndpointSlice discovery for %s failed (%s); retrying in %.1fs",
                        self.cluster,
                        exc,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.settings.retry_max_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token_file = self.settings.token_file
        if token_file is not None and Path(token_file).exists():
            headers["Authorization"] = f"Bearer {Path(token_file).read_text().strip()}"
        return headers

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.settings.api_server.startswith("https://"):
            return True
        ca = self.settings.ca_file
        if ca is not None and Path(ca).exists():
            return ssl.create_default_context(cafile=ca)
        return ssl.create_default_context()

    async def _list(self, session: aiohttp.ClientSession) -> None:
        params = {"labelSelector": self.settings.label_selector}
        timeout = aiohttp.ClientTimeout(total=30)
        async with session.get(
            self.url, params=params, headers=self._headers(), ssl=self._ssl(), timeout=timeout
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"list: HTTP {resp.status}: {(await resp.text())[:200]}")
            body = orjson.loads(await resp.read())
        self._slices = {
            _name(item): slice_endpoints(item, self.settings.port, self.settings.port_name)
            for item in body.get("items") or ()
        }
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion", ""))
        self._count("list")
        self._synced = True
        self._report()

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        s = self.settings
        params = {
            "labelSelector": s.label_selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": str(s.watch_timeout_s),
        }
        # No total timeout: a watch is long-lived. A read timeout beyond the server's own end.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=s.watch_timeout_s + 30)
        async with session.get(
            self.url, params=params, headers=self._headers(), ssl=self._ssl(), timeout=timeout
        ) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise RuntimeError(f"watch: HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if line.strip():
                    self._event(orjson.loads(line))

    def _event(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("type", ""))
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        self._count(kind.lower() or "unknown")
        if kind in ("ADDED", "MODIFIED"):
            self._slices[_name(obj)] = slice_endpoints(obj, self.settings.port, self.settings.port_name)
        elif kind == "DELETED":
            self._slices.pop(_name(obj), None)
        else:
            return  # BOOKMARK: only the version moves
        self._report()

    def _report(self) -> None:
        endpoints = tuple(sorted({e for eps in self._slices.values() for e in eps}))
        if endpoints != self._reported:
            self._reported = endpoints
            self.on_change(self.cluster, endpoints)

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.discovery_events.labels(source=SOURCE, kind=kind).inc()


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
