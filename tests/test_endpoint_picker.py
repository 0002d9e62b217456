"""envoy/endpoint-picker.yaml: the service picks ip:port; Envoy's override_host LB honours it."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gateway_stack import MODEL, Stack, wait_until

from extproc.config import config_from_dict
from extproc.lifecycle import RequestLifecycle
from extproc.server import picker
from extproc.server.stream import RequestStream
from extproc.telemetry import Metrics
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import ENVOY_DIR, body_mode_edit, ext_proc_filter, refusing_port

ENVOY = pytest.mark.envoy  # the tests that start real Envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(engines: EngineGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc-endpoint.yaml").read_text())
    cfg["pool"]["clusters"][0]["endpoints"] = [engines.address(0), engines.address(1)]
    cfg.pop("fleet")  # static pool + own in-flight counts here; tests/test_fleet_routing.py covers Redis
    s = Stack(
        engines,
        tmp_path_factory.mktemp("endpoint-picker"),
        envoy_file="endpoint-picker.yaml",
        service=cfg,
        clusters={"inference-pool": [0, 1]},
    )
    s.start()
    yield s
    s.stop()


@ENVOY
async def test_request_lands_on_picked_endpoint(stack: Stack, engines: EngineGroup) -> None:
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.02
    async with aiohttp.ClientSession() as s:

        async def one() -> str:
            async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                await r.read()
                return r.headers["x-sim-engine"]

        served = Counter(await asyncio.gather(*(one() for _ in range(20))))
    assert set(served) == {e.name for e in engines.engines}
    for i, e in enumerate(engines.engines):
        # Each engine was reached because the service named exactly its address.
        assert e.stats.routing_headers, e.name
        for seen in e.stats.routing_headers:
            # The pick first, then the shipped config's fallbacks (the other engine).
            assert seen == {
                "x-llm-destination-cluster": "inference-pool",
                "x-gateway-destination-endpoint": f"{engines.address(i)},{engines.address(1 - i)}",
            }
    assert wait_until(lambda: stack.inflight() == 0)


@ENVOY
async def test_spoofed_endpoint_header_is_overwritten(stack: Stack, engines: EngineGroup) -> None:
    engines.reset()
    busy, idle = engines.engines
    for e in engines.engines:
        e.token_delay_s = 0.005
    busy.token_delay_s = 0.2
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(
            s.post(stack.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 10})
        )
        assert await asyncio.to_thread(wait_until, lambda: busy.stats.active + idle.stats.active == 1)
        held = busy if busy.stats.active else idle
        other = idle if held is busy else busy
        spoof = {"x-gateway-destination-endpoint": engines.address(engines.engines.index(held))}
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT, headers=spoof) as r:
            assert r.status == 200
            assert r.headers["x-sim-engine"] == other.name
        (await hold).close()


# -- the endpoint-picker protocol: subset hint ------------------------------------------------------
# A gateway tells the picker which endpoints it may choose from (filter metadata namespace
# envoy.lb.subset_hint, key x-gateway-destination-endpoint-subset, a list of ip:port). Here a Lua
# filter in front of ext_proc turns a test header into that metadata, as a real gateway would set it.
SUBSET_LUA = """
function envoy_on_request(handle)
  local value = handle:headers():get("x-test-subset")
  if value == nil then return end
  local list = {}
  for item in string.gmatch(value, "[^,]+") do table.insert(list, item) end
  handle:streamInfo():dynamicMetadata():set(
    "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
end
"""


def subset_edit(mode: str) -> Callable[[dict[str, Any]], None]:
    body_mode = body_mode_edit(mode)

    def edit(cfg: dict[str, Any]) -> None:
        body_mode(cfg)
        ext = ext_proc_filter(cfg)
        ext.setdefault("metadata_options", {}).setdefault("forwarding_namespaces", {})["untyped"] = [
            "envoy.lb.subset_hint"
        ]
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        lua = {
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": SUBSET_LUA},
            },
        }
        hcm["http_filters"].insert(0, lua)

    return edit


def picker_service(engines: EngineGroup, **overrides: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc-endpoint.yaml").read_text())
    cfg["pool"]["clusters"][0]["endpoints"] = [engines.address(0), engines.address(1)]
    cfg.pop("fleet")
    cfg.update(overrides)
    return cfg


@ENVOY
@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_subset_hint_is_honoured(
    make_stack: Callable[..., Stack], engines: EngineGroup, mode: str
) -> None:
    stack = make_stack(
        envoy_file="endpoint-picker.yaml",
        service=picker_service(engines),
        clusters={"inference-pool": [0, 1]},
        envoy_edit=subset_edit(mode),
    )
    only = engines.engines[1]
    hint = {"x-test-subset": f"10.255.0.9:80,{engines.address(1)}"}
    async with aiohttp.ClientSession() as s:

        async def one(headers: dict[str, str], i: int) -> str:
            body = {**CHAT, "messages": [{"role": "user", "content": f"question {i} " * 40}]}
            async with s.post(stack.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
                return r.headers["x-sim-engine"]

        hinted = Counter(await asyncio.gather(*(one(hint, i) for i in range(12))))
        free = Counter(await asyncio.gather(*(one({}, 100 + i) for i in range(12))))
        assert hinted == {only.name: 12}, hinted
        assert set(free) == {e.name for e in engines.engines}  # without the hint both are used
        # Outside the pool only, or nothing: 503 with an OpenAI-style body, nothing reaches an engine.
        before = sum(e.stats.requests for e in engines.engines)
        for outside in ("10.255.0.9:80", "127.0.0.1:1"):
            async with s.post(
                stack.url + "/v1/chat/completions", json=CHAT, headers={"x-test-subset": outside}
            ) as r:
                assert r.status == 503
                body = await r.json()
                assert body["error"]["code"] == "no_endpoint_in_subset"
        after = sum(e.stats.requests for e in engines.engines)
    assert after == before
    assert wait_until(lambda: stack.inflight() == 0)


# -- fallbacks: the header lists the pick then the next-best; Envoy retries down the list ------------
SERVED_HEADER = {
    "header": {"key": "x-gateway-destination-endpoint-served", "value": "%UPSTREAM_REMOTE_ADDRESS%"}
}


@pytest.fixture
def dead_port() -> Iterator[int]:
    """Held for the whole test: a port merely free when picked was once given to Envoy's admin
    listener (bound to port 0), and the "dead" endpoint answered 404."""
    with refusing_port() as port:
        yield port


@ENVOY
@pytest.mark.parametrize("release_on", ["access_log", "stream_end"])
async def test_fallback_list_is_retried_in_order(
    make_stack: Callable[..., Stack], engines: EngineGroup, release_on: str, dead_port: int
) -> None:
    """access_log: Envoy's access log says which endpoint served. stream_end: the stream stays open
    and the served endpoint arrives with the response headers (here a header the route adds from
    %UPSTREAM_REMOTE_ADDRESS%; a gateway may send envoy.lb metadata instead, read the same way)."""
    dead = f"127.0.0.1:{dead_port}"  # in Envoy's pool and the service's, but refuses connections
    cfg = picker_service(
        engines,
        release_on=release_on,
        fallbacks=1,
        # Equal scores and random ties: the dead endpoint is picked about a third of the time.
        scheduling={"profiles": {"default": {"scorers": ["least-outstanding"], "picker": "max-score"}}},
    )
    cfg["pool"]["clusters"][0]["endpoints"] = [dead, engines.address(0), engines.address(1)]

    def add_dead(envoy: dict[str, Any]) -> None:
        if release_on == "stream_end":
            modes = ext_proc_filter(envoy)["processing_mode"]
            modes["response_header_mode"] = "SEND"
            modes["response_trailer_mode"] = "SEND"
            hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
                route.setdefault("response_headers_to_add", []).append(SERVED_HEADER)
        for c in envoy["static_resources"]["clusters"]:
            if c["name"] == "inference-pool":
                c["load_assignment"]["endpoints"][0]["lb_endpoints"].insert(
                    0,
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": dead_port}}
                        }
                    },
                )

    stack = make_stack(
        envoy_file="endpoint-picker.yaml",
        service=cfg,
        clusters={"inference-pool": [0, 1]},
        envoy_edit=add_dead,
    )
    async with aiohttp.ClientSession() as s:
        for i in range(24):
            body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}
            async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
    seen = [
        (i, h["x-gateway-destination-endpoint"])
        for i, e in enumerate(engines.engines)
        for h in e.stats.routing_headers
    ]
    assert len(seen) == 24
    for i, value in seen:
        listed = value.split(",")
        assert len(listed) == 2 and len(set(listed)) == 2  # the pick and one fallback, distinct
        # The engine that served is the first live endpoint of the list: the pick, or after the
        # dead pick its fallback (Envoy went down the list, not to its own load balancer's choice).
        live = [a for a in listed if a != dead]
        assert live[0] == engines.address(i), value
    via_fallback = [v for _, v in seen if v.startswith(dead)]
    assert via_fallback, "the dead endpoint was never picked: nothing exercised the fallback"

    # Envoy's access log reports where each request was served; those that went to the fallback
    # are counted as such (the lease followed them there).
    # Access-log reports arrive after the responses: wait for all 24, then check the split.
    def served() -> tuple[float, float]:
        m = stack.metrics()
        return (
            m.get('llm_extproc_endpoint_served_total{outcome="chosen"}', 0),
            m.get('llm_extproc_endpoint_served_total{outcome="fallback"}', 0),
        )

    assert wait_until(lambda: sum(served()) >= 24)
    assert served() == (24 - len(via_fallback), len(via_fallback))
    assert wait_until(lambda: stack.inflight() == 0)


# -- protocol units: the stream state machine with real ext_proc messages (no Envoy) ----------------
def _lifecycle(endpoints: list[str], **extra: Any) -> RequestLifecycle:
    cfg = config_from_dict(
        {
            "routing": "endpoint",
            "metrics_listen": None,
            "pool": {"clusters": [{"name": "pool", "models": ["m"], "endpoints": endpoints}]},
            **extra,
        }
    )
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


def _headers(subset: Any = None, mode: int = ProcessingMode.BUFFERED) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    hmap = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap))
    msg.protocol_config.request_body_mode = mode
    if subset is not None:
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset}
        )
    return msg


BODY = pb.ProcessingRequest(
    request_body=pb.HttpBody(
        body=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', end_of_stream=True
    )
)
EPS = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.1.1:80", "10.0.1.1:81"]


def _routed_to(reply: pb.ProcessingResponse) -> str:
    common = reply.request_body.response
    sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    value = sets["x-gateway-destination-endpoint"]
    # The header and the envoy.lb metadata carry the same value (the protocol forbids them differing).
    assert (
        reply.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
        == value
    )
    return value


@pytest.mark.parametrize(
    ("subset", "allowed"),
    [
        (["10.0.0.2:80", "10.9.9.9:80"], {"10.0.0.2:80"}),
        (["10.0.1.1"], {"10.0.1.1:80", "10.0.1.1:81"}),  # a bare IP: every port of that host
        ("10.0.0.1:80,10.0.0.3:80", {"10.0.0.1:80", "10.0.0.3:80"}),  # a string list, tolerated
    ],
)
async def test_subset_hint_restricts_every_pick(subset: Any, allowed: set[str]) -> None:
    lc = _lifecycle(EPS, fallbacks=2)
    picked = set()
    for _ in range(40):
        s = RequestStream(lc)
        await s.on_message(_headers(subset))
        [reply] = await s.on_message(BODY)
        listed = _routed_to(reply).split(",")
        assert set(listed) <= allowed  # the fallbacks too stay inside the subset
        picked.add(listed[0])
        s.close()
    assert picked == allowed  # and every allowed endpoint gets picked
    assert lc.inflight.total() == 0


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:80"], ["10.0.0"], ["10.9.9.9:80", "10.9.9.8"]])
async def test_nothing_eligible_in_the_subset_is_a_503(
    subset: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The 503's body counts the hint's entries but never lists them (the pool's addresses are not the
    client's to see); the service's log has them."""
    lc = _lifecycle(EPS)
    s = RequestStream(lc)
    with caplog.at_level(logging.INFO, logger="extproc.endpoints"):
        await s.on_message(_headers(subset, ProcessingMode.FULL_DUPLEX_STREAMED))
        [reply] = await s.on_message(BODY)
    assert reply.immediate_response.status.code == 503
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "no_endpoint_in_subset"
    assert (f"None of the {len(subset)} endpoints" if subset else "empty") in error["message"]
    for entry in subset:
        assert entry not in reply.immediate_response.body.decode()
        assert entry in caplog.text
    assert "10." not in reply.immediate_response.body.decode()
    assert lc.inflight.total() == 0


async def test_fallbacks_are_the_next_best_by_score() -> None:
    # least-outstanding: endpoints already holding requests rank below idle ones.
    lc = _lifecycle(
        EPS[:3], fallbacks=1, scheduling={"profiles": {"default": {"scorers": ["least-outstanding"]}}}
    )
    held = []
    for _ in range(2):  # two requests in flight: the third endpoint is the only idle one
        s = RequestStream(lc)
        await s.on_message(_headers())
        await s.on_message(BODY)
        held.append(s)
    s = RequestStream(lc)
    await s.on_message(_headers())
    [reply] = await s.on_message(BODY)
    pick, fallback = _routed_to(reply).split(",")
    busy = {h.decision.upstream.address for h in held if h.decision is not None}
    assert pick not in busy and fallback in busy


async def test_served_elsewhere_moves_the_lease() -> None:
    lc = _lifecycle(EPS[:3], fallbacks=2, release_on="stream_end")
    s = RequestStream(lc)
    await s.on_message(_headers())
    [reply] = await s.on_message(BODY)
    pick, first_fallback, _ = _routed_to(reply).split(",")
    ids = {u.address: u.id for u in lc.config.pool.everything()}
    assert lc.inflight.count(ids[pick]) == 1
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap()))
    msg.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": first_fallback}
    )
    await s.on_message(msg)
    assert lc.inflight.count(ids[pick]) == 0 and lc.inflight.count(ids[first_fallback]) == 1
    assert (
        lc.metrics.registry.get_sample_value("llm_extproc_endpoint_served_total", {"outcome": "fallback"})
        == 1
    )
    s.close()
    assert lc.inflight.total() == 0


def test_subset_and_served_readers() -> None:
    assert picker.subset_hint(pb.ProcessingRequest()) is None
    msg = pb.ProcessingRequest()
    msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].update({"other": 1})
    assert picker.subset_hint(msg) is None  # the namespace without the key: no hint
    msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": ["10.0.0.1:80", 7, " 10.0.0.2:80 "]}
    )
    assert picker.subset_hint(msg) == frozenset({"10.0.0.1:80", "10.0.0.2:80"})  # non-strings ignored
    served = pb.ProcessingRequest()
    assert (
        picker.served_endpoint(served, {"x-gateway-destination-endpoint-served": "10.0.0.3:80"})
        == "10.0.0.3:80"
    )
    assert picker.served_endpoint(served, {}) is None
