"""``unicron run`` as a command: help, bad input, Ctrl-C.

Bad usage or bad input is refused before anything starts: exit 2 and one line on stderr
(DESIGN.md, Contracts). Ctrl-C stops the whole run (coordinator, agent, zygote, workers)
and exits 130, leaving no process behind.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, TRAIN

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _unicron(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unicron", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=ENV,
    )


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]], ids=["unicron", "run"])
def test_help_exits_0(argv: list[str], tmp_path: Path) -> None:
    p = _unicron(*argv, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "usage: unicron" in p.stdout
    expected = ("--nproc-per-node", "--inject", "--events") if argv[0] == "run" else ("run",)
    for word in expected:
        assert word in p.stdout


BAD_INPUT = {
    "missing script": (["--nproc-per-node", "4", "no_such_script.py"], "no_such_script.py"),
    "non-integer rank": (["--inject", "crash:rank=x,step=1", str(TRAIN)], "rank"),
    "unknown fault": (["--inject", "boom:rank=1,step=1", str(TRAIN)], "boom"),
    "unknown error kind": (["--inject", "error:rank=1,step=1,kind=nope", str(TRAIN)], "nope"),
    "missing step": (["--inject", "hang:rank=1", str(TRAIN)], "step"),
    "zero workers": (["--nproc-per-node", "0", str(TRAIN)], "--nproc-per-node"),
    "rank out of range": (["--inject", "crash:rank=4,step=1", str(TRAIN)], "out of range"),
    "members above the world": (
        ["--inject", "crash:rank=1,step=1,members=5", str(TRAIN)],
        "members 5 out of range",
    ),
    "min-workers too high": (["--min-workers", "5", str(TRAIN)], "--min-workers"),
    "nproc not a number": (["--nproc-per-node", "x", str(TRAIN)], "--nproc-per-node"),
    "readmit-after zero": (["--readmit-after", "0", str(TRAIN)], "--readmit-after"),
    "give-up-after zero": (["--give-up-after", "0", str(TRAIN)], "--give-up-after"),
    "give-up-after nan": (["--give-up-after", "nan", str(TRAIN)], "--give-up-after"),
    "restart-window zero": (["--restart-window", "0", str(TRAIN)], "--restart-window"),
    "bucket-cap-mb negative": (["--bucket-cap-mb", "-1", str(TRAIN)], "--bucket-cap-mb"),
    "pp-choices not numbers": (["--pp-choices", "x", str(TRAIN)], "--pp-choices"),
    "tp-choices not numbers": (["--tp-choices", "1,y", str(TRAIN)], "--tp-choices"),
    "tp-choices zero": (["--tp-choices", "0", str(TRAIN)], "tp_choices"),
}


@pytest.mark.parametrize("argv, names", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_refused_with_one_line_and_nothing_started(
    argv: list[str], names: str, tmp_path: Path
) -> None:
    events, logs = tmp_path / "events.jsonl", tmp_path / "logs"
    run_args = ["run", "--events", str(events), "--log-dir", str(logs)]
    if "--nproc-per-node" not in argv:
        run_args += ["--nproc-per-node", "4"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = _unicron(*run_args, *argv, "--steps", "5", cwd=tmp_path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the refusal's CPU, not its wall time: a loaded machine stretches the latter (6.6 s seen
    # at load 50 for what takes 0.3 s of CPU, 0.6 s wall, idle); starting a run costs more
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("unicron: error:") and names in lines[0], lines[0]
    assert p.stdout == ""
    assert not events.exists() and not logs.exists()  # nothing was started
    assert cpu_s < 5, cpu_s


def _processes_with(marker: str) -> list[int]:
    """Processes whose command line or environment holds ``marker`` (workers forked from
    the zygote carry the environment, not the command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if any(marker.encode() in (proc / f).read_bytes() for f in ("cmdline", "environ")):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_ctrl_c_stops_every_process_and_exits_130(tmp_path: Path) -> None:
    marker = f"unicron-ctrl-c-{uuid.uuid4().hex}"
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unicron",
            "run",
            "--nproc-per-node",
            "4",
            "--events",
            str(events),
            "--log-dir",
            str(tmp_path / "logs"),
            "--quiet",
            str(TRAIN),
            "--steps",
            "100000",
            "--seed",
            "7",
            "--out",
            str(tmp_path / marker),
        ],
        cwd=tmp_path,
        env={**ENV, "UNICRON_TEST_MARKER": marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job inherits SIGINT ignored: Ctrl-C must reach this run
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        started = _wait_for(
            lambda: events.exists() and '"step_end"' in events.read_text(), timeout_s=90
        )
        assert started, "no step_end within 90 s"
        assert len(_processes_with(marker)) >= 6  # runner, zygote, 4 workers
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 130, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _wait_for(lambda: not _processes_with(marker), timeout_s=5), [
        Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _processes_with(marker)
    ]
    assert "interrupted" in stderr
    last = events.read_text().splitlines()[-1]
    assert '"task_end"' in last and '"interrupted"' in last


@pytest.mark.long
def test_a_finished_run_leaves_no_temporary_folder(tmp_path: Path) -> None:
    """Without ``--log-dir`` the run's folder is temporary: gone once the task finished (with
    the service's state folder, which goes from a ``--log-dir`` given too)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "2", str(TRAIN),
         "--steps", "2"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, env={**ENV, "TMPDIR": str(tmp)},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "task train: ok after 2 steps" in p.stderr
    assert "worker logs" not in p.stderr
    assert sorted(tmp.glob("unicron-*")) == [] and sorted(tmp.glob("cluster-*")) == []
