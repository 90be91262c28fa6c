"""The error classification table: what went wrong, how bad it is, and what to do about it.

One table, :data:`RULES`, maps an observed failure to a :class:`Verdict` (kind, severity,
action). It is data, read top to bottom, first match wins; the functions below only walk it:

- a worker catches an exception in its training step and calls :func:`classify_exception`
  (or, when the error arrives from another process as a type name and a text, the agent or
  the coordinator calls :func:`classify_message`);
- the agent calls :func:`classify_exit` when a worker process ends;
- the coordinator's detectors call :func:`classify_detector` with the detector's name:
  ``hang`` and ``straggler`` (the step monitor, :mod:`unicron.detect.monitor`), ``stall`` and
  ``collective_stall`` (a transition or reduce that never ends, :mod:`unicron.detect.stall`),
  ``heartbeat_lost`` (node heartbeats);
- fault injection (``--inject error:kind=K``) and the simulator use :data:`KINDS`,
  :func:`make_exception` and :func:`verdict_for_kind`.

The verdict is what the table says about *one* failure. Whether it is the first or the fifth
failure on that slot is :mod:`unicron.control.escalation`'s business. Nothing here raises on odd
input: an error that no rule matches gets :data:`DEFAULT` (SEV2, restart the process).
No I/O, no clock, no torch import (the type names of torch's exceptions are matched as text,
so the table also classifies errors reported across processes).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT",
    "KINDS",
    "RULES",
    "Action",
    "Rule",
    "Scope",
    "Severity",
    "Verdict",
    "classify_detector",
    "classify_exception",
    "classify_exit",
    "classify_message",
    "make_exception",
    "table_markdown",
    "verdict_for_kind",
]


class Severity(enum.IntEnum):
    """How far the fix reaches (lower is worse, as in the paper).

    SEV1: reconfigure the cluster: a slot (device-level fault such as ECC) or a node (lost,
    or failing again and again) is excluded and every task is replanned.
    SEV2: restart the failed worker process in its slot; the task goes on around it.
    SEV3: reattempt in place: retry the step or collective in the same epoch, nothing restarts.
    """

    SEV1 = 1
    SEV2 = 2
    SEV3 = 3


class Action(enum.StrEnum):
    """What the coordinator does; the values are the ``action`` event's names (DESIGN.md)."""

    REATTEMPT = "reattempt"
    """retry the step / collective in the same epoch (SEV3)"""
    RESTART = "restart"
    """kill (if still alive) and restart the worker process in the same slot (SEV2)"""
    RECONFIGURE = "reconfigure"
    """replan the cluster without excluding anything, e.g. around a straggler (SEV1)"""
    EXCLUDE = "exclude"
    """take a slot or a node out of the plan until it is readmitted, then replan (SEV1)"""
    READMIT = "readmit"
    """an excluded slot passed its health probe: back in the plan, a worker starts there
    (the coordinator's own decision, never a classification rule's)"""


class Scope(enum.StrEnum):
    """What an EXCLUDE verdict takes out of the plan: the failed worker's slot or its node."""

    SLOT = "slot"
    NODE = "node"


@dataclass(frozen=True)
class Verdict:
    """The table's answer for one failure: ``kind`` (a row name, or ``unknown``), how bad it
    is, what to do, and a one-line human ``reason`` naming the evidence and the rule.
    ``scope`` says what an EXCLUDE applies to."""

    kind: str
    severity: Severity
    action: Action
    reason: str
    scope: Scope = Scope.SLOT


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the table.

    A row matches an exception when one of ``types`` is the name of a class in the
    exception's MRO (``ConnectionResetError`` also matches its subclasses), *or* ``pattern``
    (a case-insensitive regular expression) is found in its message. It matches a process
    exit when the return code is in ``exit_codes``, and a detector report when the name equals
    ``detector``. A row may combine several of these; an empty criterion never matches.
    """

    kind: str
    severity: Severity
    action: Action
    about: str
    """what the row is for, in a few words (docs and reasons)"""
    types: frozenset[str] = frozenset()
    pattern: str | None = None
    exit_codes: Container[int] = frozenset()
    detector: str | None = None
    scope: Scope = Scope.SLOT
    _regex: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.pattern is not None:
            object.__setattr__(self, "_regex", re.compile(self.pattern, re.IGNORECASE))

    def matches_exception(self, type_names: frozenset[str], message: str) -> bool:
        """True if the row's type names or its pattern match (``type_names``: the MRO's names)."""
        if self.types & type_names:
            return True
        return self._regex is not None and self._regex.search(message) is not None

    def verdict(self, evidence: str) -> Verdict:
        """This row's verdict, with ``evidence`` (what was seen) in the reason."""
        reason = f"{self.kind} (SEV{int(self.severity)} {self.action}): {self.about}: {evidence}"
        return Verdict(self.kind, self.severity, self.action, reason, self.scope)


