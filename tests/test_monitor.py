"""The statistical step monitor, driven with a simulated clock and seeded jitter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from unicron.detect.monitor import Detection, MonitorSettings, StepMonitor

WORKERS = 4


class Run:
    """A synchronous data-parallel run: every worker computes, then all wait for the slowest."""

    def __init__(self, monitor: StepMonitor, seed: int = 0) -> None:
        self.m, self.rng, self.t, self.step = monitor, np.random.default_rng(seed), 0.0, 0
        self.found: list[Detection] = []

    def steps(
        self,
        n: int,
        base_s: float = 0.02,
        slow: dict[int, float] | None = None,
        workers: int = WORKERS,
        sigma: float = 0.1,
        spike_p: float = 0.01,
        polls: int = 3,
        cpu: dict[int, float] | None = None,
    ) -> None:
        """``cpu``: report each step's CPU time too, the compute's less the ``slow`` factor,
        times this one (1: a slow worker held off the CPU, its slow factor: computing
        slower); ``None``: no CPU times."""
        for _ in range(n):
            compute = base_s * self.rng.lognormal(0.0, sigma, workers)
            compute *= np.where(self.rng.random(workers) < spike_p, 2.0, 1.0)
            cpu_s = compute.copy()
            for w, f in (slow or {}).items():
                compute[w] *= f
            for w, f in (cpu or {}).items():
                cpu_s[w] *= f
            wall = float(compute.max()) + base_s * 0.2 * self.rng.random()
            for w in range(workers):
                self.m.step_started(w, self.step, self.t + 0.0005 * self.rng.random())
            for k in range(1, polls + 1):  # the agent's timer, the last poll just before the end
                self.found += self.m.check(self.t + wall * k / polls - 1e-9)
            self.t += wall
            for w in range(workers):
                own_cpu = None if cpu is None else float(cpu_s[w])
                self.m.step_finished(w, self.step, float(compute[w]), self.t, cpu_s=own_cpu)
            self.found += self.m.check(self.t)
            self.step += 1


def test_warmup_is_ignored() -> None:
    m = StepMonitor(MonitorSettings(warmup_steps=3))
    run = Run(m)
    run.steps(3, base_s=5.0, sigma=0.0, spike_p=0.0)  # slow first steps: imports, compile
    assert m.expected_step_s() is None
    run.steps(2, base_s=0.1, sigma=0.0, spike_p=0.0)
    assert m.expected_step_s() is None  # not enough samples yet
    run.steps(1, base_s=0.1, sigma=0.0, spike_p=0.0)
    expected = m.expected_step_s()
    assert expected is not None and 0.1 <= expected < 0.13
    assert run.found == []


def test_warmup_deadline_applies_before_an_expectation() -> None:
    m = StepMonitor(MonitorSettings(warmup_hang_s=60.0))
    m.step_started(0, 0, now=10.0)
    assert m.hang_deadline(0) == 70.0
    assert m.check(69.9) == []
    [d] = m.check(70.0)
    assert (d.kind, d.worker, d.step) == ("hang", 0, 0)


@pytest.mark.parametrize("base_s", [0.02, 0.5, 2.0])
def test_hang_detected_at_max_k_expected_floor(base_s: float) -> None:
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=1)
    run.steps(40, base_s=base_s)
    expected = m.expected_step_s()
    assert expected is not None
    m.step_started(2, run.step, run.t)  # worker 2 starts and never finishes
    deadline = m.hang_deadline(2)
    assert deadline is not None
    limit = max(s.hang_factor * expected, s.hang_floor_s)
    assert deadline == pytest.approx(run.t + limit)
    poll, now = 0.1, run.t
    found: list[Detection] = []
    while not found:
        now += poll
        found = m.check(now)
    [d] = found
    assert (d.kind, d.worker, d.step, d.detected_at) == ("hang", 2, run.step, now)
    # the target: under max(3 x median, 1 s) + 0.5 s, and never before the deadline
    assert limit <= now - run.t < limit + 0.5
    assert "expected" in d.reason
    assert m.check(now + 100.0) == []  # reported once


@pytest.mark.parametrize(("steps", "base_s"), [(30_000, 0.02), (10_000, 0.5)])
def test_no_false_alarm_in_a_long_fault_free_run(steps: int, base_s: float) -> None:
    """Over 10 minutes of steps with lognormal jitter and 1% 2x spikes, polled just before each
    step ends. With 0.5 s steps the floor does not help: k x median alone must hold (k = 2.5
    raises 16 false hangs on this seed with 20 ms steps and no floor; k = 3 none)."""
    m = StepMonitor(MonitorSettings())
    run = Run(m, seed=7)
    run.steps(steps, base_s=base_s, sigma=0.15, polls=1)
    assert run.t > 600.0
    assert run.found == []


def test_adapts_when_all_workers_slow_down_together() -> None:
    m = StepMonitor(MonitorSettings())
    run = Run(m, seed=3)
    run.steps(60, base_s=0.5)
    before = m.expected_step_s()
    run.steps(60, base_s=1.0)  # all workers 2x: a legitimate change, not a straggler
    after = m.expected_step_s()
    assert before is not None and after is not None
    assert after == pytest.approx(2 * before, rel=0.2)
    assert run.found == []


def test_level_shift_relearns_quickly() -> None:
    s = MonitorSettings(window=200)
    m = StepMonitor(s)
    run = Run(m, seed=4)
    run.steps(200, base_s=0.5, spike_p=0.0)
    run.steps(s.shift_steps, base_s=1.25, spike_p=0.0)  # a plain median would take 100 steps
    expected = m.expected_step_s()
    assert expected is not None and expected > 1.2


def test_reset_expectation_relearns_with_a_lenient_deadline() -> None:
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=5)
    run.steps(30, base_s=0.5)
    before = m.expected_step_s()
    assert before is not None
    m.reset_expectation()  # the world shrank from 4 workers to 1: 4x the work each
    m.step_started(0, run.step, run.t)
    deadline = m.hang_deadline(0)
    assert deadline == pytest.approx(run.t + s.hang_factor * s.relearn_factor * before, rel=0.05)
    run.steps(10, base_s=2.0, workers=1, spike_p=0.0)
    after = m.expected_step_s()
    assert after is not None and after > 1.9
    assert run.found == []


def test_a_straggler_is_reported_once() -> None:
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=6)
    run.steps(20, base_s=0.05)
    start = run.step
    run.steps(50, base_s=0.05, slow={3: 2.0})
    stragglers = [d for d in run.found if d.kind == "straggler"]
    assert [(d.worker, d.step) for d in stragglers] == [(3, start + s.straggler_steps - 1)]
    assert "peers' median" in stragglers[0].reason
    assert not [d for d in run.found if d.kind == "hang"]
    # it recovers, then straggles again: a new condition, reported again
    run.steps(20, base_s=0.05)
    run.steps(10, base_s=0.05, slow={3: 2.0})
    assert len([d for d in run.found if d.kind == "straggler"]) == 2


def test_peers_too_fast_for_the_clock_do_not_break_the_straggler_verdict() -> None:
    """A clock too coarse to time the peers' micro-batches reads them as 0.0 s: a worker
    slower than that by more than the minimal excess is slow beside them (no division by
    zero), and workers all at 0.0 are not."""

    def run(slow_s: float) -> list[Detection]:
        m, found = StepMonitor(MonitorSettings()), []
        for step in range(30):
            for w in range(3):
                m.step_started(w, step, float(step))
            for w in range(3):
                m.step_finished(w, step, slow_s if w == 2 else 0.0, step + 0.9)
            found += m.check(step + 0.95)
        return found

    assert [(d.kind, d.worker) for d in run(0.5)] == [("straggler", 2)]
    assert run(0.0) == []


def test_a_noisy_straggler_is_still_found() -> None:
    """On a loaded machine a straggler's ratio dips under the factor now and then: two calm
    steps inside its slow stretch do not reset the count (it used to need 5 in a row)."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=6)
    run.steps(20, base_s=0.05)
    for _ in range(4):
        run.steps(2, base_s=0.05, slow={3: 2.0})
        run.steps(1, base_s=0.05)  # noise: one step within the factor
    assert [d.worker for d in run.found if d.kind == "straggler"] == [3]


