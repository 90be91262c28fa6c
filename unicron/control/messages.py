"""What agents and the coordinator say to each other: typed reports, actions and replies.

An agent collects what its workers told it during one round of its loop as :data:`Report`
values (in order), and hands them to the coordinator in one exchange
(:meth:`unicron.control.coordinator.Coordinator.exchange`, in-process; or ``POST
/v1/agents/{node}/exchange`` of the cluster service, :mod:`unicron.control.service`, which
calls the same method). The coordinator applies them, judges the node's heartbeat, runs its
detectors and answers with a :class:`Reply`: the :data:`AgentAction` values queued for that
node and where the task stands. Nothing else crosses between the two.

Every type here is a frozen dataclass of plain fields, so one codec
(:func:`to_wire` / :func:`from_wire`) turns any of them into JSON and back; a report's ``ts``
is when the agent saw it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from unicron.detect.classify import Action, Scope, Severity, Verdict


# -- actions: coordinator -> agent -------------------------------------------------------------
@dataclass(frozen=True)
class Spawn:
    """Start a new incarnation of the worker in ``slot``; ``fresh``: a slot the task was just
    given (started unless a worker already runs there)."""

    slot: int
    fresh: bool = False


@dataclass(frozen=True)
class Kill:
    """SIGKILL the worker in ``slot``; its exit is reported with ``verdict`` (already logged).
    ``leave``: the slot goes to another task (a planned move, not a failure): its exit is
    reported as :class:`WorkerLeft`."""

    slot: int
    verdict: Verdict | None = None
    leave: bool = False


@dataclass(frozen=True)
class Probe:
    """Run the health probe of the excluded ``slot``; answer with :class:`ProbeDone` (or
    :class:`ProbeNotStarted`)."""

    slot: int


AgentAction = Spawn | Kill | Probe


# -- reports: agent -> coordinator -------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Ready:
    """The worker in ``slot`` built its model and waits for an epoch."""

    slot: int
    ts: float
    microbatches: int | None = None
    state_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class EpochEntered:
    """The worker in ``slot`` entered ``epoch`` (rendezvous, ledger exchange, state follow)."""

    slot: int
    ts: float
    epoch: int


@dataclass(frozen=True, kw_only=True)
class StepBegan:
    """The worker in ``slot`` began computing ``step``: the monitor's clock starts."""

    slot: int
    ts: float
    step: int
    epoch: int | None = None
    cpu_s: float | None = None  # its computing thread's CPU time then (unicron.detect.busy)


@dataclass(frozen=True, kw_only=True)
class StepComputed:
    """The worker in ``slot`` finished computing ``step``; the reduce and vote follow."""

    slot: int
    ts: float
    step: int
    compute_s: float
    microbatches: int | None = None
    cpu_s: float | None = None  # its computing thread's CPU time then (unicron.detect.busy)
    queued_s: float | None = None  # of compute_s, waiting for a CPU (unicron.detect.busy)


@dataclass(frozen=True, kw_only=True)
class WaitingOnReplica:
    """The worker in ``slot`` waits (``waiting``), or no longer, on the other ranks of its
    replica inside ``step`` (a tensor-parallel sum): not a hang of its own."""

    slot: int
    ts: float
    step: int
    epoch: int
    waiting: bool


@dataclass(frozen=True, kw_only=True)
class CpuTime:
    """The agent read the clocks of the computing thread of the worker in ``slot``, whose step
    has lasted a while: its CPU time, and how long it has waited runnable for a CPU
    (``queued_s``; ``None``: unknown). Evidence that it is starved rather than hung
    (:mod:`unicron.detect.busy`)."""

    slot: int
    ts: float
    cpu_s: float
    queued_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Event:
    """An event-log record a worker wrote (``step_end``, ``transition_end``, ...): the
    coordinator keeps one ``step_end`` per committed step and writes it to the task's log."""

    ts: float
    name: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Detected:
    """The agent detected a failure of the worker in ``slot`` (an exception it reported, a
    process exit): one ``error_detected`` event."""

    slot: int
    ts: float
    step: int | None
    verdict: Verdict
    method: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WorkerError:
    """An error raised inside the living worker in ``slot`` (in-band; see
    :meth:`~unicron.control.coordinator.Coordinator.worker_error`)."""

    slot: int
    ts: float
    verdict: Verdict
    in_place: bool
    epoch: int | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerFailed:
    """The worker process in ``slot`` is gone (its detection was already reported)."""

    slot: int
    ts: float
    verdict: Verdict


@dataclass(frozen=True, kw_only=True)
class WorkerLeft:
    """The worker in ``slot`` exited cleanly after the task ended, without a report."""

    slot: int
    ts: float


