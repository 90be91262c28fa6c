"""The cluster demo: ``make cluster-demo``.

Three "machines" on this one: network namespaces on a bridge (as root, with iproute2; else
distinct loopback addresses), an agent in each (``unicron agent``, one slot), and the
coordinator service on the host side (``unicron coordinator``). A task of three workers, one
per machine, trains the small GPT over gloo across them, and meets:

1. a node loss: machine n0 vanishes mid-training (its agent and worker, ``--inject node``);
   the other two go on without it;
2. the node's return: a new agent under the same name; the task grows back to three;
3. the coordinator's death: ``kill -9``, then a restart on the same state directory; the
   training goes on meanwhile and the new coordinator adopts the task.

``unicron status`` is printed along the way; at the end a fault-free ``unicron run`` of the
same script on three workers must give the same parameters, bit for bit. Exit 0 when it does.
Everything started is stopped and the namespaces removed, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from unicron.control import netns
from unicron.control.events import read_events
from unicron.control.lab import LocalCluster
from unicron.control.report import task_end

HERE = Path(__file__).resolve().parent
SHOWN = ("error_detected", "action", "epoch_begin", "control_plane", "task_end")


def status(c: LocalCluster, console: Console) -> None:
    """``unicron status``, as a user would type it."""
    env = {**c.env(), "UNICRON_COORDINATOR": c.url}
    out = subprocess.run(
        [sys.executable, "-m", "unicron", "status"], env=env, capture_output=True, text=True
    )
    console.print(out.stdout.rstrip() or out.stderr.rstrip(), markup=False, highlight=False)


def timeline(events: list[dict[str, Any]], console: Console) -> None:
    t0 = events[0]["ts"] if events else 0.0
    for e in events:
        if e["event"] not in SHOWN:
            continue
        what = {k: v for k, v in e.items() if k not in ("ts", "event", "task", "allocation")}
        if isinstance(what.get("reason"), str):
            what["reason"] = what["reason"].splitlines()[0][:80]
        line = f"  {e['ts'] - t0:7.2f} s  {e['event']:<15} {what}"
        console.print(line[:200], markup=False, highlight=False)


def reference(workdir: Path, steps: int) -> str | None:
    events = workdir / "reference.jsonl"
    subprocess.run(
        [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "3", "--quiet",
         "--events", str(events), "--log-dir", str(workdir / "reference-logs"),
         str(HERE / "train_gpt.py"), "--steps", str(steps)],
        check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )  # fmt: skip
    end = task_end(read_events(events)) or {}
    return end.get("params_sha256")


def demo(c: LocalCluster, steps: int, console: Console) -> str | None:
    console.rule("1/5  a coordinator and three agents")
    how = "network namespaces" if c.isolated else f"loopback ({netns.available()})"
    console.print(f"machines: {how}; coordinator at {c.url}")
    c.start_coordinator()
    for host in range(3):  # one by one: node ids follow the names (n0 is node 0)
        c.start_agent(host)
    status(c, console)

    console.rule("2/5  a task across the three machines; machine n0 vanishes at step 10")
    task = c.root / "task.yaml"
    task.write_text(
        f"name: gpt\nscript: {HERE / 'train_gpt.py'}\nargs: [--steps, '{steps}']\n"
        "workers: {min: 1, max: 3}\ninject: ['node:node=0,step=10']\n"
    )
    env = {**c.env(), "UNICRON_COORDINATOR": c.url}
    subprocess.run([sys.executable, "-m", "unicron", "submit", str(task)], env=env, check=True)
    code = c.agents[0].wait(timeout=300)
    console.print(f"the agent of n0 exited with code {code} (its machine is gone)")
    c.wait_until(lambda: c.node("n0")["state"] == "lost", "n0 lost")
    c.wait_task("gpt", lambda v: v["workers"] == 2 or v["state"] != "running")
    status(c, console)

    console.rule("3/5  machine n0 comes back (a new agent, the same name)")
    c.start_agent(0)
    view = c.wait_task("gpt", lambda v: v["workers"] == 3 or v["state"] != "running")
    console.print(f"the task is at step {view['step'] + 1} with {view['workers']} workers")
    status(c, console)

    console.rule("4/5  kill -9 the coordinator, restart it on the same state directory")
    at = view["step"]
    c.wait_task("gpt", lambda v: v["step"] >= at + 5 or v["state"] != "running")
    c.kill_coordinator()
    console.print("coordinator killed; the training goes on without it for 2 s")
    time.sleep(2.0)
    c.start_coordinator()
    status(c, console)
    view = c.wait_task("gpt", timeout_s=600)
    status(c, console)

    console.rule("5/5  what happened (the task's event log, from the coordinator)")
    events = c.events("gpt")
    timeline(events, console)
    steps_seen = [e["step"] for e in events if e["event"] == "step_end"]
    console.print(
        f"steps committed: {len(steps_seen)}, each once: {steps_seen == list(range(steps))}"
    )
    if view["state"] != "done":
        console.print(f"[bold red]the task ended {view['state']}: {view['outcome']}[/]")
        return None
    return str(view["outcome"]["params_sha256"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, state)")
    args = p.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 120)
    workdir = Path(tempfile.mkdtemp(prefix="unicron-cluster-demo-"))
    try:
        with LocalCluster(workdir / "cluster", hosts=3, slots=1) as c:
            got = demo(c, args.steps, console)
        console.rule("the fault-free reference: unicron run --nproc-per-node 3")
        want = reference(workdir, args.steps)
        console.print(f"cluster run, healed:  params sha256 {got}")
        console.print(f"unicron run, no fault: params sha256 {want}")
        if got is not None and got == want:
            console.print("[bold green]bitwise identical: node loss, node return and the "
                          "coordinator's death changed nothing[/bold green]")  # fmt: skip
            return 0
        console.print("[bold red]the cluster run's parameters differ[/bold red]")
        return 1
    finally:
        if args.keep:
            console.print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
