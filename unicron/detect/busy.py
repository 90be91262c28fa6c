"""Starved or hung? A late worker's CPU time tells.

A step past its hang allowance while every peer finished it is a hang in a quiet machine, but
on a loaded one the late worker may simply not have been scheduled: its peers got the cores
first. The two look the same on the wall clock and differ in CPU time. A hung process (stopped,
deadlocked, blocked on a lock or a socket) accumulates none; a starved one accumulates CPU
whenever it runs, and needs about what its peers needed for the same step.

The worker sends the CPU time of the thread that computes the step (``time.thread_time``,
and the thread's kernel id) with each step's begin and end; while a step lasts long, the agent
samples the same clock from outside, with the time the thread waited runnable for a CPU
(``/proc/<pid>/task/<tid>/schedstat``: a stopped process cannot answer for itself), and reports
:class:`~unicron.messages.CpuTime`. Before it kills a hang suspect the coordinator
asks :func:`judge`. A worker whose CPU time still advances, and has not yet spent ``factor``
times what the step cost its peers (or itself, lately), is WORKING: left to finish. One whose
CPU time stood still is IDLE: hung, and that is evidence enough once a single peer finished
the step (without it the coordinator waited for every peer, or for twice the allowance). Past
the budget it is SPINNING (an endless loop): a hang like any other. Without samples (no
``/proc``, an agent too busy to send them) the wall-clock verdict stands.

The computing thread's clock, not the process's: a process also runs threads of its own that
have nothing to say about the step (gloo's event loops, a data loader, a checkpoint writer).
One of them busy, or spinning, would make a hung step read as WORKING, or a slow one as
SPINNING (seen: a gloo loop thread of a left epoch at a whole core, found beside a CPU burner).

:func:`judge` is pure (no clock, no I/O); :func:`read_thread_clocks` is the agent's one read. A
worker whose CPU time stood still but that waited in the run queue meanwhile is starved too
(WORKING), not IDLE: at a load of 7 processes per core one can get under 2 % of a core for half
a second. One whose CPU time stood still while *another* of its threads waited for a CPU may
be waiting on that thread (a thread it starts, which must run before ``Thread.start``
returns; the GIL one holds): its stillness is no evidence, and it is UNKNOWN, the wall
clock's larger overrun deciding (seen beside CPU burners: a ZeRO worker killed at 1 s in
``Thread.start`` of its gatherer, the new thread not yet run, the task's state lost with it).
The kernel counts a wait only when it ends, so another thread runnable at the last sample,
while the other threads got no CPU, counts as well: it waits in the run queue (seen: a
restarted ZeRO worker killed at its 5 s cold allowance, its new gloo threads runnable and one
never yet run, none of their seconds of wait counted). A runnable thread that runs is no
such evidence: the computing thread may wait on a thread that holds the GIL for ever, a hang.

A machine that is itself a guest has a third way to stand still: the hypervisor may hold one
of its virtual CPUs off for a while (steal time). A thread on that CPU then accumulates neither
CPU time nor a wait in the run queue (its time is the host's, not its kernel's), and every
thread that waits on it (the computing thread in a collective, its peer's too) stands still
with nothing queued: a hang, to the clocks above (seen beside CPU burners on this VM: an FSDP
replica's two ranks judged hung together in an all-gather, no fault injected; a burner's
schedstat plus its CPU's steal in ``/proc/stat`` add up to the wall clock). The agent reads
the machine's steal with each sample (:class:`Stolen`: over each interval of 0.2 s or more, the
most that any one CPU lost, summed); the judge compares readings at least :data:`MIN_GAP_S`
apart in the machine's *own* time, the span less what was stolen in it.

The same question, starved or slow, decides stragglers. A worker that computes its share in
twice its peers' time is slow (a throttled device, a sick host) or merely last in the run queue
of an oversubscribed machine, which moves between workers. The kernel keeps the difference
for each thread: the time it was runnable but waited for a CPU
(``/proc/thread-self/schedstat``). The worker reads it around each step's compute
(:func:`read_queued_s`) and sends the difference; the straggler detector judges
:func:`own_compute_s`, the step's compute without that wait. What a worker waits for of its own
accord (a device, a sleep, I/O) stays in it: a slow device is still slow. Only the computing
thread's wait is counted: a starved helper thread the main thread waits on still reads as slow.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "STOLEN_EVERY_S",
    "Cpu",
    "CpuTimes",
    "Sample",
    "Stolen",
    "judge",
    "own_compute_s",
    "process_state",
    "read_cpu_s",
    "read_queued_s",
    "read_thread_clocks",
    "waiting",
]

MIN_BUSY = 0.02
"""a process using less than this share of one core between two samples is not working"""
MIN_GAP_S = 0.5
"""the two samples compared are at least this far apart (the kernel counts CPU time in 10 ms
ticks: over half a second that is 2 % of a core)"""
FRESH_S = 1.0
"""the newest sample must be this recent at the verdict: older evidence is no evidence"""


@dataclass(frozen=True)
class Sample:
    """The CPU time ``cpu_s`` of the worker's computing thread at time ``ts`` (seconds since
    the epoch), and how long it had waited runnable for a CPU by then (``queued_s``; ``None``:
    unknown)."""

    ts: float
    cpu_s: float
    queued_s: float | None = None
    others_queued_s: float | None = None
    """how long the process's other threads had waited runnable for a CPU by then (summed;
    ``None``: unknown)"""
    runnable: bool | None = None
    """the thread was runnable at ``ts`` (state ``R``: on a CPU or waiting for one; ``None``:
    unknown). The kernel adds a wait to ``queued_s`` only when the wait ends: a thread that
    waits for a CPU through the whole span shows neither CPU time nor wait"""
    others_runnable: bool | None = None
    """another thread of the process (less those at ``SCHED_IDLE``) was runnable at ``ts``: on
    a CPU or waiting for one (``None``: unknown)"""
    others_cpu_s: float | None = None
    """the CPU time of those other threads by then (summed; ``None``: unknown): where it stood
    still, a runnable one waits for a CPU, and its wait is not yet in ``others_queued_s``"""
    stolen_s: float | None = None
    """the machine's CPU time stolen by the hypervisor by then, as :meth:`Stolen.read` counts it
    (``None``: unknown): the seconds between two samples that a thread (or one it waits on)
    may have been held off the CPU without a trace in its own clocks"""


class Cpu(enum.Enum):
    """What a late worker's CPU time says (:func:`judge`)."""

    UNKNOWN = "unknown"  # no fresh samples: the wall-clock verdict stands
    IDLE = "idle"  # it stood still: stopped, deadlocked or blocked (a hang)
    WORKING = "working"  # it advances within the step's budget: starved, not hung
    SPINNING = "spinning"  # it advances past the budget: an endless loop (a hang)


