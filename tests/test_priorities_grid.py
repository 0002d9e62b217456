"""The priorities bench across cells (extproc_lab.discrete_event.priorities_grid), on a tiny cell."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc_lab.bench.grid import Cell
from extproc_lab.discrete_event import priorities_grid as pg


def test_a_cell_runs_every_row_at_every_load_against_the_best_routers_capacity() -> None:
    cell = Cell("tiny", engines=2, tenants=6, kv_prefixes=4, prompt_tokens=1000, count=120)
    cs = pg.setup(cell, count_scale=1.0)
    assert cs.count == 120 and len(cs.profiles) == 2
    assert cs.slo.ttft_s >= 1.0 and cs.slo.ttft_s >= 2 * cs.cold_prefill_s - 1e-9
    lines: list[str] = []
    result = pg.run_cell(cs, loads=(0.5, 1.2), log=lines.append)
    assert set(result["capacities"]) == set(pg.CAPACITY_POLICIES)
    assert result["capacity_rps"] == max(result["capacities"].values()) > 0
    for load, run in result["loads"].items():
        assert run["rate_rps"] == pytest.approx(result["capacity_rps"] * float(load))
        assert set(run["policies"]) == {
            pg.OURS,
            pg.TPOT_GATE_ROW,
            pg.ENGINE_PRIORITY_ROW,
            pg.NO_ADMISSION,
            *pg.REFERENCES,
        }
        for row in run["policies"].values():
            classes = row["classes"]
            # every request is accounted for: served, shed with a 429, or failed otherwise
            assert sum(c["requests"] for c in classes.values()) == 120
            assert all(c["ok"] + c["shed"] + c["other_errors"] == c["requests"] for c in classes.values())
            assert row["errors"] == 0
        # only llm-extproc with admission sheds
        for name, row in run["policies"].items():
            if name not in (pg.OURS, pg.TPOT_GATE_ROW, pg.ENGINE_PRIORITY_ROW):
                assert all(c["shed"] == 0 for c in row["classes"].values())
    ch = result["checks"]
    assert ch["no_critical_shed"] and ch["critical_shed"] == 0
    gated = result["checks_tpot_gate"]
    assert gated["no_critical_shed"] and gated["goodput_rps"] == pytest.approx(
        result["loads"]["1.2"]["policies"][pg.TPOT_GATE_ROW]["goodput_rps"]
    )
    assert ch["best_peer"] in pg.REFERENCES
    assert lines[0].startswith("tiny: capacity") and "at 120 %" in lines[1]
    text = pg.markdown([result], {"seed": 0, "admission": result["admission"]})
    assert text.count("| tiny (") == 3 and "### 120% load" in text  # a summary line per llm-extproc row
    assert f"## {pg.TPOT_GATE_ROW}" in text
    prio = result["checks_engine_priority"]
    assert prio["no_critical_shed"] and prio["goodput_rps"] == pytest.approx(
        result["loads"]["1.2"]["policies"][pg.ENGINE_PRIORITY_ROW]["goodput_rps"]
    )
    assert f"## {pg.ENGINE_PRIORITY_ROW}" in text
    assert text.count(f"| {pg.NO_ADMISSION} |") == 2  # one row per load


def test_unknown_cells_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-cell"):
        pg.run_grid(["no-such-cell"], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_default_cells_exist_in_the_routing_grids() -> None:
    for name in pg.CELLS:
        assert name in pg._KNOWN
