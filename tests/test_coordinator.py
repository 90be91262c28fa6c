"""The coordinator's decisions, driven with plain reports and a fake clock.

The coordinator runs for real (its TCPStore, escalation, step monitor and event log); the
agents are the coordinator's own action queues, read back here. End-to-end runs of the same
paths are in ``tests/test_faults_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from unicron import messages as M
from unicron.control import failures
from unicron.control.coordinator import (
    FAST_EXCHANGE_S,
    Coordinator,
    CoordinatorSettings,
    IllegalTransition,
    Kill,
    Probe,
    SlotState,
    Spawn,
    TaskState,
)
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog, read_events
from unicron.control.health import (
    LAST_COPY_HANG_OVERRUN,
    STARVED_STALL_OVERRUN,
    finish_deadline,
)
from unicron.control.slots import KILL_UNDER_WAY_S, SlotTable
from unicron.detect.busy import Sample
from unicron.detect.classify import verdict_for_kind
from unicron.detect.monitor import MonitorSettings, StepMonitor
from unicron.protocol import done_key, trained_key


class Cluster:
    """A coordinator of ``nodes`` x ``per_node`` slots whose first epoch started at t = 0."""

    def __init__(self, tmp: Path, nodes: int = 1, per_node: int = 4, **settings: Any) -> None:
        self.path = tmp / "events.jsonl"
        self.c = Coordinator(
            task="t",
            slots={s: s // per_node for s in range(nodes * per_node)},
            events=EventLog(self.path),
            escalation=Escalation(EscalationSettings()),
            settings=CoordinatorSettings(**settings),
            monitor=StepMonitor(MonitorSettings(warmup_steps=2)),
        )
        self.taken: list[Any] = []
        for n in range(nodes):
            self.c.attach(n)
        for s in self.c.slots:
            self.c.worker_ready(s, 0.0, microbatches=8)
        assert self.c.state is TaskState.RUNNING and self.c.epoch == 1

    def actions(self, kind: type) -> list[Any]:
        for n in self.c.nodes:
            self.taken += self.c.take_actions(n)
        return [a for a in self.taken if isinstance(a, kind)]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.path) if e["event"] == name]

    def steps(self, n: int, t0: float, slots: tuple[int, ...] | None = None, dt: float = 0.1,
              slow: dict[int, float] | None = None, queued: bool = False,
              cpu: dict[int, float] | None = None) -> float:  # fmt: skip
        """Every member computes and commits ``n`` steps of ``dt`` seconds from ``t0``; the
        ``slow`` ones take longer, for ``queued``: waiting in an oversubscribed run queue.
        ``cpu``: the steps report their computing thread's clock too, a step costing ``dt``
        times this factor of CPU (default 1)."""
        c, t = self.c, t0
        for _ in range(n):
            members = slots or c.members
            step = (
                max((o.computed for o in c.slots.values() if o.computed is not None), default=-1)
                + 1
            )
            for m in members:
                c.step_started(m, step, t, epoch=c.epoch, cpu_s=None if cpu is None else t)
            for m in members:
                f = (slow or {}).get(m, 1.0)
                used = None if cpu is None else t + dt * cpu.get(m, 1.0)
                c.step_computed(
                    m, step, t + dt * f, compute_s=dt * f, microbatches=2,
                    queued_s=dt * (f - 1.0) if queued else 0.0, cpu_s=used,
                )  # fmt: skip
            t += dt * max((slow or {}).values(), default=1.0)
            c.step_committed(c.epoch, step, t)
            c.tick(t)
        return t


def test_an_in_band_error_of_the_current_epoch_gets_a_new_epoch(tmp_path: Path) -> None:
    """The race behind a transition stalled for ever: a member's collective fails in the epoch
    that replaced a failed worker, just after the failure. Such an error used to be dropped as
    a symptom of the failure, so its reporter waited for an epoch that never came."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(1, verdict_for_kind("cuda"), t)  # epoch 2 without slot 1
    assert c.epoch == 2 and [a.slot for a in k.actions(Spawn)] == [1]
    c.worker_ready(1, t + 0.1)  # the restart joins: epoch 3
    assert c.epoch == 3 and c.members == (0, 2, 3, 1)
    c.worker_error(0, verdict_for_kind("conn_reset"), t + 0.2, in_place=False, epoch=3)
    c.tick(t + 0.2 + c.settings.error_grace_s / 2)
    assert c.epoch == 3  # a process or node failure may still explain it
    c.tick(t + 0.3 + c.settings.error_grace_s)
    assert c.epoch == 4 and c.members == (0, 2, 3, 1)
    assert k.events("action")[-1]["action"] == "reattempt"


def test_an_in_band_error_of_an_older_epoch_is_healed_by_the_newer_one(tmp_path: Path) -> None:
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(1, verdict_for_kind("killed"), t)  # epoch 2
    c.worker_error(0, verdict_for_kind("conn_reset"), t + 0.01, in_place=False, epoch=1)
    c.tick(t + 10.0)
    assert c.epoch == 2 and [e["action"] for e in k.events("action")] == ["restart"]


def _slot_2_never_enters(k: Cluster) -> float:
    """Slot 3 lost after 10 steps: epoch 2 of 0, 1, 2, which slot 2 never enters."""
    t = k.steps(10, 0.0)
    k.c.worker_failed(3, verdict_for_kind("killed"), t)
    for m in (0, 1):
        k.c.epoch_entered(m, 2, t + 0.01)
    return t


def test_a_member_that_never_enters_the_epoch_is_killed_as_stalled(tmp_path: Path) -> None:
    k = Cluster(tmp_path)
    c = k.c
    t = _slot_2_never_enters(k)
    deadline = c.stall_deadline()
    assert deadline == c.settings.stall_floor_s + c.state_bytes / 50e6
    c.tick(t + 0.01 + deadline * 0.9)
    assert k.actions(Kill) == []
    c.tick(t + 0.02 + deadline)
    (kill,) = k.actions(Kill)
    assert kill.slot == 2 and kill.verdict.kind == "stall"
    (found,) = [e for e in k.events("error_detected") if e.get("method") == "stall"]
    assert found["slot"] == 2 and "outside epoch 2" in found["reason"]
    c.tick(t + 0.03 + deadline)
    assert len(k.actions(Kill)) == 1  # judged once


def test_a_collective_stuck_on_every_member_starts_the_epoch_again(tmp_path: Path) -> None:
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(10, 0.0)
    for m in c.members:
        c.step_started(m, 10, t, epoch=1)
        c.step_computed(m, 10, t + 0.1, compute_s=0.1, microbatches=2)
    c.tick(t + 0.2 + c.stall_deadline())
    assert c.epoch == 2 and c.members == (0, 1, 2, 3)  # a reattempt: same members
    assert k.actions(Kill) == []
    assert k.events("action")[-1]["action"] == "reattempt"


def test_below_the_minimum_the_task_waits_for_a_readmitted_slot(tmp_path: Path) -> None:
    """An excluded slot leaves the task under its minimum: it waits (an action says why) for
    the health probe instead of failing, then runs again."""
    k = Cluster(tmp_path, min_workers=4, readmit_after_s=5.0)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(3, verdict_for_kind("ecc"), t)
    assert c.state is TaskState.WAITING and c.members == (0, 1, 2)
    (wait,) = [e for e in k.events("action") if e["action"] == "wait"]
    assert "fewer than the minimum of 4" in wait["reason"] and "health probe" in wait["reason"]
    c.tick(t + 5.0)
    assert [a.slot for a in k.actions(Probe)] == [3]
    c.probe_done(3, True, "cpu: fine", t + 6.0)
    assert [a.slot for a in k.actions(Spawn)] == [3]
    c.worker_ready(3, t + 7.0)
    assert c.state is TaskState.RUNNING and c.members == (0, 1, 2, 3) and c.epoch == 2


def test_no_reattempt_epoch_below_the_minimum(tmp_path: Path) -> None:
    """The survivors' collectives fail once their peer is gone; below the minimum that must
    not bring an epoch of fewer workers: the epoch that ends the wait heals them."""
    k = Cluster(tmp_path, min_workers=4, readmit_after_s=1000.0)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(3, verdict_for_kind("ecc"), t)
    c.worker_error(0, verdict_for_kind("conn_reset"), t + 0.1, in_place=False, epoch=1)
    c.tick(t + 10.0)
    assert c.state is TaskState.WAITING and c.epoch == 1
    assert [e["action"] for e in k.events("action")] == ["exclude", "wait"]