def test_short_slowness_is_not_a_straggler() -> None:
    """A mild slowdown needs ``straggler_steps`` slow steps; a strong one a single step alone
    never makes a straggler (a GC pause, a page-cache miss)."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=8)
    run.steps(20)
    run.steps(s.straggler_steps - 1, slow={1: 1.6})
    run.steps(20)
    run.steps(1, slow={2: 20.0})
    run.steps(20)
    assert run.found == []


def test_a_worker_restarted_into_a_warm_task_is_judged_after_two_steps() -> None:
    """Found by the fault soak: a slow fault on a just-restarted worker went unnoticed through
    its five warm-up steps (1.5 s against the 1.5 s goal). In a warm task only its cold step
    and one more are left out."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=9)
    run.steps(20, base_s=0.1, spike_p=0.0)
    m.forget(3)  # restarted
    start = run.step
    run.steps(6, base_s=0.1, spike_p=0.0, slow={3: 4.0})
    stragglers = [(d.worker, d.step) for d in run.found if d.kind == "straggler"]
    assert stragglers == [(3, start + s.rejoin_warmup_steps + s.straggler_min_steps - 1)]
    # a task's own start keeps the long warm-up: every worker is new
    m = StepMonitor(s)
    run = Run(m, seed=9)
    run.steps(s.warmup_steps, base_s=0.1, spike_p=0.0, slow={3: 4.0})
    assert run.found == []


