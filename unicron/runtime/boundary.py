"""What a worker does at a step boundary after a commit: the persistent checkpoint; after
the task's last step, the report that it is done (:func:`finish`).

Called by the worker's commit (:meth:`unicron.worker._Runner.commit`) once the step is
applied, on every member: replica 0 checkpoints the committed state when the interval says
so (:func:`unicron.runtime.checkpoint.at_boundary_of`: every shard at the same steps); with
a sharded optimizer every member takes part, since the shares of the state gather at replica
0 first (:meth:`unicron.runtime.zero.Zero.gather`). The copy is taken here, the write runs in
the background. An epoch that ends meanwhile, or a store that stops answering, is returned:
the step is committed all the same, without a checkpoint, and the worker leaves the epoch.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from unicron import messages as M
from unicron.protocol import checkpoint_at_key
from unicron.runtime import checkpoint as C
from unicron.runtime.context import save_atomic
from unicron.runtime.digest import params_sha256
from unicron.runtime.group import EpochOver, StoreLost, store_calls

if TYPE_CHECKING:
    from unicron.worker import _Runner

__all__ = ["checkpoint", "finish"]


def checkpoint(r: _Runner, rank: int) -> EpochOver | None:
    """Checkpoint the committed state of member ``rank`` if the interval says so; why the
    epoch ended meanwhile, or ``None``."""
    if r.ckpt is None:
        return None
    try:
        with store_calls():
            if r.zero is not None:
                return _shares(r, rank)
            C.at_boundary_of(
                r.ckpt, r.store, checkpoint_at_key(r.ctx.task), rank=rank, size=r.R,
                model=r.model, optimizer=r.optimizer, step=r.step,
                world=r.groups[-1].world, now=time.time(), data=r.data.state(),
            )  # fmt: skip
    except StoreLost as exc:
        return exc
    return None


def _shares(r: _Runner, rank: int) -> EpochOver | None:
    """:func:`checkpoint` with a sharded optimizer: every member learns the checkpoint's step
    from the store (:func:`unicron.runtime.checkpoint.agreed`), the shares of the state
    gather at replica 0, which writes the unsharded files, then forgets what it does not
    keep."""
    assert r.ckpt is not None and r.zero is not None and r.dp is not None
    now, data = time.time(), r.data.state()
    at = C.agreed(r.ckpt, r.store, checkpoint_at_key(r.ctx.task), rank=rank, model=r.model,
                  optimizer=r.optimizer, step=r.step, now=now, data=data)  # fmt: skip
    if not at:
        return None
    try:
        r.zero.gather(r.dp, r.groups[-1], writer=rank < r.R)
        if rank < r.R:
            r.ckpt.save(r.model, r.optimizer, step=r.step, world=r.groups[-1].world, now=now,
                        data=data)  # fmt: skip
    except EpochOver as exc:
        return exc
    finally:
        r.zero.drop()
    return None


def finish(r: _Runner, epoch: int, last_loss: float) -> tuple[str, int]:
    """The task's last step is committed and every value of it is here: replica 0 writes the
    final files (a file per shard), and the worker reports done with its parameters' digest
    (the coordinator compares the replicas'). Called by the worker's loop
    (:meth:`unicron.worker._Runner.attempts`) in the epoch it finished in, and again in each
    newer epoch it serves before the task is over. Returns (digest, rank in the epoch)."""
    r.grads.stop()
    if r.ckpt is not None:
        r.ckpt.join()
    group = r.groups[-1]
    sha = params_sha256(r.model)
    if group.rank < r.R and r.out is not None:
        name = "final.pt" if r.R == 1 else f"final.shard{r.place}.pt"
        save_atomic(r.model.state_dict(), r.out / name)
    # final_loss: none when no step was computed here (a resume of a run that had finished)
    r.link.send(M.WorkerDone(slot=r.ctx.slot, ts=time.time(), steps=r.step,
                             final_loss=None if math.isnan(last_loss) else last_loss,
                             params_sha256=sha, rank=group.rank, epoch=epoch,
                             shard=r.place))  # fmt: skip
    return sha, group.rank
