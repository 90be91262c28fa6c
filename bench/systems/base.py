"""The parts every benchmarked system shares: settings, scenarios, arms, launched processes.

An *arm* is one configuration of one system (``torchrun K=10``, ``unicron``); the harness
runs every arm of a scenario in turn, repetition after repetition (A B A B), and each run of
an arm (a *trial*) returns its figures as metric name -> value. A trial that fails raises
:class:`TrialError` with the reason, and the harness reports the arm as failed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bench.common import kind_metric
from bench.events import Event, actions, alarms, detection_by_method, measure
from unicron.detect.classify import KINDS, RULES, verdict_for_kind

REPO = Path(__file__).resolve().parents[2]
ONE_PER_SEVERITY = ("conn_reset", "cuda", "ecc")
"""One error kind per severity: SEV3 (reattempt), SEV2 (restart), SEV1 (exclude). The error
kinds of ``--quick``, and those torchrun runs in the full suite (it handles every raised
error alike: the worker exits, the agent restarts the group; ``--quick`` runs it on the
default kind only)."""


def error_kinds() -> tuple[str, ...]:
    """Every kind ``--inject error:kind=K`` can raise but ``unknown``: SEV3 first, then SEV2,
    then SEV1, each in the order of the classification table."""
    order = {rule.kind: i for i, rule in enumerate(RULES)}
    kinds = [k for k in KINDS if k != "unknown"]
    return tuple(sorted(kinds, key=lambda k: (-int(verdict_for_kind(k).severity), order[k])))


class TrialError(RuntimeError):
    """One trial failed; the message is the reason (an exit code and the output's last line)."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How big the runs are; ``--quick`` and the full suite differ only here."""

    quick: bool
    reps: int
    steps: int
    fault_step: int
    ckpt_every: tuple[int, ...]
    """Checkpoint intervals K of the torchrun baseline (steps)."""
    hang_timeout_s: float
    """Process-group (torchrun) and collective (torchft) timeout in the hang scenario."""
    trial_timeout_s: float
    fault_rank: int = 3
    error_kind: str = "cuda"
    """The error kind every arm runs (torchrun's default timeout and K=50, torchft too)."""
    error_kinds: tuple[str, ...] = ("cuda",)
    """The error kinds of the ``error`` scenario, each run by Unicron."""
    torchrun_error_kinds: tuple[str, ...] = ("cuda",)
    """The error kinds torchrun runs too (with ``error_pg_timeout_s``): a subset of
    ``error_kinds``; its mechanism does not look at the kind, so one per severity is enough."""
    error_pg_timeout_s: float = 60.0
    """torchrun's process-group timeout in the per-kind arm of the ``error`` scenario."""
    soak_s: float = 120.0
    """Target wall time of the fault-free ``soak`` run (its steps come from the step time)."""
    nproc: int = 4
    torchrun_max_restarts: int = 3
    nnodes: int = 2
    """Agents (nodes) on this machine in the node scenario, ``nproc / nnodes`` workers each."""
    node_trial_timeout_s: float = 120.0
    """Wall-time bound of one trial of the node scenario (torchrun waits out rendezvous)."""

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if not 0 < self.fault_step < self.steps:
            raise ValueError(f"fault_step must be in 1..steps-1, got {self.fault_step}")
        if self.nnodes < 2 or self.nproc % self.nnodes:
            raise ValueError(f"nnodes must be >= 2 and divide nproc, got {self.nnodes}")
        bad = [k for k in self.error_kinds if k not in KINDS]
        if bad or self.error_kind not in self.error_kinds:
            raise ValueError(
                f"error_kinds must be kinds of unicron.detect.classify.KINDS and hold error_kind "
                f"{self.error_kind!r}, got {self.error_kinds}"
            )
        if not set(self.torchrun_error_kinds) <= set(self.error_kinds) or (
            self.error_kind not in self.torchrun_error_kinds
        ):
            raise ValueError(
                f"torchrun_error_kinds must be error_kinds and hold error_kind "
                f"{self.error_kind!r}, got {self.torchrun_error_kinds}"
            )

    @classmethod
    def make(cls, quick: bool, reps: int | None = None) -> Settings:
        """The quick (a few minutes) or full (under an hour) settings."""
        if quick:
            return cls(
                quick=True,
                reps=reps or 2,
                steps=32,
                fault_step=25,
                ckpt_every=(10,),
                hang_timeout_s=10.0,
                trial_timeout_s=150.0,
                error_kinds=ONE_PER_SEVERITY,
                torchrun_error_kinds=("cuda",),
                soak_s=30.0,
            )
        return cls(
            quick=False,
            reps=reps or 3,
            steps=100,
            fault_step=75,
            ckpt_every=(10, 50),
            hang_timeout_s=60.0,
            trial_timeout_s=400.0,
            node_trial_timeout_s=180.0,
            error_kinds=error_kinds(),
            torchrun_error_kinds=ONE_PER_SEVERITY,
            soak_s=600.0,
        )


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One thing measured: a training run with these faults, or a module's own rows."""

    name: str
    description: str
    faults: tuple[str, ...] = ()
    kind: str | None = None
    """The error kind (``error`` scenario): its figures are named ``metric[kind]``."""
    steps: int | None = None
    """Steps of a run, where not ``settings.steps`` (the soak)."""
    timeout_s: float | None = None
    """Wall-time bound of a trial, where not ``settings.trial_timeout_s`` (the soak)."""
    reps: int | None = None
    """Repetitions, where not ``settings.reps`` (the soak runs once: its figures are counts and
    percentiles over one long run)."""

    @property
    def fault_kind(self) -> str | None:
        """``crash``, ``hang``, ... of the first fault (``None`` for a fault-free run)."""
        return self.faults[0].partition(":")[0] if self.faults else None

    def metric(self, name: str) -> str:
        """The row name of figure ``name`` here: ``detection_s[cuda]`` for error kind cuda."""
        return kind_metric(name, self.kind)

    def run_steps(self, settings: Settings) -> int:
        """How many steps one trial runs."""
        return self.steps or settings.steps

    def run_reps(self, settings: Settings) -> int:
        """How many repetitions of this scenario run."""
        return self.reps or settings.reps

    def run_timeout_s(self, settings: Settings) -> float:
        """The wall-time bound of one trial (not the node scenario's)."""
        return self.timeout_s or settings.trial_timeout_s


class Arm(Protocol):
    """One configuration of one system, run once per repetition."""

    @property
    def system(self) -> str:
        """The system's registry name (``--system``)."""
        ...

    @property
    def label(self) -> str:
        """The name in the results (system plus its configuration)."""
        ...

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """Run one trial in the empty folder ``workdir``; return metric -> value."""
        ...


def figures(events: list[Event], wall_s: float, scenario: Scenario) -> dict[str, float]:
    """The trial's metrics from its events; raise :class:`TrialError` if a fault went unseen."""
    outcome = measure(events)
    if scenario.faults and outcome.faults == 0:
        raise TrialError("the injected fault never fired (no fault_injected event)")
    if scenario.faults and outcome.unrecovered:
        raise TrialError("no step finished after the fault")
    out = {"wall_s": wall_s, **outcome.metrics()}
    heartbeat = detection_by_method(events, "heartbeat")
    if heartbeat is not None:
        out["detection_heartbeat_s"] = heartbeat
    # counts for a row's note, not rows: ``action:restart`` (what Unicron did), ``alarm:hang``
    for name, count in actions(events).items():
        out[f"action:{name}"] = float(count)
    if not scenario.faults:  # what raised each false alarm (hang, straggler, ...)
        for kind, count in alarms(events).items():
            out[f"alarm:{kind}"] = float(count)
    return out


@dataclass
class Launched:
    """A child process in its own session, its output stamped line by line as it arrives.

    ``watch`` maps a regular expression to a callback run (from the reader thread) with the
    arrival time of each matching line: that is how torchrun's agent log becomes events.
    """

    proc: subprocess.Popen[bytes]
    log_path: Path
    watch: dict[str, Callable[[float, str], None]] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    _reader: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        cmd: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        watch: dict[str, Callable[[float, str], None]] | None = None,
    ) -> Launched:
        """Start ``cmd`` in the repository root with ``PYTHONPATH`` set to it."""
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        proc = subprocess.Popen(
            list(cmd),
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        launched = cls(proc=proc, log_path=log_path, watch=dict(watch or {}))
        launched._reader = threading.Thread(target=launched._read, daemon=True)
        launched._reader.start()
        return launched

    def _read(self) -> None:
        assert self.proc.stdout is not None
        patterns = [(re.compile(p), cb) for p, cb in self.watch.items()]
        with open(self.log_path, "ab") as log:
            for raw in self.proc.stdout:
                ts = time.time()
                log.write(raw)
                line = raw.decode(errors="replace").rstrip()
                self.tail.append(line)
                for pattern, callback in patterns:
                    if pattern.search(line):
                        callback(ts, line)

    def wait(self, timeout_s: float) -> int:
        """Wait for the exit (and the last output); kill it and raise on timeout."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            last = self.last_line()
            raise TrialError(f"timed out after {timeout_s:.0f} s; last output: {last}") from None
        if self._reader is not None:
            self._reader.join(timeout=5)
        return rc

    def poll(self) -> int | None:
        """The exit code, or ``None`` while it runs."""
        return self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL what is left after ``grace_s``."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left after the leader exited

    def last_line(self) -> str:
        """The last meaningful output line (an error, usually)."""
        for line in reversed(self.tail):
            if line.strip() and not line.startswith(" "):
                return line.strip()[-300:]
        return "(no output)"

    def check(self, rc: int, what: str) -> None:
        """Raise :class:`TrialError` if ``rc`` is not 0."""
        if rc != 0:
            raise TrialError(f"{what} exited with {rc}: {self.last_line()}")


def python() -> str:
    """The interpreter running the suite (the project's virtual environment)."""
    return sys.executable


def reap_workers(folder: Path) -> int:
    """Kill baseline workers that registered a pid file in ``folder`` and still run.

    Only processes whose command line names ``bench.baselines`` are touched, so a recycled
    pid is left alone. Returns how many were killed.
    """
    killed = 0
    for pid_file in folder.glob("pid-*"):
        pid = int(pid_file.name.removeprefix("pid-"))
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"bench.baselines" in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
