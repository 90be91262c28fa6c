"""A worker's gradients, from its backward passes to the step's mean: the glue between the
user's model and the reduction of :mod:`unicron.runtime.reduce`.

:class:`Reducer` owns the trainable parameters' gradient hooks, the local sums of the step's
micro-batches (:class:`~unicron.runtime.reduce.LocalSums`) and each attempt's
:class:`~unicron.runtime.reduce.Exchange` over the epoch's group. The worker
(:mod:`unicron.worker`) calls it in the step's order: :meth:`Reducer.start` as an attempt
at a step begins, :meth:`Reducer.backward` (or :meth:`Reducer.add`) once per micro-batch,
:meth:`Reducer.finish` at the commit, then :meth:`Reducer.apply` to put the mean gradient
in ``.grad`` for the optimizer, or :meth:`Reducer.clear` when the step's work is dropped.
Buckets are launched from the gradient hooks of the attempt's last micro-batch, so the
exchange overlaps the rest of its backward pass (docs/runtime.md, Speed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unicron.runtime import reduce as R
from unicron.runtime.group import EpochGroup, EpochOver


class Reducer:
    """The gradient side of one worker (one per process, built before the first epoch).

    ``stray`` is called when a backward pass runs outside :meth:`backward` (the user's own
    ``loss.backward()``): the worker refuses it while a step is open.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        num_microbatches: int,
        *,
        exact: bool,
        bucket_cap_mb: float,
        device: torch.device,
        stray: Callable[[], None],
    ) -> None:
        self.params = list(params)
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params), torch.float32)
        cap, first = (
            max(int(mb * 2**20) // dtype.itemsize, 1)
            for mb in (bucket_cap_mb, min(bucket_cap_mb, R.FIRST_BUCKET_MB))
        )
        self.layout = R.Layout.plan([p.numel() for p in self.params], cap, first)
        self.sums = R.LocalSums(
            self.layout, num_microbatches, exact=exact, dtype=dtype, device=device
        )
        self.device = device
        self._stray = stray
        self._spaces: dict[int, R.Workspace] = {}
        self._gatherers: dict[int, R.Gatherer] = {}
        # autograd accumulates straight into the local sums (LocalSums.grad_views) where each
        # parameter's gradient can live in their buffer as it is; a node's first micro-batch
        # too where the parameters are small (R.VIEWS_FIRST_MAX)
        self._shapes = (
            [p.shape for p in self.params]
            if all(
                p.dtype == dtype and p.device == self.sums.device and p.layout == torch.strided
                for p in self.params
            )
            else None
        )
        self._views_first = self.layout.numel <= R.VIEWS_FIRST_MAX * len(self.params)
        self._in_backward = self._last = False
        self._exchange: R.Exchange | None = None  # the reduction the last micro-batch starts
        self._broken: EpochOver | None = None  # a collective the hooks started failed
        self._hooks = self._register_hooks()

    def _register_hooks(self) -> list[Any]:
        """Each parameter's gradient hook (:meth:`_grad_ready`)."""
        return [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
            for i, p in enumerate(self.params)
        ]

    # -- an attempt at a step -------------------------------------------------------------------
    def start(self, g: EpochGroup, held: Sequence[Sequence[R.Node]]) -> None:
        """An attempt at a step begins in epoch ``g``; ``held[r]`` are the tree nodes member r
        will hold once it computed its share. Drops an exchange given up before its commit."""
        if self._exchange is not None:
            self._exchange.close()
        self._broken = None
        gather = None
        try:  # the exact all-gathers' own group and thread: they overlap the backward pass
            gather = self._gatherer(g)
        except EpochOver as exc:
            self._broken = exc
        self._exchange = R.Exchange(g, self.sums, self._space(g), held, gather)

    def _begin(self, mb: int) -> None:
        for p in self.params:
            p.grad = None
        self.sums.begin(mb)

    def backward(
        self, mb: int, loss: torch.Tensor, *, last: bool, run: Callable[[], None] | None = None
    ) -> None:
        """Micro-batch ``mb``'s backward pass (``loss.backward()``, or ``run()`` where something
        else drives it: a torch ``PipelineStage``, :mod:`unicron.pipelining`); its loss is read
        from ``loss`` after it. ``last``: the attempt's last micro-batch here, whose hooks launch
        the buckets. On any failure the local sums are abandoned (half-added gradients spoil
        them: the step's work here is redone) and the error propagates."""
        self._begin(mb)
        self._in_backward, self._last = True, last
        shapes = self._shapes if self._views_first or not self.sums.starting else None
        if shapes is not None:
            for p, view in zip(self.params, self.sums.grad_views(shapes), strict=True):
                p.grad = view
        try:
            loss.backward() if run is None else run()
            finished = self.sums.end(float(loss.detach()))
        except BaseException:
            self.sums.abandon()
            raise
        finally:
            self._in_backward = False
            if shapes is not None:
                for p in self.params:
                    p.grad = None  # a backward pass of the user's own adds into nothing of ours
        self._close(last, finished)

    def add(
        self, mb: int, grads: Sequence[torch.Tensor | None], loss: float, *, last: bool
    ) -> None:
        """Micro-batch ``mb``'s gradients handed over (one per parameter, checked by the
        caller), as :meth:`backward` would have taken them."""
        self._begin(mb)
        finished: list[int] = []
        for i, grad in enumerate(grads):
            if grad is not None and (b := self.sums.add(i, grad.detach())) is not None:
                finished.append(b)
        finished += self.sums.end(float(loss))
        self._close(last, finished)

    def _close(self, last: bool, finished: list[int]) -> None:
        if last:
            for b in finished:
                self._ready(b)

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Gradient hook: parameter ``index``'s gradient of the current micro-batch is in."""
        if not self._in_backward:
            self._stray()
            return  # a backward pass of the user's own, between steps
        bucket = self.sums.hooked(index, param)
        if bucket is not None and self._last:
            self._ready(bucket)

    def _ready(self, bucket: int) -> None:
        """Launch a finished bucket's exchange; a failed launch is kept for the commit (the
        backward pass goes on, so that the local sums stay whole for the next epoch)."""
        if self._exchange is None or self._broken is not None:
            return
        try:
            self._exchange.ready(bucket)
        except EpochOver as exc:
            self._broken = exc

    def finish(self) -> tuple[list[torch.Tensor], list[float], torch.Tensor]:
        """The commit's reduction: the reduced sums (views of the third value, the whole
        buffer) and each micro-batch's loss (NaN: nobody holds it). Raises ``EpochOver`` if a
        collective failed or the epoch ended meanwhile; the exchange is dropped either way."""
        ex, self._exchange = self._exchange, None
        assert ex is not None, "finish() without start()"
        try:
            if self._broken is not None:
                raise self._broken
            grads, losses = ex.finish()
            return grads, losses, ex.space.out
        finally:
            ex.close()

    def apply(self, grads: list[torch.Tensor], whole: torch.Tensor, divisor: int) -> None:
        """Put the mean gradient in each parameter's ``.grad`` for the optimizer: ``whole``
        divided at once (one operation, not one per parameter: the same quotient in every
        element), ``grads`` its views. The caller steps the optimizer, then :meth:`clear_grads`."""
        whole.div_(divisor)
        for p, g in zip(self.params, grads, strict=True):
            mean = g.view_as(p)
            p.grad = mean if mean.dtype == p.dtype else mean.to(p.dtype)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def clear(self) -> None:
        """Drop the local sums (the step committed, or its work here is redone)."""
        self.sums.clear()

    def stop(self) -> None:
        """The worker is done: stop exact mode's gather threads."""
        for gatherer in self._gatherers.values():
            gatherer.stop()

    def close(self) -> None:
        """Another shard is trained from now on (a layout change): stop, and take the hooks
        off these parameters (the old shard may be trained again, by a new reducer)."""
        self.stop()
        for hook in self._hooks:
            hook.remove()

    # -- an epoch's buffers and threads -----------------------------------------------------------
    def _space(self, g: EpochGroup) -> R.Workspace:
        """The exchange's buffers of epoch ``g``: fresh in each epoch, since a collective of
        an abandoned epoch may still write into the buffers it was given."""
        epoch = g.info.epoch
        if epoch not in self._spaces:
            self._spaces = {epoch: R.Workspace(self.layout, g.world, self.sums.dtype, self.device)}
        return self._spaces[epoch]

    def _gatherer(self, g: EpochGroup) -> R.Gatherer | None:
        """Exact mode's gather thread of epoch ``g``, on the epoch's ``gather`` subgroup: one
        per epoch, the previous one stopped (:class:`unicron.runtime.reduce.Gatherer`). None
        in fast mode, or with too few buckets to overlap (:data:`~unicron.runtime.reduce.
        OVERLAP_BUCKETS`). Raises ``EpochOver`` if the subgroup cannot be built."""
        if not self.sums.exact or len(self.layout.buckets) <= R.OVERLAP_BUCKETS:
            return None
        epoch = g.info.epoch
        if epoch not in self._gatherers:
            for old in self._gatherers.values():
                old.stop()
            self._gatherers = {}  # stopped even if the new epoch's subgroup cannot be built
            self._gatherers = {epoch: R.Gatherer(g.subgroup(list(range(g.world)), "gather"))}
        return self._gatherers[epoch]
