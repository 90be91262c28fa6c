"""The health probes of one node's excluded slots: a fresh process each
(``python -m unicron.runtime.health``), polled without blocking.

Owned by the node's :class:`~unicron.control.agent.Agent`, which starts a probe when the
coordinator's reply asks for one (``Probe``) and reports each verdict :meth:`Probes.check`
returns as ``ProbeDone``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unicron.control.workerenv import Account, as_account, killpg

__all__ = ["PROBE_TIMEOUT_S", "Probes"]

PROBE_TIMEOUT_S = 120.0
"""a health probe (a fresh process: imports, then milliseconds of work) that takes longer fails"""


@dataclass
class _Probe:
    """A running health probe: its process, start time and output."""

    proc: subprocess.Popen[bytes]
    started: float
    log: Path
    overran: bool = False


class Probes:
    """The running probes of a node's slots, by slot."""

    def __init__(self, log_dir: Path, account: Account | None = None) -> None:
        self.log_dir = log_dir
        self.account = account  # the probes run as the workers do
        self._running: dict[int, _Probe] = {}

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
        :data:`PROBE_TIMEOUT_S` is killed (its whole process group) and returned once its
        exit is seen. Never blocks."""
        ended: list[tuple[int, bool, str]] = []
        for slot, probe in list(self._running.items()):
            code = probe.proc.poll()
            if code is None:
                if now - probe.started >= PROBE_TIMEOUT_S and not probe.overran:
                    probe.overran = True
                    killpg(probe.proc.pid)
                continue
            del self._running[slot]
            if probe.overran:
                ok, detail = False, f"no answer in {PROBE_TIMEOUT_S:g} s"
            else:
                lines = probe.log.read_text(errors="replace").strip().splitlines()
                ok = code == 0
                detail = lines[-1] if lines else f"exit code {code}"
            ended.append((slot, ok, detail))
        return ended

    def kill_all(self, *, wait: bool = False) -> None:
        """SIGKILL every probe's process group (``wait``: and reap them; forgotten then)."""
        for probe in self._running.values():
            killpg(probe.proc.pid)
            if wait:
                probe.proc.wait()
        if wait:
            self._running.clear()