def test_a_strong_straggler_is_found_across_a_membership_change() -> None:
    """Found by the fault soak: a worker 4x slower for one step, then a new epoch (a slot
    readmitted) restarted its count, and its share of the transition step was reused (it
    computed nothing, which read as a calm step): found two steps late."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=9)
    run.steps(20, base_s=0.1, spike_p=0.0)
    run.steps(1, base_s=0.1, spike_p=0.0, slow={3: 4.0})
    m.reset_expectation()  # a new epoch
    step, t = run.step, run.t
    for w in range(WORKERS):  # the transition step: worker 3's micro-batches were reused
        m.step_started(w, step, t)
        m.step_finished(w, step, 0.0 if w == 3 else 0.2, t + 0.2, microbatches=0 if w == 3 else 2)
    run.step, run.t = step + 1, t + 0.2
    assert run.found + m.check(run.t) == []
    run.steps(1, base_s=0.1, spike_p=0.0, slow={3: 4.0})
    assert [(d.worker, d.step) for d in run.found if d.kind == "straggler"] == [(3, step + 1)]


@pytest.mark.parametrize(("factor", "steps"), [(4.0, 2), (3.3, 2), (2.0, 5), (1.8, 5)])
def test_a_stronger_slowdown_is_found_in_fewer_steps(factor: float, steps: int) -> None:
    """``straggler_min_steps`` steps at ``straggler_strong_factor`` x the peers' median are
    enough; a milder slowdown needs ``straggler_steps`` slow steps."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m, seed=9)
    run.steps(20, base_s=0.1, spike_p=0.0)
    start = run.step
    run.steps(10, base_s=0.1, slow={3: factor}, spike_p=0.0)
    stragglers = [(d.worker, d.step) for d in run.found if d.kind == "straggler"]
    assert stragglers == [(3, start + steps - 1)]


@pytest.mark.parametrize(
    ("cpu_factor", "check", "steps"), [(4.0, True, 2), (1.0, True, 5), (1.0, False, 2)]
)
def test_the_sooner_verdict_asks_the_cpu_time_to_agree(
    cpu_factor: float, check: bool, steps: int
) -> None:
    """A worker 4x slower on the clock is found after 2 steps when its CPU time agrees (a
    slower core); held off the CPU (its CPU time like its peers': blocked on the lock a
    sibling thread holds), after the 5 of the mild path. An accelerator's monitor does not
    ask (``straggler_cpu_check=False``): the clock decides."""
    m = StepMonitor(MonitorSettings(straggler_cpu_check=check))
    run = Run(m, seed=9)
    run.steps(20, base_s=0.1, spike_p=0.0, cpu={})
    start = run.step
    run.steps(10, base_s=0.1, slow={3: 4.0}, spike_p=0.0, cpu={3: cpu_factor})
    stragglers = [(d.worker, d.step) for d in run.found if d.kind == "straggler"]
    assert stragglers == [(3, start + steps - 1)]
    # the reason gives the verdict step's CPU figures, whether the monitor asked them or not
    (found,) = [d for d in run.found if d.kind == "straggler"]
    reading = "slower on the CPU too" if cpu_factor > 1.5 else "held off the CPU"
    assert "; CPU time " in found.reason
    assert (f"({reading})" in found.reason) == check  # an accelerator's CPU time is no reading


