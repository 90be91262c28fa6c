"""The coordinator's decisions as values: state + observation + ``now`` -> effects.

:meth:`Coordinator.decide_exchange` and :meth:`Coordinator.decide_tick` return what the
coordinator decided (``unicron.control.effects``) without doing it: nothing reaches the store,
the event log or an agent's queue until an :class:`Executor` runs the effects. The key paths:
a worker's failure (a new epoch without it, its restart), its return (an epoch with it), a node
lost (an epoch without its slots), bad input (the task fails, its exits heal nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unicron import messages as M
from unicron.control import health
from unicron.control.coordinator import Coordinator, CoordinatorSettings, TaskState
from unicron.control.effects import AnnounceEpoch, LogEvent, Tell, WriteStoreKey
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog
from unicron.detect.classify import verdict_for_kind
from unicron.protocol import EpochInfo, done_key, epoch_key


def running(tmp: Path) -> Coordinator:
    """Two nodes of two slots each (slots 0, 1 on node 0; 2, 3 on node 1), in epoch 1."""
    c = Coordinator(
        task="t",
        slots={0: 0, 1: 0, 2: 1, 3: 1},
        events=EventLog(tmp / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(),
    )
    for n in (0, 1):
        c.exchange(n, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in (2 * n, 2 * n + 1)], 0.0)
    assert c.epoch == 1 and c.members == (0, 1, 2, 3)
    return c


def names(effects: list[object]) -> list[str]:
    return [e.name if isinstance(e, LogEvent) else type(e).__name__ for e in effects]


def test_a_failed_worker_gives_a_new_epoch_and_its_restart_and_nothing_is_done_yet(
    tmp_path: Path,
) -> None:
    c = running(tmp_path)
    crash = M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))
    effects = c.decide_exchange(0, [crash], 1.0)
    assert names(effects) == ["action", "plan", "AnnounceEpoch", "epoch_begin", "Tell"]
    assert effects[2] == AnnounceEpoch(
        "t", EpochInfo(2, (0, 2, 3), (0, 1, 1), urgent=True, published_ts=1.0)
    )
    assert effects[4] == Tell(0, M.Spawn(1))
    action = effects[0]
    assert isinstance(action, LogEvent) and action.fields["action"] == "restart"
    # decided, not done: the store still points at epoch 1, no agent has anything to do, the
    # event log has not heard of it
    assert c.store.get(epoch_key("t")) == b"1" and c.take_actions(0) == []
    assert [e["epoch"] for e in c.events.events() if e["event"] == "epoch_begin"] == [1]
    c.executor.run(effects)
    assert c.store.get(epoch_key("t")) == b"2" and c.take_actions(0) == [M.Spawn(1)]
    assert [e["epoch"] for e in c.events.events() if e["event"] == "epoch_begin"] == [1, 2]


def test_a_spawn_whose_answer_was_lost_is_sent_again_when_the_agent_reconnects(
    tmp_path: Path,
) -> None:
    """The exchange that reported slot 1's crash reached the coordinator, but its answer (the
    restart's ``Spawn``) was lost on the way back. The agent's next exchange carries its census
    (it does after any failed one): slot 1 has no worker there, so the ``Spawn`` comes again.
    A census that shows the worker, or a ``Spawn`` still on its way, sends none."""
    c = running(tmp_path)
    assert c.exchange(0, [M.Census(ts=0.5, alive=(0, 1))], 0.5).actions == ()
    reply = c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))],
                       1.0)  # fmt: skip
    assert reply.actions == (M.Spawn(1),)  # ... and lost
    again = c.exchange(0, [M.Census(ts=2.0, alive=(0,))], 2.0)
    assert again.actions == (M.Spawn(1),)
    assert c.exchange(0, [M.Census(ts=3.0, alive=(0, 1))], 3.0).actions == ()
    # a crash and the census in one exchange: the restart's Spawn goes once
    both = [M.WorkerFailed(slot=0, ts=4.0, verdict=verdict_for_kind("segfault")),
            M.Census(ts=4.0, alive=(1,))]  # fmt: skip
    assert c.exchange(0, both, 4.0).actions == (M.Spawn(0),)
    # a Spawn the ticker queued that the agent has not taken yet: not sent twice
    effects = c.decide_exchange(
        1, [M.WorkerFailed(slot=3, ts=5.0, verdict=verdict_for_kind("segfault"))], 5.0
    )
    c.executor.run(effects)
    assert c.exchange(1, [M.Census(ts=5.1, alive=(2,))], 5.1).actions == (M.Spawn(3),)
    # a kill under way: its Kill was in the lost answer too, and a new worker would outlive it
    c.book.slots[3].killed_at = 6.0
    assert c.exchange(1, [M.Census(ts=6.0, alive=(2,))], 6.0).actions == ()


def test_a_probe_whose_answer_was_lost_is_asked_again(tmp_path: Path) -> None:
    """Slot 1 excluded (an ECC error), its probe asked for when the cool-down is over, and the
    answer that carried the ``Probe`` lost: the agent's census (no probe runs there) brings it
    again. Before, the slot stayed marked as probing, and out, for good."""
    c = running(tmp_path)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("ecc"))], 1.0)
    assert c.book.slots[1].excluded
    c.executor.run(c.decide_tick(100.0))
    assert c.take_actions(0) == [M.Probe(1)]  # ... and lost
    assert c.exchange(0, [M.Census(ts=101.0, alive=(0,))], 101.0).actions == (M.Probe(1),)
    assert c.exchange(0, [M.Census(ts=102.0, alive=(0,), probing=(1,))], 102.0).actions == ()
    # back in the plan meanwhile (its node lost and returned), still marked: no probe of it
    c.book.slots[1].readmit()
    assert c.exchange(0, [M.Census(ts=103.0, alive=(0,))], 103.0).actions == ()


def test_a_restarted_worker_that_is_ready_joins_at_the_step_boundary(tmp_path: Path) -> None:
    c = running(tmp_path)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))], 1.0)
    effects = c.decide_exchange(0, [M.Ready(slot=1, ts=1.5, microbatches=8)], 1.5)
    announced = [e for e in effects if isinstance(e, AnnounceEpoch)]
    assert [a.info.members for a in announced] == [(0, 2, 3, 1)]
    assert not announced[0].info.urgent  # nobody was lost: members switch at a step boundary
    assert not [e for e in effects if isinstance(e, Tell)]


def test_a_silent_node_is_lost_and_the_next_epoch_goes_on_without_its_slots(
    tmp_path: Path,
) -> None:
    c = running(tmp_path)
    effects: list[object] = []
    t = 0.0
    while t < 2.5:  # node 0 keeps exchanging; node 1 falls silent after t = 0
        t += 0.25
        effects += c.decide_exchange(0, [], t)
        effects += c.decide_tick(t)  # the cluster's ticker: it alone judges heartbeats
    lost = [e for e in effects if isinstance(e, LogEvent) and e.name == "error_detected"]
    assert len(lost) == 1 and lost[0].fields["kind"] == "heartbeat_lost"
    assert lost[0].fields["node"] == 1 and lost[0].fields["ts"] > 2.0
    announced = [e for e in effects if isinstance(e, AnnounceEpoch)]
    assert [a.info.members for a in announced] == [(0, 1)] and announced[0].info.urgent
    assert c.slots[2].excluded and c.slots[3].excluded and 1 in c.lost_nodes
    assert not [e for e in effects if isinstance(e, Tell)]  # a lost node has no agent to tell


def test_a_node_late_lately_is_given_its_lateness_of_silence_more(tmp_path: Path) -> None:
    """Node 0's agent comes back 1.7 s later than the rhythm asked of it (50 ms: nobody has
    entered the epoch yet) (starved: beside CPU burners the agent of `unicron run`, a thread of
    the coordinator's process, once fell silent for 2.1 s, and its task, with no checkpoint,
    failed; the loaded series, stop 67). Then both nodes fall silent: punctual node 1 is lost
    past the 2 s timeout, node 0 only past 2 s plus its lateness, halved every 30 s."""
    c = running(tmp_path)
    t = 0.0
    while t < 6.5:
        t += 0.25
        if t <= 2.75:  # node 0 silent from 1.0 to 2.75, node 1 every round, then neither
            c.exchange(1, [], t)
            if t <= 1.0 or t == 2.75:
                c.exchange(0, [], t)
        c.tick(t)  # the cluster's ticker
    lost = {e["node"]: e["ts"] for e in c.events.events() if e.get("kind") == "heartbeat_lost"}
    assert c.book.asked_s[1] == 0.05
    # silent 2.25 s > 2 s; node 0: 3.5 s < 2 s + 1.57 s at 6.25, 3.75 s > 2 s + 1.55 s at 6.5
    assert lost == {1: 5.0, 0: 6.5}, lost


def test_lateness_is_capped_forgotten_for_a_new_agent_and_set_aside_while_an_error_waits(
    tmp_path: Path,
) -> None:
    """A node's lateness counts at most one timeout and halves every 30 s; a new agent of the
    node starts with none (it is measured against nothing the old one was asked); and while an
    in-band error waits out its grace every node has the plain timeout, so that a node lost
    behind the error is found before the error is reattempted (the grace is longer)."""
    c = running(tmp_path)
    b = c.book
    b.asked_s[0] = 0.25
    health.heartbeat(b, 0, 10.0, None)  # back 9.75 s later than asked: counted as 2 s
    assert health.lateness(b, 0, 10.0) == 2.0
    assert health.silence_allowed_s(b, 0, 40.0) == 3.0  # halved after 30 s
    failed = M.WorkerError(slot=2, ts=40.0, verdict=verdict_for_kind("conn_reset"),
                           in_place=False, epoch=c.epoch)  # fmt: skip
    c.exchange(1, [failed], 40.0)
    assert c.book.slots.pending_errors() == [2]
    assert health.silence_allowed_s(b, 0, 40.0) == 2.0
    b.new_agent(0, 41.0)
    assert health.lateness(b, 0, 41.0) == 0.0 and 0 not in b.asked_s


def test_the_clock_alone_decides_nothing_while_every_node_is_heard(tmp_path: Path) -> None:
    c = running(tmp_path)
    for t in (0.25, 0.5, 0.75):
        assert c.decide_exchange(0, [], t) == []
        assert c.decide_exchange(1, [], t) == []
        assert c.decide_tick(t) == []


def test_bad_input_fails_the_task_and_its_exits_heal_nothing(tmp_path: Path) -> None:
    c = running(tmp_path)
    reports: list[M.Report] = [
        M.WorkerFailed(slot=0, ts=1.0, verdict=verdict_for_kind("user")),
        M.BadInput(ts=1.0, message="a checkpoint of another model"),  # applied first
    ]
    effects = c.decide_exchange(0, reports, 1.0)
    assert effects == [WriteStoreKey(done_key("t"), "failed")]
    assert c.state is TaskState.FAILED and c.outcome is not None and c.outcome.usage


def _give_back_3(c: Coordinator, t: float) -> None:
    """Slot 3 given to another task at ``t``; the others enter the epoch without it, and the
    ticker sends its worker the leaver's ``Kill`` (taken here: what happens to it is the
    caller's)."""
    c.release_slots([3], t, "another task needs it")
    for n, slots in ((0, (0, 1)), (1, (2,))):
        c.exchange(n, [M.EpochEntered(slot=s, ts=t + 0.1, epoch=c.epoch) for s in slots], t + 0.1)
    c.tick(t + 0.2)
    assert c.take_actions(1) == [M.Kill(3, None, leave=True)]


