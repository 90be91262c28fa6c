"""The event-log parser that measures every benchmarked system (bench/events.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.events import measure, read_events, steps_redone

FIXTURE = Path(__file__).parent / "fixtures" / "bench_events.jsonl"


def test_fixture_figures() -> None:
    events = read_events(FIXTURE)  # the torn last line is skipped
    assert len(events) == 13
    outcome = measure(events)
    assert outcome.faults == 1
    assert outcome.detection_s == [pytest.approx(0.2)]
    # the first step_end after the fault with step >= 5, not the redone steps 3 and 4
    assert outcome.recovery_s == [pytest.approx(5.75)]
    assert outcome.steps_redone == 2
    assert outcome.steps_finished == 6
    assert outcome.step_time_s == pytest.approx(0.15)  # steps 3 and 4, before the fault
    metrics = outcome.metrics()
    assert metrics["steps_redone"] == 2 and "false_alarms" not in metrics


def test_fault_free_counts_false_alarms() -> None:
    events = [
        {"ts": 1.0, "event": "step_end", "rank": 0, "step": 0, "duration_s": 0.1},
        {"ts": 1.5, "event": "error_detected", "kind": "hang", "method": "monitor"},
        {"ts": 2.0, "event": "step_end", "rank": 0, "step": 1, "duration_s": 0.1},
    ]
    outcome = measure(events, warmup_steps=0)
    assert outcome.false_alarms == 1
    assert outcome.metrics()["false_alarms"] == 1
    assert "detection_s" not in outcome.metrics()


def test_per_rank_reports_are_not_redone_steps() -> None:
    # torchft and Unicron may log each step once per rank: that is not a redo
    events = [
        {"ts": float(i), "event": "step_end", "rank": r, "step": s}
        for i, (r, s) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1), (0, 1)])
    ]
    assert steps_redone(events) == 1


def test_undetected_and_unrecovered_fault() -> None:
    events = [
        {"ts": 1.0, "event": "step_end", "rank": 0, "step": 0, "duration_s": 0.1},
        {"ts": 2.0, "event": "fault_injected", "fault": "hang", "rank": 1, "step": 1},
    ]
    outcome = measure(events)
    assert outcome.undetected == 1 and outcome.unrecovered == 1
    assert "recovery_s" not in outcome.metrics()


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert read_events(tmp_path / "absent.jsonl") == []


def test_detection_by_method_takes_the_first_of_that_method() -> None:
    from bench.events import detection_by_method

    events = [
        {"ts": 10.0, "event": "fault_injected", "fault": "node", "node": 1, "step": 25},
        {"ts": 10.05, "event": "error_detected", "kind": "conn_reset", "method": "exception"},
        {"ts": 12.0, "event": "error_detected", "kind": "heartbeat_lost", "method": "heartbeat"},
        {"ts": 13.0, "event": "error_detected", "kind": "heartbeat_lost", "method": "heartbeat"},
    ]
    assert measure(events).detection_s == [pytest.approx(0.05)]
    assert detection_by_method(events, "heartbeat") == pytest.approx(2.0)
    assert detection_by_method(events, "monitor") is None
