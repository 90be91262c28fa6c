"""``unicron run``: train a script on this machine with N workers, self-healing.

Builds the same parts as a cluster (coordinator with its TCPStore, one agent per node, their
workers) inside this process and its children, runs each agent's supervision loop on its own
thread while the main thread watches the coordinator until the task is done or failed, then
writes ``task_end`` and prints the timeline. Exit codes: 0 finished, 1 failed for good, 2 bad
usage (raised as UsageError), 130 interrupted (Ctrl-C or SIGTERM; every process is stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unicron.control import flags as F
from unicron.control.taskspec import depths_of
from unicron.errors import UsageError
from unicron.runtime import checkpoint as C
from unicron.runtime.inject import Fault, parse

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live

    from unicron.control.cluster import Cluster
    from unicron.control.events import EventLog
    from unicron.control.taskspec import TaskSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nnodes",
        default="1",
        metavar="K",
        help="agents (nodes) to start on this machine, each with its own zygote and heartbeat; "
        "node k's workers get launch ranks k*N .. k*N+N-1 (default 1; torchrun's K:K too)",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N",
        help="worker processes per node (default 1; as under torchrun, also cpu: the CPU "
        "count, gpu: the GPU count, auto: gpu with --device cuda, else cpu)",
    )
    F.add_to(p)  # the task settings, from the task file's model
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject a fault: crash:rank=R,step=S[,mb=K] | hang:rank=R,step=S | "
        "error:rank=R,step=S,kind=K | slow:rank=R,step=S,factor=F | node:node=N,step=S "
        "(repeatable; R is the launch rank; any may add ,members=M: at step S or the first "
        "step after it in an epoch of at least M members)",
    )
    p.add_argument("--events", metavar="FILE", help="write the event log (JSON Lines) here")
    p.add_argument(
        "--min-workers",
        type=int,
        default=1,
        metavar="K",
        help="fail (exit 1) when fewer usable slots remain (default 1)",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go: one directory per step (default: LOG_DIR/checkpoints)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="go on from the newest valid checkpoint in DIR (new checkpoints go there too)",
    )
    p.add_argument(
        "--task",
        "--rdzv-id",
        "--rdzv_id",
        default="train",
        help="task name (event log, store keys); torchrun's --rdzv-id means the same",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="accepted for torchrun's sake: what unicron run always does (one machine, its own "
        "coordinator on a free port); torchrun's other flags: docs/loop.md",
    )
    for flags, takes_value, _reason in TORCHRUN_REFUSED:
        p.add_argument(
            *flags,
            dest=_refused_dest(flags),
            action="store" if takes_value else "store_true",
            default=None,
            help=argparse.SUPPRESS,
        )
    p.add_argument(
        "--log-dir", "--log_dir", metavar="DIR", help="workers' stdout/stderr (default: a temp dir)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress display, no report")
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def validate(args: argparse.Namespace) -> list[Fault]:
    """Check everything before starting anything; raise UsageError with one line."""
    from unicron.detect.classify import KINDS

    for flags, _takes_value, reason in TORCHRUN_REFUSED:
        if getattr(args, _refused_dest(flags)) not in (None, False):
            raise UsageError(f"{flags[0]} is not supported by unicron run: {reason}")
    args.nnodes = _nnodes(str(args.nnodes))
    args.nproc_per_node = _nproc_per_node(str(args.nproc_per_node), args.device)
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {args.nnodes}")
    world = args.nnodes * args.nproc_per_node
    if not 1 <= args.min_workers <= world:
        raise UsageError(f"--min-workers must be in 1..{world}, got {args.min_workers}")
    _check_replica(args)
    from unicron.runtime import device as D  # imports torch only to count GPUs, for --device cuda

    args.reduce = args.reduce or D.default_reduce(args.device)  # before --resume's check
    D.check(args.device, args.reduce, D.gpu_count() if args.device == "cuda" else 0)
    every = args.checkpoint_every
    if every != "auto" and not (every.isdigit() and int(every) >= 0):
        raise UsageError(f"--checkpoint-every must be an integer >= 0 or auto, got {every!r}")
    F.check(args)  # every task setting against the task file's model
    _validate_checkpoint_args(args)
    if not Path(args.script).is_file():
        raise UsageError(f"script not found: {args.script}")
    faults = [parse(spec, KINDS) for spec in args.inject]
    for f in faults:
        if f.node is not None and f.node >= args.nnodes:
            raise UsageError(
                f"--inject {f.spec!r}: node {f.node} out of range 0..{args.nnodes - 1}"
            )
        if f.rank is not None and f.rank >= world:
            raise UsageError(f"--inject {f.spec!r}: rank {f.rank} out of range 0..{world - 1}")
        if f.members is not None and not 1 <= f.members <= world:
            raise UsageError(f"--inject {f.spec!r}: members {f.members} out of range 1..{world}")
    return faults


_NO_RDZV = "the rendezvous is the coordinator's store (on a cluster: unicron coordinator and agent)"
_OUTPUT = "each worker's output goes to its own file in --log-dir"
TORCHRUN_REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--max-restarts", "--max_restarts"), True,
     "unicron restarts only the failed worker, in place, as the escalation policy allows (3 "
     "restarts in 60 s exclude its slot, docs/detection.md); the task fails below --min-workers"),
    (("--rdzv-backend", "--rdzv_backend"), True, _NO_RDZV),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True, _NO_RDZV),
    (("--rdzv-conf", "--rdzv_conf"), True, _NO_RDZV),
    (("--node-rank", "--node_rank"), True,
     "unicron run starts every node on this machine (on a cluster each node runs unicron agent)"),
    (("--master-addr", "--master_addr"), True,
     "the coordinator hosts the store on 127.0.0.1 and a free port; workers find it in "
     "MASTER_ADDR/MASTER_PORT"),
    (("--master-port", "--master_port"), True,
     "the coordinator hosts the store on 127.0.0.1 and a free port; workers find it in "
     "MASTER_ADDR/MASTER_PORT"),
    (("--monitor-interval", "--monitor_interval"), True,
     "workers are supervised through their socket to the agent: an exit is seen at once"),
    (("--start-method", "--start_method"), True,
     "the agent forks workers from a warm zygote (a plain spawn as the fallback)"),
    (("--redirects",), True, _OUTPUT),
    (("--tee",), True, _OUTPUT),
    (("--local-ranks-filter", "--local_ranks_filter"), True, _OUTPUT),
    (("--logs-specs", "--logs_specs"), True, _OUTPUT),
    (("--role",), True, "every worker of a task runs the same script"),
    (("--local-addr", "--local_addr"), True, "the agent and its workers talk over 127.0.0.1"),
    (("--module", "-m"), False, "unicron run takes the path of a Python script"),
    (("--no-python", "--no_python"), False, "unicron run takes the path of a Python script"),
    (("--run-path", "--run_path"), False, "unicron run takes the path of a Python script"),
)  # fmt: skip
"""torchrun's flags that mean nothing here, each with why: ``unicron run`` exits 2 naming it"""