def test_a_kill_whose_answer_was_lost_is_sent_again(tmp_path: Path) -> None:
    """A leaver's ``Kill`` (its slot given to another task) went in an answer lost on its way
    back: the agent's census shows the worker alive, so the ``Kill`` comes again, and the
    slot is given back once its exit is in (before, the slot stayed STOPPING for good and the
    other task waited for it). A hang's ``Kill`` alike, with its verdict."""
    c = running(tmp_path)
    _give_back_3(c, 1.0)  # ... and lost
    again = c.exchange(1, [M.Census(ts=2.0, alive=(2, 3))], 2.0)
    assert again.actions == (M.Kill(3, None, leave=True),)
    assert c.exchange(1, [M.Census(ts=2.5, alive=(2, 3))], 2.5).actions == (
        M.Kill(3, None, leave=True),
    )  # still alive after the second: again (a Kill twice is harmless on the agent)
    c.exchange(1, [M.WorkerLeft(slot=3, ts=3.0)], 3.0)
    assert c.released() == {3}

    c = running(tmp_path / "hang")
    verdict = verdict_for_kind("hang")
    with c._deciding():
        c.book.kill(1, verdict, 4.0)
    c.executor.run(c.book.effects)
    assert c.take_actions(0) == [M.Kill(1, verdict)]  # ... and lost
    assert c.exchange(0, [M.Census(ts=5.0, alive=(0, 1))], 5.0).actions == (M.Kill(1, verdict),)
    assert c.exchange(0, [M.Census(ts=5.5, alive=(0,))], 5.5).actions == ()  # it is gone


