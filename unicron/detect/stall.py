"""Stalls outside the compute of a step: a transition or a reduce that never ends.

The step monitor (:mod:`unicron.detect.monitor`) times each worker's *compute*. Everything else a
member of an epoch does waits on its peers: joining the epoch (rendezvous, ledger exchange,
state transfer) and reducing a step (all-reduce, commit vote). Such a wait ends only when
every member takes part, so a member that never arrives (stuck in an older epoch, or in a
phase of its own) stalls the others with no error at all. The coordinator records where each
worker is (:class:`Progress`, from the worker's reports) and asks :func:`find_stall` on every
tick; it kills the members found behind (a hang, SEV2) or, when every member waits at the
same place (the collective itself is stuck), starts the epoch again (a reattempt, SEV3).

Pure: no clock, no I/O; ``now`` and the deadline are passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Phase", "Progress", "Stall", "find_stall", "stall_deadline_s"]


class Phase(enum.Enum):
    """Where a worker is. ``JOIN`` (entered an epoch: rendezvous, ledger exchange, state
    transfer) -> ``COMPUTE`` (StepBegan) -> ``REDUCE`` (StepComputed: all-reduce, vote) ->
    ``COMPUTE`` of the next step ... -> ``DONE``; any phase -> ``LEFT`` (it left the epoch
    after a failed collective and waits for a newer one) or ``JOIN`` of a newer epoch."""

    JOIN = "join"
    COMPUTE = "compute"
    REDUCE = "reduce"
    LEFT = "left"
    DONE = "done"


WAITING = frozenset({Phase.JOIN, Phase.REDUCE})
"""phases that wait on every member of the epoch"""


@dataclass(frozen=True)
class Progress:
    """A worker's last reported position: in ``epoch``, ``phase`` of ``step``, since ``since``."""

    epoch: int
    phase: Phase
    step: int
    since: float

    def position(self) -> tuple[int, int]:
        """Order within an epoch: join < compute s < reduce s < compute s+1 < ... < done."""
        if self.phase is Phase.JOIN:
            return (self.epoch, -1)
        if self.phase is Phase.DONE:
            return (self.epoch, 1 << 40)
        return (self.epoch, 2 * self.step + (self.phase is Phase.REDUCE))


@dataclass(frozen=True)
class Stall:
    """What :func:`find_stall` found. ``behind``: the members the others wait for (kill them:
    they hang outside a step); empty when every member waits at the same place (``stuck``:
    start the epoch again). ``reason`` is one line for the event log."""

    behind: tuple[int, ...]
    waited_s: float
    reason: str

    @property
    def stuck(self) -> bool:
        return not self.behind


def stall_deadline_s(
    *,
    pace_s: float | None,
    state_bytes: int,
    factor: float,
    floor_s: float,
    cold_s: float,
    transfer_bytes_per_s: float,
) -> float:
    """How long a member may wait on its peers before the wait is a stall: ``factor`` times
    the task's step time (``pace_s``), at least ``floor_s``, plus the time to move the state
    (``state_bytes``) at a conservative ``transfer_bytes_per_s``. Before the task has a pace
    (its first epoch: every process connecting for the first time) ``cold_s``."""
    transfer_s = state_bytes / transfer_bytes_per_s
    if pace_s is None:
        return cold_s + transfer_s
    return max(factor * pace_s, floor_s) + transfer_s


def find_stall(
    *,
    epoch: int,
    members: Sequence[int],
    progress: Mapping[int, Progress],
    now: float,
    deadline_s: float,
) -> Stall | None:
    """A stall of the current ``epoch``, or ``None``.

    A stall needs a member that has waited (joining the epoch, or reducing a step) for longer
    than ``deadline_s``. The members it waits for are those behind it: not yet in this epoch
    (or never heard from), or at an earlier position in it while not computing (a member
    still computing is the step monitor's to judge). A member that left the epoch after a
    failed collective is healed by the in-band error path, not here.
    """
    waiters = [
        (m, p)
        for m in members
        if (p := progress.get(m)) is not None
        and p.epoch == epoch
        and p.phase in WAITING
        and now - p.since > deadline_s
    ]
    if not waiters:
        return None
    first, longest = max(waiters, key=lambda mp: (now - mp[1].since, -mp[0]))
    waited = now - longest.since
    where = f"{longest.phase.value} of epoch {epoch}" + (
        f", step {longest.step}" if longest.phase is Phase.REDUCE else ""
    )
    if any((p := progress.get(m)) is not None and p.phase is Phase.LEFT for m in members):
        return None  # a member left after a failed collective: the in-band error heals it
    outside = tuple(m for m in members if (p := progress.get(m)) is None or p.epoch < epoch)
    if outside:
        return Stall(
            outside,
            waited,
            f"slot {first} waited {waited:.2f} s in the {where} for slot(s) "
            f"{', '.join(map(str, outside))}, still outside epoch {epoch}",
        )
    here = {m: progress[m] for m in members}
    lowest = min(p.position() for p in here.values())
    if all(p.position() == lowest for p in here.values()):
        return Stall(
            (),
            waited,
            f"every member waited {waited:.2f} s in the {where}: the collective is stuck",
        )
    behind = tuple(m for m, p in here.items() if p.position() == lowest)
    if any(here[m].phase is Phase.COMPUTE for m in behind):
        return None  # someone is still computing: the step monitor judges a slow step
    return Stall(
        behind,
        waited,
        f"slot {first} waited {waited:.2f} s in the {where} for slot(s) "
        f"{', '.join(map(str, behind))}, stuck in an earlier phase",
    )
