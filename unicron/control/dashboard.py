"""The web dashboard's data: one JSON snapshot of the cluster, for the page at ``/ui``.

The coordinator's service (:mod:`unicron.control.service`) mounts :func:`page`, the page's
static files (``unicron/control/web/``: HTML, JavaScript, CSS and the vendored uPlot charting
library), at ``/ui/`` without a token, since they hold no data, and serves
:meth:`Dashboard.snapshot` at ``GET /v1/dashboard`` behind the token like every other call.
The page asks for the token, keeps it in the tab's ``sessionStorage`` and sends it as the
bearer header of its requests (never in a URL), polling the snapshot about once a second. A
snapshot holds:

- every node with its slots: which task and rank holds each, and the slot's health as its
  task's coordinator sees it (training, starting, down, excluded, probing, leaving; free);
- every task's view (as ``GET /v1/tasks``) with its series over time: committed step, loss
  and step rate per ``step_end``, worker count per ``epoch_begin``;
- every task's ``plan`` events (the planner's decisions with their trigger, reason and
  expected WAF before and after; a coordinator's membership changes with their reason);
- every task's fault timeline: one row per fault, as ``unicron run`` prints it at its end
  (:func:`unicron.control.report.incidents`), for injected faults and for real ones alike.

Each task's event log is read from the service's SQLite state incrementally (only the events
after the last one read), so a poll costs the new events, not the whole log.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unicron.control import report as R
from unicron.control.coordinator import SlotState as S

if TYPE_CHECKING:
    from unicron.control.cluster import Cluster
    from unicron.control.coordinator import Coordinator

Event = dict[str, Any]

MAX_POINTS = 600
"""the most points a series sends (longer ones are thinned evenly, the newest point kept)"""
RATE_WINDOW = 5
"""a point's step rate: committed steps over the wall time of the last this many steps"""


PAGE = "/ui"
"""where the service mounts the page (:func:`page`)"""
WEB = Path(__file__).resolve().parent / "web"
"""the page's static files (package data)"""
PAGE_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; style-src 'self' 'unsafe-inline'; "
     b"img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-cache"),
]  # fmt: skip
"""on every file of the page: scripts from this origin only (no inline script, so text that
slipped into the page could not run), no referrer, revalidated on each load"""


def is_page(path: str) -> bool:
    """Whether a request's path is the page's (served to anyone: the same files for everyone,
    no data); a token check in front of the whole app lets these through."""
    return path == PAGE or path.startswith(PAGE + "/")


def page() -> Any:
    """The ASGI app serving :data:`WEB` (``index.html`` for the folder) with
    :data:`PAGE_HEADERS`; the service mounts it at :data:`PAGE`."""
    from starlette.staticfiles import StaticFiles

    files = StaticFiles(directory=WEB, html=True)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *PAGE_HEADERS]
            await send(message)

        await files(scope, receive, with_headers)

    return app


@dataclass
class _TaskLog:
    """What the dashboard keeps of one task's event log: its ``step_end`` events as tuples
    (the bulk of a log), everything else whole, and the last timeline it derived."""

    after: int = 0  # the id of the last event read
    steps: list[tuple[float, int, float | None]] = field(default_factory=list)  # ts, step, loss
    other: list[Event] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    timeline_of: tuple[int, int] = (-1, -1)  # (len(other), len(steps)) it was derived from

    def add(self, events: list[Event]) -> None:
        for e in events:
            if e.get("event") == "step_end":
                loss = e.get("loss")
                finite = float(loss) if isinstance(loss, int | float) else math.nan
                kept = finite if math.isfinite(finite) else None  # JSON has no NaN
                self.steps.append((float(e["ts"]), int(e["step"]), kept))
            else:
                self.other.append(e)

    def rows(self) -> list[dict[str, Any]]:
        """The fault timeline, derived again only when it could have changed: a new event
        other than a step, or a new step while a fault has not seen its next step yet."""
        key = (len(self.other), len(self.steps))
        stale = key[0] != self.timeline_of[0] or (
            key[1] != self.timeline_of[1] and any(r["recovery_s"] is None for r in self.timeline)
        )
        if stale:
            steps = [{"event": "step_end", "ts": ts, "step": s} for ts, s, _ in self.steps]
            self.timeline = timeline(sorted([*self.other, *steps], key=lambda e: e["ts"]))
            self.timeline_of = key
        return self.timeline


