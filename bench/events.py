"""Measures one run from its event log (DESIGN.md, Contracts): the parser every system shares.

Unicron writes the log itself; the baselines write the same events (``bench/baselines``), and
the harness adds ``error_detected`` for torchrun from its agent's log. So one function turns
any run into the same figures:

- detection: the first ``error_detected`` at or after a ``fault_injected``, minus the fault
  (:func:`detection_by_method`: the first one of a given ``method``, e.g. ``heartbeat``);
- recovery: the first ``step_end`` after the fault whose step is at least the faulted step,
  minus the fault (the time from the fault to the next finished step);
- steps redone: for each step, how many times one rank reported it finished, minus one;
- step time: the median ``duration_s`` of the steps after warm-up and before any fault (and
  its 99th percentile, for the fault-free soak);
- false alarms: ``error_detected`` events in a run where nothing was injected;
- epochs: ``epoch_begin`` events of the whole job (Unicron: one per epoch; torchrun: one per
  attempt; torchft's are per replica, carry a ``rank`` and are not counted), and the
  ``action`` events' names (what Unicron decided: ``reattempt``, ``restart``, ``exclude``).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Event = dict[str, Any]


def read_events(path: str | Path) -> list[Event]:
    """The events of a JSON Lines file in time order; a torn last line is skipped."""
    events: list[Event] = []
    p = Path(path)
    if not p.exists():
        return events
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a writer killed mid-line
        if isinstance(record, dict) and "ts" in record and "event" in record:
            events.append(record)
    return sorted(events, key=lambda e: float(e["ts"]))


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The figures of one run; a figure is ``None`` where the run gives no value for it."""

    faults: int
    detection_s: list[float]
    recovery_s: list[float]
    steps_redone: int
    steps_finished: int
    step_time_s: float | None
    false_alarms: int
    undetected: int
    unrecovered: int
    epochs: int | None = None
    step_time_p99_s: float | None = None

    def metrics(self) -> dict[str, float]:
        """The figures as metric name -> value (means over the run's faults)."""
        out: dict[str, float] = {"steps_finished": float(self.steps_finished)}
        if self.epochs is not None:
            out["epochs"] = float(self.epochs)
        if self.step_time_s is not None:
            out["step_time_s"] = self.step_time_s
        if self.faults == 0:
            out["false_alarms"] = float(self.false_alarms)
            if self.step_time_p99_s is not None:
                out["step_time_p99_s"] = self.step_time_p99_s
            return out
        out["steps_redone"] = float(self.steps_redone)
        if self.detection_s:
            out["detection_s"] = statistics.fmean(self.detection_s)
        if self.recovery_s:
            out["recovery_s"] = statistics.fmean(self.recovery_s)
        return out


def _of(events: Iterable[Event], name: str) -> list[Event]:
    return [e for e in events if e.get("event") == name]


def steps_redone(events: list[Event]) -> int:
    """Finished steps reported again later: per (rank, step), the count beyond the first."""
    counts = Counter((e.get("rank"), e.get("step")) for e in _of(events, "step_end"))
    per_step: dict[Any, int] = {}
    for (_, step), n in counts.items():
        per_step[step] = max(per_step.get(step, 0), n - 1)
    return sum(per_step.values())


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between the nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def actions(events: list[Event]) -> Counter[str]:
    """How many ``action`` events of each name (``reattempt``, ``restart``, ``exclude``...)."""
    return Counter(str(e.get("action", "?")) for e in _of(events, "action"))


def alarms(events: list[Event]) -> Counter[str]:
    """How many ``error_detected`` events of each ``kind`` (``hang``, ``straggler``...)."""
    return Counter(str(e.get("kind", "?")) for e in _of(events, "error_detected"))


def _job_epochs(events: list[Event]) -> int | None:
    """``epoch_begin`` events of the whole job; ``None`` if there are none (only per-rank ones,
    or none at all)."""
    job = [e for e in _of(events, "epoch_begin") if "rank" not in e]
    return len(job) if job else None


def measure(events: list[Event], warmup_steps: int = 3) -> Outcome:
    """The figures of one run's events (see the module docstring)."""
    events = sorted(events, key=lambda e: float(e["ts"]))
    faults = _of(events, "fault_injected")
    detected = _of(events, "error_detected")
    steps = _of(events, "step_end")
    detection: list[float] = []
    recovery: list[float] = []
    for i, fault in enumerate(faults):
        t, step = float(fault["ts"]), int(fault.get("step", 0))
        t_next = float(faults[i + 1]["ts"]) if i + 1 < len(faults) else float("inf")
        seen = [float(e["ts"]) for e in detected if t <= float(e["ts"]) < t_next]
        if seen:
            detection.append(seen[0] - t)
        done = [float(e["ts"]) for e in steps if float(e["ts"]) > t and int(e["step"]) >= step]
        if done:
            recovery.append(done[0] - t)
    t_first_fault = float(faults[0]["ts"]) if faults else float("inf")
    durations = [
        float(e["duration_s"])
        for e in steps
        if "duration_s" in e and int(e["step"]) >= warmup_steps and float(e["ts"]) < t_first_fault
    ]
    return Outcome(
        epochs=_job_epochs(events),
        step_time_p99_s=percentile(durations, 99.0) if durations else None,
        faults=len(faults),
        detection_s=detection,
        recovery_s=recovery,
        steps_redone=steps_redone(events),
        steps_finished=len({int(e["step"]) for e in steps}),
        step_time_s=statistics.median(durations) if durations else None,
        false_alarms=len(detected) if not faults else 0,
        undetected=len(faults) - len(detection),
        unrecovered=len(faults) - len(recovery),
    )


def detection_by_method(events: list[Event], method: str) -> float | None:
    """Mean over the faults of the first ``error_detected`` with ``method`` after each fault.

    A fault counts only if such a detection comes before the next fault; ``None`` if none does.
    """
    events = sorted(events, key=lambda e: float(e["ts"]))
    faults = [float(e["ts"]) for e in _of(events, "fault_injected")]
    seen = [float(e["ts"]) for e in _of(events, "error_detected") if e.get("method") == method]
    delays = []
    for i, t in enumerate(faults):
        t_next = faults[i + 1] if i + 1 < len(faults) else float("inf")
        after = [ts for ts in seen if t <= ts < t_next]
        if after:
            delays.append(after[0] - t)
    return statistics.fmean(delays) if delays else None
