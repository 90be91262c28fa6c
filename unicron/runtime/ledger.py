"""The deterministic micro-batch ledger (DESIGN.md, Transition).

The global batch of step ``s`` is ``M`` micro-batches with ids ``(s, 0..M-1)``. Each id maps to
fixed sample indices: the dataset is walked in a seeded permutation per pass over the data,
so the samples of a step depend only on (seed, step) and never on who computes them. An
epoch assigns ids to replicas; after a failure the survivors keep what they have done and the
missing ids are spread over the members again. Pure functions, no torch: the worker calls
them for every step, the tests call them with plain data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Ledger:
    """Maps micro-batch ids to sample indices.

    ``dataset_len`` samples are visited in a seeded permutation per pass; micro-batch ``j`` of
    step ``s`` takes positions ``(s * M + j) * B .. + B`` of that endless stream.
    """

    dataset_len: int
    micro_batch_size: int
    num_microbatches: int
    seed: int = 0
    _perms: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> dict[str, int]:
        """What a checkpoint records of the ledger: a resume under another one is refused."""
        return {
            "dataset_len": self.dataset_len,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "seed": self.seed,
        }

    def __post_init__(self) -> None:
        if self.dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {self.dataset_len}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")

    def _perm(self, data_pass: int) -> np.ndarray:
        perm = self._perms.get(data_pass)
        if perm is None:
            rng = np.random.default_rng([self.seed, data_pass])
            perm = rng.permutation(self.dataset_len)
            self._perms.clear()  # keep one pass cached: steps move forward
            self._perms[data_pass] = perm
        return perm

    def samples(self, step: int, mb: int) -> list[int]:
        """Dataset indices of micro-batch ``mb`` of step ``step``."""
        if not 0 <= mb < self.num_microbatches:
            raise ValueError(f"micro-batch {mb} out of range 0..{self.num_microbatches - 1}")
        start = (step * self.num_microbatches + mb) * self.micro_batch_size
        out: list[int] = []
        for pos in range(start, start + self.micro_batch_size):
            data_pass, offset = divmod(pos, self.dataset_len)
            out.append(int(self._perm(data_pass)[offset]))
        return out


def mb_seed(seed: int, step: int, mb: int) -> int:
    """Seed of the randomness inside micro-batch (step, mb), e.g. dropout masks."""
    return (seed * 1_000_003 + step * 10_007 + mb) % (2**63 - 1)


def assign(missing: Iterable[int], world: int) -> list[list[int]]:
    """Spread the micro-batch ids not yet done by any member over ``world`` ranks, in
    contiguous blocks whose sizes differ by at most one (the larger first).

    A fresh step of M ids in a world of W gives rank r the block ``r * M / W ..`` (an aligned
    subtree of the summation tree, :mod:`unicron.runtime.reduce`, when W divides M into powers of
    two); after a failure the same rule spreads only the missing ids, so nothing a living
    member has done is redone.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    ids = sorted(missing)
    base, extra = divmod(len(ids), world)
    out: list[list[int]] = []
    at = 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append(ids[at : at + n])
        at += n
    return out


def missing(done_by_member: Sequence[Iterable[int]], num_microbatches: int) -> list[int]:
    """Ids of the step that no living member has in its local sum.

    The sets are disjoint by construction (each id is assigned to one member per epoch, and
    only missing ids are assigned again); an overlap would double-count a gradient, so it is an
    invariant violation.
    """
    seen: set[int] = set()
    for done in done_by_member:
        done = set(done)
        assert not (seen & done), f"micro-batches {sorted(seen & done)} done twice"
        seen |= done
    return [mb for mb in range(num_microbatches) if mb not in seen]
