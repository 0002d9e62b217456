"""Decision explanation: the framework records the decision it makes (per-filter survival, per-scorer
raw score, weight and contribution; totals are the sums), the x-llm-decision header reaches the client
through real Envoy (envoy.yaml copies the request header onto the response), /debug/decisions lists the
last N; all of it off by default (no header, 404)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
import pytest
from builders import chat_request
from gateway_stack import MODEL, Stack, service_config

from extproc.fleet import Load, Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling import Profile, build_picker, profile_from_config
from extproc.scheduling.explain import (
    DECISION_HEADER,
    MAX_HEADER_BYTES,
    DecisionLog,
    new_explanation,
)
from extproc.settings import ConfigError, ExplainSettings, explain_settings
from extproc_lab.stack import body_mode_edit

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


# -- the framework ----------------------------------------------------------------------------------
class State:
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = Counter(counts)

    def count(self, upstream_id: str) -> int:
        return self.counts[upstream_id]

    def load(self, upstream_id: str) -> Load | None:
        return None

    def pending(self, upstream_id: str) -> int:
        return self.counts[upstream_id]

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return 0.0, None, None  # no batch limit known

    def now(self) -> float:
        return 0.0


@dataclass(slots=True)
class DropNamed:
    name: str

    def filter(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any
    ) -> Sequence[Upstream]:
        return [u for u in candidates if u.id != self.name]


@dataclass(slots=True)
class Fixed:
    """Returns given scores by upstream id, out of range ones included (the framework clamps)."""

    scores: dict[str, float]

    def score(self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any) -> list[float]:
        return [self.scores[u.id] for u in candidates]


def ups(*names: str) -> list[Upstream]:
    return [Upstream(id=n, cluster=n, address=None, weight=1.0) for n in names]


def profile() -> Profile:
    return Profile(
        name="p",
        filters=(DropNamed("d"),),
        scorers=(
            (Fixed({"a": 0.2, "b": 0.9, "c": 1.7}), 2.0),
            (Fixed({"a": 0.7, "b": -0.3, "c": float("nan")}), 0.5),
            (profile_from_config("x", {"scorers": ["least-outstanding"]}).scorers[0][0], 1.25),
        ),
        picker=build_picker("max-score", {"seed": 3}),
    )


def test_explained_decision_is_the_same_and_totals_are_the_sum_of_contributions() -> None:
    state = State({"a": 1, "b": 0, "c": 4, "d": 0})
    plain = profile().schedule(chat_request(), ups("a", "b", "c", "d"), state)
    why = new_explanation(MODEL)
    explained = profile().schedule(chat_request(), ups("a", "b", "c", "d"), state, explain=why)
    assert plain is not None and explained is not None and plain.id == explained.id
    assert why.picked is not None and why.picked.id == explained.id
    assert why.profile == "p" and why.scored
    assert why.scorer_labels() == ["Fixed", "Fixed#2", "least-outstanding"]
    rows = {c.upstream.id: c for c in why.candidates}
    assert rows["d"].dropped_by == "DropNamed" and rows["d"].contributions == []
    for uid in "abc":
        row = rows[uid]
        assert row.dropped_by is None
        assert sum(row.contributions) == row.total  # exactly: the same additions in the same order
        for (_, weight), raw, contribution in zip(why.scorers, row.raw, row.contributions, strict=True):
            clamped = 0.0 if raw != raw else min(1.0, max(0.0, raw))  # NaN -> 0
            assert contribution == weight * clamped
    assert rows["c"].raw[0] == 1.7 and rows["c"].contributions[0] == 2.0  # clamped to 1
    assert rows["b"].contributions[1] == 0.0  # negative -> 0
    assert max(rows[u].total for u in "abc") == rows[explained.id].total
    assert why.totals == [rows[u].total for u in why.scored_ids]  # the totals the picker saw


def test_one_survivor_is_picked_unscored_and_none_left_is_recorded() -> None:
    p = Profile(name="p", filters=(DropNamed("a"),), scorers=(), picker=build_picker("max-score"))
    why = new_explanation(None)
    assert p.schedule(chat_request(), ups("a", "b"), State({}), explain=why) is not None
    assert not why.scored and why.picked is not None and why.picked.id == "b"
    why = new_explanation(None)
    assert p.schedule(chat_request(), ups("a"), State({}), explain=why) is None
    assert why.picked is None and why.candidates[0].dropped_by == "DropNamed"


def parse_header(value: str) -> tuple[str, dict[str, dict[str, float]]]:
    """The header's grammar: `<picked>; profile=..; candidates=N, <id>; total=T; <scorer>=C; ..., ...`"""
    head, *items = value.split(", ")
    picked = head.split("; ")[0]
    out: dict[str, dict[str, float]] = {}
    for item in items:
        uid, *fields = item.split("; ")
        out[uid] = {k: float(v) for k, v in (f.split("=") for f in fields)}
    return picked, out


