"""The agent: one per node. Starts and supervises the node's workers.

It listens on an authenticated local socket for its workers' reports (the typed messages of
:mod:`unicron.protocol`, :data:`~unicron.protocol.KINDS`), starts workers through
the warm zygote (:mod:`unicron.runtime.launcher`; a plain spawn when the zygote is gone), notices a
worker that exits or is killed (its socket closes; the zygote reports the exit status), writes
what it sees to the event log and reports it to the coordinator (step times, epochs entered,
errors, exits: the coordinator runs the task's detectors over every node's workers), and
carries out the coordinator's actions (:class:`unicron.control.messages.Spawn`, ``Kill`` and
``Probe``, the health probe of an excluded slot), which each exchange's reply carries.

Threads: everything the agent owns is touched by one thread, the one in :meth:`Agent.run`
(its ``accept`` thread only queues new connections and rings the doorbell). The coordinator
never calls the agent; the agent calls the coordinator's ``exchange`` once per round
(:class:`CoordinatorLink`), which sends when a report may not wait or the rhythm is due.

A round (:meth:`Agent.poll`) sleeps until the first thing timed is due (:meth:`Agent.round_s`)
or its doorbell rings: a worker's message that is not quiet (an error, an epoch entered; see
:func:`unicron.protocol.quiet`), the zygote's, a new connection. It then reads every
socket that has something; a step's reports, a dozen per step, wait in their sockets for it.

Each slot's process is in one :class:`WorkerState` (its diagram is there); a move it does not
draw raises :class:`IllegalTransition`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any, Protocol

from unicron import protocol as P
from unicron.control import messages as M
from unicron.control import replicas
from unicron.control.messages import Kill, Probe, Reply, Spawn
from unicron.control.workerstate import (
    Worker,
    WorkerState,
)
from unicron.detect.busy import read_thread_clocks
from unicron.detect.classify import Verdict, classify_exit, classify_message
from unicron.protocol import (
    ENV_AGENT,
    ENV_AUTHKEY,
    ENV_BELL,
    ENV_FAULTS,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_PP_STAGE,
    ENV_SLOT,
    ENV_STORE,
    ENV_TASK,
    ENV_THREADS,
    ENV_TP_RANK,
)
from unicron.runtime import device as D
from unicron.runtime.inject import Fault

log = logging.getLogger("unicron.control.agent")

EXIT_GRACE_S = 0.3
_TICKS_PER_S = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
"""after a worker's socket closes, how long to wait for its exit status before classifying"""
_HUNG = frozenset({"hang", "stall", "collective_stall"})
"""verdict kinds of a worker killed while alive but stuck: it writes its stacks first"""
PROBE_TIMEOUT_S = 120.0
"""a health probe (a fresh process: imports, then milliseconds of work) that takes longer fails"""
ROUND_S = 0.02
"""the shortest wait of a round, while something is polled (a probe, a plainly started
worker's exit, a closed socket's grace, a zygote still starting)"""
IDLE_ROUND_S = 0.25
"""the longest: a round starts at least this often (:meth:`Agent.round_s`)"""


@dataclass
class _Probe:
    """A running health probe (:meth:`Agent.probe`): its process, start time and output."""

    proc: subprocess.Popen[bytes]
    started: float
    log: Path
    overran: bool = False


@dataclass(frozen=True)
class FatalError:
    """An error that ended the worker in ``slot`` (reported by it at ``ts``): the runner shows
    the first one's traceback when the task fails."""

    slot: int
    ts: float
    error: P.Error


SECRETS = frozenset(("UNICRON_TOKEN",))
"""environment variables of the agent's process its workers never inherit"""


