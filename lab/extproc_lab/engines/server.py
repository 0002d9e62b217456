"""A simple simulated OpenAI-compatible engine: real HTTP, JSON and SSE, fixed cost per token.

This is the routing core's stand-in upstream (tests and the first demo). It has no KV cache, no
batching model and no /metrics yet: the full engine model (continuous batching, prefix cache,
vLLM metrics) is separate work. Each engine reports who it is (`x-sim-engine` header and
`system_fingerprint`) and what routing headers it received, so tests can see where requests landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc_lab.engines.driver import ModelDriver
from extproc_lab.engines.kv_publisher import KvEventPublisher
from extproc_lab.engines.model import (
    SCHEDULING_POLICIES,
    EngineModel,
    FinishedEvent,
    FirstTokenEvent,
    TokenEvent,
)
from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.engines.tokens import Recount, chat_to_tokens, token_text, tokenize

SIM_GPU_BLOCKS = 4096
ROUTING_HEADERS = ("x-llm-destination-cluster", "x-gateway-destination-endpoint")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    active: int = 0  # admitted: generating or queued
    running: int = 0  # generating (holding a batch slot)
    max_active: int = 0
    completed: int = 0
    disconnected: int = 0
    hung_requests: int = 0  # API requests accepted while `hung` and never answered
    # vLLM's counters for the fixed-cost engine (the engine model keeps its own): no prefix cache,
    # and a prefill is the prompt's share of the delay.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    prefill_count: int = 0
    prefill_time_sum: float = 0.0
    itl_count: int = 0  # inter-token gaps: the nominal token delay each
    itl_sum: float = 0.0
    routing_headers: list[dict[str, str]] = field(default_factory=list)
    priorities: list[Any] = field(default_factory=list)
    # LoRA (fixed-cost engine with lora_slots): requests whose adapter was in GPU memory when they
    # arrived, those whose adapter was not, and adapter loads.
    lora_hits: int = 0
    lora_misses: int = 0
    lora_loads: int = 0


class LoraSlots:
    """vLLM's LoRA scheduling, reduced: at most `slots` distinct adapters in the running batch, the
    adapters in GPU memory an LRU of that size (one with running requests is never evicted), loading
    one that is not there takes `load_s`. A request whose adapter cannot get a slot waits (vLLM's
    scheduler skips it until a running adapter's last request ends)."""

    def __init__(self, slots: int, load_s: float) -> None:
        self.slots = slots
        self.load_s = load_s
        self.loaded: OrderedDict[str, None] = OrderedDict()  # in GPU memory, least recent first
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._cond: asyncio.Condition | None = None

    async def acquire(self, adapter: str, stats: EngineStats) -> None:
        """Wait for a slot for `adapter` in the running batch; counted as a hit when the adapter is in
        GPU memory on arrival. Each acquire needs one `release`."""
        if adapter in self.loaded:
            stats.lora_hits += 1
        else:
            stats.lora_misses += 1
        cond = self._cond = self._cond or asyncio.Condition()
        self.waiting[adapter] += 1
        try:
            async with cond:
                await cond.wait_for(lambda: adapter in self.running or len(self.running) < self.slots)
                self.running[adapter] += 1
        finally:
            self.waiting[adapter] -= 1
            if not self.waiting[adapter]:
                del self.waiting[adapter]

    async def load(self, adapter: str, stats: EngineStats) -> None:
        """After `acquire`: the adapter in GPU memory (loaded now, evicting the least recently used
        idle one, or already there, or being loaded by another request)."""
        if adapter in self.loaded and adapter not in self._loading:
            self.loaded.move_to_end(adapter)
            return
        pending = self._loading.get(adapter)
        if pending is not None:  # another request of it is loading it
            await asyncio.shield(pending)
            return
        while len(self.loaded) >= self.slots:  # some loaded adapter has no running request
            victim = next(a for a in self.loaded if a not in self.running)
            del self.loaded[victim]
        self.loaded[adapter] = None
        done = self._loading[adapter] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.sleep(self.load_s)
            stats.lora_loads += 1
        finally:
            del self._loading[adapter]
            done.set_result(None)

    async def release(self, adapter: str) -> None:
        cond = self._cond = self._cond or asyncio.Condition()
        async with cond:
            self.running[adapter] -= 1
            if not self.running[adapter]:
                del self.running[adapter]
            cond.notify_all()


class SimEngine:
    """One engine on one port. `token_delay_s` is the time per output token (and per 256 prompt bytes);
    at most `max_batch` requests generate at once (0: unlimited), the rest wait in a FIFO queue, so an
    overloaded engine gets slower the way a real one does."""

    def __init__(
        self,
        name: str,
        model: str,
        token_delay_s: float = 0.005,
        default_tokens: int = 16,
        max_batch: int = 0,
        *,
        profile: GpuProfile | None = None,
        time_scale: float = 1.0,
        ready_delay_s: float = 0.0,
        check_model: bool = False,
        kv_events_port: int | None = None,
        kv_events_topic: str = "",
        lora_slots: int = 0,
        lora_load_s: float = 0.3,
        scheduling_policy: str = "fcfs",
        preemption_threshold: int | None = None,
        token_scale: float = 1.0,
    ) -> None:
        self.name = name
        # Model-driven engines only: a tokenizer that counts `token_scale` tokens per token of the
        # built-in one (~bytes/4): an engine whose tokens differ from a router's estimate (tokens.Recount).
        self.recount = Recount(token_scale)
        # vLLM's --scheduling-policy: "priority" orders the engine model's queue by the request
        # body's `priority` (lower first); under "fcfs" a non-zero priority is refused (400), as vLLM
        # does. The fixed-cost engine checks the field the same way but keeps its FIFO.
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        self.scheduling_policy = scheduling_policy
        # LoRA adapters (fixed-cost engine only): a request whose `model` is not the base model asks
        # for an adapter of that name, served through `lora_slots` slots (LoraSlots); 0: none.
        self.lora = LoraSlots(lora_slots, lora_load_s) if lora_slots > 0 else None
        # KV-cache events (model-driven engines only): vLLM's ZMQ PUB on this port (0: any free one,
        # read `kv_events_port` after start()); None: off.
        self.kv_events_port = kv_events_port
        self.kv_events_topic = kv_events_topic
        self.kv_publisher: KvEventPublisher | None = None
        # vLLM answers 404 for a model it does not serve; `llm-extproc sim` does too. Tests and benches
        # leave it off so one engine can stand in for several configured model names.
        self.check_model = check_model
        # With a profile, generation follows the engine model (batching, KV cache with prefix reuse,
        # preemption) in virtual time scaled by time_scale; without, a fixed cost per token.
        self.driver: ModelDriver | None = None
        if profile is not None:
            engine_model = EngineModel(
                profile,
                ready_at=ready_delay_s * time_scale,
                kv_events=kv_events_port is not None,
                scheduling_policy=scheduling_policy,
                preemption_threshold=preemption_threshold,
            )
            self.driver = ModelDriver(engine_model, time_scale)
        self.ready = True  # /health answers 503 while False (model "loading")
        # While True every request (health and metrics included) is accepted and never answered: a
        # wedged engine process. /sim/stats still answers, for tests.
        self.hung = False
        self.metrics_delay_s = 0.0  # /metrics answers this much later (a busy engine's slow page)
        self._slots: asyncio.Semaphore | None = asyncio.Semaphore(max_batch) if max_batch > 0 else None
        self.model = model
        self.token_delay_s = token_delay_s
        self.default_tokens = default_tokens
        self.stats = EngineStats()
        self._setup_metrics(max_batch)
        self.app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._errors, self._hang])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.post("/v1/embeddings", self._embeddings),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/get_load", self._get_load),
                web.get("/server_info", self._server_info),
                web.post("/v1/chat/completions/render", self._render_chat),
                web.post("/v1/completions/render", self._render_completion),
                web.get("/sim/stats", self._stats),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1]
        if self.driver is not None:
            if self.kv_events_port is not None:
                self.kv_publisher = KvEventPublisher(host, self.kv_events_port, self.kv_events_topic)
                self.kv_events_port = self.kv_publisher.port
                self.driver.on_kv_events = self.kv_publisher.publish
            self.driver.start()
        return self.port

    async def stop(self) -> None:
        if self.driver is not None:
            await self.driver.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own errors (unknown route, wrong method, body too large) as vLLM-shaped JSON."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else ""
            if exc.status == 404:
                message = f"{request.method} {request.path}: no such route"
            elif exc.status == 405:
                message = f"method {request.method} not allowed on {request.path}"
            return _error(exc.status, message or exc.reason, headers=_allow(exc))

    @web.middleware
    async def _hang(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.hung and request.path != "/sim/stats":
            if request.path.startswith("/v1/"):
                self.stats.hung_requests += 1
            await asyncio.Event().wait()  # until the client gives up (cancelled)
        return await handler(request)

    # -- handlers ------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await request.read()
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON")
        if not isinstance(doc, dict):
            return _error(400, "body must be an object")
        if (missing := self._unknown_model(doc)) is not None:
            return missing
        self._record(request, doc.get("priority"))
        priority = doc.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            return _error(400, "priority must be an integer", param="priority")
        if priority != 0 and self.scheduling_policy != "priority":
            return _error(
                400, f"Got priority {priority} but priority scheduling is not enabled.", param="priority"
            )
        n_tokens = doc.get("max_completion_tokens") or doc.get("max_tokens") or self.default_tokens
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool):
            return _error(400, "max_tokens must be an integer", param="max_tokens")
        n_tokens = max(1, min(n_tokens, 4096))
        if self.driver is not None:
            return await self._generate_model(request, doc, chat, n_tokens, priority)
        prompt_tokens = max(1, len(body) // 4)
        self.stats.active += 1
        self.stats.max_active = max(self.stats.max_active, self.stats.active)
        arrived = time.perf_counter()
        model = doc.get("model")
        adapter = model if self.lora is not None and isinstance(model, str) and model != self.model else None
        entered = False
        try:
            if adapter is not None:
                assert self.lora is not None
                await self.lora.acquire(adapter, self.stats)
                entered = True
                await self.lora.load(adapter, self.stats)
            async with self._slots or contextlib.nullcontext():
                self.stats.running += 1
                try:
                    return await self._run(request, doc, chat, n_tokens, prompt_tokens, len(body), arrived)
                finally:
                    self.stats.running -= 1
        except asyncio.CancelledError:
            self.stats.disconnected += 1
            raise
        finally:
            self.stats.active -= 1
            if entered:
                assert self.lora is not None and adapter is not None
                await asyncio.shield(self.lora.release(adapter))

    async def _run(
        self,
        request: web.Request,
        doc: dict[str, Any],
        chat: bool,
        n_tokens: int,
        prompt_tokens: int,
        size: int,
        arrived: float,
    ) -> web.StreamResponse:
        # Prefill: a cost proportional to the prompt, capped so huge test prompts stay quick.
        started = time.perf_counter()
        await asyncio.sleep(min(self.token_delay_s * size / 256, 0.5))
        s = self.stats
        s.prompt_tokens_total += prompt_tokens
        s.prefix_cache_queries += prompt_tokens
        s.prefill_count += 1
        s.prefill_time_sum += time.perf_counter() - started + self.token_delay_s
        s.generation_tokens_total += n_tokens
        s.itl_count += max(0, n_tokens - 1)
        s.itl_sum += max(0, n_tokens - 1) * self.token_delay_s
        self._ttft.observe(time.perf_counter() - arrived + self.token_delay_s)
        if doc.get("stream"):
            return await self._stream(request, doc, chat, n_tokens, prompt_tokens)
        await asyncio.sleep(self.token_delay_s * n_tokens)
        self.stats.completed += 1
        text = " ".join(f"tok{i}" for i in range(n_tokens))
        rid = f"sim-{uuid.uuid4().hex[:12]}"
        return self._json_completion(
            rid, doc.get("model", self.model), chat, text, _usage(prompt_tokens, n_tokens)
        )

    async def _stream(
        self, request: web.Request, doc: dict[str, Any], chat: bool, n_tokens: int, prompt_tokens: int
    ) -> web.StreamResponse:
        resp = await self._sse_start(request)
        rid = f"sim-{uuid.uuid4().hex[:12]}"
        model = doc.get("model", self.model)
        for i in range(n_tokens):
            await asyncio.sleep(self.token_delay_s)
            finish = "length" if i == n_tokens - 1 else None
            await resp.write(_sse(_chunk(rid, model, chat, f"tok{i} ", i, finish, self.name)))
        if (doc.get("stream_options") or {}).get("include_usage"):
            await resp.write(_sse(_usage_chunk(rid, model, chat, _usage(prompt_tokens, n_tokens))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.stats.completed += 1
        return resp

    async def _embeddings(self, request: web.Request) -> web.Response:
        """One vector per input, as vLLM does: a string or a token list is one input, a list of strings
        or of token lists is one input each. Vectors are deterministic per input (unit length)."""
        try:
            doc = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON")
        if not isinstance(doc, dict):
            return _error(400, "body must be an object")
        if (missing := self._unknown_model(doc)) is not None:
            return missing
        inputs = _embedding_inputs(doc.get("input"))
        if inputs is None:
            return _error(
                400,
                "input must be a string, a list of strings, a list of token ids or a list of such lists",
                param="input",
            )
        self._record(request)
        await asyncio.sleep(self.token_delay_s)
        prompt_tokens = sum(len(x) if isinstance(x, list) else len(tokenize(x)) for x in inputs)
        return web.json_response(
            {
                "id": f"embd-{uuid.uuid4().hex[:12]}",
                "object": "list",
                "created": int(time.time()),
                "data": [
                    {"object": "embedding", "index": i, "embedding": _vector(x)} for i, x in enumerate(inputs)
                ],
                "model": doc.get("model", self.model),
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens,
                    "completion_tokens": 0,
                },
            },
            headers={"x-sim-engine": self.name},
        )

    def _unknown_model(self, doc: dict[str, Any]) -> web.Response | None:
        """vLLM's 404 for a model this engine does not serve (only with `check_model`)."""
        model = doc.get("model")
        if not self.check_model or model is None or model == self.model:
            return None
        return _error(404, f"The model `{model}` does not exist.", param="model")

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "llm-extproc-sim"}],
            },
            headers={"x-sim-engine": self.name},
        )

    async def _generate_model(
        self, request: web.Request, doc: dict[str, Any], chat: bool, n_tokens: int, priority: int = 0
    ) -> web.StreamResponse:
        assert self.driver is not None
        tokens = self.recount(_prompt_tokens(doc, chat))
        if not tokens:
            return _error(400, "empty prompt")
        if len(tokens) >= self.driver.model.profile.max_model_len:
            return _error(400, f"prompt of {len(tokens)} tokens exceeds the model's context")
        rid = f"sim-{uuid.uuid4().hex[:12]}"
        model = doc.get("model", self.model)
        stream = bool(doc.get("stream"))
        resp: web.StreamResponse | None = None
        pieces: list[str] = []
        self.stats.active += 1
        try:
            async for ev in self.driver.generate(tokens, n_tokens, priority):
                if isinstance(ev, FirstTokenEvent):
                    self._ttft.observe(ev.ttft / self.driver.time_scale)
                elif isinstance(ev, TokenEvent):
                    piece = token_text(ev.token_id)
                    if not stream:
                        pieces.append(piece)
                        continue
                    if resp is None:
                        resp = await self._sse_start(request)
                    await resp.write(_sse(_chunk(rid, model, chat, piece, ev.index, None, self.name)))
                elif isinstance(ev, FinishedEvent):
                    usage = _usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                    self.stats.completed += 1
                    if not stream:
                        return self._json_completion(rid, model, chat, "".join(pieces), usage)
                    if resp is None:
                        resp = await self._sse_start(request)
                    await resp.write(
                        _sse(_chunk(rid, model, chat, "", ev.completion_tokens, "length", self.name))
                    )
                    if (doc.get("stream_options") or {}).get("include_usage"):
                        await resp.write(_sse(_usage_chunk(rid, model, chat, usage)))
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
        except asyncio.CancelledError:
            self.stats.disconnected += 1
            raise
        finally:
            self.stats.active -= 1
        return _error(500, "generation ended without finishing")

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "cache-control": "no-cache",
                "x-sim-engine": self.name,
            }
        )
        await resp.prepare(request)
        return resp

    def _json_completion(
        self, rid: str, model: str, chat: bool, text: str, usage: dict[str, Any]
    ) -> web.Response:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": self.name,
                "choices": [choice],
                "usage": usage,
            },
            headers={"x-sim-engine": self.name},
            dumps=lambda o: orjson.dumps(o).decode(),
        )

    async def _get_load(self, request: web.Request) -> web.Response:
        running, waiting = self._load()
        return web.json_response({"load": running + waiting, "num_running": running, "num_waiting": waiting})

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {
            "served_model_name": self.model,
            "engine": "llm-extproc-sim",
            "name": self.name,
        }
        if self.driver is not None:
            p = self.driver.model.profile
            info |= {
                "profile": p.name,
                "max_total_num_tokens": p.kv_capacity_tokens,
                "page_size": p.block_size,
                "max_model_len": p.max_model_len,
                "time_scale": self.driver.time_scale,
            }
        return web.json_response(info)

    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, *, chat: bool) -> web.Response:
        """The prompt's token ids as this engine sees them (the simulator's own tokenizer)."""
        try:
            doc = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON")
        if not isinstance(doc, dict):
            return _error(400, "body must be an object")
        ids = self.recount(_prompt_tokens(doc, chat))
        return web.json_response(
            {"prompt_token_ids": ids, "count": len(ids), "model": doc.get("model", self.model)}
        )

    def _load(self) -> tuple[int, int]:
        if self.driver is not None:
            return self.driver.model.num_running, self.driver.model.num_waiting
        return self.stats.running, self.stats.active - self.stats.running

    async def _health(self, request: web.Request) -> web.Response:
        if self.driver is not None and not self.driver.model.ready(self.driver.now()):
            return web.Response(status=503, text="loading")
        if not self.ready:
            return web.Response(status=503, text="loading")
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_delay_s > 0:
            await asyncio.sleep(self.metrics_delay_s)
        return web.Response(
            body=generate_latest(self.registry), headers={"content-type": CONTENT_TYPE_LATEST}
        )

    def _setup_metrics(self, max_batch: int) -> None:
        """vLLM's metric names and labels, so publishers scrape the simulator exactly like vLLM. With the
        engine model, KV usage and prefix-cache counters are the model's; without it, KV usage is the
        share of batch slots in use (the fixed-cost engine has no KV cache)."""
        labels = {"model_name": self.model, "engine": "0"}
        names = list(labels)
        self.registry = CollectorRegistry()
        running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            names,
            registry=self.registry,
        )
        running.labels(**labels).set_function(lambda: self._load()[0])
        waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            names,
            registry=self.registry,
        )
        waiting.labels(**labels).set_function(lambda: self._load()[1])
        kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            names,
            registry=self.registry,
        )
        slots = max_batch or 64
        driver = self.driver
        if driver is not None:
            kv.labels(**labels).set_function(lambda: driver.model.kv_usage)
            block_size, blocks = driver.model.profile.block_size, driver.model.profile.num_gpu_blocks
            self.registry.register(_PrefixCacheCollector(driver.model, labels, driver.time_scale))
        else:
            self.registry.register(_PrefixCacheCollector(self.stats, labels))
            kv.labels(**labels).set_function(lambda: min(1.0, self.stats.running / slots))
            block_size, blocks = 16, SIM_GPU_BLOCKS
        info_labels = {**labels, "block_size": str(block_size), "num_gpu_blocks": str(blocks)}
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info_labels),
            registry=self.registry,
        )
        info.labels(**info_labels).set(1)
        if self.lora is not None:
            self.registry.register(_LoraCollector(self.lora, labels))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        ).labels(**labels)

    async def _stats(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "name": self.name,
                "requests": s.requests,
                "active": s.active,
                "max_active": s.max_active,
                "completed": s.completed,
                "disconnected": s.disconnected,
                "lora_hits": s.lora_hits,
                "lora_misses": s.lora_misses,
                "lora_loads": s.lora_loads,
                "routing_headers": s.routing_headers[-100:],
                "priorities": s.priorities[-100:],
            }
        )

    def _record(self, request: web.Request, priority: Any = None) -> None:
        self.stats.requests += 1
        seen = {h: request.headers[h] for h in ROUTING_HEADERS if h in request.headers}
        self.stats.routing_headers.append(seen)
        self.stats.priorities.append(priority)  # the body's `priority` field as received (None: absent)
        if len(self.stats.routing_headers) > 1000:
            del self.stats.routing_headers[:500]
            del self.stats.priorities[:500]