def judge(
    *,
    began: Sample | None,
    samples: Sequence[Sample],
    typical_cpu_s: float | None,
    factor: float,
    now: float,
) -> tuple[Cpu, str]:
    """What the CPU time of a worker late in its step says, and why (for the event log).

    ``began`` is its CPU time when the step began; ``samples`` the agent's readings since (in
    time order); ``typical_cpu_s`` what the step cost its peers (or its own recent steps);
    ``factor`` the hang factor: a step that has used more than ``factor x typical_cpu_s`` of CPU
    spins rather than computes. Without a yardstick a worker that advances is UNKNOWN.
    """
    read = _latest_rate(samples, now)
    if isinstance(read, str):
        return Cpu.UNKNOWN, read
    if read.busy < MIN_BUSY:
        return _still(read)
    busy = read.busy
    if began is None or typical_cpu_s is None:
        return Cpu.UNKNOWN, f"it uses {busy:.0%} of a core; no yardstick for the step's cost"
    used = read.last.cpu_s - began.cpu_s
    if used > factor * typical_cpu_s:
        return Cpu.SPINNING, (
            f"it used {used:.2f} s of CPU in the step, over {factor:g} x the "
            f"{typical_cpu_s:.3f} s a step costs: it spins"
        )
    return Cpu.WORKING, (
        f"still computing ({busy:.0%} of a core; {used:.2f} s of CPU so far against "
        f"{typical_cpu_s:.3f} s a step costs): starved, not hung"
    )


def waiting(samples: Sequence[Sample], now: float) -> tuple[Cpu, str]:
    """What the readings ``samples`` (in time order) of a member its peers wait for outside a
    step (joining an epoch, reducing a step: :func:`unicron.control.health.check_stalls`)
    say, and why. There is no step to cost: WORKING is starved (its thread still while
    runnable, or while its own wait in the run queue grew), IDLE still with nothing of its own
    queued (blocked: stuck in a collective, or waiting on a peer); UNKNOWN without fresh
    readings, while it runs (slow work, or a spin), or while only its other threads wait for
    a CPU (it may wait on them, or merely sleep while they wake)."""
    read = _latest_rate(samples, now)
    if isinstance(read, str):
        return Cpu.UNKNOWN, read
    if read.busy >= MIN_BUSY:
        return Cpu.UNKNOWN, f"it runs ({read.busy:.0%} of a core over {read.over})"
    return _still(read)


