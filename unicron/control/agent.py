"""The agent: one per node. Starts and supervises the node's workers.

It listens on an authenticated local socket for its workers' reports (the typed messages of
:mod:`unicron.messages`, :data:`~unicron.messages.LocalMessage`), starts workers through
the warm zygote (:mod:`unicron.runtime.launcher`; a plain spawn when the zygote is gone), notices a
worker that exits or is killed (its socket closes; the zygote reports the exit status), writes
what it sees to the event log and reports it to the coordinator (step times, epochs entered,
errors, exits: the coordinator runs the task's detectors over every node's workers), and
carries out the coordinator's actions (:class:`unicron.messages.Spawn`, ``Kill`` and
``Probe``, the health probe of an excluded slot), which each exchange's reply carries.

Threads: everything the agent owns is touched by one thread, the one in :meth:`Agent.run`
(its ``accept`` thread only queues new connections and rings the doorbell). The coordinator
never calls the agent; the agent calls the coordinator's ``exchange`` once per round
(:class:`CoordinatorLink`), which sends when a report may not wait or the rhythm is due.

A round (:meth:`Agent.poll`) sleeps until the first thing timed is due (:meth:`Agent.round_s`)
or its doorbell rings: a worker's message that is not quiet (an error, an epoch entered; see
:func:`unicron.messages.quiet`), the zygote's, a new connection. It then reads every
socket that has something; a step's reports, a dozen per step, wait in their sockets for it.

Each slot's process is in one :class:`WorkerState` (its diagram is there); a move it does not
draw raises :class:`IllegalTransition`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from unicron import messages as M
from unicron import protocol as P
from unicron.control.door import Door
from unicron.control.heard import Doorbell, exit_reports, news_of_node, report_of
from unicron.control.probes import PROBE_TIMEOUT_S, Probes
from unicron.control.workerenv import (
    SECRETS,
    Account,
    AgentAddresses,
    base_env,
    device_env,
    import_env,
    killpg,
    signal_worker,
    slot_env,
    start_plainly,
)
from unicron.control.workerstate import (
    Worker,
    WorkerState,
)
from unicron.detect.busy import Stolen, process_state, read_thread_clocks, thread_states
from unicron.detect.classify import Verdict, classify_message
from unicron.messages import Kill, Probe, Reply, Spawn
from unicron.runtime.inject import Fault

__all__ = [
    "IDLE_ROUND_S",
    "PROBE_TIMEOUT_S",
    "ROUND_S",
    "SECRETS",
    "Agent",
    "AgentConfig",
    "CoordinatorLink",
    "FatalError",
    "import_env",
]

log = logging.getLogger("unicron.control.agent")

EXIT_GRACE_S = 0.3
"""after a worker's socket closes, how long to wait for its exit status before classifying"""
LAST_WORDS_S = 0.5
"""when the zygote reports a worker's exit, how long to wait for the connections still in the
door (its backlog, their challenges) that may carry its error (:meth:`Door.settle`)"""
_TICKS_PER_S = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def worker_log(log_dir: Path, slot: int, incarnation: int) -> Path:
    """Where the worker of ``slot``'s ``incarnation`` writes its output (and its stacks)."""
    return log_dir / f"worker{slot}.{incarnation}.log"


