"""PyTorch's FSDP2 inside a healing replica: ``unicron run --fsdp F``.

A script shards its model the way torchtitan does, with ``fully_shard`` on each block and
then on the whole model, on this module's mesh::

    import unicron.fsdp

    for block in model.blocks:
        unicron.fsdp.fully_shard(block)
    unicron.fsdp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)   # after sharding

Each replica is ``F`` ranks of one node; each rank keeps its shard of every parameter and of
the optimizer's state, gathers a block's parameters for its passes and computes its own
micro-batch, ``F`` at a time (docs/runtime.md, FSDP inside a replica). The worker takes
FSDP's reduce-scatter apart so that every micro-batch's gradient slice reaches the exact
reduce alone (:mod:`unicron.runtime.fsdp`): the update is the unsharded one, bit for bit,
whichever rank or replica computed which micro-batch, and a replica that loses a rank heals
as a tensor-parallel one does, its shards coming from the same place in another replica.

The mesh's group is a :class:`unicron.dtensor.ReplicaGroup` over the replica's ranks of the
current epoch: the model is sharded once and never rebuilt. With ``--fsdp 1`` (or outside
``unicron run``) :func:`fully_shard` leaves the module as it is: the same script trains
plain data-parallel replicas.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from unicron.parallel import fsdp_parallel

__all__ = ["fully_shard", "mesh", "size"]

_MESH: DeviceMesh | None = None


def size() -> int:
    """FSDP ranks per replica (``unicron run --fsdp F``; 1 without)."""
    return fsdp_parallel().size


def mesh(device_type: str | None = None) -> DeviceMesh:
    """The one-dimensional device mesh over this slot's replica's FSDP ranks, the same object
    for the process's life (``device_type``: as :func:`unicron.dtensor.device_mesh`)."""
    global _MESH
    if _MESH is None:
        from unicron.dtensor import mesh_over  # DTensor's machinery: imported when used

        _MESH = mesh_over(fsdp_parallel(), device_type)
    return _MESH


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard(module, mesh=mesh(), **kwargs)``; returns
    ``module``. Under ``--fsdp 1`` the module is left as it is. Every rank must have built the
    same whole module (the same seed): each keeps its shard of it."""
    if size() == 1:
        return module
    from torch.distributed.fsdp import fully_shard as shard

    shard(module, mesh=mesh(), **kwargs)
    return module
