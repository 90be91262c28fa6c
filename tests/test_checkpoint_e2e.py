"""Durable checkpoints end to end: the last tier of the nearest principle never loses work.

Every replica killed at once: the task goes on from the newest checkpoint and ends with the
bits of a run without faults. ``unicron run`` stopped (SIGTERM) and resumed with ``--resume``
at another world size: the same bits again. Bad ``--resume`` input: one line, exit 2, nothing
in the directory changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, TRAIN, RunResult, run_unicron
from unicron.control.events import read_events
from unicron.control.lab import LocalCluster
from unicron.control.taskspec import TaskSpec
from unicron.runtime import checkpoint as C

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

STEPS = 40
"""enough that a stop or a cancel, which reaches the workers up to half a second after the step
the test saw (held step reports, the exchange rhythm), lands before the last step"""
SMALL = ("--microbatches", "4")  # half the example's global batch: a faster test


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    d = tmp_path_factory.mktemp("clean")
    r = run_unicron(
        d, "--nproc-per-node", "2", "--checkpoint-every", "0", steps=STEPS, script_args=SMALL
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.long
def test_every_replica_killed_resumes_from_the_checkpoint_bitwise(
    clean: RunResult, run: Any
) -> None:
    faults = ("--inject", "crash:rank=0,step=12", "--inject", "crash:rank=1,step=12")
    r = run(
        "--nproc-per-node", "2", "--checkpoint-every", "5", *faults, steps=STEPS, script_args=SMALL
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["params_sha256"] == clean.task_end["params_sha256"]
    # from the newest checkpoint on disk when they died: step 10's, unless its write (in the
    # background, 2.5 steps before the crash) was still going and died with rank 0
    (back,) = [e for e in r.of("transition_end") if e["state_source"] == "checkpoint"]
    crashed = min(e["ts"] for e in r.of("fault_injected"))
    saved = [e for e in r.of("checkpoint_saved") if e["ok"]]
    newest = max(e["step"] for e in saved if e["ts"] < crashed)
    assert back["step"] in (newest, 10) and newest >= 5, (back, newest)
    assert back["steps_redone"] == 12 - back["step"], back
    assert set(range(5, STEPS + 1, 5)) <= {e["step"] for e in saved}
    assert sorted({e["step"] for e in r.of("step_end")}) == list(range(STEPS))
    root = r.out.parent / "logs" / "checkpoints"
    assert len(C.steps(root)) == 3  # --checkpoint-keep 3
    interval = r.of("checkpoint_interval")[0]
    assert interval["interval_steps"] == 5 and "fixed" in interval["reason"]
    # resuming a run that had finished (its newest checkpoint is the last step) ends at once
    again = run("--nproc-per-node", "1", "--resume", str(root), steps=STEPS, script_args=SMALL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.task_end["params_sha256"] == clean.task_end["params_sha256"]
    start = again.of("transition_end")[0]
    assert (start["state_source"], start["step"], start["steps_redone"]) == ("checkpoint", STEPS, 0)
    assert not again.of("step_end")


def test_resume_after_a_full_stop_is_bitwise_identical(clean: RunResult, tmp_path: Path) -> None:
    first, ck = tmp_path / "first", tmp_path / "ck"
    first.mkdir()
    events = first / "events.jsonl"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "2", "--quiet",
           "--events", str(events), "--log-dir", str(first / "logs"), "--checkpoint-dir",
           str(ck), "--checkpoint-every", "4", str(TRAIN), "--steps", str(STEPS),
           *SMALL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=first, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            # two checkpoints written (an interrupted run's workers are killed: a checkpoint
            # still being written in the background is not one), and a step after them
            logged = _events(events)
            steps = [e["step"] for e in logged if e["event"] == "step_end"]
            saved = [e for e in logged if e["event"] == "checkpoint_saved" and e["ok"]]
            if len(saved) >= 2 and steps and max(steps) >= 9:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    committed = max(e["step"] for e in _events(events) if e["event"] == "step_end") + 1
    assert committed < STEPS, "the run finished before it was stopped"

    # the newest checkpoint damaged (one flipped byte): skipped with a warning, the one
    # before it used, and the run still ends with the fault-free bits
    *_, previous, newest = C.steps(ck)
    data = bytearray((newest / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "model.pt").write_bytes(bytes(data))
    second = tmp_path / "second"
    second.mkdir()
    r = run_unicron(
        second, "--nproc-per-node", "3", "--resume", str(ck), steps=STEPS, script_args=SMALL
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: skipping checkpoint" in r.stderr and newest.name in r.stderr, r.stderr
    assert r.task_end["params_sha256"] == clean.task_end["params_sha256"]
    state = torch.load(r.out / "final.pt", weights_only=True)
    ref = torch.load(clean.out / "final.pt", weights_only=True)
    assert all(torch.equal(state[k], ref[k]) for k in ref)
    start = r.of("transition_end")[0]
    assert start["state_source"] == "checkpoint" and start["step"] % 4 == 0
    assert start["step"] == C.read_manifest(previous).step
    assert start["steps_redone"] == committed - start["step"]
    assert min(e["step"] for e in r.of("step_end")) == start["step"]


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        return read_events(path)
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def _unicron(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unicron", "run", "--log-dir", str(tmp / "logs"), *args,
         str(TRAIN), "--steps", "5"],
        capture_output=True, text=True, timeout=120, cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _checkpoint(root: Path, *, reduce: str = "exact", model: dict[str, Any] | None = None) -> None:
    parts = {"model": {"w": torch.zeros(3)}, "optim": {}, "train": {"step": 4}}
    C.write(
        root, parts, step=4, world=2, reduce=reduce, now=0.0,
        model=model or C.describe_model(parts["model"]), ledger={"seed": 0},
    )  # fmt: skip


@pytest.mark.parametrize("case", ["missing", "empty", "corrupt", "reduce", "taken"])
def test_bad_resume_input_is_one_line_exit_2_and_nothing_overwritten(
    case: str, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    args = ["--resume", str(ck)]
    if case != "missing":
        ck.mkdir()
    if case in ("reduce", "taken", "corrupt"):
        _checkpoint(ck, reduce="fast" if case == "reduce" else "exact")
    if case == "corrupt":
        (C.step_dir(ck, 4) / "model.pt").write_bytes(b"not a checkpoint")
    if case == "taken":  # a directory of checkpoints given as a fresh run's --checkpoint-dir
        args = ["--checkpoint-dir", str(ck)]
    before = _tree(ck) if ck.exists() else None
    p = _unicron(tmp_path, *args)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("unicron: error:"), p.stderr
    expected = {"missing": "no such directory", "empty": "empty", "corrupt": "none valid",
                "reduce": "--reduce fast", "taken": "--resume"}[case]  # fmt: skip
    assert expected in lines[0], lines[0]
    assert (_tree(ck) if ck.exists() else None) == before
    assert not (tmp_path / "logs").exists()  # nothing was started


@pytest.mark.parametrize(
    "args, names",
    [
        (["--checkpoint-every", "x"], "--checkpoint-every"),
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--mtbf", "0"], "--mtbf"),
        (["--checkpoint-keep", "-1"], "--checkpoint-keep"),
        (["--resume", "a", "--checkpoint-dir", "b"], "--checkpoint-dir"),
    ],
)
def test_bad_checkpoint_options_are_one_line_exit_2(
    args: list[str], names: str, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    p = _unicron(tmp_path, *args)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert names in p.stderr


def test_a_directory_without_write_permission_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unicron.control.runner import _check_resume
    from unicron.errors import UsageError

    ck = tmp_path / "ck"
    _checkpoint(ck)
    if os.geteuid() != 0:  # root may write anywhere: then only the check itself is exercised
        ck.chmod(0o555)
    else:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == ck else real(p, m))
    try:
        with pytest.raises(UsageError, match="no permission to write"):
            _check_resume(ck, "exact")
    finally:
        ck.chmod(0o755)


@pytest.mark.long
def test_a_checkpoint_of_another_model_stops_the_run_with_exit_2(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _checkpoint(ck)
    before = _tree(ck)
    p = _unicron(tmp_path, "--nproc-per-node", "2", "--resume", str(ck))
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("unicron: error:")]
    assert len(errors) == 1 and "another model" in errors[0], p.stderr[-2000:]
    assert _tree(ck) == before


@pytest.mark.long
def test_a_cluster_task_resumes_from_the_checkpoint_bitwise(
    clean: RunResult, tmp_path: Path
) -> None:
    """A cluster task (``checkpoint: {dir, every}``) cancelled mid-run, then a second task
    with ``checkpoint: {dir, resume: true}``: it goes on from the newest checkpoint, says how
    many steps it redoes, and ends with the fault-free run's bits."""
    ck = tmp_path / "ck"
    task = {"script": str(TRAIN), "args": ["--steps", str(STEPS), *SMALL],
            "workers": {"min": 2, "max": 2}}  # fmt: skip
    with LocalCluster(tmp_path / "cluster", hosts=1, slots=2, loopback=True) as c:
        c.start_coordinator()
        c.start_agent(0)
        c.submit({**task, "name": "first", "checkpoint": {"dir": str(ck), "every": 4}})
        c.wait_task("first", lambda v: v["step"] >= 8 or v["state"] in ("done", "failed"))
        c.client.request("POST", "/v1/tasks/first/cancel")
        first = c.wait_task("first", lambda v: v["outcome"] is not None)  # ended
        assert first["state"] == "cancelled", first
        committed = max(e["step"] for e in c.events("first") if e["event"] == "step_end") + 1
        assert committed < STEPS, "the first task finished before it was cancelled"
        c.submit({**task, "name": "second", "checkpoint": {"dir": str(ck), "resume": True}})
        view = c.wait_task("second")
        events = c.events("second")
    assert view["state"] == "done", view
    assert view["outcome"]["params_sha256"] == clean.task_end["params_sha256"]
    start = next(e for e in events if e["event"] == "transition_end")
    assert start["state_source"] == "checkpoint" and start["step"] % 4 == 0, start
    # a loaded agent may kill the cancelled workers a step or two after the cancel: they may
    # have written a checkpoint past the last step the task logged (nothing is then redone)
    assert start["steps_redone"] == max(0, committed - start["step"]), (start, committed)
    steps = [e["step"] for e in events if e["event"] == "step_end"]
    assert steps == list(range(start["step"], STEPS)), steps
    interval = next(e for e in events if e["event"] == "checkpoint_interval")
    assert "Young/Daly" in interval["reason"], interval  # the task file's default: auto