def _size(path: Path) -> int:
    """``path``'s size in bytes, 0 where it is missing."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


class StackDumps:
    """The hung workers asked for their stacks (:data:`~unicron.protocol.STACKS_SIGNAL`) and
    not killed yet: each is killed once something reached its log, no sooner than
    :data:`~unicron.protocol.STACKS_GRACE_S` after the ask and no later than
    :data:`~unicron.protocol.STACKS_MAX_GRACE_S`. The agent asks (:meth:`asked`), looks at
    each round (:meth:`due`), and sleeps no longer than :meth:`waits` says. A stopped process
    writes nothing: it is killed at the grace."""

    def __init__(self) -> None:
        self.look_at: dict[int, float] = {}  # pid -> when to look again
        self._logs: dict[int, tuple[Path, int, float]] = {}  # its log, its size, the last moment
        self._spies: dict[int, subprocess.Popen[bytes]] = {}  # pid -> its native dump, running

    def asked(self, pid: int, log_file: Path, now: float) -> None:
        last = now + P.STACKS_MAX_GRACE_S
        if os.environ.get(P.ENV_NATIVE_STACKS) == "1" and (spy := native_stacks(pid, log_file)):
            self._spies[pid], last = spy, now + NATIVE_STACKS_MAX_S
        self._logs[pid] = (log_file, _size(log_file), last)
        self.look_at[pid] = now + P.STACKS_GRACE_S

    def due(self, now: float) -> list[int]:
        """The workers to kill now (their stacks written, or their time is up)."""
        out = []
        for pid, at in list(self.look_at.items()):
            log_file, size, last = self._logs[pid]
            if now < at and now < last:
                continue
            spy = self._spies.get(pid)
            dumping = spy is not None and spy.poll() is None
            # stopped, it writes no stacks until continued; but a native dump under way stops it
            # itself (ptrace's tracing stop, "t"): that one ends by itself
            state = process_state(pid)
            stopped = state == "T" or (state == "t" and not dumping)
            if (_size(log_file) <= size or dumping) and now < last and not stopped:
                self.look_at[pid] = now + ROUND_S  # nothing written yet: look again soon
                continue
            if spy is not None:
                del self._spies[pid]
                if dumping:
                    spy.kill()
                    spy.wait()
            _append(log_file, ["unicron: the kernel's view of each thread, at the kill:",
                               *thread_states(pid)])  # fmt: skip
            del self.look_at[pid], self._logs[pid]
            out.append(pid)
        return out

    def waits(self, now: float) -> list[float]:
        return [at - now for at in self.look_at.values()]


def _append(log_file: Path, lines: list[str]) -> None:
    """Append ``lines`` to a worker's log (nothing where it cannot be written)."""
    with contextlib.suppress(OSError), open(log_file, "a") as out:
        out.write("\n" + "\n".join(lines) + "\n")


def native_stacks(pid: int, log_file: Path) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy dump --native`` of ``pid`` appending to ``log_file`` (``None``: no
    ``py-spy`` beside the interpreter or on the ``PATH``); :class:`StackDumps` holds the kill
    until it ends (:data:`~unicron.protocol.ENV_NATIVE_STACKS`)."""
    beside = os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", "")))
    spy = shutil.which("py-spy", path=beside)  # the interpreter's environment's, else PATH's
    if spy is None:
        return None
    with open(log_file, "ab") as out:
        out.write(f"\nunicron: py-spy dump --native --pid {pid}\n".encode())
        out.flush()
        return subprocess.Popen([spy, "dump", "--native", "--pid", str(pid)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip


NATIVE_STACKS_MAX_S = 30.0
"""how long a native dump (:func:`native_stacks`) may hold a hung worker's kill back: py-spy
reads the native symbols of torch's libraries first (seconds of a core; beside two CPU
burners 5 s gave it time for its first line only)"""
_HUNG = frozenset({"hang", "stall", "collective_stall"})
"""verdict kinds of a worker killed while alive but stuck: it writes its stacks first"""
ROUND_S = 0.02
"""the shortest wait of a round, while something is polled (a probe, a plainly started
worker's exit, a closed socket's grace, a zygote still starting)"""
IDLE_ROUND_S = 0.25
"""the longest: a round starts at least this often (:meth:`Agent.round_s`)"""


@dataclass(frozen=True)
class FatalError:
    """An error that ended the worker in ``slot`` (reported by it at ``ts``): the runner shows
    the first one's traceback when the task fails."""

    slot: int
    ts: float
    error: M.Error


