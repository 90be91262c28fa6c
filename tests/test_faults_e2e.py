"""Every fault of the ``--inject`` contract, end to end through ``unicron run``.

Each run injects one fault into 4 CPU workers and asserts what DESIGN.md promises for it:
how it is detected (method, kind, severity, latency), what the coordinator does about it
(the ``action`` events, the epochs), and that the healed task ends with the same parameters
as a fault-free run of the same length (computed once for the module). Then the faults
nothing can heal: a script that cannot start, a user error that repeats on every restart,
fewer usable slots than ``--min-workers``; each ends with exit 1 and its reason, in bounded
time.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, RunResult, run_unicron

STEPS = 24
SCRIPTS = ROOT / "tests" / "scripts"
RESTART_LIMIT = 3  # EscalationSettings.restart_limit: restarts a slot gets before exclusion

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def clean(fault_free_4x24: RunResult) -> RunResult:
    """The fault-free reference run (:func:`tests.conftest.fault_free_4x24`, STEPS steps)."""
    return fault_free_4x24


def _healed(r: RunResult, clean: RunResult) -> None:
    """The task finished every step, with the fault-free run's parameters, bit for bit."""
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == STEPS
    assert r.task_end["params_sha256"] == clean.task_end["params_sha256"]


def _fault(r: RunResult, fault: str) -> dict[str, Any]:
    fired = r.of("fault_injected")
    assert [e["fault"] for e in fired] == [fault], fired
    return fired[0]


def _actions(r: RunResult, action: str) -> list[dict[str, Any]]:
    return [e for e in r.of("action") if e["action"] == action]


def _rejoined(r: RunResult, slot: int, after: float) -> bool:
    """Some epoch that began after ``after`` has ``slot`` among its members."""
    return any(slot in e["members"] for e in r.of("epoch_begin") if e["ts"] >= after)


def test_hang_is_detected_by_the_monitor_and_the_hung_worker_restarted(
    run: Any, clean: RunResult
) -> None:
    r = run("--nproc-per-node", "4", "--inject", "hang:rank=2,step=12", steps=STEPS)
    _healed(r, clean)
    fault = _fault(r, "hang")
    assert (fault["rank"], fault["step"]) == (2, 12)

    hangs = [e for e in r.of("error_detected") if e["kind"] == "hang"]
    assert len(hangs) == 1, r.of("error_detected")
    hang = hangs[0]
    assert hang["method"] == "monitor" and hang["slot"] == 2 and hang["severity"] == 2
    # target (DESIGN.md): max(3 x median step, 1 s) + 0.5 s; asserted with 10x headroom
    before = [e["duration_s"] for e in r.of("step_end") if e["step"] < fault["step"]]
    target_s = max(3 * statistics.median(before), 1.0) + 0.5
    latency_s = hang["ts"] - fault["ts"]
    assert 0 <= latency_s < 10 * target_s, (latency_s, target_s)

    # the hung worker (only it) is restarted, and comes back
    restarts = _actions(r, "restart")
    assert [e["slot"] for e in restarts] == [2], r.of("action")
    assert restarts[0]["ts"] >= hang["ts"]
    assert _rejoined(r, 2, after=restarts[0]["ts"])
    assert r.of("step_end")[-1]["workers"] == 4


