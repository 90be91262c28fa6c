"""The escalation policy: reattempts, restarts, slot and node exclusion, readmission."""

from __future__ import annotations

import math

import pytest

from unicron.control.escalation import Escalation, EscalationSettings
from unicron.detect.classify import Action, Severity, classify_detector, verdict_for_kind

RESET = verdict_for_kind("conn_reset")
CUDA = verdict_for_kind("cuda")


def test_sev3_reattempts_then_escalates_to_restart() -> None:
    e = Escalation(EscalationSettings(max_reattempts=2))
    d1 = e.decide(RESET, slot=2, node=0, now=0.0)
    d2 = e.decide(RESET, slot=2, node=0, now=1.0)
    d3 = e.decide(RESET, slot=2, node=0, now=2.0)
    assert [d.action for d in (d1, d2, d3)] == [Action.REATTEMPT] * 2 + [Action.RESTART]
    assert d1.reason == "conn_reset on slot 2: reattempt 1 of 2"
    assert (d3.severity, d3.kind) == (Severity.SEV2, "conn_reset")
    assert "escalated to SEV2" in d3.reason
    # the restart gives the slot its reattempts back
    assert e.decide(RESET, slot=2, node=0, now=3.0).action is Action.REATTEMPT


def test_healthy_step_resets_reattempts() -> None:
    e = Escalation(EscalationSettings(max_reattempts=1))
    assert e.decide(RESET, slot=0, node=0, now=0.0).action is Action.REATTEMPT
    e.healthy(slot=0, now=1.0)
    assert e.decide(RESET, slot=0, node=0, now=2.0).action is Action.REATTEMPT
    assert e.decide(RESET, slot=0, node=0, now=3.0).action is Action.RESTART


def test_reattempts_age_out_of_the_window() -> None:
    e = Escalation(EscalationSettings(max_reattempts=1, restart_window_s=10.0))
    assert e.decide(RESET, slot=0, node=0, now=0.0).action is Action.REATTEMPT
    assert e.decide(RESET, slot=0, node=0, now=20.0).action is Action.REATTEMPT


def test_other_slots_are_independent() -> None:
    e = Escalation(EscalationSettings(max_reattempts=1))
    assert e.decide(RESET, slot=0, node=0, now=0.0).action is Action.REATTEMPT
    assert e.decide(RESET, slot=1, node=0, now=0.0).action is Action.REATTEMPT


def test_sev2_restarts_until_the_limit_then_excludes_the_slot() -> None:
    e = Escalation(EscalationSettings(restart_limit=3, restart_window_s=60.0))
    decisions = [e.decide(CUDA, slot=1, node=0, now=10.0 * i) for i in range(4)]
    assert [d.action for d in decisions] == [Action.RESTART] * 3 + [Action.EXCLUDE]
    assert decisions[0].reason == "cuda on slot 1: restart (restart 1 of 3 in 60 s)"
    last = decisions[-1]
    assert (last.severity, last.exclude_slot, last.exclude_node) == (Severity.SEV1, True, False)
    assert last.reason == "cuda on slot 1: failed 4 times in 60 s: slot excluded"
    assert e.excluded_slots() == {1}
    again = e.decide(RESET, slot=1, node=0, now=50.0)
    assert (again.action, again.exclude_slot) == (Action.EXCLUDE, True)


def test_restarts_spread_over_time_do_not_exclude() -> None:
    e = Escalation(EscalationSettings(restart_limit=1, restart_window_s=60.0))
    for i in range(10):
        assert e.decide(CUDA, slot=1, node=0, now=61.0 * i).action is Action.RESTART
    assert e.excluded_slots() == frozenset()


def test_ecc_excludes_the_slot_at_once() -> None:
    e = Escalation()
    d = e.decide(verdict_for_kind("ecc"), slot=5, node=1, now=0.0)
    assert (d.action, d.severity, d.exclude_slot, d.exclude_node) == (
        Action.EXCLUDE,
        Severity.SEV1,
        True,
        False,
    )
    assert e.excluded_slots() == {5}


def test_heartbeat_lost_excludes_the_node() -> None:
    e = Escalation()
    d = e.decide(classify_detector("heartbeat_lost"), slot=0, node=3, now=0.0)
    assert (d.action, d.exclude_node, d.exclude_slot) == (Action.EXCLUDE, True, False)
    assert e.excluded_nodes() == {3}
    assert e.decide(CUDA, slot=9, node=3, now=1.0).exclude_node


def test_straggler_reconfigures_without_excluding() -> None:
    e = Escalation()
    d = e.decide(classify_detector("straggler"), slot=2, node=0, now=0.0)
    assert (d.action, d.severity, d.exclude_slot, d.exclude_node) == (
        Action.RECONFIGURE,
        Severity.SEV1,
        False,
        False,
    )


def test_several_failing_slots_exclude_the_node() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=3))
    assert e.decide(CUDA, slot=0, node=7, now=0.0).action is Action.RESTART
    assert e.decide(CUDA, slot=1, node=7, now=1.0).action is Action.RESTART
    assert e.decide(CUDA, slot=8, node=8, now=1.5).action is Action.RESTART  # another node
    d = e.decide(verdict_for_kind("illegal_memory"), slot=2, node=7, now=2.0)
    assert (d.action, d.exclude_node, d.exclude_slot) == (Action.EXCLUDE, True, False)
    assert "node 7 has 3 failing slots [0, 1, 2]: node excluded" in d.reason
    assert e.excluded_nodes() == {7}


