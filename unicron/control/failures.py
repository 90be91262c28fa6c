"""Failure handling: one place where the escalation's decisions are turned into moves.

Judges over a task's :class:`~unicron.control.book.TaskBook`, called under its
:class:`~unicron.control.coordinator.Coordinator`'s lock: a worker process gone
(:func:`worker_failed`), an error raised inside a living worker (:func:`worker_error`, healed
after its grace period by :func:`heal_errors`), a straggler (:func:`worker_slow`), and, from
:mod:`~unicron.control.health`, a lost node (:func:`node_lost`) and a stuck collective
(:func:`collective_stuck`). Each asks the task's
:class:`~unicron.control.escalation.Escalation` (:meth:`~Escalation.decide`, whose per-slot
memory lives on the slots), writes the ``action`` event with its reason, and acts: a
reattempt (a new epoch of the same members), a restart in the slot, an exclusion of the slot
or its node (:mod:`~unicron.control.readmission`), then a new epoch or a wait
(:func:`unicron.control.membership.reform`).
"""

from __future__ import annotations

import logging

from unicron.control import membership, readmission
from unicron.control.book import TaskBook, TaskState
from unicron.control.escalation import Decision
from unicron.control.slots import SlotState
from unicron.detect.classify import (
    Action,
    Scope,
    Severity,
    Verdict,
    classify_detector,
    classify_exit,
)
from unicron.detect.stall import Phase, Progress
from unicron.messages import Census, Kill, Probe, Spawn

log = logging.getLogger(__name__)

CONTROL_ERRORS_FAIL = 3
"""reports the coordinator may fail to apply (its own bugs, logged with their tracebacks)
before it fails the task instead of leaving it waiting for decisions that never come"""

MIN_COPIES = 2
"""a straggler is dropped only if at least this many other workers hold the task's state: with
one copy left, the next fault of any kind rolls the task back to its checkpoint (the fault soak
lost 3 steps so: a slow worker dropped from two, then a crash of the last one)"""


def control_error(b: TaskBook, what: str, now: float) -> None:
    """The coordinator failed to apply a report (``what``: the report's kind and the error; a
    bug of its own: reports are screened before they get here): an event in the task's log,
    and after :data:`CONTROL_ERRORS_FAIL` of them the task fails with the reason."""
    b.control_errors += 1
    b.emit("control_plane", ts=now, what=f"could not apply a report ({what})",
           errors=b.control_errors)  # fmt: skip
    if b.control_errors >= CONTROL_ERRORS_FAIL:
        membership.fail(b, f"the coordinator failed to apply {b.control_errors} reports (the "
                        f"last: {what}); its log has the tracebacks", now)  # fmt: skip


def worker_failed(b: TaskBook, slot: int, verdict: Verdict, now: float) -> None:
    """The worker process in ``slot`` is gone (its agent already logged the detection)."""
    b.exited = True
    s = b.slots[slot]
    s.ended()
    if s.leaving:  # given back anyway: no healing, the slot is the task's no more
        membership.worker_left(b, slot)
        membership.reform(b, now, f"slot {slot} released")
        return
    s.last_error = verdict.reason
    b.forget(slot)
    if b.over():
        return
    if membership.conclude_if_done(b):  # lost after every other member finished
        return
    b.last_error = verdict.reason
    kept = keeps_last_copies(b, slot)
    if s.excluded and not kept:
        # taken out already (a dropped straggler, a slot excluded on its own account)
        s.kept = False
        membership.reform(b, now, f"slot {slot} excluded")
        return
    decision = b.escalation.decide(verdict, slot=slot, node=s.node, now=now, last_copies=kept)
    b.action(decision.action, slot, decision.reason, int(decision.severity), now)
    excluded = decision.exclude_slot or decision.action is Action.EXCLUDE
    # the failure that tipped its node over, the slot itself under its limits: it is
    # kept like the node's living workers if the state now lives only there
    tipped = decision.exclude_node and not decision.exclude_slot
    in_place = (kept and not excluded) or (tipped and state_only_on(b, s.node, slot))
    if excluded and not in_place:
        readmission.exclude(b, slot, now)
    out_before = s.excluded
    if decision.exclude_node or (verdict.scope is Scope.NODE and decision.action is Action.EXCLUDE):
        readmission.exclude_node(b, s.node, verdict, now)
    if in_place and s.excluded and not out_before:  # its node's exclusion said it was out
        b.action(Action.READMIT, slot, f"slot {slot}: restarted in place", 1, now)
    if in_place:
        # restarted in place (kept): in the plan, to take the state from its
        # neighbours when it joins
        if excluded:
            reason = (
                f"slot {slot}: restart in place (node {s.node} is excluded but holds "
                "the task's last copies)"
            )
            b.action(Action.RESTART, slot, reason, int(Severity.SEV2), now)
        s.kept = True
        s.readmit()
        s.excluded_at = None
    else:
        s.kept = False
    if not membership.reform(b, now, f"slot {slot} lost: {verdict.kind}"):
        return
    if not s.excluded:
        b.spawn(slot)