SEV1, SEV2, SEV3 = Severity.SEV1, Severity.SEV2, Severity.SEV3
REATTEMPT, RESTART = Action.REATTEMPT, Action.RESTART
RECONFIGURE, EXCLUDE = Action.RECONFIGURE, Action.EXCLUDE

# fmt: off
RULES: tuple[Rule, ...] = (
    # ---- exceptions: hardware first (their texts also say "CUDA error"), then the more
    # specific communication errors, then the generic ones, user code last.
    Rule(kind="ecc", severity=SEV1, action=EXCLUDE, about="uncorrectable ECC error: faulty device",
         pattern=r"ECC error|cudaErrorECCUncorrectable|\bXid\b[^,]*?:\s*(48|63|64|94|95)\b"),
    Rule(kind="illegal_memory", severity=SEV2, action=RESTART,
         about="illegal memory access: the CUDA context is unusable",
         pattern=r"illegal memory access|cudaErrorIllegalAddress|illegal address"),
    Rule(kind="oom", severity=SEV2, action=RESTART, about="out of memory",
         types=frozenset({"OutOfMemoryError", "MemoryError"}),
         pattern=r"out of memory|can't allocate memory|CUBLAS_STATUS_ALLOC_FAILED"
                 r"|cudaErrorMemoryAllocation"),
    Rule(kind="timeout", severity=SEV3, action=REATTEMPT,
         about="collective or store timed out (transient)",
         types=frozenset({"TimeoutError", "StoreTimeout", "StoreLost"}),
         pattern=r"timed out|collective operation timeout|Timeout\(ms\)|Socket Timeout"
                 r"|deadline exceeded"),
    Rule(kind="nccl", severity=SEV2, action=RESTART, about="NCCL error: communicator is broken",
         pattern=r"\bNCCL (error|communicator|watchdog)"
                 r"|nccl(System|Internal|InvalidUsage|InvalidArgument|Remote|UnhandledCuda)Error"),
    Rule(kind="cuda", severity=SEV2, action=RESTART, about="CUDA error",
         types=frozenset({"AcceleratorError"}),
         pattern=r"CUDA error|CUDA driver error|cudaError\w+|device-side assert"),
    Rule(kind="conn_reset", severity=SEV3, action=REATTEMPT,
         about="connection reset or closed by a peer (peer gone or link flapping)",
         types=frozenset({"ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError"}),
         pattern=r"Connection (reset|closed) by peer|ECONNRESET|Broken pipe"),
    Rule(kind="conn_refused", severity=SEV3, action=REATTEMPT,
         about="connection refused (peer or store not listening yet)",
         types=frozenset({"ConnectionRefusedError"}),
         pattern=r"Connection refused|ECONNREFUSED|errno: 111\b"),
    Rule(kind="user", severity=SEV2, action=RESTART, about="Python error in the training script",
         types=frozenset({"ArithmeticError", "AssertionError", "AttributeError",
                          "FileNotFoundError", "ImportError", "IndexError", "KeyError",
                          "LookupError", "ModuleNotFoundError", "NameError", "NotImplementedError",
                          "RecursionError", "SyntaxError", "TypeError", "UnboundLocalError",
                          "UnicodeError", "ValueError", "ZeroDivisionError"})),
    # ---- process exits (Popen.returncode: -N = killed by signal N; 128+N is mapped to -N)
    Rule(kind="exited", severity=SEV2, action=RESTART,
         about="worker exited cleanly before the task ended", exit_codes=frozenset({0})),
    Rule(kind="killed", severity=SEV2, action=RESTART,
         about="killed by SIGKILL (or the OOM killer)", exit_codes=frozenset({-9})),
    Rule(kind="segfault", severity=SEV2, action=RESTART, about="segmentation fault (SIGSEGV)",
         exit_codes=frozenset({-11})),
    Rule(kind="aborted", severity=SEV2, action=RESTART,
         about="aborted (SIGABRT, e.g. a C++ exception or the NCCL watchdog)",
         exit_codes=frozenset({-6})),
    Rule(kind="bus_error", severity=SEV2, action=RESTART,
         about="bus error (SIGBUS, e.g. shared memory exhausted)", exit_codes=frozenset({-7})),
    Rule(kind="terminated", severity=SEV2, action=RESTART, about="terminated (SIGTERM or SIGINT)",
         exit_codes=frozenset({-15, -2})),
    Rule(kind="signal", severity=SEV2, action=RESTART, about="killed by another signal",
         exit_codes=range(-64, 0)),
    Rule(kind="exit_error", severity=SEV2, action=RESTART,
         about="exited with an error code (an uncaught error)", exit_codes=range(1, 1 << 31)),
    # ---- detectors
    Rule(kind="hang", severity=SEV2, action=RESTART,
         about="step far longer than expected: kill and restart the hung worker", detector="hang"),
    Rule(kind="stall", severity=SEV2, action=RESTART,
         about="the other members waited past the stall deadline for this one, outside a step "
               "(joining an epoch, or reducing): kill and restart it", detector="stall"),
    Rule(kind="collective_stall", severity=SEV3, action=REATTEMPT,
         about="every member waited past the stall deadline in the same collective: the "
               "epoch starts again with a fresh process group", detector="collective_stall"),
    Rule(kind="straggler", severity=SEV1, action=RECONFIGURE,
         about="worker persistently slower than its peers: replan", detector="straggler"),
    Rule(kind="heartbeat_lost", severity=SEV1, action=EXCLUDE,
         about="node's agent stopped heartbeating: node lost", detector="heartbeat_lost",
         scope=Scope.NODE),
)
# fmt: on

