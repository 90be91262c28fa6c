"""``bench.tp``'s figures from a run's events (pure): a crash's recovery, the first step with
the whole global batch, steps redone and steps committed without every replica."""

from __future__ import annotations

import pytest

from bench.tp import arms, figures


def test_torchfts_shrunk_steps_and_its_return_to_the_whole_batch_are_told_apart() -> None:
    """torchft's live group commits steps 10-12 alone (``replicas`` 1) after the fault at step
    10; the restarted group is back for step 13: recovery is its first lone step, the whole
    batch only at step 13; each group's step counted once."""
    evs = [{"event": "step_end", "ts": 1.0, "step": 9, "replicas": 2}] * 2 + [
        {"event": "fault_injected", "ts": 2.0},
        {"event": "error_detected", "ts": 2.5},
        *({"event": "step_end", "ts": 5.0 + s, "step": 10 + s, "replicas": 1} for s in range(3)),
        {"event": "step_end", "ts": 9.0, "step": 13, "replicas": 2},
        {"event": "step_end", "ts": 9.1, "step": 13, "replicas": 2},
    ]
    got = figures(evs, 10, "torchft")
    assert got == {"recovery_s": 3.0, "whole_s": 7.0, "steps_redone": 0, "steps_shrunk": 3}


def test_a_restarted_jobs_redone_steps_count_and_only_unicron_reports_detection() -> None:
    evs = [
        {"event": "fault_injected", "ts": 2.0},
        {"event": "error_detected", "ts": 2.2},
        *({"event": "step_end", "ts": 4.0 + s, "step": 8 + s} for s in range(4)),
    ]
    assert figures(evs, 10, "torchrun") == {
        "recovery_s": 4.0, "whole_s": 4.0, "steps_redone": 2, "steps_shrunk": 0,
    }  # fmt: skip
    assert figures(evs, 10, "unicron")["detection_s"] == pytest.approx(0.2)
    assert arms("tp2") == arms("pp2") == ("unicron", "torchrun", "torchft")
    assert arms("fsdp2") == ("unicron", "torchrun")


def test_detection_is_the_first_error_detected_after_the_fault() -> None:
    """The event log is not in time order (every writer appends): an error logged before the
    fault (a retried connection at the start) is not its detection."""
    evs = [
        {"event": "error_detected", "ts": 0.5},
        {"event": "fault_injected", "ts": 2.0},
        {"event": "error_detected", "ts": 2.3},
        {"event": "error_detected", "ts": 2.1},
        {"event": "step_end", "ts": 3.0, "step": 10},
    ]
    assert figures(evs, 10, "unicron")["detection_s"] == pytest.approx(0.1)


def test_a_run_never_whole_again_has_no_whole_figure() -> None:
    """torchft at PP=2 beside a loaded machine: the live group finished the run alone before
    the restarted one was back (which then started over alone): no ``whole_s``."""
    evs = [
        {"event": "fault_injected", "ts": 2.0},
        *({"event": "step_end", "ts": 3.0 + s, "step": 10 + s, "replicas": 1} for s in range(3)),
        {"event": "step_end", "ts": 1.0, "step": 9, "replicas": 2},
    ]
    assert figures(evs, 10, "torchft") == {"recovery_s": 1.0, "steps_redone": 0,
                                           "steps_shrunk": 3}  # fmt: skip