class _LoraCollector(Collector):
    """vLLM's `vllm:lora_requests_info`: a gauge whose labels list the adapters with running and with
    waiting requests (comma-separated) and the slots (`max_lora`); its value is the time of the
    report."""

    def __init__(self, lora: LoraSlots, labels: dict[str, str]) -> None:
        self.lora = lora
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        names = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=names)
        lora = self.lora
        values = [str(lora.slots), ",".join(sorted(lora.running)), ",".join(sorted(lora.waiting))]
        family.add_metric(values, time.time())
        yield family


class _PrefixCacheCollector(Collector):
    """vLLM's cumulative prefix-cache, token and prefill-time counters, read from the engine model (or
    the fixed-cost engine's stats) at scrape time."""

    def __init__(
        self, model: EngineModel | EngineStats, labels: dict[str, str], time_scale: float = 1.0
    ) -> None:
        self.model = model
        self.labels = labels
        self.time_scale = time_scale  # times are exported in real seconds, as the TTFT histogram is

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in tokens.",
                self.model.prefix_cache_queries,
            ),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", self.model.prefix_cache_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", self.model.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                self.model.generation_tokens_total,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", self.model.preemptions_total),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        # Per-request prefill phase, first scheduled to first token: only the sum and count are
        # modelled, so one +Inf bucket (valid exposition; the publisher reads _sum for its rate).
        prefill = HistogramMetricFamily(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            labels=names,
        )
        prefill.add_metric(
            values, [("+Inf", self.model.prefill_count)], self.model.prefill_time_sum / self.time_scale
        )
        yield prefill
        itl = HistogramMetricFamily(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=names,
        )
        itl.add_metric(values, [("+Inf", self.model.itl_count)], self.model.itl_sum / self.time_scale)
        yield itl
        if isinstance(self.model, EngineModel):
            free = GaugeMetricFamily(
                "llm_extproc_sim_free_blocks", "Free KV blocks (simulator only).", labels=names
            )
            free.add_metric(values, self.model.free_blocks)
            yield free


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _chunk(
    rid: str, model: str, chat: bool, piece: str, index: int, finish: str | None, engine: str
) -> dict[str, Any]:
    """One streamed completion chunk; the first chat chunk also carries the assistant role."""
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": piece} | ({"role": "assistant"} if index == 0 else {})}
        if chat
        else {"index": 0, "text": piece}
    )
    choice["finish_reason"] = finish
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "model": model, "system_fingerprint": engine, "choices": [choice]}