def _refused_dest(flags: tuple[str, ...]) -> str:
    return "torchrun_" + flags[0].lstrip("-").replace("-", "_")


def _nnodes(raw: str) -> int:
    """``--nnodes K``, or torchrun's ``K:K``; an elastic range is refused."""
    lo, _, hi = raw.partition(":")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        raise UsageError(f"--nnodes must be a number of nodes (or K:K), got {raw!r}")
    if hi and hi != lo:
        raise UsageError(
            f"--nnodes {raw}: elastic ranges are not supported: unicron run starts K nodes "
            "and heals the task down to --min-workers workers; give one number"
        )
    return int(lo)


def _check_replica(args: argparse.Namespace) -> None:
    """``--tp``, ``--fsdp`` and ``--pp``: a replica's ``tp x fsdp`` ranks of a stage are on
    one node (its stages may be on several), and the task's slots are whole replicas;
    ``--min-workers`` left at its default becomes one replica."""
    fsdp = args.fsdp or 1
    tp, pp = (args.tp or 1) * fsdp, args.pp or 1  # a stage's ranks, on one node
    own = ("--fsdp", fsdp) if fsdp > 1 else ("--tp", tp)
    if tp < 1 or pp < 1:
        return  # the task file's model says so, with the flag's name
    n, slots = tp * pp, args.nnodes * args.nproc_per_node
    choices = {}
    for flag in ("pp_choices", "tp_choices"):
        text = getattr(args, flag, None) or ""
        try:
            choices[flag] = depths_of(text)
        except ValueError as exc:
            raise UsageError(f"--{flag.replace('_', '-')} {exc}") from None
    other = [("--pp-choices", d, tp, d) for d in choices["pp_choices"]]
    other += [("--tp-choices", t, t, pp) for t in choices["tp_choices"]]
    for flag, value, t, p in [(*own, tp, pp), *other]:
        if t < 1 or p < 1:
            continue  # the task file's model says so, with the flag's name
        if args.nproc_per_node % t:
            raise UsageError(
                f"{flag} {value}: {t} ranks of a stage must divide --nproc-per-node "
                f"{args.nproc_per_node}: a stage's ranks are on one node"
            )
        if t * p > slots and flag != own[0]:  # the task's own: must divide them (below)
            raise UsageError(
                f"{flag} {value}: a replica of {t * p} ranks must fit in the run's {slots} "
                "slots (--nnodes x --nproc-per-node)"
            )
    if n == 1:
        return
    said = " x ".join(
        f"--{k} {v}" for k, v in (("tp", args.tp or 1), ("fsdp", fsdp), ("pp", pp)) if v > 1
    )
    if slots % n:
        raise UsageError(
            f"{said} ({n} ranks) must divide the run's {slots} slots (--nnodes x "
            "--nproc-per-node): the task trains on whole replicas"
        )
    if args.min_workers == 1:
        args.min_workers = n
    elif args.min_workers % n:
        raise UsageError(
            f"--min-workers {args.min_workers} must be a multiple of {said} ({n} ranks): the "
            "task trains on whole replicas"
        )