class Dashboard:
    """The snapshot behind ``GET /v1/dashboard``, over a
    :class:`~unicron.control.cluster.Cluster`. Called from the service's thread pool, by any
    number of pages at once (one lock: each task's log is read once)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._logs: dict[str, _TaskLog] = {}
        self._lock = threading.Lock()

    def snapshot(self, now: float) -> dict[str, Any]:
        tasks = self.cluster.task_views()
        with self._lock:
            for view in tasks:
                self._read(view)
            return {
                "now": now,
                "nodes": self._nodes(now),
                "tasks": [self._task(view) for view in tasks],
            }

    def _read(self, view: dict[str, Any]) -> None:
        """The task's events since the last read (kept by uid: a name may be used again by a
        later task)."""
        log = self._logs.setdefault(view["uid"], _TaskLog())
        while True:
            found, last = self.cluster.events(view["name"], log.after)
            if not found:
                return
            log.add(found)
            log.after = last

    def _task(self, view: dict[str, Any]) -> dict[str, Any]:
        log = self._logs[view["uid"]]
        return {
            **view,
            "series": series(log.steps),
            "workers_series": workers(log.other),
            "decisions": decisions(log.other),
            "timeline": log.rows(),
        }

    def _nodes(self, now: float) -> list[dict[str, Any]]:
        """Every node's view (as ``GET /v1/nodes``) with its slots, each held by a task (its
        name and rank, and the slot's health from the task's coordinator) or free."""
        held: dict[int, list[dict[str, Any]]] = {}
        for task in list(self.cluster.tasks.values()):
            c = task.controller
            if c is None:  # queued or ended: holds no slot
                continue
            for rank, nid in enumerate(list(task.row.placement)):
                if nid >= 0:
                    held.setdefault(nid, []).append(
                        {"task": task.row.name, "rank": rank, "health": slot_health(c, rank)}
                    )
        out = []
        for node in self.cluster.node_views(now):
            slots = held.get(node["id"], [])
            free = max(int(node["slots"]) - len(slots), 0)
            out.append({**node, "slot_list": slots + [{"health": "free"}] * free})
        return out


def slot_health(controller: Coordinator, rank: int) -> str:
    """One word for the slot ``rank`` of a task, from its coordinator
    (:class:`~unicron.control.coordinator.SlotState`): ``training`` (a member of the current
    epoch), ``starting`` (in the plan, a worker starting or ready to join), ``down`` (in the
    plan, no worker), ``probing`` (excluded, its health probe running), ``excluded``,
    ``leaving`` (given to another task). Read without the coordinator's lock: a copy of
    one moment's state, good enough for a page redrawn every second."""
    slot = controller.slots.get(rank)
    if slot is None:  # added by the cluster, not yet known to its coordinator
        return "starting"
    state = slot.state
    if state in (S.LEAVING, S.STOPPING, S.LEFT):
        return "leaving"
    if state in (S.OUT_STARTING, S.OUT_READY, S.EXCLUDED):
        return "probing" if slot.probing else "excluded"
    if state is S.DOWN:
        return "down"
    return "training" if rank in controller.members else "starting"


def thin(n: int, most: int = MAX_POINTS) -> list[int]:
    """Indices of at most ``most`` of ``n`` points, evenly spread, the first and last kept."""
    if n <= most:
        return list(range(n))
    stride = (n - 1) / (most - 1)
    return sorted({round(k * stride) for k in range(most)})


def series(steps: list[tuple[float, int, float | None]]) -> dict[str, list[Any]]:
    """The step, loss and step-rate series of a task's ``(ts, step, loss)`` commits, in time
    order. A point's rate is the steps committed over the last :data:`RATE_WINDOW` steps'
    wall time (``None`` for the first point)."""
    ts = [t for t, _, _ in steps]
    rate: list[float | None] = [None]
    for i in range(1, len(steps)):
        j = max(i - RATE_WINDOW, 0)
        dt = ts[i] - ts[j]
        rate.append(round((steps[i][1] - steps[j][1]) / dt, 4) if dt > 0 else None)
    keep = thin(len(steps))
    return {
        "ts": [ts[i] for i in keep],
        "step": [steps[i][1] for i in keep],
        "loss": [steps[i][2] for i in keep],
        "rate": [rate[i] for i in keep],
    }


def workers(events: list[Event]) -> dict[str, list[Any]]:
    """The worker count over time: the members of each ``epoch_begin``."""
    begins = [e for e in events if e.get("event") == "epoch_begin"]
    return {
        "ts": [float(e["ts"]) for e in begins],
        "count": [len(e.get("members") or ()) for e in begins],
    }


