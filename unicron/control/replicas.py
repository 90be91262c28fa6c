"""Replicas of several ranks: which slots train together as one model-parallel replica.

A task with ``tp`` > 1 (tensor parallel) runs each replica on ``tp`` slots of one node: the
slots of the task on a node, in slot order, in groups of ``tp``; a slot's *place* in its
group is its tensor-parallel rank, fixed for the slot's life (its worker builds that shard
of the model: :data:`unicron.protocol.ENV_TP_RANK`, which the agent computes the same way).
An epoch holds whole replicas only: a replica that lost a rank sits out until the rank is
back, its other ranks alive and waiting (never killed for it), and rejoins at a step
boundary with the shard of each place streamed from the same place in a live replica.

Pure functions over a task's :class:`~unicron.control.slots.SlotTable`, called by the
membership judges (:mod:`unicron.control.membership`) before each epoch is announced, and by
:func:`unicron.control.membership.worker_done` to compare the replicas' results place by
place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from unicron.control.slots import SlotTable

__all__ = ["group_of", "orphans", "place", "whole"]


def group_of(slots: SlotTable, slot: int, tp: int) -> tuple[int, ...]:
    """The slots of ``slot``'s replica, in place order (fewer than ``tp`` on a node whose
    slot count ``tp`` does not divide: that group is never whole)."""
    on = slots.on_node(slots[slot].node)
    first = on.index(slot) // tp * tp
    return tuple(on[first : first + tp])


def place(slots: SlotTable, slot: int, tp: int) -> int:
    """``slot``'s tensor-parallel rank in its replica."""
    return slots.on_node(slots[slot].node).index(slot) % tp


def whole(slots: SlotTable, candidates: Sequence[int], tp: int) -> tuple[int, ...]:
    """The replicas all of whose slots are ``candidates``, each in place order, in the order
    their first slot comes in ``candidates`` (members keep their order, replica by replica)."""
    if tp == 1:
        return tuple(candidates)
    given, out = set(candidates), list[int]()
    for slot in candidates:
        if slot in out:
            continue
        group = group_of(slots, slot, tp)
        if len(group) == tp and given.issuperset(group):
            out.extend(group)
    return tuple(out)


def orphans(slots: SlotTable, before: Iterable[int], members: Sequence[int]) -> list[int]:
    """Living slots of the epoch ``before`` that the next one (``members``) leaves out while
    they stay in the plan: the other ranks of a broken replica, waiting for it to be whole."""
    kept = set(members)
    return [s for s in before if s not in kept and s in slots and slots[s].alive]
