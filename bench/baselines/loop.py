"""What every baseline script shares: the model and data, the step, the event log, the faults.

The baselines train exactly what ``examples/train_gpt.py`` trains under Unicron: the model of
:mod:`examples.gpt`, the micro-batches of :class:`unicron.runtime.ledger.Ledger`
(8 micro-batches of 4
sequences per step, global batch 32), one compute thread per worker. They write the same
event log (DESIGN.md, Contracts) so that one parser measures every system, and they fire the
same ``--inject`` faults (parsed by :mod:`unicron.runtime.inject`) at the same step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.gpt import build, loss_fn
from unicron.runtime import inject
from unicron.runtime.device import seed
from unicron.runtime.inject import parse
from unicron.runtime.ledger import Ledger, assign, mb_seed

NUM_MICROBATCHES = 8
MICRO_BATCH_SIZE = 4
SEED = 0
CPU = torch.device("cpu")


class EventWriter:
    """Appends events to a JSON Lines file shared by several processes (one write per line)."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def emit(self, event: str, /, **fields: Any) -> None:
        """Record ``event`` now, with ``fields`` (``None`` values are left out)."""
        if self._fd is None:
            return
        record = {"ts": time.time(), "event": event}
        record.update({k: v for k, v in fields.items() if v is not None})
        os.write(self._fd, (json.dumps(record) + "\n").encode())


@dataclass
class FaultPlan:
    """The faults of one baseline worker, fired once each per run (a marker file survives
    the restarts), through the same :class:`unicron.runtime.inject.FaultPlan` as Unicron's
    worker: its due faults, its ``fault_injected`` event and its effects.

    A ``node:node=N,step=S`` fault is fired by the *node leader* of node ``N`` (the worker
    the harness marks as the node's first): it SIGKILLs its agent's process group (when
    ``agent_pid`` is given: torchrun's agent, started in its own session by the harness),
    the other workers registered on node ``N``, then itself, so the node vanishes at once.
    A hang sleeps (alive, no progress; a SIGTERM still ends it).
    """

    plan: inject.FaultPlan
    marker_dir: Path
    node: int | None = None
    agent_pid: int | None = None

    @classmethod
    def from_specs(
        cls,
        specs: list[str],
        marker_dir: str,
        rank: int,
        events: EventWriter,
        *,
        node: int | None = None,
        node_leader: bool = False,
        agent_pid: int | None = None,
    ) -> FaultPlan:
        """Parse ``--inject`` specs for the worker of launch rank ``rank`` (on ``node``).

        A worker on a node registers its pid under ``marker_dir`` so that a node fault can
        find the node's other workers.
        """
        if node is not None:
            (Path(marker_dir) / f"node{node}-{os.getpid()}").touch()
        mine = [
            f
            for f in map(parse, specs)
            if (f.fault == "node" and node_leader and node is not None and f.node == node)
            or (f.fault != "node" and f.rank == rank)
        ]
        if any(f.phase == "update" for f in mine):  # a point of Unicron's commit alone
            raise SystemExit("--inject: a baseline has no phase=update point to crash at")
        plan = inject.FaultPlan(mine, emit=events.emit, rank=rank)
        out = cls(plan, Path(marker_dir), node, agent_pid)
        out.plan.act, out.plan.claim = out._act, out._claim
        return out

    def at(self, step: int, local_total: int) -> Callable[[int], None]:
        """The hook :func:`accumulate` calls before each micro-batch of ``step``."""
        return lambda local_done: self.maybe_fire(step, local_done, local_total)

    def maybe_fire(self, step: int, local_done: int, local_total: int) -> None:
        """Fire a fault due on this rank at ``step`` after ``local_done`` local micro-batches."""
        for fault in self.plan.due_after(step, local_done, local_total):
            self.plan.fire(fault, step)

    def _claim(self, fault: inject.Fault) -> bool:
        try:  # fire once per run, across restarts
            os.close(os.open(self.marker_dir / f"fired-{fault.spec}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _act(self, fault: inject.Fault) -> None:
        if fault.fault == "node":
            vanish_node(self.marker_dir, fault.node or 0, self.agent_pid)
        elif fault.fault == "hang":
            while True:  # stop making progress, stay alive (a SIGTERM still ends it)
                time.sleep(3600)
        elif fault.fault == "slow":
            raise NotImplementedError("slow faults are not benchmarked against the baselines")
        else:
            inject.stop_self(fault)


def _baseline_pid(pid: int, needle: bytes = b"bench.baselines") -> bool:
    """Whether ``pid`` runs a command line containing ``needle`` (not a recycled pid)."""
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def vanish_node(marker_dir: Path, node: int, agent_pid: int | None) -> None:
    """SIGKILL node ``node``: its agent's process group, its other workers, then this process.

    The agent is killed first so that it cannot react (torchrun's agent would otherwise see
    its workers die and restart them); its workers run in sessions of their own (torchrun
    starts them with ``start_new_session``), so each is killed by its registered pid.
    """
    if agent_pid is not None and _baseline_pid(agent_pid, b"torch.distributed.run"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(agent_pid) == agent_pid:  # its own group: the harness started it
                os.killpg(agent_pid, signal.SIGKILL)
            else:
                os.kill(agent_pid, signal.SIGKILL)
    for marker in marker_dir.glob(f"node{node}-*"):
        pid = int(marker.name.rpartition("-")[2])
        if pid != os.getpid() and _baseline_pid(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code: int = 0) -> None:
    """End a baseline's process with ``code`` once its run is over, without the
    interpreter's teardown: a gloo or store thread destructed at exit now and then aborts
    the process ("terminate called without an active exception", SIGABRT) after the run has
    finished, or hangs once the peers are gone, and torchrun restarts the whole group for
    it. Every baseline's ``__main__`` ends here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setup_threads(pid_dir: str | None = None) -> None:
    """One compute thread per worker, as under Unicron; register the pid for the harness.

    The harness kills registered workers still alive when a trial ends (a hung worker that
    nothing else ends, or a run cut off by its timeout).
    """
    torch.set_num_threads(1)
    if pid_dir:
        (Path(pid_dir) / f"pid-{os.getpid()}").touch()


@dataclass(frozen=True)
class Job:
    """A model-parallel baseline's worker under torchrun (``bench/baselines/tp_ckpt.py``,
    ``fsdp_ckpt.py``): its rank of the world, torchrun's restart count, its event log (rank 0
    writes one) and its faults."""

    rank: int
    world: int
    attempt: int
    events: EventWriter
    faults: FaultPlan


def job_arguments(p: argparse.ArgumentParser, dim: int, hidden: int) -> None:
    """The model-parallel baselines' shared flags: the model's width (``dim``, ``hidden``:
    the example's defaults), the run and its checkpoints, events and faults."""
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=0, help="0: never checkpoint")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])