DEFAULT = Verdict(
    "unknown", SEV2, RESTART, "unknown (SEV2 restart): no rule matched: restarting is safe"
)
"""The safe default for anything the table does not know: restart the process in its slot."""

_EXCEPTION_KINDS = frozenset(r.kind for r in RULES if r.types or r.pattern)
KINDS: frozenset[str] = _EXCEPTION_KINDS | {"unknown"}
"""Error kinds that ``--inject error:kind=K`` can raise (each one :func:`make_exception` makes;
``unknown`` raises an error no rule matches, to exercise the default)."""

_MAX_CHAIN = 16
_MAX_EVIDENCE = 200


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_EVIDENCE else line[: _MAX_EVIDENCE - 3] + "..."


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not break classification
        return ""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts and (for groups) its members, each once, bounded."""
    todo, seen = [exc], set[int]()
    while todo and len(seen) < _MAX_CHAIN:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)


def _mro_names(exc: BaseException) -> frozenset[str]:
    return frozenset(c.__name__ for c in type(exc).__mro__)


def classify_exception(exc: BaseException) -> Verdict:
    """Classify an exception caught in a worker (called by the worker, in its except clause).

    The exception is tried against the rules in table order; if none matches, its cause,
    context (and a group's members) are tried in turn, so an NCCL error wrapped in a plain
    ``RuntimeError("step failed")`` is still an NCCL error, while the outermost exception that
    a rule recognises wins. Never raises.
    """
    for e in _chain(exc):
        names, message = _mro_names(e), _message(e)
        for rule in RULES:
            if rule.matches_exception(names, message):
                return rule.verdict(_one_line(f"{type(e).__name__}: {message}"))
    return _default(f"{type(exc).__name__}: {_message(exc)}")


def classify_message(type_name: str, message: str) -> Verdict:
    """Classify an error reported across processes as (type name, text); called by the agent
    or the coordinator on a worker's error report. ``type_name`` may be qualified
    (``torch.OutOfMemoryError``); only its last part is compared, and only by name (the MRO
    is unknown here, so ``ValueError`` subclasses match by pattern or not at all). Never raises.
    """
    name = str(type_name).rpartition(".")[2]
    text = str(message)
    for rule in RULES:
        if rule.matches_exception(frozenset({name}), text):
            return rule.verdict(_one_line(f"{name}: {text}"))
    return _default(f"{name}: {text}")


def _signal_name(signum: int) -> str:
    names = {2: "SIGINT", 6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
    return names.get(signum, f"signal {signum}")


def classify_exit(returncode: int) -> Verdict:
    """Classify a worker process's end (called by the agent when it reaps a worker).

    ``returncode`` as :class:`subprocess.Popen` reports it: ``-N`` killed by signal N, else the
    exit status; a shell's ``128+N`` is read as signal N. ``0`` is a clean exit: the agent
    only asks when the worker had not reported the end of its task. Never raises.
    """
    try:
        code = int(returncode)
    except (TypeError, ValueError, OverflowError):
        return _default(f"exit code {returncode!r}")
    if 128 < code <= 128 + 64:
        code = -(code - 128)
    evidence = f"exit code {returncode}"
    if code < 0:
        evidence = f"killed by {_signal_name(-code)} (return code {returncode})"
    for rule in RULES:
        if code in rule.exit_codes:
            return rule.verdict(evidence)
    return _default(evidence)


def classify_detector(name: str) -> Verdict:
    """Classify a detector's report: ``hang`` and ``straggler`` (the step monitor),
    ``stall`` and ``collective_stall`` (:mod:`unicron.detect.stall`), ``heartbeat_lost``. Never
    raises."""
    for rule in RULES:
        if rule.detector is not None and rule.detector == name:
            return rule.verdict(f"detector {name!r}")
    return _default(f"detector {name!r}")


def verdict_for_kind(kind: str) -> Verdict:
    """The table's verdict for a named kind (the simulator; checking an ``--inject`` kind).
    A kind with no row gets :data:`DEFAULT`."""
    for rule in RULES:
        if rule.kind == kind:
            return rule.verdict(f"kind {kind!r}")
    return _default(f"kind {kind!r}")


def _default(evidence: str) -> Verdict:
    return Verdict(
        DEFAULT.kind, DEFAULT.severity, DEFAULT.action, f"{DEFAULT.reason}: " + _one_line(evidence)
    )


# Stand-ins named like torch's exceptions (this module does not import torch): the table
# matches by class *name*, so the real ones and these classify alike.
class OutOfMemoryError(RuntimeError):
    """Stand-in for ``torch.OutOfMemoryError`` (a ``RuntimeError``)."""


class AcceleratorError(RuntimeError):
    """Stand-in for ``torch.AcceleratorError`` (CUDA errors, torch >= 2.8)."""


class DistBackendError(RuntimeError):
    """Stand-in for ``torch.distributed.DistBackendError`` (backend errors such as NCCL's)."""


class DistNetworkError(RuntimeError):
    """Stand-in for ``torch.distributed.DistNetworkError`` (store / socket errors)."""


_CUDA_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

_EXAMPLES: dict[str, tuple[type[BaseException], str]] = {
    "ecc": (AcceleratorError, "CUDA error: uncorrectable ECC error encountered" + _CUDA_TAIL),
    "illegal_memory": (
        AcceleratorError,
        "CUDA error: an illegal memory access was encountered" + _CUDA_TAIL,
    ),
    "oom": (
        OutOfMemoryError,
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
        "of which 1.06 GiB is free. Of the allocated memory 74.21 GiB is allocated by PyTorch, "
        "and 2.31 GiB is reserved by PyTorch but unallocated.",
    ),
    "timeout": (
        DistBackendError,
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1042, "
        "OpType=ALLREDUCE, NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran for "
        "600035 milliseconds before timing out.",
    ),
    "nccl": (
        DistBackendError,
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled "
        "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
        "device error.\nLast error:\nsocketProgress: Connection closed by remote peer",
    ),
    "cuda": (AcceleratorError, "CUDA error: unspecified launch failure" + _CUDA_TAIL),
    "conn_reset": (
        RuntimeError,
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40312: "
        "Connection reset by peer",
    ),
    "conn_refused": (
        DistNetworkError,
        "The client socket has failed to connect to [localhost]:29500 "
        "(errno: 111 - Connection refused).",
    ),
    "user": (ValueError, "could not convert string to float: 'lr'"),
    "unknown": (RuntimeError, "injected error that no classification rule knows"),
}


def make_exception(kind: str) -> BaseException:
    """A representative exception of ``kind`` (one of :data:`KINDS`) with a realistic message,
    for ``--inject error:kind=K`` and tests; ``classify_exception`` gives it back ``kind``.
    An unknown kind is a ``ValueError`` naming the known ones."""
    if kind not in _EXAMPLES:
        raise ValueError(f"unknown error kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    cls, message = _EXAMPLES[kind]
    return cls(message)


def _criteria(rule: Rule) -> str:
    parts = []
    if rule.types:
        parts.append("type " + " / ".join(f"`{t}`" for t in sorted(rule.types)))
    if rule.pattern:
        parts.append("message ~ `" + rule.pattern.replace("|", "\\|") + "`")
    codes = rule.exit_codes
    if isinstance(codes, range):
        parts.append(f"exit code in {codes.start}..{codes.stop - 1}")
    elif isinstance(codes, frozenset) and codes:
        parts.append("exit code " + ", ".join(str(c) for c in sorted(codes)))
    if rule.detector:
        parts.append(f"detector `{rule.detector}`")
    return "; or ".join(parts)


def table_markdown() -> str:
    """:data:`RULES` as a Markdown table (first match wins), for ``docs/detection.md``."""
    lines = [
        "| kind | severity | action | what | matches |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in RULES:
        action = f"{rule.action} {rule.scope}" if rule.action is EXCLUDE else str(rule.action)
        lines.append(
            f"| {rule.kind} | SEV{int(rule.severity)} | {action} | {rule.about} | "
            f"{_criteria(rule)} |"
        )
    lines.append(
        f"| unknown (default) | SEV{int(DEFAULT.severity)} | {DEFAULT.action} | "
        "anything no row matches | - |"
    )
    return "\n".join(lines)