def test_a_task_that_waits_too_long_gives_up(tmp_path: Path) -> None:
    k = Cluster(tmp_path, min_workers=4, readmit_after_s=1000.0, give_up_after_s=30.0)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(3, verdict_for_kind("ecc"), t)
    c.tick(t + 29.0)
    assert c.state is TaskState.WAITING
    c.tick(t + 31.0)
    assert c.state is TaskState.FAILED and c.outcome is not None
    assert "gave up after waiting 31 s" in c.outcome.reason
    assert c.store.get(done_key("t")) == b"failed"


def test_with_probes_turned_off_below_the_minimum_fails_at_once(tmp_path: Path) -> None:
    k = Cluster(tmp_path, min_workers=4, readmit_after_s=math.inf)
    k.c.worker_failed(3, verdict_for_kind("ecc"), 1.0)
    assert k.c.state is TaskState.FAILED and k.c.outcome is not None
    assert "3 slot(s) left that can be used again" in k.c.outcome.reason


@pytest.mark.parametrize("spare", [0, 1])
def test_in_a_cluster_with_slots_to_give_a_task_below_its_minimum_waits_for_them(
    tmp_path: Path, spare: int
) -> None:
    """Fewer slots that can come back than the minimum: ``unicron run``'s task fails at once
    (nothing else can come), but a cluster whose planner could give it ``spare`` slots (free,
    or others' above their minimums: the cluster's tick says how many) waits for them (found
    by the cluster soak: a task that had given slots back lost a node and failed at once
    while the planner had slots to give), and the slot given brings it back."""
    k = Cluster(tmp_path, min_workers=4, readmit_after_s=math.inf, nodes_return=True)
    c = k.c
    t = k.steps(3, 0.0)
    c.tick(t, spare)
    c.worker_failed(3, verdict_for_kind("ecc"), t + 0.1)  # excluded, and never probed
    if not spare:
        assert c.state is TaskState.FAILED and c.outcome is not None
        assert "3 slot(s) left that can be used again, fewer than" in c.outcome.reason
        return
    assert c.state is TaskState.WAITING
    assert "waiting for the cluster to give more" in k.events("action")[-1]["reason"]
    c.tick(t + 1.0, 0)  # the planner gave the spare slot to another task meanwhile
    assert c.state is TaskState.WAITING  # waiting already: the give-up deadline decides
    c.add_slot(4, 0, t + 2.0, "planner", 0)
    assert [a.slot for a in k.actions(Spawn)][-1] == 4
    c.worker_ready(4, t + 3.0)
    assert c.state is TaskState.RUNNING and sorted(c.members) == [0, 1, 2, 4]


def test_without_a_way_back_the_task_fails_at_once(tmp_path: Path) -> None:
    """Slots of a lost node have no agent to probe them: below the minimum, nothing to wait for."""
    k = Cluster(tmp_path, nodes=2, per_node=2, min_workers=3)
    c = k.c
    t = k.steps(3, 0.0)
    for n in (0, 1):
        c.heartbeat(n, t)
    for i in range(1, 26):  # node 1 falls silent; node 0's agent goes on ticking
        c.heartbeat(0, t + i / 10)
        c.tick(t + i / 10)
    assert c.state is TaskState.FAILED and c.outcome is not None
    assert "2 slot(s) left that can be used again" in c.outcome.reason


def test_in_a_cluster_a_task_on_lost_nodes_waits_for_them(tmp_path: Path) -> None:
    """Where nodes come back (a cluster: ``nodes_return``), a task left only with slots of
    lost nodes waits for its give-up deadline instead of failing at once (found by the
    cluster soak: a task whose every slot sat on one node failed when its link was cut for
    6 s), and the node's return brings its slots back."""
    k = Cluster(tmp_path, nodes=2, per_node=2, min_workers=3, nodes_return=True,
                give_up_after_s=60.0)  # fmt: skip
    c = k.c
    t = k.steps(3, 0.0)
    for n in (0, 1):
        c.heartbeat(n, t)
    for i in range(1, 26):  # node 1 falls silent, as in the test above
        c.heartbeat(0, t + i / 10)
        c.tick(t + i / 10)
    assert c.state is TaskState.WAITING and c.lost_nodes == {1}
    c.node_returned(1, t + 5.0)
    assert c.lost_nodes == set()
    readmitted = [e.get("slot") for e in k.events("action") if e["action"] == "readmit"]
    assert sorted(readmitted) == [2, 3]


def test_an_excluded_node_keeps_the_last_copies_of_the_state_running(tmp_path: Path) -> None:
    """One node, failures on three of its slots: the node is excluded, but its living workers
    hold the only copies of the state, so they go on instead of the task rolling back (one
    that fails is restarted in place); a health probe brings the node back."""
    k = Cluster(tmp_path, readmit_after_s=5.0)
    c = k.c
    t = k.steps(3, 0.0)
    for i, (slot, kind) in enumerate([(0, "cuda"), (1, "hang"), (2, "ecc")]):
        c.worker_failed(slot, verdict_for_kind(kind), t + i)
        if slot != 2:
            c.worker_ready(slot, t + i + 0.5)
    assert 0 in c.escalation.excluded_nodes()
    assert k.actions(Kill) == []  # nobody outside the node holds the state
    assert c.slots[0].alive and c.slots[0].excluded and c.state is TaskState.RUNNING
    assert c.members == (3, 0, 1)
    c.worker_failed(0, verdict_for_kind("killed"), t + 3.0)  # restarted in place
    assert [a.slot for a in k.actions(Spawn)] == [0, 1, 0]
    assert "holds the task's last copies" in k.events("action")[-1]["reason"]
    assert not c.slots[0].excluded and 0 in c.escalation.excluded_nodes()
    c.worker_ready(0, t + 3.5)
    assert c.members == (3, 1, 0)  # it joins, to take the state from its neighbours
    c.tick(t + 8.0)  # slot 2 was excluded on its own account at t+2: probed at t+7
    assert [a.slot for a in k.actions(Probe)] == [2]
    c.probe_done(2, True, "cpu: fine", t + 9.0)
    assert 0 not in c.escalation.excluded_nodes()
    assert not any(o.excluded for o in c.slots.values())  # the node is back, and slot 2
    assert [a.slot for a in k.actions(Spawn)] == [0, 1, 0, 2]


def test_failures_on_a_node_that_holds_the_last_copies_restart_in_place(tmp_path: Path) -> None:
    """Found by the fault soak: a node excluded for three failing slots kept its living workers
    (the only copies of the state), but the failure that excluded it lost its worker, an OOM
    on a kept one was answered with "node is excluded", then a user error on the last, and
    the task rolled back to its checkpoint (4 and 9 steps redone in two runs). Each failure of
    a slot's own there now restarts its worker in place, within the slot's own restart limit;
    the copies never run out."""
    k = Cluster(tmp_path, readmit_after_s=30.0)
    c = k.c
    t = k.steps(3, 0.0)
    for i, (slot, kind) in enumerate([(0, "cuda"), (1, "hang"), (2, "illegal_memory")]):
        c.worker_failed(slot, verdict_for_kind(kind), t + i)
        c.worker_ready(slot, t + i + 0.5)
    assert 0 in c.escalation.excluded_nodes() and not c.escalation.excluded_slots()
    assert c.members == (3, 0, 1, 2)  # the failure that tipped the node: restarted in place
    assert [a.slot for a in k.actions(Spawn)] == [0, 1, 2]
    assert [e["action"] for e in k.events("action")][-2:] == ["readmit", "restart"]
    said: set[int] = set()  # what the cluster's planner reads of it: per slot, in order
    for e in k.events("action"):
        if e["action"] in ("exclude", "readmit"):
            said = said | {e["slot"]} if e["action"] == "exclude" else said - {e["slot"]}
    assert said == {s for s, o in c.slots.items() if o.excluded} == {0, 1, 3}
    t = k.steps(2, t + 3.0)  # the restarted workers took the state and computed with it
    for slot, kind in [(1, "oom"), (3, "nccl"), (0, "user"), (2, "segfault")]:
        c.worker_failed(slot, verdict_for_kind(kind), t)
        assert c.slots[slot].state is SlotState.STARTING, (slot, kind)
        c.worker_ready(slot, t + 0.5)
        assert slot in c.members
        t = k.steps(2, t + 1.0)
        assert sorted(c.slots.holders()) == [0, 1, 2, 3]
    assert [a.slot for a in k.actions(Spawn)] == [0, 1, 2, 1, 3, 0, 2]
    assert c.state is TaskState.RUNNING and k.actions(Kill) == []
    restarts = [e for e in k.events("action") if e["action"] == "restart"][-4:]
    assert all("holds the task's last copies" in e["reason"] for e in restarts), restarts
    # the slot's own restart limit still holds: its fourth failure in the window excludes it
    for _ in range(2):
        c.worker_failed(3, verdict_for_kind("oom"), t)
        assert c.slots[3].state is SlotState.STARTING
        c.worker_ready(3, t + 0.5)
        t = k.steps(1, t + 1.0)
    assert "restart 3 of 3" in k.events("action")[-1]["reason"]
    c.worker_failed(3, verdict_for_kind("oom"), t)
    assert 3 in c.escalation.excluded_slots() and c.slots[3].state is SlotState.EXCLUDED
    assert sorted(c.slots.holders()) == [0, 1, 2] and c.state is TaskState.RUNNING


