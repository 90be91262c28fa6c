"""Starting workers cheaply: a warm fork server (the zygote), with a plain spawn as fallback.

A fresh Python process pays ~5 s here before its first step (``import torch``, then the
optimizer's imports); a child forked from a process that already paid them pays ~0.1 s
(TORCH-FACTS.md). So the agent starts one zygote per node: it imports torch, builds a throw-away
optimizer, then forks a child per worker on request and reports each child's exit. The zygote
creates no process group, thread pool or socket to peers before forking. The zygote dies with
its agent's process; workers do not die with the zygote (a lost zygote only means that later
workers start as fresh processes), and a worker whose coordinator is gone fails at its next
look at the store and exits.

Run as ``python -m unicron.runtime.launcher zygote`` (by the agent) or
``python -m unicron.runtime.launcher worker SCRIPT [ARGS]`` (the fallback: a plain fresh process).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, wait

from unicron.errors import UsageError
from unicron.messages import Error, Exited, Spawned, SpawnWorker, ZygoteUp, from_wire, to_wire
from unicron.protocol import ENV_AGENT, ENV_AUTHKEY, ENV_THREADS, STACKS_SIGNAL, host_port

_PR_SET_PDEATHSIG = 1
ENV_PRELOAD = "UNICRON_PRELOAD"
"""modules the zygote imports before it forks workers, comma-separated (e.g. ``transformers``:
~3-10 s per worker here otherwise, paid again by every restarted worker)"""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent goes (no orphans, Linux)."""
    # not Linux: no prctl; the agent's kill at shutdown still applies
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_script(script: str, argv: Sequence[str]) -> int:
    """Run the user's script as ``__main__`` in this process; return its exit code.

    Connects to the agent first, so that an error at import time is reported with its
    traceback (the agent shows it when it gives up on the slot).
    """
    import torch

    from unicron.runtime import link

    torch.set_num_threads(int(os.environ.get(ENV_THREADS, "1")))
    # the agent asks a worker it kills as hung where it was (every thread, into its log)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    agent = link.connect_agent()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except UsageError as exc:  # bad use of the worker API: the whole run ends with exit 2
        sys.stderr.write(f"unicron: error: {exc}\n")
        agent.send(Error(type_name="UsageError", message=str(exc), usage=True))
        return 2
    except BaseException as exc:  # report everything the script raised, then exit 1
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        agent.send(Error(type_name=type(exc).__name__, message=str(exc), traceback=tb))
        return 1
    return 0


def _zygote() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # the expensive imports, paid once

    torch.set_num_threads(int(os.environ.get(ENV_THREADS, "1")))
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # pulls in torch._dynamo
    import unicron.worker  # noqa: F401

    if ENV_AGENT not in os.environ:  # started ahead of its task (:func:`prewarm`)
        _adopt_environment()
        torch.set_num_threads(int(os.environ.get(ENV_THREADS, "1")))
    for name in filter(None, os.environ.get(ENV_PRELOAD, "").split(",")):
        try:  # the script's own heavy imports, paid once (a failure is the script's to report)
            importlib.import_module(name)
        except Exception as exc:
            sys.stderr.write(f"unicron: zygote: cannot preload {name}: {exc}\n")

    conn = Client(host_port(os.environ[ENV_AGENT]), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
    conn.send(to_wire(ZygoteUp(pid=os.getpid())))
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        ready = wait([conn, rfd], timeout=1.0)
        if rfd in ready:
            os.read(rfd, 4096)
        _reap(conn, children)
        if conn in ready:
            try:
                cmd = from_wire(conn.recv())
            except EOFError:
                return 0
            if isinstance(cmd, SpawnWorker):
                pid = _fork_worker(conn, rfd, wfd, cmd)
                children.add(pid)
                conn.send(to_wire(Spawned(slot=cmd.slot, pid=pid, incarnation=cmd.incarnation)))


def _adopt_environment() -> None:
    """A zygote started before its task was known (``unicron run`` starts one per node while
    it starts its coordinator, :func:`prewarm`) gets its task's environment as one JSON line
    on stdin from the agent that adopts it, then has the environment and the stdin a zygote
    the agent started itself has; an agent that never comes (stdin closed) ends it."""
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def prewarm(env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    """Start a zygote ahead of its task, with ``env`` for its imports (what the agent will
    give it: :func:`unicron.control.agent.import_env`), its output appended to ``log``; the
    agent that adopts it (:meth:`unicron.control.agent.Agent.start`) sends the rest. It pays
    ``import torch`` while its caller starts the coordinator (~1.5 s of each ``unicron run``)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "unicron.runtime.launcher", "zygote"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )


def _reap(conn: Connection, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            conn.send(to_wire(Exited(pid=pid, returncode=code)))


def _fork_worker(conn: Connection, rfd: int, wfd: int, cmd: SpawnWorker) -> int:
    pid = os.fork()
    if pid:
        return pid
    # child: drop the zygote's plumbing, become the worker
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.close(rfd)
        os.close(wfd)
        conn.close()
        die_with_parent()
        if cmd.log:
            fd = os.open(cmd.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        os.environ.update(cmd.env)
        code = run_script(cmd.script, cmd.argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    if argv[:1] == ["zygote"]:
        return _zygote()
    if argv[:1] == ["worker"] and len(argv) >= 2:
        return run_script(argv[1], argv[2:])
    print(
        "usage: python -m unicron.runtime.launcher zygote | worker SCRIPT [ARGS]", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: abandoned gloo groups must not be destructed
