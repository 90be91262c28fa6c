"""The agent's reports: what a worker's message becomes before the coordinator sees it.

A real :class:`~unicron.control.agent.Agent` (its listener; no zygote, no worker started) is
handed worker messages as its loop would hand them; the coordinator's side is in
``tests/test_coordinator.py``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection, Pipe, answer_challenge
from pathlib import Path

import pytest

from unicron import messages as M
from unicron import protocol as P
from unicron.control import agent as agent_module
from unicron.control import door, workerenv
from unicron.control.agent import IDLE_ROUND_S, ROUND_S, Agent, AgentConfig, StackDumps
from unicron.control.client import can_wait
from unicron.control.heard import STEP_FACTS, exit_reports, report_of
from unicron.control.workerenv import Account, signal_worker
from unicron.control.workerstate import WAIT_SAMPLE_AFTER_S, IllegalTransition, WorkerState
from unicron.detect.busy import process_state
from unicron.runtime.link import AgentLink


@pytest.fixture
def pid() -> Iterator[int]:
    """The pid of a process this test owns, to stand in for a worker's: the agent SIGKILLs a
    worker it judges failed and any still alive when it stops, and a made-up number (4242
    here once) was some other process on the machine (in CI, pytest itself)."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_step_reports_carry_the_time_the_worker_sent_them(tmp_path: Path) -> None:
    # the monitor times a step from its begin to its end as the worker saw them: an agent
    # that reads its sockets 1.2 s late on a loaded machine (the soak's 2.38 s hang detection)
    # must not start the hang clock 1.2 s late, nor shorten or stretch the learned durations
    config = AgentConfig(node=0, slots=[0], script="train.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    try:
        sent = time.time() - 1.2
        agent._from_worker(0, M.StepBegan(slot=0, step=7, epoch=2, ts=sent, cpu_s=1.0))
        done = M.StepComputed(
            slot=0, step=7, microbatches=2, compute_s=0.1, ts=sent + 0.1, cpu_s=1.1
        )
        agent._from_worker(0, done)
        began, computed = agent._reports
        assert isinstance(began, M.StepBegan) and began.ts == sent
        assert isinstance(computed, M.StepComputed) and computed.ts == sent + 0.1
        # a time in the future (never on one host's clock) is not believed
        agent._from_worker(0, M.StepBegan(slot=0, step=8, epoch=2, ts=time.time() + 60, cpu_s=1.2))
        assert agent._reports[-1].ts <= time.time()
    finally:
        agent.stop()


def test_a_worker_is_sampled_while_it_computes_a_step_or_waits_on_its_peers(
    tmp_path: Path, pid: int
) -> None:
    """What the worker says moves the agent's CPU sampling (:mod:`unicron.detect.busy`): a
    step is timed from its begin, a wait on the peers from the epoch's entry or the step's
    computed report; none once it left its epoch, finished or was restarted. Before its
    first step told the computing thread, its main thread is read (a restarted worker's old
    thread id is not kept)."""
    config = AgentConfig(node=0, slots=[0], script="train.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    w = agent.workers[0]
    _zygote_end, agent._zygote_conn = Pipe()  # (a restart is asked of it)
    try:
        w.spawned()
        w.pid = pid
        now = time.time()
        agent._from_worker(0, M.EpochEntered(slot=0, ts=now, epoch=2))
        assert w.computing_since is None and w.waiting_since is not None
        assert w.sampled_tid == pid
        agent._from_worker(0, M.StepBegan(slot=0, step=0, epoch=2, ts=now, cpu_s=1.0, tid=7))
        assert w.computing_since is not None and w.waiting_since is None and w.sampled_tid == 7
        agent._from_worker(0, M.StepComputed(slot=0, step=0, compute_s=0.1, ts=now, epoch=2))
        assert w.computing_since is None and w.waiting_since is not None
        agent._from_worker(0, M.StepBegan(slot=0, step=1, epoch=2, ts=now, cpu_s=1.0, tid=7))
        agent._from_worker(0, M.EpochEntered(slot=0, ts=now, epoch=3))  # step 1 abandoned
        assert w.computing_since is None and w.waiting_since is not None
        error = M.Error(type_name="RuntimeError", message="Connection closed by peer",
                        in_band=True, epoch=3)  # fmt: skip
        agent._from_worker(0, error)  # it leaves the epoch
        assert w.computing_since is None and w.waiting_since is None
        agent._from_worker(0, M.EpochEntered(slot=0, ts=now, epoch=4))
        done = M.WorkerDone(slot=0, ts=now, steps=2, final_loss=1.0, params_sha256="x",
                            rank=0, epoch=4)  # fmt: skip
        agent._from_worker(0, done)  # finished
        assert w.computing_since is None and w.waiting_since is None
        agent._from_worker(0, M.EpochEntered(slot=0, ts=now, epoch=5))
        agent.spawn(0)  # restarted
        assert w.waiting_since is None and w.tid is None
    finally:
        agent.stop()


def test_one_step_end_per_committed_step_leaves_the_node(tmp_path: Path) -> None:
    # every member reports the commit (so that the record survives one that dies right after
    # it); the coordinator logs the first: the agent passes on one per (epoch, step)
    config = AgentConfig(node=0, slots=[0, 1], script="train.py", argv=[], faults=[],
                         log_dir=tmp_path)  # fmt: skip
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    try:
        for epoch, step in ((1, 5), (1, 6), (2, 6)):  # step 6 again in epoch 2: a new record
            for slot in (0, 1):
                fields = {"epoch": epoch, "step": step, "rank": slot}
                agent._from_worker(slot, M.Event(ts=time.time(), name="step_end", fields=fields))
        agent._from_worker(
            1, M.Event(ts=time.time(), name="transition_end", fields={"epoch": 2, "step": 6})
        )
        got = [(r.name, r.fields["epoch"], r.fields["step"]) for r in agent._reports]
        assert got == [("step_end", 1, 5), ("step_end", 1, 6), ("step_end", 2, 6),
                       ("transition_end", 2, 6)]  # fmt: skip
    finally:
        agent.stop()


def test_a_workers_lifecycle_is_one_state_along_its_diagram(tmp_path: Path) -> None:
    """A slot's process is in one ``WorkerState``; a report that does not apply where it
    stands leaves it there, and a move the diagram does not draw is refused. Its exit says
    what it was: a finished worker's is the normal end, a leaving one's heals nothing."""
    config = AgentConfig(node=0, slots=[0, 1], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    try:
        w, v = agent.workers[0], agent.workers[1]
        assert w.state is WorkerState.NEW and not w.alive and agent.census().alive == ()
        with pytest.raises(IllegalTransition, match="NEW -> READY"):
            w.to(WorkerState.READY)
        for x in (w, v):
            x.spawned()  # what Agent.spawn does, without launching a process here
        agent._from_worker(0, M.Ready(slot=0, ts=time.time(), microbatches=8, state_bytes=1))
        assert w.state is WorkerState.READY and agent.census().ready == (0,)
        agent._from_worker(0, M.EpochEntered(slot=0, ts=time.time(), epoch=1))
        assert w.state is WorkerState.MEMBER and agent.census().ready == ()
        agent._from_worker(
            0,
            M.WorkerDone(
                slot=0, ts=time.time(), steps=3, final_loss=1.0, params_sha256="ab", rank=0, epoch=1
            ),
        )
        assert w.state is WorkerState.DONE and agent.census().alive == (0, 1)
        assert agent.census().done == (0,)
        # it stays until the task is over, and serves a newer epoch that needs what it holds
        agent._from_worker(0, M.EpochEntered(slot=0, ts=time.time(), epoch=2))
        assert w.state is WorkerState.MEMBER and agent.census().done == ()
        agent._from_worker(
            0,
            M.WorkerDone(
                slot=0, ts=time.time(), steps=3, final_loss=1.0, params_sha256="ab", rank=0, epoch=2
            ),
        )
        agent.reply = M.Reply(actions=(M.Kill(0, None, leave=True), M.Kill(1, None, leave=True)))
        agent._act(time.time())
        assert w.state is WorkerState.LEAVING  # finished, then its slot given away
        assert v.state is WorkerState.LEAVING and v.kill_pending  # no pid yet: killed on it
        agent._from_worker(
            1, M.Ready(slot=1, ts=time.time(), microbatches=8, state_bytes=1)
        )  # read after the kill
        assert v.state is WorkerState.LEAVING
        agent._reports.clear()
        agent._exited(0, 0)
        agent._exited(1, -9)
        assert (w.state, v.state) == (WorkerState.GONE, WorkerState.GONE)
        assert [type(r) for r in agent._reports] == [M.WorkerLeft, M.WorkerLeft]
        agent._reports.clear()
        for code in (0, -9):  # a finished worker's exit 0 is the normal end; killed before
            for move in (w.spawned, w.readied, w.entered, w.done):  # the task's end, it may
                move()  # have held what the others need
            agent._exited(0, code)
        assert [type(r) for r in agent._reports] == [M.Detected, M.WorkerFailed]
        with pytest.raises(IllegalTransition, match="GONE -> MEMBER"):
            w.to(WorkerState.MEMBER)
        w.spawned()  # a new incarnation
        assert w.state is WorkerState.STARTING and w.alive
    finally:
        agent.stop()


def test_a_workers_last_words_are_read_before_the_zygote_reports_its_exit(
    tmp_path: Path, pid: int
) -> None:
    """A script that cannot import sends its error, then dies; the zygote reports the exit on
    another socket. Read first, that exit must still carry the error, not a bare exit code."""
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    worker_side, from_worker = Pipe()
    zygote_side, from_zygote = Pipe()
    try:
        w = agent.workers[0]
        w.spawned()
        agent._zygote_conn = from_zygote
        agent._handle(from_zygote, M.Spawned(slot=0, pid=pid, incarnation=w.incarnation))
        agent._anonymous.append(from_worker)  # accepted, not read yet
        for msg in (
            M.Hello(slot=0, pid=pid, incarnation=w.incarnation),
            M.Error(type_name="ModuleNotFoundError", message="No module named 'x'"),
        ):
            worker_side.send(M.to_wire(msg))
        zygote_side.send(M.to_wire(M.Exited(pid=pid, returncode=1)))
        agent._read(from_zygote)  # the zygote's socket first
        (failed,) = [r for r in agent._reports if isinstance(r, M.WorkerFailed)]
        assert failed.verdict.kind != "exit_error", failed.verdict
        assert "No module named" in failed.verdict.reason
    finally:
        agent.stop()


def test_a_workers_last_words_still_in_the_door_are_read_before_its_exit(
    tmp_path: Path, pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the worker died so soon that its connection was still in the agent's
    door (its challenge on a starved thread, here one that admits it 0.3 s late) when the
    zygote's report of its exit was read: the door settles first, and the exit carries the
    error (before, a bare exit code)."""

    def starved(conn: Connection, authkey: bytes) -> None:
        answer_challenge(conn, authkey)
        time.sleep(0.3)

    monkeypatch.setattr(door, "answer_challenge", starved)
    monkeypatch.setattr(agent_module, "LAST_WORDS_S", 60.0)  # the wait, not its bound, is tested
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    zygote_side, from_zygote = Pipe()
    try:
        agent._door.open()
        w = agent.workers[0]
        w.spawned()
        agent._zygote_conn = from_zygote
        agent._handle(from_zygote, M.Spawned(slot=0, pid=pid, incarnation=w.incarnation))
        # connects, says who it is and why it dies, and is gone
        conn = Client(agent._door.address, authkey=agent._authkey)
        conn.send(M.to_wire(M.Hello(slot=0, pid=pid, incarnation=w.incarnation)))
        conn.send(
            M.to_wire(M.Error(type_name="ModuleNotFoundError", message="No module named 'x'"))
        )
        conn.close()
        zygote_side.send(M.to_wire(M.Exited(pid=pid, returncode=1)))
        agent._read(from_zygote)
        (failed,) = [r for r in agent._reports if isinstance(r, M.WorkerFailed)]
        assert "No module named" in failed.verdict.reason, failed.verdict
    finally:
        agent.stop()


class _Link:
    """The coordinator's side of :meth:`Agent.poll`: keeps what it is handed."""

    def __init__(self, due_s: float = 0.05) -> None:
        self.reports: list[M.Report] = []
        self.due_s = due_s

    def exchange(self, node: int, reports: list[M.Report], now: float, **_: object) -> M.Reply:
        self.reports += reports
        return M.Reply()

    def due_in(self, now: float) -> float:
        return self.due_s


@pytest.mark.parametrize(
    "msg",
    [
        M.StepBegan(slot=0, step=4, epoch=3, ts=1.5, cpu_s=3.0),
        M.StepComputed(slot=0, step=4, microbatches=2, compute_s=0.25, ts=1.75, cpu_s=3.25),
        M.WaitingOnReplica(slot=0, step=4, epoch=3, ts=1.6, waiting=True),
        M.Event(ts=1.0, name="step_end", fields={"epoch": 3, "step": 4, "loss": 2.5}),
        M.Event(ts=1.0, name="step_end", fields={"epoch": 3, "step": 0, "loss": 2.5}),
        M.Event(ts=1.0, name="fault_injected", fields={"spec": "crash@rank=1,step=3"}),
        M.Error(type_name="RuntimeError", message="boom", in_band=True, step=4, epoch=3),
        M.EpochEntered(slot=0, ts=1.0, epoch=3),
    ],
)
def test_a_quiet_message_is_one_whose_reports_may_wait_for_the_rhythm(
    tmp_path: Path, msg: M.LocalMessage
) -> None:
    """The worker rings the agent's doorbell for exactly the messages whose reports the link
    sends at once: a quiet message waits up to a round, its reports then wait for the rhythm."""
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    try:
        agent.workers[0].spawned()
        agent.workers[0].readied()
        agent._from_worker(0, msg)
        assert agent._reports
        assert M.quiet(msg) == all(can_wait(r) for r in agent._reports)
    finally:
        agent.stop()


@pytest.mark.timeout(30)
def test_a_round_sleeps_through_step_reports_and_wakes_for_an_error(tmp_path: Path) -> None:
    """A worker's step reports (a dozen per step from a node) are read on the agent's next
    round, not each at once; a message that is not quiet rings the doorbell and ends the
    round's wait."""
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    link = _Link()
    agent = Agent(config, link=link, task="t", store_address="127.0.0.1:1", store_key="")
    worker_end, agent_end = Pipe()
    worker = AgentLink(worker_end, P.host_port(agent.bell_address))
    try:
        agent.workers[0].spawned()
        agent.workers[0].conn = agent_end
        worker.send(M.StepBegan(slot=0, step=1, epoch=1, ts=time.time(), cpu_s=0))
        t0 = time.monotonic()
        agent.poll(0.5)
        assert time.monotonic() - t0 >= 0.45  # not woken by the step's begin...
        assert [r.step for r in link.reports if isinstance(r, M.StepBegan)] == [1]  # ...read

        worker.send(M.Error(type_name="RuntimeError", message="boom", in_band=True, epoch=1))
        t0 = time.monotonic()
        agent.poll(20.0)
        assert time.monotonic() - t0 < 5.0  # woken at once
        assert any(isinstance(r, M.Detected) for r in link.reports)
    finally:
        agent.stop()


def test_a_hung_worker_is_killed_once_its_stacks_reached_its_log(tmp_path: Path) -> None:
    """Asked for its stacks, a hung worker is killed no sooner than the grace, as soon after
    as something reached its log, and at the longest grace if nothing does (a loaded machine
    may not run it within 0.1 s: two kills of stuck workers there left no stack)."""
    dumps, log, silent = StackDumps(), tmp_path / "worker0.0.log", tmp_path / "worker1.0.log"
    log.write_text("step 3\n")
    dumps.asked(11, log, 100.0)
    dumps.asked(12, silent, 100.0)
    assert dumps.due(100.0 + P.STACKS_GRACE_S / 2) == []
    assert dumps.due(100.0 + P.STACKS_GRACE_S) == []  # nothing written yet: looked at again
    with log.open("a") as f:
        f.write("Thread 0x... (most recent call first):\n")
    assert dumps.due(100.0 + P.STACKS_GRACE_S + 0.05) == [11]
    assert dumps.due(100.0 + P.STACKS_MAX_GRACE_S - 0.01) == []
    assert dumps.due(100.0 + P.STACKS_MAX_GRACE_S) == [12] and not dumps.look_at
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.1)  # the kernel marks it stopped
        dumps.asked(stopped.pid, silent, 200.0)
        assert dumps.due(200.0 + P.STACKS_GRACE_S) == [stopped.pid]  # no stacks will come
        # what the kernel says of each of its threads is in the log instead (a process in
        # uninterruptible sleep, or not scheduled in time, writes no stacks either)
        view = silent.read_text().split("the kernel's view of each thread, at the kill:\n")
        assert len(view) == 3  # the two kills above, this one
        first = view[-1].splitlines()[0].split()
        assert first[0] == str(stopped.pid) and first[2] == "T" and "syscall=" in view[-1]
    finally:
        stopped.kill()
        stopped.wait()


def test_a_native_dump_under_way_is_not_cut_by_the_stop_it_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """py-spy holds the worker in ptrace's tracing stop (``t``) while it reads the stacks: that
    stop is the dump's own, not a stopped worker's (killed at the grace), so the kill waits
    for the dump (it used to kill py-spy mid-dump: 6 of 10 dumps beside the loaded runs had no
    thread). Without a dump under way, ``t`` is a stop like ``T``."""
    monkeypatch.setattr("unicron.control.agent.process_state", lambda pid: "t")
    dumps, log = StackDumps(), tmp_path / "worker0.0.log"
    spy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setenv(P.ENV_NATIVE_STACKS, "1")
    monkeypatch.setattr("unicron.control.agent.native_stacks", lambda pid, log: spy)
    try:
        dumps.asked(11, log, 100.0)
        monkeypatch.delenv(P.ENV_NATIVE_STACKS)
        log.write_text("Thread 11 (idle)\n")  # its first lines
        assert dumps.due(100.0 + P.STACKS_GRACE_S) == []  # dumping: not cut
        assert dumps.due(100.0 + P.STACKS_MAX_GRACE_S) == []  # its own bound is longer
        spy.kill()
        spy.wait()
        assert dumps.due(100.0 + P.STACKS_MAX_GRACE_S + 0.05) == [11]  # the dump ended
    finally:
        spy.kill()
        spy.wait()
    dumps.asked(12, tmp_path / "worker1.0.log", 200.0)
    assert dumps.due(200.0 + P.STACKS_GRACE_S) == [12]  # stopped, no dump: no stacks will come


def test_a_hung_workers_native_stacks_reach_its_log_before_the_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``UNICRON_NATIVE_STACKS=1``: the agent also runs ``py-spy dump --native`` (a dev
    dependency) into the log of a worker it kills as hung, and holds the kill until the dump
    ended: what a thread blocked inside a C++ call waits for, which ``faulthandler`` cannot
    show (a loaded run's rank sat in gloo's ``alltoall_base`` until killed)."""
    monkeypatch.setenv(P.ENV_NATIVE_STACKS, "1")
    hung = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    log, dumps = tmp_path / "worker0.0.log", StackDumps()
    try:
        assert hung.stdout is not None
        hung.stdout.readline()  # started (a loaded machine takes a while)
        deadline = time.time() + 30.0
        while process_state(hung.pid) != "S":  # in its sleep
            assert time.time() < deadline, process_state(hung.pid)
            time.sleep(0.01)
        dumps.asked(hung.pid, log, time.time())
        deadline = time.time() + 30.0
        while not (due := dumps.due(time.time())) and time.time() < deadline:
            time.sleep(0.05)
        assert due == [hung.pid]
        text = log.read_text()
        assert f"py-spy dump --native --pid {hung.pid}" in text and "time_sleep" in text, text
    finally:
        hung.kill()
        hung.wait()


def test_a_round_waits_until_the_first_thing_due(tmp_path: Path, pid: int) -> None:
    """:meth:`Agent.round_s`: the link's next exchange, a hung worker's kill after its stacks,
    a computing worker's next CPU sample; a short round while something is polled; at most
    the idle round."""
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    link = _Link(due_s=10.0)
    agent = Agent(config, link=link, task="t", store_address="127.0.0.1:1", store_key="")
    _zygote_end, agent._zygote_conn = Pipe()
    try:
        now = time.time()
        assert agent.round_s(now) == IDLE_ROUND_S
        link.due_s = 0.1
        assert agent.round_s(now) == pytest.approx(0.1)
        agent._dumps.look_at[pid] = now + 0.03
        assert agent.round_s(now) == pytest.approx(0.03)
        agent._dumps.look_at.clear()
        w = agent.workers[0]
        w.spawned()
        w.pid, w.tid, w.computing_since = pid, pid, now - 0.15  # first sample at 0.2 s
        assert agent.round_s(now) == pytest.approx(0.05)
        w.cpu_read_at = now - 0.1  # sampled; the next one 0.2 s after
        assert agent.round_s(now) == pytest.approx(0.1)
        w.computing_since, w.cpu_read_at = None, 0.0  # its step computed: it reduces
        w.waiting_since = now - WAIT_SAMPLE_AFTER_S + 0.07  # a wait is sampled later
        assert agent.round_s(now) == pytest.approx(0.07)
        w.waiting_since, w.cpu_read_at = now - 5.0, now - 0.45  # a wait: every 0.5 s
        assert agent.round_s(now) == pytest.approx(0.05)
        w.waiting_since = None
        assert agent.round_s(now) == pytest.approx(0.1)
        w.eof_ts = now  # its socket closed: its exit status is polled for
        assert agent.round_s(now) == ROUND_S
        w.eof_ts = None
        agent._zygote_conn = None  # no zygote to report exits
        assert agent.round_s(now) == ROUND_S
    finally:
        agent.stop()


@pytest.mark.timeout(30)
def test_one_round_reads_every_waiting_message_and_follows_new_sockets(tmp_path: Path) -> None:
    """One round reads every message of every worker; a socket that closes is dropped, and
    the one a restarted worker connects with (often the same descriptor number) is read from
    its first round."""
    config = AgentConfig(node=0, slots=[0, 1], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    link = _Link()
    agent = Agent(config, link=link, task="t", store_address="127.0.0.1:1", store_key="")
    ends = {}
    try:
        for slot in (0, 1):
            ends[slot], agent.workers[slot].conn = Pipe()
            agent.workers[slot].spawned()
            for step in range(3):
                ends[slot].send(
                    M.to_wire(M.StepBegan(slot=slot, step=step, epoch=1, ts=time.time(), cpu_s=0))
                )
        agent.poll(0.05)
        began = [(r.slot, r.step) for r in link.reports if isinstance(r, M.StepBegan)]
        assert sorted(began) == [(s, step) for s in (0, 1) for step in range(3)]

        ends[1].close()  # the worker in slot 1 is gone...
        agent.poll(0.01)
        assert agent.workers[1].conn is None
        ends[1], agent.workers[1].conn = Pipe()  # ...and its next incarnation connects
        ends[1].send(M.to_wire(M.StepBegan(slot=1, step=9, epoch=2, ts=time.time(), cpu_s=0)))
        agent.poll(0.05)
        assert [(r.slot, r.step) for r in link.reports if isinstance(r, M.StepBegan)][-1] == (1, 9)
    finally:
        agent.stop()


@pytest.mark.timeout(30)
def test_a_dead_workers_socket_is_read_to_its_end_once_when_the_zygote_reports_first(
    tmp_path: Path, pid: int
) -> None:
    """The zygote's exit report can be read before the dead worker's closed socket is: the
    agent then reads that socket itself, its last message and its end, and goes on (a
    rewrite of the loop's reads, tried and not kept, spun on that end for ever, and its node
    fell silent)."""
    config = AgentConfig(node=0, slots=[0], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    link = _Link()
    agent = Agent(config, link=link, task="t", store_address="127.0.0.1:1", store_key="")
    worker_side, from_worker = Pipe()
    zygote_side, from_zygote = Pipe()
    try:
        w = agent.workers[0]
        w.spawned()
        w.conn, agent._zygote_conn = from_worker, from_zygote
        agent._handle(from_zygote, M.Spawned(slot=0, pid=pid, incarnation=w.incarnation))
        worker_side.send(M.to_wire(M.Error(type_name="RuntimeError", message="boom")))
        worker_side.close()  # the worker died
        zygote_side.send(M.to_wire(M.Exited(pid=pid, returncode=1)))
        agent._read(from_zygote)
        assert w.conn is None and not w.alive
        agent.poll(0.01)
        (failed,) = [r for r in link.reports if isinstance(r, M.WorkerFailed)]
        assert "boom" in failed.verdict.reason
    finally:
        agent.stop()


LOCAL = [
    M.Hello(slot=1, pid=42, incarnation=0),
    M.Ready(slot=1, ts=1.0, microbatches=8, state_bytes=1 << 20),
    M.EpochEntered(slot=1, ts=1.0, epoch=3),
    M.Event(ts=1.0, name="step_end", fields={"step": 4, "loss": 2.5}),
    M.StepBegan(slot=1, step=4, epoch=3, ts=1.5, cpu_s=3.0),
    M.StepComputed(slot=1, step=4, microbatches=2, compute_s=0.25, ts=1.75, cpu_s=3.25),
    M.WaitingOnReplica(slot=1, step=4, epoch=3, ts=1.6, waiting=True),
    M.Error(type_name="RuntimeError", message="boom", in_band=True, step=4, epoch=3),
    M.WorkerDone(slot=1, ts=1.0, steps=10, final_loss=1.0, params_sha256="ab", rank=0, epoch=3),
    M.NodeFault(),
    M.ZygoteUp(pid=7),
    M.Spawned(slot=1, pid=43, incarnation=1),
    M.Exited(pid=43, returncode=-9),
    M.SpawnWorker(slot=1, incarnation=1, env={"A": "1"}, script="t.py", argv=("-x",), log="l"),
    M.WhereStore(),
    M.StoreAt(address="10.0.0.1:29500"),
]


def test_every_local_message_kind_round_trips() -> None:
    """What the agent's socket carries goes through the one codec (:mod:`unicron.messages`),
    as the exchange with the coordinator does (tests/test_cluster_units.py)."""
    for msg in LOCAL:
        wire = M.to_wire(msg)
        assert M.KINDS[wire["type"]] is type(msg)
        assert M.from_wire(wire) == msg


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"type": "nope"},
        {"type": "EpochEntered"},
        "x",
        {"type": "EpochEntered", "slot": 1, "ts": 1.0, "epoch": 1, "extra": 2},
    ],
)
def test_a_malformed_local_message_is_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="not a message"):
        M.from_wire(raw)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")
def test_a_pid_a_worker_names_is_signalled_only_if_it_runs_as_the_workers_account(
    tmp_path: Path,
) -> None:
    """With workers run as an account (``--run-as``), a pid a worker names to its agent (in its
    hello, or posing as the zygote) is killed only if it is that account's: a worker cannot
    turn the agent's root against another process. A worker's own, it kills."""
    nobody = Account.named("nobody")
    agent = Agent(
        AgentConfig(node=0, slots=[0], script="x.py", argv=[], faults=[], log_dir=tmp_path,
                    account=nobody),
        link=None,  # type: ignore[arg-type]
        task="t", store_address="127.0.0.1:1", store_key="",
    )  # fmt: skip
    root_owned = subprocess.Popen(["sleep", "60"])
    worker = subprocess.Popen(["sleep", "60"], user=nobody.uid, group=nobody.gid, extra_groups=[])
    try:
        assert not agent._kill(root_owned.pid)
        assert agent._kill(worker.pid)
        assert worker.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.2)
        assert root_owned.poll() is None  # alive
        assert signal_worker(root_owned.pid, signal.SIGKILL, None)  # no account: the agent's
        assert root_owned.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (root_owned, worker):
            p.kill()
        agent.stop()


def test_a_workers_fact_is_passed_on_as_it_is_with_its_connections_slot() -> None:
    """One class per fact: what a worker says on its agent's socket is what the agent reports
    to the coordinator, with the slot of the connection it came on (not the one it claims)
    and, but for a step's reports, the time the agent heard it; every other field keeps its
    value."""
    passed = 0
    for msg in LOCAL:
        report = report_of(2, msg, 1.25)
        if report is None:
            assert not isinstance(msg, M.WORKER_FACTS)
            continue
        passed += 1
        assert type(report) is type(msg) and M.is_report(report)
        step = isinstance(msg, STEP_FACTS)  # the worker's own time; the others: when heard
        assert report.ts == (min(msg.ts, 1.25) if step else 1.25)  # type: ignore[union-attr]
        kept = {f.name for f in dataclasses.fields(msg)} - {"ts", "slot"}  # type: ignore[arg-type]
        assert all(getattr(report, k) == getattr(msg, k) for k in kept), msg
        assert getattr(report, "slot", 2) == 2
    assert passed == len(M.WORKER_FACTS)


@pytest.mark.parametrize("returncode", [None, -9, 1])
def test_the_reports_of_an_exit_pass_the_clusters_screen(returncode: int | None) -> None:
    """An exit with no status (its socket closed, none came) said ``returncode: None`` in
    its detection, which the cluster's screen refuses: the node's exchange of that task was
    refused whole, every later report with it (found by the cluster soak)."""
    from unicron.control.screen import _malformed
    from unicron.control.workerstate import Worker

    w = Worker(slot=3, step=7, eof_ts=1.0)
    reports = exit_reports(w, returncode, 2.0)
    assert [type(r).__name__ for r in reports] == ["Detected", "WorkerFailed"]
    assert all(_malformed(r, epoch=5) == "" for r in reports), reports
    assert reports[0].extra == ({} if returncode is None else {"returncode": returncode})  # type: ignore[union-attr]


def test_a_worker_resolves_with_a_short_retry_unless_the_task_says_otherwise() -> None:
    """Every store connection makes a reverse DNS query (torch formats its address); a
    dropped one held an epoch's join for glibc's 5 s retry (workerenv.import_env)."""
    assert workerenv.import_env(1, {})["RES_OPTIONS"] == "timeout:1 attempts:2"
    mine = workerenv.import_env(1, {"RES_OPTIONS": "timeout:3"})
    assert mine["RES_OPTIONS"] == "timeout:3"


def test_a_workers_end_with_a_diverged_loss_passes_the_clusters_screen() -> None:
    """A worker's end is one typed report now (its result was an opaque dict): a loss that
    diverged is the task's news, not a forged number, so the screen lets it through, while a
    time that is not finite is still refused."""
    from unicron.control.screen import _malformed

    done = M.WorkerDone(slot=1, ts=1.0, steps=3, final_loss=float("inf"), params_sha256="ab",
                        rank=0, epoch=2)  # fmt: skip
    assert _malformed(done, epoch=2) == ""
    assert "not a finite number" in _malformed(dataclasses.replace(done, ts=float("nan")), 2)


def test_a_workers_place_is_the_one_the_coordinator_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 x PP=2, a replica a stage per node: this node's slots 2 and 3 are stage 1 of
    theirs (the assignment's places), which this node's slots alone cannot tell; a slot
    added later gets the place its spawn names."""
    config = AgentConfig(node=1, slots=[2, 3], script="t.py", argv=[], faults=[],
                         log_dir=tmp_path, settings=P.WorkerSettings(tp=2, pp=2),
                         places={2: 2, 3: 3})  # fmt: skip
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    try:
        env = workerenv.slot_env(config, 3, 0, set())
        assert (env[P.ENV_PP_STAGE], env[P.ENV_TP_RANK]) == ("1", "1")
        started: list[int] = []
        monkeypatch.setattr(agent, "spawn", started.append)  # no process here
        agent.reply = M.Reply(actions=(M.Spawn(slot=6, fresh=True, place=2),))
        agent._act(time.time())
        assert started == [6] and config.places[6] == 2
        config.slots.append(6)
        env = workerenv.slot_env(config, 6, 0, set())
        assert (env[P.ENV_PP_STAGE], env[P.ENV_TP_RANK]) == ("1", "0")
    finally:
        agent.stop()


def test_the_zygotes_death_leaves_no_worker_it_was_asked_for_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote dies (its fork raised, or it was killed) with slot 0's start unanswered
    and slot 1's worker forked but not yet connected (it dies with the zygote): slot 0 is
    started plainly, slot 1's end is reported after the grace (before, both stayed
    STARTING for good, and nothing told the coordinator)."""
    from unicron.control import agent as agent_mod

    started: list[subprocess.Popen[bytes]] = []

    def plainly(*_: object, **__: object) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(["sleep", "30"]))
        return started[-1]

    monkeypatch.setattr(agent_mod, "start_plainly", plainly)
    monkeypatch.setattr(agent_mod, "EXIT_GRACE_S", 0.0)
    link = _Link()
    config = AgentConfig(node=0, slots=[0, 1], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    ours, zygote = Pipe()
    try:
        agent._zygote_conn = ours
        agent.spawn(1)
        zygote.recv()
        zygote.send(M.to_wire(M.Spawned(slot=1, pid=2**22 + 7, incarnation=0)))
        agent.poll(0.01)
        agent.spawn(0)
        zygote.recv()
        zygote.close()  # gone, slot 0's fork never answered
        for _ in range(5):
            agent.poll(0.01)
        assert agent.workers[0].popen is started[0] and agent.workers[0].alive
        failed = [r.slot for r in link.reports if isinstance(r, M.WorkerFailed)]
        assert failed == [1] and not agent.workers[1].alive
    finally:
        agent._kill = lambda pid: None  # type: ignore[method-assign]
        agent.stop()
        for p in started:
            p.kill()
            p.wait()


def test_a_worker_that_cannot_start_is_reported_and_the_reply_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting slot 0's worker fails (fork's EAGAIN): its end is reported as a failure, and
    the rest of the coordinator's answer (a Kill of slot 1) is carried out (before, the error
    escaped the round: slot 0 stayed STARTING with no process and the Kill was dropped)."""
    from unicron.control import agent as agent_mod

    def no_fork(*_: object, **__: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(agent_mod, "start_plainly", no_fork)
    monkeypatch.setattr(agent_mod, "EXIT_GRACE_S", 0.0)
    link = _Link()
    config = AgentConfig(node=0, slots=[0, 1], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    killed: list[int] = []
    agent._kill = killed.append  # type: ignore[method-assign]
    try:
        agent.workers[1].spawned()
        agent.workers[1].pid = 2**22 + 9
        agent.reply = M.Reply(actions=(M.Spawn(0), M.Kill(1, None)))
        agent._act(1.0)
        assert killed == [2**22 + 9]
        for _ in range(3):
            agent.poll(0.01)
        assert [r.slot for r in link.reports if isinstance(r, M.WorkerFailed)] == [0]
    finally:
        agent.stop()


def test_a_start_the_zygote_owes_is_made_plainly_and_a_kill_before_it_is_carried_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slot 0's start is asked of the zygote, its ``Kill`` comes before the zygote answers,
    then the zygote dies, found by a failed send for slot 1: both are started plainly, and
    slot 0's worker is killed as soon as it has a pid (before, the failed send left the
    zygote's socket unread, so slot 0 stayed STARTING for good; and a worker started plainly
    outlived a kill that came before it)."""
    from unicron.control import agent as agent_mod

    started: list[subprocess.Popen[bytes]] = []

    def plainly(*_: object, **__: object) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(["sleep", "30"]))
        return started[-1]

    monkeypatch.setattr(agent_mod, "start_plainly", plainly)
    link = _Link()
    config = AgentConfig(node=0, slots=[0, 1], script="t.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link, task="t", store_address="127.0.0.1:1", store_key="")  # type: ignore[arg-type]
    killed: list[int] = []
    agent._kill = killed.append  # type: ignore[method-assign]
    ours, zygote = Pipe()
    try:
        agent._zygote_conn = ours
        agent.spawn(0)
        zygote.recv()
        agent.kill(0, None)
        assert agent.workers[0].kill_pending
        zygote.close()
        agent.spawn(1)  # the send fails: plainly
        for _ in range(3):
            agent.poll(0.01)
        assert [w.popen is not None for w in agent.workers.values()] == [True, True]
        assert killed == [started[1].pid]  # slot 0's (started after slot 1's)
    finally:
        agent.stop()
        for p in started:
            p.kill()
            p.wait()