def start_job(args: argparse.Namespace) -> Job:
    """This worker's :class:`Job` (flags of :func:`job_arguments`), its threads set up and
    torchrun's process group (gloo) made."""
    setup_threads(args.ckpt_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(args.events if rank == 0 else None)
    faults = FaultPlan.from_specs(args.inject, args.ckpt_dir, rank, EventWriter(args.events))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    return Job(rank, world, attempt, events, faults)


@dataclass
class Trainer:
    """The model, optimizer and micro-batch ledger of one worker."""

    model: nn.Module
    opt: torch.optim.Optimizer
    dataset: Any
    ledger: Ledger

    @classmethod
    def create(cls, size: str = "example") -> Trainer:
        """Build the shared example model (seeded, identical on every worker) of ``size``
        (:data:`examples.gpt.SIZES`)."""
        model, opt, dataset = build(SEED, size=size)
        ledger = Ledger(
            dataset_len=len(dataset),
            micro_batch_size=MICRO_BATCH_SIZE,
            num_microbatches=NUM_MICROBATCHES,
            seed=SEED,
        )
        return cls(model, opt, dataset, ledger)

    def batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``mb`` of step ``step`` as (x, y)."""
        items = [self.dataset[i] for i in self.ledger.samples(step, mb)]
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def local_microbatches(rank: int, world: int) -> list[int]:
    """The micro-batch ids of a fresh step for ``rank`` of ``world`` (Unicron's rule)."""
    return assign(range(NUM_MICROBATCHES), world)[rank]


def accumulate(
    model: nn.Module,
    trainer: Trainer,
    step: int,
    ids: list[int],
    scale: float,
    no_sync: Callable[[], Any] | None,
    on_microbatch: Callable[[int], None],
) -> float:
    """Forward and backward ``ids`` of ``step`` (loss times ``scale``); the last one syncs.

    ``no_sync`` is the DDP context that skips the gradient all-reduce for all but the last
    micro-batch; ``on_microbatch(done)`` runs before each micro-batch (fault injection).
    Returns the mean loss of the local micro-batches.
    """
    total = 0.0
    for j, mb in enumerate(ids):
        on_microbatch(j)
        seed(mb_seed(SEED, step, mb), CPU)
        x, y = trainer.batch(step, mb)
        last = j == len(ids) - 1
        if no_sync is not None and not last:
            with no_sync():
                loss = loss_fn(model, (x, y))
                (loss * scale).backward()
        else:
            loss = loss_fn(model, (x, y))
            (loss * scale).backward()
        total += float(loss.detach())
    return total / max(len(ids), 1)
