"""Online statistical monitoring of step times: hangs and stragglers that raise nothing.

The agent owns one :class:`StepMonitor` per task and feeds it every step report of its
workers: :meth:`StepMonitor.step_started` when a worker begins a step,
:meth:`StepMonitor.step_finished` when it ends one. It calls :meth:`StepMonitor.check` on a
timer (every 0.1-0.2 s; anything under 0.5 s keeps the detection target below) and turns
each returned :class:`Detection` into a verdict with
``unicron.detect.classify.classify_detector(d.kind)``. The clock is passed in (``now``);
nothing here
reads time, sleeps or does I/O.

Two detectors:

- **hang**: a started step that outlasts ``max(hang_factor x expected step time,
  hang_floor_s)``. The expected step time is the median of the worker's recent wall-clock
  step durations (a sliding window, so one slow step does not move it), after the first
  ``warmup_steps`` steps (imports, compilation, allocator growth), which are not learned.
  Only a worker's first step is *cold*. Before a worker has its own expectation, its peers'
  evidence counts: with the task's pace (the median of the others' expectations, or of their
  previous ones while they re-learn after a membership change) the allowance is
  ``max(hang_factor x relearn_factor x pace, hang_floor_s)``; in the task's first steps,
  before anyone has an expectation, the pooled durations of every worker's warm-up steps
  after its cold one give an *early pace*, and the allowance is ``max(hang_factor x early
  pace, hang_floor_s)``. A cold step gets ``warmup_hang_s`` when the task has no pace yet
  (its start), and ``max(hang_factor x relearn_factor x pace, rejoin_hang_s)`` when the
  worker was restarted into a running task. When the step time shifts for ``shift_steps``
  consecutive steps (by more than ``shift_ratio`` either way) the window restarts from those
  steps: the workload changed legitimately. A membership change is announced with
  :meth:`StepMonitor.reset_expectation`: the worker re-learns its step time, with a deadline
  ``relearn_factor`` times as lenient meanwhile; when the new epoch also runs another layout
  (``rebuilt``: every worker built a new shard of the model), each worker's next step is cold
  as a restarted worker's first one is; so it is when the epoch admits a worker (``joined``:
  every member's next step waits inside its collectives for the newcomer's cold first step,
  over connections the group makes to it there), though each keeps what it learned. Peers
  that already computed the same step are the best evidence of what it costs now: a lenient
  allowance (warming up, re-learning) never exceeds ``max(hang_factor x the slowest peer's
  duration of that step, hang_floor_s)``.
  A change larger than ``hang_factor`` that is *not* announced is indistinguishable from a
  hang, by design.
- **straggler**: a worker whose own compute time (excluding the wait for its peers) stays
  above ``straggler_factor`` x the median of its peers' compute times for the same step, for
  ``straggler_steps`` of its last ``straggler_steps`` + 2 steps (two calm steps of noise are
  tolerated inside a slow stretch); or sooner, when its last ``straggler_min_steps`` steps
  were each ``straggler_strong_factor`` x its peers' median or more (a worker 4x slower than
  its peers is found after 2 steps, one 2x slower after 5: a strong slowdown costs the task
  more per step, and one step alone, a GC pause, never makes a straggler), provided those
  strong steps lasted ``straggler_strong_min_s`` (0.5 s) in all: on steps of a few tens of
  milliseconds two of them are a hiccup's length (a loaded machine's healthy worker was
  once 4x its peers for two 0.14 s steps), and waiting half a second costs the task little. A
  legitimate change moves every peer together and leaves the ratio alone; a straggler
  moves alone.
  On a CPU device (``straggler_cpu_check``) a step counts toward the sooner verdict only
  when the CPU time it took the worker's computing thread (``cpu_s``, where the caller
  knows it) also exceeds ``straggler_factor`` x its peers' median: a slower core spends more
  CPU on the same work, while a thread held off the CPU, not queued for one but blocked (the
  interpreter lock another of its threads holds while that one waits for a CPU on a loaded
  machine), spends none; such steps still count toward ``straggler_steps``. On an
  accelerator the kernels run off the thread, and the clock alone decides.

Each condition is reported once: a hang once per (worker, step), a straggler once until it
has been back within the factor for ``straggler_steps`` steps.

Caller contract: report ``step_started`` at the top of the training loop (data loading
belongs to the step) and after a worker has finished joining a new epoch (building the
group, receiving state), so the step only carries training work.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Detection", "MonitorSettings", "StepMonitor"]

_MIN_SAMPLES = 3
"""post-warm-up steps a worker needs before its median counts as an expectation"""
_STRAGGLER_NOISE_STEPS = 2
"""calm steps tolerated inside a straggler's slow stretch (a loaded machine's noise): it is
``straggler_steps`` slow steps among the last ``straggler_steps`` + this many"""
_EVIDENCE_STEPS = 8
"""recent steps whose durations are kept as the peers' evidence for a late worker"""
_MAX_PENDING_STEPS = 256
"""steps kept waiting for slow reporters before they are judged with the reports at hand"""


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raise the settings' one-line ``ValueError`` unless ``lo <(=) value <= hi``."""
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:  # also catches NaN
        bracket = "(" if lo_open else "["
        raise ValueError(f"MonitorSettings.{name} must be in {bracket}{lo}, {hi}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MonitorSettings:
    """Thresholds of :class:`StepMonitor`; the defaults and their reasons are in
    ``docs/detection.md``. Built once by the agent; invalid values raise ``ValueError``."""

    warmup_steps: int = 5
    """first steps of each worker left out of the statistics while the task warms up"""
    rejoin_warmup_steps: int = 2
    """first steps of a worker (re)started into a task that is already warm (another worker
    is past its warm-up) left out of the statistics: its cold step and one more (the task's
    allocator sizes and imports are known; 5 steps would leave a slow fault on a restarted
    worker undetected for 5 steps)"""
    warmup_hang_s: float = 300.0
    """hang deadline of a cold (first) step while the task has no pace yet (its start:
    imports, compilation); ``math.inf`` disables"""
    rejoin_hang_s: float = 5.0
    """the least hang deadline of the cold first step of a worker restarted into a running
    task (a new allocator, lazy initialisation; raise it for a script that compiles on its
    first step, e.g. ``torch.compile`` for the new world size)"""
    hang_factor: float = 3.0
    """k: a step longer than k x the expected step time is a hang"""
    hang_floor_s: float = 1.0
    """a step is never a hang before this many seconds, however short steps usually are"""
    window: int = 50
    """number of recent step durations per worker whose median is the expected step time"""
    shift_ratio: float = 1.5
    """a step more than this factor above (or below) the median counts toward a level shift"""
    shift_steps: int = 5
    """this many consecutive shifted steps on the same side replace the window: re-learned"""
    relearn_factor: float = 4.0
    """after reset_expectation, deadlines are this many times more lenient until re-learned"""
    straggler_factor: float = 1.5
    """a worker whose compute time exceeds this factor x its peers' median is slow"""
    straggler_steps: int = 5
    """slow steps (among the last this many + 2) that make a straggler; consecutive calm steps
    that end one"""
    straggler_min_excess_s: float = 0.01
    """and it must exceed the peers' median by at least this much (ignores tiny steps' noise)"""
    straggler_strong_factor: float = 3.0
    """a worker this many times slower than its peers' median ..."""
    straggler_min_steps: int = 2
    """... in this many consecutive steps is a straggler without waiting for
    ``straggler_steps`` slow steps"""
    straggler_cpu_check: bool = True
    """... provided each of those steps also took more than ``straggler_factor`` x its peers'
    median CPU time, where the steps' CPU times are reported (a CPU device); ``False`` on an
    accelerator, whose kernels' time is not the computing thread's CPU time"""
    straggler_strong_min_s: float = 0.5
    """... and those steps (with any strong ones just before them) lasted this many seconds in
    all: on tiny steps two of them are a hiccup's length, not a slower worker"""

    def __post_init__(self) -> None:
        _check_range("warmup_steps", self.warmup_steps, 0, 10_000)
        _check_range("rejoin_warmup_steps", self.rejoin_warmup_steps, 0, 10_000)
        _check_range("hang_floor_s", self.hang_floor_s, 0.0, 86_400.0, lo_open=True)
        _check_range("warmup_hang_s", self.warmup_hang_s, self.hang_floor_s, math.inf)
        _check_range("rejoin_hang_s", self.rejoin_hang_s, self.hang_floor_s, self.warmup_hang_s)
        _check_range("hang_factor", self.hang_factor, 1.0, 1_000.0, lo_open=True)
        _check_range("window", self.window, _MIN_SAMPLES, 100_000)
        _check_range("shift_ratio", self.shift_ratio, 1.0, 100.0, lo_open=True)
        _check_range("shift_steps", self.shift_steps, _MIN_SAMPLES, self.window)
        _check_range("relearn_factor", self.relearn_factor, 1.0, 1_000.0)
        _check_range("straggler_factor", self.straggler_factor, 1.0, 100.0, lo_open=True)
        _check_range("straggler_steps", self.straggler_steps, 1, 10_000)
        _check_range("straggler_min_excess_s", self.straggler_min_excess_s, 0.0, 3_600.0)
        _check_range(
            "straggler_strong_factor", self.straggler_strong_factor, self.straggler_factor, 100.0
        )
        _check_range("straggler_min_steps", self.straggler_min_steps, 1, self.straggler_steps)
        _check_range("straggler_strong_min_s", self.straggler_strong_min_s, 0.0, 3_600.0)


@dataclass(frozen=True)
class Detection:
    """One detected condition: ``kind`` is ``"hang"`` or ``"straggler"`` (a detector name
    for :func:`unicron.detect.classify.classify_detector`), on ``worker`` at ``step``, detected at
    ``detected_at`` (the caller's clock), with a one-line human ``reason``."""

    kind: str
    worker: int
    step: int
    reason: str
    detected_at: float


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


@dataclass
class _Worker:
    """What the monitor knows about one worker since it was (re)started."""

    window: deque[float]
    warmup: int  # its steps left out of the statistics (fewer if it joined a warm task)
    expected: float | None = None  # the window's median once it has enough steps (cached)
    finished: int = 0
    last_step: int = -1
    step: int | None = None
    started_at: float | None = None
    hang_reported: bool = False
    previous: float | None = None  # expectation before reset_expectation, while re-learning
    rebuilt: bool = False  # its next step is the first of a model rebuilt for a new layout
    joined: int | None = None  # the membership whose first step beside a newcomer is cold
    membership: int = 0  # the membership its current step began in (StepMonitor._membership)
    early: list[float] = field(default_factory=list)  # warm-up step durations after the cold one
    shifted: list[float] = field(default_factory=list)
    shift_side: int = 0
    recent: deque[tuple[float, bool]] = field(default_factory=deque)
    """its last judged steps: (compute time / its peers' median, 0 when calm; whether the
    step's CPU time, where known, agrees it was slow)"""
    strong_s: float = 0.0
    """how long its current run of strong steps (``straggler_strong_factor`` x its peers', the
    CPU agreeing where asked) lasted, by its own step durations"""
    slow_since: int = 0
    calm_streak: int = 0
    straggling: bool = False


def _cpu_beside_peers(worker: int, cpu: dict[int, float]) -> tuple[float, float] | None:
    """``worker``'s CPU time per micro-batch of a step (``cpu``: worker -> its rate) and its
    peers' median, or ``None`` where either is unknown. On a CPU device each of the strong
    path's steps must be ``straggler_factor`` x slower here too (``straggler_cpu_check``);
    every straggler's reason gives these figures beside the clock's: a worker slow on the
    clock but not on the CPU was held off it, one slow on both computes slower."""
    own, peers = cpu.get(worker), [c for k, c in cpu.items() if k != worker]
    return None if own is None or not peers else (own, _median(peers))


def _cpu_reading(cpu_slow: bool, *, asked: bool) -> str:
    """What a straggler's CPU figures say, where the computing thread's CPU time is its
    compute (a CPU device, ``asked``); an accelerator's thread waits on its kernels, so
    there the figures are given without a reading."""
    if not asked:
        return ""
    return " (slower on the CPU too)" if cpu_slow else " (held off the CPU)"


def _beside_newcomer(w: _Worker) -> bool:
    """Whether ``w``'s step is its first begun in a membership that admitted a worker (a step
    already running when it came is judged as before)."""
    return w.joined is not None and w.step is not None and w.membership == w.joined


class StepMonitor:
    """Per-worker running step statistics of one task, fed by the agent (see module doc)."""

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self._workers: dict[int, _Worker] = {}
        self._compute: dict[int, dict[int, float]] = {}  # step -> worker -> compute rate
        self._cpu: dict[int, dict[int, float]] = {}  # step -> worker -> CPU time rate
        self._durations: dict[int, dict[int, tuple[int, float]]] = {}
        """step -> worker -> (the membership it computed the step in, its duration)"""
        self._membership = 0  # counts reset_expectation: durations of one membership compare
        self._found: list[Detection] = []
        self._paces: tuple[float | None, float | None] | None = None  # (pace, early pace)
        """cached: recomputed only after new data (a step learned, a reset, a worker
        forgotten), not on every question (``hang_deadline`` is asked on every exchange)"""

    # ---- reports (the agent, on each worker message) --------------------------------------

    def step_started(self, worker: int, step: int, now: float) -> None:
        """Worker ``worker`` began ``step`` at ``now``; its hang deadline starts running."""
        w = self._worker(worker)
        w.step, w.started_at, w.hang_reported = step, now, False
        w.membership = self._membership

    def step_finished(
        self,
        worker: int,
        step: int,
        compute_s: float,
        now: float,
        *,
        microbatches: int | None = None,
        cpu_s: float | None = None,
    ) -> None:
        """Worker ``worker`` finished ``step`` at ``now``; ``compute_s`` is its own compute time
        in that step, without waiting for peers; ``cpu_s``, where known, the CPU time the step
        took its computing thread (the evidence ``straggler_cpu_check`` asks for). When
        replicas get unequal shares of the batch (e.g. 4 micro-batches on 3 replicas), pass
        ``microbatches`` and stragglers are judged on the time per micro-batch."""
        w = self._worker(worker)
        duration = now - w.started_at if w.step == step and w.started_at is not None else None
        w.step, w.started_at, w.hang_reported = None, None, False
        w.finished += 1
        w.last_step = max(w.last_step, step)
        if w.joined == w.membership:  # its first step beside a newcomer is over
            w.joined = None
        if w.rebuilt:  # the first step of a rebuilt model: cold, learned from nothing
            w.rebuilt = False
            return
        if duration is not None and duration >= 0.0 and w.finished > 1:  # not a cold step
            self._durations.setdefault(step, {})[worker] = (w.membership, duration)
            while len(self._durations) > _EVIDENCE_STEPS:
                del self._durations[min(self._durations)]
        if w.finished <= w.warmup:
            if w.finished > 1 and duration is not None and duration >= 0.0:
                w.early.append(duration)  # not learned, but evidence of the task's early pace
                self._paces = None
            return
        if duration is not None and duration >= 0.0:
            self._learn(w, duration)
        if math.isfinite(compute_s) and compute_s >= 0.0 and microbatches != 0:
            # (a replica that computed nothing, its share reused after a transition, says
            # nothing of its speed)
            share = microbatches or 1
            self._compute.setdefault(step, {})[worker] = compute_s / share
            if cpu_s is not None and math.isfinite(cpu_s) and cpu_s >= 0.0:
                self._cpu.setdefault(step, {})[worker] = cpu_s / share
        self._judge_stragglers(now)

    def forget(self, worker: int) -> None:
        """Drop everything about ``worker`` (gone, or about to be restarted: it warms up anew)."""
        self._workers.pop(worker, None)
        self._paces = None
        for reports in (*self._compute.values(), *self._cpu.values()):
            reports.pop(worker, None)
        for durations in self._durations.values():
            durations.pop(worker, None)

    def reset_expectation(self, *, rebuilt: bool = False, joined: bool = False) -> None:
        """Membership changed (new epoch): step times may change legitimately. Each worker
        keeps its last expectation as a lenient stand-in (``relearn_factor``) and re-learns
        from its next steps; straggler streaks restart (the work split changed), except the
        steps a worker not yet reported was ``straggler_strong_factor`` times slower than its
        peers (its CPU time agreeing, where asked): that is the worker, not the split (a slow
        worker caught by a membership change would otherwise need two more slow steps after
        it). Peers' durations of a step in the old membership say nothing of it computed
        again in the new one (another split of the work): a step is judged by the durations of
        peers that computed it in the membership it began in.

        ``rebuilt``: the epoch runs another layout (a change of pipeline depth), so every
        worker's next step is the first of a model it has just built (new autograd graph,
        allocations, a move's memory to give back): a cold step, judged like a restarted
        worker's first one (``rejoin_hang_s`` at least; no peer's duration shortens it, as
        the slowest rank of a loaded machine may take seconds where its peers took a tenth),
        and learned from nothing.

        ``joined``: the epoch admits a worker that was not in the last one (restarted,
        readmitted, given by the planner). Its first step is cold, and every member's next
        step waits for it inside the step's collectives (the group's first with it, whose
        connections are made there): on a loaded machine a member idle in that wait read
        as hung and was killed, twice taking the last copy of a shard with it (the ZeRO
        e2e test, the 3D layout change). So each member's next step is judged cold too
        (``rejoin_hang_s`` at least, no peer's duration shortening it), but keeps what it
        learned: the step time has not changed."""
        strong = self.settings.straggler_strong_factor
        self._membership += 1
        for w in self._workers.values():
            w.rebuilt = rebuilt
            w.joined = self._membership if joined else None
            if w.expected is not None:
                w.previous = w.expected
            w.window.clear()
            w.expected = None
            w.shifted, w.shift_side = [], 0
            kept = [] if w.straggling else [x for x in w.recent if x[0] >= strong and x[1]]
            w.recent.clear()
            w.recent.extend(kept)
            w.strong_s = w.strong_s if kept else 0.0
            w.calm_streak, w.straggling = 0, False
        self._compute.clear()
        self._cpu.clear()
        self._paces = None

    # ---- questions (the agent, on its timer) ------------------------------------------------

    def slow_suspected(self) -> bool:
        """A worker's recent steps include a slow one, and it is not a straggler yet: its next
        reports decide (the coordinator then asks its agents for them at once)."""
        return any(
            not w.straggling and any(x > 0.0 for x, _ in w.recent) for w in self._workers.values()
        )

    def expected_step_s(self) -> float | None:
        """The task's expected step time: the median over workers of their expectations;
        ``None`` while no worker has one (warm-up)."""
        values = [e for w in self._workers.values() if (e := self._expected(w)) is not None]
        return _median(values) if values else None

    def pace_s(self) -> float | None:
        """The task's step time as far as it is known: the workers' expectations (or previous
        ones while they re-learn), else the early pace of the first steps; ``None`` before the
        task has finished a warm step."""
        pace = self._pace()
        return pace if pace is not None else self._early_pace()

    def hang_deadline(self, worker: int) -> float | None:
        """Absolute time at which ``worker``'s current step counts as hung; ``None`` if the
        worker has no step in progress (or is unknown)."""
        w = self._workers.get(worker)
        if w is None or w.started_at is None:
            return None
        return w.started_at + self._allowance(worker, w, self._pace())[0]

    def overrun(self, worker: int, now: float) -> float | None:
        """How many hang allowances ``worker``'s current step has lasted at ``now`` (1.0 at
        its deadline); ``None`` if it has no step in progress. The agent confirms a lone
        worker's hang, which no peer can vouch for, on a larger overrun."""
        w = self._workers.get(worker)
        if w is None or w.started_at is None:
            return None
        return (now - w.started_at) / self._allowance(worker, w, self._pace())[0]

    def due(self, worker: int, at: float) -> bool:
        """Whether :meth:`check` would report a hang of ``worker`` judged at ``at``: its step
        in progress is past its deadline and was not reported yet. Cheap: asked on every
        exchange of the worker's agent."""
        w = self._workers.get(worker)
        if w is None or w.started_at is None or w.step is None or w.hang_reported:
            return False
        return at >= w.started_at + self._allowance(worker, w, self._pace())[0]

    def check(self, now: float, known_until: Mapping[int, float] | None = None) -> list[Detection]:
        """New detections since the last call: hangs past their deadline at ``now`` and the
        stragglers found by the step reports. Each condition is returned once.

        ``known_until`` (worker -> time): the moment up to which that worker's reports have
        all been fed in (its agent's last read). A worker's step is judged at that moment, not
        at ``now``: a report still unread in a busy agent's socket is not a hang."""
        found, self._found = self._found, []
        pace = self._pace()
        for worker, w in sorted(self._workers.items()):
            if w.started_at is None or w.step is None or w.hang_reported:
                continue
            at = min(now, known_until.get(worker, now)) if known_until else now
            allowance, basis = self._allowance(worker, w, pace)
            if at >= w.started_at + allowance:
                w.hang_reported = True
                reason = (
                    f"worker {worker} step {w.step}: running {at - w.started_at:.2f} s "
                    f"> {allowance:.2f} s ({basis})"
                )
                found.append(Detection("hang", worker, w.step, reason, now))
        return found

    # ---- internals --------------------------------------------------------------------------

    def _worker(self, worker: int) -> _Worker:
        if worker not in self._workers:
            s = self.settings
            warm = any(w.finished > w.warmup for w in self._workers.values())
            warmup = min(s.rejoin_warmup_steps, s.warmup_steps) if warm else s.warmup_steps
            self._workers[worker] = _Worker(window=deque(maxlen=s.window), warmup=warmup)
        return self._workers[worker]

    def _expected(self, w: _Worker) -> float | None:
        return w.expected

    def _pace(self) -> float | None:
        """The task's step time as its workers know it: the median over workers of their
        expectations, or of their previous ones while they re-learn; ``None`` if nobody knows."""
        return self._cached_paces()[0]

    def _early_pace(self) -> float | None:
        """The task's pace in its first steps, before any worker has an expectation: the median
        of every worker's warm-up step durations after its cold first step."""
        return self._cached_paces()[1]

    def _cached_paces(self) -> tuple[float | None, float | None]:
        """(:meth:`_pace`, :meth:`_early_pace`), computed again only after new data."""
        if self._paces is None:
            values = [
                e for w in self._workers.values() if (e := w.expected or w.previous) is not None
            ]
            early = [d for w in self._workers.values() for d in w.early]
            self._paces = (
                _median(values) if values else None,
                _median(early) if early else None,
            )
        return self._paces

    def _allowance(self, worker: int, w: _Worker, pace: float | None) -> tuple[float, str]:
        """Seconds a step of ``w`` may take, and why (for the reason). Peers that finished the
        same step are the best evidence of what it costs in the current membership: they can
        only shorten a lenient allowance (warming up, re-learning), never a cold step's."""
        base = self._base_allowance(w, pace)
        if w.rebuilt or _beside_newcomer(w):
            return base  # a cold step: peers' evidence never shortens it
        s = self.settings
        done = self._durations.get(w.step, {}) if w.step is not None and w.finished >= 1 else {}
        peers = [d for k, (m, d) in done.items() if k != worker and m == w.membership]
        if peers:
            took = max(peers)  # the slowest peer: a loaded machine slows several at once
            evidence = max(s.hang_factor * took, s.hang_floor_s)
            if evidence < base[0]:
                return evidence, (
                    f"peers computed step {w.step} in up to {took:.3f} s: max({s.hang_factor:g} "
                    f"x that, floor {s.hang_floor_s:g} s)"
                )
        return base

    def _base_allowance(self, w: _Worker, pace: float | None) -> tuple[float, str]:
        """The allowance from ``w``'s own statistics and the task's pace (see the module
        docstring); ``pace`` is :meth:`_pace` (``w`` counts in it once it has an expectation)."""
        s = self.settings
        floor = f"floor {s.hang_floor_s:g} s"
        expected = self._expected(w)
        lenient = s.hang_factor * s.relearn_factor
        if w.rebuilt or _beside_newcomer(w):
            known = next((x for x in (expected, w.previous, pace, self._early_pace()) if x), None)
            what = "a layout change" if w.rebuilt else "a worker joined"
            if known is not None:
                return max(lenient * known, s.rejoin_hang_s), (
                    f"first step after {what}: max({lenient:g} x the step time "
                    f"{known:.3f} s, {s.rejoin_hang_s:g} s)"
                )
        if expected is not None:
            return max(s.hang_factor * expected, s.hang_floor_s), (
                f"max({s.hang_factor:g} x expected {expected:.3f} s, {floor})"
            )
        if w.previous is not None:
            return max(lenient * w.previous, s.hang_floor_s), (
                f"re-learning after a membership change: max({lenient:g} x previous "
                f"{w.previous:.3f} s, {floor})"
            )
        if pace is not None and w.finished >= 1:
            return max(lenient * pace, s.hang_floor_s), (
                f"joined a running task: max({lenient:g} x the task's pace {pace:.3f} s, {floor})"
            )
        early = self._early_pace()
        if early is not None and w.finished >= 1:
            return max(s.hang_factor * early, s.hang_floor_s), (
                f"warming up: max({s.hang_factor:g} x the task's early pace {early:.3f} s, {floor})"
            )
        known = pace if pace is not None else early
        if known is not None:  # a cold first step, of a worker restarted into a running task
            return max(lenient * known, s.rejoin_hang_s), (
                f"cold step of a worker joining a running task: max({lenient:g} x the task's "
                f"pace {known:.3f} s, {s.rejoin_hang_s:g} s)"
            )
        return s.warmup_hang_s, f"warm-up deadline {s.warmup_hang_s:g} s"

    def _learn(self, w: _Worker, duration: float) -> None:
        """Add one step duration; restart the window on a sustained level shift."""
        s = self.settings
        expected = self._expected(w)
        if expected is not None:
            side = (duration > expected * s.shift_ratio) - (duration < expected / s.shift_ratio)
            if side and side == w.shift_side:
                w.shifted.append(duration)
            else:
                w.shifted, w.shift_side = ([duration], side) if side else ([], 0)
            if len(w.shifted) >= s.shift_steps:
                w.window.clear()
                w.window.extend(w.shifted)
                w.shifted, w.shift_side = [], 0
                self._window_changed(w)
                return
        w.window.append(duration)
        if len(w.window) >= _MIN_SAMPLES:
            w.previous = None
        self._window_changed(w)

    def _window_changed(self, w: _Worker) -> None:
        """``w``'s window changed: its expectation (its median) and the task's pace are
        computed again, once, here."""
        w.expected = _median(list(w.window)) if len(w.window) >= _MIN_SAMPLES else None
        self._paces = None

    def _judge_stragglers(self, now: float) -> None:
        """Judge every step that all post-warm-up workers have finished (in step order). A
        worker whose next step is its first judged one counts as warm already, so that step
        is judged with its report, not before it."""
        warm = [w for w in self._workers.values() if w.finished >= w.warmup]
        if not warm:
            return
        done_upto = min(w.last_step for w in warm)
        for step in sorted(self._compute):
            if step > done_upto and len(self._compute) <= _MAX_PENDING_STEPS:
                break
            self._judge_step(step, self._compute.pop(step), self._cpu.pop(step, {}), now)

    def _judge_step(
        self, step: int, reports: dict[int, float], cpu: dict[int, float], now: float
    ) -> None:
        s = self.settings
        if len(reports) < 2:
            return
        for worker, rate in sorted(reports.items()):
            w = self._workers.get(worker)
            if w is None:
                continue
            peers = _median([r for k, r in reports.items() if k != worker])
            # (peers at 0.0: a clock too coarse to time their micro-batches; any rate is slower)
            ratio = rate / peers if peers > 0.0 else math.inf
            slow = ratio > s.straggler_factor and rate - peers > s.straggler_min_excess_s
            figures = _cpu_beside_peers(worker, cpu)  # (own, peers' median) CPU time
            cpu_slow = figures is not None and figures[0] > s.straggler_factor * figures[1]
            agrees = cpu_slow or figures is None or not s.straggler_cpu_check
            w.recent.append((ratio if slow else 0.0, slow and agrees))
            if slow and agrees and ratio >= s.straggler_strong_factor:
                w.strong_s += self._durations.get(step, {}).get(worker, (0, 0.0))[1]
            else:
                w.strong_s = 0.0
            while len(w.recent) > s.straggler_steps + _STRAGGLER_NOISE_STEPS:
                w.recent.popleft()
            if not slow:
                w.calm_streak += 1
                if w.straggling and w.calm_streak >= s.straggler_steps:
                    w.straggling = False
                if w.calm_streak > _STRAGGLER_NOISE_STEPS:
                    w.recent.clear()  # a calm stretch, not noise inside a slow one
                continue
            slow_steps = sum(1 for x, _ in w.recent if x > 0.0)
            if slow_steps == 1:
                w.slow_since = step
            w.calm_streak = 0
            last = list(w.recent)[-s.straggler_min_steps :]
            strong = (
                len(last) == s.straggler_min_steps
                and all(x >= s.straggler_strong_factor and ok for x, ok in last)
                and w.strong_s >= s.straggler_strong_min_s
            )
            if (slow_steps >= s.straggler_steps or strong) and not w.straggling:
                w.straggling = True
                reason = (
                    f"worker {worker}: compute {rate:.3f} s per micro-batch > "
                    f"{s.straggler_factor:g} x peers' median {peers:.3f} s in {slow_steps} of "
                    f"the last {len(w.recent)} steps ({w.slow_since}-{step})"
                )
                if figures is not None:  # the evidence beside the clock's, asked for or not
                    reason += (
                        f"; CPU time {figures[0]:.3f} s, peers' median {figures[1]:.3f} s"
                        + _cpu_reading(cpu_slow, asked=s.straggler_cpu_check)
                    )
                self._found.append(Detection("straggler", worker, step, reason, now))
