"""One worker's micro-batches of the step being computed, and the step API's rules of use.

The worker's step loop (``unicron.worker._Runner``) owns one :class:`MicroBatches`; a
:class:`~unicron.runtime.step.Step` opens each micro-batch the script asks for here, hands
each loss (:meth:`MicroBatches.backward`) or gradient (:meth:`MicroBatches.add_gradients`)
the script gives back, and the commit checks here that the attempt's work is whole
(:meth:`MicroBatches.check_whole`). What this rank has computed of the step (:attr:`done`)
is the local sums' content: the ledger exchange reads it, a transition may clear it. Bad use
is refused before anything changes (:func:`refuse`: one line, ``unicron run`` exits 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import torch

from unicron.errors import UsageError
from unicron.parallel import PipelineParallel, TensorParallel
from unicron.runtime.gradients import Reducer
from unicron.runtime.inject import FaultPlan
from unicron.runtime.rounds import Round, rounds

if TYPE_CHECKING:
    from unicron.runtime.step import Step

__all__ = ["MicroBatches", "refuse"]


def refuse(message: str) -> NoReturn:
    """Bad use of the step API: one line, :class:`UsageError` (``unicron run`` exits 2; the
    launcher reports it). Raised before the step's state changes."""
    raise UsageError(message)


@dataclass(kw_only=True)
class MicroBatches:
    """The micro-batches of the step being computed here, and the attempt handed out."""

    grads: Reducer
    par: TensorParallel
    pipe: PipelineParallel
    faults: FaultPlan
    tp: int
    pp: int
    fsdp: bool = False
    """the replica's ``tp`` ranks are FSDP's: each computes one micro-batch of each round
    (:mod:`unicron.runtime.fsdp`), and every round's micro-batches are in every rank's sums"""
    done: set[int] = field(default_factory=set)
    """micro-batches of the step in the local sums"""
    pending: list[int] = field(default_factory=list)
    """micro-batches handed out and not yet computed, oldest first: one in a step iterated
    micro-batch by micro-batch, several in a pipeline's order (:meth:`Step.batches`: forward
    passes ahead, the backward passes in the same order)"""
    attempt: Step | None = None
    """the step handed out and not yet committed"""
    crash_at: int = -1
    """the index among the attempt's micro-batches where an injected crash fires"""
    _split_checked: bool = False  # the model was seen to use its replica (_check_split)
    _rounds: dict[int, Round] = field(default_factory=dict)  # fsdp: this rank's id -> round

    def count(self, n: int) -> int:
        """How many micro-batches this rank computes of its replica's ``n`` (an injected
        crash's ``mb`` counts these): all, or with ``fsdp`` one a round."""
        return -(-n // self.tp) if self.fsdp else n

    def mine(self, s: Step) -> Iterator[int]:
        """The micro-batches of attempt ``s`` this rank computes, read as each is reached
        until the replica breaks: those not computed yet, or with ``fsdp`` its share of each
        round of them (:func:`unicron.runtime.fsdp.rounds`)."""
        if not self.fsdp:
            for mb in s.microbatches:
                if self.par.broken is not None:
                    return
                if mb not in self.done:
                    yield mb
            return
        left = [mb for mb in s.microbatches if mb not in self.done]
        self._rounds = {}
        for mb, ids in rounds(left, self.tp, self.par.rank):
            if self.par.broken is not None:
                return
            self._rounds[mb] = ids
            yield mb

    def clear(self) -> None:
        """The local sums are abandoned (or reduced): nothing of the step is computed here."""
        self.done.clear()
        self.pending.clear()

    def check_open(self, s: Step, what: str) -> None:
        if s is not self.attempt or s.closed:
            refuse(f"step {s.index}: {what} after its commit (use the loop's current step)")

    def open(self, s: Step, mb: int, *, ahead: bool = False) -> None:
        """Micro-batch ``mb`` of step ``s`` is about to be computed (the checks of bad use);
        ``ahead``: before the backward passes of those handed out already (a pipeline's order)."""
        self.check_open(s, f"micro-batch {mb} asked for")
        if mb not in s.microbatches:
            refuse(
                f"step {s.index}: micro-batch {mb} is not this replica's to compute "
                f"(its micro-batches: {list(s.microbatches)})"
            )
        if mb in self.done:
            refuse(f"step {s.index}: micro-batch {mb} is computed already (once per step)")
        if mb in self.pending:
            refuse(f"step {s.index}: micro-batch {mb} is handed out already (once per step)")
        if self.pending and not ahead:
            refuse(
                f"step {s.index}: micro-batch {mb} asked for before micro-batch "
                f"{self.pending[0]} was computed: call step.backward(loss) for each batch "
                "before the next (or iterate step.batches() to compute forward passes ahead)"
            )
        mine = list(self._rounds) if self.fsdp else s.microbatches
        if mine.index(mb) == self.crash_at:
            self.faults.fire_due("crash", s.index)
        self.pending.append(mb)

    def _take(self, s: Step, api: str) -> tuple[int, bool]:
        """The micro-batch whose gradient comes now (the oldest handed out), and whether it is
        the attempt's last."""
        self.check_open(s, api)
        if not self.pending:
            refuse(
                f"step {s.index}: {api} without a micro-batch: iterate the step "
                "(for batch in step) or call step.batch(j) first"
            )
        mb = self.pending[0]
        now = self._round(mb)
        left = [j for j in s.microbatches if j not in self.done and j not in now]
        return mb, not left

    def _round(self, mb: int) -> tuple[int | None, ...]:
        """What the replica computes with this rank's micro-batch ``mb``: itself, or with
        ``fsdp`` its round."""
        return self._rounds[mb] if self.fsdp else (mb,)

    def backward(self, s: Step, loss: torch.Tensor, run: Callable[[], None] | None = None) -> None:
        """Backward of the oldest micro-batch handed out (``run``: the pass, where the caller
        drives it; its loss is read from ``loss`` after it); the gradient hooks take each
        gradient. Once the attempt is broken (a sum or link of the replica failed) the losses
        of the micro-batches still handed out mean nothing and are dropped."""
        if self.par.broken is not None and not self.pending:
            self.check_open(s, "step.backward(loss)")
            return  # the first backward pass after the break dropped the attempt's work
        mb, last = self._take(s, "step.backward(loss)")
        if self.pipe.last and self.pipe.stages > 1:
            self.pipe.loss = float(loss.detach())  # goes back to the other stages
        if self.fsdp:
            self.grads.round = self._round(mb)  # type: ignore[attr-defined]  # FsdpReducer
        try:
            self.grads.backward(mb, loss, last=last, run=run)
        except BaseException:
            self.clear()  # the local sums are abandoned: redo the step's work here
            raise
        if not self._split_checked:
            self._check_split()
        if self.par.broken is not None:  # a sum of the replica failed: the sums mean nothing
            self.clear()
            self.grads.clear()
            return
        self._computed(mb)

    def _check_split(self) -> None:
        """After this process's first micro-batch: a model run at ``--tp``/``--pp`` > 1 must
        have summed over its replica or passed activations between stages, else every rank of
        a replica computes the whole model (bad input: one line, exit 2)."""
        self._split_checked = True
        tp = "fsdp" if self.fsdp else "tp"
        flags = [
            f"--{name} {n}"
            for name, n, used in ((tp, self.tp, self.par.used), ("pp", self.pp, self.pipe.used))
            if n > 1 and not used
        ]
        if flags and self.fsdp:
            refuse(
                f"{flags[0]}: the model did not gather its shards over its replica (no "
                "collective on unicron.fsdp.mesh() in its first micro-batch): shard it with "
                "fully_shard on that mesh (docs/runtime.md, FSDP inside a replica)"
            )
        if flags:
            refuse(
                f"{' '.join(flags)}: the model did not split over its replica (no sum or "
                "link of unicron.parallel in its first micro-batch): build it with "
                "unicron.parallel's parts (docs/runtime.md, Model-parallel replicas)"
            )

    def add_gradients(self, s: Step, grads: Sequence[torch.Tensor | None], loss: float) -> None:
        """The current micro-batch's gradients, handed over (one per trainable parameter)."""
        params = self.grads.params
        if len(grads) != len(params):
            refuse(
                f"step {s.index}: add_gradients got {len(grads)} gradients for "
                f"{len(params)} trainable parameters"
            )
        for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
            if grad is not None and grad.shape != p.shape:
                refuse(
                    f"step {s.index}: add_gradients: gradient {i} has shape "
                    f"{tuple(grad.shape)}, its parameter {tuple(p.shape)}"
                )
        mb, last = self._take(s, "step.add_gradients()")
        self.grads.add(mb, grads, loss, last=last)
        self._computed(mb)

    def _computed(self, mb: int) -> None:
        self.done.update(j for j in self._round(mb) if j is not None)
        self.pending.remove(mb)

    def check_whole(self, s: Step) -> None:
        """At the commit: every micro-batch of the attempt computed, none half done."""
        if self.pending:
            refuse(
                f"step {s.index}: commit() before micro-batch {self.pending[0]} was computed: "
                "call step.backward(loss) for it first"
            )
        left = [mb for mb in s.microbatches if mb not in self.done]
        if left:
            refuse(
                f"step {s.index}: commit() before computing this replica's micro-batches "
                f"{left}: compute every batch the step yields"
            )

    def stray_backward(self) -> None:
        """A backward pass outside step.backward(loss): refused while a step is open (the
        gradient hooks call it)."""
        if self.attempt is not None and not self.attempt.closed:
            refuse(
                f"step {self.attempt.index}: a backward pass outside step.backward(loss): "
                "call step.backward(loss) instead of loss.backward(), so that Unicron "
                "takes the micro-batch's gradient and loss"
            )
