"""The health probes of one node's excluded slots: a fresh process each
(``python -m unicron.runtime.health``), polled without blocking.

Owned by the node's :class:`~unicron.control.agent.Agent`, which starts a probe when the
coordinator's reply asks for one (``Probe``) and reports each verdict :meth:`Probes.check`
returns as ``ProbeDone``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unicron.control.workerenv import Account, as_account, killpg

__all__ = ["PROBE_TIMEOUT_S", "Probes"]

PROBE_TIMEOUT_S = 120.0
"""a health probe (a fresh process: imports, then milliseconds of work) that takes longer fails"""
REAP_WAIT_S = 5.0
"""how long stopping the agent waits for each killed probe to exit"""


@dataclass
class _Probe:
    """A running health probe: its process, start time and output."""

    proc: subprocess.Popen[bytes]
    started: float
    log: Path


class Probes:
    """The running probes of a node's slots, by slot."""

    def __init__(self, log_dir: Path, account: Account | None = None) -> None:
        self.log_dir = log_dir
        self.account = account  # the probes run as the workers do
        self._running: dict[int, _Probe] = {}
        self._unreaped: list[subprocess.Popen[bytes]] = []  # killed, overran: reaped later

    def __bool__(self) -> bool:
        return bool(self._running)

    def __contains__(self, slot: int) -> bool:
        return slot in self._running

    def start(self, slot: int, env: dict[str, str]) -> None:
        """Start ``slot``'s probe with ``env`` (its log: ``health<slot>.<n>.log``); a slot
        whose probe runs is left alone. Raises :class:`OSError` when it cannot start."""
        if slot in self._running:
            return
        n = sum(1 for _ in self.log_dir.glob(f"health{slot}.*.log"))
        log_path = self.log_dir / f"health{slot}.{n}.log"
        user, group, extra_groups = as_account(self.account)
        with open(log_path, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "unicron.runtime.health", "--slot", str(slot)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                user=user,
                group=group,
                extra_groups=extra_groups,
            )
        self._running[slot] = _Probe(proc, time.time(), log_path)

    def check(self, now: float) -> list[tuple[int, bool, str]]:
        """``(slot, ok, detail)`` of every probe that ended since; one that overran
        :data:`PROBE_TIMEOUT_S` failed: it is killed (its whole process group) and returned at
        once, its exit reaped later (found in review: a probe stuck in the kernel, the fault
        a probe looks for, never exited, so its slot stayed probing for good). Never blocks."""
        self._unreaped = [p for p in self._unreaped if p.poll() is None]
        ended: list[tuple[int, bool, str]] = []
        for slot, probe in list(self._running.items()):
            code = probe.proc.poll()
            if code is None and now - probe.started < PROBE_TIMEOUT_S:
                continue
            del self._running[slot]
            if code is None:
                killpg(probe.proc.pid)
                self._unreaped.append(probe.proc)
                ok, detail = False, f"no answer in {PROBE_TIMEOUT_S:g} s"
            else:
                lines = probe.log.read_text(errors="replace").strip().splitlines()
                ok = code == 0
                detail = lines[-1] if lines else f"exit code {code}"
            ended.append((slot, ok, detail))
        return ended

    def kill_all(self, *, wait: bool = False) -> None:
        """SIGKILL every probe's process group (``wait``: and reap them, a few seconds each at
        most: one stuck in the kernel is left to init; forgotten then)."""
        for probe in self._running.values():
            killpg(probe.proc.pid)
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    probe.proc.wait(timeout=REAP_WAIT_S)
        if wait:
            self._running.clear()
