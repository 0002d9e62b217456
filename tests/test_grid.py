"""The robustness grid: definitions, calibration pieces, targets, and the smoke grid end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from extproc_lab.bench import grid_live, scenarios
from extproc_lab.bench.grid import (
    DIMENSIONS,
    GRIDS,
    LIVE_CELLS,
    OURS,
    REFERENCES,
    Cell,
    cell_profiles,
    evaluate,
    geomean,
    grid,
    kv_variant,
)
from extproc_lab.bench.report import RequestRecord
from extproc_lab.discrete_event.grid import calibrate, run_des_grid, saturated_capacity
from extproc_lab.discrete_event.simulation import POLICIES
from extproc_lab.engines.profiles import A10G_LLAMA3_8B, H100_LLAMA3_8B


@pytest.mark.parametrize("name", ["default", "full"])
def test_grids_cover_every_dimension_value(name: str) -> None:
    cells = GRIDS[name]
    for dim, values in DIMENSIONS.items():
        if dim in ("tenants", "zipf", "prompt_tokens"):
            seen = {getattr(c, dim) for c in cells if c.workload == "tenants"}
        elif dim == "conversations":
            seen = {c.conversations for c in cells if c.workload == "chat"}
        else:
            seen = {getattr(c, dim) for c in cells}
        assert set(values) <= seen, (name, dim, seen)
    assert len({c.name for c in cells}) == len(cells)


def test_report_grid_is_off_the_grids_the_defaults_were_chosen_on() -> None:
    cells = GRIDS["report"]
    assert len(cells) == 6 and len({c.name for c in cells}) == 6
    assert {c.workload for c in cells} == {"tenants", "chat"}
    fields = ("engines", "fleet", "kv_prefixes", "tenants", "zipf", "prompt_tokens", "conversations", "load")
    seen = {tuple(getattr(c, f) for f in fields) for c in GRIDS["default"]}
    for cell in cells:
        assert cell.engines == 6 and cell.kv_prefixes in (3, 5)
        assert tuple(getattr(cell, f) for f in fields) not in seen


def test_default_grid_is_one_factor_at_a_time_plus_corners() -> None:
    cells = GRIDS["default"]
    assert 24 <= len(cells) <= 40
    base = {"tenants": grid("default", ["t-base"])[0], "chat": grid("default", ["c-base"])[0]}
    fields = ("engines", "fleet", "kv_prefixes", "tenants", "zipf", "prompt_tokens", "conversations", "load")
    differing = [sum(getattr(c, f) != getattr(base[c.workload], f) for f in fields) for c in cells]
    assert differing.count(0) == 2  # the two base cells
    assert differing.count(1) >= 20  # one factor at a time
    assert any(d >= 3 for d in differing)  # corners
    for name, cell_names in LIVE_CELLS.items():
        assert grid(name if name in GRIDS else "default", list(cell_names))


def test_unknown_grid_and_cells_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown grid"):
        grid("huge")
    with pytest.raises(ValueError, match="not in grid"):
        grid("smoke", ["nope"])


def test_kv_variant_and_cell_profiles() -> None:
    v = kv_variant(A10G_LLAMA3_8B, 100)
    assert v.num_gpu_blocks == 100 and v.max_model_len == 1600  # capped by the cache
    big = kv_variant(A10G_LLAMA3_8B, 10_000)
    assert big.max_model_len == 32_768 and big.prefill_s_per_token == A10G_LLAMA3_8B.prefill_s_per_token
    cell = Cell("x", engines=4, fleet="mixed", kv_prefixes=4)
    profiles = cell_profiles(cell, prefix=1000, longest_request=500)
    assert [p.prefill_s_per_token for p in profiles] == [
        H100_LLAMA3_8B.prefill_s_per_token,
        A10G_LLAMA3_8B.prefill_s_per_token,
    ] * 2
    assert {p.num_gpu_blocks for p in profiles} == {math.ceil(4 * 1000 / 16)}
    # Never smaller than one request needs.
    assert cell_profiles(cell, prefix=10, longest_request=5000)[0].num_gpu_blocks >= 5000 / 16


def test_saturated_capacity_is_n_times_the_slowest_engine() -> None:
    def rec(engine: str, done_at: float) -> RequestRecord:
        return RequestRecord("t", engine, 200, None, 0.0, 0.1, done_at)

    fast = [rec("engine-0", t * 0.5) for t in range(1, 21)]  # 2 per second
    slow = [rec("engine-1", t * 1.0) for t in range(1, 21)]  # 1 per second
    assert saturated_capacity(fast + slow, 2) == pytest.approx(2.0)


def _row(p50: float, p90: float, p99: float, toks: float = 100.0, errors: int = 0) -> dict[str, object]:
    return {
        "ttft_p50_ms": p50,
        "ttft_p90_ms": p90,
        "ttft_p99_ms": p99,
        "ttft_geomean_ms": geomean(p50, p90, p99),
        "output_tokens_per_s": toks,
        "errors": errors,
    }


def test_targets_pass_miss_and_not_applicable() -> None:
    rows = {
        OURS: _row(100, 200, 400, toks=110),
        "round-robin": _row(900, 3000, 6000, toks=100),
        "least-request": _row(800, 2500, 5000),
        "sglang-cache-aware": _row(400, 900, 2000),
        "exact-ttft": _row(100, 150, 300),
    }
    ratios, targets = evaluate(rows, rr_unloaded_p90_ms=800.0, cold_prefill_ms=300.0)
    assert ratios["rr_loaded"] and ratios["best_reference"] == "sglang-cache-aware"
    assert not ratios["refs_on_floor"]  # 400 ms > 1.2 x 300 ms
    assert ratios["geomean_bound"] == 0.8
    assert targets == {"p90": "PASS", "geomean": "PASS", "tok/s": "PASS", "errors": "PASS"}
    assert ratios["geomean_vs_exact"] > 1

    rows[OURS] = _row(390, 1000, 2100, toks=101, errors=2)
    ratios, targets = evaluate(rows, rr_unloaded_p90_ms=800.0, cold_prefill_ms=400.0)
    assert ratios["refs_on_floor"] and ratios["geomean_bound"] == 1.05  # 400 <= 1.2 x 400
    assert targets == {"p90": "MISS", "geomean": "PASS", "tok/s": "MISS", "errors": "MISS"}

    # Round robin not loaded (p90 < 3x unloaded): only the errors target applies.
    _, targets = evaluate(rows, rr_unloaded_p90_ms=1500.0, cold_prefill_ms=400.0)
    assert targets == {"p90": "n/a", "geomean": "n/a", "tok/s": "n/a", "errors": "MISS"}


def test_calibration_is_a_property_of_the_cell_not_of_the_count() -> None:
    cell = Cell("c", engines=2, tenants=8, count=120)
    full, small = calibrate(cell), calibrate(cell, count_scale=0.25)
    assert full.capacity_rps == small.capacity_rps > 0
    assert len(small.requests) == 30 and len(full.requests) == 120
    assert [b for _, b, _ in small.requests] == [b for _, b, _ in full.requests[:30]]
    assert full.rate == pytest.approx(0.8 * full.capacity_rps)
    assert full.cold_prefill_ms > 0 and full.rr_unloaded_p90_ms and full.rr_unloaded_p90_ms > 0


def test_smoke_grid_end_to_end(tmp_path: Path) -> None:
    results = run_des_grid("smoke", count_scale=0.08, out_dir=tmp_path, progress=None)
    doc = json.loads((tmp_path / "grid-smoke.json").read_text())
    table = (tmp_path / "grid-smoke.md").read_text()
    assert [c["cell"]["name"] for c in doc["cells"]] == [c.name for c in GRIDS["smoke"]]
    for cell, result in zip(doc["cells"], results, strict=True):
        assert list(cell["policies"]) == list(POLICIES)  # every policy in every cell
        for row in cell["policies"].values():
            assert row["requests"] == result.cell.requests(0.08)
            assert row["errors"] == 0
            for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_geomean_ms"):
                assert row[key] > 0
            assert row["output_tokens_per_s"] > 0 and row["prefix_cache_hit_rate"] is not None
        assert set(cell["targets"]) == {"p90", "geomean", "tok/s", "errors"}
        assert set(cell["targets"].values()) <= {"PASS", "MISS", "n/a"}
        assert cell["ratios"]["best_reference"] in REFERENCES
        assert cell["capacity_rps"] > 0 and cell["rate_rps"] == pytest.approx(
            cell["cell"]["load"] * cell["capacity_rps"]
        )
        assert f"| {cell['cell']['name']} |" in table
    assert "## Misses" in table


def test_cli_grid(tmp_path: Path) -> None:
    from extproc.cli import main

    rc = main(
        ["simulate", "--grid", "smoke", "--cells", "t-base", "--count-scale", "0.05", "--out", str(tmp_path)]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "grid-smoke.json").read_text())
    assert [c["cell"]["name"] for c in doc["cells"]] == ["t-base"]
    assert doc["meta"]["policies"] == list(POLICIES)


async def test_live_grid_reports_a_missing_peer_as_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(scenarios.PEER_ROUTERS, "vllm-router-cache-aware", ("vllm-router", lambda: None))
    results = await grid_live.run_live_grid(
        "smoke",
        calibrate=lambda cell: calibrate(cell, count_scale=0.02),
        policies=["vllm-router-cache-aware"],
        cells=["t-base"],
        out_dir=tmp_path,
        progress=None,
    )
    assert results[0].skipped == {
        "vllm-router-cache-aware": "vllm-router not installed (pip install vllm-router)"
    }
    assert results[0].policies == {}
    doc = json.loads((tmp_path / "grid-live-smoke.json").read_text())
    assert doc["cells"][0]["skipped"]["vllm-router-cache-aware"].startswith("vllm-router not installed")
    assert "skipped: vllm-router not installed" in (tmp_path / "grid-live-smoke.md").read_text()


@pytest.mark.envoy
async def test_live_grid_cell_runs_through_envoy(tmp_path: Path) -> None:
    results = await grid_live.run_live_grid(
        "smoke",
        calibrate=lambda cell: calibrate(cell, count_scale=0.03),
        policies=["llm-extproc", "envoy-round-robin"],
        cells=["t-base"],
        time_scale=20.0,
        out_dir=tmp_path,
        progress=None,
    )
    rows = results[0].policies
    assert set(rows) == {OURS, "round-robin"}
    for row in rows.values():
        assert row["requests"] == 24 and row["errors"] == 0 and row["ttft_p50_ms"] > 0


# -- the pressure grid (issue 30) ----------------------------------------------------------------------


def test_engines_that_count_differently_keep_prefixes_and_their_own_scale() -> None:
    import random

    from extproc_lab.bench.workloads import pseudo_text
    from extproc_lab.engines.tokens import Recount, chat_to_tokens

    words = pseudo_text(random.Random(3), 2000)  # a workload's text: many distinct pieces
    system = {"role": "system", "content": words}
    turn = [system, {"role": "user", "content": "first question about it"}]
    base = chat_to_tokens(turn, add_generation_prompt=False)
    longer = chat_to_tokens([*turn, {"role": "user", "content": "more"}], add_generation_prompt=False)
    assert longer[: len(base)] == base
    for scale in (0.5, 1 / 1.75, 2.0, 3.0):
        recount = Recount(scale)
        a = recount(base)
        assert recount(list(base)) == a  # the same text, the same ids
        assert recount(longer)[: len(a)] == a  # a continuation keeps its prefix: caches still match
        pieces = [t for t in base if t < 50_000]
        assert len(recount(pieces)) == pytest.approx(scale * len(pieces), rel=0.1)
    with pytest.raises(ValueError):
        Recount(0.0)


def test_pressure_grid_varies_what_the_service_does_not_control() -> None:
    cells = GRIDS["pressure"]
    assert len({c.name for c in cells}) == len(cells)
    ratios = {r for c in cells for r in c.token_ratio}
    assert {0.5, 1.0, 1.75, 3.0} <= ratios
    assert any(len(c.token_ratio) > 1 for c in cells)  # engines of one pool that count differently
    assert any(not c.prefill_counters for c in cells)
    assert {0.3, 3.0} <= {c.prefill_rate_error for c in cells}
    assert {"wrong", "missing"} <= {c.gpu_names for c in cells}
    assert {0.5, 2.0} <= {c.step_cost for c in cells}
    # 8+ engines holding ~3 hot prefixes each, tenants several times what the fleet holds
    tight = [c for c in cells if c.engines >= 8 and c.kv_prefixes <= 3 and c.workload == "tenants"]
    assert tight and all(c.tenants >= 2 * c.engines * c.kv_prefixes for c in tight)
    assert max(c.load for c in cells) > 1.0  # past round robin's capacity


def test_stability_targets() -> None:
    def rows(ours: tuple[float, float, float], tok: float = 100.0) -> dict[str, dict[str, float]]:
        def row(p50: float, p90: float, p99: float, t: float) -> dict[str, float]:
            return {
                "ttft_p50_ms": p50,
                "ttft_p90_ms": p90,
                "ttft_p99_ms": p99,
                "ttft_geomean_ms": geomean(p50, p90, p99),
                "output_tokens_per_s": t,
                "errors": 0,
            }

        return {
            OURS: row(*ours, tok),
            "round-robin": row(5000, 9000, 12000, 90.0),
            "least-request": row(4000, 8000, 11000, 90.0),
            "sglang-cache-aware": row(100, 800, 2000, 99.0),
        }

    _, good = evaluate(rows((80, 500, 1500)), rr_unloaded_p90_ms=500, cold_prefill_ms=50, stability=True)
    assert good == {
        "p90/LR": "PASS",
        "tok/s/RR": "PASS",
        "geomean": "PASS",
        "worst": "PASS",
        "errors": "PASS",
    }
    ratios, bad = evaluate(
        rows((200, 9000, 20000), tok=80.0), rr_unloaded_p90_ms=500, cold_prefill_ms=50, stability=True
    )
    assert bad == {"p90/LR": "MISS", "tok/s/RR": "MISS", "geomean": "MISS", "worst": "MISS", "errors": "PASS"}
    assert ratios["p90_vs_lr"] == pytest.approx(9000 / 8000)
    # 0.85x < geomean <= 1.2x: within the bound every cell must meet, short of the one off the floor
    _, near = evaluate(rows((110, 900, 2100)), rr_unloaded_p90_ms=500, cold_prefill_ms=50, stability=True)
    assert near["geomean"] == "MISS" and near["worst"] == "PASS"
    # our policy alone (`--policies llm-extproc`): nothing to compare with, nothing missed
    alone = {OURS: rows((80, 500, 1500))[OURS]}
    _, none = evaluate(alone, rr_unloaded_p90_ms=500, cold_prefill_ms=50, stability=True)
    assert none == {"p90/LR": "n/a", "tok/s/RR": "n/a", "geomean": "n/a", "worst": "n/a", "errors": "PASS"}


def test_the_service_learns_the_engines_count_in_the_discrete_event_mode() -> None:
    """Engines counting 1/1.75 of the service's bytes/4 estimate (words of 3-9 letters): the scorer's
    ratio, read off the same /metrics series the service exports, converges to the engines' count
    over the service's, from the publisher's counters alone."""
    from extproc_lab.discrete_event.grid import engine_recount, service_estimate_ratio
    from extproc_lab.discrete_event.simulation import simulate, tokenize_requests

    cell = Cell("x", engines=4, tenants=8, kv_prefixes=4, token_ratio=(1.75,), output_tokens=(20, 40))
    cal = calibrate(cell, count_scale=0.5)
    estimate = service_estimate_ratio(cal.requests, tokenize_requests(cal.requests))
    recount = engine_recount(cell, estimate)
    assert recount is not None
    run = simulate(cal.requests, cal.profiles, OURS, tokens=cal.tokens, recount=recount)
    assert run.metrics is not None
    ratios = [
        run.metrics.registry.get_sample_value(
            "llm_extproc_calibration_token_ratio", {"profile": "default", "upstream": f"engine-{i}"}
        )
        for i in range(4)
    ]
    assert all(r == pytest.approx(1 / 1.75, rel=0.1) for r in ratios), ratios
