"""``--inject`` specs: parsed once, round-trip, one-line errors."""

from __future__ import annotations

import time
from typing import Any

import pytest

from unicron.errors import UsageError
from unicron.runtime.inject import FaultPlan, parse, slow_down, slowdown, stop_self


@pytest.mark.parametrize(
    "spec",
    [
        "crash:rank=1,step=30",
        "crash:rank=0,step=5,mb=1",
        "hang:rank=2,step=3",
        "error:rank=1,step=2,kind=cuda",
        "slow:rank=0,step=9,factor=2.5",
        "node:node=1,step=4",
        "crash:rank=5,step=7,members=8",
        "crash:rank=0,step=5,phase=update",
        "hang:rank=1,step=5,phase=update",
    ],
)
def test_round_trip(spec: str) -> None:
    fault = parse(spec, frozenset({"cuda"}))
    assert parse(fault.spec, frozenset({"cuda"})) == fault
    assert fault.fault == spec.split(":")[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("boom:rank=1,step=1", "unknown fault 'boom'"),
        ("crash:rank=1", "missing step"),
        ("crash:rank=x,step=1", "rank must be an integer"),
        ("crash:rank=-1,step=1", "rank must be >= 0"),
        ("crash:rank=1,step=1,color=red", "unknown key 'color'"),
        ("crash:rank1,step=1", "expected key=value"),
        ("error:rank=1,step=1,kind=nope", "unknown kind 'nope'"),
        ("slow:rank=1,step=1,factor=0.5", "factor must be >= 1"),
        ("slow:rank=1,step=1,factor=fast", "factor must be a number"),
        ("crash:rank=1,step=1,phase=vote", "phase must be one of compute, update"),
        ("crash:rank=1,step=1,phase=update,mb=2", "mb is a point of the compute"),
        ("slow:rank=1,step=1,factor=2,phase=update", "unknown key 'phase' for slow"),
    ],
)
def test_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse(spec, frozenset({"cuda"}))
    assert "\n" not in str(info.value)


def test_only_a_slow_fault_that_fired_slows_the_worker() -> None:
    # a slow fault whose step went by while its slot was out never fired (no event): a worker
    # started past it must not be silently slow (the soak's ghost stragglers and hangs)
    early, late = parse("slow:rank=2,step=5,factor=4"), parse("slow:rank=2,step=9,factor=2")
    assert slowdown([early, late], fired=set()) == 1.0
    assert slowdown([early, late], fired={late.spec}) == 2.0
    assert slowdown([early, late], fired={early.spec, late.spec}) == 4.0
    assert slowdown([parse("crash:rank=2,step=5")], fired={"crash:step=5,rank=2"}) == 1.0


def _plan(*specs: str, **kw: Any) -> tuple[FaultPlan, list[tuple[str, dict[str, Any]]], list[str]]:
    events: list[tuple[str, dict[str, Any]]] = []
    acted: list[str] = []
    plan = FaultPlan(
        [parse(s) for s in specs],
        emit=lambda name, **fields: events.append((name, fields)),
        rank=1,
        act=lambda f: acted.append(f.spec),
        **kw,
    )
    return plan, events, acted


def test_a_fault_plan_fires_each_fault_once_at_its_step_with_its_event() -> None:
    plan, events, acted = _plan("hang:rank=1,step=3", "crash:rank=1,step=3,mb=1")
    hang = plan.faults[0].spec
    plan.fire_due("hang", 2)
    assert acted == []  # not its step
    plan.fire_due("hang", 3)
    plan.fire_due("hang", 3)  # once
    assert acted == [hang]
    assert events == [
        (
            "fault_injected",
            {"fault": "hang", "kind": None, "spec": hang, "step": 3, "rank": 1},
        )
    ]
    assert plan.crash_point(3, 4) == 1 and plan.crash_point(4, 4) == -1
    plan.fire_due("crash", 3)
    assert plan.crash_point(3, 4) == -1  # fired: no longer due


