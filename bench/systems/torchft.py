"""torchft (PyPI ``torchft`` 0.2.x) as a third system: its DDP wrapper, Manager and lighthouse.

One lighthouse (``torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000``; the CLI's
default join timeout is 60 s) and one replica group of one process per worker
(``bench/baselines/train_torchft.py``). The harness restarts a replica that exits with an
error (at most ``torchrun_max_restarts`` times each), as a per-group torchrun would; it
rejoins through torchft's quorum and heals from a live peer. A replica that never exits
(hung) is killed once the others have finished: torchft itself leaves it alone.

The node scenario maps a node to ``nproc / nnodes`` replica groups of one process (replica i
on node ``i // (nproc / nnodes)``): node 1's first replica SIGKILLs the node's replicas and
itself, they are not restarted (a lost node does not come back), and the survivors go on
with half the global batch.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port
from bench.events import read_events
from bench.systems.base import (
    Launched,
    Scenario,
    Settings,
    TrialError,
    figures,
    python,
    reap_workers,
)

DEFAULT_TIMEOUT_S = 60.0
GRACE_AFTER_FIRST_DONE_S = 5.0


def unavailable() -> str | None:
    """Why torchft cannot run here, or ``None`` if it is installed."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install 'torchft==0.2.*')"
    if _lighthouse_binary() is None:
        return "torchft is installed but the torchft_lighthouse command is missing"
    return None


def _lighthouse_binary() -> str | None:
    here = Path(python()).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


@dataclass(frozen=True)
class TorchftArm:
    """torchft with a collective timeout of ``timeout_s`` (its default: 60 s)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    system: str = "torchft"

    @property
    def label(self) -> str:
        """``torchft`` (and the timeout where it is not torchft's default)."""
        if self.timeout_s == DEFAULT_TIMEOUT_S:
            return "torchft"
        return f"torchft timeout={self.timeout_s:g}s"

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One trial: lighthouse, replicas, restarts of failed replicas, then the figures."""
        reason = unavailable()
        if reason:
            raise TrialError(reason)
        port = free_port()
        lighthouse = Launched.start(
            [
                str(_lighthouse_binary()),
                "--min_replicas",
                "1",
                "--join_timeout_ms",
                "1000",
                "--bind",
                f"127.0.0.1:{port}",
            ],
            workdir / "lighthouse.log",
        )
        t0 = time.time()
        try:
            wall = self._replicas(scenario, settings, workdir, f"http://127.0.0.1:{port}", t0)
        finally:
            lighthouse.stop(grace_s=2.0)
            reap_workers(workdir)
        return figures(read_events(workdir / "events.jsonl"), wall, scenario)

    def _replicas(
        self, scenario: Scenario, settings: Settings, workdir: Path, lighthouse: str, t0: float
    ) -> float:
        """Run and supervise the replicas; return the wall time until the last one finished."""

        def start(rid: int, attempt: int) -> Launched:
            cmd = [
                python(),
                "-m",
                "bench.baselines.train_torchft",
                "--replica-id",
                str(rid),
                "--replicas",
                str(settings.nproc),
                "--steps",
                str(settings.steps),
                "--lighthouse",
                lighthouse,
                "--marker-dir",
                str(workdir),
                "--events",
                str(workdir / "events.jsonl"),
                "--timeout-s",
                str(self.timeout_s),
            ]
            if node_loss:
                cmd += ["--replicas-per-node", str(settings.nproc // settings.nnodes)]
            for spec in scenario.faults:
                cmd += ["--inject", spec]
            return Launched.start(cmd, workdir / f"replica{rid}.{attempt}.log")

        node_loss = scenario.fault_kind == "node"
        procs = {rid: start(rid, 0) for rid in range(settings.nproc)}
        restarts = dict.fromkeys(procs, 0)
        done: dict[int, float] = {}
        lost: set[int] = set()  # replicas of the vanished node: a lost node does not return
        first_done: float | None = None
        bound = settings.node_trial_timeout_s if node_loss else settings.trial_timeout_s
        deadline = t0 + bound
        while len(done) + len(lost) < len(procs):
            now = time.time()
            if now > deadline:
                raise TrialError(f"timed out after {bound:.0f} s")
            if first_done is not None and now - first_done > GRACE_AFTER_FIRST_DONE_S:
                for rid in set(procs) - set(done) - lost:  # hung: torchft never ends it
                    procs[rid].stop(grace_s=1.0)
                break
            for rid, proc in procs.items():
                rc = proc.poll()
                if rid in done or rid in lost or rc is None:
                    continue
                if node_loss and rc < 0:  # killed with its node
                    lost.add(rid)
                elif rc == 0:
                    done[rid] = now
                    first_done = first_done or now
                elif restarts[rid] < settings.torchrun_max_restarts:
                    restarts[rid] += 1
                    procs[rid] = start(rid, restarts[rid])
                else:
                    raise TrialError(f"replica {rid} exited with {rc}: {proc.last_line()}")
            time.sleep(0.05)
        if not done:
            raise TrialError("no replica finished")
        return max(done.values()) - t0
