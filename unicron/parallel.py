"""Model parallelism inside a replica: the parts a script builds its shard of the model with.

Tensor parallel (below) and pipeline parallel (:class:`PipelineParallel`: a stage ends in
``send``, the next begins with ``receive``; docs/runtime.md, Model-parallel replicas).

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
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unicron.protocol import (
    ENV_FSDP,
    ENV_PP,
    ENV_PP_CHOICES,
    ENV_PP_STAGE,
    ENV_TP,
    ENV_TP_CHOICES,
    ENV_TP_RANK,
)

__all__ = [
    "SCHEDULES",
    "TP_DIM",
    "ColumnParallelLinear",
    "Link",
    "PairLink",
    "PipelineParallel",
    "RowParallelLinear",
    "TensorParallel",
    "copy_to_replica",
    "fsdp_parallel",
    "layouts",
    "pipeline_depths",
    "pipeline_parallel",
    "reduce_from_replica",
    "schedule",
    "split_dims",
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
        self.used = 0
        """sums asked for so far (the worker refuses a model that never sums at ``size`` > 1)"""
        self._sum: Callable[[torch.Tensor], None] | None = None
        self._catch: tuple[type[BaseException], ...] = ()
        self.group: Any = None
        """the epoch's group of the replica's ranks of this stage (``allreduce(t)``,
        ``allgather(t) -> list``, ``broadcast(t, src)``, waited for in slices: a
        :class:`~unicron.runtime.group.EpochGroup`), for the collectives of PyTorch's own
        tensor parallelism (:mod:`unicron.dtensor`); ``None`` outside an epoch"""

    def bind(self, group: Any) -> None:
        """Sum over a torch process group (a script of its own, outside ``unicron run``)."""
        self._sum = lambda t: dist.all_reduce(t, group=group)
        self._catch, self.broken, self.group = (), None, None

    def bind_epoch(
        self,
        allreduce: Callable[[torch.Tensor], None],
        catch: type[BaseException],
        group: Any = None,
    ) -> None:
        """Sum with ``allreduce`` (in place) from now on, and run each :meth:`collective` over
        ``group``; an exception of type ``catch`` from either breaks the attempt
        (:attr:`broken`). Called by the worker entering an epoch."""
        self._sum, self._catch, self.broken, self.group = allreduce, (catch,), None, group

    def collective(self, what: str, run: Callable[[Any], None]) -> None:
        """Run ``run(group)``, one collective over the replica's ranks (:attr:`group`), as
        :meth:`all_reduce` runs its sum: counted in :attr:`used`, skipped once the attempt is
        broken, breaking it when it fails. Called by :class:`unicron.dtensor.ReplicaGroup`
        for DTensor's collectives."""
        self.used += 1
        if self.broken is not None:
            return
        if self.group is None:
            raise RuntimeError(
                f"{what} over {self.size} tensor-parallel ranks without an epoch's group: run "
                "the script under `unicron run --tp N`"
            )
        try:
            run(self.group)
        except self._catch as exc:  # a rank of the replica is gone, or the epoch is over
            self.broken = exc

    def reset(self) -> None:
        """A new attempt at a step begins: nothing is broken (the worker calls it)."""
        self.broken = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the replica's ranks (a new tensor); ``x`` itself with
        ``size`` 1, or once the attempt is broken."""
        if self.size == 1:
            return x
        self.used += 1
        if self.broken is not None:
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


class Link(Protocol):
    """This stage's side of its link to a neighbouring stage of the replica (at the same
    tensor-parallel rank): what it sends one way, what it receives the other."""

    def send(self, t: torch.Tensor) -> None:
        """Post ``t`` to the neighbour; may return before the neighbour has it (the caller
        does not use ``t`` again)."""

    def recv(self, t: torch.Tensor) -> None:
        """Fill ``t`` with the neighbour's next tensor of this direction (blocks)."""

    def flush(self) -> None:
        """Return once every tensor posted by :meth:`send` has been delivered."""


