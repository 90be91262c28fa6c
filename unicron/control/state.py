"""The cluster service's durable state: one SQLite file, ``STATE_DIR/state.db``.

Nodes, tasks (spec, state, placement, epoch, workers, last committed step, last fault,
outcome) and every task's events live here, each change written in a transaction, so that a
coordinator restarted on the same directory (after ``kill -9``, too) goes on where it
stopped. WAL journal: a write is durable once its transaction commits, against a process
crash (not against the machine losing power mid-write: ``synchronous=NORMAL``).

:func:`open_state` refuses, with a one-line :class:`~unicron.errors.UsageError`, a directory
that is not ours (files but no state, or a database of another schema) and a file SQLite
cannot read; it never overwrites either. Only :class:`unicron.control.cluster.Cluster` writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron.errors import UsageError

SCHEMA = "unicron-state/1"
DB = "state.db"
OURS = {
    *(DB + end for end in ("", ".new", "-wal", "-shm")),
    *("store.json", "store.log", "store.starting.json", "tasks", "token", "coordinator.log"),
    *("credentials.json", "credentials.json.tmp", "token.tmp"),
}
"""what a state directory may hold besides the database"""

_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, slots INTEGER NOT NULL,
    address TEXT NOT NULL, instance TEXT NOT NULL, registered_ts REAL NOT NULL
);
CREATE TABLE tasks (
    name TEXT PRIMARY KEY, uid TEXT UNIQUE NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
    submitted_ts REAL NOT NULL, placement TEXT NOT NULL, epoch INTEGER NOT NULL,
    workers INTEGER NOT NULL, committed_step INTEGER NOT NULL, last_fault TEXT NOT NULL,
    outcome TEXT, updated_ts REAL NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, task TEXT NOT NULL, ts REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX events_by_task ON events (task, id);
"""
_OWNERS = "CREATE TABLE IF NOT EXISTS owners (task TEXT PRIMARY KEY, owner TEXT NOT NULL);"
"""who submitted each task (added to a database of an older release when it is opened)"""

ACTIVE = ("pending", "running", "waiting")
"""the states of a task that holds slots"""
ENDED = ("done", "failed", "cancelled")
"""the states of a task that is over"""


@dataclass
class TaskRow:
    name: str
    uid: str
    spec: dict[str, Any]
    state: str
    submitted_ts: float
    placement: list[int]  # node id of each launch rank
    epoch: int = 0
    workers: int = 0
    committed_step: int = -1
    last_fault: str = ""
    outcome: dict[str, Any] | None = None


@dataclass
class NodeRow:
    id: int
    name: str
    slots: int
    address: str
    instance: str
    registered_ts: float


