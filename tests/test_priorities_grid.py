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


def _row(goodput: float, p99: float, shed: tuple[int, int, int] = (0, 0, 0)) -> dict[str, object]:
    classes = {
        name: {"ttft_p99_ms": p99, "ttft_p99_steady_ms": p99, "shed": n, "served_over_shed_standard": 0}
        for name, n in zip(("critical", "standard", "sheddable"), shed, strict=True)
    }
    return {"goodput_rps": goodput, "classes": classes}


def test_the_checks_read_every_load_from_capacity_on_and_whether_goodput_holds_past_it() -> None:
    """`checks`: the 120 % figures as before, each load from 100 % on (`by_load`), and the goodput at
    150 % and more against the row's best up to that load: 9.0 after a 10.0 peak holds, 8.9 does
    not, and a goodput that rises with the load holds."""
    from extproc_lab.bench.priorities import checks

    def runs(at_2x: float) -> dict[str, dict[str, object]]:
        figures = {0.5: (5.0, 200.0), 1.0: (9.0, 250.0), 1.2: (10.0, 280.0), 2.0: (at_2x, 900.0)}
        peer = _row(4.0, 999.0)
        return {
            f"{load:g}": {"policies": {"llm-extproc": _row(g, p99, (0, 3, 5)), "round-robin": peer}}
            for load, (g, p99) in figures.items()
        }

    ch = checks(runs(9.0), (0.5, 1.0, 1.2, 2.0), ("round-robin",))
    assert ch["critical_ttft_p99_ratio"] == pytest.approx(1.4) and ch["critical_ttft_ok"]  # at 120 %
    assert list(ch["by_load"]) == ["1", "1.2", "2"]
    assert ch["by_load"]["2"]["critical_ttft_p99_ratio"] == pytest.approx(4.5)
    assert not ch["by_load"]["2"]["critical_ttft_ok"] and ch["by_load"]["1"]["critical_ttft_ok"]
    assert ch["by_load"]["2"]["goodput_ok_peers"] and ch["by_load"]["2"]["sheddable_shed_first"]
    hold = ch["goodput_hold"]
    assert hold["peak_goodput_rps"] == 10.0 and hold["held"] == {"2": pytest.approx(0.9)} and hold["holds"]
    assert not checks(runs(8.9), (0.5, 1.0, 1.2, 2.0), ("round-robin",))["goodput_hold"]["holds"]
    rising = checks(runs(12.0), (0.5, 1.0, 1.2, 2.0), ("round-robin",))["goodput_hold"]
    assert rising["holds"] and rising["held"] == {"2": 1.0} and rising["peak_goodput_rps"] == 12.0
    no_deep = checks(runs(9.0), (0.5, 1.2), ("round-robin",))["goodput_hold"]
    assert no_deep["held"] == {} and not no_deep["holds"]  # nothing past 150 %: not shown to hold


def test_goodput_holds_from_150_percent_to_twice_the_peaks_load_in_both_benches() -> None:
    """One definition for the priorities and the class benches: every load from 150 % up to the first
    at or past 2x the load where goodput peaks, over the best before it (issue 33 asks 1.5x and 2x
    the peak's load). A collapse past that window is not asked; one inside it fails."""
    from extproc_lab.bench.classes import class_checks
    from extproc_lab.bench.priorities import goodput_hold

    peak_at_100 = goodput_hold({0.5: 5.0, 1.0: 10.0, 1.6: 9.5, 2.0: 9.1, 3.0: 4.0})
    assert peak_at_100["peak_load"] == 1.0 and peak_at_100["holds"]
    assert peak_at_100["held"] == {"1.6": pytest.approx(0.95), "2": pytest.approx(0.91)}  # 300 % not asked
    peak_at_160 = goodput_hold({0.5: 5.0, 1.0: 8.0, 1.6: 10.0, 2.0: 9.5, 3.0: 8.5})
    assert list(peak_at_160["held"]) == ["1.6", "2", "3"] and not peak_at_160["holds"]  # 3.0 < 2x 1.6
    assert goodput_hold({0.5: 5.0})["held"] == {} and not goodput_hold({0.5: 5.0})["holds"]
    loads = {
        f"{x:g}": {"policies": {"llm-extproc": _row(g, 100.0, (0, 3, 5))}}
        for x, g in {0.5: 5.0, 1.0: 8.0, 1.6: 10.0, 2.0: 9.5, 3.0: 8.5}.items()
    }
    assert class_checks(loads, "llm-extproc")["goodput_hold"] == peak_at_160