def import_env(threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a zygote's imports read from its environment, for ``threads`` torch threads on
    top of ``base`` (default: this process's): torch's thread pools, its C++ log level and
    gloo's lazy connect (a setting the task gave stays). Part of every zygote's environment
    (:meth:`Agent._base_env`), and all of one started before its task is known
    (:func:`unicron.runtime.launcher.prewarm`)."""
    base = os.environ if base is None else base
    return {
        "TORCH_CPP_LOG_LEVEL": base.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        "TORCH_GLOO_LAZY_INIT": base.get("TORCH_GLOO_LAZY_INIT", "1"),  # inside a sliced wait
        ENV_THREADS: str(threads),
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass(kw_only=True)
class AgentConfig:
    node: int
    slots: list[int]
    script: str
    argv: list[str]
    faults: list[Fault]
    log_dir: Path
    threads: int = 1
    settings: P.WorkerSettings = field(default_factory=P.WorkerSettings)
    """what the task's workers read from their environment"""
    env: dict[str, str] = field(default_factory=dict)


class CoordinatorLink(Protocol):
    """How an agent reaches its task's coordinator (see the module docstring)."""

    def exchange(
        self,
        node: int,
        reports: list[M.Report],
        now: float,
        *,
        read_until: float | None = None,
        flush: bool = False,
    ) -> Reply: ...

    def due_in(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`exchange` would go out with nothing new to
        report (0: at once)."""
        ...


class Agent:
    """Supervises the workers of one task on one node; see the module docstring."""

    def __init__(
        self, config: AgentConfig, link: CoordinatorLink, *, task: str, store_address: str
    ) -> None:
        self.config = config
        self.node = config.node
        self.link = link
        self.task = task
        self.store_address = store_address
        self.reply = Reply()  # the coordinator's last answer
        self._reports: list[M.Report] = []  # this round's, in order
        self.workers = {s: Worker(s) for s in config.slots}
        self.fired: set[str] = set()
        self._step_ends: deque[tuple[int, int]] = deque(maxlen=64)  # (epoch, step) sent on
        self.errors: list[FatalError] = []  # every error that ended a worker, in order
        self.vanished = False
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self.address = "{}:{}".format(*self._listener.address)
        # the workers' doorbell (:func:`unicron.protocol.quiet`): a datagram wakes a round
        self._bell = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._bell.bind(("127.0.0.1", 0))
        self._bell.setblocking(False)
        self._bell_at: tuple[str, int] = self._bell.getsockname()
        self.bell_address = "{}:{}".format(*self._bell_at)
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self._anonymous: list[Connection] = []  # connected, no hello yet
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_conn: Connection | None = None
        self._pending_spawns: list[int] = []
        self._by_pid: dict[int, int] = {}
        self._probes: dict[int, _Probe] = {}  # slot -> its running health probe
        self._dumping: dict[int, float] = {}  # pid of a hung worker -> when to SIGKILL it
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    # -- start, stop ------------------------------------------------------------------------
    def start(self, zygote: subprocess.Popen[bytes] | None = None) -> None:
        """Start the zygote and every slot's worker (called once, before :meth:`run`).
        ``zygote``: one started ahead with :func:`import_env` of this task's settings
        (:func:`unicron.runtime.launcher.prewarm`), adopted here: it gets the rest of the
        environment on its stdin; one that died meanwhile is replaced."""
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if zygote is not None and zygote.poll() is None and zygote.stdin is not None:
            try:
                zygote.stdin.write(json.dumps(self._base_env()).encode() + b"\n")
                zygote.stdin.close()
                self._zygote = zygote
            except OSError:  # it died between the look and the write
                zygote = None
        else:
            zygote = None
        if zygote is None:
            out = open(self.config.log_dir / f"zygote-node{self.node}.log", "ab")  # noqa: SIM115
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "unicron.runtime.launcher", "zygote"],
                env=self._base_env(),
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            out.close()
        for slot in self.config.slots:
            self.spawn(slot)

    def stop(self) -> None:
        """Kill every worker and the zygote; no process is left behind."""
        self._stop.set()
        for w in self.workers.values():
            if w.pid is not None and w.alive:
                _kill(w.pid)
            if w.popen is not None:
                w.popen.kill()
                w.popen.wait()
        for probe in self._probes.values():
            _killpg(probe.proc.pid)
            probe.proc.wait()
        self._probes.clear()
        if self._zygote is not None:
            _killpg(self._zygote.pid)
            self._zygote.wait()
        self._listener.close()
        self._bell.close()

    # -- actions (the coordinator's, taken on every round) ------------------------------------
    def _report(self, report: M.Report) -> None:
        self._reports.append(report)

    def census(self) -> M.Census:
        """Which of this node's workers live, and which reported ready but entered no epoch
        since: sent when the agent reconnects to a coordinator (one that restarted adopts the
        task from it)."""
        alive = tuple(s for s, w in self.workers.items() if w.alive)
        ready = tuple(s for s, w in self.workers.items() if w.state is WorkerState.READY)
        return M.Census(ts=time.time(), alive=alive, ready=ready)

    def _act(self, now: float) -> None:
        """Carry out what the coordinator asked of this node in its last answer."""
        for action in self.reply.actions:
            if self.vanished:
                return
            if isinstance(action, Spawn):
                w = self.workers.get(action.slot)
                if action.fresh and w is not None and w.alive and w.incarnation >= 0:
                    continue  # a slot given to the task, already started with its supervisor
                self.spawn(action.slot)
            elif isinstance(action, Kill):
                if action.leave and action.slot in self.workers:
                    self.workers[action.slot].leave()
                self.kill(action.slot, action.verdict)
            elif isinstance(action, Probe):
                try:
                    self.probe(action.slot)
                except OSError as exc:  # could not start it: tried again after another wait
                    self._report(M.ProbeNotStarted(slot=action.slot, ts=now, error=str(exc)))

    def spawn(self, slot: int) -> None:
        """Start a new incarnation of the worker in ``slot``. Never two processes in one slot:
        an earlier incarnation still running is killed (its pid, if the zygote has not told
        it yet, is killed when it does), and a slot waiting for the zygote is launched once."""
        if slot not in self.workers:  # a slot the task was given while it ran
            self.workers[slot] = Worker(slot)
            self.config.slots.append(slot)
        w = self.workers[slot]
        if w.pid is not None and w.alive:
            _kill(w.pid)
        w.incarnation += 1
        w.pid, w.conn, w.popen, w.eof_ts, w.error, w.verdict, w.step = (None,) * 7
        w.computing_since = None
        w.kill_pending = False
        w.spawned()
        if self._zygote_conn is None and self._zygote is not None and self._zygote.poll() is None:
            if slot not in self._pending_spawns:  # the zygote is still importing torch
                self._pending_spawns.append(slot)
        else:
            self._launch(slot)

    def kill(self, slot: int, verdict: Verdict | None = None) -> None:
        """SIGKILL the worker in ``slot``; its exit is then reported with ``verdict``."""
        w = self.workers[slot]
        if verdict is not None:
            w.verdict = verdict
        if w.pid is None:
            w.kill_pending = True  # killed as soon as the zygote says which pid it got
        elif w.alive and verdict is not None and verdict.kind in _HUNG:
            with contextlib.suppress(ProcessLookupError):  # where it hangs, into its log
                os.kill(w.pid, P.STACKS_SIGNAL)
            self._dumping[w.pid] = time.time() + P.STACKS_GRACE_S
        elif w.alive:
            _kill(w.pid)

    def probe(self, slot: int) -> None:
        """Start the health probe of the excluded ``slot`` (``python -m unicron.runtime.health``,
        a fresh process); :meth:`poll` reports its verdict (``ProbeDone``)."""
        if slot in self._probes or self.vanished:
            return
        n = sum(1 for _ in self.config.log_dir.glob(f"health{slot}.*.log"))
        log_path = self.config.log_dir / f"health{slot}.{n}.log"
        with open(log_path, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "unicron.runtime.health", "--slot", str(slot)],
                env={**self._base_env(), **self._device_env(slot)},  # the slot's own device
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._probes[slot] = _Probe(proc, time.time(), log_path)

    def _check_probes(self, now: float) -> None:
        """Report every probe that ended; one that overran :data:`PROBE_TIMEOUT_S` is killed
        (its whole process group) and reported once its exit is seen. Never blocks."""
        for slot, probe in list(self._probes.items()):
            code = probe.proc.poll()
            if code is None:
                if now - probe.started >= PROBE_TIMEOUT_S and not probe.overran:
                    probe.overran = True
                    _killpg(probe.proc.pid)
                continue
            del self._probes[slot]
            if probe.overran:
                ok, detail = False, f"no answer in {PROBE_TIMEOUT_S:g} s"
            else:
                lines = probe.log.read_text(errors="replace").strip().splitlines()
                ok = code == 0
                detail = lines[-1] if lines else f"exit code {code}"
            self._report(M.ProbeDone(slot=slot, ts=now, ok=ok, detail=detail))

    # -- the loop ---------------------------------------------------------------------------
    def run(self, until: threading.Event) -> None:
        """Supervise until ``until`` is set (then call :meth:`wake`) or the coordinator says
        the task is over."""
        while not until.is_set() and not self._stop.is_set() and not self.vanished:
            try:
                self.poll(self.round_s(time.time()))
            except Exception:  # keep supervising (and heartbeating) whatever one round hit
                log.exception("node %d: supervision round failed", self.node)
                time.sleep(0.1)
            if self.reply.finished:
                return
        self._flush()

    def round_s(self, now: float) -> float:
        """How long the next round waits for its doorbell: until the first thing timed is
        due (the link's next exchange, a hung worker's SIGKILL after its stacks, a computing
        worker's CPU sample), :data:`ROUND_S` while something is polled, at most
        :data:`IDLE_ROUND_S`. A worker's message that is not quiet, the zygote's and a new
        connection wake it sooner (docs/cluster.md, The rhythm)."""
        if (
            self._probes
            or self._pending_spawns
            or self._zygote_conn is None
            or any(w.alive and (w.popen or w.eof_ts) for w in self.workers.values())
        ):
            return ROUND_S
        due = [IDLE_ROUND_S, self.link.due_in(now)]
        due += [at - now for at in self._dumping.values()]
        due += [at - now for w in self.workers.values() if (at := w.sample_at()) is not None]
        return max(min(due), 0.0)

    def wake(self) -> None:
        """Ring the doorbell: a waiting round starts now (from any thread)."""
        with contextlib.suppress(OSError):
            self._bell.sendto(b"!", self._bell_at)

    def _flush(self) -> None:
        """The loop was stopped (the run interrupted, the node stopping): what the workers
        said, and the step reports the link held for the rhythm, go out now, so that the
        event log keeps every step committed until then. Nothing is acted on any more."""
        if self.vanished:
            return
        try:
            for w in self.workers.values():
                if w.conn is not None:
                    self._read(w.conn)
            reports, self._reports = self._reports, []
            now = time.time()
            self.link.exchange(self.node, reports, now, read_until=now, flush=True)
        except Exception:  # the coordinator may be gone already: nothing more to tell it
            log.warning("node %d: the last reports could not be sent", self.node, exc_info=True)

    def kill_all(self) -> None:
        """SIGKILL every worker and the zygote now (the run is interrupted). Safe from another
        thread: it only sends signals; :meth:`stop` cleans up after."""
        for w in list(self.workers.values()):
            if w.pid is not None and w.alive:
                _kill(w.pid)
        if self._zygote is not None:
            _killpg(self._zygote.pid)

    def vanish(self) -> None:
        """The injected node fault: this node's workers and zygote die at once and the agent
        falls silent (no more reports, no heartbeats), as when a machine is lost."""
        self.vanished = True
        for probe in self._probes.values():
            _killpg(probe.proc.pid)
        for w in self.workers.values():
            if w.pid is not None and w.alive:
                _kill(w.pid)
            w.exited()
        if self._zygote is not None:
            _killpg(self._zygote.pid)

    def poll(self, timeout: float) -> None:
        """One round: read reports, notice exits, run the monitor, let the coordinator act.

        The round waits up to ``timeout`` for its doorbell (a worker's message that is not
        :func:`~unicron.protocol.quiet`), the zygote or a new connection's hello, then
        reads every socket that has something: a worker's step reports wait for the next round
        instead of waking one each (a dozen per step; docs/cluster.md, The rhythm)."""
        self._drain_accepted()
        waken: list[Any] = [self._bell, *self._anonymous]
        if self._zygote_conn is not None:
            waken.append(self._zygote_conn)
        if wait(waken, timeout=timeout):
            self._silence()
            self._drain_accepted()
        read_until = time.time()  # every report sent before now is in its socket
        conns: list[Any] = [w.conn for w in self.workers.values() if w.conn is not None]
        conns += self._anonymous  # after the workers': a worker's last words before its exit
        if self._zygote_conn is not None:
            conns.append(self._zygote_conn)
        ready = set(wait(conns, timeout=0))
        for conn in conns:
            if conn in ready:
                self._read(conn)
        now = time.time()
        if self._pending_spawns and self._zygote is not None and self._zygote.poll() is not None:
            log.warning("node %d: the zygote died while starting; spawning plainly", self.node)
            pending, self._pending_spawns = self._pending_spawns, []
            for slot in pending:
                self._launch(slot)
        for pid, at in list(self._dumping.items()):
            if now >= at:  # its stacks are written: the kill of :meth:`kill`
                del self._dumping[pid]
                if pid in self._by_pid:  # not exited meanwhile
                    _kill(pid)
        self._check_exits(now)
        self._sample_cpu(now)
        if self._probes:
            self._check_probes(now)
        if self.vanished:
            return  # a lost node says nothing more
        reports, self._reports = self._reports, []
        self.reply = self.link.exchange(self.node, reports, now, read_until=read_until)
        self._act(now)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self._accepted.put(self._listener.accept())
                self.wake()  # its hello is read now
            except (OSError, EOFError):
                if self._stop.is_set():
                    return
            except Exception as exc:  # a bad handshake must not kill the agent
                log.warning("rejected a connection: %s", exc)

    def _silence(self) -> None:
        """Empty the doorbell (any number of rings since the last round wake one round)."""
        while True:
            try:
                self._bell.recv(16)
            except OSError:  # BlockingIOError: empty
                return

    def _drain_accepted(self) -> None:
        while True:
            try:
                self._anonymous.append(self._accepted.get_nowait())
            except queue.Empty:
                return

    def _drain_worker(self, slot: int) -> None:
        """Read everything the worker in ``slot`` sent before the zygote reported its exit.
        The zygote's message and the worker's last ones (the error that ended it) sit in two
        sockets: read in the wrong order, a script that cannot import was reported as a bare
        exit code (seen beside a CPU burner), its traceback dropped."""
        self._drain_accepted()
        w = self.workers[slot]
        for conn in [*self._anonymous, *([w.conn] if w.conn is not None else [])]:
            self._read(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                raw = conn.recv()
                try:
                    self._handle(conn, P.decode(raw))
                except Exception:  # one bad report must not stop the supervision loop
                    log.exception("node %d: could not handle %r", self.node, raw)
        except (EOFError, OSError):
            self._closed(conn)

    def _closed(self, conn: Connection) -> None:
        if conn in self._anonymous:
            self._anonymous.remove(conn)
        if conn is self._zygote_conn:
            log.warning("the zygote is gone; workers start as fresh processes from now on")
            self._zygote_conn = None
            return
        for w in self.workers.values():
            if w.conn is conn:
                w.conn = None
                w.eof_ts = w.eof_ts or time.time()

    def _handle(self, conn: Connection, msg: P.LocalMessage) -> None:
        if isinstance(msg, P.ZygoteUp):
            self._anonymous.remove(conn)
            self._zygote_conn = conn
            for slot in self._pending_spawns:
                self._launch(slot)
            self._pending_spawns.clear()
        elif isinstance(msg, P.Spawned):
            w = self.workers[msg.slot]
            if msg.incarnation != w.incarnation:
                _kill(msg.pid)  # an earlier incarnation, replaced before it started
                return
            self._by_pid[msg.pid] = msg.slot
            self._set_pid(w, msg.pid)
        elif isinstance(msg, P.Exited):
            owner = self._by_pid.get(msg.pid, -1)
            if owner >= 0 and self.workers[owner].pid == msg.pid:
                self._drain_worker(owner)  # what it said before it died (its error) first
            self._by_pid.pop(msg.pid, None)
            if owner >= 0 and self.workers[owner].pid == msg.pid:
                self._exited(owner, msg.returncode)
        elif isinstance(msg, P.Hello):
            w = self.workers[msg.slot]
            if conn in self._anonymous:
                self._anonymous.remove(conn)
            if msg.incarnation != w.incarnation or not w.alive:
                conn.close()  # a late hello from an earlier incarnation of the slot: it ends
                if msg.pid != w.pid:
                    _kill(msg.pid)
                return
            w.conn = conn
            self._set_pid(w, msg.pid)
            self._by_pid[msg.pid] = msg.slot
        else:
            sender = next((w.slot for w in self.workers.values() if w.conn is conn), None)
            if sender is not None:
                self._from_worker(sender, msg)

    def _set_pid(self, w: Worker, pid: int) -> None:
        w.pid = pid
        if w.kill_pending:
            _kill(pid)

    def _from_worker(self, slot: int, msg: P.LocalMessage) -> None:
        """One message of the worker in ``slot`` as this round's reports."""
        now = time.time()
        w = self.workers[slot]
        if isinstance(msg, P.Ready):
            w.readied()
            self._report(
                M.Ready(
                    slot=slot, ts=now, microbatches=msg.microbatches, state_bytes=msg.state_bytes
                )
            )
        elif isinstance(msg, P.Event):
            fields = msg.fields
            if msg.name == "fault_injected" and "spec" in fields:
                if fields["spec"] in self.fired:
                    return  # a node fault fires in every worker of the node: log it once
                self.fired.add(fields["spec"])
            if msg.name == "step_end":
                key = (int(fields.get("epoch", -1)), int(fields.get("step", -1)))
                if key in self._step_ends:
                    return  # every member reports the commit; the coordinator logs the first
                self._step_ends.append(key)
            self._report(M.Event(ts=now, name=msg.name, fields=fields))
        elif isinstance(msg, P.Entered):
            w.entered()
            self._report(M.EpochEntered(slot=slot, ts=now, epoch=msg.epoch))
        elif isinstance(msg, P.StepBegin):
            w.step, w.tid = msg.step, msg.tid
            sent = min(msg.ts, now)  # the monitor times the worker's step,
            w.computing_since = sent
            self._report(
                M.StepBegan(slot=slot, ts=sent, step=msg.step, epoch=msg.epoch, cpu_s=msg.cpu_s)
            )
        elif isinstance(msg, P.Waiting):
            self._report(
                M.WaitingOnReplica(
                    slot=slot,
                    ts=min(msg.ts, now),
                    step=msg.step,
                    epoch=msg.epoch,
                    waiting=msg.waiting,
                )
            )
        elif isinstance(msg, P.StepDone):
            w.computing_since = None
            self._report(
                M.StepComputed(
                    slot=slot,
                    ts=min(msg.ts, now),  # not this agent's read latency
                    step=msg.step,
                    compute_s=msg.compute_s,
                    microbatches=msg.microbatches or None,
                    cpu_s=msg.cpu_s,
                    queued_s=msg.queued_s,
                )
            )
        elif isinstance(msg, P.Error) and msg.usage:  # bad input: the whole run ends, exit 2
            self._report(M.BadInput(ts=now, message=msg.message))
        elif isinstance(msg, P.Error):
            if not msg.in_band:
                w.error = msg  # the error that ends this process
                self.errors.append(FatalError(slot, now, msg))  # the task's failure report
            verdict = classify_message(msg.type_name, msg.message)
            step = w.step if msg.step is None else msg.step
            self._report(
                M.Detected(slot=slot, ts=now, step=step, verdict=verdict, method="exception")
            )
            if msg.in_band:
                self._report(
                    M.WorkerError(
                        slot=slot, ts=now, verdict=verdict, in_place=msg.in_place, epoch=msg.epoch
                    )
                )
            else:  # the error ends the process: do not wait for its interpreter to wind down
                self.kill(slot, verdict)
        elif isinstance(msg, P.NodeFault):
            # what the node's workers said before the fault (the injector's fault_injected
            # record among it) goes out first; from then on the node says nothing
            reports, self._reports = self._reports, []
            self.link.exchange(self.node, reports, now, read_until=now, flush=True)
            self.vanish()
        elif isinstance(msg, P.Done):
            w.done()
            self._report(M.WorkerDone(slot=slot, ts=now, report=P.encode(msg)))
        else:
            raise ValueError(f"not a worker's message: {msg!r}")

    # -- process supervision ----------------------------------------------------------------
    def _sample_cpu(self, now: float) -> None:
        """Report the CPU time of each worker whose step has lasted a while: the coordinator
        tells a starved worker from a hung one by it before killing (:mod:`unicron.detect.busy`)."""
        for w in self.workers.values():
            at = w.sample_at()
            if at is None or now < at:
                continue
            assert w.pid is not None and w.tid is not None  # (sample_at)
            w.cpu_read_at = now
            clocks = read_thread_clocks(w.pid, w.tid, _TICKS_PER_S)
            if clocks is not None:
                cpu_s, queued_s = clocks
                self._report(M.CpuTime(slot=w.slot, ts=time.time(), cpu_s=cpu_s, queued_s=queued_s))

    def _check_exits(self, now: float) -> None:
        for w in self.workers.values():
            if not w.alive:
                continue
            if w.popen is not None and w.popen.poll() is not None:
                self._exited(w.slot, w.popen.returncode)
            elif w.eof_ts is not None and now - w.eof_ts > EXIT_GRACE_S:
                # the socket closed but no exit status came: the process is cut off; end it
                if w.pid is not None:
                    _kill(w.pid)
                self._exited(w.slot, None)

    def _exited(self, slot: int, returncode: int | None) -> None:
        w = self.workers[slot]
        if not w.alive:
            return
        was = w.state
        w.exited()
        if self._stop.is_set() or was is WorkerState.DONE or self.reply.finished:
            return
        if was is WorkerState.LEAVING:  # a planned move: nothing to heal
            self._report(M.WorkerLeft(slot=slot, ts=time.time()))
            return
        if returncode == 0 and self.reply.over:
            # a worker that left because the task ended (maybe announced in a last epoch it
            # never trained in): nothing to heal, but the task must not wait for its report
            self._report(M.WorkerLeft(slot=slot, ts=time.time()))
            return
        detected = min(t for t in (w.eof_ts, time.time()) if t is not None)
        if w.verdict is not None:  # the agent killed it and already logged why
            verdict = w.verdict
        else:
            if w.error is not None:
                verdict = classify_message(w.error.type_name, w.error.message)
                method = "exception"
            else:
                verdict = classify_exit(returncode if returncode is not None else -9)
                method = "process"
            if w.error is None or returncode is None or returncode < 0:
                self._report(
                    M.Detected(
                        slot=slot,
                        ts=detected,
                        step=w.step,
                        verdict=verdict,
                        method=method,
                        extra={"returncode": returncode},
                    )
                )
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        self._report(M.WorkerFailed(slot=slot, ts=detected, verdict=verdict))

    # -- launching --------------------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        """What every worker, the zygote and the probes start with: this process's
        environment without the coordinator's credentials (:data:`SECRETS`: a training
        script and whatever it imports never hold a token of the cluster), the task's
        settings, and the task file's ``env`` (allow-listed: :func:`~unicron.control.
        taskspec.refused_env`)."""
        env = {k: v for k, v in os.environ.items() if k not in SECRETS}
        env.update(self.config.env)
        env.update(import_env(self.config.threads, env))
        env.update(
            {
                ENV_TASK: self.task,
                ENV_NODE: str(self.node),
                ENV_STORE: self.store_address,
                ENV_AGENT: self.address,
                ENV_BELL: self.bell_address,
                ENV_AUTHKEY: self._authkey.hex(),
                **self.config.settings.env(),
            }
        )
        return env

    def _slot_env(self, slot: int) -> dict[str, str]:
        faults = [
            f.spec
            for f in self.config.faults
            if (f.rank == slot or f.node == self.node) and f.spec not in self.fired
        ]
        return {
            ENV_SLOT: str(slot),
            ENV_INCARNATION: str(self.workers[slot].incarnation),
            ENV_FAULTS: ";".join(faults),
            # its place in its replica: the task's slots on this node in groups of tp x pp
            # (unicron.control.replicas, which the coordinator uses alike), stage by stage
            **self._place_env(slot),
            **self._device_env(slot),
        }

    def _place_env(self, slot: int) -> dict[str, str]:
        tp, pp = self.config.settings.tp, self.config.settings.pp
        place = replicas.place_in(self.config.slots, slot, tp * pp)
        return {ENV_TP_RANK: str(place % tp), ENV_PP_STAGE: str(place // tp)}

    def _device_env(self, slot: int) -> dict[str, str]:
        """The slot's device (this node's GPUs round robin) and torchrun's LOCAL_RANK."""
        kind = self.config.env.get(D.ENV_DEVICE_KIND, "cpu")
        gpus = D.gpu_count() if kind == "cuda" else 0
        return D.slot_env(kind, self.config.slots.index(slot), len(self.config.slots), gpus)

    def _launch(self, slot: int) -> None:
        w = self.workers[slot]
        logfile = self.config.log_dir / f"worker{slot}.{w.incarnation}.log"
        if self._zygote_conn is not None:
            try:
                command = P.SpawnWorker(
                    slot=slot,
                    incarnation=w.incarnation,
                    env=self._slot_env(slot),
                    script=self.config.script,
                    argv=self.config.argv,
                    log=str(logfile),
                )
                self._zygote_conn.send(P.encode(command))
                return
            except OSError:
                self._zygote_conn = None
        env = self._base_env()
        env.update(self._slot_env(slot))
        with open(logfile, "ab") as out:
            w.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "unicron.runtime.launcher",
                    "worker",
                    self.config.script,
                    *self.config.argv,
                ],
                env=env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        w.pid = w.popen.pid


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _killpg(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads (a probe and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