@dataclass(frozen=True)
class _Rate:
    """Two readings compared: ``prev`` and ``last``, ``seen`` seconds of the machine's own time
    apart (their distance less what the hypervisor stole in it, ``stolen``)."""

    last: Sample
    prev: Sample
    seen: float
    stolen: float
    near: Sample
    """the newest reading :data:`MIN_GAP_S` before ``last`` on the wall clock (``prev`` where
    nothing was stolen): whether another thread got no CPU *lately* is asked of it, a longer
    span taking in what the thread ran before"""

    def rate(self, before: float | None, after: float | None) -> float | None:
        """How fast a clock read as ``before`` at ``prev`` and ``after`` at ``last`` grew, in
        seconds per second of the machine's own time (``None``: unknown)."""
        return None if before is None or after is None else (after - before) / self.seen

    @property
    def busy(self) -> float:
        """The share of a core the thread used between the two readings."""
        return (self.last.cpu_s - self.prev.cpu_s) / self.seen

    @property
    def over(self) -> str:
        """The span, for a reason: ``0.60 s``, or ``0.62 s + 0.31 s stolen``."""
        more = f" + {self.stolen:.2f} s stolen" if self.stolen >= 0.01 else ""
        return f"{self.seen:.2f} s{more}"


def _stolen(prev: Sample, last: Sample) -> float:
    """What the hypervisor stole from the machine between two readings (0: unknown)."""
    if prev.stolen_s is None or last.stolen_s is None:
        return 0.0
    return max(0.0, last.stolen_s - prev.stolen_s)


def _latest_rate(samples: Sequence[Sample], now: float) -> _Rate | str:
    """The newest reading and the newest at least :data:`MIN_GAP_S` of the machine's own time
    before it (the wall clock less what the hypervisor stole between them), compared; or why
    there are none to compare (the newest must be :data:`FRESH_S` recent at ``now``)."""
    if len(samples) < 2:
        return "no CPU samples"
    last = samples[-1]
    if now - last.ts > FRESH_S:
        return f"no CPU sample for {now - last.ts:.2f} s"
    near = next((s for s in reversed(samples[:-1]) if last.ts - s.ts >= MIN_GAP_S), None)
    for prev in reversed(samples[:-1]):
        if prev.stolen_s is None and last.stolen_s is not None:
            continue  # what was stolen since is not known
        stolen = _stolen(prev, last)
        if last.ts - prev.ts - stolen >= MIN_GAP_S:
            return _Rate(last, prev, last.ts - prev.ts - stolen, stolen, near or prev)
    first = next((s for s in samples if s.stolen_s is not None), samples[0])
    stolen = _stolen(first, last)
    if stolen > 0.0 and last.ts - first.ts >= MIN_GAP_S:
        return (
            f"the hypervisor held the machine's CPUs off {stolen:.2f} s of the last "
            f"{last.ts - first.ts:.2f} s: not {MIN_GAP_S:g} s of its own between two CPU samples"
        )
    return f"no two CPU samples {MIN_GAP_S:g} s apart"


def _still(read: _Rate) -> tuple[Cpu, str]:
    """What a thread that got under :data:`MIN_BUSY` of a core between two readings (``read``)
    is: starved (WORKING) where it waits for a CPU, UNKNOWN where its other threads do (it may
    wait on them), else IDLE."""
    last, prev, busy, over = read.last, read.prev, read.busy, read.over
    if last.runnable:  # still in the run queue: its wait is not counted until it runs
        return Cpu.WORKING, (
            f"runnable but not run ({busy:.0%} of a core over {over}): starved, not hung"
        )
    waiting = read.rate(prev.queued_s, last.queued_s)
    if waiting is not None and waiting >= MIN_BUSY:  # runnable, but others had the cores
        return Cpu.WORKING, (
            f"runnable but waiting for a CPU {waiting:.0%} of the last {over} "
            f"(ran {busy:.0%}): starved, not hung"
        )
    others = read.rate(prev.others_queued_s, last.others_queued_s)
    if others is not None and others >= MIN_BUSY:  # it may wait on one: a thread start, the GIL
        return Cpu.UNKNOWN, (
            f"its CPU time stood still ({busy:.0%} of a core over {over}) while its other "
            f"threads waited for a CPU {others:.0%} of it: it may wait on them"
        )
    near = read.near
    others = None
    if near.others_cpu_s is not None and last.others_cpu_s is not None:
        others = (last.others_cpu_s - near.others_cpu_s) / (last.ts - near.ts)
    if last.others_runnable and others is not None and others < MIN_BUSY:
        # runnable, not run: in the queue (its wait not yet counted)
        return Cpu.UNKNOWN, (
            f"its CPU time stood still ({busy:.0%} of a core over {over}) while another of "
            f"its threads is runnable and its other threads ran {others:.0%}: it may wait on "
            "one in the run queue"
        )
    return Cpu.IDLE, f"its CPU time stood still ({busy:.0%} of a core over {over})"