def _nproc_per_node(raw: str, device: str) -> int:
    """``--nproc-per-node N``, or torchrun's ``cpu``, ``gpu``, ``auto``."""
    if raw.lstrip("-").isdigit():
        return int(raw)
    if raw == "auto":
        raw = "gpu" if device == "cuda" else "cpu"
    if raw == "cpu":
        return os.cpu_count() or 1
    if raw == "gpu":
        from unicron.runtime import device as D

        gpus = D.gpu_count()
        if gpus < 1:
            raise UsageError("--nproc-per-node gpu: this node has no CUDA device")
        return gpus
    raise UsageError(f"--nproc-per-node must be a number, cpu, gpu or auto, got {raw!r}")


def _validate_checkpoint_args(args: argparse.Namespace) -> None:
    """``--resume`` and ``--checkpoint-dir``: one directory, its checkpoints readable."""
    if args.resume is not None:
        other = args.checkpoint_dir and Path(args.checkpoint_dir).resolve()
        if other and other != Path(args.resume).resolve():
            raise UsageError("--resume DIR writes new checkpoints into DIR: drop --checkpoint-dir")
        _check_resume(Path(args.resume), args.reduce)
    elif args.checkpoint_dir:
        root = Path(args.checkpoint_dir)
        found = C.newest(root, check_files=False) or C.newest(root / "shard0", check_files=False)
        if found is not None:
            raise UsageError(
                f"--checkpoint-dir {root} already holds checkpoints (newest: step "
                f"{found[1].step}): pass --resume {root} to go on from them, or another directory"
            )
        _check_writable(root, "--checkpoint-dir")


