"""A node's health probes (:class:`unicron.control.probes.Probes`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from unicron.control import probes
from unicron.control.probes import PROBE_TIMEOUT_S, Probes, _Probe


def test_a_probe_past_its_timeout_fails_at_once_even_if_it_never_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe stuck where a kill does not reach it (a driver hang in the kernel: here its
    kill does nothing) is reported failed at its timeout, not when it exits (before, never:
    its slot stayed probing for good), and stopping the agent does not wait on it."""
    monkeypatch.setattr(probes, "killpg", lambda pid: None)
    monkeypatch.setattr(probes, "REAP_WAIT_S", 0.1)
    p = Probes(tmp_path)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        now = time.time()
        p._running[3] = _Probe(proc, now - PROBE_TIMEOUT_S - 1, tmp_path / "health3.0.log")
        assert p.check(now) == [(3, False, f"no answer in {PROBE_TIMEOUT_S:g} s")]
        assert 3 not in p and p.check(now) == []
        p._running[4] = _Probe(proc, now, tmp_path / "health4.0.log")
        t0 = time.monotonic()
        p.kill_all(wait=True)
        assert time.monotonic() - t0 < 5 and not p
    finally:
        proc.kill()
        proc.wait()
