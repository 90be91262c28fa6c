"""Starved or hung (``unicron.detect.busy``): a late worker whose CPU time advances, and has
not spent much more than a step costs, is WORKING (left to finish); one whose CPU time stands
still is IDLE, one that spins past the budget SPINNING (hangs). Without fresh samples it is
UNKNOWN: the wall clock decides."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unicron.detect.busy import (
    Cpu,
    CpuTimes,
    Sample,
    Stolen,
    judge,
    own_compute_s,
    read_cpu_s,
    read_queued_s,
    read_thread_clocks,
    waiting,
)

T0 = 1000.0


def _samples(
    rate: float, *, start: float = T0 + 0.5, n: int = 6, cpu0: float = 1.0
) -> list[Sample]:
    """Readings every 0.2 s of a process using ``rate`` of a core."""
    return [Sample(start + 0.2 * i, cpu0 + rate * 0.2 * i) for i in range(n)]


def test_a_starved_worker_is_still_working() -> None:
    cpu, why = judge(
        began=Sample(T0, 1.0),
        samples=_samples(0.1),
        typical_cpu_s=0.3,
        factor=3.0,
        now=T0 + 1.6,
    )
    assert cpu is Cpu.WORKING and "starved" in why


def test_a_worker_runnable_but_never_scheduled_is_starved_not_hung() -> None:
    """On an oversubscribed machine a worker can get under 2 % of a core for half a second:
    its CPU time stands still as a hung one's does, but it waits in the run queue."""
    waiting = [Sample(s.ts, 1.0, 5.0 + 0.9 * (s.ts - T0)) for s in _samples(0.0)]
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=waiting, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.WORKING and "waiting for a CPU" in why
    asleep = [Sample(s.ts, 1.0, 5.0) for s in _samples(0.0)]  # blocked: not in the queue
    cpu, _ = judge(
        began=Sample(T0, 1.0), samples=asleep, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.IDLE


def test_a_worker_in_the_run_queue_through_the_whole_span_is_starved_not_hung() -> None:
    """The kernel adds a thread's run-queue wait to its count when the wait ends: one that
    waits for a CPU through the whole span shows neither CPU time nor wait, as a hung one
    does; its state says it (``R``, runnable). Found by a loaded run: a worker killed as hung
    in its forward pass, the kernel's view at the kill ``R``, 4 s of run-queue wait."""
    queued = [Sample(s.ts, 1.0, 5.0, 2.0, runnable=True) for s in _samples(0.0)]
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=queued, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.WORKING and "runnable but not run" in why
    blocked = [Sample(s.ts, 1.0, 5.0, 2.0, runnable=False) for s in _samples(0.0)]
    cpu, _ = judge(
        began=Sample(T0, 1.0), samples=blocked, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.IDLE


def test_read_thread_clocks_says_whether_the_thread_is_runnable() -> None:
    import threading

    tid: list[int] = []
    stop = threading.Event()

    def sleeper() -> None:
        tid.append(threading.get_native_id())
        stop.wait(5.0)

    other = threading.Thread(target=sleeper)
    other.start()
    try:
        while not tid:
            time.sleep(0.01)
        time.sleep(0.05)
        asleep = read_thread_clocks(os.getpid(), tid[0], 100.0)
        running = read_thread_clocks(os.getpid(), threading.get_native_id(), 100.0)
    finally:
        stop.set()
        other.join()
    assert asleep is not None and asleep.runnable is False
    assert running is not None and running.runnable is True


def test_a_worker_waiting_on_its_own_starved_thread_is_left_to_the_wall_clock() -> None:
    """Its computing thread stood still and is not in the run queue, but another thread of
    its process waited for a CPU meanwhile: it may wait on that thread (seen beside CPU
    burners: the main thread in ``Thread.start`` for a second, the new thread not yet run),
    so its stillness is no evidence of a hang: UNKNOWN (the wall clock's larger overrun
    decides). Other threads that waited for nothing leave it IDLE."""
    others = [Sample(s.ts, 1.0, 5.0, 2.0 + 0.5 * (s.ts - T0)) for s in _samples(0.0)]
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=others, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.UNKNOWN and "other threads waited for a CPU" in why
    quiet = [Sample(s.ts, 1.0, 5.0, 2.0) for s in _samples(0.0)]
    cpu, _ = judge(
        began=Sample(T0, 1.0), samples=quiet, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.IDLE


def test_a_worker_whose_other_thread_waits_in_the_run_queue_is_left_to_the_wall_clock() -> None:
    """The kernel adds a wait to a thread's count only when the wait ends: another thread in
    the run queue through the whole span shows no wait, and the computing thread may wait on
    it. Found by a loaded run: a restarted ZeRO worker killed at its 5 s cold allowance, its
    new gloo threads runnable for seconds and one never yet run, none of their wait counted
    at the verdict. Runnable while the other threads got no CPU: in the queue. A runnable
    thread that runs (one that holds the GIL for ever), or none runnable, leaves it IDLE."""

    def judged(others_runnable: bool, others_rate: float) -> tuple[Cpu, str]:
        samples = [
            Sample(s.ts, 1.0, 5.0, 2.0, runnable=False, others_runnable=others_runnable,
                   others_cpu_s=3.0 + others_rate * (s.ts - T0))
            for s in _samples(0.0)
        ]  # fmt: skip
        return judge(
            began=Sample(T0, 1.0), samples=samples, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
        )

    cpu, why = judged(True, 0.0)
    assert cpu is Cpu.UNKNOWN and "another of its threads is runnable" in why
    assert judged(True, 0.5)[0] is Cpu.IDLE  # it runs: no evidence of waiting
    assert judged(False, 0.0)[0] is Cpu.IDLE


def _stolen(stolen: list[float]) -> list[Sample]:
    """Readings every 0.2 s of a thread whose CPU time stands still while the hypervisor
    steals ``stolen[i]`` seconds in all by reading i (nothing queued: as a hang reads)."""
    return [
        Sample(s.ts, 1.0, 5.0, 2.0, runnable=False, others_runnable=False, others_cpu_s=3.0,
               stolen_s=lost)
        for s, lost in zip(_samples(0.0, n=len(stolen)), stolen, strict=True)
    ]  # fmt: skip


def test_a_worker_still_while_the_hypervisor_held_the_cpus_off_is_not_judged_on_that_time() -> None:
    """A thread on a CPU that the hypervisor holds off (steal time) shows neither CPU time nor
    a wait, and so does every thread waiting on it: found beside CPU burners on this VM, an
    FSDP replica's two ranks judged hung together in an all-gather with nothing injected. The
    judge compares readings :data:`MIN_GAP_S` apart in the machine's own time: with 0.3 s of
    the last 0.6 s stolen there is nothing to compare (UNKNOWN: the wall clock's larger overrun
    decides); once the readings span 0.5 s of the machine's own time, still is IDLE again."""
    held = _stolen([0.0, 0.0, 0.1, 0.2, 0.3, 0.4])  # readings at +0.5 .. +1.5
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=held[-4:], typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )
    assert cpu is Cpu.UNKNOWN and "hypervisor held the machine's CPUs off 0.30 s" in why
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=held, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.6
    )  # from +0.5: 1.0 s less 0.4 s stolen
    assert cpu is Cpu.IDLE and "over 0.60 s + 0.40 s stolen" in why
    cpu, why = waiting(held[-4:], now=T0 + 1.6)  # a wait on the peers: the same reading
    assert cpu is Cpu.UNKNOWN and "hypervisor" in why
    unread = [Sample(s.ts, s.cpu_s, s.queued_s, s.others_queued_s) for s in held[-4:]]
    assert judge(began=Sample(T0, 1.0), samples=unread, typical_cpu_s=0.3, factor=3.0,
                 now=T0 + 1.6)[0] is Cpu.IDLE  # no steal clock (not Linux): as before  # fmt: skip


def test_a_share_of_a_core_is_measured_in_the_machines_own_time() -> None:
    """A thread that ran 0.015 s in 0.9 s of which 0.3 s were stolen used 2.5 % of the time
    the machine had (1.7 % of the wall clock's: still, were the steal not counted)."""
    samples = [
        Sample(T0 + 0.5, 1.0, stolen_s=0.0),
        Sample(T0 + 1.0, 1.005, stolen_s=0.0),
        Sample(T0 + 1.4, 1.015, stolen_s=0.3),
    ]
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=samples, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.5
    )
    assert cpu is Cpu.WORKING, why
    unread = [Sample(s.ts, s.cpu_s) for s in samples]
    cpu, _ = judge(
        began=Sample(T0, 1.0), samples=unread, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.5
    )
    assert cpu is Cpu.IDLE


