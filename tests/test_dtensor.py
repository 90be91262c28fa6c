"""The process group under a DTensor device mesh (:class:`unicron.dtensor.ReplicaGroup`):
each collective torch asks of it runs over the replica's group of the current epoch, to its
end, as a sum, gather, broadcast or a sum's slice; once the attempt is broken the rest of
its collectives are skipped; other reductions are refused. In one process, over a stand-in
for the epoch's group whose other rank holds known values; the real thing, under ``unicron
run`` with a rank lost and one hung, is ``tests/test_model_parallel_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from unicron.dtensor import ReplicaGroup
from unicron.parallel import TensorParallel


class _Peer:
    """The epoch's group of two ranks as rank 0 sees it: rank 1 holds ``x + 100``."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def allreduce(self, t: torch.Tensor) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        t.mul_(2).add_(100)

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        return [t.clone(), t + 100]

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.calls += 1
        if src == 1:
            t.add_(100)


def _group() -> tuple[ReplicaGroup, TensorParallel, _Peer]:
    par, peer = TensorParallel(0, 2), _Peer()
    par.bind_epoch(peer.allreduce, RuntimeError, peer)
    return ReplicaGroup(par), par, peer


def test_each_collective_runs_over_the_epochs_group_and_is_over_when_returned() -> None:
    pg, par, _ = _group()
    assert (pg.rank(), pg.size()) == (0, 2)
    t = torch.arange(4.0)
    work = pg.allreduce([t])
    assert work.is_completed() and work.wait()
    assert torch.equal(t, torch.arange(4.0) * 2 + 100)  # x + (x + 100)

    out = torch.empty(2, 3)
    pg._allgather_base(out, torch.ones(1, 3))
    assert torch.equal(out, torch.tensor([[1.0] * 3, [101.0] * 3]))

    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    b = torch.zeros(2)
    pg.broadcast([b], opts)
    assert torch.equal(b, torch.full((2,), 100.0))

    # reduce-scatter: this rank's slice of the sum
    part = torch.empty(2)
    pg._reduce_scatter_base(part, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(part, torch.tensor([102.0, 104.0]))
    assert par.used == 4  # each counted as a use of the replica (the worker's check)


def test_a_failed_collective_breaks_the_attempt_and_later_ones_are_skipped() -> None:
    pg, par, peer = _group()
    peer.fail = True
    t = torch.ones(3)
    assert pg.allreduce([t]).wait()  # returns: the forward and backward passes go on
    assert isinstance(par.broken, RuntimeError)
    peer.fail, before = False, peer.calls
    pg.allreduce([torch.ones(3)])
    pg._allgather_base(torch.empty(2, 1), torch.ones(1, 1))
    assert peer.calls == before  # skipped: the attempt is dropped at its commit
    par.reset()
    x = torch.ones(1)
    pg.allreduce([x])
    assert x.item() == 102.0  # the next attempt sums again


def test_only_sums_are_reduced_and_a_replica_without_an_epoch_says_how_to_run() -> None:
    pg, _, _ = _group()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    with pytest.raises(NotImplementedError, match="only sums"):
        pg.allreduce([torch.ones(1)], opts)
    alone = ReplicaGroup(TensorParallel(1, 2))
    with pytest.raises(RuntimeError, match="unicron run --tp"):
        alone.allreduce([torch.ones(1)])


def test_a_replica_of_one_rank_copies() -> None:
    """A mesh of one tensor-parallel rank (``--tp 1``): every collective is a copy or
    nothing, without an epoch's group."""
    pg = ReplicaGroup(TensorParallel(0, 1))
    t = torch.arange(3.0)
    pg.allreduce([t])
    assert torch.equal(t, torch.arange(3.0))
    out = torch.empty(1, 3)
    pg._allgather_base(out, t.view(1, 3))
    assert torch.equal(out[0], t)
    part = torch.empty(3)
    pg._reduce_scatter_base(part, t)
    assert torch.equal(part, t)