def test_two_strong_steps_shorter_than_the_floor_are_a_hiccup() -> None:
    """The loaded runs' false positive of stop 74: a healthy worker 4x its peers on the clock,
    2.3x on the CPU, for two steps of 0.14 s. Strong steps lasting less than
    ``straggler_strong_min_s`` in all are no sooner verdict, however strong; steps enough
    (or the floor off) are."""
    s = MonitorSettings()
    for floor, found in ((s.straggler_strong_min_s, []), (0.0, [(3, 21)])):
        m = StepMonitor(MonitorSettings(straggler_strong_min_s=floor))
        run = Run(m, seed=9)
        run.steps(20, base_s=0.03, spike_p=0.0, cpu={})
        run.steps(2, base_s=0.03, spike_p=0.0, slow={3: 4.0}, cpu={3: 4.0})
        run.steps(10, base_s=0.03, spike_p=0.0, cpu={})
        assert [(d.worker, d.step) for d in run.found if d.kind == "straggler"] == found
    # a slower worker on the same tiny steps: found once its strong steps add up to the floor
    m = StepMonitor(s)
    run = Run(m, seed=9)
    run.steps(20, base_s=0.03, spike_p=0.0, cpu={})
    run.steps(10, base_s=0.03, spike_p=0.0, slow={3: 4.0}, cpu={3: 4.0})
    (found,) = [d for d in run.found if d.kind == "straggler"]
    assert found.worker == 3 and 22 <= found.step <= 25  # 4-5 steps of about 0.12 s


def test_without_the_peers_cpu_times_the_clock_decides() -> None:
    """Only the slow worker's CPU time known (its peers' reports carry none): no evidence
    either way, so the two-step verdict stands on the clock."""
    m = StepMonitor(MonitorSettings())
    for step in range(12):
        for w in range(3):
            m.step_started(w, step, float(step))
        for w in range(3):
            slow = w == 2 and step >= 8
            compute = 0.4 if slow else 0.1
            m.step_finished(w, step, compute, step + 0.5, cpu_s=0.1 if w == 2 else None)
    found = [d for d in m.check(12.0) if d.kind == "straggler"]
    assert [(d.worker, d.step) for d in found] == [(2, 9)]
    assert "CPU time" not in found[0].reason  # nothing to tell of it


def test_unequal_shares_are_judged_per_microbatch() -> None:
    m = StepMonitor(MonitorSettings(warmup_steps=0))
    for step in range(20):  # 4 micro-batches on 3 replicas: worker 0 does 2
        for w in range(3):
            m.step_started(w, step, float(step))
        for w, mbs in enumerate((2, 1, 1)):
            m.step_finished(w, step, 0.1 * mbs, step + 0.5, microbatches=mbs)
    assert m.check(20.0) == []


def test_forget_drops_a_worker_and_it_warms_up_again() -> None:
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.1)
    m.step_started(1, run.step, run.t)
    m.forget(1)
    assert m.hang_deadline(1) is None
    assert m.check(run.t + 100.0) == []  # nothing about the forgotten worker


