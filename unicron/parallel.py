"""Tensor parallelism inside a replica: the layers a script builds its shard of the model with.

A task run with ``--tp T`` (task file: ``tp: T``) trains replicas of T ranks on one node.
Each rank builds the same model with its own shard of the large matrices, Megatron-LM's way:
a :class:`ColumnParallelLinear` keeps a slice of the output features (attention heads, the
MLP's hidden units), a :class:`RowParallelLinear` the matching slice of the input features
and sums the partial outputs over the replica; everything else (embeddings, norms, the
output head) is replicated and gets the same gradient on every rank of the replica::

    tp = unicron.parallel.tensor_parallel()          # this rank's place and the degree
    self.up = ColumnParallelLinear(dim, 4 * dim, tp)  # each rank: 4 * dim / tp outputs
    self.down = RowParallelLinear(4 * dim, dim, tp)   # sums the ranks' partial outputs

The layers reach the replica's process group through :class:`TensorParallel`, which the
worker (:mod:`unicron.worker`) points at a new group each epoch: the model is built once and
never rebuilt, whatever the membership does. Its sums are waited for in slices like every
collective of the runtime; when the group breaks (a rank of the replica failed, or the epoch
was superseded) the attempt is lost: :attr:`TensorParallel.broken` is set, later sums of the
attempt are skipped (the forward and backward passes run to their end on meaningless values,
so that a script's own loop never sees the failure), and the worker drops the attempt's work
and leaves the epoch at the commit. Outside ``unicron run`` (or with ``tp`` 1) the layers are
plain linear layers, or use a torch process group handed to :meth:`TensorParallel.bind`.

Bits: the replica's sums are of ``tp`` partial outputs; for a fixed layout they are the same
operations on the same operands whichever replica computes a micro-batch, so the exact
reduce's guarantee holds (docs/runtime.md, Model-parallel replicas). The weights are drawn
whole from the global RNG, as ``nn.Linear`` would (the same stream on every rank), and each
rank keeps its slice: a model built at ``tp`` T holds the same numbers as one built at 1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unicron.protocol import ENV_TP, ENV_TP_RANK

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallel",
    "copy_to_replica",
    "reduce_from_replica",
    "tensor_parallel",
]


class TensorParallel:
    """This rank's place in its replica (:attr:`rank` of :attr:`size`) and the replica's sum.

    One per process (:func:`tensor_parallel`). The worker binds each epoch's group of the
    replica (:meth:`bind_epoch`) and reads :attr:`broken` after each micro-batch."""

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} outside 0..{size - 1}")
        self.rank = rank
        self.size = size
        self.broken: BaseException | None = None
        """why this attempt's sums failed (``None``: they did not)"""
        self._sum: Callable[[torch.Tensor], None] | None = None
        self._catch: tuple[type[BaseException], ...] = ()

    def bind(self, group: Any) -> None:
        """Sum over a torch process group (a script of its own, outside ``unicron run``)."""
        self._sum = lambda t: dist.all_reduce(t, group=group)
        self._catch, self.broken = (), None

    def bind_epoch(
        self, allreduce: Callable[[torch.Tensor], None], catch: type[BaseException]
    ) -> None:
        """Sum with ``allreduce`` (in place) from now on; an exception of type ``catch`` from
        it breaks the attempt (:attr:`broken`). Called by the worker entering an epoch."""
        self._sum, self._catch, self.broken = allreduce, (catch,), None

    def reset(self) -> None:
        """A new attempt at a step begins: nothing is broken (the worker calls it)."""
        self.broken = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the replica's ranks (a new tensor); ``x`` itself with
        ``size`` 1, or once the attempt is broken."""
        if self.size == 1 or self.broken is not None:
            return x
        if self._sum is None:
            raise RuntimeError(
                f"tensor parallel over {self.size} ranks without a group: run the script "
                "under `unicron run --tp N`, or TensorParallel.bind(process_group)"
            )
        out = x.contiguous().clone()
        try:
            self._sum(out)
        except self._catch as exc:  # a rank of the replica is gone, or the epoch is over
            self.broken = exc
        return out

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``(start, size)`` of ``n`` features split evenly over the replica."""
        if n % self.size:
            raise ValueError(
                f"{what}: {n} is not divisible by the tensor-parallel size {self.size}"
            )
        k = n // self.size
        return self.rank * k, k


_TP: TensorParallel | None = None


def tensor_parallel() -> TensorParallel:
    """This process's :class:`TensorParallel`: under ``unicron run --tp T`` its slot's place
    in its replica (fixed for the slot's life) and T; else rank 0 of 1."""
    global _TP
    if _TP is None:
        size = int(os.environ.get(ENV_TP, "1"))
        _TP = TensorParallel(int(os.environ.get(ENV_TP_RANK, "0")) if size > 1 else 0, size)
    return _TP


class _CopyToReplica(torch.autograd.Function):
    """Identity forward; the gradient summed over the replica backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce(grad), None


class _ReduceFromReplica(torch.autograd.Function):
    """Sum over the replica forward; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        out = tp.all_reduce(x)
        return x.clone() if out is x else out  # broken: a new tensor all the same

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_replica(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``x`` as the input of column-parallel layers: its gradient is summed over the replica."""
    return x if tp.size == 1 else _CopyToReplica.apply(x, tp)


def reduce_from_replica(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of the replica's partial outputs ``x``."""
    return x if tp.size == 1 else _ReduceFromReplica.apply(x, tp)


def _drawn(out_features: int, in_features: int) -> torch.Tensor:
    """A whole weight drawn as ``nn.Linear`` draws it (the same RNG stream on every rank)."""
    w = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    return w


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with this rank's slice of the output features (no bias): the input is
    replicated, the output stays split (feed it to a :class:`RowParallelLinear`)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        start, k = tp.shard(out_features, "ColumnParallelLinear out_features")
        self.weight = nn.Parameter(_drawn(out_features, in_features)[start : start + k].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_replica(x, self.tp), self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with this rank's slice of the input features (no bias): the input is the
    split output of column-parallel layers, the partial outputs are summed over the replica."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        start, k = tp.shard(in_features, "RowParallelLinear in_features")
        self.weight = nn.Parameter(_drawn(out_features, in_features)[:, start : start + k].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_replica(F.linear(x, self.weight), self.tp)
