"""A live cluster on this machine for the cluster benchmarks: ``unicron coordinator`` and
``unicron agent`` processes on loopback, talked to over the HTTP API like any user.

:class:`LiveCluster` starts the coordinator (on a free port, a fresh state directory, a
token of its own) and agents, submits tasks, kills and restarts the coordinator, and tears
everything down again, the cluster's store (its own process, :mod:`unicron.control.store`)
included. :class:`EventTail` follows a task's event log file and stamps every line with
the moment it appeared, which is when the coordinator logged it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import free_port
from bench.systems.base import Launched, TrialError, python

STORE_RECORD = "store.json"


@dataclass
class Stamped:
    """One event-log line and when it appeared in the file (``seen``, Unix seconds)."""

    seen: float
    event: dict[str, Any]


@dataclass
class EventTail:
    """Follows ``path`` (JSON Lines, appended to) from a thread, every ``poll_s``."""

    path: Path
    poll_s: float = 0.01
    lines: list[Stamped] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> EventTail:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        offset, partial = 0, b""
        while not self._stop.is_set():
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            seen = time.time()
            if data:
                offset += len(data)
                chunks = (partial + data).split(b"\n")
                partial = chunks.pop()
                got = [json.loads(c) for c in chunks if c.strip()]
                with self._lock:
                    self.lines += [Stamped(seen, e) for e in got]
            self._stop.wait(self.poll_s)

    def snapshot(self) -> list[Stamped]:
        with self._lock:
            return list(self.lines)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def loadavg() -> str:
    """This machine's load averages (1, 5, 15 min) and core count, for a row's note."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load average {one} {five} {fifteen} on {os.cpu_count()} cores"


class LiveCluster:
    """A coordinator and agents in ``workdir`` (see the module docstring)."""

    def __init__(self, workdir: Path, *, node_timeout_s: float = 2.0) -> None:
        from unicron.control.client import Client

        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(16)
        self.env = {"UNICRON_TOKEN": self.token}
        self.node_timeout_s = node_timeout_s
        self.coordinator: Launched | None = None
        self.starts = 0
        self.agents: dict[str, Launched] = {}
        self.client = Client(self.url, self.token, timeout_s=5.0)

    # -- processes ---------------------------------------------------------------------------
    def start_coordinator(self) -> float:
        """Start ``unicron coordinator`` on the state directory; the time it was started."""
        self.starts += 1
        cmd = [python(), "-m", "unicron", "coordinator", "--state-dir", str(self.state_dir),
               "--port", str(self.port), "--node-timeout", str(self.node_timeout_s)]  # fmt: skip
        t0 = time.time()
        self.coordinator = Launched.start(
            cmd, self.workdir / f"coordinator{self.starts}.log", env=self.env
        )
        return t0

    def answers(self, timeout_s: float = 120.0, poll_s: float = 0.01) -> float:
        """Wait until the service answers an authorized request; the time it first did."""
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.coordinator is not None
            if self.coordinator.poll() is not None:
                raise TrialError(f"the coordinator exited: {self.coordinator.last_line()}")
            try:
                self.client.request("GET", "/v1/nodes")
                return time.time()
            except httpx.TransportError:
                time.sleep(poll_s)
        raise TrialError(f"the coordinator did not answer within {timeout_s:.0f} s")

    def kill_coordinator(self) -> float:
        """SIGKILL the coordinator process alone (not its store); the time it was sent."""
        assert self.coordinator is not None
        t = time.time()
        os.kill(self.coordinator.proc.pid, signal.SIGKILL)
        self.coordinator.proc.wait(timeout=10)
        return t

    def start_agent(self, name: str, slots: int) -> Launched:
        logs = str(self.workdir / f"agent-{name}")
        cmd = [python(), "-m", "unicron", "agent", "--coordinator", self.url, "--slots",
               str(slots), "--node-name", name, "--log-dir", logs, "--allow-root"]  # fmt: skip
        agent = Launched.start(cmd, self.workdir / f"agent-{name}.log", env=self.env)
        self.agents[name] = agent
        return agent

    def wait_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            up = [n for n in self.client.request("GET", "/v1/nodes") if n["state"] == "up"]
            if len(up) >= count:
                return
            time.sleep(0.1)
        raise TrialError(f"fewer than {count} nodes registered within {timeout_s:.0f} s")

    # -- tasks -------------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        view: dict[str, Any] = self.client.request("POST", "/v1/tasks", json=spec)
        return view

    def task(self, name: str) -> dict[str, Any]:
        view: dict[str, Any] = self.client.request("GET", f"/v1/tasks/{name}")
        return view

    def events_path(self, uid: str) -> Path:
        return self.state_dir / "tasks" / uid / "events.jsonl"

    def wait_ended(self, name: str, timeout_s: float) -> dict[str, Any]:
        """Wait until task ``name`` ended (done, failed, cancelled); its view."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            view = self.task(name)
            if view["state"] in ("done", "failed", "cancelled"):
                return view
            time.sleep(0.2)
        raise TrialError(f"task {name} did not end within {timeout_s:.0f} s")

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the agents (their workers with them), the coordinator and the store."""
        for agent in self.agents.values():
            agent.stop(grace_s=10.0)
        if self.coordinator is not None:
            self.coordinator.stop(grace_s=5.0)
        record = self.state_dir / STORE_RECORD
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads(record.read_text())["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"unicron.control.store" in cmdline:
                os.kill(pid, signal.SIGKILL)
        self.client.close()