def _restart(m: StepMonitor, run: Run, worker: int, compute_s: float = 0.1) -> None:
    """What the agent does when ``worker`` is restarted into the running task: forget it, then
    the new epoch's ``reset_expectation``, then the new process's first (cold) step."""
    m.forget(worker)
    pace = m._pace()
    m.reset_expectation()
    assert m.hang_deadline(worker) is None
    m.step_started(worker, run.step, run.t)
    s = m.settings
    if pace is not None:  # the cold step of a restart: lenient, but not the start's 300 s
        cold = max(s.hang_factor * s.relearn_factor * pace, s.rejoin_hang_s)
        assert m.hang_deadline(worker) == pytest.approx(run.t + cold)
    run.t += 2.0  # slow, as a fresh process's first step is
    m.step_finished(worker, run.step, compute_s, run.t)
    assert m.check(run.t) == []


def test_a_restarted_worker_gets_the_tasks_pace_after_its_cold_first_step() -> None:
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.1)
    _restart(m, run, 1)
    # its peers re-learn too (their windows emptied), but their previous pace stands in
    m.step_started(1, run.step + 1, run.t)
    pace = m._pace()
    assert pace is not None and pace < 0.2
    limit = max(s.hang_factor * s.relearn_factor * pace, s.hang_floor_s)
    assert m.hang_deadline(1) == pytest.approx(run.t + limit)  # seconds, not the old 30 s
    assert m.check(run.t + limit - 0.01) == []
    (found,) = m.check(run.t + limit)
    assert (found.kind, found.worker) == ("hang", 1) and "joined a running task" in found.reason


def test_a_restarted_workers_cold_step_gets_the_rejoin_deadline() -> None:
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.1)
    m.forget(2)
    m.reset_expectation()
    m.step_started(2, run.step, run.t)
    assert m.hang_deadline(2) == run.t + s.rejoin_hang_s
    (found,) = m.check(run.t + s.rejoin_hang_s)
    assert found.worker == 2 and "cold step" in found.reason


def test_a_rejoining_worker_with_slow_peers_gets_their_pace_times_the_leniency() -> None:
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=4.0, sigma=0.0, spike_p=0.0)  # 4 s steps: 12 x 4.8 s > the floor
    m.forget(3)
    pace = m.expected_step_s()  # the other three's
    assert pace is not None
    _restart(m, run, 3, compute_s=4.0)
    m.step_started(3, run.step + 1, run.t)
    limit = s.hang_factor * s.relearn_factor * pace
    assert limit > s.rejoin_hang_s and m.hang_deadline(3) == pytest.approx(run.t + limit)


def test_a_hang_in_the_first_steps_is_found_from_the_early_pace() -> None:
    """Only the very first (cold) step has the long warm-up deadline: from the second step on,
    every worker's warm-up steps give the task's early pace (issue: a hang at step 5 of 4
    workers took the whole 300 s warm-up deadline)."""
    s = MonitorSettings(warmup_steps=5)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(1, base_s=3.0, sigma=0.0, spike_p=0.0)  # the cold step: imports, allocator
    run.steps(2, base_s=0.1)
    assert m.expected_step_s() is None  # nobody has an expectation yet
    m.step_started(0, run.step, run.t)
    assert m.hang_deadline(0) == run.t + s.hang_floor_s  # 3 x ~0.1 s is under the floor
    (found,) = m.check(run.t + s.hang_floor_s)
    assert found.worker == 0 and "early pace" in found.reason


def test_peers_that_finished_the_step_tighten_a_relearning_allowance() -> None:
    """After a membership change every worker re-learns with a 12x allowance; a worker late on
    a step its peers already computed is judged by their durations of that step instead."""
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.5, sigma=0.0, spike_p=0.0)
    m.reset_expectation()
    for w in range(WORKERS):
        m.step_started(w, run.step, run.t)
    lenient = m.hang_deadline(3)
    assert lenient is not None and lenient - run.t > s.hang_factor * s.relearn_factor * 0.5
    for w in range(3):
        m.step_finished(w, run.step, 0.6, run.t + 0.6)  # the new membership: 0.6 s steps
    assert m.hang_deadline(3) == pytest.approx(run.t + s.hang_factor * 0.6)
    (found,) = m.check(run.t + s.hang_factor * 0.6)
    assert found.worker == 3 and "peers computed step" in found.reason


