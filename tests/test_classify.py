"""The classification table: one case per row, the default, odd input, injection round trip."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicron.detect.classify import (
    DEFAULT,
    KINDS,
    RULES,
    Action,
    Scope,
    Severity,
    classify_detector,
    classify_exception,
    classify_exit,
    classify_message,
    make_exception,
    table_markdown,
    verdict_for_kind,
)

S1, S2, S3 = Severity.SEV1, Severity.SEV2, Severity.SEV3

# (type name, message) -> kind, severity, action: real texts from gloo, NCCL, CUDA, torch.
MESSAGES = [
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", "ecc", S1, Action.EXCLUDE),
    ("RuntimeError", "NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, DBE", "ecc", S1, Action.EXCLUDE),
    (
        "AcceleratorError",
        "CUDA error: an illegal memory access was encountered",
        "illegal_memory",
        S2,
        Action.RESTART,
    ),
    ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB", "oom", S2,
     Action.RESTART),
    ("MemoryError", "", "oom", S2, Action.RESTART),
    (
        "RuntimeError",
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)",
        "oom",
        S2,
        Action.RESTART,
    ),
    (
        "RuntimeError",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "1800000ms for recv operation to complete",
        "timeout",
        S3,
        Action.REATTEMPT,
    ),
    ("DistStoreError", "wait timeout after 300000ms, keys: /epoch/3: Socket Timeout", "timeout",
     S3, Action.REATTEMPT),
    ("TimeoutError", "", "timeout", S3, Action.REATTEMPT),
    # the worker's bounded store connection (unicron.runtime.bounded) and what it becomes
    ("unicron.runtime.bounded.StoreTimeout", "no answer within 3.0 s", "timeout", S3,
     Action.REATTEMPT),
    ("StoreLost", "the training store stopped answering (no answer within 3.0 s)", "timeout",
     S3, Action.REATTEMPT),
    (
        "torch.distributed.DistBackendError",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.21.5",
        "nccl",
        S2,
        Action.RESTART,
    ),
    ("DistBackendError", "ncclRemoteError: A call failed possibly due to a network error or a "
     "remote process exiting prematurely.", "nccl", S2, Action.RESTART),
    ("RuntimeError", "CUDA error: device-side assert triggered", "cuda", S2, Action.RESTART),
    ("AcceleratorError", "", "cuda", S2, Action.RESTART),
    (
        "RuntimeError",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:40312",
        "conn_reset",
        S3,
        Action.REATTEMPT,
    ),
    ("ConnectionResetError", "[Errno 104] Connection reset by peer", "conn_reset", S3,
     Action.REATTEMPT),
    ("BrokenPipeError", "[Errno 32] Broken pipe", "conn_reset", S3, Action.REATTEMPT),
    (
        "RuntimeError",
        "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
        "Connection refused",
        "conn_refused",
        S3,
        Action.REATTEMPT,
    ),
    ("ConnectionRefusedError", "[Errno 111] Connection refused", "conn_refused", S3,
     Action.REATTEMPT),
    ("ValueError", "could not convert string to float: 'x'", "user", S2, Action.RESTART),
    ("KeyError", "'lr'", "user", S2, Action.RESTART),
    ("ZeroDivisionError", "division by zero", "user", S2, Action.RESTART),
    ("builtins.TypeError", "unsupported operand type(s)", "user", S2, Action.RESTART),
]  # fmt: skip


@pytest.mark.parametrize(("type_name", "message", "kind", "severity", "action"), MESSAGES)
def test_message_rows(
    type_name: str, message: str, kind: str, severity: Severity, action: Action
) -> None:
    v = classify_message(type_name, message)
    assert (v.kind, v.severity, v.action) == (kind, severity, action), v.reason
    assert v.reason.startswith(kind)


EXITS = [
    (0, "exited"),
    (-9, "killed"),
    (137, "killed"),
    (-11, "segfault"),
    (139, "segfault"),
    (-6, "aborted"),
    (-7, "bus_error"),
    (-15, "terminated"),
    (-2, "terminated"),
    (-10, "signal"),
    (1, "exit_error"),
    (2, "exit_error"),
    (255, "exit_error"),
]


@pytest.mark.parametrize(("code", "kind"), EXITS)
def test_exit_rows(code: int, kind: str) -> None:
    v = classify_exit(code)
    assert v.kind == kind
    assert (v.severity, v.action) == (S2, Action.RESTART)
    assert str(code) in v.reason


@pytest.mark.parametrize(
    ("name", "severity", "action", "scope"),
    [
        ("hang", S2, Action.RESTART, Scope.SLOT),
        ("stall", S2, Action.RESTART, Scope.SLOT),
        ("collective_stall", Severity.SEV3, Action.REATTEMPT, Scope.SLOT),
        ("straggler", S1, Action.RECONFIGURE, Scope.SLOT),
        ("heartbeat_lost", S1, Action.EXCLUDE, Scope.NODE),
    ],
)
def test_detector_rows(name: str, severity: Severity, action: Action, scope: Scope) -> None:
    v = classify_detector(name)
    assert (v.kind, v.severity, v.action, v.scope) == (name, severity, action, scope)


def test_every_row_is_tested() -> None:
    tested = {m[2] for m in MESSAGES} | {e[1] for e in EXITS}
    tested |= {"hang", "stall", "collective_stall", "straggler", "heartbeat_lost"}
    assert {r.kind for r in RULES} == tested


def test_design_severities() -> None:
    """DESIGN.md's severity table, kind by kind."""
    expected = {
        "conn_reset": (S3, Action.REATTEMPT),
        "conn_refused": (S3, Action.REATTEMPT),
        "timeout": (S3, Action.REATTEMPT),
        "cuda": (S2, Action.RESTART),
        "illegal_memory": (S2, Action.RESTART),
        "killed": (S2, Action.RESTART),
        "hang": (S2, Action.RESTART),
        "user": (S2, Action.RESTART),
        "oom": (S2, Action.RESTART),
        "ecc": (S1, Action.EXCLUDE),
        "heartbeat_lost": (S1, Action.EXCLUDE),
    }
    for kind, (severity, action) in expected.items():
        v = verdict_for_kind(kind)
        assert (v.kind, v.severity, v.action) == (kind, severity, action)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_make_exception_round_trip(kind: str) -> None:
    exc = make_exception(kind)
    assert classify_exception(exc).kind == kind
    assert classify_message(type(exc).__name__, str(exc)).kind == kind
    assert verdict_for_kind(kind).kind == kind


