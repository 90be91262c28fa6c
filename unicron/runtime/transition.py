"""A worker's transition into an epoch: the ledger exchange, and the state for members
that lack it.

Called by the worker (:meth:`unicron.worker._Runner._enter`) once it has rendezvoused in a new
epoch and bound its replica's groups. One all-gather of a row per member (its committed step,
node, data position, the micro-batches of the interrupted step it holds, its state's layout)
tells every member the same thing: the newest committed step, who holds each place's state,
which replicas' partial results count (:func:`unicron.runtime.replica.plan`). Then, in order
of preference: the state streamed from the nearest holders of the same place
(:func:`unicron.runtime.transfer.transfer`); after a layout change, moved by name from the
shards of the old layout (:func:`unicron.runtime.reshard.reshard`); when no member holds
some of it, the newest persistent checkpoint (:func:`load_checkpoint`). docs/runtime.md,
A membership change and Model-parallel replicas.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unicron.parallel import layouts
from unicron.protocol import trained_key, usage_key
from unicron.runtime import byname, replica
from unicron.runtime import checkpoint as C
from unicron.runtime import ledger as L
from unicron.runtime.context import WorkerContext
from unicron.runtime.digest import params_sha256
from unicron.runtime.group import EpochGroup
from unicron.runtime.reshard import StateLost, local_spans, reshard
from unicron.runtime.transfer import Inventory, inventory, layout, model_tensors, transfer
from unicron.runtime.zero import redistribute

if TYPE_CHECKING:
    from unicron.worker import _Runner

__all__ = ["layout_root", "load_checkpoint", "sync"]

log = logging.getLogger(__name__)


def layout_root(ctx: WorkerContext, tp: int, stages: int) -> Path:
    """Where the checkpoints of the layout of ``tp`` tensor-parallel ranks and ``stages``
    pipeline stages go: the task's directory, or for another layout than the task's own (a
    layout change) its ``ppP`` folder (another depth) or ``tpTppP`` (another degree)."""
    assert ctx.checkpoint is not None
    return C.layout_dir(ctx.checkpoint, (ctx.tp, ctx.pp), (tp, stages))


def sync(r: _Runner, g: EpochGroup) -> tuple[int, str]:
    """Agree on the committed step, give state to members without it, find missing ids.

    Returns (micro-batches reused, where this epoch's joiners got state from).
    """
    if r.step == 0 and r.has_state and r.store.check([trained_key(r.ctx.task)]):
        r.has_state = False  # a fresh model, and a step has committed since it was built
    mask = [1 if mb in r.mb.done else 0 for mb in range(r.M)]
    # the parameters' digest tells replicas apart at step 0 (each member built its own
    # model, perhaps with another seed); at a committed step they are identical by
    # construction (one update applied to one state), and a pass over every parameter at
    # each transition (0.2 s at 340 MB of them) would tell nothing
    digest = 0
    if r.step == 0 and r.has_state:
        digest = int.from_bytes(bytes.fromhex(params_sha256(r.model))[:7], "big")
    tensors = model_tensors(r.model)
    mine = torch.tensor(
        [r.step if r.has_state else -1, r.ctx.node, digest, *r.data.state(), *mask,
         layout(tensors), _newest_checkpoint(r), int(r.old is not None)],
        dtype=torch.int64,
    )  # fmt: skip
    have: list[Inventory] = []

    def take() -> None:  # while the rows are on the wire: the transfer's walks, done
        have.append(inventory(tensors, r.optimizer, manifest=r.has_state))

    rows = [t.tolist() for t in g.allgather(mine, meanwhile=None if r.zero else take)]
    if any(row[replica.MOVED] for row in rows):
        return _reshard(r, g, rows)  # some member's state is in another layout
    if r.zero is not None:
        return _shares(r, g, rows)  # the optimizer's state is sharded across replicas
    size, place = r.R, r.place  # ranks per replica, this rank's place
    sp = replica.plan(rows, size, r.M)
    if sp.lost:
        # every replica is gone (or, model parallel, every copy of some place's shard at
        # the newest step): the last resort, the persistent checkpoint
        load_checkpoint(r)
        return _recomputed(r, len(rows) // size), "checkpoint"
    ref, holders = sp.refs[place], sp.holders[place]
    assert ref is not None and r.dp is not None
    needers = [q for q in range(len(rows) // size) if q not in holders]
    source = "local"
    if needers:
        # the nearest holders (on the needers' node, else all) each stream a share
        node_of = [row[replica.NODE] for row in rows[place::size]]
        near = [h for h in holders if node_of[h] == node_of[needers[0]]]
        source = "peer_node" if near else "peer_remote"
        # needers whose model's layout is the holders' post its receives at once
        at = replica.LAYOUT
        agreed = all(rows[q * size + place][at] == ref[at] for q in needers)
        if r.dp.rank in needers:  # its tensors are written in place: cut, they are a mixture
            r.has_state = False
        transfer(r.dp, r.model, r.optimizer, holders=near or holders,
                 needers=needers, device=r.device, have=have[0], agreed=agreed)  # fmt: skip
        if r.dp.rank in needers:
            r.step, r.has_state, r.laid_out = sp.target, True, False
            r.data.load(ref[3:5])  # the data position is committed state too
    return _reused(r, sp), source


def _reused(r: _Runner, sp: replica.SyncPlan) -> int:
    """The interrupted step's partial results after a transition that kept the layout: a
    replica's count when every rank of it holds its place's state and all of them computed
    the same micro-batches (:func:`replica.plan`); the micro-batches nobody holds are this
    epoch's to compute. Returns how many are reused."""
    assert r.dp is not None
    if not sp.kept[r.dp.rank]:
        r.mb.done.clear()
        r.grads.clear()
    r.held = sp.done
    r.missing = L.missing(sp.done, r.M)
    return r.M - len(r.missing)


def _recomputed(r: _Runner, replicas: int) -> int:
    """No partial result of the interrupted step counts (the checkpoint was read, or the
    layout changed): every micro-batch is computed again by the epoch's ``replicas``.
    Returns 0, the micro-batches reused."""
    r.mb.done.clear()
    r.grads.clear()
    r.missing = list(range(r.M))
    r.held = [set() for _ in range(replicas)]
    return 0


def _shares(r: _Runner, g: EpochGroup, rows: list[list[int]]) -> tuple[int, str]:
    """:func:`sync` for a sharded optimizer (:mod:`unicron.runtime.zero`): the committed step
    and the interrupted step's partial results as :func:`replica.plan` reads them; then the
    parameters a member lacks and this epoch's shares of the optimizer's state move by name
    within each place (:func:`unicron.runtime.zero.redistribute`); when some share is held by
    nobody, every member reads the checkpoint."""
    assert r.zero is not None and r.dp is not None
    size, place = r.R, r.place
    sp = replica.plan(rows, size, r.M)
    nodes = [row[replica.NODE] for row in rows[place::size]]
    holder = r.has_state and r.step == sp.target and r.dp.rank in sp.holders[place]
    try:
        if sp.target < 0 or sp.checkpoint > sp.target:
            raise StateLost("no member holds the state, or a checkpoint is newer")
        if not holder:  # what it lacks is written into its model: cut, a mixture
            r.has_state = False
        got = redistribute(r.zero, r.dp, g, nodes=nodes, holder=holder)
    except StateLost:
        load_checkpoint(r)
        r.zero.begin(nodes, r.dp.rank)
        r.zero.drop()  # the whole state was read: keep this epoch's shares
        return _recomputed(r, len(rows) // size), "checkpoint"
    ref = sp.refs[place]
    assert ref is not None
    if not holder:
        r.step, r.has_state, r.laid_out = sp.target, True, False
        r.data.load(ref[3:5])
    near = any(nodes[src] == r.ctx.node for src in got)
    source = "local" if not got else ("peer_node" if near else "peer_remote")
    return _reused(r, sp), source


def _newest_checkpoint(r: _Runner) -> int:
    """The newest step of the task's persistent checkpoints this member can read, at any of
    its pipeline depths (-1: none): the ledger exchange weighs it against the newest step the
    members hold whole (:func:`unicron.runtime.replica.plan`)."""
    if r.ctx.checkpoint is None:
        return -1
    return max(
        C.newest_step(layout_root(r.ctx, tp, depth), tp * depth)
        for tp, depth in {(r.par.size, r.pipe.stages), *layouts()}
    )


def _reshard(r: _Runner, g: EpochGroup, rows: list[list[int]]) -> tuple[int, str]:
    """The ledger exchange found state in another layout than the epoch's: every member
    fills its new shard by name (:func:`unicron.runtime.reshard.reshard`). The
    interrupted step's partial results are dropped (sums of another split)."""
    target = max(row[replica.STEP] for row in rows)
    source = None
    if r.has_state and r.step == target:
        source = r.old if r.old is not None else r.shard
    assert r.shard is not None
    try:
        if target < 0:
            raise StateLost("no member holds the state")
        if source is None and r.old is None:  # its own shard is the target: cut, a mixture
            r.has_state = False
        reshard(g, source=source, target=r.shard)
        ref = next(row for row in rows if row[replica.STEP] == target)
        r.step, r.has_state, r.old = target, True, None
        r.data.load(ref[3:5])
        source_name = "reshard"
    except StateLost:
        load_checkpoint(r)
        r.old, source_name = None, "checkpoint"
    return _recomputed(r, g.world // r.R), source_name


def load_checkpoint(r: _Runner) -> None:
    """Every replica is gone: go on from the newest valid checkpoint (a checkpoint of
    another model, data layout or reduce mode stops the task: exit 2). Model parallel:
    each rank its place's shard, of the newest step every shard has."""
    root = r.ctx.checkpoint
    found = None
    if root is not None:
        found = C.load_newest_shard(layout_root(r.ctx, r.par.size, r.pipe.stages), r.place, r.R)
        if _by_name(r, newer_than=-1 if found is None else found[0].step):
            return
    if found is None:
        raise RuntimeError("no member of the epoch holds the model state and no checkpoint")
    manifest, parts = found
    why = C.mismatch(
        manifest,
        model=C.describe_model(r.model.state_dict()),
        ledger=r.ledger.describe(),
        reduce=r.ctx.reduce,
    )
    if why is not None:
        flag = "--resume" if r.ctx.resume else "--checkpoint-dir"
        r.store.set(usage_key(r.ctx.task), f"{flag} {root}: {why}")
        raise SystemExit(2)
    _loaded(r, C.restore(parts, r.model, r.optimizer), parts)


def _loaded(r: _Runner, step: int, parts: dict[str, Any]) -> None:
    """A checkpoint of ``step`` is in the model and optimizer: the rest of the state."""
    r.step, r.has_state, r.laid_out = step, True, False
    r.data.load(parts["train"].get("data", (-1, -1)))
    if r.ckpt is not None:
        r.ckpt.last_step = r.step  # no need to write what was just read
    r.grads.clear()
    r.mb.done.clear()


def _by_name(r: _Runner, newer_than: int) -> bool:
    """After a layout change: load a newer checkpoint than this layout's own (``newer_than``)
    written at another layout of the task, entry by entry from the shards of every stage at
    the tensor-parallel ranks holding this rank's slices (at another degree: the slices
    joined and cut again; :func:`unicron.runtime.byname.load_by_name`). False if there is
    none."""
    assert r.ctx.checkpoint is not None
    mine = (r.par.size, r.pipe.stages)
    found = [
        (C.newest_step(layout_root(r.ctx, tp, depth), tp * depth), tp, depth)
        for tp, depth in set(layouts()) - {mine}
    ]
    for step, tp, depth in sorted(found, reverse=True):  # the newest first
        if step <= newer_than:
            break
        ranks = _ranks_holding(tp, r.par.size, r.par.rank)
        places = [stage * tp + rank for stage in range(depth) for rank in ranks]
        try:
            parts = byname.load_by_name(layout_root(r.ctx, tp, depth), places, tp * depth, step)
            step_read = byname.restore_by_name(
                parts, r.model, r.optimizer, part=(r.par.size, r.par.rank), of=(tp, ranks)
            )
            _loaded(r, step_read, parts)
        except C.CheckpointError as exc:
            log.warning("skipping the tp %d pp %d checkpoint of step %d: %s", tp, depth, step, exc)
            continue
        return True
    return False


def _ranks_holding(tp: int, mine_tp: int, mine_rank: int) -> list[int]:
    """The ranks of degree ``tp`` whose slices overlap rank ``mine_rank`` of ``mine_tp``'s
    (one at the same degree: the same rank)."""
    mine = (mine_tp, mine_rank)
    return [k for k in range(tp) if local_spans(mine, (tp, k), split=True) is not None]
