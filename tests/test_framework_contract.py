"""The scheduling framework's contract with plugins (hooks collected once, scores checked, time per
plugin), the lifecycle's ownership of a request's end, and config errors that name the bad key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from builders import chat_request

from extproc.cli import INIT_FILES, main
from extproc.config import config_from_dict, load_config
from extproc.fleet import InFlight, SchedulingState, Upstream
from extproc.lifecycle import RequestLifecycle
from extproc.openai import InferenceRequest, RequestError
from extproc.openai.parse import parse_head
from extproc.scheduling import FinishHook, PickHook, Profile, plugin_name, profile_from_config
from extproc.scheduling.plugins import LeastOutstandingScorer, MaxScorePicker
from extproc.server.stream import RequestStream
from extproc.settings import ConfigError, listen_address, shipped_configs
from extproc.telemetry import Metrics

A, B, C = (Upstream(id=x, cluster=x, address=None, weight=1.0) for x in "abc")


class Fixed:
    """A scorer returning the scores it was given (whatever they are)."""

    def __init__(self, scores: Sequence[float]) -> None:
        self.scores = list(scores)

    def score(self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any) -> list[float]:
        return self.scores


class Learner:
    def __init__(self) -> None:
        self.picked: list[str] = []
        self.finished: list[str] = []

    def score(self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any) -> list[float]:
        return [1.0 if u.id == "b" else 0.0 for u in candidates]

    def on_pick(self, request: InferenceRequest, upstream: Upstream, state: Any) -> None:
        self.picked.append(upstream.id)

    def on_finish(self, request: InferenceRequest, upstream: Upstream) -> None:
        self.finished.append(upstream.id)


def state() -> SchedulingState:
    return SchedulingState(InFlight(), None)


def profile(*scorers: tuple[Any, float]) -> Profile:
    return Profile(name="p", filters=(), scorers=tuple(scorers), picker=MaxScorePicker(seed=0))


# -- scores are checked --------------------------------------------------------------------------------
def test_a_scorer_returning_too_few_scores_is_an_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"scorer 'Fixed' returned 2 scores for 3 candidates"):
        profile((Fixed([1.0, 1.0]), 1.0)).schedule(chat_request(), [A, B, C], state())


def test_scores_are_clamped_so_one_scorer_cannot_outweigh_the_weights() -> None:
    # Unclamped, 50.0 x 1 would beat 1.0 x 2 and pick a; clamped to 1.0, b wins on the heavier scorer.
    wild = Fixed([50.0, 0.0])
    heavy = Fixed([0.0, 1.0])
    assert profile((wild, 1.0), (heavy, 2.0)).schedule(chat_request(), [A, B], state()) is B


@pytest.mark.parametrize("bad", [math.nan, -3.0, -math.inf])
def test_nan_and_negative_scores_count_as_zero(bad: float) -> None:
    assert profile((Fixed([bad, 0.1]), 1.0)).schedule(chat_request(), [A, B], state()) is B


# -- hooks are collected when the profile is built -------------------------------------------------------
def test_hooks_are_collected_once_and_called() -> None:
    learner = Learner()
    p = profile((learner, 1.0), (LeastOutstandingScorer(), 1.0))
    assert p.pick_hooks == (learner,) and p.finish_hooks == (learner,)
    assert isinstance(learner, PickHook) and isinstance(learner, FinishHook)
    assert not isinstance(LeastOutstandingScorer(), PickHook)
    assert p.schedule(chat_request(), [A, B], state()) is B
    assert learner.picked == ["b"]
    p.finished(chat_request(), B)
    assert learner.finished == ["b"]


def test_plugin_names_come_from_the_registry_once() -> None:
    built = profile_from_config("x", {"scorers": ["prefix-affinity", "queue-depth"], "picker": "max-score"})
    assert [plugin_name(s) for s, _ in built.scorers] == ["prefix-affinity", "queue-depth"]
    assert plugin_name(built.picker) == "max-score"
    assert plugin_name(Fixed([])) == "Fixed"  # built outside the registry


def test_each_plugin_call_is_timed() -> None:
    calls: list[tuple[str, str]] = []
    p = profile_from_config(
        "t",
        {"filters": ["max-inflight"], "scorers": ["queue-depth", "kv-cache-usage"], "picker": "max-score"},
    )
    p.schedule(chat_request(), [A, B], state(), lambda kind, name, s: calls.append((kind, name)))
    assert calls == [
        ("filter", "max-inflight"),
        ("scorer", "queue-depth"),
        ("scorer", "kv-cache-usage"),
        ("picker", "max-score"),
    ]


# -- the lifecycle owns the request's end ------------------------------------------------------------------
POOL = {"clusters": [{"name": "a", "models": ["m"]}, {"name": "b", "models": ["m"]}]}
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
    session_header="x-session-id",
    user_header="x-user-id",
    priority_header="x-llm-priority",
)


def lifecycle_with(learner: Learner) -> RequestLifecycle:
    cfg = config_from_dict({"pool": POOL, "metrics_listen": None})
    cfg.profile = profile((learner, 1.0))
    return RequestLifecycle(cfg, Metrics(cfg.pool.models(), cfg.pool.cluster_names()))


def sample(lc: RequestLifecycle, name: str, **labels: str) -> float:
    return lc.metrics.registry.get_sample_value(name, labels) or 0.0


def test_finish_releases_counts_and_tells_plugins_exactly_once() -> None:
    learner = Learner()
    lc = lifecycle_with(learner)
    decision = lc.route(HEAD, BODY)
    assert lc.inflight.count("b") == 1
    lc.finish(decision, "response_end")
    lc.finish(decision, "stream_end")  # the stream closing afterwards changes nothing
    assert lc.inflight.count("b") == 0
    assert learner.finished == ["b"]
    assert sample(lc, "llm_extproc_releases_total", trigger="response_end") == 1
    assert sample(lc, "llm_extproc_releases_total", trigger="stream_end") == 0
    assert sample(lc, "llm_extproc_plugin_seconds_count", kind="scorer", plugin="Learner") == 1


def test_plugins_are_timed_on_a_sample_of_decisions() -> None:
    from extproc.telemetry.metrics import PLUGIN_TIMING_EVERY

    lc = lifecycle_with(Learner())
    for _ in range(2 * PLUGIN_TIMING_EVERY + 1):
        lc.finish(lc.route(HEAD, BODY), "response_end")
    # the first decision, then one in PLUGIN_TIMING_EVERY
    assert sample(lc, "llm_extproc_plugin_seconds_count", kind="scorer", plugin="Learner") == 3
    assert sample(lc, "llm_extproc_releases_total", trigger="response_end") == 2 * PLUGIN_TIMING_EVERY + 1


async def test_stream_close_goes_through_the_lifecycle() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    learner = Learner()
    lc = lifecycle_with(learner)
    s = RequestStream(lc)
    hdrs = pb.ProcessingRequest()
    for k, v in {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
    }.items():
        hdrs.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    await s.on_message(hdrs)
    await s.on_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)))
    s.close()
    assert learner.finished == ["b"]
    assert sample(lc, "llm_extproc_releases_total", trigger="stream_end") == 1


def test_reject_after_routing_releases_and_counts_the_error() -> None:
    learner = Learner()
    lc = lifecycle_with(learner)
    decision = lc.route(HEAD, BODY)
    lc.reject(RequestError(500, "boom", err_type="server_error"), decision)
    assert lc.inflight.total() == 0
    assert learner.finished == ["b"]
    assert sample(lc, "llm_extproc_errors_total", status="500") == 1
    assert sample(lc, "llm_extproc_requests_total", model="m", cluster="", outcome="rejected") == 1


# -- config errors name the key ---------------------------------------------------------------------------
def test_a_typo_in_a_cluster_is_named_as_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown keys \['modles'\]"):
        config_from_dict({"pool": {"clusters": [{"name": "a", "modles": ["m"]}]}})


@pytest.mark.parametrize(
    "raw",
    [
        {
            "scheduling": {
                "profiles": {"p": {"scorers": ["queue-depth"], "pickr": "max-score"}},
                "profile": "p",
            }
        },
        {
            "scheduling": {
                "profiles": {"p": {"scorers": [{"name": "queue-depth", "wieght": 2}]}},
                "profile": "p",
            }
        },
        {"scheduling": {"profil": "p"}},
        {"fleet": {"urll": "redis://x"}},
        {"headers": {"sesion": "x-s"}},
    ],
)
def test_unknown_keys_everywhere_are_named(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_dict({"pool": POOL, **raw})


@pytest.mark.parametrize("good", ["127.0.0.1:9002", "0.0.0.0:0", "[::1]:9002", "[::]:80", "localhost:9002"])
def test_listen_addresses_accepted(good: str) -> None:
    assert listen_address(good, "listen") == good


@pytest.mark.parametrize(
    "bad",
    [
        "notanaddress",
        "127.0.0.1",
        "127.0.0.1:99999",
        "[zz]:1",
        "300.1.1.1:80",
        "bad_host:1",
        "a b:1",
        "",
        ":9002",
    ],
)
def test_listen_addresses_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="listen"):
        config_from_dict({"pool": POOL, "listen": bad})


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pool: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


# -- init ---------------------------------------------------------------------------------------------------
def test_init_writes_agreeing_configs_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cfg"
    assert main(["init", str(target)]) == 0
    for name in INIT_FILES:
        assert (target / name).read_text() == (shipped_configs() / name).read_text()
    assert load_config(target / "llm-extproc.yaml").pool.cluster_names()
    (target / "envoy.yaml").write_text("# edited\n")
    assert main(["init", str(target)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (target / "envoy.yaml").read_text() == "# edited\n"  # nothing lost
    assert main(["init", str(target), "--force"]) == 0
    assert (target / "envoy.yaml").read_text() == (shipped_configs() / "envoy.yaml").read_text()


class ConstantPredictor:
    """Not predicted-ttft: any plugin that produces the prepared `predicted-ttft` figure."""

    produces = ("predicted-ttft",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.prepared = 0

    def score(self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any) -> list[float]:
        return [0.0] * len(candidates)

    def prepare(self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any) -> None:
        self.prepared += 1
        assert request.prepared is not None
        request.prepared["predicted-ttft"] = {u.id: self.seconds for u in candidates}


def test_the_ttft_readers_read_the_prepared_figure_by_name_not_a_plugin() -> None:
    """slo-ttft reads the `predicted-ttft` figure whichever plugin of its profile produced it, once
    per decision; a profile without a producer is refused, naming what would produce it."""
    from extproc.scheduling.slo import SloTtftFilter

    candidates = [Upstream("a", "a", None, 1.0), Upstream("b", "b", None, 1.0)]
    request = chat_request()
    state = SchedulingState(InFlight(), None)
    for seconds, kept in ((0.1, 2), (5.0, 0)):
        producer = ConstantPredictor(seconds)
        profile = Profile("p", (SloTtftFilter(),), ((producer, 1.0),), MaxScorePicker())
        assert profile.produced == {"predicted-ttft"}
        request.ttft_slo_ms = 1000.0
        if kept:
            assert profile.schedule(request, candidates, state) in candidates
        else:
            with pytest.raises(RequestError) as err:
                profile.schedule(request, candidates, state)
            assert err.value.status == 429
        assert producer.prepared == 1  # once per decision
        assert request.prepared is None  # not kept past the decision
    with pytest.raises(ConfigError, match=r"'predicted-ttft', which no plugin .* scorer 'predicted-ttft'"):
        Profile("p", (SloTtftFilter(),), ((LeastOutstandingScorer(), 1.0),), MaxScorePicker())