_KEPT_STEPS = 8
"""steps whose CPU cost per worker is kept as the peers' evidence"""


class CpuTimes:
    """What the coordinator knows of its workers' CPU time: fed from their step reports and
    the agents' samples, asked by :meth:`judge` before a hang suspect is killed and by
    :meth:`waiting` before a member its peers wait for outside a step is."""

    def __init__(self) -> None:
        self._began: dict[int, tuple[int, Sample]] = {}  # slot -> step, CPU when it began
        self._samples: dict[int, deque[Sample]] = {}  # slot -> the agent's readings since
        self._waiting: dict[int, deque[Sample]] = {}  # slot -> readings outside a step
        self._cost: dict[int, dict[int, float]] = {}  # step -> slot -> CPU it took
        self._own: dict[int, deque[float]] = {}  # slot -> CPU of its recent steps
        self.sampling = False
        """an agent has sent a reading: CPU evidence is to be expected, and its absence at a
        verdict means a late agent (a loaded machine), not a platform without ``/proc``"""

    def began(self, slot: int, step: int, sample: Sample | None) -> None:
        """The worker in ``slot`` began ``step``, with ``sample`` its CPU time then."""
        self._samples.pop(slot, None)
        self._waiting.pop(slot, None)
        if sample is None:
            self._began.pop(slot, None)
        else:
            self._began[slot] = (step, sample)

    def computed(self, slot: int, step: int, cpu_s: float | None) -> float | None:
        """The worker in ``slot`` finished computing ``step`` with ``cpu_s`` its CPU time;
        returns what the step cost it (``None``: unknown), for the straggler detector."""
        began = self._began.pop(slot, None)
        self._samples.pop(slot, None)
        self._waiting.pop(slot, None)  # (what it did before the step: the wait after is new)
        if cpu_s is None or began is None or began[0] != step:
            return None
        cost = max(0.0, cpu_s - began[1].cpu_s)
        self._cost.setdefault(step, {})[slot] = cost
        while len(self._cost) > _KEPT_STEPS:
            del self._cost[min(self._cost)]
        self._own.setdefault(slot, deque(maxlen=_KEPT_STEPS)).append(cost)
        return cost

    def sampled(self, slot: int, sample: Sample) -> None:
        """The agent read the CPU time of the worker in ``slot`` during its step, or while
        it waits on its peers outside one."""
        self.sampling = True
        kept = self._samples if slot in self._began else self._waiting
        kept.setdefault(slot, deque(maxlen=_KEPT_STEPS)).append(sample)

    def forget(self, slot: int) -> None:
        """The worker in ``slot`` is gone or restarting."""
        self._began.pop(slot, None)
        self._samples.pop(slot, None)
        self._waiting.pop(slot, None)
        self._own.pop(slot, None)
        for costs in self._cost.values():
            costs.pop(slot, None)

    def judge(self, slot: int, step: int, *, factor: float, now: float) -> tuple[Cpu, str]:
        """:func:`judge` for the worker in ``slot``, late in ``step``: its peers' CPU cost
        of that step is the yardstick (the most any of them took), else its own recent
        steps' median."""
        began = self._began.get(slot)
        if began is None or began[0] != step:
            return Cpu.UNKNOWN, "no CPU time at the step's start"
        peers = [c for s, c in self._cost.get(step, {}).items() if s != slot]
        own = sorted(self._own.get(slot, ()))
        typical = max(peers) if peers else (own[len(own) // 2] if own else None)
        return judge(
            began=began[1],
            samples=list(self._samples.get(slot, ())),
            typical_cpu_s=typical,
            factor=factor,
            now=now,
        )

    def entered(self, slot: int) -> None:
        """The worker in ``slot`` entered an epoch: a step it had begun is abandoned (it is
        begun again there), and what it does now is a wait on its peers."""
        self._began.pop(slot, None)
        self._samples.pop(slot, None)
        self._waiting.pop(slot, None)

    def read_at(self, slot: int) -> float | None:
        """When the newest reading of the worker in ``slot`` outside a step was taken (the
        agent's clock), or ``None``: none since its last step's end or its epoch's entry."""
        kept = self._waiting.get(slot)
        return kept[-1].ts if kept else None

    def waiting(self, slot: int, now: float) -> tuple[Cpu, str]:
        """:func:`waiting` for the worker in ``slot``, outside a step (joining an epoch,
        reducing a step), from the readings since it entered the epoch or ended its step."""
        return waiting(list(self._waiting.get(slot, ())), now)


def own_compute_s(compute_s: float, queued_s: float | None) -> float:
    """A step's compute time without the time its thread waited for a CPU (``queued_s``, from
    :func:`read_queued_s`; ``None`` where unknown): what the straggler detector compares."""
    if queued_s is None or not math.isfinite(queued_s) or queued_s <= 0.0:
        return compute_s
    return max(compute_s - queued_s, 0.0)


def _schedstat(path: str) -> tuple[float, float] | None:
    """A thread's ``schedstat``: seconds on a CPU and seconds runnable but waiting for one
    (nanoseconds in the file); ``None`` where it cannot be read (gone, or not Linux)."""
    try:
        with open(path, "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


def read_queued_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started
    (the run-queue delay, second field of ``/proc/thread-self/schedstat``); ``None`` where the
    kernel does not say. Called by the worker at the start and end of each step's compute."""
    clocks = _schedstat("/proc/thread-self/schedstat")
    return None if clocks is None else clocks[1]


STOLEN_EVERY_S = 0.2
""":class:`Stolen` takes each CPU's largest loss over intervals at least this long: over many
short ones the sum of the largest losses, each a 10 ms tick on some CPU, tends to the whole
machine's steal (on many CPUs, more than the wall clock)"""


class Stolen:
    """The CPU time the hypervisor has held this machine's CPUs off (their steal time, per CPU
    in ``/proc/stat``), as one clock that only grows: over each interval of at least
    :data:`STOLEN_EVERY_S`, the most that any one CPU lost. A thread frozen on a held-off CPU
    lost about that (to the kernel's 10 ms tick), and so did a chain of threads that moved
    between CPUs no faster. The agent keeps one, read with each sample of a worker
    (:func:`read_thread_clocks`); the judge subtracts it from the span it compares."""

    def __init__(self, ticks_per_s: float, path: str = "/proc/stat") -> None:
        self._ticks_per_s, self._path = ticks_per_s, path
        self._since: tuple[float, dict[bytes, int]] | None = None  # the open interval's start
        self._total = 0.0  # over the closed intervals

    def read(self, now: float | None = None) -> float | None:
        """The clock at ``now`` (``time.monotonic()``; seconds since the first read): the
        closed intervals' losses and the open one's so far; ``None`` where the kernel does not
        count steal time (not Linux)."""
        now = time.monotonic() if now is None else now
        ticks = _steal_ticks(self._path)
        if ticks is None:
            return None
        if self._since is None:
            self._since = now, ticks
            return self._total
        opened, before = self._since
        lost = max((ticks[cpu] - before[cpu] for cpu in ticks.keys() & before.keys()), default=0)
        lost_s = max(lost, 0) / self._ticks_per_s  # (a counter that went back: none lost)
        if now - opened < STOLEN_EVERY_S:
            return self._total + lost_s
        self._total += lost_s
        self._since = now, ticks
        return self._total


def _steal_ticks(path: str) -> dict[bytes, int] | None:
    """Each CPU's steal time in clock ticks (the eighth number of its ``cpuN`` line of
    ``/proc/stat``); ``None`` where it cannot be read."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
        return {
            fields[0]: int(fields[8])
            for fields in map(bytes.split, lines)
            if len(fields) > 8 and fields[0][:3] == b"cpu" and fields[0][3:].isdigit()
        } or None
    except (OSError, ValueError):
        return None


def read_thread_clocks(
    pid: int, tid: int, ticks_per_s: float, stolen: Stolen | None = None
) -> Sample | None:
    """CPU time and run-queue wait (seconds) of thread ``tid`` of process ``pid``, and of the
    process's other threads their run-queue wait and CPU time (summed) and whether one is
    runnable now (those alive now, less those at ``SCHED_IDLE``: an abandoned epoch's gloo
    threads, which the worker demotes and which may spin for the process's life, waiting for a
    CPU for ever; the computing thread never waits on them): from
    ``/proc/<pid>/task/*/schedstat``, else its CPU time alone from ``stat``; ``None`` when it
    cannot be read (gone, or not Linux); with the machine's steal clock ``stolen`` read too. The
    agent's one read of a worker, stamped now."""
    now = time.time()
    stolen_s = None if stolen is None else stolen.read()
    clocks = _schedstat(f"/proc/{pid}/task/{tid}/schedstat")
    if clocks is None:
        cpu_s = read_cpu_s(pid, ticks_per_s, tid)
        return None if cpu_s is None else Sample(now, cpu_s, stolen_s=stolen_s)
    state = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
    runnable = None if not state else state[0] == b"R"
    try:
        threads = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(tid)]
    except OSError:
        return Sample(now, *clocks, runnable=runnable, stolen_s=stolen_s)
    ran, waited, others_runnable = 0.0, 0.0, False
    for t in threads:
        fields = _stat_fields(f"/proc/{pid}/task/{t}/stat")
        if not fields or _policy(fields) == SCHED_IDLE:
            continue  # gone, or an abandoned epoch's demoted thread
        if (other := _schedstat(f"/proc/{pid}/task/{t}/schedstat")) is not None:
            ran, waited = ran + other[0], waited + other[1]
        others_runnable = others_runnable or fields[0] == b"R"
    return Sample(now, *clocks, waited, runnable, others_runnable, ran, stolen_s)


SCHED_IDLE = 5
"""the scheduling policy of ``os.SCHED_IDLE`` (Linux), as ``/proc/.../stat`` writes it"""


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a ``/proc/.../stat`` file from the state (field 3) on, after ``pid
    (comm)`` (a command name may hold spaces and parentheses); ``None`` where it cannot be
    read (gone, or not Linux)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()


def _policy(fields: list[bytes]) -> int | None:
    """A thread's scheduling policy (field 41 of its ``stat``, from :func:`_stat_fields`);
    ``None`` where the kernel does not write it."""
    try:
        return int(fields[38])
    except (IndexError, ValueError):
        return None


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T``
    stopped, ``Z`` zombie, ...), ``""`` when it cannot be read (gone, or not Linux). Asked by
    the agent (is a hung worker stopped?) and by the store's keeper (is the store a zombie?)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return fields[0].decode() if fields else ""


def read_cpu_s(pid: int, ticks_per_s: float, tid: int | None = None) -> float | None:
    """The CPU time (user + system) of thread ``tid`` of process ``pid`` (every thread when
    ``tid`` is None) from ``/proc``; ``None`` when it cannot be read (gone, or not Linux).
    Called by the agent for its own workers' computing threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = _stat_fields(path)
    try:
        return None if fields is None else (int(fields[11]) + int(fields[12])) / ticks_per_s
    except (IndexError, ValueError):  # utime, stime: fields 14 and 15
        return None


def thread_states(pid: int) -> list[str]:
    """One line per thread of process ``pid`` as the kernel sees it: its id, name, state
    letter (and ``SCHED_IDLE`` where it is demoted), the kernel function it sleeps in
    (``wchan``), its CPU time and its run-queue wait (``schedstat``), and the system call it
    is in (``syscall``: its number first, ``running`` when it is on a CPU). What a hung worker
    was doing where its own stack dump cannot say: a process in uninterruptible sleep (``D``),
    or one not scheduled in time, writes no stacks (found beside CPU burners: ranks killed as
    hung left empty logs). The agent appends it to the worker's log before the kill; empty
    where ``/proc`` cannot be read."""
    out: list[str] = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        stat = _stat_fields(f"{base}/stat")
        state = stat[0].decode() if stat else "?"
        if stat and _policy(stat) == SCHED_IDLE:
            state += " SCHED_IDLE"  # a left epoch's thread (the judge does not count it)
        wchan, sched, call = (_read(f"{base}/{name}") for name in ("wchan", "schedstat", "syscall"))
        out.append(f"{tid} {_read(base + '/comm')} {state} wchan={wchan or '0'} "
                   f"schedstat={sched} syscall={call}")  # fmt: skip
    return out


def _read(path: str) -> str:
    """A small ``/proc`` file's text, stripped; ``""`` where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(256).decode(errors="replace").strip()
    except OSError:
        return ""