def worker_error(
    b: TaskBook, slot: int, verdict: Verdict, now: float, *, in_place: bool, epoch: int | None
) -> None:
    """An error raised inside a living worker (in-band). ``in_place``: the worker already
    retried the step (SEV3): the decision is recorded, and the worker restarted only if the
    escalation says the retries are used up. Otherwise a collective of ``epoch`` failed and
    the worker waits for a newer epoch: :func:`heal_errors` gives it one after the grace
    period (a newer epoch announced meanwhile, for a process or node failure, heals it too)."""
    if not in_place:
        epoch = b.epoch if epoch is None else epoch
        o = b.slots[slot]
        if epoch >= b.epoch:
            o.progress = Progress(epoch, Phase.LEFT, -1, now)
        o.erred(now, verdict, epoch)
        return
    decision = decide_in_band(b, slot, verdict, now)
    b.action(decision.action, slot, decision.reason, int(decision.severity), now)
    if decision.action is not Action.REATTEMPT:
        b.kill(slot, verdict, now)


def heal_errors(b: TaskBook, now: float) -> None:
    """An in-band error whose epoch is still the current one after the grace period (no
    process or node failure explained it with a newer epoch) gets a reattempt: a new epoch
    of the same members. Dropping it would leave the reporter waiting for an epoch that
    never comes, and its peers blocked in a collective it left."""
    for slot in b.slots.pending_errors():
        o = b.slots[slot]
        e = o.pending_error
        assert e is not None
        if (
            b.epoch > e.epoch
            or slot not in b.members
            or not o.alive
            or b.state is TaskState.WAITING  # the epoch that ends the wait heals it
        ):
            o.pending_error = None  # a newer epoch (or its exit) heals it
        elif now - e.ts > b.settings.error_grace_s:
            o.pending_error = None
            decision = decide_in_band(b, slot, e.verdict, now)
            b.action(decision.action, slot, decision.reason, int(decision.severity), now)
            if decision.action is Action.REATTEMPT:
                membership.announce(
                    b,
                    b.members,
                    urgent=True,
                    now=now,
                    reason=f"reattempt after {e.verdict.kind} on slot {slot}",
                )
            else:  # escalated: restart the process; its exit is handled as a failure
                b.kill(slot, e.verdict, now)


def decide_in_band(b: TaskBook, slot: int, verdict: Verdict, now: float) -> Decision:
    """The escalation's decision on an in-band error, except for a worker kept running on
    an excluded slot or node (the last copies of the state): a transient (SEV3) error there
    is reattempted, never a reason to kill the state's last holder."""
    s = b.slots[slot]
    if s.excluded and s.alive and verdict.severity is Severity.SEV3:
        reason = (
            f"{verdict.kind} on slot {slot}: reattempt (kept on an excluded slot or node: it "
            "holds the state and goes on until it fails)"
        )
        return Decision(Action.REATTEMPT, Severity.SEV3, reason, kind=verdict.kind)
    kept = keeps_last_copies(b, slot)
    return b.escalation.decide(verdict, slot=slot, node=s.node, now=now, last_copies=kept)


def keeps_last_copies(b: TaskBook, slot: int) -> bool:
    """The worker in ``slot`` (failed, or failing) was kept running on an excluded node
    because the task's state lived only there, and the other copies still do: a failure
    of its own restarts it in place (:func:`worker_failed`), within its own restart limit,
    so that the node keeps two copies or more until its health probe brings it back."""
    s = b.slots[slot]
    if not s.kept or s.node not in b.escalation.excluded_nodes():
        return False
    return state_only_on(b, s.node, slot)


def state_only_on(b: TaskBook, node: int, slot: int) -> bool:
    """Workers other than ``slot``'s hold the task's state, all of them on ``node``."""
    others = b.other_holders(slot)
    return bool(others) and all(b.slots[h].node == node for h in others)


