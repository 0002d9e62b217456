"""The request lifecycle: parse -> admit -> prepare -> place -> schedule -> record, then finish (or
reject). Prepare runs the profile's producers once (framework.Producer: predicted TTFT per
candidate), and admission's placement and the profile's plugins read what they wrote by name. The
stream layer does the respond step and tells the lifecycle when the request ends.

Everything here is in-memory: no network I/O happens on the request path. `route()` runs on the
calling thread; `route_async()` awaits only to parse a big body in a worker process (bodies.py) and
to tokenize a long prompt on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.config import ServiceConfig
from extproc.fleet import FleetView, InFlight, Lease, SchedulingState, Upstream
from extproc.lifecycle.admission import (
    NO_ROUTE,
    Admission,
    RouteAdmission,
    priority_class,
)
from extproc.lifecycle.bodies import BodyParser
from extproc.lifecycle.endpoints import explained, in_subset, ranked_fallbacks
from extproc.openai import Api, InferenceRequest, RequestError, RequestHead, bodyless_request, parse_head
from extproc.openai.errors import (
    bad_request,
    body_too_large,
    no_upstream,
    prompt_too_long,
    unknown_model,
)
from extproc.openai.parse import MODEL_APIS, parse_request
from extproc.openai.rewrite import set_field
from extproc.scheduling import Profile, profile_from_config
from extproc.scheduling.explain import DecisionLog, Explanation, new_explanation
from extproc.settings import FALLBACK_PROFILE
from extproc.telemetry import Metrics
from extproc.telemetry.metrics import PLUGIN_TIMING_EVERY
from extproc.tokenization import (
    ChatTemplateError,
    PromptTooLong,
    TokenizedPrompt,
    TokenizerRegistry,
    block_hashes,
)
from extproc.tokenization.hashing import ids_array

log = logging.getLogger("extproc.lifecycle")
# Requests whose body gets the engine priority: vLLM's chat and completions requests carry the field.
ENGINE_PRIORITY_APIS = frozenset({Api.CHAT, Api.COMPLETION})
# Hash a prompt's blocks on a worker thread from this many blocks: from there, hashing them on the
# loop costs about what the hand-off to a thread does (notebook/benchmarks-history.md, "Tokenization
# on the request path").
OFFLOAD_HASH_BLOCKS = 256
MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32 (extproc.tokenization.hashing)


@dataclass(slots=True)
class Decision:
    request: InferenceRequest
    upstream: Upstream
    lease: Lease
    profile: Profile
    explanation: Explanation | None = None
    """Why it went there: filled only when asked (explain=True, or /debug/decisions keeping some)."""
    fallbacks: tuple[Upstream, ...] = ()
    """Endpoint mode with `fallbacks: N`: the next-best endpoints, listed after the pick (endpoints.py)."""


class RequestLifecycle:
    """Turns one request (headers, then maybe a body) into a Decision or a RequestError."""

    __slots__ = (
        "_untimed",
        "_warned",
        "admission",
        "bodies",
        "config",
        "decisions",
        "fallback",
        "inflight",
        "metrics",
        "state",
        "view",
    )

    def __init__(self, config: ServiceConfig, metrics: Metrics, view: FleetView | None = None) -> None:
        self._warned: set[str] = set()
        self._untimed = 0  # decisions until the next one whose plugins are timed
        self.config = config
        self.metrics = metrics
        self.inflight = InFlight(metrics.on_inflight_change)
        self.view = view
        if view is not None:
            view.own_count = self.inflight.count  # sampled as snapshots arrive (SchedulingState.pending)
        self.state = SchedulingState(self.inflight, view)
        self.fallback = profile_from_config("fallback", FALLBACK_PROFILE)
        self.bodies = BodyParser(config.bodies, config.max_body_bytes)
        self.admission = Admission(
            config.admission,
            self._admission_candidates,
            self.state,
            metrics,
            prefill=config.profile,  # the default profile's model of the prefill queues
        )
        keep = config.explain.keep_last
        self.decisions = DecisionLog(keep) if keep > 0 else None  # /debug/decisions
        metrics.watch_plugins(self._plugin_figures)
        # Endpoints that leave (discovery, or instances the view forgot): their state goes too.
        config.pool.on_departure(self.forget_upstreams)
        if view is not None:
            view.on_departure(self.forget_upstreams)

    def forget_upstreams(self, upstream_ids: Sequence[str]) -> list[str]:
        """Upstreams that left: discovery took them out of the pool, or the fleet view forgot the last
        instance behind them. Unless the pool or the view still has them, what the profiles' plugins
        (framework.UpstreamMemory) and the precise prefix index kept about them goes, so a pool whose
        endpoints churn keeps state for the endpoints it has, not every one it ever saw. Returns the
        ids forgotten."""
        live = {u.id for u in self.config.pool.everything()}
        if self.view is not None:
            live |= self.view.upstream_keys()
        gone = [uid for uid in upstream_ids if uid not in live]
        if not gone:
            return gone
        profiles = {id(p): p for p in (self.config.profile, *self.config.profiles.values(), self.fallback)}
        for profile in profiles.values():
            for uid in gone:
                profile.forget_upstream(uid)
        forget = getattr(self.state.kv, "forget", None)  # fleet/kv_index.py KvIndex
        if forget is not None:
            for uid in gone:
                forget(uid)
        log.debug("forgot the state of %d departed upstreams: %s", len(gone), ", ".join(gone[:16]))
        return gone

    def _plugin_figures(self) -> Iterator[tuple[str, str, str, float]]:
        """The profiles' reporting plugins' figures (calibration, guard drops), for /metrics."""
        for name, profile in list(self.config.profiles.items()):
            for plugin in profile.reporting:
                for figure, upstream, value in plugin.report():
                    yield name, figure, upstream, value

    def close(self) -> None:
        """Stop the body parser processes (the service calls this when it stops)."""
        self.bodies.close()

    def served_models(self) -> list[str]:
        """What `GET /v1/models` lists: the pool's models and those fresh snapshots name ("*" is a
        catch-all, not a model)."""
        models = set(self.config.pool.models())
        if self.view is not None:
            models |= self.view.fresh_models
        models.discard("*")
        return sorted(models)

    # -- parse -----------------------------------------------------------------------------------
    def read_head(self, headers: dict[str, str]) -> RequestHead:
        h = self.config.headers
        head = parse_head(
            headers,
            session_header=h.session,
            user_header=h.user,
            priority_header=h.priority,
            ttft_slo_header=h.ttft_slo,
            tpot_slo_header=h.tpot_slo,
        )
        if head.content_length is not None and head.content_length > self.config.max_body_bytes:
            raise body_too_large(self.config.max_body_bytes)
        return head

    def check_size(self, size: int) -> None:
        if size > self.config.max_body_bytes:
            raise body_too_large(self.config.max_body_bytes)

    def profile(self, name: str | None) -> Profile:
        """The profile a route asked for by name; the default when none is named or the name is unknown
        (an unknown name is logged once: a typo in envoy.yaml must not fail requests)."""
        if name is None:
            return self.config.profile
        found = self.config.profiles.get(name)
        if found is None:
            if name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "route asked for unknown scheduling profile %r; using %r",
                    name[:64],
                    self.config.profile.name,
                )
            return self.config.profile
        return found

    def route(
        self,
        head: RequestHead,
        body: bytes | None,
        profile: Profile | None = None,
        *,
        explain: bool = False,
        subset: frozenset[str] | None = None,
        route: RouteAdmission = NO_ROUTE,
    ) -> Decision:
        """route_async()'s stages on the calling thread (the discrete-event mode, benches, tests);
        raises RequestError to reject it. Nothing may wait here: a request admission would queue is
        refused (429 `saturated`); the discrete-event mode queues in virtual time with `prepare`,
        `admission` and `schedule` instead."""
        started = time.perf_counter()
        request = self.prepare(head, body, route, profile)
        self.admission.admit_now(request)
        return self._routed(self._schedule(request, profile, started, explain, subset))

    def prepare(
        self,
        head: RequestHead,
        body: bytes | None,
        route: RouteAdmission = NO_ROUTE,
        profile: Profile | None = None,
    ) -> InferenceRequest:
        """The parse and tokenize stages on the calling thread: `_prepare` with nothing handed to a
        worker, so it completes without suspending."""
        step = self._prepare(head, body, route, profile, offload=False)
        try:
            step.send(None)
        except StopIteration as done:
            request: InferenceRequest = done.value
            return request
        step.close()
        raise RuntimeError("the inline prepare stage suspended")

    def schedule(self, request: InferenceRequest, profile: Profile | None = None) -> Decision:
        """Schedule and record a prepared, admitted request (the discrete-event mode's last step)."""
        return self._schedule(request, profile, time.perf_counter())

    async def route_async(
        self,
        head: RequestHead,
        body: bytes | None,
        profile: Profile | None = None,
        *,
        explain: bool = False,
        subset: frozenset[str] | None = None,
        route: RouteAdmission = NO_ROUTE,
    ) -> Decision:
        """The request path: prepare (parse, tokenize, hash), admit (a request admission queues
        waits on a future: lifecycle/admission.py), schedule and record."""
        started = time.perf_counter()
        request = await self._prepare(head, body, route, profile, offload=True)
        waited = time.perf_counter()
        await self.admission.admit(request)
        started += time.perf_counter() - waited  # the decision time does not count the queue
        return self._routed(self._schedule(request, profile, started, explain, subset))

    async def _prepare(
        self,
        head: RequestHead,
        body: bytes | None,
        route: RouteAdmission,
        profile: Profile | None,
        *,
        offload: bool,
    ) -> InferenceRequest:
        """Parse, apply the route's admission settings, tokenize. With `offload` (the event loop), a
        big body is parsed in a worker process (bounded, see bodies.py), and a prompt is encoded and
        a long prompt's blocks hashed on a worker thread; without, all of it runs here."""
        if offload and body is not None and self.bodies.is_big(body):
            self.check_size(len(body))
            keep = self.config.tokenizers is not None  # messages are only needed to tokenize
            request = await self.bodies.parse(head, body, keep_messages=keep)
        else:
            request = self._parse(head, body)
        checked_token_ids(request)
        route.apply(request)
        args = self._tokenize_args(request)
        if args is not None:
            registry = self._registry()
            try:
                if offload:
                    result = await registry.tokenize_async(**args)
                else:
                    result = registry.tokenize(**args)
            except ChatTemplateError as exc:
                raise _template_error(exc) from None
            except PromptTooLong as exc:
                raise prompt_too_long(exc.max_model_len, exc.tokens, exact=exc.exact) from None
            self._tokenized(request, result)
        if offload:
            await self._hash_long_prompt(request, profile or self.config.profile)
        return request

    async def engine_body(self, decision: Decision, body: bytes | None) -> bytes | None:
        """The body with the request's engine priority written in (`engine_priority:`), or None
        when it goes unchanged: the setting is off or leaves out the chosen cluster, or the API has
        no such field. A big body is rewritten on a worker thread (a parse and dump of a multi-megabyte
        body would hold the loop)."""
        ep = self.config.engine_priority
        request = decision.request
        if ep is None or not body or request.api not in ENGINE_PRIORITY_APIS:
            return None
        value = ep.value_for(decision.upstream.cluster, request.priority)
        if value is None:
            return None
        if self.bodies.is_big(body):
            return await asyncio.to_thread(set_field, body, ep.field, value)
        return set_field(body, ep.field, value)

    @staticmethod
    def _routed(decision: Decision) -> Decision:
        """No prompt is kept while the request runs (plugins have seen it: their on_pick hooks ran;
        on_finish gets the same request object, without its prompt): a chat body's parsed messages
        take many times its size in Python objects, held until the response ends."""
        decision.request.release_prompt()
        return decision

    # -- tokenize --------------------------------------------------------------------------------
    @staticmethod
    async def _hash_long_prompt(request: InferenceRequest, profile: Profile) -> None:
        """A long prompt's block hashes, for the profile's plugin that hashes blocks, on a worker
        thread: hashing a long prompt's ids would otherwise hold the event loop inside the decision
        (docs/benchmarks.md, "Tokenization on the request path")."""
        spec = profile.hash_spec
        ids = request.prompt_token_ids
        if spec is None or not ids:
            return
        block, most = spec
        if min(len(ids) // block, most) < OFFLOAD_HASH_BLOCKS:
            return
        hashes = await asyncio.to_thread(block_hashes, ids, block, most)
        request.block_hashes = (block, hashes)

    def _registry(self) -> TokenizerRegistry:
        assert self.config.tokenizers is not None
        return self.config.tokenizers

    def _tokenize_args(self, request: InferenceRequest) -> dict[str, Any] | None:
        """What to tokenize, or None: no tokenizers configured (plugins estimate from the text), no
        model, or token ids already in the body."""
        if self.config.tokenizers is None or request.model is None or request.prompt_token_ids:
            return None
        if request.messages is not None:
            return {"model": request.model, "messages": request.messages}
        if request.api in MODEL_APIS:
            return {"model": request.model, "prompt": request.prompt_text}
        return None

    def _tokenized(self, request: InferenceRequest, result: TokenizedPrompt) -> None:
        m = self.metrics
        m.tokenized_by(result.source).inc()
        if result.exact:
            request.prompt_token_ids = result.token_ids
            request.prompt_tokens = result.token_count
            m.tokenized_tokens_by("hit").inc(result.cached_tokens)
            m.tokenized_tokens_by("miss").inc(result.token_count - result.cached_tokens)

    # -- admit, schedule, record -------------------------------------------------------------------
    def _schedule(
        self,
        request: InferenceRequest,
        profile: Profile | None,
        started: float,
        explain: bool = False,
        subset: frozenset[str] | None = None,
    ) -> Decision:
        # -- admit ---------------------------------------------------------------------------------
        profile = profile or self.config.profile
        candidates = self._candidates(request.model)
        if candidates is None:
            profile = self.fallback
            candidates = self.config.pool.candidates(request.model)  # type: ignore[arg-type]
            self.metrics.fallbacks.labels(reason="no_fresh_snapshot").inc()
            if not candidates:
                raise no_upstream(request.model)
        if subset is not None:  # the gateway's subset hint (endpoint picker protocol): only inside it
            candidates = in_subset(candidates, subset, request.model)
        # -- prepare: the figures admission and the profile's plugins read (framework.Producer) ----
        timer = None
        self._untimed -= 1
        if self._untimed < 0:
            self._untimed = PLUGIN_TIMING_EVERY - 1  # telemetry/metrics.py: why a sample
            timer = self.metrics.observe_plugin
        profile.prepare(request, candidates, self.state, timer)
        fallbacks = self.config.fallbacks  # the next-best by total score (endpoints.py)
        ranked: list[tuple[float, Upstream]] | None = [] if fallbacks > 0 else None
        why = new_explanation(request.model) if explain or self.decisions is not None else None
        try:
            if request.model is not None:  # admitted: to an upstream with headroom (admission.py)
                candidates = self.admission.placeable(request, candidates)
            # -- schedule --------------------------------------------------------------------------
            upstream = profile.schedule(request, candidates, self.state, timer, why, ranked=ranked)
        except RequestError as err:
            if err.code == "slo_unattainable":  # slo-ttft / slo-tpot: counted as an admission shed
                klass = priority_class(request.priority).value
                self.metrics.admission.labels(priority=klass, decision="shed", reason=err.code).inc()
            raise
        finally:
            request.prepared = None  # the decision's figures: not kept while the request runs
        if why is not None and self.decisions is not None:
            self.decisions.add(why)
        if upstream is None:
            raise no_upstream(request.model)
        # -- record --------------------------------------------------------------------------------
        if request.predicted_ttft_s is not None:
            klass = priority_class(request.priority).value
            self.metrics.predicted_ttft_by(klass).observe(request.predicted_ttft_s)
        lease = self.inflight.acquire(upstream)
        self.metrics.requests_by(self.metrics.model_label(request.model), upstream.cluster, "routed").inc()
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        decision = Decision(request=request, upstream=upstream, lease=lease, profile=profile, explanation=why)
        if ranked is not None and upstream.address is not None:
            scored = explained(why) if why is not None else ranked
            decision.fallbacks = ranked_fallbacks(scored, upstream, fallbacks)
        return decision

    # -- finish ----------------------------------------------------------------------------------
    def finish(self, decision: Decision, trigger: str) -> None:
        """The routed request ended: `response_end` (its response finished) or `stream_end` (the
        ext_proc stream closed first, e.g. the client went away). Idempotent: only the first counts."""
        if not decision.lease.release():
            return
        self.metrics.releases_by(trigger).inc()
        decision.profile.finished(decision.request, decision.upstream)
        self.admission.dispatch(decision.request.model)  # the freed capacity goes to a waiter

    def first_byte(self, decision: Decision, seconds: float) -> None:
        """A streamed request's first response byte came `seconds` after it reached Envoy (its
        access-log entry): the observed TTFT, by class, beside the predicted one."""
        if decision.request.stream:
            klass = priority_class(decision.request.priority).value
            self.metrics.observed_ttft_by(klass).observe(seconds)

    def reject(self, error: RequestError, decision: Decision | None = None) -> None:
        """The request is answered with `error` (before or after routing): release and count it."""
        model = None
        if decision is not None:
            model = decision.request.model
            if decision.lease.release():
                decision.profile.finished(decision.request, decision.upstream)
                self.admission.dispatch(model)
        self.metrics.errors_by(str(error.status)).inc()  # shedding at saturation: every request
        self.metrics.requests_by(self.metrics.model_label(model), "", "rejected").inc()

    def _admission_candidates(self, model: str) -> tuple[Upstream, ...]:
        """Who admission measures for `model`: the live candidates, else the static pool's."""
        found = self._candidates(model)
        if found is None:
            found = self.config.pool.candidates(model) or ()
        return found

    def _candidates(self, model: str | None) -> tuple[Upstream, ...] | None:
        """Who may serve `model`. Live snapshots decide when fresh ones exist for the model (an empty
        tuple then means none is ready: 503); None asks for the stale-data fallback over the static
        pool. Raises 404 for a model neither the pool nor any fresh snapshot serves."""
        static = self.config.pool.candidates(model) if model is not None else self.config.pool.everything()
        if self.view is None or model is None:
            if static is None:
                raise unknown_model(model or "")
            return static
        live = self.view.candidates(model)
        if live is not None:
            return live
        if static is None:
            raise unknown_model(model)
        return None

    def _parse(self, head: RequestHead, body: bytes | None) -> InferenceRequest:
        """On the calling thread (route(), and small bodies in route_async())."""
        if body is None or (not body and head.api not in MODEL_APIS):
            if head.api in MODEL_APIS:
                raise bad_request("This endpoint requires a JSON request body.", code="missing_body")
            return bodyless_request(head)
        self.check_size(len(body))
        return parse_request(head, body)


def checked_token_ids(request: InferenceRequest) -> None:
    """A prompt given as token ids, as the uint32 array every hash of it reads (extproc.tokenization:
    one conversion, here, instead of one per use); an id outside 0..2^32-1 is the client's 400, not a
    500 from deep inside a scorer. A worker process's parse hands over such an array already."""
    ids = request.prompt_token_ids
    if not ids:
        return
    try:
        request.prompt_token_ids = ids_array(ids)
    except OverflowError:
        field = "input" if request.api is Api.EMBEDDING else "prompt"
        raise bad_request(
            f"'{field}' holds a token id outside 0..{MAX_TOKEN_ID}.", param=field, code="invalid_value"
        ) from None


def _template_error(exc: ChatTemplateError) -> RequestError:
    """The model's chat template rejected the messages (e.g. roles that must alternate): the client's
    request is at fault, as with the engine itself, which would answer 400 too."""
    return bad_request(f"The chat template rejected the messages: {str(exc)[:300]}", code="invalid_messages")
