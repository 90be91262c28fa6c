"""Two more premises of FSDP inside a replica (docs/runtime.md, FSDP inside a replica),
checked on torch's own FSDP2 (``fully_shard``) before the worker is built on them:

- **A broken attempt leaves FSDP2 ready for the next one, on another group.** Under ``unicron
  run`` a replica's collectives go through a process group written in Python
  (:class:`unicron.dtensor.ReplicaGroup`): when the replica breaks, that collective and every
  later one of the attempt return at once on meaningless values, the script's passes run to
  their end, the worker drops the attempt and the next epoch's collectives run over a new
  gloo group under the same module. Here a stand-in with that contract breaks at each
  collective of a middle step's forward and backward passes, and at the first and the last
  collective of the run (outputs left NaN), its gloo group is made anew, and the run ends
  with the bits of a run that never broke: FSDP2 keeps nothing of the broken attempt that
  the next one sees. (FSDP2 calls ``all_gather_single`` and ``reduce_scatter_single`` on
  its group, as on ``ReplicaGroup``; and it must be told to sum,
  ``set_force_sum_reduction_for_comms``, as ``ReplicaGroup`` only sums.)
- **A place's state can be written in place by name.** The runtime moves state by the names
  of ``state_dict()`` into tensors it already has (the state transfer, a ZeRO share, a
  reshard). With FSDP2 those are DTensors whose ``to_local()`` is the rank's shard: a rank
  that lost its model's and optimizer's shards, written back into ``to_local()`` of each
  entry by name, trains on to the bits of a rank that never lost them.

Two ranks over gloo in one FSDP2 group; the exactness of the sums is
``tests/test_fsdp_exact.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_fsdp_exact import _batch, _model
from unicron.dtensor import _Done  # a collective over when returned, as ReplicaGroup's

pytestmark = pytest.mark.e2e

STEPS = 3
PER_STEP = 9
"""the collectives of one step of the model below (counted by the first test): an all-gather
per module in the forward pass, and an all-gather or a reduce-scatter in the backward"""


class _Replica(dist.ProcessGroup):
    """``ReplicaGroup``'s contract over a gloo group that can be replaced (``inner``): each
    collective runs to its end, or, from the ``break_at``-th on (``broken``), returns at once
    with its outputs NaN."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.inner: Any = None
        self.calls = 0
        self.break_at: int | None = None
        self.broken = False
        self._name: str | None = None

    def getBackendName(self) -> str:
        return "test-replica"

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        assert self._name is not None
        return self._name

    def _run(self, out: list[torch.Tensor], run: Callable[[], None]) -> _Done:
        self.calls += 1
        self.broken = self.broken or (self.break_at is not None and self.calls >= self.break_at)
        if self.broken:
            for t in out:
                t.fill_(float("nan"))
        else:
            run()
        return _Done(out)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        return self._run(
            [out], lambda: dist.all_gather_into_tensor(out, inp.contiguous(), group=self.inner)
        )

    def allgather_into_tensor_coalesced(
        self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None
    ) -> _Done:
        def run() -> None:
            for o, i in zip(outs, inps, strict=True):
                dist.all_gather_into_tensor(o, i.contiguous(), group=self.inner)

        return self._run(outs, run)

    def reduce_scatter_single(
        self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> _Done:
        assert getattr(opts, "reduceOp", dist.ReduceOp.SUM) == dist.ReduceOp.SUM

        def run() -> None:
            total = inp.contiguous().clone()
            dist.all_reduce(total, group=self.inner)
            out.copy_(total.view(self.size(), *out.shape)[self.rank()])

        return self._run([out], run)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:  # type: ignore[override]
        def run() -> None:
            for t in tensors:
                dist.all_reduce(t, group=self.inner)

        return self._run(tensors, run)

    def new_epoch(self) -> None:
        """The next epoch: a new gloo group under the same module, nothing broken."""
        self.inner = dist.new_group(ranks=list(range(self.size())), backend="gloo")
        self.broken, self.break_at = False, None


def _sharded(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    sharded = [m for m in model if isinstance(m, torch.nn.Linear)] + [model]
    for m in sharded:
        fully_shard(m, mesh=mesh)
    for m in sharded:  # sums only, as over a Unicron replica (FSDP2 divides after)
        m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(
    group: _Replica, mesh: Any, *, break_at: tuple[int, int] | None = None, lose_at: int = -1
) -> dict[str, torch.Tensor]:
    """``STEPS`` steps; ``break_at`` (step, n): the step's first attempt breaks at its n-th
    collective and is dropped; ``lose_at``: before that step, the rank's every shard of the
    model and the optimizer is zeroed and written back by name."""
    model, opt = _sharded(mesh)
    step, broke = 0, False
    while step < STEPS:
        if step == lose_at:
            _lose_and_write_back(model, opt)
        if break_at is not None and step == break_at[0] and not broke:
            group.calls, group.break_at, broke = 0, break_at[1], True
        x, y = _batch(step, group.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        if group.broken:  # the worker drops the attempt; the next epoch has a new group
            model.zero_grad(set_to_none=True)
            group.new_epoch()
            continue
        opt.step()
        model.zero_grad(set_to_none=True)
        step += 1
    group.break_at = None
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _lose_and_write_back(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """What a transfer does for a rank that lost its state: each entry of the model's and the
    optimizer's state dicts written by name into the tensors the rank has."""
    from torch.distributed.tensor import DTensor

    def local(v: Any) -> torch.Tensor:
        return v.to_local() if isinstance(v, DTensor) else v

    params = {k: local(v).clone() for k, v in model.state_dict().items()}
    states = {
        (i, k): local(v).clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
    }
    assert states, "the optimizer has state to lose (a step before)"
    with torch.no_grad():
        for v in model.state_dict().values():
            local(v).zero_()
        for s in opt.state.values():
            for v in s.values():
                local(v).zero_()
        for k, v in model.state_dict().items():
            local(v).copy_(params[k])
        for i, s in enumerate(opt.state.values()):
            for k, v in s.items():
                local(v).copy_(states[i, k])


def _rank(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = _Replica(rank, 2)
    dist.Backend.register_backend("test-replica", lambda *_: group, devices=["cpu"])
    assert dist.new_group(ranks=[0, 1], backend="test-replica") is group
    group.new_epoch()
    mesh = DeviceMesh.from_group(group, "cpu")
    ref = _train(group, mesh)
    per_step = (group.calls - 6) // STEPS  # the last 6: full_tensor's gathers
    results = []
    # at each collective of a middle step, and the first and the last of the run
    cuts = [(0, 1), *((1, n) for n in range(1, per_step + 1)), (STEPS - 1, per_step)]
    for step, n in cuts:
        got = _train(group, mesh, break_at=(step, n))
        results.append(f"break {step}.{n} {all(torch.equal(got[k], ref[k]) for k in ref)}")
    # a zeroed state written back, as a stand-in for a lost place's shards from a replica
    got = _train(group, mesh, lose_at=1)
    results.append(f"written back {all(torch.equal(got[k], ref[k]) for k in ref)}")
    # and the check can fail: a state zeroed and not written back is another run
    model, _ = _sharded(mesh)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.to_local().zero_()
    zeroed = {k: v.full_tensor() for k, v in model.state_dict().items()}
    results.append(
        f"zeroed {any(not torch.equal(zeroed[k], _model().state_dict()[k]) for k in zeroed)}"
    )
    if rank == 0:
        Path(out).write_text(f"{per_step}\n" + "\n".join(results))
    dist.destroy_process_group()


def test_fsdp2_heals_from_a_broken_attempt_and_a_state_written_back_by_name(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    per_step, *results = out.read_text().splitlines()
    assert int(per_step) == PER_STEP, "the model's collectives per step changed: recount"
    assert len(results) == PER_STEP + 4
    assert all(r.endswith("True") for r in results), [r for r in results if r.endswith("False")]
