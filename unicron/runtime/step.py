"""One attempt at a step of the task: the object the step API hands to a script's loop.

:class:`Step` is what ``for step in unicron.worker.Loop(...)`` yields (re-exported as
``unicron.worker.Step``); each call goes to the worker's runner (``unicron.worker._Runner``),
which owns the state: the micro-batches of the attempt, the local sums, the commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from unicron.detect.busy import read_queued_s
from unicron.runtime.group import EpochGroup, EpochOver
from unicron.runtime.microbatches import refuse

if TYPE_CHECKING:
    from unicron.worker import _Runner

__all__ = ["Step"]


class Step:
    """One attempt at a step of the task, handed out by :class:`Loop`.

    Iterate it for this replica's micro-batches (each collated, moved to the device, with the
    RNG seeded by (seed, step, micro-batch)), call :meth:`backward` with each one's loss, then
    :meth:`commit`. Or, with a data pipeline of your own: :attr:`microbatches` are the ids,
    :meth:`samples` their dataset indices, and :meth:`batch` seeds and returns one batch. A
    step whose commit returns False is handed out again, with only the micro-batches that
    nobody living has computed.
    """

    def __init__(self, runner: _Runner, index: int, todo: list[int], group: EpochGroup) -> None:
        self._r = runner
        self.index = index
        """the step of the task (steps committed before it)"""
        self.microbatches = tuple(todo)
        """ids of this replica's micro-batches in this attempt (0 .. num_microbatches-1)"""
        self.epoch = group.info.epoch
        self.rank = group.rank
        self.world = group.world
        self.stages = runner.pipe.stages
        """the pipeline stages of this attempt's layout (1: no pipeline)"""
        self.stage = runner.pipe.stage
        """this rank's stage of them"""
        self.loss: float | None = None
        """the step's mean loss over all its micro-batches, once committed"""
        self.committed = False
        self.closed = False
        self.broken: EpochOver | None = None
        """why the commit failed (the epoch changed); the loop goes to the next epoch"""
        self.began = time.perf_counter()
        self.cpu_at_start = time.thread_time()
        """the computing thread's CPU time when the attempt began (an injected slow fault)"""
        self.queued_at_start = read_queued_s()
        """this thread's run-queue wait so far (:mod:`unicron.detect.busy`)"""

    def __repr__(self) -> str:
        return f"Step({self.index}, microbatches={list(self.microbatches)}, epoch={self.epoch})"

    def _left(self) -> Iterator[int]:
        """This rank's micro-batches of the attempt not computed yet, read as each is
        reached, until the replica breaks (the commit then says False, the step comes again):
        :meth:`~unicron.runtime.microbatches.MicroBatches.mine`."""
        return self._r.mb.mine(self)

    def __iter__(self) -> Iterator[Any]:
        for mb in self._left():
            yield self.batch(mb)
            if mb in self._r.mb.pending:
                refuse(
                    f"step {self.index}: micro-batch {mb} was handed out but not computed: call "
                    "step.backward(loss) for every batch the step yields"
                )

    @property
    def todo(self) -> int:
        """How many of :attr:`microbatches` are left to compute in this attempt (those kept
        from an interrupted attempt are not computed again)."""
        return sum(mb not in self._r.mb.done for mb in self.microbatches)

    def batches(self) -> Iterator[Any]:
        """This replica's micro-batches, each handed out as it is yielded, before the
        backward passes of the earlier ones: compute forward passes ahead (keeping each
        loss), then call :meth:`backward` with the losses in the order of the batches (a
        pipeline stage's order: :func:`unicron.parallel.schedule`; :func:`unicron.worker.train`
        does it). In a pipeline (:attr:`stages` > 1) a stage then computes one micro-batch
        while its neighbours compute others; each micro-batch's gradient still goes to the
        reducer on its own, so the step's bits are those of the one-at-a-time order. Each
        micro-batch's activations are kept until its backward pass. Yields nothing more once
        the attempt is broken."""
        for mb in self._left():
            self._r.mb.open(self, mb, ahead=True)
            yield self._r.make_batch(self.index, mb)

    def samples(self, mb: int) -> list[int]:
        """Dataset indices of micro-batch ``mb`` of this step."""
        return self._r.data.samples(self.index, mb)

    def batch(self, mb: int) -> Any:
        """Micro-batch ``mb``, collated and on the device; the RNG is seeded for it. Its
        gradient goes in with the next :meth:`backward`."""
        self._r.mb.open(self, mb)
        return self._r.make_batch(self.index, mb)

    def backward(self, loss: torch.Tensor, *, run: Callable[[], None] | None = None) -> None:
        """``loss.backward()`` for the current micro-batch (its mean loss, not divided by the
        number of micro-batches: the commit divides the sum): the gradient hooks add each
        parameter's gradient into this replica's local sums, and the last micro-batch's start
        the exchange. ``run``: the backward pass itself, where something else drives it (a
        torch ``PipelineStage``'s ``backward_one_chunk``: :mod:`unicron.pipelining`); ``loss``
        then holds the micro-batch's loss once ``run`` returns."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            refuse(f"step.backward(loss): loss must be a one-element tensor, got {loss!r}")
        self._r.mb.backward(self, loss, run)

    def add_gradients(self, grads: Sequence[torch.Tensor | None], loss: float) -> None:
        """Hand over the current micro-batch's gradients yourself (e.g. from
        ``torch.autograd.grad``): one per trainable parameter, in ``model.parameters()`` order
        (None: zero), and its loss."""
        self._r.mb.add_gradients(self, grads, loss)

    def commit(self, *, before_optimizer: Callable[[], object] | None = None) -> bool:
        """Reduce every replica's sums, vote, step the optimizer with the mean gradient.
        True: the step committed (:attr:`loss` holds its loss). False: the membership changed
        (a peer failed or one joined mid-step); the loop hands this step out again in the new
        epoch, with whatever is left to compute. ``before_optimizer`` runs once the mean
        gradient is in each parameter's ``.grad``, right before ``optimizer.step()`` (e.g.
        ``lambda: clip_grad_norm_(model.parameters(), 1.0)``)."""
        return self._r.commit(self, before_optimizer)