def test_a_kept_last_copy_is_not_killed_for_a_transient_error(tmp_path: Path) -> None:
    """Found by the fault soak: on an excluded node, a SEV3 error of a kept worker was answered
    with "node is excluded" and a kill, and the task lost its last copies of the state."""
    k = Cluster(tmp_path, readmit_after_s=5.0)
    c = k.c
    t = k.steps(3, 0.0)
    for i, (slot, kind) in enumerate([(0, "cuda"), (1, "hang"), (2, "ecc")]):
        c.worker_failed(slot, verdict_for_kind(kind), t + i)
    assert 0 in c.escalation.excluded_nodes() and c.slots[3].alive
    c.worker_error(3, verdict_for_kind("timeout"), t + 3.0, in_place=True)
    c.worker_error(3, verdict_for_kind("conn_reset"), t + 3.1, in_place=False, epoch=c.epoch)
    c.tick(t + 3.2 + c.settings.error_grace_s)
    assert k.actions(Kill) == []
    assert [e["action"] for e in k.events("action")][-2:] == ["reattempt", "reattempt"]


def test_replicas_that_disagree_fail_the_task(tmp_path: Path) -> None:
    k = Cluster(tmp_path)
    c = k.c
    c.worker_done(0, {"params_sha256": "aa", "rank": 0, "steps": 3}, 1.0)
    assert c.state is TaskState.RUNNING  # until every member has reported
    c.worker_done(1, {"params_sha256": "bb", "rank": 1, "steps": 3}, 1.0)
    assert c.state is TaskState.FAILED and c.outcome is not None
    assert c.outcome.state is TaskState.FAILED and "different parameters" in c.outcome.reason
    assert c.finished()


def _done(m: int) -> dict[str, Any]:
    return {"params_sha256": "aa", "rank": m, "steps": 3, "epoch": 1}


def test_the_task_is_done_once_every_live_member_reported(tmp_path: Path) -> None:
    """A finished worker waits for the ``done`` key, which is written once every live member
    of the epoch has reported (W2: a member whose last update's broadcast was cut by a loss
    does not report; the ones that finished stay to serve its values in a newer epoch). A
    member lost after the others finished ends the task with no new epoch."""
    k = Cluster(tmp_path)
    c = k.c
    for m in (0, 1):
        c.worker_done(m, _done(m), 1.0)
    assert c.state is TaskState.RUNNING and not c.store.check([done_key("t")])
    c.worker_failed(3, verdict_for_kind("killed"), 1.1)  # its broadcast cut slot 2's update
    assert c.state is TaskState.RUNNING and c.members == (0, 1, 2) and c.epoch == 2
    c.worker_done(2, _done(2), 1.5)  # (after taking its values from 0 and 1 in epoch 2)
    assert c.state is TaskState.DONE and c.finished()
    assert c.store.check([done_key("t")])
    assert c.outcome is not None and c.outcome.result["params_sha256"] == "aa"

    k = Cluster(tmp_path / "b")
    c = k.c
    for m in (0, 1, 2):
        c.worker_done(m, _done(m), 1.0)
    c.worker_failed(3, verdict_for_kind("killed"), 1.1)
    assert c.state is TaskState.DONE and c.finished() and c.epoch == 1
    assert k.actions(Spawn) == [] and [e["action"] for e in k.events("action")] == []


def test_a_writer_lost_before_its_report_is_replaced_in_a_new_epoch(tmp_path: Path) -> None:
    """W3: replica 0 (rank 0 here) writes the final files before it reports; lost after the
    others finished, it wrote none, and the others' reports used to end the task without
    them. The task forms a new epoch of the live members instead, and is DONE once one of
    them reports there as rank 0 (it wrote the file)."""
    k = Cluster(tmp_path)
    c = k.c
    for m in (1, 2, 3):
        c.worker_done(m, _done(m), 1.0)
    c.worker_failed(0, verdict_for_kind("killed"), 1.1)
    assert c.state is TaskState.RUNNING and not c.store.check([done_key("t")])
    assert c.epoch == 2 and c.members == (1, 2, 3)
    c.worker_done(2, {**_done(1), "epoch": 2}, 1.5)  # rank 1 of epoch 2: no file
    assert c.state is TaskState.RUNNING
    c.worker_done(1, {**_done(0), "epoch": 2}, 1.6)  # rank 0 of epoch 2: final.pt written
    assert c.state is TaskState.DONE and c.store.check([done_key("t")])
    # a writer that reported before it was lost wrote its file: nothing to form again
    k = Cluster(tmp_path / "b")
    c = k.c
    for m in (0, 1, 2):
        c.worker_done(m, _done(m), 1.0)
    c.worker_failed(0, verdict_for_kind("killed"), 1.05)  # restarted: its report is gone
    c.worker_failed(3, verdict_for_kind("killed"), 1.1)
    assert c.state is TaskState.DONE and c.finished()


def test_a_member_that_left_after_the_end_does_not_keep_the_task_open(tmp_path: Path) -> None:
    """A restarted worker announced in a last epoch as the others finished: the task waits
    for its report (the finished ones serve it the state there), and one that leaves
    without a report (exit 0) does not keep it open (it used to wait for ever)."""
    k = Cluster(tmp_path)
    c = k.c
    c.worker_failed(3, verdict_for_kind("killed"), 1.0)
    c.worker_ready(3, 1.5)  # epoch 3 includes it
    for m in (0, 1, 2):
        c.worker_done(m, {"params_sha256": "aa", "rank": m, "steps": 3, "epoch": c.epoch}, 2.0)
    assert c.state is TaskState.RUNNING and not c.finished()
    c.worker_left(3)
    assert c.state is TaskState.DONE and c.finished()


def test_the_first_commit_report_is_the_one_source_of_trained(tmp_path: Path) -> None:
    """Workers started before the first commit hold a fresh model; once a commit is reported
    the coordinator (and the store key a new worker reads) says it is no longer the state."""
    k = Cluster(tmp_path)
    c = k.c
    c.worker_failed(2, verdict_for_kind("killed"), 0.5)  # restarted before any commit
    assert c.slots[2].has_state  # a fresh model is still the task's state
    assert not c.store.check([trained_key("t")])
    for m in (0, 1, 3):
        c.step_started(m, 0, 0.6, epoch=c.epoch)
        c.step_computed(m, 0, 0.7, compute_s=0.1, microbatches=2)
    assert c.step_committed(c.epoch, 0, 0.8) and not c.step_committed(c.epoch, 0, 0.8)
    assert c.store.check([trained_key("t")])
    assert not c.slots[2].has_state and c.slots[0].has_state