def test_the_first_step_after_a_layout_change_is_cold_whatever_its_peers_took() -> None:
    """A layout change (another pipeline depth): every worker built a new shard. On a loaded
    machine one rank's first step took 3.6 s where its peers took 0.13 s, and their evidence
    (3 x 0.13 s, floor 1 s) called it hung: that step is cold, as a restarted worker's is."""
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.13, sigma=0.0, spike_p=0.0)
    m.reset_expectation(rebuilt=True)
    for w in range(WORKERS):
        m.step_started(w, run.step, run.t)
    for w in range(3):
        m.step_finished(w, run.step, 0.13, run.t + 0.13)
    assert s.hang_factor * s.relearn_factor * 0.2 < s.rejoin_hang_s  # steps of ~0.15 s
    assert m.hang_deadline(3) == pytest.approx(run.t + s.rejoin_hang_s)
    assert m.check(run.t + 3.6) == []
    m.step_finished(3, run.step, 3.6, run.t + 3.6)
    run.t += 3.6
    run.step += 1
    # the next step is warm again: peers' durations of it judge a late worker, and the cold
    # step taught nobody anything (the lenient re-learning allowance stands)
    for w in range(WORKERS):
        m.step_started(w, run.step, run.t)
    relearning = m.hang_deadline(3)
    assert relearning is not None and 1.5 < relearning - run.t < s.rejoin_hang_s
    for w in range(3):
        m.step_finished(w, run.step, 0.13, run.t + 0.13)
    (found,) = m.check(run.t + s.hang_floor_s)
    assert found.worker == 3 and "peers computed step" in found.reason


def test_the_first_step_beside_a_newcomer_is_cold_for_every_member() -> None:
    """A restarted worker joins at step 4, while the task still warms up: every member's first
    step of that epoch waits inside its collectives for the newcomer's cold first step. Two
    members idle there for 1 s were killed as hung by the warm-up allowance (max(3 x 0.084 s,
    floor 1 s)), taking the last copies of a ZeRO shard with them (a loaded run of
    test_zero_e2e; the 3D layout change's test before it). That step is cold for every member,
    whatever its peers took; a step already running when the newcomer came, and the step
    after, are judged as before."""
    s = MonitorSettings()
    m = StepMonitor(s)
    run = Run(m)
    run.steps(3, base_s=0.084, sigma=0.0, spike_p=0.0)
    warm = s.hang_floor_s  # 3 x the early pace is under the floor

    def deadline(worker: int) -> float:
        at = m.hang_deadline(worker)
        assert at is not None
        return at - run.t

    for w in range(WORKERS):
        m.step_started(w, run.step, run.t)
    m.reset_expectation(joined=True)  # while the step runs: not its newcomer
    assert deadline(0) == pytest.approx(warm)
    for w in range(WORKERS):
        m.step_finished(w, run.step, 0.084, run.t + 0.084)
    run.t, run.step = run.t + 0.084, run.step + 1
    for w in range(WORKERS):  # the first step begun beside the newcomer
        m.step_started(w, run.step, run.t)
    m.step_finished(3, run.step, 0.084, run.t + 0.084)  # a peer done: no evidence for this one
    assert deadline(0) == pytest.approx(s.rejoin_hang_s)
    assert m.check(run.t + 1.0) == []
    for w in range(3):
        m.step_finished(w, run.step, 1.5, run.t + 1.5)
    run.t, run.step = run.t + 1.5, run.step + 1
    for w in range(WORKERS):  # warm again
        m.step_started(w, run.step, run.t)
    assert deadline(0) < s.rejoin_hang_s


def test_peers_durations_from_the_old_membership_are_no_evidence() -> None:
    """A step interrupted by a failure is computed again in the new epoch, on another split
    of the work: how long the peers took for it before says nothing of it now."""
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.5, sigma=0.0, spike_p=0.0)
    for w in range(WORKERS):
        m.step_started(w, run.step, run.t)
    for w in range(3):  # three computed the step, then worker 3 failed
        m.step_finished(w, run.step, 0.5, run.t + 0.5)
    m.forget(3)
    m.reset_expectation()
    for w in range(3):  # the step again, on three workers: 4/3 of the work each
        m.step_started(w, run.step, run.t + 1.0)
    # nobody computed it in the new epoch yet: the re-learning allowance, not 3 x 0.5 s
    relearning = m.hang_deadline(0)
    assert relearning is not None and relearning - (run.t + 1.0) > s.hang_factor * 0.5 * 2
    assert m.check(run.t + 1.0 + s.hang_factor * 0.5 + 0.1) == []
    m.step_finished(1, run.step, 0.67, run.t + 1.67)
    m.step_finished(2, run.step, 0.67, run.t + 1.67)
    # then the new epoch's own evidence judges the late one: 3 x 0.67 s
    assert m.hang_deadline(0) == pytest.approx(run.t + 1.0 + s.hang_factor * 0.67)