def _check_writable(root: Path, flag: str) -> None:
    existing = next(p for p in (root, *root.resolve().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {root}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {root}: no permission to write in {existing}")


def _check_resume(root: Path, reduce: str) -> None:
    """``--resume DIR`` (:func:`unicron.runtime.checkpoint.check_resume`); the checkpoints
    skipped as invalid are named on stderr before the run starts."""
    for reason in C.check_resume(root, reduce, flag="--resume"):
        print(f"unicron: warning: skipping checkpoint: {reason}", file=sys.stderr)


def task_spec(args: argparse.Namespace, log_dir: Path) -> TaskSpec:
    """The run's arguments as a task file would say them (:mod:`unicron.control.taskspec`)."""
    from unicron.control.taskspec import TaskSpec

    settings = F.task_fields(args)
    settings["checkpoint"] |= {
        "dir": str(Path(args.resume or args.checkpoint_dir or log_dir / "checkpoints")),
        "resume": bool(args.resume),
    }
    return TaskSpec.model_validate(
        {
            "name": args.task,
            "script": os.path.abspath(args.script),
            "args": list(args.args),
            "workers": {"min": args.min_workers, "max": args.nnodes * args.nproc_per_node},
            "inject": list(args.inject),
            **settings,
        }
    )


def main(args: argparse.Namespace) -> int:
    """A coordinator service, ``--nnodes`` agents and their workers on this machine, through
    the cluster's own code: the service (:class:`~unicron.control.cluster.Cluster` behind its
    HTTP API on 127.0.0.1 and a free port, with a fresh token), node agents
    (:class:`~unicron.control.node.NodeAgent`, one thread each) talking to it over HTTP, the
    task submitted to it; the main thread watches the task until it ends."""
    validate(args)
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=160)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="unicron-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="cluster-", dir=log_dir))
    try:
        code = _run(args, console, log_dir, state_dir)
    except UsageError:  # refused before training: nothing to keep
        _tidy(args, log_dir, state_dir, kept_why=None)
        raise
    except BaseException:
        _tidy(args, log_dir, state_dir, kept_why="it stopped on an error")
        raise
    kept_why = None if code == 0 else "the task did not finish"
    _tidy(args, log_dir, state_dir, kept_why=kept_why, console=console)
    return code


def _tidy(
    args: argparse.Namespace,
    log_dir: Path,
    state_dir: Path,
    *,
    kept_why: str | None,
    console: Any = None,
) -> None:
    """After a run: the service's own state directory goes, its logs (the store's) moved to
    ``log_dir``; a temporary ``--log-dir`` (none given) goes too unless ``kept_why`` (the task
    did not finish: its worker logs, events and checkpoints are kept, and ``console`` says
    where). A ``--log-dir`` given is kept."""
    for found in state_dir.glob("*.log"):
        with contextlib.suppress(OSError):
            shutil.move(found, log_dir / found.name)
    shutil.rmtree(state_dir, ignore_errors=True)
    if args.log_dir:
        if console is not None and not args.quiet:
            console.print(f"worker logs: {log_dir}", markup=False, highlight=False)
        return
    if kept_why is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif console is not None:
        console.print(
            f"worker logs, events and checkpoints kept ({kept_why}): {log_dir}",
            markup=False,
            highlight=False,
        )


def _run(args: argparse.Namespace, console: Any, log_dir: Path, state_dir: Path) -> int:
    """:func:`main`'s run in ``log_dir``, the service's state in ``state_dir``; the exit
    code."""
    zygotes = _prewarm(args, log_dir)  # they import torch while this process does the same
    try:
        return _run_nodes(args, console, log_dir, state_dir, zygotes)
    finally:
        for z in zygotes:  # one no agent adopted (the run stopped before its task started)
            if z.stdin is not None and not z.stdin.closed:
                z.kill()
                z.wait()


def _prewarm(args: argparse.Namespace, log_dir: Path) -> list[subprocess.Popen[bytes]]:
    """One zygote per node, started before the coordinator and the agents (which import
    torch first), so that the workers fork ~1.5 s sooner; each node's agent adopts its own
    (:meth:`~unicron.control.agent.Agent.start`). CPU runs only: a CUDA zygote's
    environment (its device list) is the agent's to set."""
    if args.device != "cpu":
        return []
    from unicron.control.agent import SECRETS, import_env
    from unicron.runtime.launcher import prewarm

    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env |= import_env(args.threads, env)
    return [prewarm(env, str(log_dir / f"zygote-node{k}.log")) for k in range(args.nnodes)]


def _run_nodes(
    args: argparse.Namespace,
    console: Any,
    log_dir: Path,
    state_dir: Path,
    zygotes: list[subprocess.Popen[bytes]],
) -> int:
    from unicron.control.cluster import ENDED, Cluster
    from unicron.control.node import NodeAgent
    from unicron.control.report import render

    spec = task_spec(args, log_dir)
    ckpt_dir = Path(spec.checkpoint.dir) if spec.checkpoint.dir else None
    checkpoint = None if spec.checkpoint.every == 0 and not spec.checkpoint.resume else ckpt_dir
    events_path = Path(args.events) if args.events else log_dir / "events.jsonl"
    events_path.unlink(missing_ok=True)  # this run's log, not appended to an older one
    cluster = Cluster(state_dir, host="127.0.0.1", embedded=True)
    service = _Service(cluster)
    stop = threading.Event()
    terminated = threading.Event()
    nodes = [
        NodeAgent(
            service.client,
            name=f"node{k}",
            slots=args.nproc_per_node,
            log_dir=log_dir,
            per_task=False,  # worker<slot>.<incarnation>.log right in --log-dir, as always
            zygote=zygotes[k] if k < len(zygotes) else None,
        )
        for k in range(args.nnodes)
    ]

    def on_sigterm(*_: object) -> None:
        for node in nodes:  # before ``stop``: the node threads must not wait for anyone
            node.interrupt()
        terminated.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    display = None
    interrupted = False
    t0 = time.time()
    threads: list[threading.Thread] = []
    try:
        for node in nodes:  # in order: node k is node k of the --inject specs
            node.register(stop)
        cluster.submit(spec, time.time(), events_to=events_path)
        task = cluster.tasks[spec.name]
        events = task.events
        assert events is not None
        display = None if args.quiet else _Display(console, events)
        # Everything the imports made (torch's, FastAPI's: about 200,000 objects)
        # lives as long as the process: out of the cyclic collector's sight, its full passes
        # take milliseconds instead of 50-110 ms in which every thread of this process, the
        # service and the agents, stands still (`bench/results/scale-history.md`).
        gc.freeze()
        threads = [
            threading.Thread(target=n.run, args=(stop,), name=n.name, daemon=True) for n in nodes
        ]
        for th in threads:
            th.start()
        while not stop.is_set() and task.row.state not in ENDED:
            time.sleep(0.05)
        if terminated.is_set():
            for node in nodes:
                node.kill_all()  # stop now: no step after the signal
        stop.set()
        for th in threads:  # each drains its finished workers (they may write final.pt)
            th.join()
    except KeyboardInterrupt:
        interrupted = True
        for node in nodes:
            node.interrupt()
    finally:
        stop.set()
        if interrupted or terminated.is_set():
            for node in nodes:
                node.kill_all()
        for th in threads:  # no agent may start a worker while the others are being stopped
            th.join(timeout=5.0)
        for node in nodes:
            node.stop()
        if display is not None:
            display.close()
        service.close()
    row = cluster.tasks[spec.name].row
    committed = (
        max(row.committed_step + 1, 0) if row.committed_step >= 0 or not args.resume else None
    )
    C.record_progress(checkpoint, committed)
    outcome = row.outcome or {}
    interrupted = interrupted or terminated.is_set()
    if interrupted or row.state not in ENDED:
        reason = "interrupted" if interrupted else "ended without an outcome"
        _end_event(events_path, spec.name, "failed", reason, round(time.time() - t0, 3))
        console.print(f"unicron: {reason}; every process was stopped")
        cluster.close()
        return 130 if interrupted else 1
    cluster.close()
    if outcome.get("usage"):  # a worker refused the input before training; all stopped
        raise UsageError(outcome["reason"])
    ok = row.state == "done"
    if not args.quiet:
        from unicron.control.events import read_events

        render(read_events(events_path), console)
    if not ok:
        console.print(
            f"unicron: task failed: {outcome.get('reason')}",
            style="red",
            soft_wrap=True,
            markup=False,
        )
        errors = sorted((e for n in nodes for e in n.errors), key=lambda e: e.ts)
        first = next((e for e in errors if e.error.traceback), None)
        if first is not None:
            console.print(
                f"first error (slot {first.slot}):\n{first.error.traceback.rstrip()}",
                markup=False,
                highlight=False,
            )
    return 0 if ok else 1


def _end_event(path: Path, task: str, status: str, reason: str, wall_s: float) -> None:
    """A ``task_end`` for a run stopped before its task ended (the service is gone)."""
    from unicron.control.events import EventLog

    log = EventLog(path)
    log.emit("task_end", task=task, status=status, reason=reason, wall_s=wall_s)
    log.close()


class _Service:
    """The cluster service of this run: its HTTP API on 127.0.0.1 and a free port (uvicorn on
    a thread), a fresh token, the cluster's ticker, and a client for the agents."""

    def __init__(self, cluster: Cluster) -> None:
        import secrets
        import socket

        from unicron.control.client import Client
        from unicron.control.service import serve

        self.cluster = cluster
        token = secrets.token_urlsafe(24)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.server = serve(cluster, token, "127.0.0.1", port)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="service", daemon=True
        )
        self._thread.start()
        deadline = time.time() + 30.0
        while not self.server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the embedded coordinator service did not start")
            time.sleep(0.01)
        cluster.start_ticker()
        self.client = Client(f"http://127.0.0.1:{port}", token)

    def close(self) -> None:
        self.client.close()  # first: the server waits for open connections to close
        self.server.should_exit = True
        self._thread.join(timeout=5.0)