def test_a_hang_is_judged_only_on_reports_its_agent_has_read(tmp_path: Path) -> None:
    """Under load an agent may not have read a worker's "step done" yet; the runner's tick must
    not take that worker for hung (three healthy workers were killed at the last step)."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch)
    c.step_computed(0, 20, t + 0.1, compute_s=0.1, microbatches=2)  # a peer is ahead
    c.heartbeat(0, t + 0.2, read_until=t + 0.2)  # then the agent starves
    c.tick(t + 5.0)  # the runner's thread ticks on
    assert k.actions(Kill) == []
    c.heartbeat(0, t + 5.0, read_until=t + 5.0)  # the agent read everything: still no report
    c.tick(t + 5.0)
    assert sorted(a.slot for a in k.actions(Kill)) == [1, 2, 3]


def test_two_late_workers_are_hangs_only_at_twice_the_allowance(tmp_path: Path) -> None:
    """A loaded machine slows several workers at once: with only some peers done, the late
    ones are confirmed at twice their allowance, not at once."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch)
    for m in (0, 1):
        c.step_computed(m, 20, t + 0.1, compute_s=0.1, microbatches=2)
    assert c.monitor is not None
    allowance = c.monitor.settings.hang_floor_s  # 3 x 0.1 s steps is under the 1 s floor
    c.tick(t + allowance * 1.5)
    assert k.actions(Kill) == []
    c.tick(t + allowance * 2.01)
    assert sorted(a.slot for a in k.actions(Kill)) == [2, 3]


@pytest.mark.parametrize("joiner_computes", [False, True])
def test_a_joiner_that_computed_nothing_does_not_hold_a_hang_back(
    tmp_path: Path, joiner_computes: bool
) -> None:
    """A restarted worker that joins while a member hangs waits for that member in the
    rendezvous: it is no peer "not done yet" (the soak's 2.06 s hang: confirmed at twice the
    allowance because of it), so the hang is confirmed once the computing peers are done. A
    joiner that computes the same step is a peer like any other."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    c.worker_failed(3, verdict_for_kind("killed"), t)  # restarted: joins the next epoch
    assert c.members == (0, 1, 2)
    t = k.steps(5, t + 0.1)
    for m in c.members:
        c.step_started(m, 25, t, epoch=c.epoch)
    for m in (1, 2):
        c.step_computed(m, 25, t + 0.1, compute_s=0.1, microbatches=2)
    c.worker_ready(3, t + 0.2)  # ready while slot 0 hangs: in the next epoch at once
    c.epoch_entered(3, c.epoch, t + 0.3)
    assert c.members == (0, 1, 2, 3)
    if joiner_computes:
        c.step_started(3, 25, t + 0.4, epoch=c.epoch)
    assert c.monitor is not None
    c.tick(t + c.monitor.settings.hang_floor_s * 1.05)
    assert [a.slot for a in k.actions(Kill)] == ([] if joiner_computes else [0])


@pytest.mark.parametrize("zero", [False, True])
def test_a_worker_being_killed_holds_no_copy_to_count_on(tmp_path: Path, zero: bool) -> None:
    """Found beside CPU burners (the ZeRO e2e test): two of three members were killed as hung
    in one step, the second while the first's kill was under way, each counted as the other's
    copy of the state: a share of the sharded optimizer lost, the task failed. A worker being
    killed holds nothing; under ``zero`` (each share on two members) a member keeps a share's
    last copy while another member of the epoch is being killed, and before the epoch's first
    commit (whose ledger exchange doubles the shares of members lost before)."""
    k = Cluster(tmp_path, zero=zero)
    c = k.c
    t = k.steps(5, 0.0)
    assert c.book.other_holders(0) == [1, 2, 3]
    c.book.kill(3, verdict_for_kind("hang"), t)
    assert c.book.other_holders(0) == ([] if zero else [1, 2])
    c.worker_failed(3, verdict_for_kind("hang"), t)  # its exit: epoch 2 of 0, 1, 2
    assert c.members == (0, 1, 2) and [a.slot for a in k.actions(Spawn)] == [3]
    # the restart is alive (starting) and has no state yet: not a copy either way
    assert c.book.other_holders(0) == ([] if zero else [1, 2])
    k.steps(1, t + 0.1)  # the epoch's first commit
    assert c.book.other_holders(0) == [1, 2]


@pytest.mark.parametrize("case", ["replicated", "zero, then idle", "zero, then 6x"])
def test_the_last_copy_of_a_share_is_not_killed_while_it_may_wait_on_others(
    tmp_path: Path, case: str
) -> None:
    """The loaded run behind the rule above: in the first full step after a crash, two of
    three members passed twice their allowance, their CPU time still while their processes'
    other threads queued for a CPU (no verdict: they may wait on those). The first is
    killed (another member holds the state); under ``zero`` the second then keeps a share's
    last copy, and with no checkpoint it is held, not killed (its buddy's death ends its
    collective): while the first one's kill is under way whatever its CPU time says (one kill
    at a time among the last copies), then until its CPU time stands still with nothing else
    queued, or the step has lasted six times its allowance. Without ``zero`` the third
    member holds everything: both are killed at twice the allowance."""
    zero = case != "replicated"
    k = Cluster(tmp_path, zero=zero)
    c = k.c
    t = k.steps(20, 0.0)
    c.worker_failed(2, verdict_for_kind("killed"), t)  # epoch 2 of 0, 1, 3
    assert c.members == (0, 1, 3)
    t = k.steps(3, t + 0.1)
    for m in c.members:
        c.step_started(m, 23, t, epoch=c.epoch, cpu_s=10.0)
    c.step_computed(1, 23, t + 0.1, compute_s=0.1, microbatches=2, cpu_s=10.1)
    assert c.monitor is not None
    allowance = max(c.monitor.hang_deadline(s) or 0.0 for s in (0, 3)) - t
    killed: list[int] = []

    def tick(ts: float, others: float | None = None) -> None:
        cpu = [M.CpuTime(slot=s, ts=ts, cpu_s=10.0, queued_s=0.0,
                         others_queued_s=(ts - t) / 2 if others is None else others)
               for s in (0, 3) if s not in killed]  # fmt: skip
        reply = c.exchange(0, cpu, ts, read_until=ts)
        killed.extend(a.slot for a in reply.actions if isinstance(a, Kill))

    ts = t
    while ts < t + 3 * allowance:  # past twice the allowance: the evidence of a hang
        ts += 0.1
        tick(ts)
    assert len(killed) == (1 if zero else 2), killed
    if not zero:
        return
    while ts < t + 3.5 * allowance:  # held
        ts += 0.1
        tick(ts)
    assert len(killed) == 1
    frozen = (ts - t) / 2
    for _ in range(10):  # still held, even standing still: one kill at a time among them
        ts += 0.1
        tick(ts, others=frozen)
    assert len(killed) == 1
    c.worker_failed(killed[0], verdict_for_kind("hang"), ts)  # its exit: a new epoch
    frozen = (ts - t) / 2
    for _ in range(10):  # its CPU time stands still, with nothing else queued (a hang); or
        ts += 0.1  # with its threads queued still, until six times its allowance
        tick(ts, others=frozen if case == "zero, then idle" else None)
    if case == "zero, then 6x":
        assert len(killed) == 1
        while ts < t + 6.2 * allowance:
            ts += 0.1
            tick(ts)
    assert sorted(killed) == [0, 3]


def test_a_kill_is_under_way_until_its_exit_is_in_wherever_it_ends(tmp_path: Path) -> None:
    """A kill sent holds the judges back (one kill at a time among last copies) until its
    exit is reported, the node is lost, or the slot is given a new worker: a flag left set
    by any of those paths would hold every later last-copy hang for the task's life, and a
    slot given back to the task would never count as a copy of the state (found in review:
    a slot killed, excluded, released and given back kept its flag)."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    c = k.c
    t = k.steps(5, 0.0)
    c.book.kill(3, verdict_for_kind("hang"), t)
    assert c.slots.kills_under_way(t) == {3} and 3 not in c.slots.holders()
    c.worker_failed(3, verdict_for_kind("hang"), t + 0.1)  # its exit
    assert c.slots.kills_under_way(t + 0.1) == set()
    c.book.kill(1, verdict_for_kind("hang"), t + 0.2)
    ts = t + 0.2
    c.heartbeat(0, ts)
    for _ in range(20):  # node 0 falls silent: its kills end with it
        ts += 0.25
        c.heartbeat(1, ts)
        c.tick(ts)
    assert c.book.lost_nodes == {0} and c.slots.kills_under_way(ts) == set()
    table = SlotTable({0: 0, 1: 0})  # killed, its exit in as the slot is released, given back
    table[1].killed_at = 1.0
    table[1].gone()
    assert table.kills_under_way(1.5) == {1}  # doomed, not alive: its kill still under way
    assert table.kills_under_way(1.0 + KILL_UNDER_WAY_S) == set()  # a lost report: bounded
    table.remove(1)
    table.add(1, 0)
    assert table[1].killed_at is None and 1 in table.holders()


