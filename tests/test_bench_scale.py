"""The scale benchmark's figures and turn order (no runs: bench/scale.py runs them)."""

from __future__ import annotations

import pytest

from bench.scale import figures, paired, turns


def test_figures_are_medians_after_the_warmup() -> None:
    # step s ends at ts 10 * s^2 (periods 10, 30, 50, 70), lasting s seconds; step 2 is
    # reported twice (two members): the first report counts
    events = [
        {"event": "step_end", "step": s, "ts": 10.0 * s * s, "duration_s": float(s)}
        for s in range(5)
    ]
    events.insert(3, {"event": "step_end", "step": 2, "ts": 41.0, "duration_s": 99.0})
    events.append({"event": "task_end", "ts": 200.0})
    assert figures(events, warmup=2) == (3.0, 50.0)  # steps 2, 3, 4: periods 30, 50, 70
    assert figures(events, warmup=1) == (2.5, 40.0)
    with pytest.raises(ValueError, match="missing"):
        figures([e for e in events if e.get("step") != 3], warmup=2)


def test_each_repetition_starts_one_arm_further_on() -> None:
    arms = ("a", "b", "c")
    assert [turns(arms, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_paired_ratios_are_taken_repetition_by_repetition() -> None:
    # the machine's pace moves between repetitions; within each, the arm is 1.1x DDP
    arm, ddp = [110.0, 440.0, 220.0, 165.0], [100.0, 400.0, 200.0, 150.0]
    assert [round(r, 9) for r in paired(arm, ddp)] == [1.1] * 4
    # ... and inside them: repetition k's arm over repetition k's DDP, never another's
    arm, ddp = [110.0, 220.0, 330.0], [100.0, 300.0, 150.0]
    assert [round(r, 3) for r in paired(arm, ddp)] == [1.1, 0.733, 2.2]
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])
