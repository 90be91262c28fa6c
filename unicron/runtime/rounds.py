"""Rounds: how the ranks of an FSDP replica share its micro-batches (pure).

An FSDP replica's ranks compute different micro-batches (:mod:`unicron.runtime.fsdp`), one
each per round, since every rank runs every all-gather and reduce-scatter of a round's
forward and backward passes. Called by the worker's micro-batches
(:mod:`unicron.runtime.microbatches`) as an attempt is iterated.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Round", "rounds"]

Round = tuple[int | None, ...]
"""the micro-batch each place of the replica computes in one round (None: a padding one)"""


def rounds(left: Sequence[int], size: int, place: int) -> list[tuple[int, Round]]:
    """The rounds of a replica of ``size`` places over its micro-batches ``left`` (in order):
    for each, the micro-batch ``place`` computes and what every place computes. A short last
    round's extra places compute its first micro-batch again as padding (every place runs
    every collective of a round); their gradients are not added."""
    out = []
    for at in range(0, len(left), size):
        ids = tuple(left[at : at + size])
        real: Round = ids + (None,) * (size - len(ids))
        out.append((ids[place] if place < len(ids) else ids[0], real))
    return out