@pytest.mark.parametrize("case", ["missing", "empty", "reduce", "in use"])
def test_a_cluster_task_with_bad_resume_input_is_refused_at_submit(
    case: str, tmp_path: Path
) -> None:
    """``checkpoint: {dir, resume: true}`` is checked when the task is submitted (a 422 or
    409: ``unicron submit`` prints the line and exits 2), and the directory is left as it
    was; two tasks never write into one directory."""
    from unicron.control.cluster import Cluster, Conflict, Invalid

    ck = tmp_path / "ck"
    if case != "missing":
        ck.mkdir()
    if case in ("reduce", "in use"):
        _checkpoint(ck, reduce="fast" if case == "reduce" else "exact")
    before = _tree(ck) if ck.exists() else None
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    task = {"script": str(TRAIN), "checkpoint": {"dir": str(ck), "resume": True}}
    try:
        if case == "in use":  # queued: no node yet
            cluster.submit(TaskSpec.model_validate({**task, "name": "first"}), time.time())
        with pytest.raises((Invalid, Conflict)) as got:
            cluster.submit(TaskSpec.model_validate({**task, "name": "second"}), time.time())
    finally:
        cluster.close(stop_store=True)
    expected = {"missing": "no such directory", "empty": "empty", "reduce": "--reduce fast",
                "in use": "task first (queued) writes there"}[case]  # fmt: skip
    assert expected in str(got.value) and "\n" not in str(got.value), got.value
    assert (_tree(ck) if ck.exists() else None) == before