def test_header_lists_top_three_compact_and_bounded() -> None:
    state = State({"a": 3, "b": 0, "c": 1, "e": 2})
    why = new_explanation(MODEL)
    chosen = profile_from_config(
        "lo", {"scorers": ["least-outstanding", {"name": "least-outstanding", "weight": 0.5}]}
    ).schedule(chat_request(), ups("a", "b", "c", "e"), state, explain=why)
    assert chosen is not None and chosen.id == "b"
    picked, cands = parse_header(why.header_value())
    assert picked == "b" and list(cands) == ["b", "c", "e"]  # best three, best first
    for c in cands.values():
        parts = [v for k, v in c.items() if k != "total"]
        assert abs(sum(parts) - c["total"]) <= 0.00005 * (len(parts) + 1)  # 4-decimal rounding
    many = replace(
        why,
        scorers=tuple((f"scorer-with-a-long-name-{i}", 1.0) for i in range(40)),
        raw=[why.raw[0]] * 40,
    )
    value = many.header_value()
    assert len(value) <= MAX_HEADER_BYTES and value.startswith("b; profile=lo; candidates=4")


def test_decision_log_keeps_the_last_n_newest_first() -> None:
    log = DecisionLog(3)
    for i in range(5):
        why = new_explanation(f"m{i}")
        profile().schedule(chat_request(), ups("a", "b", "c"), State({}), explain=why)
        log.add(why)
    status, kind, body = log.page()
    doc = orjson.loads(body)
    assert (status, kind) == (200, "application/json")
    assert [d["model"] for d in doc["decisions"]] == ["m4", "m3", "m2"]
    for cand in doc["decisions"][0]["candidates"]:
        assert sum(s["contribution"] for s in cand["scores"].values()) == cand["total"]


def test_settings() -> None:
    assert explain_settings(None) == ExplainSettings("off", 0)
    assert explain_settings({"header": True, "keep_last": 5}) == ExplainSettings("on_request", 5)
    assert explain_settings({"header": "always"}).header == "always"
    assert explain_settings({"header": False}).header == "off"
    for bad in ({"header": "yes"}, {"keep_last": -1}, {"keep_last": 10**6}, {"headers": True}):
        with pytest.raises(ConfigError, match="explain"):
            explain_settings(bad)
    assert explain_settings(None).detail == "summary"
    assert explain_settings({"detail": "full"}).detail == "full"
    with pytest.raises(ConfigError, match="detail"):
        explain_settings({"detail": "debug"})
    asked = {"x-llm-explain": "1"}
    assert not ExplainSettings("off").wants_header(asked)
    assert ExplainSettings("on_request").wants_header(asked)
    assert not ExplainSettings("on_request").wants_header({"x-llm-explain": "0"})
    assert not ExplainSettings("on_request").wants_header({})
    assert ExplainSettings("always").wants_header({})


class Calibrated:
    """A reporting plugin (framework.Reporting) with a figure per upstream, as predicted-ttft has."""

    def report(self) -> Iterator[tuple[str, str, float]]:
        yield "token_ratio", "gpu-a/10.1.2.3:8000", 0.93
        yield "token_ratio", "gpu-b/10.1.2.4:8000", 1.07


def test_the_header_for_clients_names_clusters_without_addresses_or_scores() -> None:
    """Clients read the header: at the default detail it names the picked cluster, the profile and the
    candidate count, never an upstream address (endpoint mode) nor a score or figure derived from
    what engines cache (a prefix scorer's score tells whether someone sent that prompt before);
    `detail: full` is the whole record, for routes whose clients the operator trusts."""
    endpoints = [
        Upstream(id="gpu-a/10.1.2.3:8000", cluster="gpu-a", address="10.1.2.3:8000", weight=1.0),
        Upstream(id="gpu-b/10.1.2.4:8000", cluster="gpu-b", address="10.1.2.4:8000", weight=1.0),
    ]
    prefix_like = Fixed({"gpu-a/10.1.2.3:8000": 0.96, "gpu-b/10.1.2.4:8000": 0.0})
    p = Profile(name="p", filters=(), scorers=((prefix_like, 1.0),), picker=build_picker("max-score"))
    p.reporting = (Calibrated(),)
    why = new_explanation(MODEL)
    assert p.schedule(chat_request(), endpoints, State({}), explain=why) is not None
    summary = ExplainSettings("on_request").header_for(why)
    assert summary == "gpu-a; profile=p; candidates=2"
    full = ExplainSettings("on_request", detail="full").header_for(why)
    assert full == why.header_value()
    assert "10.1.2.3:8000" in full and "total=0.9600" in full and "token_ratio=0.93" in full
    for secret in ("10.1.2.", "total", "0.96", "Fixed", "token_ratio"):
        assert secret not in summary


