"""PyTorch's own pipeline stage (``torch.distributed.pipelining.PipelineStage``) in a healing
replica.

A script whose stage module is plain PyTorch (it takes the previous stage's output and
returns its own, the last stage the model's output) wraps it in :class:`Stage` and hands that
to :func:`unicron.worker.train`::

    import unicron.pipelining

    stage = unicron.pipelining.Stage(
        module, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        example_input=torch.zeros(mbs, seq, dim),   # this stage's input (stage 0: the batch's)
        example_output=torch.zeros(mbs, seq, dim),  # its output (the last stage: the logits)
    )
    unicron.worker.train(model=module, optimizer=opt, stage=stage, dataset=..., ...)

Inside is torch's ``PipelineStage``: its ``forward_one_chunk`` and ``backward_one_chunk``
compute each micro-batch (torch's autograd plumbing between stages, its activation and
gradient buffers, its backward), and its ``get_fwd_recv_ops`` / ``get_fwd_send_ops`` /
``get_bwd_recv_ops`` / ``get_bwd_send_ops`` name what crosses to the neighbouring stages.
What Unicron changes:

- **The order.** Not one of torch's schedules: they run the step's micro-batches themselves
  and add their gradients up in one ``.grad``, where the exact reduce needs each
  micro-batch's gradient apart (the summation tree over micro-batch indices that makes the
  bits independent of which replica computed what), and the worker hands out the
  micro-batches a replica computes (those kept from an interrupted attempt are not computed
  again). The worker drives the stage in GPipe's or 1F1B's order
  (:func:`unicron.parallel.schedule`); each backward pass goes through
  ``step.backward(loss, run=...)``, so the gradient hooks take each micro-batch's gradient.
- **The wire.** The ops the stage names run over the epoch's links to the neighbouring
  stages (:class:`~unicron.parallel.PipelineParallel`'s ``send_activation`` ...), waited for in
  slices like every transfer of the runtime; a broken link breaks the attempt (later
  transfers are skipped, the passes run on to their end, the worker drops the attempt). A
  gradient carries the micro-batch's loss back, so every stage knows the step's loss. The
  stage's ``group`` (torch's numbering of the stages) is a group of PyTorch's ``fake`` backend
  over the replica's default group of :func:`unicron.dtensor.replica_world`: it never
  communicates.
- **Set-up without the schedule.** torch's schedules prepare a stage's buffers at their first
  step, after a warm-up vote over the stages on whether shapes must be inferred (torch 2.13).
  :class:`Stage` is given its shapes (``example_input``, ``example_output``), which is what
  the vote settles as static, and prepares the buffers itself: the only private parts of torch
  it uses (:func:`_prepare`).

Bits: the stage module computes what :mod:`unicron.parallel`'s hand-written stages compute
(``receive`` and ``send`` around the same layers), so the example trains to the same bits
either way (tested end to end). What is not here: a change of the pipeline depth (the
stage's index and count are fixed for the process's life: ``--pp-choices`` and ``--tp-choices``
are refused in one line), interleaved
(virtual) stages, torch's zero-bubble split of the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from unicron.dtensor import replica_world
from unicron.errors import UsageError
from unicron.parallel import layouts, pipeline_parallel, tensor_parallel
from unicron.runtime import device as D

if TYPE_CHECKING:
    from unicron.runtime.step import Step

__all__ = ["Stage"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)``: the micro-batch's mean loss from the last stage's output (as
torch's schedules take it)"""


