"""Every message of the system, one typed class per fact, and the one codec that carries them.

Three links carry them:

- an agent's local socket (an authenticated ``multiprocessing.connection``): what its
  workers say (:mod:`unicron.worker`, through :class:`unicron.runtime.link.AgentLink`), what
  its zygote says and is told (:mod:`unicron.runtime.launcher`): :data:`LocalMessage`;
- a node's agent and the cluster service: the :class:`Assignment` of each task it runs, in
  the answer to its heartbeat;
- an agent's exchange with its coordinator (:meth:`unicron.control.coordinator.Coordinator.
  exchange`, in-process; or ``POST /v1/agents/{node}/tasks/{uid}/exchange`` of the cluster
  service, :mod:`unicron.control.service`, which calls the same method): the agent's
  :data:`Report` values of one round, in order, answered by a :class:`Reply` carrying the
  :data:`AgentAction` values queued for its node.

A worker's fact (:data:`WORKER_FACTS`: ready, an epoch entered, a step begun or computed, a
wait on its replica, an event-log record, the end) is one class on both links: the worker
sends it with its slot and its own clock, and the agent passes the same value on
(:func:`unicron.control.heard.report_of`: the slot its connection says; a step's reports
keep the worker's time, the others carry when the agent heard them). The agent's own
findings (:class:`Detected`, :class:`WorkerFailed`, :class:`CpuTime`, :class:`Census`, ...)
and the worker's raw :class:`Error` (which the agent classifies into a :class:`Detected`)
are facts of their own.

Every class is a frozen dataclass of plain fields, so one codec (:func:`to_wire` /
:func:`from_wire`) turns any of them into a JSON-ready dict and back, checking scalar types on
the way in (a report from the network must not carry a string for a slot). This module
imports nothing of ``unicron.control`` or ``unicron.runtime``: both import it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, TypeGuard, get_args

from unicron.detect.classify import Action, Scope, Severity, Verdict
from unicron.protocol import WorkerSettings


# -- what a node's agent must run: coordinator -> agent, in every heartbeat's answer ----------
@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Run your part of task ``uid`` (``name``): its ranks on your node (``slots``), the
    ``script`` with ``args``, the faults to inject, torch's ``threads`` per worker, each
    slot's ``places`` in its model-parallel replica (in the order of ``slots``), the
    training ``store``'s address and the task's capability there (``store_key``: its
    workers' credential), the ``device`` kind, the ``settings`` its workers read from their
    environment and the task file's own ``env``. Made by
    :func:`unicron.control.planning.assignment`, started by
    :meth:`unicron.control.node.NodeAgent._start` (a lost store that starts again elsewhere
    changes only ``store``)."""

    uid: str
    name: str
    slots: tuple[int, ...]
    script: str
    args: tuple[str, ...]
    inject: tuple[str, ...]
    threads: int
    store: str
    store_key: str
    device: str
    settings: WorkerSettings
    env: dict[str, str]
    places: tuple[int, ...] = ()


# -- actions: coordinator -> agent -------------------------------------------------------------
@dataclass(frozen=True)
class Spawn:
    """Start a new incarnation of the worker in ``slot``; ``fresh``: a slot the task was just
    given (started unless a worker already runs there); ``place``: the slot's place in its
    model-parallel replica (:mod:`unicron.control.replicas`: the shard its worker builds)."""

    slot: int
    fresh: bool = False
    place: int = 0


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


# -- a worker's facts: worker -> agent -> coordinator ------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Ready:
    """The worker in ``slot`` built its model and waits for an epoch. ``microbatches``: its
    micro-batches per step; ``state_bytes``: the state a joiner receives (the model and the
    optimizer's moments)."""

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
    """The worker in ``slot`` began computing ``step`` at ``ts``: the monitor's clock starts.
    ``cpu_s``: the CPU time then of the thread that computes the step, ``tid`` its kernel
    thread id (the agent reads that thread's clocks, :mod:`unicron.detect.busy`)."""

    slot: int
    ts: float
    step: int
    epoch: int | None = None
    cpu_s: float | None = None
    tid: int | None = None


@dataclass(frozen=True, kw_only=True)
class WaitingOnReplica:
    """Inside ``step``, the worker in ``slot`` waits (``waiting``) or no longer waits on the
    other ranks of its replica (a sum of a tensor-parallel replica that has taken more than
    :data:`unicron.runtime.group.WAIT_REPORT_S`): it computes nothing meanwhile, so the hang
    detector looks at the ranks it waits for, not at it."""

    slot: int
    ts: float
    step: int
    epoch: int
    waiting: bool