def worker_slow(b: TaskBook, slot: int, verdict: Verdict, now: float) -> None:
    """A straggler: ask the planner whether the task's WAF is higher without it; act on the
    answer (drop the slot, or keep it and say why)."""
    if slot not in b.members or b.state is not TaskState.RUNNING:
        return
    mine = b.slots[slot].mb_compute_s
    peers = [
        t
        for k, o in b.slots.items()
        if k != slot and k in b.members and (t := o.mb_compute_s) is not None
    ]
    if mine is None or not peers:
        return
    from unicron.detect.straggler import straggler_plan

    drop, reason = straggler_plan(
        world=len(b.members),
        microbatches=b.microbatches or len(b.members),
        peer_mb_s=sorted(peers)[len(peers) // 2],
        slow_mb_s=mine,
        min_workers=b.settings.min_workers,
    )
    others = b.other_holders(slot)
    if drop and len(others) < MIN_COPIES:
        drop = False  # speed is not worth the state's last spare copy
        reason += (
            f"; kept: without it {len(others)} worker(s) would hold the state (it is "
            "judged again once another copy joins)"
        )
    if drop:
        b.action(Action.EXCLUDE, slot, f"straggler dropped: {reason}", 1, now)
        b.slots[slot].kept = False
        readmission.exclude(b, slot, now)
        b.kill(slot, verdict, now)
    else:
        b.action(Action.RECONFIGURE, slot, f"straggler kept: {reason}", 1, now)


def node_lost(
    b: TaskBook, node: int, silent: float, now: float, *, suspect_confirmed: bool
) -> None:
    """The agent of ``node`` has been silent for ``silent`` seconds (and, with
    ``suspect_confirmed``, a living peer's collective failed meanwhile): the node is lost,
    its slots excluded with their workers, the survivors reform. A node where the task holds
    no slot any more (it gave them back; the agent's last exchange came after) is forgotten:
    nothing of the task was lost there."""
    slots = b.slots.on_node(node)
    if not slots:
        b.forget_node(node)
        return
    b.lost_nodes.add(node)
    verdict = classify_detector("heartbeat_lost")
    b.emit(
        "error_detected",
        ts=now,
        task=b.label,
        node=node,
        kind=verdict.kind,
        severity=int(verdict.severity),
        method="heartbeat",
        silent_s=round(silent, 3),
        reason=f"no heartbeat from node {node} for {silent:.2f} s"
        + (" and a collective failed on a living peer" if suspect_confirmed else ""),
    )
    if b.over():
        return
    decision = b.escalation.decide(verdict, slot=slots[0], node=node, now=now)
    b.emit(
        "action",
        task=b.label,
        epoch=b.epoch,
        node=node,
        action=str(decision.action),
        severity=int(decision.severity),
        reason=decision.reason,
        slots=slots,
    )
    for s in slots:
        o = b.slots[s]
        if o.leaving:  # given back: gone with its node, the slot is the task's no more
            membership.worker_left(b, s)  # (found in review: it was never released)
            continue
        o.exclude()
        o.ended()  # with its node: no exit report will come
        b.forget(s)
    b.last_error = decision.reason
    membership.reform(b, now, f"node {node} lost")


def collective_stuck(b: TaskBook, reason: str, now: float) -> None:
    """Every member waits on the others outside a step: the collective itself is stuck.
    The escalation decides on the first member's account: a new epoch of the same members,
    or a restart (its exit is handled as a failure)."""
    slot = b.members[0]
    verdict = classify_detector("collective_stall")
    b.detected(slot, None, verdict, now, "stall", reason=reason)
    node = b.slots[slot].node
    decision = b.escalation.decide(verdict, slot=slot, node=node, now=now)
    b.action(decision.action, slot, decision.reason, int(decision.severity), now)
    if decision.action is Action.REATTEMPT:
        membership.announce(b, b.members, urgent=True, now=now, reason=reason)
    else:
        b.kill(slot, verdict, now)


def census(
    b: TaskBook, node: int, r: Census, queued: frozenset[tuple[type, int]] = frozenset()
) -> None:
    """An agent's account of its workers, sent when it (re)connects: a coordinator that
    adopted a running task learns from it which workers live, and heals a member gone while
    nobody listened (its exit report was lost with the old coordinator) as a process failure.
    To one that never went away it says nothing new. A member whose worker waits for an
    epoch it has not entered (restarted, or never in the adopted one: the old coordinator was
    waiting for it when it died, its epoch broken and none announced since) cannot train in
    the epoch the store still names: a new one is announced (found by the cluster soak: a
    tensor-parallel task whose coordinator died while it waited for a restarted rank waited
    for the next store loss to go on). So is one for a member whose worker finished (it told
    the old coordinator alone, and waits for the task's end: it reports again from there).

    To a coordinator that never went away it says two things: a slot it started whose
    worker the agent does not have, and an excluded slot it asked to probe whose probe does
    not run. The census comes with the first exchange after one that failed, and that one
    may have reached the coordinator and lost its answer on the way back (a reply past the
    client's timeout, a connection cut): the ``Spawn`` or ``Probe`` in it is sent again,
    unless one is still on its way (``queued``: (type, slot) of the actions in the node's
    outbox or decided in this exchange). Without this the slot waited for a worker nobody
    started, or stayed out for good. No ``Spawn`` for a slot with a kill under way (its
    ``Kill`` went with it: a new worker would outlive it), nor once the task is over. A task
    adopted by a restarted coordinator reads each node's first census after the takeover as
    above, and every later one as this (before, every census of an adopted task was read as
    the takeover's: a ``Spawn`` lost after it left its slot down for good)."""
    if node not in b.adopting:
        if b.over():
            return
        for slot in b.slots.on_node(node):
            o = b.slots[slot]
            starting = o.state in (SlotState.STARTING, SlotState.OUT_STARTING)
            lost = slot not in r.alive and o.killed_at is None and (Spawn, slot) not in queued
            if starting and lost:
                log.warning("task %s: slot %d was started but its agent has no worker there "
                            "(the answer that carried its Spawn was lost): sent again",
                            b.task, slot)  # fmt: skip
                b.send(node, Spawn(slot, place=b.place(slot)))
            out = o.probing and o.excluded and not o.alive  # a worker starting is alive
            if out and slot not in r.probing and (Probe, slot) not in queued:
                log.warning("task %s: the probe of slot %d does not run (the answer that "
                            "carried it was lost): asked again", b.task, slot)  # fmt: skip
                b.send(node, Probe(slot))
            leave = o.state is SlotState.STOPPING
            doomed = o.killed_at is not None or leave
            if doomed and slot in r.alive and (Kill, slot) not in queued:
                log.warning("task %s: slot %d's worker lives on after its kill (the answer "
                            "that carried it was lost): sent again", b.task, slot)  # fmt: skip
                verdict = o.kill_verdict if o.killed_at is not None else None  # (not a leaver's)
                b.send(node, Kill(slot, verdict, leave=leave))
        return
    b.adopting.discard(node)
    outside: list[int] = []
    finished: list[int] = []
    for slot, o in b.slots.items():
        if o.node != node:
            continue
        alive = slot in r.alive
        o.seen(alive=alive, ready=slot in r.ready or (alive and slot in b.members))
        if slot in r.starting or slot in r.ready:  # a model it built, in no epoch yet
            # its first epoch: the adopted one if announced with it ready, else a later one
            first = b.epoch if slot in r.ready and slot in b.members else b.epoch + 1
            o.born = max(o.born, first - 1)  # no commit of an epoch before it is its
            o.has_state = o.has_state and not b.trained  # adopt presumed it in every slot
        if not o.alive and slot in b.members and not o.excluded:
            worker_failed(b, slot, classify_exit(-9), r.ts)
        elif alive and slot in r.ready and slot in b.members:
            outside.append(slot)
        elif alive and slot in r.done and slot in b.members:
            finished.append(slot)
    if (outside or finished) and b.state is TaskState.RUNNING:
        # a member that finished before the takeover reported it to the old coordinator
        # alone: it waits for the task's end, and reports again from a new epoch
        what = []
        if outside:
            what.append(f"slot(s) {', '.join(map(str, outside))} wait outside the adopted epoch")
        if finished:
            what.append(f"slot(s) {', '.join(map(str, finished))} finished before the takeover")
        membership.announce(b, b.members, urgent=True, now=r.ts, reason="; ".join(what))


def agent_back(b: TaskBook, node: int, now: float) -> None:
    """A new agent registered for ``node`` (:meth:`Coordinator.node_returned`): a node the
    task judged lost returns (:func:`readmission.node_returned`). One it never judged lost
    (another task did, and the node was fenced, which stopped this task's workers too; or the
    registration beat this task's heartbeat timeout) lost its workers with the old agent all
    the same: each ends, the survivors reform, and each starts again with the new agent's
    worker, a restart its escalation does not count (found in review: the dead workers stayed
    members holding the state until their peers' errors or a stall said otherwise)."""
    if node in b.lost_nodes or not b.active():
        readmission.node_returned(b, node, now)
        return
    for slot in [s for s in b.slots.on_node(node) if b.slots[s].leaving]:
        membership.worker_left(b, slot)  # given back: its worker went with the old agent
    gone = [s for s in b.slots.on_node(node) if b.slots[s].alive]
    b.new_agent(node, now)
    for slot in gone:
        b.slots[slot].ended()
        b.forget(slot)
    if not gone or not membership.reform(b, now, f"node {node}'s agent was replaced"):
        return
    for slot in gone:
        if b.slots[slot].excluded:
            continue  # kept on an excluded node: its worker is gone, it stays out
        b.action(Action.RESTART, slot, f"node {node}'s agent was replaced: a new worker", 2, now)
        b.started(slot)
