"""A standby coordinator takes over from a lost leader host, again and again: the time until
every task commits a step again.

Two ``unicron coordinator --etcd`` on one state directory, each in a network namespace of its
own (a leader, a standby), etcd on the host side (the distribution's ``etcd-server``), two
agents of two slots in two more namespaces, one task of four workers
(``examples/train_gpt.py``). Per loss: the leader's link is cut (its host lost: its processes
alive, unreachable); the time from the cut to the first step committed in an epoch the
new leader announced (``takeover_s``, goal < 5 s); the old leader must exit by itself
(``fenced``: it could not renew its lease). Then its link comes back and it is started
again, as the standby, and the next loss cuts the new leader. At the end: every step
committed exactly once (``steps_lost``, ``steps_twice``), and the final parameters against a
fault-free ``unicron run`` of as many steps (``bitwise_identical``).

``python -m bench.standby [--losses N] [--quick]`` (root, iproute2, etcd). Writes
``bench/results/cluster-standby.json``. docs/cluster.md, A standby coordinator.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import (
    RESULTS_DIR,
    Row,
    bench_parser,
    make_row,
    positive_int,
    print_table,
    save_scenario,
    write_summary,
)
from bench.events import read_events
from unicron.control import netns
from unicron.control.lab import LocalCluster
from unicron.control.lease import FENCED_EXIT

SCENARIO = "cluster-standby"
SYSTEM = "unicron cluster"
ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 5.0
SETTLE_S = 4.0
"""after a takeover: the old leader back as the standby, the task training, before the next cut"""


def _first_commit_after(c: LocalCluster, name: str, ts: float, timeout_s: float) -> float:
    """When the first step committed in an epoch the new leader announced (after ``ts``, the
    cut; a step in flight at the cut may still commit through the old one's store)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            events = c.events(name)
        except Exception:  # the leader changing hands: ask again
            events = []
        new = [e["epoch"] for e in events if e["event"] == "epoch_begin" and e["ts"] > ts]
        after = [e["ts"] for e in events if e["event"] == "step_end" and new
                 and e["epoch"] >= min(new)]  # fmt: skip
        if after:
            return float(min(after))
        time.sleep(0.1)
    raise TimeoutError(f"no step committed within {timeout_s:.0f} s of the cut")


def _fault_free(workdir: Path, steps: int) -> str:
    """The parameters' digest of ``unicron run`` of the same task without faults."""
    workdir.mkdir()
    events = workdir / "events.jsonl"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "4", "--quiet",
           "--events", str(events), "--log-dir", str(workdir / "logs"),
           str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps),
           "--out", str(workdir / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the fault-free run failed: {proc.stderr[-2000:]}")
    end = [e for e in read_events(events) if e["event"] == "task_end"][-1]
    return str(end["params_sha256"])


def measure(losses: int, steps: int, workdir: Path) -> list[Row]:
    """The rows of ``losses`` leader hosts lost in one run of ``steps`` steps."""
    ref_sha = _fault_free(workdir / "ref", steps)
    takeovers: list[float] = []
    fenced = 0
    with LocalCluster(workdir / "ha", hosts=4, slots=2, coordinator_hosts=(0, 1)) as c:
        assert isinstance(c.net, netns.Lab)  # checked by main: hosts that can be cut off
        c.coordinator_args = ("--etcd", c.start_etcd(), "--lease-ttl", "2")
        c.start_coordinator(host=0)
        c.start_coordinator(host=1, wait=False)
        for host in (2, 3):
            c.start_agent(host, wait=False)
        c.wait_nodes(2)
        c.submit({"name": "ha", "script": str(ROOT / "examples" / "train_gpt.py"),
                  "args": ["--steps", str(steps)], "workers": {"min": 1, "max": 4}})  # fmt: skip
        c.wait_task("ha", lambda v: v["step"] >= 8)
        leader = 0
        for i in range(losses):
            if c.task("ha")["step"] > steps - 150:
                raise RuntimeError(f"the task is about to end before loss {i + 1} (slow machine)")
            cut = time.time()
            c.net.cut(leader)
            takeovers.append(_first_commit_after(c, "ha", cut, 60.0) - cut)
            fenced += c.coordinators[leader].wait(timeout=30) == FENCED_EXIT
            print(f"loss {i + 1}: host {leader} cut, a step committed {takeovers[-1]:.2f} s "
                  "later", file=sys.stderr, flush=True)  # fmt: skip
            c.net.restore(leader)
            c.start_coordinator(host=leader, wait=False)  # back, as the standby
            leader = 1 - leader
            time.sleep(SETTLE_S)
        view = c.wait_task("ha", timeout_s=3600)
        events = c.events("ha")
    counts = Counter(e["step"] for e in events if e["event"] == "step_end")
    lost = sum(1 for s in range(steps) if s not in counts)
    twice = sum(1 for n in counts.values() if n > 1)
    exact = view.get("outcome", {}).get("params_sha256") == ref_sha
    base = {"system": SYSTEM, "scenario": SCENARIO}
    setup = (
        f"{losses} leader hosts lost (link cut) in one run of {steps} steps, 4 workers on 2 "
        f"agents, lease ttl 2 s; load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores"
    )
    over = sum(1 for t in takeovers if t >= GOAL_S)
    return [
        make_row(**base, metric="takeover_s", values=takeovers, unit="s",
                 note=f"cut to the next committed step; goal < {GOAL_S:g} s: {over} over; "
                 + setup),
        make_row(**base, metric="fenced", values=[fenced], unit="",
                 note=f"of {losses} lost leaders, exited by themselves (lease not renewed)"),
        make_row(**base, metric="steps_lost", values=[lost], unit="", note="goal 0"),
        make_row(**base, metric="steps_twice", values=[twice], unit="", note="goal 0"),
        make_row(**base, metric="bitwise_identical", values=[1.0 if exact else 0.0], unit="",
                 note="final parameters == the fault-free run's"),
        make_row(**base, metric="state", values=[1.0 if view["state"] == "done" else 0.0],
                 unit="", note=f"the task ended {view['state']}"),
    ]  # fmt: skip


def missing() -> str | None:
    """What this machine lacks for the scenario, or ``None``."""
    if shutil.which("etcd") is None:
        return "needs etcd (apt-get install etcd-server)"
    if (why := netns.available()) is not None:
        return f"needs network namespaces ({why})"
    return None


def run(quick: bool, losses: int | None = None, keep: Path | None = None) -> list[Row]:
    """The scenario's rows (``python -m bench --scenario cluster-standby`` calls it);
    ``keep``: leave every log there."""
    if (why := missing()) is not None:
        raise RuntimeError(why)
    losses = losses or (3 if quick else 10)
    steps = 300 + losses * 200
    if keep is not None:
        keep.mkdir(parents=True)
        return measure(losses, steps, keep)
    with tempfile.TemporaryDirectory(prefix="unicron-bench-standby-") as tmp:
        return measure(losses, steps, Path(tmp))


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.standby", __doc__, quick="3 losses instead of 10")
    p.add_argument("--losses", type=positive_int, default=None, help="leader hosts lost (10)")
    p.add_argument("--keep", type=Path, default=None, help="leave every log in this new dir")
    args = p.parse_args(argv)
    if (why := missing()) is not None:
        p.error(why)
    if args.keep is not None and args.keep.exists():
        p.error(f"--keep {args.keep}: already exists")
    rows = run(args.quick, args.losses, args.keep)
    print_table(rows, title="A standby coordinator: leader hosts lost")
    save_scenario(rows, SCENARIO, RESULTS_DIR, replace=True)
    write_summary(RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