@dataclass(frozen=True, kw_only=True)
class StepComputed:
    """The worker in ``slot`` computed ``step`` (``microbatches`` of it, in ``compute_s``) at
    ``ts``; the reduce and the commit vote follow. ``cpu_s``: the computing thread's CPU time
    then; ``queued_s``: how long of ``compute_s`` that thread waited for a CPU (``None``:
    unknown), see :mod:`unicron.detect.busy`."""

    slot: int
    ts: float
    step: int
    compute_s: float
    microbatches: int | None = None
    cpu_s: float | None = None
    queued_s: float | None = None
    epoch: int | None = None
    """the epoch it computed in (``None``: a worker of an earlier release)"""


@dataclass(frozen=True, kw_only=True)
class Event:
    """An event-log record a worker wrote (``step_end``, ``transition_end``,
    ``fault_injected``, ...): the coordinator keeps one ``step_end`` per committed step and
    writes it to the task's log."""

    ts: float
    name: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WorkerDone:
    """The worker in ``slot`` committed the last step: its result (``final_loss``: none when
    this worker computed no step, a resume of a run that had finished)."""

    slot: int
    ts: float
    steps: int
    final_loss: float | None
    params_sha256: str
    rank: int
    epoch: int
    shard: int = 0
    """the worker's place in its replica (tensor parallel): replicas agree shard by shard"""

    def result(self) -> dict[str, Any]:
        """The task's result as this worker has it (what ``unicron run`` reports): every
        field but where and when it was said."""
        skip = ("slot", "ts")
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }


WORKER_FACTS = (Ready, EpochEntered, StepBegan, WaitingOnReplica, StepComputed, Event, WorkerDone)
"""what a worker says that its agent passes on as it is (stamped with the slot and a time)"""


# -- the rest of what a worker, its zygote and its agent say on the local socket ---------------
@dataclass(frozen=True, kw_only=True)
class Hello:
    """A worker's first message on connect: which slot and incarnation this process is."""

    slot: int
    pid: int
    incarnation: int


@dataclass(frozen=True, kw_only=True)
class Error:
    """An exception. ``in_band``: raised inside a living worker (a failed collective, its
    ``epoch``; or a SEV3 error already retried ``in_place``); otherwise it ends the process.
    ``usage``: bad input found before training (the whole run ends, exit 2). ``step``: the
    step it hit, ``None`` when the worker does not know (the agent's last known step)."""

    type_name: str
    message: str
    traceback: str = ""
    in_band: bool = False
    in_place: bool = False
    usage: bool = False
    step: int | None = None
    epoch: int | None = None


@dataclass(frozen=True, kw_only=True)
class WhereStore:
    """Worker -> agent: the training store stopped answering; where does it serve now? The
    agent answers at once with :class:`StoreAt` on the same connection (the one message a
    worker reads from its agent)."""


@dataclass(frozen=True, kw_only=True)
class StoreAt:
    """Agent -> worker: the training store's ``host:port`` as the coordinator last assigned it
    (:mod:`unicron.control.store`: a lost store is started again, perhaps elsewhere)."""

    address: str


@dataclass(frozen=True, kw_only=True)
class NodeFault:
    """The injected node fault fired: the agent takes its whole node down."""


@dataclass(frozen=True, kw_only=True)
class ZygoteUp:
    """The fork server is up (its connection carries :class:`Spawned` and :class:`Exited`)."""

    pid: int


@dataclass(frozen=True, kw_only=True)
class Spawned:
    """The zygote forked incarnation ``incarnation`` of ``slot``'s worker as ``pid``."""

    slot: int
    pid: int
    incarnation: int


@dataclass(frozen=True, kw_only=True)
class Exited:
    """A worker the zygote forked ended with ``returncode`` (negative: killed by a signal)."""

    pid: int
    returncode: int


@dataclass(frozen=True, kw_only=True)
class SpawnWorker:
    """Agent -> zygote: fork a worker for ``slot`` running ``script`` with ``argv``, with
    ``env`` added to the environment and its output appended to ``log``."""

    slot: int
    incarnation: int
    env: dict[str, str]
    script: str
    argv: tuple[str, ...]
    log: str


LocalMessage = (
    Hello
    | Ready
    | EpochEntered
    | Event
    | StepBegan
    | StepComputed
    | WaitingOnReplica
    | Error
    | WorkerDone
    | WhereStore
    | StoreAt
    | NodeFault
    | ZygoteUp
    | Spawned
    | Exited
    | SpawnWorker
)


