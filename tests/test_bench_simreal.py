"""The sim-to-real bench's analysis of a real run (:mod:`bench.simreal`), on a hand-made
event log: step rates, detection, transition costs, joins, the planner's decisions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import simreal as B


def step(ts: float, n: int, epoch: int, workers: int) -> dict[str, Any]:
    return {"event": "step_end", "ts": ts, "step": n, "epoch": epoch, "workers": workers}


def log() -> list[dict[str, Any]]:
    """A task of 3 workers stepping every 0.5 s; node 4 killed at t=10.2, detected at 10.7;
    epoch 2 (2 workers, a step every 1 s) begins then, its first step at 11.9; a plan grows
    it back at 15.0 and the 3-worker epoch 3 begins at 17.0, its first step at 17.8."""
    ev = [{"event": "epoch_begin", "ts": 0.0, "epoch": 1, "members": [0, 1, 2]}]
    ev += [step(0.5 * i, i, 1, 3) for i in range(1, 21)]  # to t=10.0
    ev += [
        {"event": "error_detected", "ts": 10.7, "node": 4, "kind": "heartbeat_lost"},
        {
            "event": "epoch_begin",
            "ts": 10.7,
            "epoch": 2,
            "members": [0, 1],
            "reason": "node 4 lost",
        },
    ]
    ev += [step(11.9 + i, 21 + i, 2, 2) for i in range(5)]  # 11.9 .. 15.9
    ev += [
        {"event": "plan", "ts": 15.0, "trigger": "node n4 back", "decision_ms": 0.8,
         "allocation": {"t": 3}, "allocation_before": {"t": 2}},
        {"event": "action", "ts": 15.1, "action": "reconfigure", "slot": 3, "node": 5,
         "reason": "slot 3 added: planner"},
        {"event": "epoch_begin", "ts": 17.0, "epoch": 3, "members": [0, 1, 3]},
        {"event": "action", "ts": 18.0, "action": "readmit", "slot": 2, "node": 4,
         "reason": "node 4 is back"},
        {"event": "action", "ts": 18.5, "action": "reconfigure", "slot": 2, "node": 4,
         "reason": "slot 2 released: planner"},
    ]  # fmt: skip
    ev += [step(17.8 + 0.5 * i, 26 + i, 3, 3) for i in range(5)]  # 17.8 .. 19.8
    return ev


KILLS = [(4, 10.2)]


def test_step_rates_come_from_commits_of_one_epoch() -> None:
    rates = B.step_rates(log(), until=30.0)
    assert rates == pytest.approx({3: 2.0, 2: 1.0})


def test_detection_is_the_kill_to_the_epoch_without_the_node() -> None:
    assert B.detections(log(), KILLS, 0.0, 30.0) == pytest.approx([0.5])  # to its new epoch
    assert B.detections(log(), [(4, 40.0)], 0.0, 30.0) == []  # outside the window


def test_a_transition_costs_the_gap_less_one_step_and_the_detection() -> None:
    count, costs = B.transitions(log(), {3: 2.0, 2: 1.0}, KILLS, 0.0, 30.0)
    assert count == 2  # epochs 2 and 3 began in the window
    # 10.0 -> 11.9 less a 1-s step less 0.5 s detection; 15.9 -> 17.8 less a 0.5-s step
    assert costs == pytest.approx([0.4, 1.4])


def test_a_new_slot_joins_at_the_first_epoch_that_has_it() -> None:
    # slot 3 on node 5 (new to the task): cold, 15.1 -> 17.0; slot 2 released before joining
    assert B.joins(log(), [0, 1, 4], KILLS, 30.0) == ([], [pytest.approx(1.9)])
    # had the task run on node 5 already (and no kill there since), the join is warm
    assert B.joins(log(), [5], KILLS, 30.0) == ([pytest.approx(1.9)], [])
    assert B.joins(log(), [5], [(5, 12.0)], 30.0) == ([], [pytest.approx(1.9)])  # node restarted


def test_task_figures_book_the_window_as_the_simulator_does() -> None:
    f = B.task_figures(
        log(), weight=2.0, ref_rate=4.0, kills=KILLS, t0=0.0, t1=20.0, rates={3: 2.0, 2: 1.0}
    )
    assert f["steps"] == 30 and f["accumulated_waf"] == 60.0
    b = f["breakdown_s"]
    assert b["detection"] == pytest.approx(0.5) and b["transition"] == pytest.approx(1.8)
    assert sum(b.values()) + 60.0 / 4.0 == pytest.approx(20.0)  # the simulator's identity


def test_decisions_report_latency_and_transitions_per_hour() -> None:
    d = B.decisions({"t": log()}, 0.0, 20.0)
    assert d["decisions"] == 1 and d["decision_ms_p50"] == d["decision_ms_max"] == 0.8
    assert d["transitions_per_hour"] == pytest.approx(2 * 3600 / 20.0)


def test_rows_hold_every_figure_of_the_comparison_a_docs_grid_shows(tmp_path: Path) -> None:
    """Per task and for the cluster, both sides' WAF, losses and transitions, and the
    measured constants: the docs' sim-to-real table is a ``+grid`` of them, never typed."""
    from bench.common import save_scenario
    from bench.docs import table

    side = {"accumulated_waf": 10.0, "transitions": 2,
            "breakdown_s": {"detection": 0.5, "transition": 1.0, "sub_healthy": 3.0}}  # fmt: skip
    cmp = {
        "tasks": {
            "light": {"real": side, "sim": {**side, "accumulated_waf": 11.0}, "waf_diff": 0.1}
        },
        "cluster": {"real": 10.0, "sim": 11.0},
        "constants": {
            "node_detect_s": 0.6,
            "transition_s": 0.4,
            "join_s": 0.3,
            "join_cold_s": None,
            "rates_steps_per_s": {"light": {"2": 1.5}},
        },
    }
    dec = {"decision_ms_p50": None, "transitions_per_hour": 100.0}
    rows = B.rows(cmp, {"planner": 10.0}, dec)
    metrics = {(r["system"], r["metric"]): r["median"] for r in rows}
    assert metrics[("unicron-sim", "accumulated_waf[light]")] == 11.0
    assert metrics[("unicron-real", "subhealthy_s[light]")] == 3.0
    assert metrics[("unicron-sim", "sim_over_real[cluster]")] == pytest.approx(1.1)
    assert metrics[("measured", "steps_per_s[light/2]")] == 1.5
    assert ("measured", "join_cold_s") not in metrics  # never measured: no row, no zero
    save_scenario(rows, "simreal", tmp_path, replace=True)
    grid = table("simreal accumulated_waf detection_s transitions +grid", tmp_path)
    assert "| unicron-real | `accumulated_waf` | 10 " in grid and "| cluster |" in grid
