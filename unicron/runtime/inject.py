"""Fault injection specs: the ``--inject`` contract of DESIGN.md, parsed once, used everywhere.

``crash:rank=R,step=S[,mb=K]``   SIGKILL the worker of launch rank R during step S (after K of
                                 its micro-batches; default: half of them, i.e. mid-step)
``crash:rank=R,step=S,phase=update``
                                 SIGKILL it once step S is voted committed, while the update
                                 is applied (under ``--zero 1``: after it sent the new values
                                 it owns, while the others' still go out); a worker's own
                                 point, which the benchmarks' baselines do not have
``hang:rank=R,step=S``           the worker stops making progress without exiting
``hang:rank=R,step=S,phase=update``
                                 it stops in the update of step S, once voted committed (of
                                 the last step: a worker hung after the task's end)
``error:rank=R,step=S,kind=K``   the worker raises an error of classified kind K
``slow:rank=R,step=S,factor=F``  the worker's compute becomes F times slower from step S on
                                 (until that process ends: a restarted worker is not slow)
``node:node=N,step=S``           node N's agent and workers vanish at step S

Any of them may add ``members=M``: the fault fires at step S, or at the first step after it,
in an epoch of at least M members (a second fault that must wait until the task healed from
the first, whatever the machine's pace: ``crash:rank=5,step=7,members=8``).

``rank`` is the worker's launch rank (its slot on the node, like torchrun's ``RANK``): it stays
with the slot when the worker is restarted, while epoch ranks change. Each fault fires once.
The runner, the worker, the tests and the benchmark baselines all parse specs here, and the
worker and the baselines fire them through one :class:`FaultPlan`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from unicron.detect.classify import make_exception
from unicron.errors import UsageError

FAULTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # fault -> (required keys, optional keys)
    "crash": (frozenset({"rank", "step"}), frozenset({"mb", "phase", "members"})),
    "hang": (frozenset({"rank", "step"}), frozenset({"phase", "members"})),
    "error": (frozenset({"rank", "step", "kind"}), frozenset({"members"})),
    "slow": (frozenset({"rank", "step", "factor"}), frozenset({"members"})),
    "node": (frozenset({"node", "step"}), frozenset({"members"})),
}


PHASES = ("compute", "update")
"""where in its step a ``crash`` or a ``hang`` fires: in its compute (a crash among its
micro-batches, ``mb``; a hang as the step begins), or in the update"""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault; ``fault`` is its type, the other fields its parameters."""

    fault: str
    step: int
    rank: int | None = None
    node: int | None = None
    mb: int | None = None
    kind: str | None = None
    factor: float | None = None
    phase: str | None = None
    """a crash's point: ``update`` (after the step's vote), else ``compute`` (mid-step)"""
    members: int | None = None
    """fire only in an epoch of at least this many members, at the first step from
    :attr:`step` on that is in one (``None``: at :attr:`step`)"""

    @property
    def spec(self) -> str:
        """The fault as an ``--inject`` spec again (round-trips through :func:`parse`)."""
        fields = {k: v for k, v in asdict(self).items() if k != "fault" and v is not None}
        return self.fault + ":" + ",".join(f"{k}={v}" for k, v in fields.items())

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse(spec: str, known_kinds: frozenset[str] | None = None) -> Fault:
    """Parse one ``--inject`` spec; raise :class:`UsageError` naming what is wrong.

    ``known_kinds`` are the error kinds accepted for ``error:`` (the classification table's
    kinds); ``None`` accepts any kind.
    """
    head, sep, body = spec.partition(":")
    if head not in FAULTS:
        raise UsageError(f"--inject {spec!r}: unknown fault {head!r} (known: {', '.join(FAULTS)})")
    required, optional = FAULTS[head]
    params: dict[str, str] = {}
    for item in body.split(",") if sep and body else []:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise UsageError(f"--inject {spec!r}: expected key=value, got {item!r}")
        if key not in required | optional:
            allowed = ", ".join(sorted(required | optional))
            raise UsageError(
                f"--inject {spec!r}: unknown key {key!r} for {head} (allowed: {allowed})"
            )
        params[key] = value
    missing = required - params.keys()
    if missing:
        raise UsageError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}")
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key == "phase":
            if value not in PHASES:
                raise UsageError(
                    f"--inject {spec!r}: phase must be one of {', '.join(PHASES)}, got {value!r}"
                )
            values[key] = value
        elif key == "kind":
            if known_kinds is not None and value not in known_kinds:
                known = ", ".join(sorted(known_kinds))
                raise UsageError(f"--inject {spec!r}: unknown kind {value!r} (known: {known})")
            values[key] = value
        elif key == "factor":
            try:
                values[key] = float(value)
            except ValueError:
                raise UsageError(
                    f"--inject {spec!r}: factor must be a number, got {value!r}"
                ) from None
            if not values[key] >= 1.0:
                raise UsageError(f"--inject {spec!r}: factor must be >= 1, got {value}")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise UsageError(
                    f"--inject {spec!r}: {key} must be an integer, got {value!r}"
                ) from None
            if values[key] < 0:
                raise UsageError(f"--inject {spec!r}: {key} must be >= 0, got {value}")
    if values.get("phase") == "update" and "mb" in values:
        raise UsageError(f"--inject {spec!r}: mb is a point of the compute, not of the update")
    return Fault(fault=head, **values)