def test_a_kill_queued_for_a_lost_nodes_old_agent_is_not_the_new_ones(tmp_path: Path) -> None:
    """A hang's ``Kill`` for slot 3 waits in node 1's queue; the node dies before its agent
    takes it, and a new agent registers: its first exchange gets no ``Kill`` (before, the
    old one killed the fresh worker the new agent had just started: a restart counted
    against a worker that did nothing)."""
    c = running(tmp_path)
    c.exchange(1, [], 1.0)
    hang = verdict_for_kind("hang")
    with c._deciding():
        c.book.kill(3, hang, 1.0)
    c.executor.run(c.book.effects)
    for k in range(1, 51):  # node 1 silent: lost (past 2 s and its 0.95 s of lateness)
        c.exchange(0, [], 1.0 + k * 0.1)
        c.tick(1.0 + k * 0.1)
    assert 1 in c.lost_nodes
    c.node_returned(1, 6.0)
    census = M.Census(ts=6.1, alive=(2, 3), starting=(2, 3))
    assert not any(isinstance(a, M.Kill) for a in c.exchange(1, [census], 6.1).actions)


def test_a_new_agent_on_a_node_the_task_never_judged_lost_restarts_its_workers(
    tmp_path: Path,
) -> None:
    """Node 1's agent is replaced (another task declared the node lost and it was fenced,
    which stopped this task's workers there too) before this task's own heartbeat timeout:
    slots 2 and 3 end, the survivors go on in a new epoch, and the new agent's workers
    start in them, fresh (before, the dead workers stayed members holding the state)."""
    c = running(tmp_path)
    c.exchange(0, [M.Event(ts=0.5, name="step_end", fields={"epoch": 1, "step": 0})], 0.5)
    c.node_returned(1, 1.0)
    assert (c.epoch, c.members) == (2, (0, 1))
    assert [c.book.slots[s].state.name for s in (2, 3)] == ["STARTING", "STARTING"]
    assert c.book.slots.holders() == [0, 1]
    census = M.Census(ts=1.1, alive=(2, 3), starting=(2, 3))
    assert c.exchange(1, [census], 1.1).actions == ()  # the new agent started them itself
    c.exchange(1, [M.Ready(slot=s, ts=2.0, microbatches=8) for s in (2, 3)], 2.0)
    assert c.members == (0, 1, 2, 3)