def test_one_kill_at_a_time_among_last_copies_without_cpu_readings(tmp_path: Path) -> None:
    """Where the agents send no CPU readings the wall clock alone judges a hang, but the last
    copy of a share is still not killed while another member's kill is under way (found in
    review: the rule was skipped with the readings, so both went in one tick)."""
    k = Cluster(tmp_path, zero=True)
    c = k.c
    t = k.steps(20, 0.0)
    c.worker_failed(2, verdict_for_kind("killed"), t)  # epoch 2 of 0, 1, 3
    t = k.steps(3, t + 0.1)
    for m in c.members:
        c.step_started(m, 23, t, epoch=c.epoch)
    c.step_computed(1, 23, t + 0.1, compute_s=0.1, microbatches=2)
    assert c.monitor is not None and not c.book.cpu.sampling
    allowance = max(c.monitor.hang_deadline(s) or 0.0 for s in (0, 3)) - t
    ts = t
    while ts < t + 3 * allowance:
        ts += 0.1
        c.tick(ts)
    (first,) = [a.slot for a in k.actions(Kill)]
    c.worker_failed(first, verdict_for_kind("hang"), ts + 0.1)  # its exit
    c.tick(ts + 0.2)
    assert sorted(a.slot for a in k.actions(Kill)) == [0, 3]


def test_a_stall_is_not_acted_on_while_another_kill_is_under_way(tmp_path: Path) -> None:
    """The members that others wait for outside a step are killed at the stall deadline, but
    not while another worker's kill is under way (its exit may end the wait, and both may be
    the last copies of the state); a kill whose exit never comes holds it back no longer than
    :data:`KILL_UNDER_WAY_S`."""
    k = Cluster(tmp_path)
    c = k.c
    t = _slot_2_never_enters(k)
    c.book.kill(0, verdict_for_kind("hang"), t + 0.01)  # its exit not in yet
    deadline = c.stall_deadline()
    c.tick(t + 0.02 + deadline)
    assert [a.slot for a in k.actions(Kill)] == [0]
    c.tick(t + 0.02 + KILL_UNDER_WAY_S)
    assert [a.slot for a in k.actions(Kill)] == [0, 2]


def test_a_stalled_last_copy_of_the_state_is_given_longer_before_it_is_killed(
    tmp_path: Path,
) -> None:
    """ZeRO: before an epoch's first commit every member may keep a share's last copy
    (its buddy was lost with the last epoch), and there is no checkpoint: slot 2, which never
    enters epoch 2, is killed only after :data:`LAST_COPY_HANG_OVERRUN` stall deadlines, not
    at the first (beside CPU burners such a member, merely slow, was killed at the deadline:
    a share lost, the task failed)."""
    k = Cluster(tmp_path, zero=True)
    c = k.c
    t = _slot_2_never_enters(k)
    deadline = c.stall_deadline()
    c.tick(t + 0.02 + deadline)
    c.tick(t + 0.02 + deadline * (LAST_COPY_HANG_OVERRUN - 0.5))
    assert k.actions(Kill) == []
    c.tick(t + 0.02 + deadline * (LAST_COPY_HANG_OVERRUN + 0.5))
    (kill,) = k.actions(Kill)
    assert kill.slot == 2 and kill.verdict.kind == "stall"


@pytest.mark.parametrize("readings", ["starved", "blocked", "starved, then none"])
def test_a_member_the_others_wait_for_while_it_waits_for_a_cpu_is_given_longer(
    tmp_path: Path, readings: str
) -> None:
    """Found beside CPU burners (``make test-loaded``, stop 69): a ZeRO member just restarted
    got through its step's vote, then was not heard from for 12 s (its threads runnable, 61 ms
    of CPU in that time) and was killed at the stall deadline as "stuck in an earlier phase".
    Where its agent's readings show it waiting for a CPU it is held, for
    :data:`STARVED_STALL_OVERRUN` deadlines from that evidence (first asked at the deadline),
    also when the readings stop (the agent starved too); where they show it blocked with
    nothing queued, it is killed at the deadline."""
    k = Cluster(tmp_path)
    c = k.c
    t = _slot_2_never_enters(k)
    deadline = c.stall_deadline()
    killed: list[float] = []
    ts = t + 0.01
    while not killed and ts < t + deadline * (STARVED_STALL_OVERRUN + 2):
        ts += 0.2
        starved = readings == "starved" or (readings != "blocked" and ts < t + 1.2 * deadline)
        reading = M.CpuTime(slot=2, ts=ts, cpu_s=10.0, runnable=starved)
        c.exchange(0, [reading] if readings == "blocked" or starved else [], ts, read_until=ts)
        c.tick(ts)
        killed += [ts - t for a in k.actions(Kill) if a.slot == 2]
    (at,) = killed
    if readings == "blocked":
        assert deadline < at < deadline + 0.5
        return
    held = (STARVED_STALL_OVERRUN + 1) * deadline
    assert held < at < held + 0.5
    (found,) = [e for e in k.events("error_detected") if e.get("method") == "stall"]
    assert "outside epoch 2" in found["reason"]


def test_a_starved_member_through_its_vote_is_held_and_its_successor_judged_afresh(
    tmp_path: Path,
) -> None:
    """The shape of the finding: slot 2 reported step 10 computed and nothing since, while its
    peers are in step 11's reduce (it took part in step 10's vote: its report of step 11 is
    late). Starved, it is held; restarted (its exit), its successor, which never enters the
    next epoch and sends no reading, is killed at that epoch's deadline: its predecessor's
    evidence does not carry over."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(10, 0.0)
    for m in c.members:
        c.step_started(m, 10, t, epoch=1)
        c.step_computed(m, 10, t + 0.1, compute_s=0.1, microbatches=2)
    c.step_committed(1, 10, t + 0.2)
    for m in (0, 1, 3):
        c.step_started(m, 11, t + 0.2, epoch=1)
        c.step_computed(m, 11, t + 0.3, compute_s=0.1, microbatches=2)
    deadline = c.stall_deadline()
    ts = t + 0.3
    while ts < t + 3 * deadline:
        ts += 0.2
        c.exchange(0, [M.CpuTime(slot=2, ts=ts, cpu_s=10.0, runnable=True)], ts, read_until=ts)
        c.tick(ts)
    assert k.actions(Kill) == []  # held: nothing detected yet
    assert not [e for e in k.events("error_detected") if e.get("method") == "stall"]
    c.worker_failed(2, verdict_for_kind("killed"), ts)  # it died of its own: epoch 2
    assert c.epoch == 2 and [a.slot for a in k.actions(Spawn)] == [2]
    c.worker_ready(2, ts + 0.1)  # its successor: epoch 3, which it never enters
    assert c.epoch == 3
    for m in (0, 1, 3):
        c.epoch_entered(m, 3, ts + 0.2)
    begun = ts + 0.2
    killed: list[float] = []
    while not killed and ts < begun + 3 * deadline:
        ts += 0.2
        c.exchange(0, [], ts, read_until=ts)
        c.tick(ts)
        killed += [ts - begun for a in k.actions(Kill) if a.slot == 2]
    (at,) = killed
    assert deadline < at < deadline + 0.5


def test_a_starved_member_holds_back_no_stuck_one_beside_it(tmp_path: Path) -> None:
    """Of two members the others wait for, the starved one is held and the blocked one is
    killed at the deadline; a starved member whose readings later show it blocked (nothing
    of its own queued) is killed at once."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(10, 0.0)
    c.worker_failed(3, verdict_for_kind("killed"), t)
    c.epoch_entered(0, 2, t + 0.01)  # 1 and 2 never enter epoch 2
    deadline = c.stall_deadline()
    ts = t + 0.01

    def read(until: float, runnable: dict[int, bool]) -> list[int]:
        nonlocal ts
        while ts < until:
            ts += 0.2
            cpu = [M.CpuTime(slot=s, ts=ts, cpu_s=10.0, runnable=r) for s, r in runnable.items()]
            c.exchange(0, cpu, ts, read_until=ts)
            c.tick(ts)
            k.actions(Kill)  # (an exchange's reply would take them)
        return [a.slot for a in k.actions(Kill)]

    assert read(t + deadline + 1.0, {1: True, 2: False}) == [2]
    c.worker_failed(2, verdict_for_kind("stall"), ts)  # its exit: epoch 3 of 0, 1
    assert c.epoch == 3
    c.epoch_entered(0, 3, ts + 0.01)
    assert read(ts + deadline + 1.0, {1: True}) == [2]  # still held
    assert read(ts + 0.8, {1: False}) == [2, 1]