def slowdown(faults: Iterable[Fault], fired: Collection[str]) -> float:
    """How many times slower a worker computes: the largest factor among the ``slow`` faults
    it has fired (their specs in ``fired``), 1.0 if none. The worker calls it after each
    step's compute. A slow fault whose step went by while the slot was out (excluded, or a
    worker restarted past it) never fired: it slows nothing, as any other unfired fault."""
    return max(
        (f.factor or 1.0 for f in faults if f.fault == "slow" and f.spec in fired), default=1.0
    )


def slow_down(extra_s: float, *, on_cpu: bool) -> None:
    """Carry out a fired ``slow`` fault: the worker's step takes ``extra_s`` more of its own
    compute (:func:`slowdown` - 1 times what it cost so far; the worker calls it before it
    reports the step computed). On a CPU device it spends that much CPU time, as a slower
    core would: the straggler detector asks a step's CPU time to agree with its clock, and a
    thread merely held off the CPU spends none (:mod:`unicron.detect.monitor`). On an
    accelerator, whose kernels run off the thread, it waits."""
    if not on_cpu:
        time.sleep(extra_s)
        return
    until = time.thread_time() + extra_s
    while time.thread_time() < until:
        pass


Emit = Callable[..., None]
"""records an event: ``emit(name, **fields)``"""


def stop_self(fault: Fault) -> None:
    """The fault's own effect on the calling process: a ``crash`` is SIGKILL, a ``hang``
    SIGSTOP (alive, no progress, until someone kills it), an ``error`` the classified kind's
    exception raised here. ``node`` and ``slow`` faults are the caller's to carry out."""
    if fault.fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.fault == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.fault == "error":
        raise make_exception(fault.kind or "user")
    else:
        raise ValueError(f"{fault.spec}: a {fault.fault} fault has no effect of its own")


