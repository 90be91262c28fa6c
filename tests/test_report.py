"""The timeline derived from an event log, and the straggler decision."""

from __future__ import annotations

from typing import Any

from unicron.control.report import incidents, median_step_s, steps_redone
from unicron.detect.straggler import straggler_plan
from unicron.protocol import EpochInfo


def _ev(ts: float, event: str, **kw: Any) -> dict[str, Any]:
    return {"ts": ts, "event": event, **kw}


def test_incident_of_a_crash() -> None:
    events = [
        _ev(0.0, "step_end", step=0),
        _ev(1.0, "step_end", step=1),
        _ev(1.5, "fault_injected", fault="crash", spec="crash:rank=2,step=2", rank=2, step=2),
        _ev(1.52, "error_detected", slot=1, kind="conn_reset", method="exception"),
        _ev(1.53, "error_detected", slot=2, kind="killed", method="process"),
        _ev(1.54, "action", action="restart", slot=2),
        _ev(1.55, "action", action="exclude", node=1, node_name="gpu-3"),
        _ev(1.56, "action", action="wait"),
        _ev(1.6, "transition_end", duration_s=0.06, state_source="local",
            microbatches_reused=6, microbatches_recomputed=2),
        _ev(1.8, "step_end", step=2),
        _ev(1.9, "transition_end", duration_s=0.01, state_source="peer_node",
            microbatches_reused=0, microbatches_recomputed=0),
        _ev(2.0, "step_end", step=3),
    ]  # fmt: skip
    (inc,) = incidents(events)
    assert inc.detected_by == "exception" and inc.kind == "killed"  # first seen; own verdict
    assert abs(inc.detection_s - 0.02) < 1e-9 and abs(inc.recovery_s - 0.3) < 1e-9
    assert (inc.reused, inc.recomputed, inc.state_source) == (6, 2, "local")
    assert inc.actions == ("restart(slot 2)", "exclude(node gpu-3)", "wait")
    assert steps_redone(events) == 0


def test_failures_of_a_log_without_injected_faults_are_incidents() -> None:
    """A cluster task's real failures: one incident per failure (a peer's symptom during
    the same healing is not another), detection time unknown."""
    events = [
        _ev(0.0, "step_end", step=0),
        _ev(1.0, "error_detected", slot=2, rank=2, kind="killed", method="process"),
        _ev(1.01, "error_detected", slot=1, rank=1, kind="conn_reset", method="exception"),
        _ev(1.02, "action", action="restart", slot=2),
        _ev(1.2, "transition_end", duration_s=0.1, state_source="local",
            microbatches_reused=5, microbatches_recomputed=3),
        _ev(1.5, "step_end", step=1),
        _ev(3.0, "error_detected", node=1, node_name="gpu-3", kind="heartbeat_lost",
            method="heartbeat"),
        _ev(3.1, "action", action="exclude", node=1, node_name="gpu-3"),
        _ev(3.5, "transition_end", duration_s=0.3, state_source="peer_remote",
            microbatches_reused=0, microbatches_recomputed=8),
        _ev(4.0, "step_end", step=2),
    ]  # fmt: skip
    killed, lost = incidents(events)
    assert (killed.fault, killed.kind, killed.detection_s) == ("killed on slot 2", "killed", None)
    assert killed.actions == ("restart(slot 2)",) and killed.reused == 5
    assert abs(killed.recovery_s - 0.5) < 1e-9
    assert (lost.fault, lost.kind, lost.detected_by) == (
        "heartbeat_lost on node gpu-3",
        "heartbeat_lost",
        "heartbeat",
    )
    assert lost.state_source == "peer_remote" and lost.actions == ("exclude(node gpu-3)",)
    injected = [_ev(0.9, "fault_injected", fault="crash", spec="crash:rank=2,step=1", rank=2,
                    step=1), *events]  # fmt: skip
    assert len(incidents(injected)) == 1  # with injected faults: those alone, as before


def test_steps_redone_after_a_checkpoint_restore() -> None:
    events = [_ev(float(i), "step_end", step=s) for i, s in enumerate([0, 1, 2, 3, 2, 3, 4])]
    assert steps_redone(events) == 2
    assert median_step_s(events, skip=0) == 1.0


def test_epoch_info_round_trip() -> None:
    info = EpochInfo(3, (2, 0, 1), (1, 0, 0), True, published_ts=12.5)
    assert EpochInfo.from_json(info.to_json()) == info


def test_straggler_is_dropped_only_when_the_task_gains() -> None:
    drop, reason = straggler_plan(
        world=4, microbatches=8, peer_mb_s=0.02, slow_mb_s=0.08, min_workers=1
    )
    assert drop and "drop it" in reason
    keep, reason = straggler_plan(
        world=4, microbatches=8, peer_mb_s=0.02, slow_mb_s=0.025, min_workers=1
    )
    assert not keep and "keep it" in reason
    # never below the task's minimum
    keep, _ = straggler_plan(world=2, microbatches=8, peer_mb_s=0.02, slow_mb_s=1.0, min_workers=2)
    assert not keep
