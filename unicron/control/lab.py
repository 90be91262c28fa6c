"""A whole cluster on one machine, for the end-to-end tests and ``make cluster-demo``.

:class:`LocalCluster` starts ``unicron coordinator`` on the host side of a
:mod:`unicron.control.netns` lab (or on loopback where namespaces cannot be made) and one
``unicron agent`` per host, each inside its namespace, as separate processes exactly as a
user would; it can ``kill -9`` and restart either, submit tasks and read their state through
the HTTP API. :meth:`LocalCluster.close` (idempotent; also on leaving the ``with`` block)
leaves nothing behind: every process it started, and every process they started (workers,
zygotes, the store), carries a marker in its environment and is killed by it, then the
namespaces go.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unicron.control import netns
from unicron.control.client import Client, ServiceError

MARKER = "UNICRON_LAB"
"""in the environment of every process of a :class:`LocalCluster` (inherited by workers)"""
ROOT = Path(__file__).resolve().parents[2]


class LocalCluster:
    """See the module docstring. ``root`` holds the state directory and every log."""

    def __init__(
        self,
        root: Path,
        *,
        hosts: int = 2,
        slots: int = 2,
        node_timeout_s: float = 2.0,
        loopback: bool = False,
        coordinator_args: tuple[str, ...] = (),
        coordinator_hosts: tuple[int, ...] = (),
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.root / "state"
        self.hosts, self.slots, self.node_timeout_s = hosts, slots, node_timeout_s
        self.coordinator_args = coordinator_args  # more ``unicron coordinator`` options
        self.token = secrets.token_urlsafe(16)
        self.tag = secrets.token_hex(4)
        self.net: netns.Lab | netns.LoopbackLab = (
            netns.LoopbackLab(hosts) if loopback else netns.make(hosts)
        )
        self.port = _free_port(self.net.host_address)
        self.url = f"http://{self.net.host_address}:{self.port}"
        # coordinators in hosts of their own (a leader and its standbys: one URL each, the
        # agents and this client given all of them), else one on the host side
        self.coordinator_hosts = coordinator_hosts
        if coordinator_hosts:
            self.url = ",".join(
                f"http://{self.net.members[h].address}:{self.port}" for h in coordinator_hosts
            )
        self.coordinators: dict[int, subprocess.Popen[bytes]] = {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self._starts = 0
        self.client = Client(self.url, self.token, timeout_s=10.0)
        self._closed = False

    @property
    def isolated(self) -> bool:
        """True when the hosts are network namespaces (False: the loopback fallback)."""
        return isinstance(self.net, netns.Lab)

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "UNICRON_TOKEN": self.token,
            MARKER: self.tag,
        }

    # -- the coordinator ---------------------------------------------------------------------
    def start_coordinator(
        self, *, timeout_s: float = 60.0, host: int | None = None, wait: bool = True
    ) -> None:
        """Start ``unicron coordinator`` on the host side (or in host ``host``, one of the
        ``coordinator_hosts``) and, with ``wait``, wait until it answers."""
        self._starts += 1
        log = open(self.root / f"coordinator.{self._starts}.log", "wb")  # noqa: SIM115
        address = self.net.host_address if host is None else self.net.members[host].address
        argv = [sys.executable, "-m", "unicron", "coordinator", "--host", address,
                "--port", str(self.port), "--state-dir", str(self.state_dir),
                "--node-timeout", str(self.node_timeout_s),
                "--insecure-http",  # a network namespace of the test's own: nobody else on it
                *self.coordinator_args]  # fmt: skip
        if host is None:
            self.coordinator = subprocess.Popen(
                argv, env=self.env(), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            proc = self.coordinator
        else:
            proc = self.coordinators[host] = self.net.popen(
                host, argv, env=self.env(), stdout=log, stderr=log
            )
        log.close()
        if not wait:
            return
        self._until(
            lambda: self._answers() or _exited(proc, "the coordinator"), timeout_s, "coordinator"
        )

    def kill_coordinator(self) -> None:
        """``kill -9`` the coordinator (its store lives on, as after a crash)."""
        assert self.coordinator is not None
        self.coordinator.kill()
        self.coordinator.wait()
        self.coordinator = None

    def _answers(self) -> bool:
        import httpx

        try:
            self.client.request("GET", "/v1/nodes")
            return True
        except (httpx.TransportError, ServiceError):
            return False

    def start_etcd(self) -> str:
        """Start etcd (the distribution's ``etcd-server``) on the host side, for coordinators
        that lead through its lease (``--etcd``); its client URL. It carries the lab's marker:
        :meth:`close` ends it."""
        at = self.net.host_address
        client, peer = _free_port(at), _free_port(at)
        log = open(self.root / "etcd.log", "wb")  # noqa: SIM115
        subprocess.Popen(
            etcd_command(self.root / "etcd", at, client, peer), env=self.env(), stdout=log,
            stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()
        return f"http://{at}:{client}"

    # -- agents ------------------------------------------------------------------------------
    def start_agent(self, host: int, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Start the agent of host ``host`` (node name ``n{host}``) in its namespace; with
        ``wait``, until the coordinator shows the node up."""
        name = f"n{host}"
        log = open(self.root / f"agent-{name}.log", "ab")  # noqa: SIM115
        self.agents[host] = self.net.popen(
            host,
            [sys.executable, "-m", "unicron", "agent", "--coordinator", self.url,
             "--slots", str(self.slots), "--node-name", name,
             "--log-dir", str(self.root / f"workers-{name}"), "--allow-root"],
            env=self.env(), stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        if wait:
            proc = self.agents[host]
            self._until(
                lambda: self.node(name).get("state") == "up" or _exited(proc, f"agent {name}"),
                timeout_s,
                f"node {name} up",
            )

    def kill_agent(self, host: int) -> None:
        """``kill -9`` the agent of host ``host``: its node is lost as a crashed machine is
        (its zygote and workers die with it, by their parent-death signal)."""
        proc = self.agents.pop(host)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def wait_nodes(self, count: int, *, timeout_s: float = 60.0) -> None:
        """Until ``count`` nodes are up (an agent that exits first fails it)."""

        def up() -> bool:
            for host, proc in self.agents.items():
                _exited(proc, f"agent n{host}")
            nodes = self.client.request("GET", "/v1/nodes")
            return sum(n["state"] == "up" for n in nodes) >= count

        self._until(up, timeout_s, f"{count} nodes up")

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        self._until(check, timeout_s, what)

    def node(self, name: str) -> dict[str, Any]:
        nodes = self.client.request("GET", "/v1/nodes")
        return next((n for n in nodes if n["name"] == name), {})

    # -- tasks -------------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(self.client.request("POST", "/v1/tasks", json=spec))

    def task(self, name: str) -> dict[str, Any]:
        return dict(self.client.request("GET", f"/v1/tasks/{name}"))

    def events(self, name: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            got = self.client.request("GET", f"/v1/tasks/{name}/events", params={"after": after})
            out += got["events"]
            if not got["events"]:
                return out
            after = got["last"]

    def wait_task(
        self,
        name: str,
        until: Callable[[dict[str, Any]], bool] | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Poll the task until ``until(view)`` (default: it ended); its last view."""
        import httpx

        ended = until or (lambda v: v["state"] in ("done", "failed", "cancelled"))
        seen: list[dict[str, Any]] = []

        def check() -> bool:
            try:
                seen[:] = [self.task(name)]
            except httpx.TransportError:
                return False
            return ended(seen[0])

        self._until(check, timeout_s, f"task {name}")
        return seen[0]

    def _until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached in {timeout_s:.0f} s (logs: {self.root})")
            time.sleep(0.1)

    # -- the end -----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process of this cluster (marked ones too), remove the namespaces."""
        if self._closed:
            return
        self._closed = True
        self.client.close()
        procs = [*self.agents.values(), *self.coordinators.values(),
                 *([self.coordinator] if self.coordinator else [])]  # fmt: skip
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        kill_marked(self.tag)
        self.net.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def etcd_command(data_dir: Path, host: str, client: int, peer: int) -> list[str]:
    """A one-member etcd serving clients at ``http://host:client`` (its data in ``data_dir``):
    the lab's (:meth:`LocalCluster.start_etcd`) and the lease tests'."""
    return ["etcd", "--data-dir", str(data_dir), "--name", "lab",
            "--listen-client-urls", f"http://{host}:{client}",
            "--advertise-client-urls", f"http://{host}:{client}",
            "--listen-peer-urls", f"http://{host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"lab=http://{host}:{peer}"]  # fmt: skip


def kill_marked(tag: str) -> list[int]:
    """SIGKILL every process whose environment holds ``UNICRON_LAB=tag``; their pids."""
    want = f"{MARKER}={tag}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if want in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def _exited(proc: subprocess.Popen[bytes], what: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"{what} exited with code {proc.returncode}")
    return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