class Stage:
    """This slot's pipeline stage as a torch ``PipelineStage`` over ``module``, driven by the
    worker (:func:`unicron.worker.train` with ``stage=``). A batch is ``(input, target)``: the
    first stage feeds ``input`` to its module, the last computes ``loss_fn(output, target)``.
    Without a pipeline (``--pp 1``) the module is run as it is."""

    def __init__(
        self,
        module: nn.Module,
        *,
        loss_fn: LossFn,
        example_input: torch.Tensor,
        example_output: torch.Tensor,
    ) -> None:
        if len(layouts()) > 1:
            raise UsageError(
                "--pp-choices or --tp-choices with torch's PipelineStage: a stage keeps its "
                "index and the pipeline's depth for the process's life (use "
                "unicron.parallel's stages to change the layout)"
            )
        self.module, self.loss_fn = module, loss_fn
        self.pp = pipeline_parallel()
        self.torch: PipelineStage | None = None
        """torch's stage (None without a pipeline)"""
        self._chunks = 0  # the forward passes of the attempt so far: each one's chunk id
        self._prepared = False
        if self.pp.stages > 1:
            replica_world()
            par = tensor_parallel()
            ranks = [s * par.size + par.rank for s in range(self.pp.stages)]
            group = dist.new_group(ranks=ranks, backend="fake")
            self.torch = PipelineStage(
                module, self.pp.stage, self.pp.stages, D.current(),
                input_args=_example(example_input, grad=not self.pp.first),
                output_args=_example(example_output, grad=not self.pp.last),
                group=group,
            )  # fmt: skip
            self.torch.has_backward = True

    def begin(self, num_microbatches: int) -> None:
        """An attempt at a step begins (of at most ``num_microbatches`` here): the stage's
        buffers of an earlier attempt are dropped (one left unfinished by a broken replica,
        too). Called by the worker."""
        self._chunks = 0
        st = self.torch
        if st is None:
            return
        if not self._prepared:
            st.device = self.pp.device  # where the worker put the model
            _prepare(st, num_microbatches)
            self._prepared = True
        st.clear_runtime_states()

    def forward(self, batch: tuple[Any, Any]) -> tuple[int, torch.Tensor]:
        """The forward pass of the next micro-batch: its chunk id and its loss (before the
        last stage, a scalar that the backward pass fills in from the gradient's loss)."""
        x, y = batch
        chunk, self._chunks = self._chunks, self._chunks + 1
        st = self.torch
        if st is None:
            return chunk, self.loss_fn(self.module(x), y)
        for op in st.get_fwd_recv_ops(chunk):
            # torch marks the chunk's buffer as needing a gradient at its first use; the
            # receive writes its storage (found in review: a staged copy_ into it, gloo
            # carrying CUDA tensors, failed from the second attempt on)
            self.pp.receive_activation(op.tensor.detach())
        out = st.forward_one_chunk(chunk, (x,) if self.pp.first else (),
                                   save_forward_output=False)  # fmt: skip
        if self.pp.last:
            return chunk, self.loss_fn(out, y)
        for op in st.get_fwd_send_ops(chunk):
            self.pp.send_activation(op.tensor.contiguous())
        return chunk, torch.zeros((), dtype=torch.float32)

    def backward(self, step: Step, computed: tuple[int, torch.Tensor]) -> None:
        """The backward pass of the oldest micro-batch forwarded (``computed``: what
        :meth:`forward` returned), through ``step.backward``."""
        chunk, loss = computed
        st = self.torch
        if st is None:
            step.backward(loss)
            return

        def run() -> None:
            if not self.pp.last:
                for op in st.get_bwd_recv_ops(chunk):
                    op.tensor.copy_(self.pp.receive_gradient(op.tensor.shape, op.tensor.dtype))
                loss.fill_(self.pp.loss)  # the last stage's, come back with the gradient
            st.backward_one_chunk(chunk, loss=loss if self.pp.last else None)
            for op in st.get_bwd_send_ops(chunk):
                self.pp.send_gradient(op.tensor)

        step.backward(loss, run=run)


def _example(t: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """A shape example as the stage wants it: an activation that crosses between stages
    requires a gradient (the stage then makes buffers for the gradient going back)."""
    t = t.detach()
    return t.requires_grad_() if grad else t


def _prepare(st: PipelineStage, num_microbatches: int) -> None:
    """Make the stage's buffers for up to ``num_microbatches`` chunks, as torch's schedules do
    at their first step, from the shapes it was given. torch 2.13 first runs a warm-up vote
    over the stages on whether those suffice (``InferenceMode``: they do when every stage was
    given its shapes and holds no DTensor, as here); the vote's outcome is set instead."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # a torch without the vote
        pass
    else:
        st._inference_mode = InferenceMode.STATIC
    st._prepare_forward_infra(num_microbatches, None, None, has_backward=True)
    st._prepare_backward_infra(num_microbatches)
