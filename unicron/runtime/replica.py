"""A worker's replica in an epoch: its groups, and who holds which shard of the state.

A replica is ``R = tp * pp`` ranks (docs/runtime.md, Model-parallel replicas); an epoch's
members are whole replicas in place order, member ``q*R + c`` being place ``c`` of replica
``q`` (place ``stage * tp + tp rank``). Called by the worker (:mod:`unicron.worker`) when it
enters an epoch: :func:`bind` builds this member's groups and points the model's parallel
parts at them; :func:`plan` reads the ledger exchange's rows (one per member) into what the
transition does, place by place. With ``R`` 1 both reduce to a replica of one rank: the
place's group is the epoch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unicron.parallel import PipelineParallel, TensorParallel
from unicron.runtime.group import EpochGroup, EpochOver

__all__ = ["StageLink", "SyncPlan", "bind", "plan"]

STEP, NODE, DIGEST, MASK, LAYOUT, CHECKPOINT, MOVED = 0, 1, 2, 5, -3, -2, -1
"""columns of a ledger exchange row: committed step (-1: no state), node, the parameters'
digest (step 0), data position (3, 4), then one 0/1 per micro-batch held, the layout's digest
(of the tensors in stream order), the newest persistent checkpoint's step the member can read
(-1: none), and 1 where the member's state is in a shard of another layout than the epoch's
(a layout change: :mod:`unicron.runtime.reshard`)"""


def bind(
    g: EpochGroup,
    *,
    place: int,
    par: TensorParallel,
    pipe: PipelineParallel,
    device: torch.device,
    said: Callable[[bool], None],
) -> EpochGroup:
    """This member's groups in epoch ``g``; returns its place's group (one member per replica:
    the exact reduce and the state transfer of this place's shard). The stage's ranks of the
    replica sum partial outputs (``par``); each stage is linked to its neighbours at the same
    tensor-parallel rank (``pipe``); a wait of either past
    :data:`~unicron.runtime.group.WAIT_REPORT_S` is told to ``said`` (the hang detector then
    looks at the ranks waited for)."""
    tp, size = par.size, par.size * pipe.stages
    if size == 1:
        return g
    if g.world % size or g.rank % size != place:
        raise RuntimeError(
            f"epoch {g.info.epoch}: place {place} of a replica of {size} at rank {g.rank} of "
            f"{g.world}: not whole replicas in order"
        )
    first = g.rank - place
    dp = g.subgroup(list(range(place, g.world, size)), "dp")
    if tp > 1:
        start = first + pipe.stage * tp
        replica = g.subgroup(list(range(start, start + tp)), "tp")
        replica.on_wait = said
        par.bind_epoch(replica.allreduce, EpochOver, replica)
    links: list[StageLink | None] = []
    for other in (g.rank - tp, g.rank + tp):  # the same tp rank one stage up, one down
        if not first <= other < first + size:
            links.append(None)
            continue
        pair = sorted([g.rank, other])
        up, down = g.subgroup(pair, "pp"), g.subgroup(pair, "pp-grad")
        up.on_wait = down.on_wait = said
        me = pair.index(g.rank)  # 0: the lower stage, which sends up and receives down
        links.append(StageLink(up, down) if me == 0 else StageLink(down, up))
    pipe.bind_epoch(links[0], links[1], EpochOver, device)
    return dp


class StageLink:
    """This stage's side of the link to a neighbouring stage in an epoch
    (:class:`unicron.parallel.Link`): a two-member group per direction, activations going
    up one, gradients down the other, so that each is one ordered channel whatever order the
    schedule posts the two in (1F1B). It sends over ``out`` and receives over ``into``, as
    broadcasts from the sending member. A send is posted and not waited for (the tensor is
    kept until :meth:`flush`): a stage whose neighbour sends it a gradient while it sends the
    neighbour an activation must not wait for its own send first, or both wait (a
    rendezvous transport: NCCL's, gloo's past its socket buffers). A receive is waited for in
    slices like every collective, a long wait told to the agent (the group's ``on_wait``)."""

    def __init__(self, out: EpochGroup, into: EpochGroup) -> None:
        self.out, self.into = out, into
        self._posted: list[tuple[Any, torch.Tensor]] = []

    def send(self, t: torch.Tensor) -> None:
        wired = t.to(self.out.wire, copy=True)  # the caller's tensor is free again at once
        self._posted.append((self.out.ibroadcast(wired, self.out.rank), wired))

    def recv(self, t: torch.Tensor) -> None:
        self.into.broadcast(t, 1 - self.into.rank)

    def flush(self) -> None:
        posted, self._posted = self._posted, []
        for work, _ in posted:
            self.out.wait(work)


@dataclass(frozen=True)
class SyncPlan:
    """What the ledger exchange's rows say, for the member at ``place``."""

    target: int
    """the newest committed step at which every place's state is held by some member (else
    the newest any member holds; -1: none)"""
    holders: list[list[int]]
    """per place, the replicas whose rank there holds that place's state at ``target`` (the
    first such rank's parameters); empty for a place none holds"""
    refs: list[list[int] | None]
    """per place, the first holder's row (its data position, its layout)"""
    kept: list[bool]
    """per replica, whether its sums count: every rank of it holds its place's state and
    computed the same micro-batches (a rank that left mid-way dropped its sums)"""
    done: list[set[int]]
    """per replica, the micro-batches of the step its kept sums hold (else none)"""
    checkpoint: int = -1
    """the newest persistent checkpoint's step any member can read (-1: none)"""

    @property
    def lost(self) -> bool:
        """No member holds some place's state at any one step, or a checkpoint is newer than
        the newest step they do: the last resort, the checkpoint."""
        return self.target < 0 or not all(self.holders) or self.checkpoint > self.target


def plan(rows: Sequence[Sequence[int]], size: int, microbatches: int) -> SyncPlan:
    """Read the rows of one ledger exchange (members in place order, ``size`` ranks per
    replica): per place, the replicas at the target step with the first such one's
    parameters hold that place's state, the others (joiners, replicas that differ, e.g.
    models built with other seeds) receive it, as DDP's first broadcast would. The target is
    the newest step at which every place has a holder: a member whose newer state is of one
    place only (it waited outside the epochs in which the rest of that step's holders were
    lost and the others went back to an older step) receives the older state too, rather than
    everyone reading the checkpoint once more. Pure."""
    n = len(rows) // size
    steps = sorted({r[STEP] for r in rows}, reverse=True)
    whole = (s for s in steps if s >= 0 and all(_held(rows, size, s)[1]))
    target = next(whole, steps[0])  # none whole: the newest (lost)
    refs, holders = _held(rows, size, target)
    masks = [list(row[MASK : MASK + microbatches]) for row in rows]
    kept = [
        all(q in holders[c] for c in range(size))
        and all(masks[q * size + c] == masks[q * size] for c in range(size))
        for q in range(n)
    ]
    done = [
        {mb for mb in range(microbatches) if masks[q * size][mb]} if kept[q] else set()
        for q in range(n)
    ]
    checkpoint = max(r[CHECKPOINT] for r in rows)
    return SyncPlan(target, holders, refs, kept, done, checkpoint)


def _held(
    rows: Sequence[Sequence[int]], size: int, step: int
) -> tuple[list[list[int] | None], list[list[int]]]:
    """Per place: the first row at ``step`` (or ``None``), and the replicas whose rank there
    holds the same state at ``step`` (the same parameters' digest as that first row)."""
    refs: list[list[int] | None] = []
    holders: list[list[int]] = []
    for c in range(size):
        col = rows[c::size]
        ref = next((list(row) for row in col if row[STEP] == step), None)
        refs.append(ref)
        holders.append(
            [] if ref is None else
            [q for q, row in enumerate(col) if row[STEP] == step and row[DIGEST] == ref[DIGEST]]
        )  # fmt: skip
    return refs, holders