def test_a_crash_in_the_update_is_no_point_of_the_compute() -> None:
    """``phase=update``: the worker fires it after the step's vote (:meth:`fire_in_update`),
    never among its micro-batches, and a baseline's per-micro-batch hook never sees it."""
    plan, events, acted = _plan("crash:rank=1,step=3,phase=update")
    assert plan.crash_point(3, 4) == -1 and plan.due_after(3, 2, 4) == []
    plan.fire_in_update(2)
    assert acted == []
    plan.fire_in_update(3)
    plan.fire_in_update(3)
    assert acted == [plan.faults[0].spec] and events[0][1]["step"] == 3


def test_a_hang_in_the_update_fires_after_the_vote_only() -> None:
    """``hang:...,phase=update``: not as the step begins (:meth:`fire_due`) but in its
    update (of the last step: a worker hung after the task's end)."""
    plan, events, acted = _plan("hang:rank=1,step=3,phase=update")
    plan.fire_due("hang", 3)
    assert acted == [] and plan.due_after(3, 2, 4) == []
    plan.fire_in_update(3)
    assert acted == [plan.faults[0].spec] and events[0][1]["fault"] == "hang"


def test_a_fault_with_members_waits_for_an_epoch_that_large() -> None:
    """``members=M``: at its step or the first one after it in an epoch of at least M
    members (the second fault of a test that must come once the task healed from the
    first, however slow the machine); a process that does not know its epoch's size (a
    baseline's fixed world) fires it at its step."""
    plan, _, acted = _plan("crash:rank=1,step=7,members=8")
    plan.members = 4  # the task has not healed yet: no crash at its step, nor after
    assert plan.crash_point(6, 4) == -1 and plan.crash_point(7, 4) == -1
    assert plan.crash_point(9, 4) == -1
    plan.members = 8  # healed: the first step from 7 on
    assert plan.crash_point(10, 4) == 2
    plan.fire_due("crash", 10)
    assert acted == [plan.faults[0].spec] and plan.crash_point(11, 4) == -1
    baseline, _, _ = _plan("crash:rank=1,step=7,members=8")  # members unknown: at step 7
    assert baseline.crash_point(7, 4) == 2 and baseline.crash_point(8, 4) == -1


def test_a_crash_without_mb_falls_mid_step_and_due_after_counts_micro_batches() -> None:
    plan, _, _ = _plan("crash:rank=1,step=5", "crash:rank=1,step=6,mb=0", "hang:rank=1,step=5")
    assert plan.crash_point(5, 4) == 2 and plan.crash_point(6, 4) == 0
    assert [f.fault for f in plan.due_after(5, 2, 4)] == ["crash", "hang"]
    assert [f.spec for f in plan.due_after(6, 0, 4)] == [plan.faults[1].spec]
    assert plan.due_after(5, 1, 4) == []


def test_slow_faults_fire_with_their_factor_and_a_claim_can_refuse() -> None:
    plan, events, _ = _plan("slow:rank=1,step=2,factor=3", claim=lambda f: True)
    assert plan.slowdown(1) == 1.0
    assert plan.slowdown(2) == 3.0 and plan.slowdown(3) == 3.0
    assert [e[1]["factor"] for e in events] == [3.0]
    refused, events, acted = _plan("crash:rank=1,step=1", claim=lambda f: False)
    refused.fire_due("crash", 1)
    assert acted == [] and events == []  # another incarnation fired it already


def test_stop_self_raises_the_classified_error_and_refuses_what_is_not_its_own() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        stop_self(parse("error:rank=0,step=1,kind=cuda"))
    with pytest.raises(ValueError, match="no effect of its own"):
        stop_self(parse("node:node=0,step=1"))


@pytest.mark.parametrize("on_cpu", [True, False])
def test_a_slow_fault_spends_cpu_on_a_cpu_device_and_waits_on_an_accelerator(
    on_cpu: bool,
) -> None:
    """The straggler detector's two-step verdict asks a CPU device's step to cost CPU time:
    there the fault spends it, as a slower core would; on an accelerator it waits."""
    wall, cpu = time.perf_counter(), time.thread_time()
    slow_down(0.05, on_cpu=on_cpu)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.05
    assert cpu >= 0.05 if on_cpu else cpu < 0.025
