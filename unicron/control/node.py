"""``unicron agent``: a node's agent on a cluster.

It registers its node with the cluster service (name, slots, address), heartbeats, and for
every task the service places on the node runs one supervisor (an
:class:`~unicron.control.agent.Agent`, the class ``unicron run`` uses, on its own thread)
whose link is a :class:`~unicron.control.client.TaskLink` over HTTP. When the coordinator is
away (restarting), the supervisors go on watching their workers and keep their reports,
and the node agent retries with backoff; when it is back, they reconnect and it adopts them.

An injected node fault (``node:node=N,step=S``) takes the whole node down: every task's
workers die and the agent exits without another word (exit code 3), as a lost machine.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unicron import messages as M
from unicron.control.workerenv import Account
from unicron.errors import UsageError

if TYPE_CHECKING:
    from unicron.control.agent import Agent, FatalError
    from unicron.control.client import Client

log = logging.getLogger("unicron.control.node")

REAP_S = 0.05
"""between two heartbeats, how often the node looks for tasks that ended (their workers are
stopped at once: a cancelled task's would train on) and for a vanished node"""
HEARTBEAT_S = 1.0
"""the node's heartbeat (the cluster's view of it: placement, ``status``; new assignments
come with its answer). A task's own judgement of the node comes from its supervisor's
exchanges (:class:`~unicron.control.client.TaskLink`), not from this"""
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
"""gloo's interface; without it gloo uses the address this host's name resolves to, which a
network namespace does not have (docs: unicron/control/netns.py)"""
VANISHED = 3
"""the exit code of an agent whose node fault fired"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from unicron.control.client import add_connection_arguments

    p.add_argument("--slots", type=int, default=1, metavar="N", help="worker slots (default 1)")
    p.add_argument(
        "--node-name", metavar="NAME", help="the node's name (default: this host's name)"
    )
    p.add_argument(
        "--log-dir", metavar="DIR", help="workers' output (default /tmp/unicron-agent-NAME)"
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="give up (exit 1) if the coordinator does not answer the first registration "
        "within S seconds (default 60; later outages are waited out)",
    )
    p.add_argument(
        "--run-as",
        metavar="USER",
        help="the unprivileged account (a name or a uid) the tasks' workers, their zygote and "
        "health probes run as; needed when the agent runs as root, unless --allow-root",
    )
    p.add_argument(
        "--allow-root",
        action="store_true",
        help="let the workers run as root (an agent started as root without --run-as, or "
        "--run-as root): the tasks' code then owns the node",
    )
    add_connection_arguments(p)


def account_of(run_as: str | None, allow_root: bool, euid: int) -> Account | None:
    """The account the tasks' processes run as, from ``--run-as`` and ``--allow-root`` for an
    agent running as ``euid``; ``None``: the agent's own. :class:`UsageError` for an unknown
    account, a root one not allowed, or ``--run-as`` without the root that switching needs."""
    if run_as is None:
        if euid == 0 and not allow_root:
            raise UsageError(
                "unicron agent runs as root: give --run-as USER (an unprivileged account for "
                "the tasks' workers) or --allow-root"
            )
        return None
    try:
        account = Account.named(run_as)
    except (KeyError, OverflowError):
        raise UsageError(f"--run-as {run_as!r}: no such account on this node") from None
    if account.uid == 0 and not allow_root:
        raise UsageError(f"--run-as {run_as!r} is root: add --allow-root to mean it")
    if euid not in (0, account.uid):
        raise UsageError(f"--run-as {run_as!r} needs an agent running as root (or as it)")
    return account


@dataclass
class _Running:
    agent: Agent
    thread: threading.Thread
    stop: threading.Event


class NodeAgent:
    """See the module docstring; :meth:`run` until ``stop`` is set or the node vanishes."""

    def __init__(
        self,
        client: Client,
        *,
        name: str,
        slots: int,
        log_dir: Path,
        per_task: bool = True,
        zygote: subprocess.Popen[bytes] | None = None,
        account: Account | None = None,
    ) -> None:
        self.client = client
        self.account = account
        """the account its tasks' processes run as (``--run-as``; None: the agent's)"""
        self.zygote = zygote
        """a zygote started ahead for the first task (``unicron run``), or None"""
        self.name = name
        self.slots = slots
        self.log_dir = log_dir
        self.per_task = per_task  # a directory per task under log_dir (``unicron run``: one task)
        self.instance = secrets.token_hex(8)
        self.gpus = _gpus()  # the coordinator places CUDA tasks only where there are GPUs
        self.node: int | None = None
        self.tasks: dict[str, _Running] = {}
        self.vanished = False
        self.errors: list[FatalError] = []  # every error that ended a worker, all tasks
        self.drain_s = 10.0
        """on stop, how long finished workers may take to exit by themselves (final files)"""
        self.interrupted = False  # set by interrupt(): stop without waiting for anyone
        self.address = ""
        self.ifname: str | None = None
        """the interface this node reaches the coordinator through (found on registering):
        its workers' gloo traffic goes there too (``GLOO_SOCKET_IFNAME``) unless the
        environment names one"""

    def register(self, stop: threading.Event, *, timeout_s: float | None = None) -> None:
        """Register, retrying with backoff while the service cannot be reached; with
        ``timeout_s`` (``unicron agent``'s first registration, ``--connect-timeout``) give up
        after that long with a :class:`SystemExit` that says why (exit code 1)."""
        import httpx

        from unicron.control.client import ServiceError

        backoff = 0.1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said = False
        while not stop.is_set():
            self.address = _address(self.client.url)
            self.ifname = _interface(self.address)
            try:
                got = self.client.request(
                    "POST",
                    "/v1/agents/register",
                    json={
                        "name": self.name,
                        "slots": self.slots,
                        "address": self.address,
                        "instance": self.instance,
                        "gpus": self.gpus,
                    },
                )
                self.node = int(got["node"])
                log.info(
                    "node %s registered as node %d (%d slot(s), address %s)",
                    self.name, self.node, self.slots, self.address,
                )  # fmt: skip
                return
            except httpx.TransportError as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise SystemExit(
                        f"unicron: error: node {self.name}: cannot reach the coordinator at "
                        f"{self.client.url} after {timeout_s:g} s: {exc or type(exc).__name__}"
                    ) from None
                if not said:
                    log.warning(
                        "node %s: the coordinator at %s does not answer (%s); retrying%s",
                        self.name, self.client.url, exc or type(exc).__name__,
                        "" if timeout_s is None else f" for {timeout_s:g} s",
                    )  # fmt: skip
                    said = True
                stop.wait(backoff)
                backoff = min(backoff * 2, 0.5)
            except ServiceError as exc:
                raise UsageError(
                    f"the coordinator refused node {self.name}: {exc.detail}"
                ) from None

    def run(self, stop: threading.Event, *, connect_timeout_s: float | None = None) -> int:
        """Register (giving up after ``connect_timeout_s``, if given), then heartbeat and run
        the tasks placed here until ``stop``; the exit code."""
        import httpx

        from unicron.control.client import ServiceError

        self.register(stop, timeout_s=connect_timeout_s)
        backoff = HEARTBEAT_S
        beat_at = 0.0
        away = False
        while not stop.is_set():
            if any(r.agent.vanished for r in self.tasks.values()):
                self._vanish()
                return VANISHED
            self._reap()  # a task that ended stops its workers now, not at the next heartbeat
            if time.monotonic() < beat_at:
                stop.wait(REAP_S)
                continue
            try:
                got = self.client.request(
                    "POST", f"/v1/agents/{self.name}/heartbeat", json={"instance": self.instance}
                )
                backoff = HEARTBEAT_S
                if away:
                    log.info("node %s: the coordinator answers again", self.name)
                    away = False
                for raw in got["tasks"]:
                    assignment = M.from_wire(raw)
                    if not isinstance(assignment, M.Assignment):
                        raise ValueError(f"not an assignment: {raw!r}")
                    running = self.tasks.get(assignment.uid)
                    if running is None:
                        self._start(assignment)
                    else:  # a lost store starts again, perhaps elsewhere: its workers ask
                        running.agent.store_address = assignment.store
            except httpx.TransportError as exc:
                backoff = min(backoff * 2, 0.5)  # the coordinator is away: its tasks go on
                if not away:
                    log.warning(
                        "node %s: the coordinator does not answer (%s); its tasks go on, "
                        "retrying", self.name, exc or type(exc).__name__,
                    )  # fmt: skip
                    away = True
            except ServiceError as exc:
                if exc.status == 404:  # a coordinator that lost us (a new state): register
                    self.register(stop)
                elif exc.status == 410:  # declared lost (a partition): fenced
                    self._fenced(stop, exc.detail)
                elif exc.status == 409:
                    log.error("node %s: %s; exiting", self.name, exc.detail)
                    self.stop()
                    return 1
            beat_at = time.monotonic() + backoff
        self.stop()
        return 0

    def _start(self, a: M.Assignment) -> None:
        from unicron.control.agent import Agent, AgentConfig
        from unicron.control.client import TaskLink
        from unicron.detect.classify import KINDS
        from unicron.runtime import device as D
        from unicron.runtime.inject import parse

        assert self.node is not None
        uid = a.uid
        gpus = D.gpu_count() if a.device == "cuda" else 0
        env = D.run_env(a.device, len(a.slots), gpus)
        if self.ifname is not None and GLOO_IFNAME not in os.environ:
            env[GLOO_IFNAME] = self.ifname
        env.update(a.env)  # the task file's word is last
        config = AgentConfig(
            node=self.node,
            slots=list(a.slots),
            script=a.script,
            argv=list(a.args),
            faults=[parse(s, KINDS) for s in a.inject],
            log_dir=self.log_dir / uid if self.per_task else self.log_dir,
            threads=a.threads,
            settings=a.settings,
            env=env,
            account=self.account,
            places=dict(zip(a.slots, a.places, strict=True)) if a.places else {},
        )
        holder: list[Agent] = []
        link = TaskLink(self.client, self.name, self.instance, uid, lambda: holder[0].census())
        agent = Agent(config, link, task=uid, store_address=a.store, store_key=a.store_key)
        holder.append(agent)
        stop = threading.Event()
        zygote, self.zygote = self.zygote, None  # the first task adopts it
        agent.start(zygote)
        thread = threading.Thread(target=agent.run, args=(stop,), name=f"task-{uid}", daemon=True)
        thread.start()
        self.tasks[uid] = _Running(agent, thread, stop)
        log.info("node %s: running task %s in slot(s) %s", self.name, uid, list(a.slots))

    def _reap(self) -> None:
        """Supervisors whose task is over and whose workers are gone end."""
        for uid, r in list(self.tasks.items()):
            if r.thread.is_alive():
                continue
            if all(not w.alive for w in r.agent.workers.values()) or r.agent.reply.finished:
                self._end(uid)

    def _end(self, uid: str) -> None:
        """Let workers that finished the task exit by themselves (they may still be writing
        their files; at most :attr:`drain_s`), then stop its supervisor and any worker left
        (those of a failed or cancelled task at once: they would train on)."""
        from unicron.control.workerstate import WorkerState

        r = self.tasks.pop(uid)
        deadline = time.time() + (0.0 if self.interrupted else self.drain_s)
        while time.time() < deadline and any(
            w.state is WorkerState.DONE for w in r.agent.workers.values()
        ):
            r.agent.poll(0.02)
        r.agent.stop()
        self.errors += r.agent.errors

    def _fenced(self, stop: threading.Event, why: str) -> None:
        """The coordinator declared this node lost while it could not hear it (a partition):
        its tasks went on without it, so every worker here holds an epoch that is over. They
        stop now (no drain: their work is void), and the agent registers again as a new
        process would, which brings the node back to its tasks with fresh workers."""
        log.warning("%s (fenced)", why)
        interrupted, self.interrupted = self.interrupted, True
        self.kill_all()
        self.stop()
        self.interrupted = interrupted
        self.instance = secrets.token_hex(8)
        self.register(stop)

    def interrupt(self) -> None:
        """The run is interrupted: from now on nothing waits for workers to end by
        themselves (a signal handler may call it)."""
        self.interrupted = True

    def kill_all(self) -> None:
        """Every worker of every task on this node dies now (``unicron run`` interrupted);
        from any thread. :meth:`stop` then cleans up."""
        self.interrupted = True
        for r in list(self.tasks.values()):
            r.agent.kill_all()

    def _vanish(self) -> None:
        self.vanished = True
        for r in self.tasks.values():
            r.agent.vanish()
            r.stop.set()
            r.agent.wake()

    def stop(self) -> None:
        """Stop every supervisor (after a drain of :attr:`drain_s`) and their workers."""
        for r in self.tasks.values():
            r.stop.set()
            r.agent.wake()
        for uid, r in list(self.tasks.items()):
            r.thread.join(timeout=5.0)
            self._end(uid)


def _gpus() -> int:
    """This node's CUDA devices: 0 without an NVIDIA device node (no need to import torch to
    know), else what torch counts."""
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return 0
    from unicron.runtime import device as D

    return D.gpu_count()


def _address(url: str) -> str:
    """This host's address as the coordinator sees it (the source address of a connection to
    it), for the node table."""
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=2) as s:
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _interface(address: str) -> str | None:
    """The name of the interface (in this network namespace) that holds IPv4 ``address``;
    ``None`` if none does (or not on Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915  # Linux: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


def main(args: argparse.Namespace) -> int:
    import re

    from unicron.control.client import connect
    from unicron.control.taskspec import NAME

    if args.slots < 1:
        raise UsageError(f"--slots must be >= 1, got {args.slots}")
    if not args.connect_timeout > 0:
        raise UsageError(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout}")
    name = args.node_name or socket.gethostname()
    if not re.match(NAME, name):
        raise UsageError(f"--node-name {name!r}: letters, digits, '.', '_', '-' only")
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.setLevel(logging.INFO)
    account = account_of(args.run_as, args.allow_root, os.geteuid())
    if account is not None and (why := account.cannot_run()) is not None:
        raise UsageError(f"--run-as {args.run_as}: that account cannot run unicron here ({why})")
    log_dir = Path(args.log_dir or f"/tmp/unicron-agent-{name}")
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # workers' output: the owner's only
    if account is not None:  # ... the workers' account's (their zygote writes their logs)
        account.owns(log_dir)
    client = connect(args)
    agent = NodeAgent(client, name=name, slots=args.slots, log_dir=log_dir, account=account)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info(
        "unicron agent: node %s, %d slot(s), connecting to %s (worker logs in %s)",
        name, args.slots, client.url, log_dir,
    )  # fmt: skip
    gc.freeze()  # the imports' objects: the collector's full passes skip them (runner.main)
    try:
        code = agent.run(stop, connect_timeout_s=args.connect_timeout)
    except KeyboardInterrupt:
        stop.set()
        agent.stop()
        return 130
    if code == VANISHED:
        os._exit(VANISHED)  # a lost machine says nothing more
    return code
