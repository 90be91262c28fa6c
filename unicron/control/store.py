"""The cluster's training store, served by a process of its own so that it outlives the coordinator.

Every task's process groups rendezvous on this store and its workers read their epochs from
it (:mod:`unicron.protocol`), so it must not die with the coordinator: a coordinator
killed with ``kill -9`` takes the HTTP API and the decisions away, not the training.
:func:`ensure` (called by the cluster service at start-up) adopts the store that
``STATE_DIR/store.json`` names if it still answers, else starts a new one
(``python -m unicron.control.store``, in its own session) and records it there (atomically).
The service stops it only on a clean shutdown (:func:`stop`). ``unicron run`` starts one as
its child (:func:`start` with ``die_with_us``), which dies with it.

A store that dies while the service runs is started again at once
(:class:`unicron.control.keeper.Keeper`), on the same port where
it is free, and every running task goes on through it: its coordinator writes there again
what the workers read and announces a new epoch of the same members
(:meth:`unicron.control.coordinator.Coordinator.store_moved`); each worker left its epoch
when the store stopped answering and asks its agent where the store serves now
(:class:`unicron.runtime.group.StoreLost`). Nothing of the old store's keys is needed: the
coordinator holds the task's membership, and the workers' ledger exchange settles a step
whose commit vote the store took with it.

The server is :mod:`unicron.control.storeserver`: torch's TCPStore protocol behind a door
that admits a key only under its task's capability, made from the store's secret
(``STATE_DIR/store.secret``, 0600, written once; docs/security.md). :func:`client` is a
connection that puts a task's capability in front of every key: the coordinator's of each
task, and every worker's (:mod:`unicron.worker`). The store's process imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron.control import storeserver
from unicron.control.credentials import write_private
from unicron.control.storeserver import capability
from unicron.detect.busy import process_state
from unicron.protocol import host_port, store_answers

RECORD = "store.json"
"""in the state directory: the store's host, port and process id"""
STARTING = "store.starting.json"
"""... as a store just started wrote it (:func:`start`), before :func:`ensure` records it"""
SECRET = "store.secret"
"""in the state directory: the secret the store's capabilities are made from (0600)"""
PING_UID = "unicron"
"""the key space :func:`ensure` asks a recorded store about before adopting it"""


@dataclass(frozen=True)
class StoreInfo:
    host: str
    port: int
    pid: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def client(address: str, key: str, timeout_s: float = 60.0) -> Any:
    """A connection to the store at ``host:port`` that opens the keys of the task whose
    capability is ``key`` (:func:`~unicron.control.storeserver.capability`; one connection
    per user: a client serves one request at a time)."""
    import torch.distributed as dist

    host, port = host_port(address)
    tcp = dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=timeout_s))
    return dist.PrefixStore(key, tcp)


def secret_of(state_dir: Path) -> bytes:
    """The store's secret for ``state_dir``: read, or made and written now (0600)."""
    path = state_dir / SECRET
    if not path.exists():
        write_private(path, secrets.token_hex(32))
    return bytes.fromhex(path.read_text(encoding="ascii").strip())


def _answers(info: StoreInfo, secret: bytes, host: str) -> bool:
    # torch's client may wait for ever on a listener: ping first (briefly when the store is on
    # another host, a lost leader's, whose silence a standby taking over must not wait out)
    if not store_answers(info.address, 1.0 if info.host == host else 0.25):
        return False
    try:
        store = client(info.address, capability(secret, PING_UID), 2.0)
        store.check([f"{PING_UID}/ping"])
        return True
    except Exception:  # refused, timed out, another secret: not ours
        return False


