"""Exclusion and readmission: slots and nodes taken out of the plan, and brought back.

Judges over a task's :class:`~unicron.control.book.TaskBook`, called under its
:class:`~unicron.control.coordinator.Coordinator`'s lock. :mod:`~unicron.control.failures`
takes slots out (:func:`exclude`, :func:`exclude_node`) when the escalation says so; the
ticker asks an excluded slot's agent for a health probe once its cool-down is over
(:func:`probe_excluded`; the cool-down doubles per exclusion, :func:`probe_due`); the agent's
answer readmits it, with its node, or keeps it out longer (:func:`probe_done`,
:func:`probe_not_started`); a lost node's new agent brings its slots back
(:func:`node_returned`).
"""

from __future__ import annotations

import logging

from unicron.control.book import TaskBook
from unicron.detect.classify import Action, Verdict
from unicron.messages import Probe

log = logging.getLogger("unicron.control.coordinator")

PROBE_BACKOFF_MAX = 8.0
"""the probe cool-down doubles per exclusion up to this many times ``readmit_after_s`` (8 min
at the default), so a slot that failed often is still probed before the default give-up
deadline (10 min) of a task waiting for it"""


def exclude(b: TaskBook, slot: int, now: float) -> None:
    """Take ``slot`` out of the plan until a health probe brings it back. The probe
    backoff counts the exclusions since the slot last stayed in the plan for a whole
    escalation window (``restart_window_s``): older ones are independent events."""
    o = b.slots[slot]
    back, o.readmitted_at = o.readmitted_at, None
    if back is not None and now - back >= b.escalation.settings.restart_window_s:
        o.exclusions = 0
    o.exclude()
    o.excluded_at = now
    o.exclusions += 1


def exclude_node(b: TaskBook, node: int, verdict: Verdict, now: float) -> None:
    """Take every slot of ``node`` out of the plan. Its living workers are killed only if
    the task's state lives on elsewhere (what each holder there holds, another node holds
    too: :meth:`TaskBook.other_holders`, shard by shard): the last copies keep running rather
    than the task rolling back to a checkpoint, and one that fails on its own account is
    restarted in place (:func:`unicron.control.failures.keeps_last_copies`). (Before, any
    holder on another node would do: PP=2 x DP=2 with each replica's stages on two nodes,
    stage 1's node excluded while the other replica's stage 1 restarted, killed the last
    stage 1, and the task failed.)"""
    state_elsewhere = all(
        any(b.slots[o].node != node for o in b.other_holders(h))
        for h in b.slots.holders()
        if b.slots[h].node == node
    )
    own = b.escalation.excluded_slots()
    for slot, o in b.slots.items():
        if o.node != node:
            continue
        if not o.excluded:
            exclude(b, slot, now)
            # said per slot: the cluster's planner parks a replica by its excluded ranks
            b.action(Action.EXCLUDE, slot, f"node {node} excluded: {verdict.reason}", 1, now)
        if o.alive and state_elsewhere:
            o.gone()  # doomed: not a member of the next epoch
            b.kill(slot, verdict, now)
        elif o.alive and slot not in own:
            o.kept = True


def probe_due(b: TaskBook, slot: int) -> float:
    """When the excluded ``slot`` may be probed: the cool-down doubles per exclusion (see
    :func:`exclude`), up to :data:`PROBE_BACKOFF_MAX` times ``readmit_after_s``."""
    o = b.slots[slot]
    assert o.excluded_at is not None
    backoff = min(2.0 ** ((o.exclusions or 1) - 1), PROBE_BACKOFF_MAX)
    return o.excluded_at + b.settings.readmit_after_s * backoff


def probe_excluded(b: TaskBook, now: float) -> None:
    """Ask the agents to probe the excluded slots whose cool-down is over (slots of a
    lost node stay out: it has no agent to run a probe; so do slots where the training
    script itself failed every time, :attr:`~unicron.control.escalation.SlotRecord.
    broken_script`)."""
    for slot, o in b.slots.items():
        if o.excluded_at is None:
            continue
        # o.alive: its worker runs (a kept last copy) or its exit is not handled yet
        if o.probing or not o.excluded or o.alive or o.node in b.lost_nodes:
            continue
        if o.broken_script:
            continue  # the script fails there, not the hardware: a probe would readmit it
        if now >= probe_due(b, slot) and o.node in b.nodes:
            log.info("task %s: probing excluded slot %d", b.task, slot)
            b.send(o.node, Probe(slot))
            o.probing = True


def probe_done(b: TaskBook, slot: int, ok: bool, detail: str, now: float) -> None:
    """The health probe of the excluded ``slot`` ended: readmit it (and its node, if the node
    was excluded) and start a worker there, or keep it out for twice as long (an ``action``
    either way)."""
    o = b.slots[slot]
    o.probing = False
    if not o.excluded or o.alive or not b.active():
        return
    if o.node in b.lost_nodes:
        return  # its node went meanwhile: the slot's own health no longer matters
    if not ok:
        exclude(b, slot, now)  # again: the next wait doubles
        wait_s = probe_due(b, slot) - now
        reason = f"slot {slot} failed its health probe ({detail}); next in {wait_s:.0f} s"
        b.action(Action.EXCLUDE, slot, reason, 1, now)
        return
    assert o.excluded_at is not None
    excluded_s = now - o.excluded_at
    reason = f"slot {slot} passed its health probe after {excluded_s:.1f} s out: {detail}"
    node_back = o.node in b.escalation.excluded_nodes()
    if node_back:
        b.escalation.readmit(node=o.node)
        reason += f"; node {o.node} readmitted"
    b.escalation.readmit(slot=slot)
    b.action(Action.READMIT, slot, reason, 1, now)
    own = b.escalation.excluded_slots()  # slots excluded on their own account
    for k, x in sorted(b.slots.items()):
        if k != slot and not (node_back and x.node == o.node and x.excluded):
            continue
        if k in own or x.probing or x.leaving:
            continue  # its own exclusion (or probe) stands; or it is another task's
        if k != slot:  # said per slot, as its exclusion was
            b.action(Action.READMIT, k, f"node {o.node} readmitted with slot {slot}", 1, now)
        x.readmit()
        x.kept = False
        x.readmitted_at = now
        if not x.alive:  # a kept last copy of the state just stays a member
            b.spawn(k)


def probe_not_started(b: TaskBook, slot: int, error: str, now: float) -> None:
    """The agent could not start the probe of ``slot``: it is tried again after another
    cool-down, without counting as a failed probe."""
    o = b.slots[slot]
    o.probing = False
    o.excluded_at = now
    log.warning("task %s: probe of slot %d not started: %s", b.task, slot, error)


def node_returned(b: TaskBook, node: int, now: float) -> None:
    """The agent of the lost ``node`` is back: its slots return to the task (a ``readmit``
    action per slot); the new agent starts a worker in each. Slots excluded on their own
    account before the loss stay out."""
    if node not in b.lost_nodes:
        return
    b.lost_nodes.discard(node)  # even for a task not running: its agent must not be fenced
    b.new_agent(node, now)
    if not b.active():
        return
    b.escalation.readmit(node=node)
    own = b.escalation.excluded_slots()
    for slot, o in sorted(b.slots.items()):
        if o.node != node or slot in own or o.alive or o.leaving:
            continue
        o.readmit()
        o.excluded_at = None
        b.action(Action.READMIT, slot, f"node {node} is back", 1, now)
        b.started(slot)  # the new agent starts a worker in every slot of its task (no Spawn)