def test_without_warm_peers_the_warmup_deadline_stands() -> None:
    s = MonitorSettings(warmup_steps=5)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(1)  # only the cold step: nobody knows the pace
    m.step_started(2, run.step, run.t)
    assert m.hang_deadline(2) == run.t + s.warmup_hang_s
    _restart(m, run, 2)
    m.step_started(2, run.step + 1, run.t)
    assert m.hang_deadline(2) == run.t + s.warmup_hang_s


def test_overrun_counts_allowances() -> None:
    s = MonitorSettings(warmup_steps=2)
    m = StepMonitor(s)
    run = Run(m)
    run.steps(20, base_s=0.1)
    assert m.overrun(0, run.t) is None  # no step in progress
    m.step_started(0, run.step, run.t)
    allowance = s.hang_floor_s  # 3 x ~0.1 s is under the floor
    assert m.overrun(0, run.t + allowance) == pytest.approx(1.0)
    assert m.overrun(0, run.t + 2 * allowance) == pytest.approx(2.0)


def test_finish_without_start_is_tolerated() -> None:
    m = StepMonitor(MonitorSettings(warmup_steps=0))
    m.step_finished(0, 5, 0.1, 1.0)
    m.step_finished(0, 6, float("nan"), 2.0)
    assert m.hang_deadline(0) is None
    assert m.check(3.0) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("warmup_steps", -1),
        ("hang_factor", 1.0),
        ("hang_factor", math.nan),
        ("hang_floor_s", 0.0),
        ("warmup_hang_s", 0.5),  # below the floor
        ("rejoin_hang_s", 0.5),  # below the floor
        ("rejoin_hang_s", 301.0),  # above the warm-up deadline
        ("window", 2),
        ("shift_ratio", 1.0),
        ("shift_steps", 51),  # above the window
        ("relearn_factor", 0.5),
        ("straggler_factor", 0.9),
        ("straggler_steps", 0),
        ("straggler_min_excess_s", -0.1),
    ],
)
def test_settings_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^MonitorSettings\.{field} must be in [\[(].*got"):
        MonitorSettings(**{field: value})  # type: ignore[arg-type]


def test_default_settings_are_valid() -> None:
    s = MonitorSettings()
    assert (s.hang_factor, s.hang_floor_s, s.straggler_factor, s.straggler_steps) == (
        3.0,
        1.0,
        1.5,
        5,
    )


def test_the_pace_follows_new_steps_and_due_agrees_with_check() -> None:
    """The medians are cached (asked on every exchange), so they must follow new data: a level
    shift moves the task's pace; :meth:`StepMonitor.due` says what :meth:`check` would find."""
    m = StepMonitor(MonitorSettings(warmup_steps=1))
    run = Run(m)
    run.steps(10, base_s=0.1, sigma=0.0, spike_p=0.0)
    pace = m.pace_s()
    assert pace is not None and 0.1 <= pace < 0.13
    run.steps(10, base_s=0.4, sigma=0.0, spike_p=0.0)  # a sustained shift: re-learned
    pace = m.pace_s()
    assert pace is not None and 0.4 <= pace < 0.5
    m.step_started(0, run.step, run.t)
    deadline = m.hang_deadline(0)
    assert deadline is not None and not m.due(0, deadline - 0.01) and m.due(0, deadline)
    assert m.check(deadline - 0.01) == [] and len(m.check(deadline)) == 1
    assert not m.due(0, deadline + 1.0)  # reported once