def test_kinds_cover_the_injectable_minimum() -> None:
    minimum = {"nccl", "cuda", "illegal_memory", "ecc", "oom", "conn_reset", "conn_refused"}
    assert minimum | {"timeout", "user"} <= KINDS


def test_make_exception_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown error kind 'bogus'"):
        make_exception("bogus")


def test_unknown_gets_the_safe_default() -> None:
    for v in (
        classify_exception(RuntimeError("mat1 and mat2 shapes cannot be multiplied")),
        classify_message("SomethingOdd", "what"),
        classify_exit(-99),
        classify_detector("no_such_detector"),
        verdict_for_kind("no_such_kind"),
    ):
        assert (v.kind, v.severity, v.action) == ("unknown", S2, Action.RESTART)
        assert v.reason.startswith(DEFAULT.reason)


def test_wrapped_error_is_found_through_the_chain() -> None:
    try:
        try:
            raise make_exception("nccl")
        except RuntimeError as inner:
            raise RuntimeError("training step failed") from inner
    except RuntimeError as outer:
        assert classify_exception(outer).kind == "nccl"


def test_outermost_recognised_error_wins() -> None:
    """A stray KeyError in the context (handled inside a library) does not make it a user error."""
    exc = make_exception("conn_reset")
    exc.__context__ = KeyError("x")
    assert classify_exception(exc).kind == "conn_reset"


def test_subclass_matches_by_mro() -> None:
    class MyConfigError(ValueError):
        pass

    assert classify_exception(MyConfigError("bad")).kind == "user"


def test_exception_group_members_are_classified() -> None:
    group = BaseExceptionGroup("workers", [RuntimeError("x"), make_exception("ecc")])
    assert classify_exception(group).kind == "ecc"


def test_odd_exceptions_never_raise() -> None:
    class BadStr(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    cyclic_a, cyclic_b = RuntimeError("a"), RuntimeError("b")
    cyclic_a.__context__, cyclic_b.__context__ = cyclic_b, cyclic_a
    assert classify_exception(BadStr()).kind == "unknown"
    assert classify_exception(cyclic_a).kind == "unknown"
    assert classify_exception(KeyboardInterrupt()).kind == "unknown"
    assert classify_exit("x").kind == "unknown"  # type: ignore[arg-type]


@given(st.text(max_size=200), st.text(max_size=500))
def test_messages_never_raise(type_name: str, message: str) -> None:
    v = classify_message(type_name, message)
    assert v.kind in {r.kind for r in RULES} | {"unknown"}
    assert "\n" not in v.reason


@given(st.integers(min_value=-(1 << 40), max_value=1 << 40))
def test_exits_never_raise(code: int) -> None:
    assert classify_exit(code).severity is S2


def test_table_markdown_lists_every_row() -> None:
    table = table_markdown()
    for rule in RULES:
        assert re.search(rf"^\| {rule.kind} \| SEV{int(rule.severity)} \|", table, re.M)
    assert "unknown (default)" in table
