"""PyTorch's own tensor parallelism (DTensor, ``parallelize_module``) in a healing replica.

A script that splits its model with ``torch.distributed.tensor.parallel`` does it here the
way torchtitan does, with the plan PyTorch documents, and gets the healing of
``unicron.parallel``'s hand-written layers (docs/runtime.md, Model-parallel replicas)::

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    import unicron.dtensor

    for block in model.blocks:                       # plain nn.Linear layers, drawn whole
        unicron.dtensor.parallelize(block, {"attn.q": ColwiseParallel(),
                                            "attn.o": RowwiseParallel(), ...})

Two things make a DTensor model live through membership changes without being rebuilt:

- **One device mesh for the slot's life, over a group that changes under it.** The mesh's
  process group is a :class:`ReplicaGroup`: a ``torch.distributed.ProcessGroup`` written in
  Python whose collectives go to the replica's group of the current epoch (the worker points
  :class:`~unicron.parallel.TensorParallel` at it each epoch), waited for in slices like every
  collective of the runtime. When the replica breaks (a rank failed, the epoch was
  superseded) the attempt is broken: that collective and every later one of the attempt
  return at once on meaningless values, the script's forward and backward passes run to
  their end, and the worker drops the attempt (the hand-written layers' contract). c10d
  finds the group by name, and ``DeviceMesh`` needs a default process group to number its
  ranks: each worker makes one that never communicates (PyTorch's ``fake`` backend, a world
  of the replica's ranks numbered by place, :func:`replica_world`), once, in
  :func:`device_mesh`. The runtime's own groups do not use it.
- **The state stays plain tensors.** :func:`parallelize` applies the plan with
  ``parallelize_module`` (each rank keeps its slice of the weights it drew whole, as the
  seeded hand-written layers do: ``src_data_rank=None``, no communication), then keeps each
  DTensor parameter's local shard as the module's parameter and rebuilds the DTensor view
  of it at each forward (``DTensor.from_local``, no communication). So the runtime's reduce,
  state transfer, resharding, checkpoints and digests see ordinary tensors by their usual
  names, and gradients reach the local shards through DTensor's autograd.

Bits: for ``tp`` 2 a split layer sums two partial results (one addition, which commutes), as
the hand-written layers do, so the exact reduce's guarantee holds (tested end to end:
``tests/test_model_parallel_e2e.py``). ``tp`` 1: :func:`parallelize` leaves the module as it
is. Supported collectives: the sum (all-reduce), all-gather, broadcast and reduce-scatter
(a sum's slice); other reductions are refused with a one-line error. With a pipeline, a stage's
module may be split this way and wrapped in torch's ``PipelineStage`` (:mod:`unicron.
pipelining`). What is not here: a change of the tensor-parallel degree.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from unicron.parallel import TP_DIM, TensorParallel, pipeline_parallel, tensor_parallel
from unicron.runtime.device import ENV_DEVICE_KIND

__all__ = ["ReplicaGroup", "device_mesh", "mesh_over", "parallelize", "replica_world"]

BACKEND = "unicron"
"""the c10d backend name under which :class:`ReplicaGroup` is registered"""


class _Done(dist._Work):
    """A collective that is over when it is returned (:class:`ReplicaGroup` runs each to its
    end, or breaks the attempt, before it returns): ``wait`` has nothing to wait for."""

    def __init__(self, out: list[torch.Tensor]) -> None:
        super().__init__()
        self._out = out

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._out

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(self._out)
        return fut


def _sum_only(opts: Any, what: str) -> None:
    op = getattr(opts, "reduceOp", opts)
    if op is not None and op != dist.ReduceOp.SUM:
        raise NotImplementedError(
            f"{what} with {op} over a Unicron replica: only sums are supported (DTensor's "
            "Partial placements of a tensor-parallel plan are sums)"
        )


class ReplicaGroup(dist.ProcessGroup):
    """The process group of a :func:`device_mesh`: the ranks of one stage of a replica
    (``par.size`` of them, this slot being ``par.rank``), whose collectives run over the
    epoch's group that :class:`~unicron.parallel.TensorParallel` is bound to now
    (:meth:`~unicron.parallel.TensorParallel.collective`). c10d and DTensor call its methods
    (torch's C++ dispatch reaches these Python overrides); each collective is over when it
    returns, or skipped once the attempt is broken."""

    def __init__(self, par: TensorParallel) -> None:
        super().__init__(par.rank, par.size)  # type: ignore[call-arg]  # pybind's (rank, size)
        self.par = par
        self._name: str | None = None

    def getBackendName(self) -> str:
        return BACKEND

    # c10d names the group when it registers it (``new_group``); the C++ base keeps the
    # name only for groups with a C++ backend, so it is kept here
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # a property in the C++ base
        if self._name is None:
            raise ValueError("ProcessGroup name not set")
        return self._name

    def _run(self, what: str, out: list[torch.Tensor], run: Any) -> _Done:
        if self.par.size == 1:
            run(_ALONE)  # a replica of one rank: each collective is a copy, or nothing
        else:
            self.par.collective(what, run)
        return _Done(out)

    # -- the collectives (arguments as torch's ProcessGroup passes them) -------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:  # type: ignore[override]
        _sum_only(opts, "all-reduce")

        def run(g: Any) -> None:
            for t in tensors:
                g.allreduce(t)

        return self._run("all-reduce", tensors, run)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        return self.allreduce(tensors, opts)

    def _gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        def run(g: Any) -> None:
            torch.cat(g.allgather(inp.contiguous()), out=out.view(-1, *inp.shape[1:]))

        return run

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        return self._run("all-gather", [out], self._gather_into(out, inp))

    all_gather_single = _allgather_base  # type: ignore[assignment]  # FSDP2 calls this name

    def allgather_into_tensor_coalesced(
        self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None
    ) -> _Done:
        def run(g: Any) -> None:
            for o, i in zip(outs, inps, strict=True):
                self._gather_into(o, i)(g)

        return self._run("all-gather", outs, run)

    def allgather(  # type: ignore[override]  # the overload c10d calls
        self, outs: list[list[torch.Tensor]], inps: list[torch.Tensor], opts: Any = None
    ) -> _Done:
        def run(g: Any) -> None:
            for olist, i in zip(outs, inps, strict=True):
                for o, got in zip(olist, g.allgather(i.contiguous()), strict=True):
                    o.copy_(got)

        return self._run("all-gather", [o for olist in outs for o in olist], run)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:  # type: ignore[override]
        root = int(getattr(opts, "rootRank", 0))

        def run(g: Any) -> None:
            for t in tensors:
                g.broadcast(t, root)

        return self._run("broadcast", tensors, run)

    def _scatter_sum(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        def run(g: Any) -> None:
            total = inp.contiguous().clone()
            g.allreduce(total)
            out.copy_(total.view(self.par.size, *out.shape)[self.par.rank])

        return run

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        _sum_only(opts, "reduce-scatter")
        return self._run("reduce-scatter", [out], self._scatter_sum(out, inp))

    # FSDP2 calls this name (dist.reduce_scatter_single) where no custom one is set
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None
    ) -> _Done:
        _sum_only(opts, "reduce-scatter")

        def run(g: Any) -> None:
            for o, i in zip(outs, inps, strict=True):
                self._scatter_sum(o, i)(g)

        return self._run("reduce-scatter", outs, run)

    def barrier(self, opts: Any = None) -> _Done:
        return self._run("barrier", [], lambda g: g.allreduce(torch.zeros(1)))


class _Alone:
    """The collectives of a group of one rank (a mesh of one tensor-parallel rank)."""

    def allreduce(self, t: torch.Tensor) -> None:
        return None

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        return None


_ALONE = _Alone()
_MESH: DeviceMesh | None = None


def replica_world(par: TensorParallel | None = None) -> None:
    """A default process group that never communicates (PyTorch's ``fake`` backend), numbering
    the replica's ranks by place (stage x tp + tensor-parallel rank, a world of tp x pp; or
    the ranks of ``par``, a replica's FSDP ranks): ``DeviceMesh``, ``new_group`` and a
    ``PipelineStage`` (:mod:`unicron.pipelining`) need one. Made once per process, for the
    layout it starts at."""
    pipe = pipeline_parallel()
    par = par or tensor_parallel()
    size, rank = par.size * pipe.stages, pipe.stage * par.size + par.rank
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise RuntimeError(
                "unicron: a default process group of another world is initialized (under "
                "`unicron run` a script does not call init_process_group)"
            )
        return
    dist.init_process_group("fake", rank=rank, world_size=size, store=dist.HashStore())


def device_mesh(device_type: str | None = None) -> DeviceMesh:
    """This slot's one-dimensional device mesh over its replica's tensor-parallel ranks
    (:func:`unicron.parallel.tensor_parallel`), the same object for the process's life; its
    group is a :class:`ReplicaGroup`. ``device_type``: ``cuda`` when the worker's device is
    a GPU (default: the device of ``unicron run --device``)."""
    global _MESH
    if _MESH is None:
        _MESH = mesh_over(tensor_parallel(), device_type)
    return _MESH


def mesh_over(par: TensorParallel, device_type: str | None = None) -> DeviceMesh:
    """A one-dimensional device mesh over the ranks of ``par`` (a stage's tensor-parallel
    ranks, or a replica's FSDP ranks: :func:`unicron.fsdp.mesh`) whose group is a
    :class:`ReplicaGroup`; made once per process (the group is registered under
    :data:`BACKEND`)."""
    replica_world(par)
    first = dist.get_rank() - par.rank  # the world's rank is this slot's place
    group = ReplicaGroup(par)
    dist.Backend.register_backend(BACKEND, lambda *_: group, devices=["cpu", "cuda"])
    made = dist.new_group(ranks=list(range(first, first + par.size)), backend=BACKEND)
    assert made is group, "c10d returned another group than the Unicron replica's"
    kind = device_type or ("cuda" if _on_gpu() else "cpu")
    return DeviceMesh.from_group(group, kind)


def _on_gpu() -> bool:
    return os.environ.get(ENV_DEVICE_KIND, "cpu") == "cuda"


def parallelize(
    module: nn.Module,
    plan: Mapping[str, ParallelStyle] | ParallelStyle,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Split ``module`` over its replica's tensor-parallel ranks with PyTorch's ``plan``
    (``ColwiseParallel``, ``RowwiseParallel``, ... by submodule name, as for
    ``parallelize_module``), on :func:`device_mesh`; returns ``module``. Its parameters stay
    plain tensors, each the rank's shard (see the module docstring). Every rank must have
    built the same whole module (the same seed): each keeps its slice, nothing is sent.
    With one tensor-parallel rank, ``module`` is left as it is."""
    if tensor_parallel().size == 1 and mesh is None:
        return module
    mesh = mesh or device_mesh()
    parallelize_module(module, mesh, dict(plan) if isinstance(plan, Mapping) else plan,
                       src_data_rank=None)  # fmt: skip
    for mod in module.modules():
        views: dict[str, tuple[Any, ...]] = {}
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                split = [q.dim for q in p.placements if isinstance(q, Shard)]
                if split:  # the slice a layout change or a checkpoint re-slices by
                    setattr(local, TP_DIM, split[0])
                mod._parameters[name] = local
                views[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
        if views:
            mod.register_forward_pre_hook(functools.partial(_as_dtensors, views), prepend=True)
            mod.register_forward_hook(functools.partial(_as_shards, views), always_call=True)
    return module


def _as_dtensors(views: dict[str, tuple[Any, ...]], mod: nn.Module, _: Any) -> None:
    """Before ``mod``'s forward: its split parameters as DTensors over their local shards
    (an instance attribute, found before ``nn.Module``'s parameter lookup)."""
    for name, (mesh, placements, shape, stride) in views.items():
        local = mod._parameters[name]
        assert local is not None
        mod.__dict__[name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )


def _as_shards(views: dict[str, tuple[Any, ...]], mod: nn.Module, _: Any, __: Any) -> None:
    """After ``mod``'s forward: the parameters are the plain shards again."""
    for name in views:
        mod.__dict__.pop(name, None)