def census_of(workers: Mapping[int, Worker], probes: Probes) -> M.Census:
    """An agent's :class:`~unicron.messages.Census` of its ``workers`` (slot -> worker) and the
    slots whose health probe runs (``probes``)."""
    of = {k: tuple(s for s, w in workers.items() if w.state is k) for k in WorkerState}
    return M.Census(
        ts=time.time(),
        alive=tuple(s for s, w in workers.items() if w.alive),
        ready=of[WorkerState.READY],
        probing=tuple(s for s in workers if s in probes),
        starting=of[WorkerState.STARTING],
        done=of[WorkerState.DONE],
    )


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
    account: Account | None = None
    """the unprivileged account the task's processes run as (``unicron agent --run-as``);
    ``None``: the agent's own"""
    places: dict[int, int] = field(default_factory=dict)
    """each slot's place in its model-parallel replica, as the coordinator says (the
    assignment, then each :class:`~unicron.messages.Spawn`); a slot not in it: its place
    among this node's slots alone (:mod:`unicron.control.replicas`)"""


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
        self,
        config: AgentConfig,
        link: CoordinatorLink,
        *,
        task: str,
        store_address: str,
        store_key: str,
    ) -> None:
        self.config, self.node, self.link, self.task = config, config.node, link, task
        # the store as last assigned (the node's heartbeat sets it); the task's capability there
        self.store_address, self.store_key = store_address, store_key
        self.reply = Reply()  # the coordinator's last answer
        self._reports: list[M.Report] = []  # this round's, in order
        self.workers = {s: Worker(s) for s in config.slots}
        self._stolen = Stolen(_TICKS_PER_S)  # the hypervisor's steal, read with each sample
        self.fired: set[str] = set()
        self._step_ends: deque[tuple[int, int]] = deque(maxlen=64)  # (epoch, step) sent on
        self.errors: list[FatalError] = []  # every error that ended a worker, in order
        self.vanished = False
        self._authkey = secrets.token_bytes(16)
        self._door = Door(self._authkey, self._admit)  # its workers, zygote connect there
        self.address = "{}:{}".format(*self._door.address)
        # the workers' doorbell (:func:`unicron.messages.quiet`): a datagram wakes a round
        self._bell = Doorbell()
        self.bell_address = self._bell.address
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self._anonymous: list[Connection] = []  # connected, no hello yet
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_conn: Connection | None = None
        self._pending_spawns: list[int] = []
        self._by_pid: dict[int, int] = {}
        self._probes = Probes(config.log_dir, config.account)  # the excluded slots' health probes
        self._dumps = StackDumps()  # hung workers writing their stacks before their kill
        self._kill = functools.partial(signal_worker, sig=signal.SIGKILL, account=config.account)
        self._stop = threading.Event()
        self._door.open()

    # -- start, stop ------------------------------------------------------------------------
    def start(self, zygote: subprocess.Popen[bytes] | None = None) -> None:
        """Start the zygote and every slot's worker (called once, before :meth:`run`).
        ``zygote``: one started ahead with :func:`import_env` of this task's settings
        (:func:`unicron.runtime.launcher.prewarm`), adopted here: it gets the rest of the
        environment on its stdin; one that died meanwhile is replaced."""
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.account is not None:  # the zygote opens its workers' logs there
            self.config.account.owns(self.config.log_dir)
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
            log_path = self.config.log_dir / f"zygote-node{self.node}.log"
            env, account = self._base_env(), self.config.account
            self._zygote = start_plainly(["zygote"], env, log_path, account)
        for slot in self.config.slots:
            self.spawn(slot)

    def stop(self) -> None:
        """Kill every worker and the zygote; no process is left behind."""
        self._stop.set()
        for w in self.workers.values():
            if w.pid is not None and w.alive:
                self._kill(w.pid)
            if w.popen is not None:
                w.popen.kill()
                w.popen.wait()
        self._probes.kill_all(wait=True)
        if self._zygote is not None:
            killpg(self._zygote.pid)
            self._zygote.wait()
        self._door.close()
        self._bell.close()

    # -- actions (the coordinator's, taken on every round) ------------------------------------
    def _report(self, report: M.Report) -> None:
        self._reports.append(report)

    def census(self) -> M.Census:
        """Which of this node's workers live, start, wait in no epoch or finished: sent when
        the agent reconnects to a coordinator (one that restarted adopts the task from it)."""
        return census_of(self.workers, self._probes)

    def _act(self, now: float) -> None:
        """Carry out what the coordinator asked of this node in its last answer."""
        for action in self.reply.actions:
            if self.vanished:
                return
            if isinstance(action, Spawn):
                w = self.workers.get(action.slot)
                if action.fresh and w is not None and w.alive and w.incarnation >= 0:
                    continue  # a slot given to the task, already started with its supervisor
                self.config.places[action.slot] = action.place
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
            self._kill(w.pid)
        w.incarnation += 1
        w.pid, w.conn, w.popen, w.eof_ts, w.error, w.verdict, w.step, w.tid = (None,) * 8
        w.computing_since = w.waiting_since = None
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
        w.verdict = verdict or w.verdict
        if w.pid is None:
            w.kill_pending = True  # killed as soon as the zygote says which pid it got
        elif w.alive and verdict is not None and verdict.kind in _HUNG:
            log_file = worker_log(self.config.log_dir, slot, w.incarnation)
            self._dumps.asked(w.pid, log_file, time.time())
            signal_worker(w.pid, P.STACKS_SIGNAL, self.config.account)  # its stacks, to its log
        elif w.alive:
            self._kill(w.pid)

    def probe(self, slot: int) -> None:
        """Start the health probe of the excluded ``slot`` (``python -m unicron.runtime.health``,
        a fresh process, on the slot's own device); :meth:`poll` reports its verdict
        (``ProbeDone``)."""
        if not self.vanished:
            self._probes.start(slot, {**self._base_env(), **device_env(self.config, slot)})

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
        due += self._dumps.waits(now)
        due += [at - now for w in self.workers.values() if (at := w.sample_at()) is not None]
        return max(min(due), 0.0)

    def wake(self) -> None:
        """Ring the doorbell: a waiting round starts now (from any thread)."""
        self._bell.ring()

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
                self._kill(w.pid)
        if self._zygote is not None:
            killpg(self._zygote.pid)

    def vanish(self) -> None:
        """The injected node fault: this node's workers and zygote die at once and the agent
        falls silent (no more reports, no heartbeats), as when a machine is lost."""
        self.vanished = True
        self._probes.kill_all()
        for w in self.workers.values():
            if w.pid is not None and w.alive:
                self._kill(w.pid)
            w.exited()
        if self._zygote is not None:
            killpg(self._zygote.pid)

    def poll(self, timeout: float) -> None:
        """One round: read reports, notice exits, run the monitor, let the coordinator act.

        The round waits up to ``timeout`` for its doorbell (a worker's message that is not
        :func:`~unicron.messages.quiet`), the zygote or a new connection's hello, then
        reads every socket that has something: a worker's step reports wait for the next round
        instead of waking one each (a dozen per step; docs/cluster.md, The rhythm)."""
        self._drain_accepted()
        waken: list[Any] = [self._bell, *self._anonymous]
        if self._zygote_conn is not None:
            waken.append(self._zygote_conn)
        if wait(waken, timeout=timeout):
            self._bell.silence()
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
        for pid in self._dumps.due(now):  # its stacks are written: the kill of :meth:`kill`
            if pid in self._by_pid:  # not exited meanwhile
                self._kill(pid)
        self._check_exits(now)
        self._sample_cpu(now)
        for slot, ok, detail in self._probes.check(now) if self._probes else ():
            self._report(M.ProbeDone(slot=slot, ts=now, ok=ok, detail=detail))
        if self.vanished:
            return  # a lost node says nothing more
        reports, self._reports = self._reports, []
        self.reply = self.link.exchange(self.node, reports, now, read_until=read_until)
        self._act(now)

    def _admit(self, conn: Connection) -> None:
        """A connection that proved the key (from :class:`Door`'s threads): its hello is read
        by the round it wakes."""
        self._accepted.put(conn)
        self.wake()

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
        exit code (seen beside a CPU burner), its traceback dropped. If it died before its
        connection was known, that connection may still be in the door (the backlog, its
        challenge): the door settles first, for :data:`LAST_WORDS_S` at most."""
        w = self.workers[slot]
        if w.conn is None:
            self._door.settle(LAST_WORDS_S)
        self._drain_accepted()
        for conn in [*self._anonymous, *([w.conn] if w.conn is not None else [])]:
            self._read(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                raw = conn.recv()
                try:
                    self._handle(conn, M.from_wire(raw))
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
            for w in self.workers.values():  # asked of it, not yet running on their own
                if not (w.alive and w.conn is None and w.popen is None and w.eof_ts is None):
                    continue
                if w.pid is None:  # its fork never came: started plainly now
                    self._launch(w.slot)
                else:  # it died with the zygote before its hello: ended after the grace
                    w.eof_ts = time.time()
            return
        for w in self.workers.values():
            if w.conn is conn:
                w.conn = None
                w.eof_ts = w.eof_ts or time.time()

    def _handle(self, conn: Connection, msg: M.LocalMessage) -> None:
        if isinstance(msg, M.ZygoteUp):
            self._anonymous.remove(conn)
            self._zygote_conn = conn
            for slot in self._pending_spawns:
                self._launch(slot)
            self._pending_spawns.clear()
        elif isinstance(msg, M.Spawned):
            w = self.workers[msg.slot]
            if msg.incarnation != w.incarnation:
                self._kill(msg.pid)  # an earlier incarnation, replaced before it started
                return
            self._by_pid[msg.pid] = msg.slot
            self._set_pid(w, msg.pid)
        elif isinstance(msg, M.Exited):
            owner = self._by_pid.get(msg.pid, -1)
            if owner >= 0 and self.workers[owner].pid == msg.pid:
                self._drain_worker(owner)  # what it said before it died (its error) first
            self._by_pid.pop(msg.pid, None)
            if owner >= 0 and self.workers[owner].pid == msg.pid:
                self._exited(owner, msg.returncode)
        elif isinstance(msg, M.WhereStore):  # its store is gone: the one question it asks
            conn.send(M.to_wire(M.StoreAt(address=self.store_address)))
        elif isinstance(msg, M.Hello):
            w = self.workers[msg.slot]
            if conn in self._anonymous:
                self._anonymous.remove(conn)
            if msg.incarnation != w.incarnation or not w.alive:
                conn.close()  # a late hello from an earlier incarnation of the slot: it ends
                if msg.pid != w.pid:
                    self._kill(msg.pid)
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
            self._kill(pid)

    def _from_worker(self, slot: int, msg: M.LocalMessage) -> None:
        """One message of the worker in ``slot`` as this round's reports (the translation:
        :func:`unicron.control.heard.report_of`) and what it changes on the node."""
        now = time.time()
        w = self.workers[slot]
        if isinstance(msg, M.Event):
            event = report_of(slot, msg, now)
            if event is not None and news_of_node(msg, self.fired, self._step_ends):
                self._report(event)
        elif isinstance(msg, M.Error) and msg.usage:  # bad input: the whole run ends, exit 2
            self._report(M.BadInput(ts=now, message=msg.message))
        elif isinstance(msg, M.Error):
            if not msg.in_band:
                w.error = msg  # the error that ends this process
                self.errors.append(FatalError(slot, now, msg))  # the task's failure report
            verdict = classify_message(msg.type_name, msg.message)
            step = w.step if msg.step is None else msg.step
            self._report(
                M.Detected(slot=slot, ts=now, step=step, verdict=verdict, method="exception")
            )
            w.timed(msg, now)
            if msg.in_band:
                self._report(
                    M.WorkerError(
                        slot=slot, ts=now, verdict=verdict, in_place=msg.in_place, epoch=msg.epoch
                    )
                )
            else:  # the error ends the process: do not wait for its interpreter to wind down
                self.kill(slot, verdict)
        elif isinstance(msg, M.NodeFault):
            # what the node's workers said before the fault (the injector's fault_injected
            # record among it) goes out first; from then on the node says nothing
            reports, self._reports = self._reports, []
            self.link.exchange(self.node, reports, now, read_until=now, flush=True)
            self.vanish()
        else:
            report = report_of(slot, msg, now)
            if report is None:
                raise ValueError(f"not a worker's message: {msg!r}")
            if isinstance(msg, M.Ready):
                w.readied()
            elif isinstance(msg, M.EpochEntered):
                w.entered()
            elif isinstance(msg, M.WorkerDone):
                w.done()
            w.timed(msg, report.ts)  # the monitor times its step, the CPU sampler its waits
            self._report(report)

    # -- process supervision ----------------------------------------------------------------
    def _sample_cpu(self, now: float) -> None:
        """Report the CPU time of each worker whose step, or wait on its peers, has lasted a
        while: the coordinator tells a starved worker from a hung one by it before killing
        (:mod:`unicron.detect.busy`)."""
        for w in self.workers.values():
            at = w.sample_at()
            if at is None or now < at:
                continue
            assert w.pid is not None and w.sampled_tid is not None  # (sample_at)
            w.cpu_read_at = now
            r = read_thread_clocks(w.pid, w.sampled_tid, _TICKS_PER_S, self._stolen)
            if r is not None:
                self._report(M.CpuTime(slot=w.slot, **asdict(r)))  # the same fields

    def _check_exits(self, now: float) -> None:
        for w in self.workers.values():
            if not w.alive:
                continue
            if w.popen is not None and w.popen.poll() is not None:
                self._exited(w.slot, w.popen.returncode)
            elif w.eof_ts is not None and now - w.eof_ts > EXIT_GRACE_S:
                # the socket closed but no exit status came: the process is cut off; end it
                if w.pid is not None:
                    self._kill(w.pid)
                self._exited(w.slot, None)

    def _exited(self, slot: int, returncode: int | None) -> None:
        w = self.workers[slot]
        if not w.alive:
            return
        was = w.state
        w.exited()
        normal = was is WorkerState.DONE and returncode == 0  # it left as the task ended
        if self._stop.is_set() or self.reply.finished or normal:
            return
        if was is WorkerState.LEAVING:  # a planned move: nothing to heal
            self._report(M.WorkerLeft(slot=slot, ts=time.time()))
            return
        if returncode == 0 and self.reply.over:
            # a worker that left because the task ended (maybe announced in a last epoch it
            # never trained in): nothing to heal, but the task must not wait for its report
            self._report(M.WorkerLeft(slot=slot, ts=time.time()))
            return
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        for report in exit_reports(w, returncode, time.time()):
            self._report(report)

    # -- launching --------------------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        """What every worker, the zygote and the probes start with
        (:func:`unicron.control.workerenv.base_env`)."""
        at = AgentAddresses(self.task, self.store_address, self.store_key, self.address,
                            self.bell_address, self._authkey)  # fmt: skip
        return base_env(self.config, at)

    def _slot_env(self, slot: int) -> dict[str, str]:  # the store as last assigned (it moves)
        env = slot_env(self.config, slot, self.workers[slot].incarnation, self.fired)
        return {**env, P.ENV_STORE: self.store_address}

    def _launch(self, slot: int) -> None:
        w = self.workers[slot]
        logfile = worker_log(self.config.log_dir, slot, w.incarnation)
        argv = (self.config.script, *self.config.argv)
        if self._zygote_conn is not None:
            env, log_to = self._slot_env(slot), str(logfile)
            command = M.SpawnWorker(slot=slot, incarnation=w.incarnation, env=env,
                                    script=argv[0], argv=argv[1:], log=log_to)  # fmt: skip
            with contextlib.suppress(OSError):
                self._zygote_conn.send(M.to_wire(command))
                return
            # gone: this one plainly, the others it owes once the next round reads its end
        env = {**self._base_env(), **self._slot_env(slot)}
        try:
            w.popen = start_plainly(["worker", *argv], env, logfile, self.config.account)
        except OSError as exc:  # no process (fork's EAGAIN, EMFILE): reported as its exit
            log.warning("node %d: slot %d's worker did not start: %s", self.node, slot, exc)
            w.eof_ts = time.time()  # (found in review: the slot stayed STARTING for good)
            return
        self._set_pid(w, w.popen.pid)  # a kill that came before its start is carried out