class _Display:
    """A live status line (step, loss, workers, epoch) on a terminal; notable events as lines
    otherwise."""

    def __init__(self, console: Console, events: EventLog) -> None:
        self.console = console
        self.live: Live | None = None
        self.state: dict[str, Any] = {"step": "-", "loss": "-", "workers": "-", "epoch": "-"}
        if console.is_terminal:
            from rich.live import Live

            self.live = Live(self._line(), console=console, refresh_per_second=8, transient=True)
            self.live.start()
        events.subscribe(self._on_event)

    def _line(self) -> str:
        s = self.state
        line = f"step {s['step']}  loss {s['loss']}  workers {s['workers']}  epoch {s['epoch']}"
        if s.get("waiting"):
            from rich.markup import escape  # the planner's reason: text, not markup

            line += f"  WAITING: {escape(str(s['waiting']))}"
        return line

    def _on_event(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind == "action" and e.get("action") == "wait":
            self.state["waiting"] = e.get("reason", "")
        elif kind == "epoch_begin":
            self.state["waiting"] = ""
        if kind == "step_end":
            self.state.update(
                step=e["step"],
                loss=f"{e['loss']:.4f}",
                workers=e.get("workers"),
                epoch=e.get("epoch"),
            )
            if self.live is None and e["step"] % 25 == 0:
                self.console.print(self._line())
        elif kind in ("fault_injected", "error_detected", "action", "epoch_begin"):
            hide = ("ts", "event", "task") + (() if e.get("action") == "wait" else ("reason",))
            detail = {k: v for k, v in e.items() if k not in hide}
            self.console.print(
                f"[{time.strftime('%H:%M:%S')}] {kind} {detail}", markup=False, highlight=False
            )
        if self.live is not None:
            self.live.update(self._line())

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