def test_a_member_writing_its_final_files_after_the_others_finished_is_no_stall(
    tmp_path: Path,
) -> None:
    """Slots 0-2 finished; slot 3 (replica 0, say) still writes its final files after the
    last step's vote, past the stall deadline: not killed (before the task waited for every
    report, the first ended the judges). A finished member that enters a newer epoch
    reports again from there before the task is done."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(4, 0.0)
    c.step_started(3, 4, t, epoch=c.epoch)
    for m in c.members:
        c.step_computed(m, 4, t + 0.1, compute_s=0.1, microbatches=2)
    for m in (0, 1, 2):
        c.worker_done(m, {**_done(m), "steps": 5}, t + 0.2)
    c.tick(t + 0.2 + 10 * c.stall_deadline())
    assert k.actions(Kill) == [] and c.state is TaskState.RUNNING
    c.worker_done(3, {**_done(3), "steps": 5}, t + 30.0)
    assert c.state is TaskState.DONE

    k = Cluster(tmp_path / "b")
    c = k.c
    for m in (0, 1):
        c.worker_done(m, _done(m), 1.0)
    c.worker_failed(3, verdict_for_kind("killed"), 1.1)  # epoch 2 of (0, 1, 2)
    c.epoch_entered(0, c.epoch, 1.2)  # slot 0 serves it: its report of epoch 1 no longer counts
    c.worker_done(2, {**_done(2), "epoch": c.epoch}, 1.5)
    c.worker_done(1, {**_done(1), "epoch": c.epoch}, 1.5)
    assert c.state is TaskState.RUNNING
    c.worker_done(0, {**_done(0), "epoch": c.epoch}, 1.6)
    assert c.state is TaskState.DONE


def test_a_member_hung_after_the_last_commit_is_killed_at_the_finish_bound(
    tmp_path: Path,
) -> None:
    """Slots 0-2 finished; slot 3 never reports (a final write that never returns, a script
    stuck past its loop): killed once the finish bound has passed since the first report,
    and its loss ends the task (before, the task never ended). Slot 3 is replica 0 of no
    place here (slot 0 wrote the file), so nothing needs another epoch."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(4, 0.0)
    for m in c.members:
        c.step_started(m, 4, t, epoch=c.epoch)
        c.step_computed(m, 4, t + 0.1, compute_s=0.1, microbatches=2)
    for m in (0, 1, 2):
        c.worker_done(m, {**_done(m), "steps": 5}, t + 0.2)
    bound = finish_deadline(c.book)
    assert bound > 10 * c.stall_deadline()  # a slow final write is no stall
    c.tick(t + 0.2 + bound - 1.0)
    assert k.actions(Kill) == [] and c.state is TaskState.RUNNING
    c.tick(t + 0.2 + bound + 1.0)
    assert [a.slot for a in k.actions(Kill)] == [3]
    assert "no done report" in k.events("error_detected")[-1]["reason"]
    c.worker_failed(3, verdict_for_kind("killed"), t + bound + 2.0)
    assert c.state is TaskState.DONE and c.finished()

    # the writer of the final files (slot 0, replica 0) may be writing a large state to
    # slow storage: given as many bounds as a last copy, then killed, and as it wrote no
    # file its peers finish again in a new epoch (one of them replica 0 there)
    k = Cluster(tmp_path / "b")
    c = k.c
    t = k.steps(4, 0.0)
    for m in (1, 2, 3):
        c.worker_done(m, {**_done(m), "steps": 5}, t)
    bound = finish_deadline(c.book)
    c.tick(t + 2 * bound)
    assert k.actions(Kill) == []
    c.tick(t + LAST_COPY_HANG_OVERRUN * bound + 1.0)
    assert [a.slot for a in k.actions(Kill)] == [0]
    c.worker_failed(0, verdict_for_kind("killed"), t + LAST_COPY_HANG_OVERRUN * bound + 2.0)
    assert c.state is TaskState.RUNNING and c.members == (1, 2, 3)
    c.worker_done(1, {**_done(0), "steps": 5, "epoch": c.epoch}, t + 800.0)
    assert c.state is TaskState.DONE


def test_a_finished_task_whose_writer_is_lost_ends_below_its_minimum(tmp_path: Path) -> None:
    """Found in review: slots 1-3 finished, node 0 lost with the writer of the final files
    (slot 0) before its report. The others finish again in an epoch of their own, below
    --min-workers (no step is left to train): the task used to fail ("fewer than the
    minimum") or wait for capacity."""
    k = Cluster(tmp_path, nodes=2, per_node=2, min_workers=4)
    c = k.c
    t = k.steps(3, 0.0)
    for m in (1, 2, 3):
        c.worker_done(m, {**_done(m), "steps": 3}, t)
    with c._deciding():  # its heartbeats stopped 5 s ago
        failures.node_lost(c.book, 0, 5.0, t + 4.0, suspect_confirmed=False)
    assert c.state is TaskState.RUNNING and c.members == (2, 3), (c.state, c.outcome)
    c.worker_done(2, {**_done(0), "steps": 3, "epoch": c.epoch}, t + 5.0)
    c.worker_done(3, {**_done(1), "steps": 3, "epoch": c.epoch}, t + 5.0)
    assert c.state is TaskState.DONE and c.finished()


def test_the_first_step_after_a_join_is_cold_for_every_member(tmp_path: Path) -> None:
    """Every member's first step of an epoch that admitted a restarted worker waits for the
    newcomer inside its collectives: a member idle there past the warm allowance, while its
    peers are done, is not hung until the cold step's (``rejoin_hang_s``)."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    c.worker_failed(3, verdict_for_kind("killed"), t)
    t = k.steps(2, t + 0.1)
    c.worker_ready(3, t)
    c.epoch_entered(3, c.epoch, t + 0.1)
    assert c.members == (0, 1, 2, 3)
    t += 0.2
    for m in c.members:
        c.step_started(m, 22, t, epoch=c.epoch)
    for m in (1, 2, 3):  # the newcomer too: slot 0 alone is late
        c.step_computed(m, 22, t + 0.1, compute_s=0.1, microbatches=2)
    assert c.monitor is not None
    s = c.monitor.settings
    deadline = c.monitor.hang_deadline(0)
    assert deadline is not None and deadline - t >= s.rejoin_hang_s
    c.tick(t + s.hang_floor_s * 2.5)
    assert k.actions(Kill) == []
    c.tick(deadline + 0.01)
    assert 0 in [a.slot for a in k.actions(Kill)]


def test_a_step_finished_in_an_earlier_epoch_is_no_evidence_of_a_hang_in_its_retry(
    tmp_path: Path,
) -> None:
    """Found under load (test_zero_e2e): the peers had finished step 20 when slot 3 crashed;
    in the next epoch slot 0, retrying the step and waiting on the new epoch's first
    collective, passed its allowance and was killed on the peers' reports of the *old*
    epoch. Only what they finish in this epoch counts; once they have, it does."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch)
    for m in (1, 2):
        c.step_computed(m, 20, t + 0.1, compute_s=0.1, microbatches=2)
    c.worker_failed(3, verdict_for_kind("killed"), t + 0.2)  # the step is retried without it
    assert c.members == (0, 1, 2)
    t += 0.3
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch)
    late = 1.5  # past the allowance after a change, max(12 x the 0.1 s steps, 1 s floor)
    c.tick(t + late)
    assert k.actions(Kill) == []  # slots 1 and 2 have not finished the retry
    for m in (1, 2):
        c.step_computed(m, 20, t + late + 0.1, compute_s=0.1, microbatches=2)
    c.tick(t + late + 0.2)
    assert [a.slot for a in k.actions(Kill)] == [0]


