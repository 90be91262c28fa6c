"""Replicas of several ranks: which slots train together as one model-parallel replica.

A task of ``tp`` x ``pp`` > 1 ranks per replica (tensor and pipeline parallel) runs each
replica on that many slots of one node: the slots of the task on a node, in slot order, in
groups of ``tp * pp``; a slot's *place* in its group (stage ``place // tp``, tensor-parallel
rank ``place % tp``) is fixed for the slot's life (its worker builds that shard of the model:
:data:`unicron.protocol.ENV_TP_RANK` and :data:`~unicron.protocol.ENV_PP_STAGE`, which the
agent computes the same way). Below, ``size`` is ``tp * pp``.
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

__all__ = ["group_of", "grouped", "orphans", "place", "place_in", "whole"]


def grouped(on: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """A node's slots ``on`` (in slot order) as replicas of ``size``: the rule every part
    shares (the table here, the agent's worker environment, the cluster's allocation). The
    last group is short where ``size`` does not divide the count: never whole."""
    return [tuple(on[i : i + size]) for i in range(0, len(on), size)]


def place_in(on: Sequence[int], slot: int, size: int) -> int:
    """``slot``'s place in its replica, among its node's slots ``on`` (:func:`grouped`)."""
    return list(on).index(slot) % size


def group_of(slots: SlotTable, slot: int, size: int) -> tuple[int, ...]:
    """The slots of ``slot``'s replica, in place order (fewer than ``size`` on a node whose
    slot count ``size`` does not divide: that group is never whole)."""
    on = slots.on_node(slots[slot].node)
    return grouped(on, size)[on.index(slot) // size]


def place(slots: SlotTable, slot: int, size: int) -> int:
    """``slot``'s place in its replica."""
    return place_in(slots.on_node(slots[slot].node), slot, size)


def whole(slots: SlotTable, candidates: Sequence[int], size: int) -> tuple[int, ...]:
    """The replicas all of whose slots are ``candidates``, each in place order, in the order
    their first slot comes in ``candidates`` (members keep their order, replica by replica)."""
    if size == 1:
        return tuple(candidates)
    given, out = set(candidates), list[int]()
    for slot in candidates:
        if slot in out:
            continue
        group = group_of(slots, slot, size)
        if len(group) == size and given.issuperset(group):
            out.extend(group)
    return tuple(out)


def orphans(slots: SlotTable, before: Iterable[int], members: Sequence[int]) -> list[int]:
    """Living slots of the epoch ``before`` that the next one (``members``) leaves out while
    they stay in the plan: the other ranks of a broken replica, waiting for it to be whole."""
    kept = set(members)
    return [s for s in before if s not in kept and s in slots and slots[s].alive]
