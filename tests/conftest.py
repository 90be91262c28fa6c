"""Shared helpers for the end-to-end tests: run ``unicron run`` as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from unicron.control.events import read_events

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_gpt.py"


@dataclass
class RunResult:
    returncode: int
    events: list[dict[str, Any]]
    stderr: str
    out: Path

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    @property
    def task_end(self) -> dict[str, Any]:
        ends = self.of("task_end")
        assert ends, f"no task_end event; stderr:\n{self.stderr[-3000:]}"
        return ends[-1]


def run_unicron(
    tmp: Path,
    *run_args: str,
    script: Path = TRAIN,
    script_args: tuple[str, ...] = (),
    steps: int | None = 30,
    timeout: float = 180.0,
) -> RunResult:
    """``python -m unicron run --nproc-per-node ... SCRIPT --steps N --out DIR``."""
    events = tmp / "events.jsonl"
    out = tmp / "out"
    args = [
        sys.executable,
        "-m",
        "unicron",
        "run",
        "--events",
        str(events),
        "--log-dir",
        str(tmp / "logs"),
        *run_args,
        str(script),
    ]
    if script == TRAIN:
        args += ["--out", str(out)]
        if steps is not None:
            args += ["--steps", str(steps)]
    args += list(script_args)
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    (tmp / "stderr.txt").write_text(proc.stderr)  # beside its logs: what a failed run said
    evs = read_events(events) if events.exists() else []
    return RunResult(proc.returncode, evs, proc.stderr, out)


@pytest.fixture
def run(tmp_path: Path) -> Any:
    counter = iter(range(1000))

    def _run(*run_args: str, **kw: Any) -> RunResult:
        d = tmp_path / f"run{next(counter)}"
        d.mkdir()
        return run_unicron(d, *run_args, **kw)

    return _run


@pytest.fixture(scope="session")
def fault_free_4x24(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The fault-free reference of 4 workers and 24 steps of the example, computed once for
    every module that checks a healed run of that shape bit for bit."""
    r = run_unicron(tmp_path_factory.mktemp("clean"), "--nproc-per-node", "4", steps=24)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == 24
    assert r.task_end["params_sha256"]
    return r
