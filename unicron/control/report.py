"""The timeline of a run, derived from its event log alone (DESIGN.md: events are the single
source for timelines, benchmarks and the demo's report).

Called by the runner at the end of ``unicron run``, by ``unicron report`` and ``unicron logs``
(a cluster task's events, from the coordinator), by the demo and by the benchmarks.
"""

from __future__ import annotations

import datetime
import json
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

Event = dict[str, Any]


@dataclass(frozen=True)
class Incident:
    """One injected fault and how the task healed from it (times in seconds, ``None`` if the
    run never got there)."""

    fault: str
    rank: int | None
    step: int | None
    ts: float
    detected_by: str | None
    kind: str | None
    detection_s: float | None
    transition_s: float | None
    recovery_s: float | None
    state_source: str | None
    reused: int | None
    recomputed: int | None
    actions: tuple[str, ...]


def incidents(events: list[Event]) -> list[Incident]:
    """One :class:`Incident` per ``fault_injected`` event, in time order; in a log without
    any (a task on a cluster: its failures are real), one per failure found
    (:func:`_found`), whose detection time is unknown (``None``).

    Detection is the first ``error_detected`` at or after the fault (often a peer's in-band
    error), its kind the verdict about the faulted worker or node itself; the transition is the
    first ``transition_end`` after the detection that reused micro-batches or moved state (or
    else the first one); recovery is the first ``step_end`` after the fault for a step at or past
    the faulted one.
    """
    out = []
    faults = sorted((e for e in events if e["event"] == "fault_injected"), key=lambda e: e["ts"])
    found = not faults
    if found:
        faults = _found(events)
    for i, f in enumerate(faults):
        t0 = f["ts"]
        horizon = faults[i + 1]["ts"] if i + 1 < len(faults) else float("inf")
        after = [e for e in events if t0 <= e["ts"]]
        det = next((e for e in after if e["event"] == "error_detected"), None)
        own = next((e for e in after if e["event"] == "error_detected" and _about(e, f)), det)
        trans_all = [
            e
            for e in after
            if e["event"] == "transition_end"
            and e["ts"] < max(horizon, t0 + 1e-9)
            and (det is None or e["ts"] >= det["ts"])
        ]
        trans = next(
            (
                e
                for e in trans_all
                if e.get("microbatches_reused") or e.get("state_source") != "local"
            ),
            trans_all[0] if trans_all else None,
        )
        step = f.get("step")
        rec = next(
            (
                e
                for e in after
                if e["event"] == "step_end" and (step is None or e.get("step", -1) >= step)
            ),
            None,
        )
        actions = tuple(
            f"{e['action']}({_target(e)})" if _target(e) else str(e["action"])
            for e in after
            if e["event"] == "action" and e["ts"] < horizon
        )
        out.append(
            Incident(
                fault=str(f.get("spec", f.get("fault", "?"))),
                rank=f.get("rank"),
                step=step,
                ts=t0,
                detected_by=det.get("method") if det else None,
                kind=own.get("kind") if own else None,
                detection_s=det["ts"] - t0 if det and not found else None,
                transition_s=trans.get("duration_s") if trans else None,
                recovery_s=rec["ts"] - t0 if rec else None,
                state_source=trans.get("state_source") if trans else None,
                reused=trans.get("microbatches_reused") if trans else None,
                recomputed=trans.get("microbatches_recomputed") if trans else None,
                actions=actions,
            )
        )
    return out


def _found(events: list[Event]) -> list[Event]:
    """The failures of a log without injected faults, as the ``fault_injected`` records
    :func:`incidents` reads: one at each ``error_detected`` that is not part of an earlier
    failure still healing (no step past the last one committed before it has been committed
    since), named by its verdict and place (``killed on slot 2``, ``heartbeat_lost on node
    gpu-17``)."""
    out: list[Event] = []
    last_step, healing_to = -1, None
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["event"] == "step_end":
            step = int(e.get("step", -1))
            if healing_to is not None and step >= healing_to:
                healing_to = None
            last_step = max(last_step, step)
        elif e["event"] == "error_detected" and healing_to is None:
            healing_to = last_step + 1
            slot = e.get("slot", e.get("rank"))
            where = f"slot {slot}" if slot is not None else _target(e) or "the task"
            out.append(
                {
                    "ts": e["ts"],
                    "event": "fault_injected",
                    "fault": "node" if e.get("method") == "heartbeat" else "found",
                    "spec": f"{e.get('kind')} on {where}",
                    "rank": slot,
                    "node": e.get("node"),
                    "step": healing_to,
                }
            )
    return out