class State:
    """The open database (thread-safe: one connection behind a lock)."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._conn:  # commits, or rolls back on an exception
            yield self._conn

    # -- meta --------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def next_generation(self) -> int:
        """One more than the last coordinator's generation on this state, recorded: a
        coordinator that starts, or takes over as the leader, fences every earlier one's
        writes to the training store with it (:mod:`unicron.control.storeserver`, Fencing)."""
        with self._tx() as c:
            row = c.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
            generation = (0 if row is None else int(row[0])) + 1
            c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('generation', ?)",
                      (str(generation),))  # fmt: skip
        return generation

    # -- nodes -------------------------------------------------------------------------------
    def nodes(self) -> list[NodeRow]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, name, slots, address, instance, registered_ts FROM nodes ORDER BY id"
            ).fetchall()
        return [NodeRow(*r) for r in rows]

    def save_node(self, n: NodeRow) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO nodes (id, name, slots, address, instance, registered_ts)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (n.id, n.name, n.slots, n.address, n.instance, n.registered_ts),
            )

    # -- tasks -------------------------------------------------------------------------------
    def tasks(self) -> list[TaskRow]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT name, uid, spec, state, submitted_ts, placement, epoch, workers,"
                " committed_step, last_fault, outcome FROM tasks ORDER BY submitted_ts"
            ).fetchall()
        return [
            TaskRow(
                name=r[0],
                uid=r[1],
                spec=json.loads(r[2]),
                state=r[3],
                submitted_ts=r[4],
                placement=json.loads(r[5]),
                epoch=r[6],
                workers=r[7],
                committed_step=r[8],
                last_fault=r[9],
                outcome=None if r[10] is None else json.loads(r[10]),
            )
            for r in rows
        ]

    def save_task(self, t: TaskRow) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO tasks (name, uid, spec, state, submitted_ts, placement,"
                " epoch, workers, committed_step, last_fault, outcome, updated_ts)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    t.name,
                    t.uid,
                    json.dumps(t.spec),
                    t.state,
                    t.submitted_ts,
                    json.dumps(t.placement),
                    t.epoch,
                    t.workers,
                    t.committed_step,
                    t.last_fault,
                    None if t.outcome is None else json.dumps(t.outcome),
                    time.time(),
                ),
            )

    def rename_task(self, old: str, new: str) -> None:
        """Task ``old`` and its events go on under the name ``new`` (an ended task archived
        under its uid, so that its name can be used again), in one transaction."""
        with self._tx() as c:
            c.execute("UPDATE tasks SET name = ? WHERE name = ?", (new, old))
            c.execute("UPDATE events SET task = ? WHERE task = ?", (new, old))
            c.execute("UPDATE owners SET task = ? WHERE task = ?", (new, old))

    def owners(self) -> dict[str, str]:
        """Who submitted each task (a task submitted before owners were kept: none)."""
        with self._lock:
            rows = self._conn.execute("SELECT task, owner FROM owners").fetchall()
        return {str(t): str(o) for t, o in rows}

    def set_owner(self, task: str, owner: str) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO owners (task, owner) VALUES (?, ?)", (task, owner))

    # -- events ------------------------------------------------------------------------------
    def add_event(self, task: str, event: dict[str, Any]) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO events (task, ts, body) VALUES (?, ?, ?)",
                (task, float(event.get("ts", time.time())), json.dumps(event)),
            )

    def events(
        self, task: str, *, after: int = 0, limit: int = 10_000
    ) -> list[tuple[int, dict[str, Any]]]:
        """Events of ``task`` with an id above ``after``, oldest first: (id, event)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, body FROM events WHERE task = ? AND id > ? ORDER BY id LIMIT ?",
                (task, after, limit),
            ).fetchall()
        return [(int(i), json.loads(b)) for i, b in rows]

    def last_event(self, task: str, name: str) -> dict[str, Any] | None:
        """``task``'s newest event called ``name`` (an ``epoch_begin``: the membership a
        coordinator restarted without its store announces again), or ``None``."""
        found = self.last_events(task, name, 1)
        return found[0] if found else None

    def last_events(self, task: str, name: str, count: int) -> list[dict[str, Any]]:
        """``task``'s newest ``count`` events called ``name``, newest first."""
        pattern = f'%"event": {json.dumps(name)}%'
        with self._lock:
            rows = self._conn.execute(
                "SELECT body FROM events WHERE task = ? AND body LIKE ? ORDER BY id DESC LIMIT ?",
                (task, pattern, count),
            ).fetchall()
        return [dict(json.loads(r[0])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_state(state_dir: Path) -> State:
    """Open (or create, in an empty or new directory) the state of ``state_dir``."""
    state_dir = Path(state_dir)
    if state_dir.exists() and not state_dir.is_dir():
        raise UsageError(f"--state-dir {state_dir}: not a directory")
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)  # task specs, their env, the token: the owner's only
    path = state_dir / DB
    if not path.exists():
        foreign = sorted(p.name for p in state_dir.iterdir() if p.name not in OURS)
        if foreign:
            raise UsageError(
                f"--state-dir {state_dir}: not a Unicron state directory (holds "
                f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); "
                "use an empty or new directory"
            )
        tmp = state_dir / f"{DB}.new"  # built aside, then renamed: never half-created
        tmp.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))  # SQLite keeps the mode
        new = sqlite3.connect(tmp)
        new.executescript(_TABLES)
        with new:
            new.execute("INSERT INTO meta (key, value) VALUES ('schema', ?)", (SCHEMA,))
            new.execute(
                "INSERT INTO meta (key, value) VALUES ('created_ts', ?)", (repr(time.time()),)
            )
        new.close()
        os.replace(tmp, path)
        conn = sqlite3.connect(path, check_same_thread=False)
        return _ready(conn, path)
    try:
        conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, check_same_thread=False)
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        conn.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"--state-dir {state_dir}: {DB} is not a readable state ({exc})") from exc
    if row is None or row[0] != SCHEMA:
        conn.close()
        found = "no schema" if row is None else f"schema {row[0]!r}"
        raise UsageError(f"--state-dir {state_dir}: {DB} has {found}, expected {SCHEMA!r}")
    return _ready(conn, path)


def _ready(conn: sqlite3.Connection, path: Path) -> State:
    """WAL, the owners table, and the database's files the owner's only (SQLite gives its
    ``-wal`` and ``-shm`` files the database's mode; a database of an older release was
    created 0644)."""
    os.chmod(path, 0o600)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    with conn:
        conn.execute(_OWNERS)
    for end in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{end}", 0o600)
    return State(conn, path)
