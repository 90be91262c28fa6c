"""Many hosts on one machine: network namespaces on a bridge (iproute2), for tests and demos.

A :class:`Lab` makes ``hosts`` network namespaces, each joined by a veth pair to one bridge
on the host side, with addresses in a private ``/24`` (``10.213.X.0/24``, ``X`` chosen so
that no address or route of this machine is in it): the host side (where a coordinator
listens) is ``.1``, namespace ``i`` is ``.(i + 2)``; loopback is up in each. Commands run in
a namespace with ``ip netns exec`` (:meth:`Lab.popen`, the environment passed). Nothing is
routed anywhere else: traffic stays on loopback and the lab's bridge.

:meth:`Lab.close` (also on leaving the ``with`` block, and idempotent) kills what still runs
in the namespaces, then removes them, their veths and the bridge; a lab whose process died
without closing it is swept by the next :func:`sweep` (a record per lab under
``/tmp/unicron-netns``). :func:`available` says why a lab cannot be made here (not root, no
``ip``, namespaces refused); callers then use :class:`LoopbackLab`, the same interface on
distinct loopback addresses (``127.0.0.2``, ...) without isolation.

Gloo between namespaces: gloo picks its interface from this machine's hostname unless
``GLOO_SOCKET_IFNAME`` is set, and in a namespace the hostname's address is not there (gloo
falls back to loopback, and peers in other namespaces are unreachable). The agent
(:mod:`unicron.control.node`) therefore sets ``GLOO_SOCKET_IFNAME`` for its workers to the
interface it reaches the coordinator through, unless the user set it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

RECORDS = Path("/tmp/unicron-netns")
"""one JSON record per live lab (its owner's pid and names), for :func:`sweep`"""
SUBNETS = "10.213"
"""labs take a free ``/24`` in ``10.213.0.0/16``"""


class LabError(RuntimeError):
    """A lab could not be made (the command and its error, one line)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise LabError(f"ip {' '.join(args)}: {err[0] if err else f'exit {proc.returncode}'}")
    return proc


_AVAILABLE: list[str | None] = []


def available() -> str | None:
    """``None`` if network namespaces can be made here, else why not (one line). Probed once
    per process (a namespace made and removed)."""
    if _AVAILABLE:
        return _AVAILABLE[0]
    why: str | None = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif shutil.which("ip") is None:
        why = "no `ip` command (iproute2)"
    else:
        probe = f"ucprobe{os.getpid()}"
        try:
            _ip("netns", "add", probe)
            _ip("link", "add", f"ucp{os.getpid() % 100000}", "type", "bridge")
        except (LabError, OSError, subprocess.TimeoutExpired) as exc:
            why = f"cannot make a network namespace or bridge: {exc}"
        finally:
            _ip("link", "del", f"ucp{os.getpid() % 100000}", check=False)
            _ip("netns", "del", probe, check=False)
    _AVAILABLE.append(why)
    return why


@dataclass(frozen=True)
class Host:
    """One host of a lab: its namespace (``None`` on loopback) and address."""

    index: int
    netns: str | None
    address: str
    ifname: str


@dataclass
class Lab:
    """``hosts`` namespaces on a bridge (see the module docstring). Use as a context manager;
    :meth:`close` is idempotent and runs after any failure of the set-up too."""

    hosts: int = 2
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    """names its devices (``uc{tag}br``, ``uc{tag}n0``, ...); taken only if no lab holds it"""
    members: list[Host] = field(default_factory=list, init=False)
    host_address: str = field(default="", init=False)
    """the bridge's address: where a service on the host side listens for the namespaces"""
    bridge: str = field(default="", init=False)
    _closed: bool = field(default=False, init=False)
    _owned: bool = field(default=False, init=False)
    _started: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be in 1..200, got {self.hosts}")
        self.bridge = f"uc{self.tag}br"
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        RECORDS.mkdir(parents=True, exist_ok=True)
        with open(RECORDS / ".lock", "w") as lock:  # one lab picks its subnet at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep()
            net = _free_subnet()
            if (RECORDS / f"{self.tag}.json").exists() or f"uc{self.tag}n0" in _ip(
                "netns", "list", check=False
            ).stdout:
                raise LabError(f"lab tag {self.tag} is taken")  # never remove another lab's
            self._record(net)
            self._owned = True
            _ip("link", "add", self.bridge, "type", "bridge")
            self.host_address = f"{net}.1"
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.hosts):
            ns, outer, inner = f"uc{self.tag}n{i}", f"uc{self.tag}h{i}", f"uc{self.tag}v{i}"
            address = f"{net}.{i + 2}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.members.append(Host(i, ns, address, inner))

    def _record(self, net: str) -> None:
        body = {"pid": os.getpid(), "tag": self.tag, "hosts": self.hosts, "net": net}
        tmp = RECORDS / f"{self.tag}.json.tmp"
        tmp.write_text(json.dumps(body))
        os.replace(tmp, RECORDS / f"{self.tag}.json")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in host ``host``'s namespace."""
        ns = self.members[host].netns
        return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]

    def cut(self, host: int) -> None:
        """Cut host ``host`` off the lab (its link down: a partition, not a death: what runs
        there goes on, unable to reach anyone, and nobody reaches it)."""
        h = self.members[host]
        assert h.netns is not None
        _ip("-n", h.netns, "link", "set", h.ifname, "down")

    def restore(self, host: int) -> None:
        """Bring the link of host ``host`` back (:meth:`cut` undone; its address stayed)."""
        h = self.members[host]
        assert h.netns is not None
        _ip("-n", h.netns, "link", "set", h.ifname, "up")

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in host ``host`` (its own session, so that it can be killed with
        everything it started)."""
        proc = _popen(self.command(host, argv), env, stdout, stderr, cwd)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        """Kill what runs in the namespaces, remove them, the veths and the bridge."""
        if self._closed:
            return
        self._closed = True
        for proc in self._started:  # one still entering its namespace is not listed there yet
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self._owned:
            _remove(self.tag, self.hosts)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class LoopbackLab:
    """The fallback of :class:`Lab` where namespaces cannot be made: the same interface, host
    ``i`` at ``127.0.0.(i + 2)``, commands run directly (no isolation: every process shares
    this machine's network)."""

    hosts: int = 2
    members: list[Host] = field(default_factory=list, init=False)
    host_address: str = field(default="127.0.0.1", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be in 1..200, got {self.hosts}")
        self.members = [Host(i, None, f"127.0.0.{i + 2}", "lo") for i in range(self.hosts)]

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        return _popen(argv, env, stdout, stderr, cwd)

    def close(self) -> None:
        pass

    def __enter__(self) -> LoopbackLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _popen(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    stdout: IO[Any] | int | None,
    stderr: IO[Any] | int | None,
    cwd: str | Path | None,
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        stdout=stdout,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
    )


def make(hosts: int) -> Lab | LoopbackLab:
    """A namespace lab if :func:`available`, else the loopback one."""
    return Lab(hosts) if available() is None else LoopbackLab(hosts)


def _free_subnet() -> str:
    """A ``10.213.X`` prefix that no address or route of this machine (nor another lab)
    touches."""
    used: set[ipaddress.IPv4Network] = set()
    for args in (("-o", "-4", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for word in _ip(*args, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                used.add(ipaddress.IPv4Network(word, strict=False))
    for rec in RECORDS.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            used.add(ipaddress.IPv4Network(json.loads(rec.read_text())["net"] + ".0/24"))
    for x in range(256):
        net = ipaddress.IPv4Network(f"{SUBNETS}.{x}.0/24")
        if not any(net.overlaps(u) and u.prefixlen > 0 for u in used):
            return f"{SUBNETS}.{x}"
    raise LabError(f"no free /24 in {SUBNETS}.0.0/16")


def _remove(tag: str, hosts: int) -> None:
    """Remove lab ``tag``: every process in its namespaces (SIGKILL), the namespaces (their
    veth ends go with them), the host-side veths and the bridge. Idempotent."""
    for i in range(hosts):
        ns = f"uc{tag}n{i}"
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"uc{tag}h{i}", check=False)
    _ip("link", "del", f"uc{tag}br", check=False)
    (RECORDS / f"{tag}.json").unlink(missing_ok=True)


def sweep() -> list[str]:
    """Remove the labs whose owner process is gone (killed before it could close them)."""
    swept = []
    for rec in sorted(RECORDS.glob("*.json")) if RECORDS.is_dir() else []:
        try:
            d = json.loads(rec.read_text())
            pid, tag, hosts = int(d["pid"]), str(d["tag"]), int(d["hosts"])
        except (OSError, ValueError, KeyError):
            continue
        if not _alive(pid):
            _remove(tag, hosts)
            swept.append(tag)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def lab(hosts: int) -> Iterator[Lab | LoopbackLab]:
    """``with lab(3) as net: ...``: :func:`make`, closed on the way out."""
    made = make(hosts)
    try:
        yield made
    finally:
        made.close()