@dataclass
class FaultPlan:
    """The faults one process fires, each once: which are due at a point of a step, the
    ``fault_injected`` event, and the fault's effect.

    The worker (:mod:`unicron.worker`) asks at its step's points: ``node``, ``hang`` and
    ``error`` faults as a step begins (:meth:`fire_due`), a ``crash`` after
    :meth:`crash_point` of its micro-batches or in the update (:meth:`fire_in_update`),
    ``slow`` once the step is computed (:meth:`slowdown`). The benchmarks' baselines
    (``bench/baselines/loop.py``) ask before each micro-batch (:meth:`due_after`). ``act``
    carries a fault out (default :func:`stop_self`; the worker hands a node fault to its
    agent, a baseline kills its node's processes); ``claim`` says whether a fault may fire
    now and marks it fired (default: once in this process; a baseline's survives its
    restarts in a marker file).
    """

    faults: list[Fault]
    emit: Emit
    rank: int | None = None
    act: Callable[[Fault], None] = stop_self
    claim: Callable[[Fault], bool] | None = None
    fired: set[str] = field(default_factory=set)
    members: int | None = None
    """how many members the process's current epoch has (the worker sets it as it enters
    one); ``None``: unknown (a baseline's fixed world), a fault's ``members`` is ignored"""

    def _claim(self, fault: Fault) -> bool:
        ok = self.claim(fault) if self.claim is not None else fault.spec not in self.fired
        if ok:
            self.fired.add(fault.spec)
        return ok

    def due(self, kind: str, step: int) -> list[Fault]:
        """The unfired faults of type ``kind`` at ``step`` (a crash of its compute: not one
        of its update, :meth:`fire_in_update`)."""
        return [f for f in self.due_at(step) if f.fault == kind and f.phase != "update"]

    def due_at(self, step: int) -> list[Fault]:
        """The unfired faults of ``step``, of any type (one with ``members``: of any step
        from its own on, in an epoch of that many members or more)."""
        return [f for f in self.faults if f.spec not in self.fired and self._now(f, step)]

    def _now(self, f: Fault, step: int) -> bool:
        if f.members is None or self.members is None:
            return f.step == step
        return f.step <= step and self.members >= f.members

    def crash_point(self, step: int, n: int) -> int:
        """After how many of its ``n`` micro-batches of ``step`` the process crashes: the
        spec's ``mb``, else half of them; -1 if no crash is due in the compute."""
        for f in self.due("crash", step):
            return n // 2 if f.mb is None else f.mb
        return -1

    def fire_in_update(self, step: int) -> None:
        """Fire the crashes and hangs due in ``step``'s update (``phase=update``): the worker
        calls it once the step is voted committed and its own part of the update is applied."""
        for f in self.due_at(step):
            if f.fault in ("crash", "hang") and f.phase == "update":
                self.fire(f, step)

    def due_after(self, step: int, done: int, total: int) -> list[Fault]:
        """The unfired faults of ``step`` due once ``done`` of the process's ``total``
        micro-batches are computed (a fault's ``mb``, else half; every type alike)."""
        return [
            f
            for f in self.due_at(step)
            if f.phase != "update" and done == min(total // 2 if f.mb is None else f.mb, total)
        ]

    def fire(self, fault: Fault, step: int) -> None:
        """Fire ``fault`` at ``step`` unless it fired already: the ``fault_injected`` event
        (fault, kind, spec, step, rank; a node fault's node), then its effect (:attr:`act`)."""
        if not self._claim(fault):
            return
        extra = {"node": fault.node} if fault.fault == "node" else {}
        self.emit(
            "fault_injected",
            fault=fault.fault,
            kind=fault.kind,
            spec=fault.spec,
            step=step,
            rank=self.rank,
            **extra,
        )
        self.act(fault)

    def fire_due(self, kind: str, step: int) -> None:
        """Fire every fault of type ``kind`` due at ``step``."""
        for f in self.due(kind, step):
            self.fire(f, step)

    def slowdown(self, step: int) -> float:
        """Mark the ``slow`` faults of ``step`` fired (an event each, with its factor) and
        return how many times slower the process computes from now on (:func:`slowdown`)."""
        for f in self.due("slow", step):
            if self._claim(f):
                self.emit(
                    "fault_injected",
                    fault="slow",
                    spec=f.spec,
                    step=step,
                    rank=self.rank,
                    factor=f.factor,
                )
        return slowdown(self.faults, self.fired)
