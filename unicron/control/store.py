"""The cluster's TCPStore, served by a process of its own so that it outlives the coordinator.

Every task's process groups rendezvous on this store and its workers read their epochs from
it (:mod:`unicron.protocol`), so it must not die with the coordinator: a coordinator
killed with ``kill -9`` takes the HTTP API and the decisions away, not the training.
:func:`ensure` (called by the cluster service at start-up) adopts the store that
``STATE_DIR/store.json`` names if it still answers, else starts a new one
(``python -m unicron.control.store``, in its own session) and records it there (atomically).
The service stops it only on a clean shutdown (:func:`stop`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron.protocol import host_port

RECORD = "store.json"
"""in the state directory: the store's host, port and process id"""


@dataclass(frozen=True)
class StoreInfo:
    host: str
    port: int
    pid: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def connect(address: str, timeout_s: float = 60.0) -> object:
    """A client connection to the store at ``host:port`` (one per user: a client serves one
    request at a time)."""
    import torch.distributed as dist

    host, port = host_port(address)
    return dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=timeout_s))


def _answers(info: StoreInfo) -> bool:
    try:
        store = connect(info.address, timeout_s=2.0)
        store.check(["unicron/ping"])  # type: ignore[attr-defined]
        return True
    except Exception:  # refused, timed out: gone
        return False


def serve_here(host: str) -> Any:
    """A store served by this process (``unicron run``: nothing outlives it), listening on
    ``host`` only (:func:`listen`)."""
    import torch.distributed as dist

    port, fd = listen(host)
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=dt.timedelta(seconds=60),
        master_listen_fd=fd,
    )


def listen(host: str) -> tuple[int, int]:
    """A socket listening on ``host`` and a free port, for the store's server: its port and
    file descriptor (open for the rest of the process: the store never lets go of it). A
    TCPStore given only a port listens on every interface of the machine (``*:PORT``),
    whatever host it is told; handed this socket (``master_listen_fd``) it serves the
    coordinator's address alone (docs/security.md)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    return port, sock.detach()


def read_record(state_dir: Path) -> StoreInfo | None:
    try:
        d = json.loads((state_dir / RECORD).read_text(encoding="utf-8"))
        return StoreInfo(str(d["host"]), int(d["port"]), int(d["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure(state_dir: Path, host: str) -> tuple[StoreInfo, bool]:
    """The store of this state directory: the recorded one if it answers (``True``: adopted),
    else a new one started now (``False``)."""
    found = read_record(state_dir)
    if found is not None and _answers(found):
        return found, True
    ready = state_dir / "store.starting.json"
    ready.unlink(missing_ok=True)
    fd = os.open(state_dir / "store.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(fd, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unicron.control.store", "--host", host, "--out", str(ready)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not in the coordinator's process group: kill -9 spares it
        )
    deadline = time.time() + 60.0
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the store did not start (see {state_dir / 'store.log'})")
        time.sleep(0.02)
    os.replace(ready, state_dir / RECORD)
    info = read_record(state_dir)
    assert info is not None
    return info, False


def stop(state_dir: Path) -> None:
    """Stop the recorded store (a clean shutdown of the cluster)."""
    info = read_record(state_dir)
    if info is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, signal.SIGTERM)
        (state_dir / RECORD).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m unicron.control.store --host H --out FILE``: serve a TCPStore on a free
    port until SIGTERM; write host, port and pid to FILE (atomically) once it listens."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m unicron.control.store")
    p.add_argument("--host", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    port, fd = listen(args.host)
    store = dist.TCPStore(
        args.host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=dt.timedelta(seconds=60),
        master_listen_fd=fd,
    )
    tmp = Path(args.out + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump({"host": args.host, "port": store.port, "pid": os.getpid()}, f)
    os.replace(tmp, args.out)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    while not done.wait(3600):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
