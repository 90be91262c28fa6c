"""Replicas of several ranks: which slots train together as one model-parallel replica.

A task of ``tp`` x ``pp`` > 1 ranks per replica (tensor and pipeline parallel) runs each
replica on ``pp`` *blocks* of ``tp`` slots: a block is ``tp`` slots of one node (a
tensor-parallel group never spans nodes: its all-reduces are on every layer's path), a
replica's stages may be on different nodes (a stage sends one activation to the next).
:func:`groups` is the one rule, shared by every part (the membership judges here, the
cluster's allocation, the agents' worker environment through the coordinator):

1. each node's slots of the task, in slot order, cut into blocks of ``tp`` (a node's last
   few, fewer than ``tp``, are a group of their own: never whole);
2. the blocks in the order of their last slot, ``pp`` at a time, are the replicas, stage by
   stage (the last group is short where ``pp`` does not divide the blocks: never whole).

A task's slots are numbered as they are added (a whole replica at a time, its blocks on the
nodes the allocation picked), so a slot added later never moves a slot of an earlier replica
(a block it completes comes last, by its new slot):
a slot's *place* in its replica (stage ``place // tp``, tensor-parallel rank ``place % tp``)
is fixed for the slot's life, and its worker builds that shard of the model
(:data:`unicron.protocol.ENV_TP_RANK`, :data:`~unicron.protocol.ENV_PP_STAGE`; the
coordinator names it with each :class:`~unicron.messages.Spawn`). Where each node holds
whole replicas (``tp * pp`` divides its slots) the replicas are those of one node: a node's
slots ``tp * pp`` at a time. An epoch holds whole replicas only: a replica that lost a rank
sits out until the rank is back, its other ranks alive and waiting (never killed for it),
and rejoins at a step boundary with the shard of each place streamed from the same place in
a live replica.

Below, ``lay`` is a layout ``(tp, pp)``. Pure functions over a task's
:class:`~unicron.control.slots.SlotTable` (or its slots' nodes), called by the membership
judges (:mod:`unicron.control.membership`) before each epoch is announced, by
:func:`unicron.control.membership.worker_done` to compare the replicas' results place by
place, and by the cluster (:mod:`unicron.control.allocation`, :mod:`unicron.control.planning`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

from unicron.control.slots import SlotTable

__all__ = ["group_of", "groups", "orphans", "place", "places", "whole"]

Layout = tuple[int, int]
Group = tuple[int, ...]


def groups(nodes: Mapping[int, int], lay: Layout) -> tuple[Group, ...]:
    """The replicas of the slots ``nodes`` (slot -> node) at layout ``lay``, each in place
    order, whole ones first in the order of their blocks' last slots, then the short ones
    (never whole); see the module docstring."""
    return _groups(tuple(sorted(nodes.items())), *lay)


@functools.lru_cache(maxsize=64)
def _groups(nodes: tuple[tuple[int, int], ...], tp: int, pp: int) -> tuple[Group, ...]:
    on: dict[int, list[int]] = {}
    for slot, node in nodes:  # in slot order
        on.setdefault(node, []).append(slot)
    blocks: list[Group] = []
    short: list[Group] = []
    for mine in on.values():
        cut = len(mine) - len(mine) % tp
        blocks += [tuple(mine[i : i + tp]) for i in range(0, cut, tp)]
        if cut < len(mine):
            short.append(tuple(mine[cut:]))
    blocks.sort(key=lambda block: block[-1])
    out = [sum(blocks[i : i + pp], ()) for i in range(0, len(blocks), pp)]
    if out and len(out[-1]) < tp * pp:
        short.append(out.pop())
    return (*out, *short)


def _nodes(slots: SlotTable) -> dict[int, int]:
    return {k: s.node for k, s in slots.items()}


def group_of(slots: SlotTable, slot: int, lay: Layout) -> Group:
    """The slots of ``slot``'s replica, in place order (fewer than ``tp * pp`` where the
    task's slots leave that group short: it is never whole)."""
    return next(g for g in groups(_nodes(slots), lay) if slot in g)


def place(slots: SlotTable, slot: int, lay: Layout) -> int:
    """``slot``'s place in its replica."""
    return group_of(slots, slot, lay).index(slot)


def places(nodes: Mapping[int, int], lay: Layout) -> dict[int, int]:
    """Each slot's place in its replica, for the slots ``nodes`` (slot -> node): what the
    coordinator tells the agents (:class:`~unicron.messages.Spawn`)."""
    return {s: i for g in groups(nodes, lay) for i, s in enumerate(g)}


def whole(slots: SlotTable, candidates: Sequence[int], lay: Layout) -> tuple[int, ...]:
    """The replicas all of whose slots are ``candidates``, each in place order, in the order
    their first slot comes in ``candidates`` (members keep their order, replica by replica)."""
    size = lay[0] * lay[1]
    if size == 1:
        return tuple(candidates)
    given, out = set(candidates), list[int]()
    of = {s: g for g in groups(_nodes(slots), lay) for s in g}
    for slot in candidates:
        if slot in out:
            continue
        group = of[slot]
        if len(group) == size and given.issuperset(group):
            out.extend(group)
    return tuple(out)


def orphans(slots: SlotTable, before: Iterable[int], members: Sequence[int]) -> list[int]:
    """Living slots of the epoch ``before`` that the next one (``members``) leaves out while
    they stay in the plan: the other ranks of a broken replica, waiting for it to be whole."""
    kept = set(members)
    return [s for s in before if s not in kept and s in slots and slots[s].alive]
