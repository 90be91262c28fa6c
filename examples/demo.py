"""The self-healing demo: ``make demo``.

Trains the small GPT of ``gpt.py`` on 4 CPU workers for 120 steps twice: once with no fault,
once losing workers to SIGKILL (one mid-step, then the worker that is rank 0). The second run
goes on without restarting the healthy workers, takes the killed ones back, and must end with
the same parameters, bit for bit. Prints the timeline of every fault and both SHA-256 sums.
Exit 0 when the healed run matches the fault-free one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from unicron.control.events import read_events
from unicron.control.report import steps_redone, task_end

HERE = Path(__file__).resolve().parent


def unicron_run(workdir: Path, name: str, steps: int, faults: list[str], quiet: bool) -> Path:
    events = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "unicron",
        "run",
        "--nproc-per-node",
        "4",
        "--events",
        str(events),
        "--log-dir",
        str(workdir / f"{name}-logs"),
    ]
    for spec in faults:
        cmd += ["--inject", spec]
    if quiet:
        cmd.append("--quiet")
    cmd += [str(HERE / "train_gpt.py"), "--steps", str(steps), "--out", str(workdir / name)]
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"demo: `unicron run` ({name}) exited with {rc}")
    return events


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    args = p.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 120)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="unicron-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    s = args.steps
    faults = [f"crash:rank=1,step={s // 4}", f"crash:rank=0,step={s * 5 // 8}"]

    console.rule("1/2  fault-free reference run (4 workers)")
    clean = read_events(unicron_run(workdir, "clean", s, [], quiet=True))
    console.rule(f"2/2  the same run with faults: {', '.join(faults)}")
    healed = read_events(unicron_run(workdir, "healed", s, faults, quiet=False))

    console.rule("result")
    a, b = task_end(clean) or {}, task_end(healed) or {}
    same = a.get("params_sha256") == b.get("params_sha256") and a.get("params_sha256")
    console.print(
        f"fault-free run: loss {a.get('final_loss'):.6f}  params sha256 {a.get('params_sha256')}"
    )
    console.print(
        f"healed run:     loss {b.get('final_loss'):.6f}  params sha256 {b.get('params_sha256')}"
    )
    console.print(
        f"finished steps lost: {steps_redone(healed)}; wall time "
        f"{a.get('wall_s')} s fault-free, {b.get('wall_s')} s with faults"
    )
    if same:
        console.print("[bold green]bitwise identical: the failures changed nothing[/bold green]")
        return 0
    console.print("[bold red]the healed run's parameters differ from the fault-free run's[/]")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