def quiet(msg: LocalMessage) -> bool:
    """Whether the agent may read worker message ``msg`` on its next round (when its next
    exchange or timed check is due, within 250 ms) rather than at once: a step's begin, its
    computed report and its ``step_end`` record but the task's first, the messages whose
    reports :func:`unicron.control.client.can_wait` lets wait for the exchange rhythm anyway.
    A node's workers send a dozen of them per step; they carry their own time.

    The worker (:class:`unicron.runtime.link.AgentLink`) sends every message on its socket,
    which the agent reads once per round, and rings the agent's doorbell (a datagram to
    :data:`unicron.protocol.ENV_BELL`) after any message that is not quiet, which wakes the
    agent's round at once: an error, an epoch entered, a finished worker. One socket per
    worker keeps the messages in order."""
    if isinstance(msg, StepBegan | StepComputed):
        return True
    return isinstance(msg, Event) and msg.name == "step_end" and int(msg.fields.get("step", 0)) > 0


# -- the agent's own findings: agent -> coordinator --------------------------------------------
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
    others_queued_s: float | None = None
    """the run-queue wait of the worker's other threads (summed): the computing thread may wait
    on one of them"""
    runnable: bool | None = None
    """the computing thread was runnable (on a CPU or in the run queue) when read"""
    others_runnable: bool | None = None
    """another of the worker's threads was runnable (on a CPU or in the run queue) when read"""
    others_cpu_s: float | None = None
    """the CPU time of the worker's other threads (summed): a runnable one that got none waits
    for a CPU"""
    stolen_s: float | None = None
    """the machine's CPU time stolen by the hypervisor by then
    (:class:`~unicron.detect.busy.Stolen`): a thread held off by it shows neither CPU time nor
    a wait in the run queue"""


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
    with a coordinator (a restarted one adopts running tasks from it) and after a failed one:
    per slot, whether a worker process lives, whether it is still starting (no ``Ready``
    yet), whether it reported ready without having entered an epoch, and whether a health
    probe of it runs. A worker starting or ready holds a model it built, not the task's state
    (an agent before ``starting`` sends none: a coordinator then presumes every live worker
    outside those ready a holder)."""

    ts: float
    alive: tuple[int, ...] = ()
    ready: tuple[int, ...] = ()
    probing: tuple[int, ...] = ()
    starting: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    """slots whose worker reported the task's last step (it waits for the task's end)"""


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


def is_report(msg: object) -> TypeGuard[Report]:
    """Whether ``msg`` is a :data:`Report`: what a coordinator accepts from an agent (the
    service refuses the rest of the vocabulary, :func:`from_wire` decodes it all)."""
    return isinstance(msg, get_args(Report))


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
KINDS: dict[str, type] = {
    t.__name__: t
    for t in (
        Assignment,
        Spawn,
        Kill,
        Probe,
        *WORKER_FACTS,
        Hello,
        Error,
        WhereStore,
        StoreAt,
        NodeFault,
        ZygoteUp,
        Spawned,
        Exited,
        SpawnWorker,
        CpuTime,
        Detected,
        WorkerError,
        WorkerFailed,
        WorkerLeft,
        BadInput,
        ProbeDone,
        ProbeNotStarted,
        Census,
        Reply,
    )
}
"""every message class, by its name on the wire (the ``type`` of :func:`to_wire`'s dict)"""


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
    """One message as a JSON-ready dict, its class's name under ``type``."""
    out: dict[str, Any] = {"type": type(msg).__name__}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, Verdict):
            value = _verdict_to_wire(value)
        elif isinstance(value, WorkerSettings):
            value = dataclasses.asdict(value)
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


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def from_wire(d: Any) -> Any:
    """The message a :func:`to_wire` dict describes; ``ValueError`` for anything else (an
    unknown kind, a missing, unknown or mistyped field)."""
    try:
        cls = KINDS[d["type"]]
        known = _fields(cls)
        unknown = sorted(set(d) - set(known) - {"type"})
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            if name == "type":
                continue
            _check(cls, known[name], value)
            if name == "verdict" and value is not None:
                value = _verdict_from_wire(value)
            elif name == "settings":
                value = WorkerSettings(**value)
            elif name == "actions":
                value = tuple(from_wire(a) for a in value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return cls(**kwargs)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a message: {exc}") from exc