def read_record(state_dir: Path, name: str = RECORD) -> StoreInfo | None:
    """The store ``state_dir/name`` records (:data:`RECORD`, or :data:`STARTING`: what a store
    just started wrote), or ``None``."""
    try:
        d = json.loads((state_dir / name).read_text(encoding="utf-8"))
        return StoreInfo(str(d["host"]), int(d["port"]), int(d["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start(state_dir: Path, host: str, *, die_with_us: bool = False, port: int = 0
          ) -> tuple[StoreInfo, subprocess.Popen[bytes]]:  # fmt: skip
    """A new store serving ``state_dir``'s secret on ``host`` and ``port`` if free (0, or
    taken: a free one); its log is ``state_dir/store.log``. It runs in a session of its own
    (:func:`first_in_line`; a cluster's store outlives a ``kill -9`` of the coordinator);
    ``die_with_us``: it is killed when this process dies (``unicron run``)."""
    secret_of(state_dir)
    ready = state_dir / STARTING
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "unicron.control.store", "--host", host,
            "--secret-file", str(state_dir / SECRET), "--out", str(ready),
            "--port", str(port)]  # fmt: skip
    if die_with_us:
        argv.append("--die-with-parent")
    fd = os.open(state_dir / "store.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(fd, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own autogroup (first_in_line); dies with us by prctl
        )
    deadline = time.time() + 60.0
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the store did not start (see {state_dir / 'store.log'})")
        time.sleep(0.01)
    info = read_record(state_dir, STARTING)
    assert info is not None  # written whole (atomically) by the store
    return info, proc


def ensure(state_dir: Path, host: str) -> tuple[StoreInfo, bool]:
    """The store of this state directory: the recorded one if it answers to this
    directory's secret (``True``: adopted), else a new one started now (``False``) and
    recorded (atomically)."""
    found = read_record(state_dir)
    if found is not None and _answers(found, secret_of(state_dir), host):
        return found, True
    port = found.port if found is not None and found.host == host else 0  # where workers look
    info, _ = start(state_dir, host, port=port)
    os.replace(state_dir / STARTING, state_dir / RECORD)
    return info, False


def alive(info: StoreInfo) -> bool:
    """Whether the store process of ``info`` (started on this host) still runs: the cluster's
    ticker asks at every tick (:meth:`unicron.control.cluster.Cluster.tick`)."""
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(info.pid) != "Z"


def stop(state_dir: Path) -> None:
    """Stop the recorded store (a clean shutdown of the cluster)."""
    info = read_record(state_dir)
    if info is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, signal.SIGTERM)
        (state_dir / RECORD).unlink(missing_ok=True)


STORE_NICE = -10
"""the store process's scheduling priority where it may raise it (root, or CAP_SYS_NICE)"""


def first_in_line() -> None:
    """Put the store ahead of the training for the CPU: every worker's vote, epoch check and
    rendezvous waits on its one thread, and a store starved behind busy workers answered
    nobody for up to 4 s (the soak with changes of degree: every worker gave up its request
    after 3 s at once, ``StoreLost``, and the task fell back to its checkpoint). A nicer value
    where the process may take one, and its own scheduling group under the kernel's
    autogroup (it runs in a session of its own: :func:`start`), weighed as much as all the
    workers of a node together."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, STORE_NICE)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write(str(STORE_NICE))


def main(argv: list[str] | None = None) -> int:
    """``python -m unicron.control.store --host H --secret-file F --out FILE``: serve the
    store on a free port of ``H`` until SIGTERM; write host, port and pid to FILE
    (atomically) once it listens."""
    p = argparse.ArgumentParser(prog="python -m unicron.control.store")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=0, help="tried first (0: any free port)")
    p.add_argument("--secret-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--die-with-parent", action="store_true")
    args = p.parse_args(argv)
    if args.die_with_parent:
        from unicron.runtime.launcher import die_with_parent

        die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    first_in_line()
    secret = bytes.fromhex(Path(args.secret_file).read_text(encoding="ascii").strip())
    sock = storeserver.listen(args.host, args.port)

    def ready() -> None:
        record = {"host": args.host, "port": sock.getsockname()[1], "pid": os.getpid()}
        write_private(Path(args.out), json.dumps(record))

    async def run() -> None:
        stop_ = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_.set)
        await storeserver.serve(sock, secret, ready, stop_)

    try:  # libuv's event loop (a dependency off Windows): the store's requests cost less
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