def _usage_chunk(rid: str, model: str, chat: bool, usage: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "model": model, "choices": [], "usage": usage}


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _prompt_tokens(doc: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = doc.get("messages")
        return chat_to_tokens(messages) if isinstance(messages, list) else []
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(x, str) for x in prompt):
        return tokenize("\n".join(prompt))
    return []


# vLLM's error body: `ErrorResponse(error=ErrorInfo(message, type, param, code))` in
# vllm/entrypoints/openai/protocol.py (vllm-project/vllm, e.g. commit 0052bed3), where `type` is the
# exception name vLLM's serving layer gives (`create_error_response`: BadRequestError by default,
# NotFoundError for an unknown model) and `code` the HTTP status as an integer. Older vLLM releases sent
# the same fields flat with "object": "error"; the nested form is what OpenAI clients read.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    error = {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param}
    return web.json_response({"error": error | {"code": status}}, status=status, headers=headers)


def _allow(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None


def _embedding_inputs(raw: Any) -> list[str | list[int]] | None:
    """The inputs of an embeddings request, one item per vector; None when malformed or empty."""

    def token_ids(x: Any) -> bool:
        return (
            isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(raw, str):
        return [raw]
    if token_ids(raw):
        return [list(raw)]
    if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        return list(raw)
    if isinstance(raw, list) and raw and all(token_ids(x) for x in raw):
        return [list(x) for x in raw]
    return None


def _vector(item: str | list[int], dim: int = 8) -> list[float]:
    """A deterministic unit vector for one input (same input, same vector)."""
    seed = hashlib.blake2b(orjson.dumps(item), digest_size=2 * dim).digest()
    raw = [b - 127.5 for b in seed[:dim]]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


async def run_engines(
    host: str,
    first_port: int,
    delays_s: list[float],
    model: str,
    max_batch: int = 0,
    profiles: list[GpuProfile] | None = None,
    time_scale: float = 1.0,
    kv_events_port: int | None = None,
    kv_events_topic: str = "",
    scheduling_policy: str = "fcfs",
    preemption_threshold: int | None = None,
    token_scale: float = 1.0,
) -> None:
    """`llm-extproc sim`: one engine per delay (or per profile), on consecutive ports, until interrupted.
    Like vLLM, these engines answer 404 for a model other than `model`. With `kv_events_port` (and
    profiles), engine i publishes vLLM-format KV-cache events on kv_events_port + i (0: any port)."""
    kinds: list[GpuProfile | None] = list(profiles) if profiles else [None] * len(delays_s)
    engines = [
        SimEngine(
            f"sim-{i}",
            model,
            delays_s[i],
            max_batch=max_batch,
            profile=p,
            time_scale=time_scale,
            check_model=True,
            kv_events_port=None if kv_events_port is None else (kv_events_port + i if kv_events_port else 0),
            kv_events_topic=kv_events_topic,
            scheduling_policy=scheduling_policy,
            preemption_threshold=preemption_threshold,
            token_scale=token_scale,
        )
        for i, p in enumerate(kinds)
    ]
    for i, engine in enumerate(engines):
        port = await engine.start(host, first_port + i if first_port else 0)
        print(f"sim engine {engine.name} serving '{model}' on http://{host}:{port}", flush=True)
        if engine.kv_publisher is not None:
            print(f"  kv events: tcp://{host}:{engine.kv_events_port} topic '{kv_events_topic}'", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            for engine in engines:
                await engine.stop()