def test_a_slot_holding_the_last_copies_is_judged_alone_on_its_excluded_node() -> None:
    e = Escalation(EscalationSettings(restart_limit=2, node_failure_limit=2))
    e.decide(CUDA, slot=0, node=0, now=0.0)
    assert e.decide(CUDA, slot=1, node=0, now=1.0).exclude_node
    assert e.decide(CUDA, slot=2, node=0, now=2.0).action is Action.EXCLUDE  # node excluded
    d = e.decide(CUDA, slot=3, node=0, now=3.0, last_copies=True)
    assert d.action is Action.RESTART and not d.exclude_node
    assert "node 0 is excluded but holds the task's last copies" in d.reason
    assert e.decide(CUDA, slot=3, node=0, now=4.0, last_copies=True).action is Action.RESTART
    d = e.decide(CUDA, slot=3, node=0, now=5.0, last_copies=True)  # its own limit: out
    assert d.action is Action.EXCLUDE and d.exclude_slot
    assert e.decide(CUDA, slot=3, node=0, now=6.0, last_copies=True).exclude_slot
    # of a node that is not excluded, last_copies changes nothing
    assert e.decide(CUDA, slot=8, node=1, now=7.0, last_copies=True).action is Action.RESTART


def test_old_failures_do_not_count_toward_the_node() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=2, restart_window_s=60.0))
    assert e.decide(CUDA, slot=0, node=0, now=0.0).action is Action.RESTART
    assert e.decide(CUDA, slot=1, node=0, now=100.0).action is Action.RESTART
    assert e.excluded_nodes() == frozenset()


def test_user_errors_do_not_blame_the_node() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=2))
    user = verdict_for_kind("user")
    for slot in range(4):
        assert e.decide(user, slot=slot, node=0, now=float(slot)).action is Action.RESTART
    assert e.excluded_nodes() == frozenset()


def test_a_slot_where_the_script_fails_every_time_is_excluded_for_good() -> None:
    """A script that raises its own error on every restart is excluded past the limit, as
    any failing slot is, but marked: no health probe will readmit it (it cycled through
    probes and restarts for ever: found with a model missing its forward under --tp 2).
    One failure of another kind in the window, and it is an ordinary exclusion."""
    user, killed = verdict_for_kind("user"), verdict_for_kind("killed")
    for kinds in ([user] * 4, [user, killed, user, user]):
        e = Escalation(EscalationSettings(restart_limit=3))
        decisions = [e.decide(v, slot=0, node=0, now=float(i)) for i, v in enumerate(kinds)]
        assert [d.action for d in decisions][-1] is Action.EXCLUDE
        record = e._slots[0]
        assert record.broken_script is (kinds == [user] * 4)
        assert ("for good" in decisions[-1].reason) is record.broken_script
        e.readmit(slot=0)  # a node's return or the operator: a fresh start
        assert not record.broken_script and not record.script


def test_killed_processes_do_not_blame_the_node() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=2))
    killed = verdict_for_kind("killed")
    for slot in range(4):
        assert e.decide(killed, slot=slot, node=0, now=float(slot)).action is Action.RESTART
    assert e.excluded_nodes() == frozenset()


def test_excluded_slots_count_toward_the_node() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=2))
    e.decide(verdict_for_kind("ecc"), slot=0, node=0, now=0.0)
    d = e.decide(verdict_for_kind("ecc"), slot=1, node=0, now=1000.0)
    assert (d.exclude_slot, d.exclude_node) == (True, True)


def test_readmit_slot_and_node() -> None:
    e = Escalation(EscalationSettings(restart_limit=0))
    assert e.decide(CUDA, slot=1, node=0, now=0.0).action is Action.EXCLUDE
    e.readmit(slot=1)
    assert e.excluded_slots() == frozenset()
    assert e.decide(RESET, slot=1, node=0, now=1.0).action is Action.REATTEMPT
    e.decide(classify_detector("heartbeat_lost"), slot=1, node=0, now=2.0)
    e.readmit(node=0)
    assert e.excluded_nodes() == frozenset()
    assert e.decide(RESET, slot=1, node=0, now=3.0).action is Action.REATTEMPT


def test_a_readmitted_slot_still_counts_toward_its_node_within_the_window() -> None:
    e = Escalation(EscalationSettings(node_failure_limit=3))
    ecc = verdict_for_kind("ecc")
    for slot in range(3):  # each slot fails, passes its probe and is readmitted in between
        d = e.decide(ecc, slot=slot, node=0, now=float(slot))
        e.readmit(slot=slot)
    assert d.exclude_node and e.excluded_nodes() == frozenset({0})


def test_unknown_verdict_restarts() -> None:
    d = Escalation().decide(verdict_for_kind("nope"), slot=0, node=0, now=0.0)
    assert (d.action, d.severity, d.kind) == (Action.RESTART, Severity.SEV2, "unknown")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_reattempts", -1),
        ("restart_limit", -1),
        ("restart_window_s", 0.0),
        ("restart_window_s", math.nan),
        ("node_failure_limit", 0),
    ],
)
def test_settings_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^EscalationSettings\.{field} must be in \[.*got"):
        EscalationSettings(**{field: value})  # type: ignore[arg-type]
