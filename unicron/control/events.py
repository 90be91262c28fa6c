"""The event log (DESIGN.md, Contracts): JSON Lines, one object per line, flushed as it happens.

Every event has ``ts`` (Unix seconds) and ``event``; ``task``, ``epoch``, ``rank``, ``node`` and
``step`` where they apply. The coordinator and the agent write through one :class:`EventLog`
(workers send theirs to the agent, which writes them); the progress display and the end
report read the same events through :meth:`EventLog.subscribe` and :meth:`EventLog.events`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

EVENTS = frozenset(
    {
        "fault_injected",
        "error_detected",
        "action",
        "plan",
        "epoch_begin",
        "transition_end",
        "step_end",
        "task_end",
        "checkpoint_interval",
        "checkpoint_saved",
        "control_plane",  # the cluster service restarted and adopted the task (away_s)
    }
)

Event = dict[str, Any]


class EventLog:
    """Thread-safe event sink: appends to a file (if given) and keeps the events in memory.
    ``enrich`` (the cluster's: a node's name beside its number) adds fields to each record
    before anyone sees it."""

    def __init__(
        self, path: str | Path | None = None, *, enrich: Callable[[Event], None] | None = None
    ) -> None:
        self._enrich = enrich
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._subscribers: list[Callable[[Event], None]] = []
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def emit(self, event: str, /, **fields: Any) -> Event:
        """Record one event now (or at ``ts=`` if the caller measured it elsewhere)."""
        assert event in EVENTS, f"unknown event {event!r}"
        record: Event = {"ts": fields.pop("ts", None) or time.time(), "event": event}
        record.update({k: v for k, v in fields.items() if v is not None})
        if self._enrich is not None:
            self._enrich(record)
        line = json.dumps(record, sort_keys=False)
        with self._lock:
            self._events.append(record)
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(record)
        return record

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback(event)`` for every later event (from the emitting thread)."""
        with self._lock:
            self._subscribers.append(callback)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[Event]:
    """Parse an event log file (used by the demo, tests and benchmarks)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
