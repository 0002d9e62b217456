"""Discrete-event mode: the service's own routing code against many simulated engines, no sockets."""

from __future__ import annotations

import pytest

from extproc_lab.bench.report import summarize
from extproc_lab.bench.workloads import make_workload
from extproc_lab.discrete_event.simulation import POLICIES, simulate
from extproc_lab.engines.profiles import PROFILES

A10G = PROFILES["a10g-llama3-8b"]


def requests(name: str, count: int = 150, rate: float = 6.0, **kw: object) -> list:
    wl = make_workload(name, rate=rate, count=count, seed=3, **kw)
    return [(r.arrival_s, r.body, r.tag) for r in wl.requests]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_is_accounted_for(policy: str) -> None:
    reqs = requests("multi-turn", count=80)
    run = simulate(reqs, [A10G] * 3, policy)
    assert len(run.records) == 80
    assert all(r.ok for r in run.records)
    assert {r.served_by for r in run.records} <= {f"engine-{i}" for i in range(3)}
    assert all(r.ttft_s is not None and r.e2e_s >= r.ttft_s > 0 for r in run.records)


def test_deterministic() -> None:
    reqs = requests("shared-prefix", count=60, tenants=8)
    a = simulate(reqs, [A10G] * 2, "llm-extproc")
    b = simulate(reqs, [A10G] * 2, "llm-extproc")
    assert [(r.served_by, r.ttft_s, r.e2e_s) for r in a.records] == [
        (r.served_by, r.ttft_s, r.e2e_s) for r in b.records
    ]


def test_llm_extproc_policy_uses_live_snapshots_not_the_fallback() -> None:
    from extproc_lab.discrete_event import simulation as des

    reqs = requests("shared-prefix", count=40, tenants=4)
    fleet = des.Fleet([des.EngineModel(A10G) for _ in range(2)])
    policy = des.ExtprocPolicy(fleet, "sim-llama", None, clock=lambda: 0.0)
    policy.publish(0.0, ttl_s=3.0)
    assert policy.view.candidates("sim-llama") is not None and len(policy.view.candidates("sim-llama")) == 2
    run = simulate(reqs, [A10G] * 2, "llm-extproc")
    assert len(run.records) == 40


def test_cache_affinity_beats_scattering_under_kv_pressure() -> None:
    # 48 tenants x 2000-token system prompts = 96k tokens of prefixes; 2 A10Gs hold 2 x 34k tokens.
    reqs = requests("shared-prefix", count=240, rate=4.0, tenants=48)
    hit = {}
    for policy in ("round-robin", "clairvoyant-affinity"):
        run = simulate(reqs, [A10G] * 2, policy)
        hit[policy] = summarize(policy, run.records, run.virtual_s).prefix_cache_hit_rate
    assert hit["clairvoyant-affinity"] > hit["round-robin"] + 0.1, hit


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate([], [A10G], "nope")


def test_kv_events_feed_every_replicas_precise_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `kv_events`, the engines' events reach each replica's KvIndex through the publisher's
    translation and wire format, and predicted-ttft reads complete sets from it."""
    from extproc.fleet.kv_index import KvIndex

    answers: list[tuple[int, bool]] = []
    original = KvIndex.blocks

    def spy(self: KvIndex, upstream_id: str):  # type: ignore[no-untyped-def]
        held = original(self, upstream_id)
        answers.append((id(self), held is not None and held.complete and bool(held.blocks)))
        return held

    monkeypatch.setattr(KvIndex, "blocks", spy)
    reqs = requests("shared-prefix", count=60, tenants=4)
    run = simulate(reqs, [A10G] * 2, "llm-extproc", kv_events=True, replicas=2)
    assert len(run.records) == 60 and all(r.ok for r in run.records)
    indexes = {i for i, _ in answers}
    assert len(indexes) == 2  # one index per replica, both asked
    assert sum(ok for _, ok in answers) > len(answers) / 2, "the sets were rarely usable"

    answers.clear()
    simulate(reqs, [A10G] * 2, "llm-extproc")
    assert answers == []  # without events no index is fed or read


def test_a_mixed_fleet_starts_out_by_the_gpus_nominal_speeds() -> None:
    """Before any prefill rate is measured, the snapshots' GPU names (gpu_model) send most cold
    prompts to the H100 (~14x an A10G); without the prior the first ones split evenly."""
    reqs = requests("shared-prefix", count=12, rate=6.0, tenants=12)  # 12 cold prefixes in 2 s
    fleet = [PROFILES["h100-llama3-8b"], A10G]

    def h100_share(params: dict[str, object], first: int) -> float:
        profile = {"scorers": [{"name": "predicted-ttft", "params": params}], "picker": "max-score"}
        service = {"scheduling": {"profiles": {"default": profile}}}
        run = simulate(reqs, fleet, "llm-extproc", service=service)
        records = sorted(run.records, key=lambda r: r.arrival_s)[:first]
        return sum(r.served_by == "engine-0" for r in records) / len(records)

    assert h100_share({}, first=12) >= 0.8
    assert h100_share({"gpu_prior": False}, first=5) <= 0.6  # before the first rates are measured