@pytest.mark.long
def test_a_deadlocked_worker_writes_where_it_hung_before_it_is_killed(run: Any) -> None:
    """A worker blocked for ever on a lock (alive, no CPU) is found by the monitor; before
    the kill the agent has it write every thread's stack into its log."""
    r = run(
        "--nproc-per-node", "2", script=SCRIPTS / "deadlock.py", steps=None,
        script_args=("--steps", "12", "--rank", "1", "--at-step", "8", "--out", "out"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == 12
    (hang,) = [e for e in r.of("error_detected") if e["kind"] == "hang"]
    assert hang["slot"] == 1 and hang["step"] == 8
    log = (r.out.parent / "logs" / "worker1.0.log").read_text()
    assert "most recent call first" in log and "take_twice" in log, log[-3000:]


@pytest.mark.long
def test_a_starved_worker_is_not_killed_as_hung(run: Any) -> None:
    """A worker that other processes starve of CPU lasts past its hang allowance while every
    peer finished the step, but its CPU time advances: it is left to finish (before, it was
    killed as hung: the main false alarm of the fault tests on a loaded machine)."""
    r = run(
        "--nproc-per-node", "2", script=SCRIPTS / "starved.py", steps=None,
        script_args=("--steps", "12", "--starve-rank", "1", "--starve-step", "8"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == 12
    ends = {e["step"]: e["duration_s"] for e in r.of("step_end")}
    allowance = max(3 * statistics.median(d for s, d in ends.items() if 2 <= s < 8), 1.0)
    assert not r.of("error_detected"), r.of("error_detected")
    assert not r.of("action") and len(r.of("epoch_begin")) == 1
    if ends[8] < 1.2 * allowance:  # the throttle runs it >= 8 % of the time (see the script)
        pytest.skip(f"too loaded to starve a worker past its allowance: {ends[8]:.2f} s")


@pytest.mark.long
def test_a_lone_worker_hang_is_confirmed_at_twice_its_deadline_and_healed_from_the_checkpoint(
    run: Any, clean: RunResult
) -> None:
    # one worker: no peer can vouch that the step hangs, so the agent waits two allowances
    r = run(
        "--nproc-per-node", "1", "--checkpoint-every", "5", "--inject", "hang:rank=0,step=12",
        steps=STEPS,
    )  # fmt: skip
    _healed(r, clean)  # exact: the same parameters as 4 workers without a fault
    fault = _fault(r, "hang")
    (hang,) = [e for e in r.of("error_detected") if e["kind"] == "hang"]
    assert hang["method"] == "monitor" and hang["slot"] == 0 and "alone" in hang["reason"]
    before = [e["duration_s"] for e in r.of("step_end") if e["step"] < fault["step"]]
    target_s = 2 * max(3 * statistics.median(before), 1.0) + 0.5
    latency_s = hang["ts"] - fault["ts"]
    assert 0.5 * target_s <= latency_s < 10 * target_s, (latency_s, target_s)
    assert [e["slot"] for e in _actions(r, "restart")] == [0], r.of("action")
    # nothing else held the state: it came back from the newest checkpoint (step 10's, written
    # in the background two steps before the hang stopped the process), in a new epoch (the
    # restarted worker does not join the stale one that named its previous incarnation)
    saved = [e["step"] for e in r.of("checkpoint_saved") if e["ok"] and e["ts"] < fault["ts"]]
    assert saved and max(saved) in (5, 10), saved
    (back,) = [e for e in r.of("transition_end") if e["ts"] > hang["ts"]]
    assert (back["epoch"], back["state_source"]) == (2, "checkpoint"), back
    assert back["step"] in (max(saved), 10), (back, saved)  # 10: written, its event not sent
    assert [e["step"] for e in r.of("step_end")].count(back["step"]) == 2  # redone, visibly


@pytest.mark.long
def test_a_lone_slow_worker_with_no_copy_of_its_state_is_reported_not_killed(run: Any) -> None:
    # alone and no checkpoint: a kill would lose the only state; a 30x slower step overruns
    # the lone deadline (2 x max(3 x ~0.1 s, 1 s)), is reported, and the run still finishes
    # (one slow step: on a loaded machine each lasts 30 loaded steps)
    steps = 13
    r = run(
        "--nproc-per-node", "1", "--checkpoint-every", "0",
        "--inject", "slow:rank=0,step=12,factor=30", steps=steps,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == steps
    hangs = [e for e in r.of("error_detected") if e["kind"] == "hang"]
    assert hangs and all("not killed" in e["reason"] for e in hangs), hangs
    assert not r.of("action"), r.of("action")
    assert len(r.of("epoch_begin")) == 1


@pytest.mark.long
def test_sev3_error_is_reattempted_in_place_without_a_new_epoch(run: Any, clean: RunResult) -> None:
    r = run(
        "--nproc-per-node", "4", "--inject", "error:rank=1,step=10,kind=conn_reset", steps=STEPS
    )
    _healed(r, clean)
    fault = _fault(r, "error")
    assert fault["kind"] == "conn_reset"

    detected = r.of("error_detected")
    assert len(detected) == 1, detected
    assert detected[0]["kind"] == "conn_reset" and detected[0]["severity"] == 3
    assert detected[0]["slot"] == 1 and detected[0]["method"] == "exception"
    assert [(e["action"], e["slot"]) for e in r.of("action")] == [("reattempt", 1)]
    # in place: the first epoch is the only one, no process was restarted
    assert len(r.of("epoch_begin")) == 1, r.of("epoch_begin")
    assert not _actions(r, "restart")
    assert all(e["workers"] == 4 for e in r.of("step_end"))


def test_sev2_error_restarts_the_worker_in_its_slot(run: Any, clean: RunResult) -> None:
    r = run("--nproc-per-node", "4", "--inject", "error:rank=1,step=10,kind=cuda", steps=STEPS)
    _healed(r, clean)
    _fault(r, "error")

    cuda = [e for e in r.of("error_detected") if e["kind"] == "cuda"]
    assert len(cuda) == 1 and cuda[0]["slot"] == 1 and cuda[0]["severity"] == 2, cuda
    restarts = _actions(r, "restart")
    assert [e["slot"] for e in restarts] == [1], r.of("action")
    assert not _actions(r, "exclude")
    assert _rejoined(r, 1, after=restarts[0]["ts"])
    assert r.of("step_end")[-1]["workers"] == 4


def test_sev1_error_excludes_the_slot_and_the_task_goes_on_with_three(
    run: Any, clean: RunResult
) -> None:
    r = run("--nproc-per-node", "4", "--inject", "error:rank=3,step=10,kind=ecc", steps=STEPS)
    # exact even with fewer workers: the global batch never changes
    _healed(r, clean)
    _fault(r, "error")

    ecc = [e for e in r.of("error_detected") if e["kind"] == "ecc"]
    assert len(ecc) == 1 and ecc[0]["slot"] == 3 and ecc[0]["severity"] == 1, ecc
    excluded = _actions(r, "exclude")
    assert [e["slot"] for e in excluded] == [3], r.of("action")
    assert not _actions(r, "restart")
    assert not _rejoined(r, 3, after=excluded[0]["ts"])
    assert r.of("step_end")[-1]["workers"] == 3


@pytest.mark.long
def test_a_lost_node_is_logged_detected_and_the_survivors_go_on(run: Any, clean: RunResult) -> None:
    r = run(
        "--nnodes", "2", "--nproc-per-node", "2", "--inject", "node:node=1,step=10", steps=STEPS
    )
    _healed(r, clean)
    # the vanishing node's agent hands the injector's record over before it falls silent
    fault = _fault(r, "node")
    assert fault["node"] == 1 and fault["step"] == 10
    lost = [e for e in r.of("error_detected") if e["kind"] == "heartbeat_lost"]
    assert [e["node"] for e in lost] == [1], r.of("error_detected")
    assert [(e["action"], e["node"]) for e in r.of("action")] == [("exclude", 1)]
    assert r.of("step_end")[-1]["workers"] == 2


@pytest.mark.long
def test_an_excluded_slot_passes_its_health_probe_and_rejoins(run: Any) -> None:
    # the probe is a fresh process importing torch: readmitted at step ~17 of a loaded machine
    steps = 100
    ref = run("--nproc-per-node", "4", steps=steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = run(
        "--nproc-per-node", "4", "--readmit-after", "0.5",
        "--inject", "error:rank=3,step=5,kind=ecc", steps=steps,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["params_sha256"] == ref.task_end["params_sha256"]  # exact throughout
    assert [(e["action"], e["slot"]) for e in r.of("action")] == [("exclude", 3), ("readmit", 3)]
    excluded, readmitted = r.of("action")
    assert "passed its health probe" in readmitted["reason"]
    assert readmitted["ts"] - excluded["ts"] >= 0.5
    assert _rejoined(r, 3, after=readmitted["ts"])
    assert r.of("step_end")[-1]["workers"] == 4


@pytest.fixture(scope="module")
def straggler(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """One run with a 2x slower worker from step 6 on, shared by the tests below (over the
    straggler factor, 1.5, and under the hang factor, 3, even on a loaded machine)."""
    return run_unicron(
        tmp_path_factory.mktemp("straggler"),
        "--nproc-per-node",
        "4",
        "--inject",
        "slow:rank=0,step=6,factor=2",
        steps=STEPS,
    )


def _straggler_decision(r: RunResult) -> dict[str, Any]:
    decided = [
        e
        for e in r.of("action")
        if e["slot"] == 0 and e["reason"].startswith(("straggler dropped", "straggler kept"))
    ]
    assert decided, r.of("action")
    return decided[0]


def test_straggler_is_detected_and_the_planner_decides(
    straggler: RunResult, clean: RunResult
) -> None:
    r = straggler
    _healed(r, clean)
    fault = _fault(r, "slow")

    slow = [e for e in r.of("error_detected") if e["kind"] == "straggler"]
    assert slow, r.of("error_detected")
    assert slow[0]["method"] == "monitor" and slow[0]["slot"] == 0
    assert slow[0]["ts"] > fault["ts"] and slow[0]["step"] >= fault["step"]
    assert "(slower on the CPU too)" in slow[0]["reason"]  # the fault spends CPU, as a slow core
    decided = _straggler_decision(r)
    if decided["reason"].startswith("straggler dropped"):
        assert decided["action"] == "exclude"
        assert not _rejoined(r, 0, after=decided["ts"])
        later = [e for e in r.of("epoch_begin") if e["ts"] > decided["ts"]]
        assert all(0 not in e["members"] for e in later)  # (the drop may come at the end)


def test_workers_exit_promptly_after_a_straggler_is_dropped(straggler: RunResult) -> None:
    if not _straggler_decision(straggler)["reason"].startswith("straggler dropped"):
        pytest.skip("the planner kept the straggler: nothing was killed")
    last_step = straggler.of("step_end")[-1]
    lag_s = straggler.task_end["ts"] - last_step["ts"]
    assert lag_s < 5.0, f"task_end {lag_s:.1f} s after the last step_end"


def test_too_few_slots_for_min_workers_fails_with_the_reason(run: Any) -> None:
    """Below the minimum with no way back (probes turned off): it fails at once."""
    r = run(
        "--nproc-per-node", "4", "--min-workers", "4", "--readmit-after", "inf",
        "--inject", "error:rank=1,step=3,kind=ecc", steps=STEPS,
    )  # fmt: skip
    assert [e["slot"] for e in _actions(r, "exclude")] == [1], r.of("action")
    assert not _actions(r, "restart")
    # the task is worth nothing below its minimum: no epoch of fewer workers begins
    assert all(len(e["members"]) >= 4 for e in r.of("epoch_begin")), r.of("epoch_begin")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.task_end["status"] == "failed"
    assert "minimum of 4" in r.task_end["reason"], r.task_end
    assert "minimum of 4" in r.stderr
    assert len(r.of("step_end")) < STEPS


@pytest.mark.long
def test_below_the_minimum_the_task_waits_for_readmission(run: Any, clean: RunResult) -> None:
    """The slot's exclusion leaves fewer workers than the minimum: the task waits (the event
    log and the progress output say why), the health probe readmits the slot, and the run
    ends as the fault-free one, bit for bit."""
    r = run(
        "--nproc-per-node", "4", "--min-workers", "4", "--readmit-after", "0.5",
        "--inject", "error:rank=1,step=3,kind=ecc", steps=STEPS,
    )  # fmt: skip
    _healed(r, clean)
    assert [e["action"] for e in r.of("action")] == ["exclude", "wait", "readmit"]
    wait = _actions(r, "wait")[0]
    assert "fewer than the minimum of 4" in wait["reason"] and "health probe" in wait["reason"]
    assert "'action': 'wait'" in r.stderr and "health probe" in r.stderr
    assert all(len(e["members"]) >= 4 for e in r.of("epoch_begin")), r.of("epoch_begin")


@pytest.mark.long
def test_a_task_that_waits_past_its_give_up_deadline_fails(run: Any) -> None:
    r = run(
        "--nproc-per-node", "2", "--min-workers", "2", "--readmit-after", "600",
        "--give-up-after", "1", "--inject", "error:rank=1,step=3,kind=ecc", steps=STEPS,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    assert "gave up after waiting" in r.task_end["reason"], r.task_end
    assert _actions(r, "wait")


def test_script_that_cannot_start_fails_fast_with_its_error(run: Any) -> None:
    t0 = time.monotonic()
    r = run("--nproc-per-node", "4", script=SCRIPTS / "broken_import.py", steps=None)
    elapsed_s = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-3000:]
    # given up, not restarted forever (~10 s quiet; 67 s seen at load 14 beside a burner)
    assert elapsed_s < 150, elapsed_s
    assert "ModuleNotFoundError" in r.stderr and "no_such_module_xyz" in r.stderr
    assert r.task_end["status"] == "failed"
    assert "no_such_module_xyz" in r.task_end["reason"]
    assert _actions(r, "exclude")
    per_slot = [sum(e["slot"] == s for e in _actions(r, "restart")) for s in range(4)]
    assert max(per_slot) <= RESTART_LIMIT, per_slot
    assert not r.of("step_end")


USER_ERROR = "ValueError: user_error.py: loss_fn rejects every batch from step 5 on"


@pytest.fixture(scope="module")
def user_error(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, float]:
    """A script whose loss raises ValueError from step 5 on, in every worker, every time."""
    t0 = time.monotonic()
    r = run_unicron(
        tmp_path_factory.mktemp("user_error"),
        "--nproc-per-node",
        "4",
        script=SCRIPTS / "user_error.py",
        steps=None,
        script_args=("--steps", "20"),
    )
    return r, time.monotonic() - t0


def test_user_error_that_repeats_on_every_restart_fails_for_good(
    user_error: tuple[RunResult, float],
) -> None:
    r, elapsed_s = user_error
    assert r.returncode == 1, r.stderr[-3000:]
    assert elapsed_s < 120, elapsed_s
    assert r.task_end["status"] == "failed" and r.task_end.get("reason")
    assert "unicron: task failed" in r.stderr
    users = [e for e in r.of("error_detected") if e["kind"] == "user"]
    assert users and all(e["severity"] == 2 for e in users)
    assert all(USER_ERROR in e["reason"] for e in users), users
    assert sorted(e["step"] for e in r.of("step_end")) == list(range(5))


def test_an_output_directory_nobody_can_write_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The script's ``--out`` under a file: every worker finds it unwritable as it starts, and
    the run stops with that reason and exit 2 before a step (before, the last step's write
    failed in every worker, each was restarted, and the trained state was lost)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out"
    r = run_unicron(tmp_path, "--nproc-per-node", "2", steps=3, script_args=("--out", str(out)))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("unicron: error:")]
    why = f"the output directory {out} cannot be written: Not a directory"
    assert errors == [f"unicron: error: {why}"]
    assert not r.of("step_end")


def test_user_error_is_the_reason_the_user_is_shown(user_error: tuple[RunResult, float]) -> None:
    r, _ = user_error
    assert r.returncode == 1
    assert "ValueError" in r.task_end["reason"], r.task_end["reason"]
    failed = [line for line in r.stderr.splitlines() if line.startswith("unicron: task failed")]
    assert failed and "ValueError" in failed[0], failed
    assert USER_ERROR in r.stderr