def test_the_steal_clock_adds_the_most_any_one_cpu_lost_in_each_interval(tmp_path: Path) -> None:
    """Per CPU in ``/proc/stat`` (ticks): a thread frozen on one CPU lost at most what that CPU
    lost; a chain moving between CPUs about the sum over intervals of the largest loss. Reads
    closer than :data:`STOLEN_EVERY_S` do not cut an interval: over many short ones each CPU's
    10 ms tick would be the largest loss in turn, the sum the whole machine's steal."""
    stat = tmp_path / "stat"

    def write(cpu0: int, cpu1: int) -> None:
        stat.write_text(
            f"cpu  10 0 10 100 0 0 0 {cpu0 + cpu1} 0 0\n"
            f"cpu0 5 0 5 50 0 0 0 {cpu0} 0 0\ncpu1 5 0 5 50 0 0 0 {cpu1} 0 0\n"
            "intr 1 2 3\nctxt 4\nprocs_running 2\n"
        )

    clock = Stolen(100.0, str(stat))
    write(1000, 2000)
    assert clock.read(now=0.0) == 0.0  # the first read starts the clock
    write(1030, 2010)  # cpu0 lost 0.3 s, cpu1 0.1 s
    assert clock.read(now=0.3) == pytest.approx(0.3)
    write(1030, 2030)  # then cpu1 0.2 s
    assert clock.read(now=0.6) == pytest.approx(0.5)
    for k in range(1, 11):  # ten reads 0.02 s apart, a tick on each CPU in turn
        write(1030 + (k + 1) // 2, 2030 + k // 2)
        assert clock.read(now=0.6 + 0.02 * k) == pytest.approx(0.5 + 0.01 * ((k + 1) // 2))
    write(1030, 2000)  # a counter that went back (a reset): nothing lost, never back
    assert clock.read(now=1.0) == pytest.approx(0.55)
    assert Stolen(100.0, str(tmp_path / "absent")).read() is None


def test_a_reading_without_a_steal_clock_is_not_compared_with_one_that_has_it() -> None:
    """What was stolen since a reading without the clock (its read failed) is not known: the
    judge does not take it for nothing stolen."""
    held = _stolen([0.0, 0.0, 0.1, 0.2, 0.3])  # readings at +0.5 .. +1.3
    unread = [Sample(s.ts, s.cpu_s, s.queued_s, s.others_queued_s, runnable=False,
                     others_runnable=False, others_cpu_s=3.0) for s in held[:2]]  # fmt: skip
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=unread + held[2:], typical_cpu_s=0.3, factor=3.0,
        now=T0 + 1.4,
    )  # fmt: skip
    assert cpu is Cpu.UNKNOWN, why  # (taking the first two for 0 s stolen: IDLE)


def test_another_thread_runnable_and_not_run_lately_is_asked_of_the_last_half_second() -> None:
    """Where steal makes the judge look further back, another thread's CPU from before the
    last half second (on the wall clock) does not hide that it is runnable and got none since:
    it waits in the run queue (UNKNOWN, as without steal)."""
    samples = [
        Sample(T0 + 0.5 + 0.2 * i, 1.0, 5.0, 2.0, runnable=False, others_runnable=True,
               others_cpu_s=3.0 if i == 0 else 3.03, stolen_s=[0.0, 0.0, 0.05, 0.15, 0.25][i])
        for i in range(5)
    ]  # fmt: skip
    cpu, why = judge(
        began=Sample(T0, 1.0), samples=samples, typical_cpu_s=0.3, factor=3.0, now=T0 + 1.4
    )
    assert cpu is Cpu.UNKNOWN and "another of its threads is runnable" in why, why


def test_the_agent_reads_the_steal_clock_with_each_sample() -> None:
    clock = Stolen(float(os.sysconf("SC_CLK_TCK")))  # this machine's /proc/stat
    first = read_thread_clocks(os.getpid(), threading.get_native_id(), 100.0, clock)
    assert first is not None and first.stolen_s == 0.0
    assert read_thread_clocks(os.getpid(), threading.get_native_id(), 100.0).stolen_s is None


_OTHER_THREAD = """
import hashlib, os, sys, threading, time
from unicron.detect.busy import process_state, read_thread_clocks
spins, stop, tid = sys.argv[1] == "1", threading.Event(), []
def other():
    tid.append(threading.get_native_id())
    block = b"x" * (1 << 20)
    while spins and not stop.is_set():
        hashlib.sha256(block).digest()  # without the GIL: on a CPU or in the run queue
    stop.wait(60.0)
t = threading.Thread(target=other, daemon=True)
t.start()
while not tid:
    time.sleep(0.01)
while (process_state(tid[0]) == "S") == spins:  # it has begun to spin, or to sleep
    time.sleep(0.01)
clocks = read_thread_clocks(os.getpid(), threading.get_native_id(), 100.0)
stop.set()
print(clocks.others_runnable, clocks.others_cpu_s is not None and clocks.others_cpu_s >= 0.0)
"""


@pytest.mark.parametrize("spins", [False, True])
def test_read_thread_clocks_says_whether_another_thread_is_runnable(spins: bool) -> None:
    """In a process of its own: no thread but the reader and the other one."""
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_THREAD, "1" if spins else "0"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.split() == [str(spins), "True"], out.stderr


def test_read_thread_clocks_reads_the_threads_own_clock_and_the_others_wait() -> None:
    import threading

    stop = threading.Event()
    other = threading.Thread(target=lambda: stop.wait(0.3))
    other.start()
    try:
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        clocks = read_thread_clocks(os.getpid(), threading.get_native_id(), 100.0)
    finally:
        stop.set()
        other.join()
    assert clocks is not None
    assert abs(clocks.cpu_s - time.thread_time()) < 0.05
    assert clocks.queued_s is not None and clocks.queued_s >= 0.0
    assert clocks.others_queued_s is not None and clocks.others_queued_s >= 0.0


@pytest.mark.parametrize("idle", [False, True])
def test_a_thread_at_sched_idle_is_not_among_the_waiting_others(idle: bool) -> None:
    """An abandoned epoch's gloo threads are demoted to ``SCHED_IDLE`` and may spin for the
    process's life, always waiting for a CPU: counted, they would make every hung worker's
    stillness "no verdict" (the wall clock's larger overrun) rather than a hang. Another
    thread spins on the computing thread's CPU (outside the GIL): at the normal policy its
    run-queue wait counts, at ``SCHED_IDLE`` it does not."""
    import hashlib
    import threading

    cpu = sorted(os.sched_getaffinity(0))[0]
    before, stop, ready, tids = os.sched_getaffinity(0), threading.Event(), threading.Event(), []

    def spin() -> None:
        os.sched_setaffinity(0, {cpu})
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        tids.append(threading.get_native_id())
        ready.set()
        block = b"x" * (1 << 22)
        while not stop.is_set():
            hashlib.sha256(block).digest()  # without the GIL

    other = threading.Thread(target=spin, daemon=True)
    other.start()
    ready.wait(5)
    os.sched_setaffinity(0, {cpu})  # this thread computes on the same CPU
    try:
        me = threading.get_native_id()
        first = read_thread_clocks(os.getpid(), me, 100.0)
        block, end = b"y" * (1 << 22), time.monotonic() + 0.6
        while time.monotonic() < end:
            hashlib.sha256(block).digest()
        last = read_thread_clocks(os.getpid(), me, 100.0)
    finally:
        stop.set()
        other.join()
        os.sched_setaffinity(0, before)
    assert first is not None and last is not None
    assert first.others_queued_s is not None and last.others_queued_s is not None
    waited = last.others_queued_s - first.others_queued_s
    assert (waited < 0.05) if idle else (waited > 0.1), waited


def test_a_stopped_worker_is_hung() -> None:
    for began, typical in ((Sample(T0, 1.0), 0.3), (None, None)):  # no yardstick needed
        cpu, why = judge(
            began=began, samples=_samples(0.0), typical_cpu_s=typical, factor=3.0, now=T0 + 1.6
        )
        assert cpu is Cpu.IDLE and "stood still" in why


def test_a_worker_that_spins_past_its_budget_is_hung() -> None:
    """An endless loop keeps the CPU busy: past ``factor`` x what a step costs it is a hang."""
    cpu, why = judge(
        began=Sample(T0, 1.0),
        samples=_samples(1.0, cpu0=1.0 + 0.8),
        typical_cpu_s=0.25,
        factor=3.0,
        now=T0 + 1.6,
    )
    assert cpu is Cpu.SPINNING and "spins" in why


@pytest.mark.parametrize(
    ("began", "samples", "typical", "now", "why"),
    [
        (None, _samples(0.1), 0.3, T0 + 1.6, "no yardstick"),
        (Sample(T0, 1.0), _samples(0.1), None, T0 + 1.6, "no yardstick"),
        (Sample(T0, 1.0), _samples(0.1, n=1), 0.3, T0 + 1.6, "no CPU samples"),
        (Sample(T0, 1.0), _samples(0.1, n=2), 0.3, T0 + 1.0, "apart"),
        (Sample(T0, 1.0), _samples(0.1), 0.3, T0 + 5.0, "no CPU sample for"),
    ],
)
def test_without_fresh_evidence_it_is_unknown(
    began: Sample | None, samples: list[Sample], typical: float | None, now: float, why: str
) -> None:
    cpu, reason = judge(began=began, samples=samples, typical_cpu_s=typical, factor=3.0, now=now)
    assert cpu is Cpu.UNKNOWN and why in reason


def test_the_peers_cost_of_the_step_is_the_yardstick() -> None:
    cpu = CpuTimes()
    for slot in (0, 1):
        cpu.began(slot, 7, Sample(T0, 10.0))
    cpu.computed(0, 7, 10.3)  # the peer needed 0.3 s of CPU for step 7
    for s in _samples(0.2, cpu0=10.0):
        cpu.sampled(1, s)
    assert cpu.judge(1, 7, factor=3.0, now=T0 + 1.6)[0] is Cpu.WORKING
    assert cpu.judge(1, 8, factor=3.0, now=T0 + 1.6)[0] is Cpu.UNKNOWN  # another step
    cpu.forget(1)
    assert cpu.judge(1, 7, factor=3.0, now=T0 + 1.6)[0] is Cpu.UNKNOWN


def test_a_member_waiting_on_its_peers_is_starved_only_while_it_waits_for_a_cpu() -> None:
    """Outside a step (joining an epoch, reducing a step) there is no step to cost: a member
    its peers wait for is starved (WORKING) where its readings show its thread in the run
    queue (runnable and not run, or its counted wait grown), blocked (IDLE) where it stood
    still with nothing of its own queued, and nothing is said (UNKNOWN) while it runs (a
    spin, or slow work), while only its other threads wait, or without fresh readings."""
    now = T0 + 1.6
    runnable = [Sample(s.ts, 1.0, runnable=True) for s in _samples(0.0)]
    queued = [Sample(s.ts, 1.0, 5.0 + 0.9 * (s.ts - T0)) for s in _samples(0.0)]
    for readings, words in ((runnable, "runnable but not run"), (queued, "waiting for a CPU")):
        cpu, why = waiting(readings, now)
        assert cpu is Cpu.WORKING and words in why
    asleep = [Sample(s.ts, 1.0, 5.0, runnable=False) for s in _samples(0.0)]
    assert waiting(asleep, now)[0] is Cpu.IDLE
    others = [Sample(s.ts, 1.0, 5.0, others_queued_s=0.5 * (s.ts - T0)) for s in _samples(0.0)]
    assert waiting(others, now)[0] is Cpu.UNKNOWN
    assert waiting(_samples(0.5), now) == (Cpu.UNKNOWN, "it runs (50% of a core over 0.60 s)")
    assert waiting(runnable, now + 5.0)[0] is Cpu.UNKNOWN  # stale
    assert waiting(runnable[:1], now)[0] is Cpu.UNKNOWN


def test_the_readings_outside_a_step_are_kept_apart_from_the_steps() -> None:
    """The agent samples a member that waits on its peers too; those readings are asked by
    :meth:`CpuTimes.waiting`, and a step's begin or end, or an epoch's entry (which abandons
    a step begun), starts them afresh."""
    cpu = CpuTimes()

    def read(start: float) -> None:
        for s in _samples(0.0, start=start):
            cpu.sampled(0, Sample(s.ts, s.cpu_s, runnable=True))

    read(T0 + 0.5)  # before its first step
    assert cpu.waiting(0, T0 + 1.6)[0] is Cpu.WORKING
    cpu.began(0, 0, Sample(T0 + 2, 1.0))
    assert cpu.waiting(0, T0 + 1.6)[0] is Cpu.UNKNOWN
    read(T0 + 2.5)  # the step's readings
    assert cpu.waiting(0, T0 + 3.6)[0] is Cpu.UNKNOWN
    assert cpu.judge(0, 0, factor=3.0, now=T0 + 3.6)[0] is Cpu.WORKING
    cpu.computed(0, 0, 1.0)
    read(T0 + 4.5)  # reducing
    assert cpu.waiting(0, T0 + 5.6)[0] is Cpu.WORKING
    cpu.began(0, 1, Sample(T0 + 6, 1.0))
    cpu.entered(0)  # its epoch broke: step 1 is abandoned, and it joins the next
    read(T0 + 6.5)
    assert cpu.waiting(0, T0 + 7.6)[0] is Cpu.WORKING
    assert cpu.judge(0, 1, factor=3.0, now=T0 + 7.6)[0] is Cpu.UNKNOWN
    cpu.forget(0)
    assert cpu.waiting(0, T0 + 7.6)[0] is Cpu.UNKNOWN


def test_its_own_steps_are_the_yardstick_without_peers() -> None:
    cpu = CpuTimes()
    for step in range(3):
        cpu.began(0, step, Sample(T0 + step, 1.0 + step))
        cpu.computed(0, step, 1.0 + step + 0.05)  # 0.05 s of CPU a step
    cpu.began(0, 3, Sample(T0 + 10, 5.0))
    for s in _samples(0.5, start=T0 + 10.5, cpu0=5.0):
        cpu.sampled(0, s)
    verdict, why = cpu.judge(0, 3, factor=3.0, now=T0 + 11.6)
    assert verdict is Cpu.SPINNING and "spins" in why  # 0.5 s of CPU against 0.05 s a step


def test_read_cpu_s_follows_the_process_clock() -> None:
    ticks = float(os.sysconf("SC_CLK_TCK"))
    before = read_cpu_s(os.getpid(), ticks)
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = read_cpu_s(os.getpid(), ticks)
    assert before is not None and after is not None
    assert after - before == pytest.approx(0.2, abs=0.05)
    assert abs(after - time.process_time()) < 0.1
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert read_cpu_s(child.pid, ticks) is None  # reaped: gone


def test_the_run_queue_wait_is_taken_out_of_a_step() -> None:
    assert own_compute_s(0.3, 0.2) == pytest.approx(0.1)
    assert own_compute_s(0.3, None) == 0.3  # unknown: the wall clock stands
    assert own_compute_s(0.3, 0.5) == 0.0  # clocks read a moment apart: never negative
    assert own_compute_s(0.3, float("nan")) == 0.3


@pytest.mark.e2e
def test_read_queued_s_counts_waiting_for_a_cpu_not_sleeping() -> None:
    """A thread that sleeps waits of its own accord (not counted); one that competes with
    busy processes for fewer cores than there are runnable threads waits in the run queue."""
    before = read_queued_s()
    assert before is not None
    time.sleep(0.3)
    slept = read_queued_s()
    assert slept is not None and slept - before < 0.1
    n = (os.cpu_count() or 1) + 2  # more spinners than cores: someone always waits
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        time.sleep(0.5)
        start, end = read_queued_s(), time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass
        after = read_queued_s()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert start is not None and after is not None
    assert after - start > 0.05  # 1 s of spinning among n + 1 runnable threads on fewer cores


def test_read_cpu_s_of_one_thread_leaves_the_others_out() -> None:
    """The computing thread's clock: a busy thread beside it (a gloo event loop spinning, a
    data loader) does not make a blocked step look like work."""
    import threading

    ticks, pid, tid = float(os.sysconf("SC_CLK_TCK")), os.getpid(), threading.get_native_id()

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    process0, thread0 = read_cpu_s(pid, ticks), read_cpu_s(pid, ticks, tid)
    busy = threading.Thread(target=spin)
    busy.start()
    busy.join()  # this thread blocks meanwhile
    process1, thread1 = read_cpu_s(pid, ticks), read_cpu_s(pid, ticks, tid)
    assert None not in (process0, thread0, process1, thread1)
    assert process1 - process0 >= 0.25  # type: ignore[operator]
    assert thread1 - thread0 < 0.1  # type: ignore[operator]


def test_the_agents_cpu_reading_carries_every_field_of_a_sample() -> None:
    """The agent sends a :class:`Sample` as a ``CpuTime`` field by field, and the coordinator
    rebuilds it by name: the two must name the same fields."""
    from dataclasses import fields

    from unicron import messages as M

    sample = {f.name for f in fields(Sample)}
    assert {f.name for f in fields(M.CpuTime)} - {"slot"} == sample