def _about(detection: Event, fault: Event) -> bool:
    """Whether a detection is about the faulted worker (or node) itself, not a peer's symptom."""
    if fault.get("fault") == "node":
        return detection.get("method") == "heartbeat" and detection.get("node") == fault.get("node")
    return detection.get("slot", detection.get("rank")) == fault.get("rank")


def _target(action: Event) -> str:
    """What an action event acted on: "slot 2", "node gpu-17" (its number where the log
    names none); "" for the task as a whole (``wait``)."""
    if action.get("slot") is not None:
        return f"slot {action['slot']}"
    if action.get("node") is not None:
        return f"node {action.get('node_name', action['node'])}"
    return ""


def steps_redone(events: list[Event]) -> int:
    """Committed steps that were committed again later (0 when nothing finished was lost)."""
    counts = Counter(e["step"] for e in events if e["event"] == "step_end")
    return sum(n - 1 for n in counts.values() if n > 1)


def task_end(events: list[Event]) -> Event | None:
    return next((e for e in reversed(events) if e["event"] == "task_end"), None)


def median_step_s(events: list[Event], skip: int = 5) -> float | None:
    """Median wall time between consecutive committed steps, after ``skip`` warm-up steps."""
    ends = [e for e in events if e["event"] == "step_end"]
    gaps = sorted(b["ts"] - a["ts"] for a, b in zip(ends[skip:], ends[skip + 1 :], strict=False))
    return gaps[len(gaps) // 2] if gaps else None


def summary(events: list[Event]) -> dict[str, Any]:
    """The timeline as data (``unicron report --json``): every incident, the steps redone,
    the median step time and the ``task_end`` event (``None`` while the task runs)."""
    return {
        "incidents": [asdict(inc) for inc in incidents(events)],
        "steps_redone": steps_redone(events),
        "median_step_s": median_step_s(events),
        "task_end": task_end(events),
    }


_QUIET = ("ts", "event", "task", "node_name")
"""fields :func:`event_line` does not repeat (the task is the one asked for)"""


def event_line(e: Event) -> str:
    """One event as a line a person reads (``unicron logs``): local time, the event, then
    its fields as ``key=value``, a node by its name."""
    when = datetime.datetime.fromtimestamp(float(e["ts"])).strftime("%H:%M:%S.%f")[:-3]
    fields = []
    for key, value in e.items():
        if key in _QUIET or value is None:
            continue
        if key == "node" and "node_name" in e:
            value = e["node_name"]
        fields.append(f"{key}={_value(value)}")
    return f"{when} {e['event']:<15} {' '.join(fields)}".rstrip()


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return json.dumps(v) if not v or any(c.isspace() or c in '"=' for c in v) else v
    return json.dumps(v, separators=(",", ":"))


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def render(events: list[Event], console: Any) -> None:
    """Print the timeline table and the outcome with ``rich``."""
    from rich.markup import escape  # a reason is a worker's text: never read as markup
    from rich.table import Table

    table = Table(title="Self-healing timeline", title_justify="left")
    for col in (
        "fault",
        "detected by",
        "kind",
        "detection",
        "transition",
        "fault -> next step",
        "state from",
        "mb reused",
        "mb recomputed",
        "actions",
    ):
        table.add_column(col)
    for inc in incidents(events):
        table.add_row(
            inc.fault,
            inc.detected_by or "-",
            inc.kind or "-",
            fmt_s(inc.detection_s),
            fmt_s(inc.transition_s),
            fmt_s(inc.recovery_s),
            inc.state_source or "-",
            "-" if inc.reused is None else str(inc.reused),
            "-" if inc.recomputed is None else str(inc.recomputed),
            ", ".join(inc.actions) or "-",
        )
    if table.row_count:
        console.print(table)
    end = task_end(events)
    if end is not None:
        console.print(
            f"task {escape(str(end.get('task')))}: [bold]{escape(str(end.get('status')))}[/bold] "
            f"after {end.get('steps')} steps, final loss {end.get('final_loss')}, steps redone "
            f"{steps_redone(events)}, params sha256 {str(end.get('params_sha256', '-'))[:16]}..."
            + (f"\nreason: {escape(str(end['reason']))}" if end.get("reason") else "")
        )
