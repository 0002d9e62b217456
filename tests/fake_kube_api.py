"""A small stand-in for the Kubernetes API server's EndpointSlice endpoints, run as its own process:

    python tests/fake_kube_api.py --port P --token T

It keeps the list/watch contract a client depends on: a list returns the items and the current
`resourceVersion`; a watch from version R first replays the recorded events after R, then streams new
ones (one JSON object per line) until `timeoutSeconds`; a watch from a version older than the last
compaction gets an ERROR event with a 410 Status (as the real API server does), so the client must
list again. Requests without `Authorization: Bearer <token>` get 401.

Test control (no auth): PUT /_test/slices/{name} (body: the slice's endpoints, ports, labels),
DELETE /_test/slices/{name}, POST /_test/compact?silent=<json slices> (replace the state without
events, forget history and end every open watch), GET /_test/stats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import web

NAMESPACE = "inference"


class FakeApi:
    def __init__(self, token: str) -> None:
        self.token = token
        self.rv = 100
        self.compacted = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.watchers: set[asyncio.Queue[tuple[int, str, dict[str, Any]] | None]] = set()
        self.stats = {"lists": 0, "watches": 0, "gone": 0, "unauthorized": 0}

    # -- state changes -------------------------------------------------------------------------
    def _object(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "resourceVersion": str(self.rv),
                "labels": spec.get("labels", {}),
            },
            "addressType": spec.get("addressType", "IPv4"),
            "endpoints": spec.get("endpoints", []),
            "ports": spec.get("ports", []),
        }

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        event = (self.rv, kind, obj)
        self.history.append(event)
        for q in self.watchers:
            q.put_nowait(event)

    def put(self, name: str, spec: dict[str, Any]) -> None:
        self.rv += 1
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.slices[name] = self._object(name, spec)
        self._emit(kind, self.slices[name])

    def delete(self, name: str) -> None:
        obj = self.slices.pop(name, None)
        if obj is not None:
            self.rv += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
            self._emit("DELETED", obj)

    def compact(self, silent: dict[str, dict[str, Any]]) -> None:
        """Changes no watcher hears about, then the history is gone: only a new list shows them."""
        for name, spec in silent.items():
            self.rv += 1
            self.slices[name] = self._object(name, spec)
        self.rv += 1
        self.compacted = self.rv
        self.history.clear()
        for q in self.watchers:
            q.put_nowait(None)  # end the stream

    # -- the API -------------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        ok = request.headers.get("Authorization") == f"Bearer {self.token}"
        if not ok:
            self.stats["unauthorized"] += 1
        return ok

    @staticmethod
    def _selected(obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"]["labels"]
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
        return True

    async def endpointslices(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if request.match_info["ns"] != NAMESPACE:
            return web.json_response(
                {"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(self.rv)}, "items": []}
            )
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1"):
            self.stats["lists"] += 1
            items = [o for o in self.slices.values() if self._selected(o, selector)]
            return web.json_response(
                {"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(self.rv)}, "items": items}
            )
        return await self._watch(request, selector)

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        self.stats["watches"] += 1
        since = int(request.query.get("resourceVersion") or self.rv)
        timeout = float(request.query.get("timeoutSeconds", "300"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.compacted:
            self.stats["gone"] += 1
            status = {
                "kind": "Status",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {since} ({self.compacted})",
            }
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return resp
        q: asyncio.Queue[tuple[int, str, dict[str, Any]] | None] = asyncio.Queue()
        for event in self.history:
            if event[0] > since:
                q.put_nowait(event)
        self.watchers.add(q)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(q.get(), left)
                except TimeoutError:
                    break
                if item is None:
                    break
                _, kind, obj = item
                if self._selected(obj, selector):
                    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        finally:
            self.watchers.discard(q)
        return resp

    # -- test control --------------------------------------------------------------------------
    async def control_put(self, request: web.Request) -> web.Response:
        self.put(request.match_info["name"], await request.json())
        return web.json_response({"resourceVersion": self.rv})

    async def control_delete(self, request: web.Request) -> web.Response:
        self.delete(request.match_info["name"])
        return web.json_response({"resourceVersion": self.rv})

    async def control_compact(self, request: web.Request) -> web.Response:
        self.compact(await request.json())
        return web.json_response({"resourceVersion": self.rv})

    async def control_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {**self.stats, "open_watches": len(self.watchers), "resourceVersion": self.rv}
        )


def make_app(token: str) -> web.Application:
    api = FakeApi(token)
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", api.endpointslices)
    app.router.add_put("/_test/slices/{name}", api.control_put)
    app.router.add_delete("/_test/slices/{name}", api.control_delete)
    app.router.add_post("/_test/compact", api.control_compact)
    app.router.add_get("/_test/stats", api.control_stats)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.token), host="127.0.0.1", port=args.port, print=None, shutdown_timeout=0.5)