# -- through real Envoy -------------------------------------------------------------------------------
PROFILE = {
    "scorers": [
        {"name": "least-outstanding", "weight": 1.0},
        {"name": "queue-depth", "weight": 0.5},
        {"name": "predicted-ttft", "weight": 2.0},
    ],
    "picker": "max-score",
}


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def post(stack: Stack, headers: dict[str, str], **body: Any) -> tuple[str, dict[str, str]]:
    url = stack.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json={**CHAT, **body}, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return stack.cluster_of[r.headers["x-sim-engine"]], dict(r.headers)


@pytest.mark.envoy
async def test_header_and_debug_endpoint_through_envoy(make_stack: Any) -> None:
    cfg = service_config(
        explain={"header": "on_request", "keep_last": 4, "detail": "full"},
        scheduling={"profile": "mixed", "profiles": {"mixed": PROFILE}},
    )
    stack: Stack = make_stack(service=cfg)
    for stream in (False, True):
        served, headers = await post(stack, {"x-llm-explain": "1"}, stream=stream)
        picked, cands = parse_header(headers[DECISION_HEADER])
        assert picked == served and picked in cands, headers[DECISION_HEADER]
        assert set(cands) == {"gpu-a", "gpu-b"}
        for c in cands.values():
            assert set(c) == {"total", "least-outstanding", "queue-depth", "predicted-ttft"}
            parts = [v for k, v in c.items() if k != "total"]
            assert abs(sum(parts) - c["total"]) <= 0.0002
        assert cands[picked]["total"] == max(c["total"] for c in cands.values())
    # Not asked: no header (the service sets none, Envoy adds none), even with a forged one.
    _, headers = await post(stack, {DECISION_HEADER: "gpu-z; forged"})
    assert DECISION_HEADER not in headers
    for _ in range(3):
        await post(stack, {})
    status, body = get(f"http://127.0.0.1:{stack.metrics_port}/debug/decisions")
    assert status == 200
    doc = orjson.loads(body)
    assert doc["keep_last"] == 4 and len(doc["decisions"]) == 4  # 6 decisions made, the last 4 kept
    for d in doc["decisions"]:
        assert d["profile"] == "mixed" and d["model"] == MODEL and d["scored"]
        assert [s["name"] for s in d["scorers"]] == ["least-outstanding", "queue-depth", "predicted-ttft"]
        totals = {}
        for c in d["candidates"]:
            assert c["dropped_by"] is None and set(c["scores"]) == {s["name"] for s in d["scorers"]}
            assert sum(s["contribution"] for s in c["scores"].values()) == pytest.approx(
                c["total"], abs=1e-12
            )
            totals[c["id"]] = c["total"]
        assert totals[d["picked"]] == max(totals.values())


@pytest.mark.envoy
async def test_off_by_default_through_envoy(make_stack: Any) -> None:
    stack: Stack = make_stack()
    _, headers = await post(stack, {"x-llm-explain": "1", DECISION_HEADER: "forged"})
    assert DECISION_HEADER not in headers
    assert get(f"http://127.0.0.1:{stack.metrics_port}/debug/decisions")[0] == 404
    assert get(f"http://127.0.0.1:{stack.metrics_port}/healthz")[0] == 200


def test_header_tokens_are_header_safe() -> None:
    """Upstream ids and names come from configs and snapshots: nothing in them can break the header's
    list syntax or smuggle a line break."""
    why = new_explanation(MODEL)
    odd = [Upstream(id=n, cluster=n, address=None, weight=1.0) for n in ("a,b;c=d", "e\r\nx-evil: 1", "f g")]
    profile_from_config("p", {"scorers": ["least-outstanding"]}).schedule(
        chat_request(), odd, State({}), explain=why
    )
    value = why.header_value()
    assert "\r" not in value and "\n" not in value
    picked, cands = parse_header(value)
    assert set(cands) == {"a_b_c_d", "e__x-evil:_1", "f_g"} and picked in cands


@pytest.mark.envoy
async def test_header_in_full_duplex_body_mode(make_stack: Any) -> None:
    """The header reply carries the route (and the decision) in FULL_DUPLEX_STREAMED mode too; at the
    default detail, the summary: the cluster, the profile and the candidate count, no scores."""
    cfg = service_config(explain={"header": "always"})
    stack: Stack = make_stack(service=cfg, envoy_edit=body_mode_edit("FULL_DUPLEX_STREAMED"))
    served, headers = await post(stack, {})
    assert headers[DECISION_HEADER] == f"{served}; profile=default; candidates=2"
