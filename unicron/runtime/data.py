"""Where a step's samples come from, for :mod:`unicron.worker`: the ledger's seeded
permutation (:class:`LedgerData`, no state of its own) or the user's sampler
(:class:`SamplerData`, whose position is part of the committed state: exchanged with the
ledger, given to joiners, written into checkpoints). Both answer :class:`Data`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from unicron.errors import UsageError
from unicron.runtime import ledger as L


class Data(Protocol):
    """The samples of each micro-batch of the step being computed. ``state()`` is part of the
    committed state: exchanged with the ledger, given to joiners, written into checkpoints."""

    def samples(self, step: int, mb: int) -> list[int]: ...

    def state(self) -> tuple[int, int]: ...

    def load(self, state: Sequence[int]) -> None: ...

    def advance(self) -> None: ...


@dataclass
class LedgerData:
    """The ledger's seeded permutation: the samples of (step, mb) follow from the step alone,
    so there is no state of its own (``(-1, -1)``)."""

    ledger: L.Ledger

    def samples(self, step: int, mb: int) -> list[int]:
        return self.ledger.samples(step, mb)

    def state(self) -> tuple[int, int]:
        return (-1, -1)

    def load(self, state: Sequence[int]) -> None:
        pass

    def advance(self) -> None:
        pass


@dataclass
class SamplerData:
    """A user's ``torch.utils.data.Sampler``: each step takes the next M x B indices of its
    stream, from the committed ``(epoch, position)``; a new pass over the data calls the
    sampler's ``set_epoch(epoch)`` (as ``DistributedSampler`` has), so a pass must list the same
    indices on every replica. The state moves on only when a step commits."""

    sampler: Any
    num_microbatches: int
    micro_batch_size: int
    epoch: int = 0
    position: int = 0
    _orders: dict[int, list[int]] = field(default_factory=dict)
    _batch: tuple[tuple[int, int], list[int], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        first = self._order(0)
        self._orders.clear()
        if first != self._order(0):
            raise UsageError(
                "the sampler lists other indices each time it is iterated, so replicas would "
                "read different samples: use one whose order follows set_epoch(epoch), e.g. "
                "DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=S)"
            )

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            order = [int(i) for i in self.sampler]
            if not order:
                raise UsageError("the sampler yields no index: nothing to train on")
            self._orders = {epoch: order}  # steps move forward: one pass cached
        return self._orders[epoch]

    def _global(self) -> tuple[list[int], tuple[int, int]]:
        """The committed step's M x B indices and the state after them."""
        key = (self.epoch, self.position)
        if self._batch is None or self._batch[0] != key:
            want = self.num_microbatches * self.micro_batch_size
            epoch, pos = self.epoch, self.position
            out: list[int] = []
            while len(out) < want:
                order = self._order(epoch)
                take = order[pos : pos + want - len(out)]
                out += take
                pos += len(take)
                if pos >= len(order):
                    epoch, pos = epoch + 1, 0
            self._batch = (key, out, (epoch, pos))
        return self._batch[1], self._batch[2]

    def samples(self, step: int, mb: int) -> list[int]:
        b = self.micro_batch_size
        return self._global()[0][mb * b : (mb + 1) * b]

    def state(self) -> tuple[int, int]:
        return (self.epoch, self.position)

    def load(self, state: Sequence[int]) -> None:
        self.epoch, self.position = int(state[0]), int(state[1])

    def advance(self) -> None:
        self.epoch, self.position = self._global()[1]