@dataclass(frozen=True, kw_only=True)
class WorkerDone:
    """The worker in ``slot`` finished the last step; ``report`` is its result."""

    slot: int
    ts: float
    report: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class BadInput:
    """A worker found the task's input unusable before training: the task fails (exit 2)."""

    ts: float
    message: str


@dataclass(frozen=True, kw_only=True)
class ProbeDone:
    """The health probe of the excluded ``slot`` ended."""

    slot: int
    ts: float
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class ProbeNotStarted:
    """The agent could not start the probe of ``slot``."""

    slot: int
    ts: float
    error: str


@dataclass(frozen=True, kw_only=True)
class Census:
    """What the agent knows of the task's workers on its node, sent on its first exchange
    with a coordinator (a restarted one adopts running tasks from it): per slot, whether a
    worker process lives and whether it reported ready without having entered an epoch."""

    ts: float
    alive: tuple[int, ...] = ()
    ready: tuple[int, ...] = ()


Report = (
    Ready
    | EpochEntered
    | StepBegan
    | StepComputed
    | WaitingOnReplica
    | CpuTime
    | Event
    | Detected
    | WorkerError
    | WorkerFailed
    | WorkerLeft
    | WorkerDone
    | BadInput
    | ProbeDone
    | ProbeNotStarted
    | Census
)


@dataclass(frozen=True, kw_only=True)
class Reply:
    """The coordinator's answer to one exchange: what this node must do, in order, whether
    the task is over (waiting workers leave) and finished (every member reported), and
    ``next_s``: with nothing to report, exchange again within this many seconds (the rhythm
    the coordinator needs from this node now: slow when nothing is due, fast while a
    detector waits on the node's reports or an action may follow; docs/cluster.md, The
    rhythm)."""

    actions: tuple[AgentAction, ...] = ()
    over: bool = False
    finished: bool = False
    next_s: float = 0.05


# -- the codec ---------------------------------------------------------------------------------
_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (
        Spawn,
        Kill,
        Probe,
        Ready,
        EpochEntered,
        StepBegan,
        StepComputed,
        WaitingOnReplica,
        CpuTime,
        Event,
        Detected,
        WorkerError,
        WorkerFailed,
        WorkerLeft,
        WorkerDone,
        BadInput,
        ProbeDone,
        ProbeNotStarted,
        Census,
        Reply,
    )
}


def _verdict_to_wire(v: Verdict) -> dict[str, Any]:
    return {
        "kind": v.kind,
        "severity": int(v.severity),
        "action": str(v.action),
        "reason": v.reason,
        "scope": str(v.scope),
    }


def _verdict_from_wire(d: dict[str, Any]) -> Verdict:
    return Verdict(
        kind=str(d["kind"]),
        severity=Severity(int(d["severity"])),
        action=Action(d["action"]),
        reason=str(d["reason"]),
        scope=Scope(d.get("scope", "slot")),
    )


def to_wire(msg: Any) -> dict[str, Any]:
    """One message as a JSON-ready dict with its ``type``."""
    out: dict[str, Any] = {"type": type(msg).__name__}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, Verdict):
            value = _verdict_to_wire(value)
        elif f.name == "actions":
            value = [to_wire(a) for a in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


_SCALARS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
}


@functools.cache
def _kinds(annotation: str) -> tuple[str, ...]:
    """The alternatives of a field's annotation (``"int | None"``: ``("int", "None")``),
    parsed once per annotation: the service decodes every report of every exchange."""
    return tuple(k.strip() for k in annotation.split("|"))


def _check(cls: type, f: dataclasses.Field[Any], value: Any) -> None:
    """A scalar field's value has its declared type (containers and verdicts are checked by
    their own decoding): a report from the network must not carry a string for a slot."""
    kinds = _kinds(str(f.type))
    if value is None and "None" in kinds:
        return
    for kind in kinds:
        allowed = _SCALARS.get(kind)
        if allowed is None and kind != "None":
            return
        if allowed and isinstance(value, allowed) and (kind == "bool" or type(value) is not bool):
            return
    raise ValueError(f"{cls.__name__}.{f.name}: {value!r} is not {f.type}")


def from_wire(d: dict[str, Any]) -> Any:
    """The message a :func:`to_wire` dict describes; ``ValueError`` for anything else."""
    try:
        cls = _TYPES[d["type"]]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            value = d[f.name]
            _check(cls, f, value)
            if f.name == "verdict" and value is not None:
                value = _verdict_from_wire(value)
            elif f.name == "actions":
                value = tuple(from_wire(a) for a in value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        return cls(**kwargs)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a message: {exc}") from exc