def test_stragglers_are_compared_across_nodes(tmp_path: Path) -> None:
    """One monitor per task: a whole slow node, with one worker on it, is found."""
    k = Cluster(tmp_path, nodes=2, per_node=1)
    t = k.steps(20, 0.0, slow={1: 3.0})
    (found,) = [e for e in k.events("error_detected") if e["kind"] == "straggler"]
    assert found["slot"] == 1 and found["node"] == 1
    assert any("straggler" in e["reason"] for e in k.events("action"))
    assert t > 0


def test_a_straggler_is_not_dropped_if_one_copy_of_the_state_would_be_left(
    tmp_path: Path,
) -> None:
    """Found by the fault soak: a slow worker dropped from two left one copy of the state, a
    crash of that one then rolled the task back to its checkpoint (3 steps redone). The same
    straggler among four is dropped."""
    for per_node in (2, 4):
        k = Cluster(tmp_path / str(per_node), per_node=per_node)
        k.steps(20, 0.0, slow={1: 4.0})
        (found,) = [e for e in k.events("error_detected") if e["kind"] == "straggler"]
        (action,) = [e for e in k.events("action") if "straggler" in e["reason"]]
        assert found["slot"] == 1 and action["slot"] == 1
        if per_node == 2:
            assert action["action"] == "reconfigure"
            assert "1 worker(s) would hold" in action["reason"]
            assert k.actions(Kill) == [] and k.c.members == (0, 1)
        else:
            assert action["action"] == "exclude"
            assert [a.slot for a in k.actions(Kill)] == [1]


def test_a_slow_step_asks_for_the_next_step_reports_at_once(tmp_path: Path) -> None:
    """The agents hold step reports for the rhythm (250 ms when nothing is due): found by the
    fault soak, a straggler's second slow step was judged that much later. One slow step makes
    the rhythm fast until the worker is judged."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    c = k.c
    slow, fast = c.settings.suspect_after_s / 2, FAST_EXCHANGE_S
    t = k.steps(20, 0.0)
    assert c.exchange(0, [], t, read_until=t).next_s == slow
    t = k.steps(1, t, slow={1: 4.0})
    assert c.exchange(0, [], t, read_until=t).next_s == fast
    t = k.steps(1, t, slow={1: 4.0})  # a straggler now: judged and acted on
    assert [e["slot"] for e in k.events("error_detected") if e["kind"] == "straggler"] == [1]
    assert c.exchange(0, [], t, read_until=t).next_s == slow


@pytest.mark.parametrize("cpu", ["idle", "working", "late"])
def test_a_late_workers_cpu_time_decides_its_hang(tmp_path: Path, cpu: str) -> None:
    """Every peer finished step 20; slot 3 is past its allowance. Its CPU time standing still
    is a hang (killed at once); advancing, it is starved (left to run). When the agent's
    readings of this step are late, as a loaded machine makes them, although readings come
    from this node, the wall clock decides only at twice the allowance."""
    k = Cluster(tmp_path)
    c = k.c
    t = k.steps(20, 0.0)
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch, cpu_s=10.0)
    for m in (0, 1, 2):
        c.step_computed(m, 20, t + 0.1, compute_s=0.1, microbatches=2, cpu_s=10.1)
    rate = 0.0 if cpu == "idle" else 0.1  # of a core: under 3x its peers' 0.1 s by 2.2 s
    assert c.monitor is not None
    allowance = c.monitor.settings.hang_floor_s  # 3 x 0.1 s steps is under the 1 s floor
    killed: list[int] = []
    for i in range(1, 12):  # the agent reads every 0.2 s (the late one: only the first)
        ts = t + 0.2 * i * allowance
        report = M.CpuTime(slot=3, ts=ts, cpu_s=10.0 + rate * 0.2 * i)
        reply = c.exchange(0, [report] if cpu != "late" or i == 1 else [], ts, read_until=ts)
        killed += [a.slot for a in reply.actions if isinstance(a, Kill)]
        if i == 6:  # 1.2 x the allowance
            assert killed == ([3] if cpu == "idle" else [])
    assert killed == ([] if cpu == "working" else [3])  # 2.2 x the allowance


def test_a_worker_last_in_the_run_queue_is_no_straggler(tmp_path: Path) -> None:
    """A worker that took 3x its peers' time because its thread waited for a CPU (the kernel's
    run-queue delay, reported with the step) is starved by the machine, not slow: neither
    found nor dropped. The same steps without that wait make it a straggler."""
    for queued in (True, False):
        k = Cluster(tmp_path / str(queued), nodes=2, per_node=2)
        k.steps(20, 0.0, slow={1: 3.0}, queued=queued)
        found = [e for e in k.events("error_detected") if e["kind"] == "straggler"]
        assert [e["slot"] for e in found] == ([] if queued else [1])


@pytest.mark.parametrize(("cpu", "found_at"), [(4.0, 6), (1.0, 9)])
def test_a_worker_held_off_the_cpu_waits_for_the_longer_straggler_verdict(
    tmp_path: Path, cpu: float, found_at: int
) -> None:
    """4x its peers' compute from step 5 on: with the CPU time to match (a slower core) a
    straggler after two steps, with its peers' CPU time (blocked, not computing: the loaded
    runs' false positive) only after five, the reason carrying the CPU figures."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    t = k.steps(5, 0.0, cpu={})
    k.steps(6, t, slow={1: 4.0}, cpu={1: cpu})
    found = [e for e in k.events("error_detected") if e["kind"] == "straggler"]
    assert [(e["slot"], e["step"]) for e in found] == [(1, found_at)]
    # the monitor's figures, per micro-batch like the compute's (two per step here)
    held_off = "slower on the CPU too" if cpu > 1.5 else "held off the CPU"
    assert f"CPU time {0.05 * cpu:.3f} s, peers' median 0.050 s ({held_off})" in found[0]["reason"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("error_grace_s", 2.0), ("give_up_after_s", 0.0), ("stall_floor_s", 0.5)],
)
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CoordinatorSettings(**{field: value})


def test_the_exchange_rhythm_is_slow_when_nothing_is_due_and_fast_when_a_detector_waits(
    tmp_path: Path,
) -> None:
    """``Reply.next_s``: half the suspect delay when nothing is due; a node with a step in
    progress is read again at its hang deadline; fast while a hang is suspected, an in-band
    error waits out its grace period or an epoch is not entered by every member yet."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    c = k.c
    slow, fast = c.settings.suspect_after_s / 2, FAST_EXCHANGE_S
    t = k.steps(20, 0.0)
    assert c.exchange(0, [], t, read_until=t).next_s == slow
    for m in c.members:
        c.step_started(m, 20, t, epoch=c.epoch)
    assert c.monitor is not None
    deadline = c.monitor.hang_deadline(0)
    assert deadline is not None and deadline - t > slow
    assert c.exchange(0, [], t, read_until=t).next_s == slow  # the deadline is far
    now = deadline - 0.1
    assert c.exchange(0, [], now, read_until=now).next_s == pytest.approx(0.1)  # read it then
    for m in (1, 2, 3):
        c.step_computed(m, 20, t + 0.1, compute_s=0.1, microbatches=2)
    c.tick(deadline)  # past the deadline, but node 0's reports are in only up to ``now``
    assert k.actions(Kill) == []
    # its next exchange, at the deadline, confirms the hang (every peer finished the step):
    # the kill goes out in that very reply, and a new epoch follows
    reply = c.exchange(0, [], deadline, read_until=deadline)
    assert [a.slot for a in reply.actions if isinstance(a, Kill)] == [0]
    c.worker_failed(0, verdict_for_kind("hang"), deadline + 0.01)
    assert c.exchange(1, [], deadline + 0.02, read_until=deadline + 0.02).next_s == fast
    for m in c.members:  # every member entered the new epoch: nothing is due any more
        c.epoch_entered(m, c.epoch, deadline + 0.03)
    assert c.exchange(1, [], deadline + 0.04, read_until=deadline + 0.04).next_s == slow
    c.worker_error(2, verdict_for_kind("conn_reset"), deadline + 0.05, in_place=False,
                   epoch=c.epoch)  # fmt: skip
    assert c.exchange(1, [], deadline + 0.06, read_until=deadline + 0.06).next_s == fast


def test_routine_exchanges_leave_the_detectors_to_the_ticker(tmp_path: Path) -> None:
    """An exchange applies its reports and answers; the detectors run on the cluster's ticker
    (once a period, not once a request), except where an exchange must judge at once (at a
    hang deadline, the test above)."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    c = k.c
    t = k.steps(20, 0.0)
    c.exchange(1, [], t, read_until=t)  # node 1's last word
    epoch, found_by = c.epoch, []
    for i in range(1, 31):  # node 1 falls silent; node 0 goes on exchanging, the ticker ticks
        now = t + 0.1 * i
        c.exchange(0, [], now + 0.01, read_until=now + 0.01)
        found_by += ["exchange"] if c.lost_nodes and not found_by else []
        c.tick(now + 0.02)
        found_by += ["tick"] if c.lost_nodes and not found_by else []
    assert found_by == ["tick"] and c.lost_nodes == {1}
    assert c.epoch == epoch + 1 and c.members == (0, 1)