def decisions(events: list[Event]) -> list[dict[str, Any]]:
    """A task's ``plan`` events, oldest first: the planner's (a ``trigger``, both
    allocations, the expected WAF before and after) and its coordinator's membership changes
    (an epoch and its reason)."""
    out = []
    for e in events:
        if e.get("event") != "plan":
            continue
        out.append(
            {
                "ts": e.get("ts"),
                "by": "planner" if "trigger" in e else "coordinator",
                "trigger": e.get("trigger"),
                "reason": e.get("reason", ""),
                "allocation_before": e.get("allocation_before"),
                "allocation": e.get("allocation"),
                "waf_before": e.get("waf_before"),
                "waf_after": e.get("waf_after"),
                "epoch": e.get("epoch"),
            }
        )
    return out


def timeline(events: list[Event]) -> list[dict[str, Any]]:
    """One row per fault of a task's log (in time order), the columns of ``unicron run``'s
    healing timeline (:func:`unicron.control.report.incidents`). A fault is an injected one
    (``fault_injected``) or, for a real one, its first SEV1/SEV2 detection that no injected
    fault explains (:func:`unannounced`)."""
    rows = []
    for inc in R.incidents(sorted([*events, *unannounced(events)], key=lambda e: e["ts"])):
        rows.append(
            {
                "ts": inc.ts,
                "fault": inc.fault,
                "injected": not inc.fault.endswith(UNANNOUNCED),
                "detected_by": inc.detected_by,
                "kind": inc.kind,
                "detection_s": inc.detection_s,
                "transition_s": inc.transition_s,
                "recovery_s": inc.recovery_s,
                "state_source": inc.state_source,
                "reused": inc.reused,
                "recomputed": inc.recomputed,
                "actions": list(inc.actions),
            }
        )
    return rows


UNANNOUNCED = "(not injected)"


def unannounced(events: list[Event]) -> list[Event]:
    """A ``fault_injected``-shaped record for each real fault of a log, so that
    :func:`~unicron.control.report.incidents` derives its row as it does an injected one's.

    A SEV1 or SEV2 ``error_detected`` starts a fault unless it is about the slot or node of
    an injected fault not yet healed (no step at or past its step committed since; a slow
    worker's until the next injected fault: its straggler verdict comes steps later), or a
    fault (injected or not) began since the last committed step (then it is that fault's
    symptom: a peer's error when a node vanished). The fault is
    dated when its worker or node was last known well: a node's last heartbeat
    (``silent_s`` before its ``heartbeat_lost``), else the detection itself; its step is the
    one after the last committed."""
    out: list[Event] = []
    injected: Event | None = None
    last_step, since_step = -1, False
    for e in sorted(events, key=lambda e: e["ts"]):
        kind = e.get("event")
        if kind == "step_end":
            last_step, since_step = max(last_step, int(e.get("step", -1))), False
            slow = injected is not None and injected.get("fault") == "slow"
            if injected is not None and not slow and last_step >= int(injected.get("step") or 0):
                injected = None  # healed: what comes next is a fault of its own
        elif kind == "fault_injected":
            injected, since_step = e, True
        elif kind == "error_detected" and int(e.get("severity", 3)) <= 2:
            if since_step or (injected is not None and _about(e, injected)):
                continue
            since_step = True
            where = f"slot {e['slot']}" if e.get("slot") is not None else f"node {e.get('node')}"
            silent = e.get("silent_s") if e.get("method") == "heartbeat" else None
            out.append(
                {
                    "event": "fault_injected",
                    "ts": float(e["ts"]) - (float(silent) if silent else 0.0),
                    "fault": "node" if e.get("slot") is None else str(e.get("kind")),
                    "spec": f"{e.get('kind')} on {where} {UNANNOUNCED}",
                    "rank": e.get("slot"),
                    "node": e.get("node"),
                    "step": last_step + 1,
                }
            )
    return out


def _about(detection: Event, fault: Event) -> bool:
    """Whether a detection is about an injected fault's own worker or node (as the report
    matches them: a node fault by its heartbeat, a worker's by its slot)."""
    if fault.get("fault") == "node":
        return detection.get("method") == "heartbeat" and detection.get("node") == fault.get("node")
    return detection.get("slot", detection.get("rank")) == fault.get("rank")