class PairLink:
    """A :class:`Link` over one channel of blocking broadcasts of the two stages,
    ``broadcast(t, src)`` (``src``: the pair's member that sends, 0 the lower stage), this
    stage being member ``me``. Both directions share the channel's one order: enough for
    GPipe's order and one at a time (each stage posts its forward passes, then its backward
    passes, in its neighbour's order), not for 1F1B (:func:`schedule`). For a script of its
    own over torch process groups (``bench/baselines/tp_ckpt.py``) and the tests; the
    worker's links (:class:`unicron.runtime.replica.StageLink`) have a channel per direction
    and post their sends."""

    def __init__(self, broadcast: Callable[[torch.Tensor, int], None], me: int) -> None:
        self._broadcast, self._me = broadcast, me

    def send(self, t: torch.Tensor) -> None:
        self._broadcast(t, self._me)

    def recv(self, t: torch.Tensor) -> None:
        self._broadcast(t, 1 - self._me)

    def flush(self) -> None:
        return None


class PipelineParallel:
    """This rank's pipeline stage (:attr:`stage` of :attr:`stages`) and its links to the
    neighbouring stages of its replica (the same tensor-parallel rank in each).

    One per process (:func:`pipeline_parallel`). A stage's module ends in :meth:`send`
    (every stage but the last: it passes its output on and returns the micro-batch's loss,
    filled in once the backward pass came back from the last stage) and begins with
    :meth:`receive` (every stage but the first); the gradient goes back over the same
    :class:`Link`. The worker computes the micro-batches in GPipe's, 1F1B's or one-at-a-time
    order (:func:`schedule`): every stage computes its forward passes in one order and its
    backward passes in the same order. A failed link breaks the attempt as a failed sum does
    (it shares :attr:`TensorParallel.broken`)."""

    def __init__(self, stage: int, stages: int, tp: TensorParallel) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"pipeline stage {stage} outside 0..{stages - 1}")
        self.stage, self.stages, self.tp = stage, stages, tp
        self.loss = 0.0
        """the current micro-batch's loss: the last stage's, set by the worker before the
        backward pass; the others', received with the gradient"""
        self._prev: Link | None = None
        self._next: Link | None = None
        self._catch: tuple[type[BaseException], ...] = ()
        self.device = torch.device("cpu")
        """where received activations and gradients are put (the worker's device)"""
        self.used = 0
        """sends and receives asked for so far"""

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def bind_epoch(
        self,
        prev: Link | None,
        next_: Link | None,
        catch: type[BaseException],
        device: torch.device | None = None,
    ) -> None:
        """Move tensors over the links of this epoch: ``prev`` to the previous stage,
        ``next_`` to the next; an exception of type ``catch`` breaks the attempt;
        ``device``: the worker's. Called by the worker."""
        self._prev, self._next, self._catch = prev, next_, (catch,)
        if device is not None:
            self.device = device

    def _move(self, link: Link | None, t: torch.Tensor, out: bool) -> None:
        """Send ``t`` over ``link`` (``out``) or receive into it, unless the attempt is
        broken; a failure breaks it."""
        self.used += 1
        if self.tp.broken is not None:
            return
        if link is None:
            raise RuntimeError(
                f"pipeline stage {self.stage} of {self.stages} without its links: run the "
                "script under `unicron run --pp N`"
            )
        try:
            link.send(t) if out else link.recv(t)
        except self._catch as exc:  # a stage of the replica is gone, or the epoch is over
            self.tp.broken = exc

    def flush(self) -> None:
        """Wait until every tensor this stage sent in the attempt is delivered (the worker
        calls it before the attempt's commit); a failed delivery breaks the attempt."""
        for link in (self._prev, self._next):
            if link is None or self.tp.broken is not None:
                continue
            try:
                link.flush()
            except self._catch as exc:
                self.tp.broken = exc

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """Pass this stage's output ``x`` to the next stage; the micro-batch's loss comes
        back (a scalar the worker's backward pass runs from; its value arrives with the
        gradient)."""
        if self.last:
            raise RuntimeError("the last pipeline stage computes the loss: it sends nothing")
        return _Send.apply(x, self)

    def receive(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:  # fmt: skip
        """The previous stage's output, of ``shape`` (the stages agree on it: the script
        knows it from the batch every stage has), as this stage's input."""
        if self.first:
            raise RuntimeError("the first pipeline stage receives nothing: it reads the batch")
        anchor = torch.zeros((), requires_grad=True)
        return _Receive.apply(anchor, self, tuple(shape), dtype)

    # -- the wire between neighbouring stages: :meth:`send` and :meth:`receive`'s autograd
    # functions use it, and so does :mod:`unicron.pipelining` (torch's PipelineStage)
    def send_activation(self, x: torch.Tensor) -> None:
        """Send ``x``, this stage's output of the current micro-batch, to the next stage
        (it must not change until :meth:`flush`)."""
        self._move(self._next, x, out=True)

    def receive_activation(self, x: torch.Tensor) -> None:
        """Fill ``x`` with the previous stage's output of the current micro-batch (left as
        it is once the attempt is broken)."""
        self._move(self._prev, x, out=False)

    def send_gradient(self, grad: torch.Tensor) -> None:
        """Send the gradient of this stage's input back to the previous stage, and the
        micro-batch's loss (:attr:`loss`) with it: one float32 buffer, the loss last."""
        buf = torch.empty(grad.numel() + 1, dtype=torch.float32, device=grad.device)
        buf[:-1].copy_(grad.reshape(-1))
        buf[-1] = self.loss
        self._move(self._prev, buf, out=True)

    def receive_gradient(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
                         ) -> torch.Tensor:  # fmt: skip
        """The gradient of this stage's output from the next stage (zeros once the attempt
        is broken); the micro-batch's loss that came with it goes to :attr:`loss`."""
        buf = torch.zeros(math.prod(shape) + 1, dtype=torch.float32, device=self.device)
        self._move(self._next, buf, out=False)
        self.loss = float(buf[-1])
        return buf[:-1].view(shape).to(dtype)


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pp: PipelineParallel) -> torch.Tensor:
        ctx.pp, ctx.shape, ctx.dtype = pp, x.shape, x.dtype
        pp.send_activation(x.detach().contiguous())
        out = torch.zeros((), dtype=torch.float32)
        ctx.out = out  # the loss, written when the gradient brings it back
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        pp: PipelineParallel = ctx.pp
        back = pp.receive_gradient(ctx.shape, ctx.dtype)
        ctx.out.fill_(pp.loss)
        return back * grad, None


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, pp: PipelineParallel,
                shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        ctx.pp = pp
        x = torch.zeros(shape, dtype=dtype, device=pp.device)
        pp.receive_activation(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.pp.send_gradient(grad)
        return None, None, None, None


SCHEDULES = ("gpipe", "1f1b", "sequential")
"""the orders a pipeline's micro-batches are computed in (:func:`schedule`)"""


def schedule(kind: str, n: int, stage: int, stages: int) -> list[tuple[bool, int]]:
    """The order in which ``stage`` of ``stages`` computes its ``n`` micro-batches of an
    attempt: ``(forward, k)`` pairs, a forward pass (``True``) or a backward pass of the
    ``k``-th micro-batch. Every stage computes its forward passes in order and its backward
    passes in the same order, whatever ``kind``:

    - ``"gpipe"``: every forward pass, then every backward pass (every micro-batch's
      activations held until its backward pass);
    - ``"1f1b"`` (Megatron-LM's): ``stages - stage - 1`` forward passes to fill the pipeline
      (fewer if ``n`` is smaller), then one forward and one backward pass in turn, then the
      backward passes left: a stage holds at most ``stages - stage`` micro-batches'
      activations. Its two neighbours post their sends in different orders, so it needs a
      channel per direction and sends that do not wait (the worker's
      :class:`~unicron.runtime.replica.StageLink`; not :class:`PairLink`);
    - ``"sequential"``: each micro-batch's forward and backward pass before the next (the
      stages take turns).

    In a pipeline (``stages`` > 1) the first two overlap the stages, with the same bubble;
    the bits are the same in every order (each micro-batch's gradient is taken on its own).
    Pure."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if kind == "sequential":
        return [(fwd, k) for k in range(n) for fwd in (True, False)]
    if kind == "gpipe":
        return [(True, k) for k in range(n)] + [(False, k) for k in range(n)]
    warmup = min(stages - stage - 1, n)
    order = [(True, k) for k in range(warmup)]
    for k in range(n - warmup):
        order += [(True, warmup + k), (False, k)]
    return order + [(False, k) for k in range(n - warmup, n)]


_TP: TensorParallel | None = None
_FSDP: TensorParallel | None = None
_PP: PipelineParallel | None = None


def tensor_parallel() -> TensorParallel:
    """This process's :class:`TensorParallel`: under ``unicron run --tp T`` its slot's place
    in its replica (fixed for the slot's life) and T; else rank 0 of 1."""
    global _TP
    if _TP is None:
        _TP = _placed(int(os.environ.get(ENV_TP, "1")) // _fsdp_size())
    return _TP


def fsdp_parallel() -> TensorParallel:
    """This process's place among its replica's FSDP ranks (``unicron run --fsdp F``: the
    replica's F ranks, whose collectives :class:`TensorParallel` runs as it runs the tensor-
    parallel sums; :mod:`unicron.fsdp`); else rank 0 of 1."""
    global _FSDP
    if _FSDP is None:
        _FSDP = _placed(_fsdp_size())
    return _FSDP


def _placed(size: int) -> TensorParallel:
    """This slot's place among ``size`` ranks of a stage (``UNICRON_TP_RANK``; 0 of 1)."""
    return TensorParallel(int(os.environ.get(ENV_TP_RANK, "0")) if size > 1 else 0, size)


def _fsdp_size() -> int:
    return int(os.environ.get(ENV_FSDP, "1"))


def pipeline_parallel() -> PipelineParallel:
    """This process's :class:`PipelineParallel`: under ``unicron run --pp P`` its slot's stage
    (fixed for the slot's life) of P; else stage 0 of 1."""
    global _PP
    if _PP is None:
        stages = int(os.environ.get(ENV_PP, "1"))
        stage = int(os.environ.get(ENV_PP_STAGE, "0")) if stages > 1 else 0
        _PP = PipelineParallel(stage, stages, tensor_parallel())
    return _PP


def pipeline_depths() -> tuple[int, ...]:
    """The pipeline depths this task may run at: its own (``--pp``) first, then those of
    ``--pp-choices`` (task file: ``pp_choices``), at which the worker calls the script's
    ``rebuild`` (:func:`unicron.worker.train`). A script checks its model splits at each
    before it builds anything."""
    return _choices(ENV_PP, ENV_PP_CHOICES)


def _choices(own_var: str, more_var: str) -> tuple[int, ...]:
    """The task's own value of ``own_var``, then the others listed in ``more_var``."""
    own = int(os.environ.get(own_var, "1"))
    more = [int(x) for x in os.environ.get(more_var, "").split(",") if x.strip()]
    return (own, *dict.fromkeys(d for d in more if d != own))


def layouts() -> tuple[tuple[int, int], ...]:
    """The ``(tp, pp)`` layouts this task may run at: its own first, then every pair of its
    tensor-parallel degrees (``--tp`` and ``--tp-choices``; task file: ``tp_choices``) and
    pipeline depths (:func:`pipeline_depths`). The worker calls the script's ``rebuild`` at
    any of them; a script checks its model splits at each before it builds anything."""
    tps, pps = _choices(ENV_TP, ENV_TP_CHOICES), pipeline_depths()
    return tuple((t // _fsdp_size(), p) for t in tps for p in pps)


TP_DIM = "tp_dim"
"""the attribute a parameter split over the tensor-parallel ranks carries: the dimension it is
split along (:func:`split_dims`; a layer of a script's own sets it on its sliced weights)"""


def split_dims(model: nn.Module) -> dict[str, int]:
    """The state-dict entries of ``model`` that each tensor-parallel rank holds a slice of
    (an equal share, rank ``r`` the ``r``-th), with the dimension they are split along: the
    parameters carrying :data:`TP_DIM` (set by :class:`ColumnParallelLinear`,
    :class:`RowParallelLinear` and :func:`unicron.dtensor.parallelize`). Every other entry is
    replicated over the ranks. Read by a layout change that changes the degree
    (:mod:`unicron.runtime.reshard`) and by a checkpoint read at another degree."""
    return {
        name: int(getattr(p, TP_DIM))
        for name, p in model.named_parameters()
        if getattr(p, TP_DIM, None) is not None
    }


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
        setattr(self.weight, TP_DIM, 0)

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
        setattr(self.weight, TP_DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_replica(F.linear(x, self.weight), self.tp)