def test_a_slot_moves_only_along_its_diagram(tmp_path: Path) -> None:
    """A slot's lifecycle is one state (``SlotState``); a move its diagram does not draw is a
    bug and is refused, whatever path asked for it."""
    k = Cluster(tmp_path, per_node=2)
    c = k.c
    assert c.slots[1].state is SlotState.READY and c.members == (0, 1)
    c.worker_failed(1, verdict_for_kind("segfault"), 1.0)  # restarted: DOWN, then STARTING
    assert c.slots[1].state is SlotState.STARTING and k.actions(Spawn)
    c.worker_ready(1, 2.0)
    assert c.slots[1].state is SlotState.READY
    c.release_slots([1], 3.0, "another task")
    assert c.slots[1].state is SlotState.LEAVING and c.slots[1].excluded
    with pytest.raises(IllegalTransition, match="LEAVING -> READY"):
        c.slots[1].to(SlotState.READY)  # a slot given away never rejoins the plan
    assert c.slots[1].state is SlotState.LEAVING  # refused: nothing changed
    c.slots[1].readmit()  # no readmission for another task's slot either
    assert c.slots[1].state is SlotState.LEAVING
    c.worker_left(1)  # gone: the task's no more
    assert 1 not in c.slots and c.released() == {1}
    with pytest.raises(IllegalTransition, match="READY -> EXCLUDED"):
        c.slots[0].to(SlotState.EXCLUDED)  # excluded with a live worker is OUT_READY


def test_the_escalations_memory_of_a_slot_lives_on_the_slot(tmp_path: Path) -> None:
    """One home per fact: the escalation's history of a slot (its restarts, its own exclusion)
    is the slot's ``record`` in the slot table, not a second table kept in step by hand; a
    slot given to another task and given back comes back with it."""
    k = Cluster(tmp_path, nodes=2, per_node=2)
    c = k.c
    t = k.steps(3, 0.0)
    c.worker_failed(1, verdict_for_kind("killed"), t)
    record = c.slots[1].record
    assert record is not None and len(record.failures) == 1 and not record.excluded
    for i in range(3):  # restarts 2 and 3, then the fourth failure in the window excludes it
        c.worker_failed(1, verdict_for_kind("killed"), t + 1 + i)
    assert record.excluded and c.escalation.excluded_slots() == {1}
    assert c.slots[1].excluded and not c.slots[1].alive
    c.release_slots([1], t + 5, "planner")
    assert 1 not in c.slots and c.released() == {1}
    assert c.escalation.excluded_slots() == {1}  # its history outlives its stay elsewhere
    c.add_slot(1, 0, t + 6, "planner", 0)
    assert c.slots[1].record is record and not c.slots[1].excluded
    c.worker_failed(1, verdict_for_kind("killed"), t + 7)
    assert "slot is excluded" in k.events("action")[-1]["reason"]


def test_reports_the_coordinator_cannot_apply_fail_the_task_rather_than_hang_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of the coordinator's own (here: applying a CPU-time report raises): each one is
    in the task's event log, and the third fails the task with the reason (it used to wait
    forever for what the lost reports would have decided)."""
    cl = Cluster(tmp_path)

    def broken(*_: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(cl.c, "_apply", broken)
    for i in range(3):
        cl.c.exchange(0, [M.CpuTime(slot=1, ts=1.0 + i, cpu_s=1.0)], 1.0 + i)
        assert (cl.c.state is TaskState.FAILED) == (i == 2)
    said = [e for e in cl.events("control_plane") if "could not apply" in e["what"]]
    assert [e["errors"] for e in said] == [1, 2, 3]
    assert "ValueError: a bug" in said[-1]["what"]
    assert cl.c.store.get(done_key("t")) == b"failed"
    assert "failed to apply 3 reports" in cl.c.outcome.reason


def test_an_agents_cpu_reading_reaches_the_judge_field_for_field(tmp_path: Path) -> None:
    """The agent sends its ``Sample`` as a ``CpuTime`` by field name and the coordinator builds
    the ``Sample`` back: every field, through the wire, lands where it was (a field added to
    one and not the other, or reordered, fails here)."""
    cl = Cluster(tmp_path)
    cl.c.step_started(1, 0, 1.0, epoch=cl.c.epoch, cpu_s=1.0)
    fields = [f.name for f in dataclasses.fields(Sample)]
    sample = Sample(*(True if f.endswith("runnable") else 1.5 + i for i, f in enumerate(fields)))
    assert [f.name for f in dataclasses.fields(M.CpuTime)] == ["slot", *fields]
    sent = M.from_wire(M.to_wire(M.CpuTime(slot=1, **dataclasses.asdict(sample))))
    cl.c.exchange(0, [sent], 2.0)
    assert list(cl.c.book.cpu._samples[1]) == [sample]


def test_a_silent_node_where_the_task_holds_no_slot_any_more_is_forgotten(
    tmp_path: Path,
) -> None:
    """Found by the cluster soak: a task gave its slots on a node back, the node's agent
    exchanged once more, then fell silent (killed): judging it lost raised (no slot to
    escalate on) and killed the whole cluster's ticker."""
    k = Cluster(tmp_path, nodes=2, per_node=2, min_workers=2)
    c = k.c
    t = k.steps(2, 0.0)
    c.release_slots([2, 3], t, "planner")
    t = k.steps(1, t, slots=(0, 1))
    for s in (2, 3):
        c.worker_left(s)
    assert c.released() == {2, 3} and c.slots.on_node(1) == []
    c.heartbeat(1, t)  # the agent's last exchange
    for i in range(1, 40):
        c.heartbeat(0, t + i / 10)
        c.tick(t + i / 10)
    assert c.lost_nodes == set() and not k.events("error_detected")
    assert c.state is TaskState.RUNNING and c.members == (0, 1)


def test_a_slot_given_away_that_dies_after_the_end_leaves_the_task_done(tmp_path: Path) -> None:
    """The planner took a slot back near the end; the task finished without it, its other
    workers exited, and then the leaving worker died (killed on its way out): the task stays
    DONE. Its loss used to reform the task: below the minimum with nobody alive, a DONE task
    went WAITING, for workers that had finished, until its give-up deadline failed it; or
    FAILED at once had its slots been fewer than the minimum."""
    k = Cluster(tmp_path, min_workers=2)
    c = k.c
    t = k.steps(3, 0.0)
    c.release_slots([3], t, "another task")
    assert c.slots[3].leaving and c.members == (0, 1, 2)
    for m in (0, 1, 2):
        c.worker_done(m, {**_done(m), "epoch": c.epoch}, t + 1)
    assert c.state is TaskState.DONE
    for m in (0, 1, 2):
        c.worker_left(m)  # their clean exits after the end
    c.worker_failed(3, verdict_for_kind("killed"), t + 2)
    assert c.state is TaskState.DONE and c.finished()
    assert c.outcome is not None and c.outcome.state is TaskState.DONE