def test_a_leavers_kill_sent_again_carries_no_earlier_workers_verdict(tmp_path: Path) -> None:
    """Slot 3's first worker was killed for a hang and restarted; later the slot is given
    back and the leaver's ``Kill`` is lost: sent again, it carries no verdict (before, the
    earlier worker's hang: the agent dumped the leaver's stacks before killing it)."""
    c = running(tmp_path)
    hang = verdict_for_kind("hang")
    with c._deciding():
        c.book.kill(3, hang, 1.0)
    c.executor.run(c.book.effects)
    c.exchange(1, [M.WorkerFailed(slot=3, ts=1.5, verdict=hang)], 1.5)
    c.exchange(1, [M.Ready(slot=3, ts=2.0, microbatches=8)], 2.0)
    _give_back_3(c, 3.0)  # ... and lost
    again = c.exchange(1, [M.Census(ts=4.0, alive=(2, 3))], 4.0)
    assert again.actions == (M.Kill(3, None, leave=True),)


@pytest.mark.parametrize("lost", [True, False])
def test_a_leaver_whose_node_goes_is_given_back(tmp_path: Path, lost: bool) -> None:
    """Slot 3 is being given back (its leaver's ``Kill`` sent) when its node is lost, or its
    agent replaced: the slot is released all the same (before, a lost node's leaver stayed
    the task's for good, and the task it was given to waited)."""
    c = running(tmp_path)
    _give_back_3(c, 1.0)
    t = 1.5
    if lost:
        for k in range(1, 51):  # past 2 s and node 1's 1.05 s of lateness
            c.exchange(0, [], 1.2 + k * 0.1)
            c.tick(1.2 + k * 0.1)
        assert 1 in c.lost_nodes
        t = 6.5
    c.node_returned(1, t)
    assert c.released() == {3}
