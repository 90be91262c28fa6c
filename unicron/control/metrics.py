"""The cluster's Prometheus metrics (``GET /metrics``), fed by
:class:`unicron.control.cluster.Cluster` from its task table and its tasks' events.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any

from unicron.control.state import ACTIVE, ENDED, State


class Metrics:
    """Prometheus metrics (``GET /metrics``): gauges read from the task table at scrape time,
    counters and histograms fed from the task events. The failure counters are kept in the
    state (meta ``metrics.failures``, written on every detection) and go on from there after
    a restart, as a counter must; the histograms start again (Prometheus sees a reset)."""

    FAILURES_KEY = "metrics.failures"

    def __init__(self, state: State) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.tasks = Gauge("unicron_tasks", "tasks by state", ["state"], registry=self.registry)
        self.workers = Gauge("unicron_workers", "workers of active tasks", registry=self.registry)
        self.steps = Gauge(
            "unicron_committed_steps", "last committed step per task", ["task"],
            registry=self.registry,
        )  # fmt: skip
        self.failures = Counter(
            "unicron_failures", "detected failures", ["kind", "severity"], registry=self.registry
        )
        self.detection = Histogram(
            "unicron_detection_seconds",
            "injected fault to its detection",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 120),
            registry=self.registry,
        )
        self.transition = Histogram(
            "unicron_transition_seconds",
            "transition durations (rendezvous to the first step of an epoch)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )
        self.decision = Histogram(
            "unicron_plan_decision_seconds",
            "the planner's decision on a trigger (every trigger, changed or not)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=self.registry,
        )
        self._state = state
        self._failed: dict[str, float] = json.loads(state.meta(self.FAILURES_KEY) or "{}")
        for labels, count in self._failed.items():  # "kind|severity" -> count so far
            kind, _, severity = labels.partition("|")
            self.failures.labels(kind, severity).inc(count)
        self._faults: dict[tuple[str, int], float] = {}  # (task, rank) -> injected at
        self.failures_seen = 0  # SEV1 and SEV2 detections: the planner's failure rate
        self._lock = threading.Lock()

    def observe(self, task: str, e: dict[str, Any]) -> None:
        kind = e["event"]
        with self._lock:
            if kind == "fault_injected" and e.get("rank") is not None:
                self._faults[(task, int(e["rank"]))] = float(e["ts"])
            elif kind == "error_detected":
                verdict, severity = str(e.get("kind")), str(e.get("severity"))
                self.failures.labels(verdict, severity).inc()
                labels = f"{verdict}|{severity}"
                self._failed[labels] = self._failed.get(labels, 0) + 1
                self._state.set_meta(self.FAILURES_KEY, json.dumps(self._failed))
                if int(e.get("severity", 3)) <= 2:
                    self.failures_seen += 1
                injected = self._faults.pop((task, int(e.get("rank", -1))), None)
                if injected is not None:
                    self.detection.observe(max(float(e["ts"]) - injected, 0.0))
            elif kind == "transition_end" and e.get("rank") == 0 and "duration_s" in e:
                self.transition.observe(float(e["duration_s"]))

    def render(self, tasks: list[tuple[str, int, str, int]]) -> bytes:
        from prometheus_client import generate_latest

        with self._lock:
            counts = Counter(state for state, *_ in tasks)
            for state in ("queued", *ACTIVE, *ENDED):
                self.tasks.labels(state).set(counts.get(state, 0))
            self.workers.set(sum(w for _, w, _, _ in tasks))
            for _, _, name, step in tasks:
                self.steps.labels(name).set(step + 1)
            return generate_latest(self.registry)
