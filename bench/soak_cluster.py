"""The cluster soak: a thousand faults across tasks, nodes, the store and the coordinator.

A namespace cluster (:class:`unicron.control.lab.LocalCluster`): two coordinators on one
state directory, a leader and a standby holding their lease in etcd, each in a host of its
own; four agents of three slots in four more; three tasks of different weights and sizes
(:data:`TASKS`: two GPTs, data parallel, and a Llama-style model in two or three
tensor-parallel replicas of two ranks). Two kinds of faults, both seeded:

- **in the workers**: planned by step as ``bench.chaos`` plans them (crashes, hangs, every
  error kind of the classification table, slow workers: each task's ``inject`` list, on the
  slots 0..max-1, which fire where such a slot is live then: in a cluster a task's slots
  get new numbers as the planner replaces lost ones), and made by this driver every
  ``--worker-period`` seconds on a live worker of a task chosen in turn, one that has
  committed :data:`HEALED_STEPS` steps since its previous such fault (as ``bench.chaos``
  spaces faults by steps: a task hit faster than it heals never trains): ``kill -9`` (a
  crash) or ``SIGSTOP`` (a hang), the worker found by its log file (``/proc/PID/fd/1``);
- **in the cluster**, made by this driver one at a time every ``--period`` seconds, each kind
  in turn (shuffled rounds): an agent ``kill -9`` (its node and workers lost) and its return;
  an agent host's link cut (``ip link set down`` in its namespace: a partition, its processes
  alive) and restored; the training store's process ``kill -9``; the leading coordinator
  ``kill -9``; the leader's host cut off (its store with it). After a coordinator fault the
  standby leads (its lease), the old one comes back as the standby.

Each task then runs again alone, without faults (``unicron run`` on as many workers); every
task's final parameters must equal that run's bit for bit. From the tasks' event logs: every
fault's detection and recovery time, per kind (p50, p99; a worker fault: its first
``error_detected`` about its slot, then the next committed step; a node or link fault: the
first detection naming the node; the store: the ``control_plane`` record of its loss; a
coordinator fault: the new leader's adoption record), steps committed twice or never, stale
commits (a step committed in an older epoch after a newer one committed: what fencing must
rule out), the planner's decisions (``plan`` events), each task's ETTR (the fraction of its
wall time spent training at its median step period), and what would have needed a human
(a task that failed, a fault never detected, a node that did not come back).

    python -m bench.soak_cluster [--faults N] [--period S] [--seed S] [--keep DIR]
    python -m bench.soak_cluster --quick        # ~150 faults, a few minutes

Needs root, iproute2 and etcd (``apt-get install etcd-server``). Writes
``bench/results/soak-cluster.json`` (rows) and ``bench/results/soak-cluster.md`` (the table).
Not part of ``python -m bench``: it is a long scenario of its own (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos import FAULT_KINDS, TIME_SCALE, measure_faults, same_state, schedule
from bench.common import (
    RESULTS_DIR,
    Row,
    bench_parser,
    make_row,
    positive_int,
    print_table,
    save_scenario,
    write_summary,
    write_text_atomic,
)
from bench.events import Event, percentile
from unicron.control import netns
from unicron.control.lab import MARKER, LocalCluster

SCENARIO = "soak-cluster"
SYSTEM = "unicron cluster"
ROOT = Path(__file__).resolve().parents[1]
COORDINATOR_HOSTS = (0, 1)
AGENT_HOSTS = (2, 3, 4, 5)
SLOTS = 3
CLUSTER_KINDS = ("agent_kill", "link_cut", "store_kill", "coordinator_kill", "leader_cut")
WORKER_KINDS = ("worker_kill", "worker_stop")
"""the driver's own faults in a worker: ``kill -9`` (a crash), ``SIGSTOP`` (a hang)"""
WORKER_WEIGHTS = (3, 1)
HEALED_STEPS = 3
"""steps a task commits after one of the driver's worker faults before the next one"""
DOWN_S = 6.0
"""how long a killed agent stays away, or a cut link down (the node timeout is 2 s: lost)"""
HTTP_S = 1.0
FAULTS, QUICK = 2400, 160
"""worker faults planned by default (and with ``--quick``): about one in six fires (the run of
2026-12-04 at 1600: 257), since a task's slots get new numbers as the planner replaces lost
ones and a slot's plan fires only while its worker lives; the driver's faults (one every
``--worker-period``) and the cluster's make the rest: the default run makes over a thousand
(the planned faults also set each task's steps, so the run's length)"""


@dataclass(frozen=True)
class SoakTask:
    """One task of the soak: its script, workers, weight, layout, and its share of the
    worker faults (one every ``gap`` steps; the shares are set so that the three tasks end
    at about the same time: the tensor-parallel one trains about three times slower)."""

    name: str
    script: str
    workers: tuple[int, int]
    weight: float
    tp: int
    share: float
    gap: int


TASKS = (
    SoakTask("gpt-a", "train_gpt.py", (2, 4), 2.0, 1, 0.45, 3),
    SoakTask("gpt-b", "train_gpt.py", (2, 3), 1.0, 1, 0.35, 3),
    SoakTask("llama-tp", "train_llama_parallel.py", (4, 6), 3.0, 2, 0.20, 3),
)


@dataclass
class Made:
    """One cluster fault this driver made: its kind, target, when, and what went wrong
    making it (``trouble``: something a person would have had to look at)."""

    kind: str
    target: str
    ts: float
    trouble: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- the run ------------------------------------------------------------------------------------
class Driver:
    """Makes the cluster faults of :data:`CLUSTER_KINDS` on ``c``, one every ``period_s``,
    until :meth:`stop` (a thread of its own; :attr:`made` is the record)."""

    def __init__(self, c: LocalCluster, period_s: float, seed: int) -> None:
        self.c, self.period_s = c, period_s
        self.rng = random.Random(seed + 1)
        self.made: list[Made] = []
        self.leader = COORDINATOR_HOSTS[0]
        self.restarted: list[tuple[float, int, int | None]] = []
        """coordinators that exited on their own (a leader fenced: its lease went unrenewed,
        etcd slow), started again as a supervisor would: (when, host, exit code)"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._kinds: list[str] = []

    def start(self) -> Driver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _next_kind(self) -> str:
        if not self._kinds:
            self._kinds = list(CLUSTER_KINDS)
            self.rng.shuffle(self._kinds)
        return self._kinds.pop()

    def _run(self) -> None:
        due = time.monotonic() + self.period_s
        while not self._stop.wait(1.0):
            self.supervise()
            if time.monotonic() < due:
                continue
            due = time.monotonic() + self.period_s
            kind = self._next_kind()
            try:
                made = getattr(self, kind)()
            except Exception as e:  # the soak goes on; the report lists it
                made = Made(kind, "?", time.time(), trouble=f"{type(e).__name__}: {e}")
            self.made.append(made)
            print(f"[soak] {time.strftime('%H:%M:%S')} {made.kind} {made.target}"
                  f"{' TROUBLE ' + made.trouble if made.trouble else ''}",
                  file=sys.stderr, flush=True)  # fmt: skip

    # -- the kinds ---------------------------------------------------------------------------
    def _hosting(self, host: int) -> dict[str, Any]:
        """Whether a worker of some task runs on agent ``host`` now (its log folder's): a
        node holding none is a loss only the cluster's node table sees, no task's log."""
        return {"held": bool(workers(self.c.root / f"workers-n{host}"))}

    def agent_kill(self) -> Made:
        host = self.rng.choice(AGENT_HOSTS)
        made = Made("agent_kill", f"n{host}", time.time(), extra=self._hosting(host))
        self.c.kill_agent(host)
        self._stop.wait(DOWN_S)
        self.c.start_agent(host, wait=False)
        made.trouble = self._node_back(host)
        return made

    def link_cut(self) -> Made:
        host = self.rng.choice(AGENT_HOSTS)
        assert isinstance(self.c.net, netns.Lab)
        made = Made("link_cut", f"n{host}", time.time(), extra=self._hosting(host))
        self.c.net.cut(host)
        self._stop.wait(DOWN_S)
        self.c.net.restore(host)
        made.trouble = self._node_back(host)
        return made

    def store_kill(self) -> Made:
        pids = marked_pids(self.c.tag, b"unicron.control.store")
        made = Made("store_kill", ",".join(map(str, pids)) or "none", time.time())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if not pids:
            made.trouble = "no store process found"
        return made

    def coordinator_kill(self) -> Made:
        old = self._find_leader()
        made = Made("coordinator_kill", f"host {old}", time.time())
        self.c.coordinators[old].kill()
        self.c.coordinators[old].wait()
        made.trouble = self._taken_over(old, made)
        return made

    def leader_cut(self) -> Made:
        old = self._find_leader()
        assert isinstance(self.c.net, netns.Lab)
        made = Made("leader_cut", f"host {old}", time.time())
        self.c.net.cut(old)
        made.trouble = self._taken_over(old, made)
        try:
            made.extra["fenced_exit"] = self.c.coordinators[old].wait(timeout=30)
        except subprocess.TimeoutExpired:
            made.trouble = made.trouble or "the cut-off leader did not exit (not fenced)"
            self.c.coordinators[old].kill()
            self.c.coordinators[old].wait()
        self.c.net.restore(old)
        self.c.start_coordinator(host=old, wait=False)  # back, as the standby
        return made

    # -- helpers -----------------------------------------------------------------------------
    def _find_leader(self, skip: int | None = None) -> int:
        """The coordinator host that answers (a standby serves nothing); ``skip``: a host a
        fault is being made on (see :meth:`supervise`)."""
        import httpx

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.supervise(skip)
            for h in COORDINATOR_HOSTS:
                url = f"http://{self.c.net.members[h].address}:{self.c.port}/v1/nodes"
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(url, headers={"Authorization": f"Bearer {self.c.token}"},
                                  timeout=HTTP_S)  # fmt: skip
                    if r.status_code == 200:
                        self.leader = h
                        return h
            time.sleep(0.2)
        raise RuntimeError("no coordinator answered for 30 s")

    def _taken_over(self, old: int, made: Made) -> str:
        """Wait until the other coordinator leads, then start ``old`` again as the standby."""
        other = next(h for h in COORDINATOR_HOSTS if h != old)
        try:
            now = self._find_leader(skip=old)
        except RuntimeError as e:
            return str(e)
        made.extra["leads_at"] = time.time()
        if now != other:
            return f"host {now} answers after host {old} was lost"
        if made.kind == "coordinator_kill":
            self.c.start_coordinator(host=old, wait=False)
        return ""

    def _node_back(self, host: int) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self._stop.is_set():
            with contextlib.suppress(Exception):
                if self.c.node(f"n{host}").get("state") == "up":
                    return ""
            time.sleep(0.2)
        return "" if self._stop.is_set() else f"node n{host} not up 60 s after its return"

    def supervise(self, skip: int | None = None) -> None:
        """Start again every coordinator that exited on its own, as the standby (what a
        supervisor such as systemd's ``Restart=always`` does for a fenced leader, exit code
        75); ``skip``: the host a fault is being made on (its maker restarts it). Called
        every second between faults, and while a fault waits for a leader."""
        for h in COORDINATOR_HOSTS:
            proc = self.c.coordinators.get(h)
            if h != skip and proc is not None and (code := proc.poll()) is not None:
                self.restarted.append((time.time(), h, code))
                self.c.start_coordinator(host=h, wait=False)


class WorkerFaults:
    """Makes the faults of :data:`WORKER_KINDS` on live workers of the tasks, one every
    ``period_s`` (a thread of its own; :attr:`made` is the record, ``extra``: task, slot)."""

    def __init__(self, c: LocalCluster, period_s: float, seed: int) -> None:
        self.c, self.root, self.period_s = c, c.root, period_s
        self.rng = random.Random(seed + 2)
        self.made: list[Made] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._turn = 0
        self._next_step: dict[str, int] = {}  # task -> the step it must have committed first

    def start(self) -> WorkerFaults:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for _ in TASKS:  # the next task in turn that has healed from the last one
                name = TASKS[self._turn % len(TASKS)].name
                self._turn += 1
                step = self._step(name)
                if step is not None and step >= self._next_step.get(name, 0):
                    break
            else:
                continue
            mine = [w for w in workers(self.root) if w[1] == name]
            live = [w[:3] for w in mine if w[3]]
            if not live:
                continue
            pid, _, slot = self.rng.choice(sorted(live))
            kind = self.rng.choices(WORKER_KINDS, weights=WORKER_WEIGHTS)[0]
            if kind == "worker_stop" and len(live) < len(mine):
                kind = "worker_kill"  # one hang at a time per task, as the schedule plans
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9 if kind == "worker_kill" else 19)  # SIGKILL, SIGSTOP
                self.made.append(Made(kind, f"{name} slot {slot}", time.time(),
                                      extra={"task": name, "slot": slot}))  # fmt: skip
                self._next_step[name] = step + HEALED_STEPS

    def _step(self, name: str) -> int | None:
        """The task's committed steps, if it runs and the coordinator answers."""
        try:
            view = self.c.task(name)
        except Exception:  # the leader changing hands
            return None
        return int(view["step"]) if view["state"] == "running" else None


def live_workers(root: Path) -> list[tuple[int, str, int]]:
    """The running (not stopped) workers of :func:`workers`: (pid, task name, slot)."""
    return [w[:3] for w in workers(root) if w[3]]


def workers(root: Path) -> list[tuple[int, str, int, bool]]:
    """The workers under the agents' log folders ``root``: (pid, task name, slot, running:
    not stopped), each found by its standard output, ``<task>.<uid>/worker<slot>.<n>.log``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            log = os.readlink(entry / "fd" / "1")
            if not log.startswith(str(root)) or not Path(log).name.startswith("worker"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in "ZX":
            continue
        folder, file = Path(log).parent.name, Path(log).name
        slot = int(file[6:].split(".", 1)[0])
        out.append((int(entry.name), folder.split(".", 1)[0], slot, state in "RSD"))
    return out


def marked_pids(tag: str, needle: bytes) -> list[int]:
    """The pids of this lab's processes (:data:`MARKER`) whose command line holds ``needle``."""
    want = f"{MARKER}={tag}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "cmdline").read_bytes():
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def task_specs(faults: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The three tasks' specs (their ``inject`` lists planned by :func:`bench.chaos.schedule`)
    and each one's steps."""
    specs, steps = [], {}
    for i, t in enumerate(TASKS):
        planned, n_steps = schedule(round(faults * t.share), seed + 10 * i, t.gap, t.workers[1])
        steps[t.name] = n_steps
        specs.append({
            "name": t.name, "script": str(ROOT / "examples" / t.script),
            "args": ["--steps", str(n_steps)],
            "workers": {"min": t.workers[0], "max": t.workers[1]},
            "weight": t.weight, "tp": t.tp, "checkpoint": {"every": 1, "keep": 2},
            "readmit_after": TIME_SCALE, "restart_window": TIME_SCALE,
            "inject": [p.spec for p in planned],
        })  # fmt: skip
    return specs, steps


def soak(
    workdir: Path,
    faults: int,
    period_s: float,
    worker_period_s: float,
    seed: int,
    timeout_s: float,
) -> tuple[dict[str, list[Event]], dict[str, dict[str, Any]], list[Made], list[Made], float, int]:
    """Run the soak in ``workdir``: each task's events and final view, the cluster faults
    made, the wall time from the first submission to the last task's end, and how many
    times a coordinator exited on its own and was started again (:meth:`Driver.supervise`)."""
    specs, _ = task_specs(faults, seed)
    with LocalCluster(workdir / "cluster", hosts=len(COORDINATOR_HOSTS) + len(AGENT_HOSTS),
                      slots=SLOTS, coordinator_hosts=COORDINATOR_HOSTS) as c:  # fmt: skip
        c.coordinator_args = ("--etcd", c.start_etcd(), "--lease-ttl", "2")
        c.start_coordinator(host=COORDINATOR_HOSTS[0])
        c.start_coordinator(host=COORDINATOR_HOSTS[1], wait=False)
        for host in AGENT_HOSTS:
            c.start_agent(host, wait=False)
        c.wait_nodes(len(AGENT_HOSTS), timeout_s=120)
        t0 = time.time()
        for spec in specs:
            spec["args"] += ["--out", str(workdir / "soak-out" / spec["name"])]
            c.submit(spec)
        for t in TASKS:
            c.wait_task(t.name, lambda v: v["step"] >= 3, timeout_s=300)
        driver = Driver(c, period_s, seed).start()
        hands = WorkerFaults(c, worker_period_s, seed).start()
        views: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(views) < len(TASKS) and time.monotonic() < deadline:
                time.sleep(2.0)
                with contextlib.suppress(Exception):
                    for t in TASKS:
                        if t.name not in views:
                            v = c.task(t.name)
                            if v["state"] in ("done", "failed", "cancelled"):
                                views[t.name] = v
                                print(f"[soak] {t.name} ended {v['state']} at step {v['step']}",
                                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            hands.stop()
            driver.stop()
        wall = time.time() - t0
        if len(views) < len(TASKS):
            raise RuntimeError(f"not every task ended within {timeout_s:.0f} s (logs: {workdir})")
        driver.supervise()
        c.wait_until(lambda: _answers(c), "a leader answers", 60)
        events = {t.name: _events(c, t.name) for t in TASKS}
    return events, views, driver.made, hands.made, wall, len(driver.restarted)


def _answers(c: LocalCluster) -> bool:
    with contextlib.suppress(Exception):
        c.task(TASKS[0].name)
        return True
    return False


def _events(c: LocalCluster, name: str) -> list[Event]:
    for _ in range(10):
        with contextlib.suppress(Exception):
            return c.events(name)
        time.sleep(1)
    return c.events(name)


def fault_free(workdir: Path, steps: dict[str, int]) -> float:
    """Each task alone, without faults, as ``unicron run`` on its most workers (the three at
    once); the wall time."""
    t0 = time.monotonic()
    procs = []
    for t in TASKS:
        where = workdir / "ref" / t.name
        where.mkdir(parents=True)
        cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(t.workers[1]),
               "--quiet", "--tp", str(t.tp), "--events", str(where / "events.jsonl"),
               "--log-dir", str(where / "logs"), str(ROOT / "examples" / t.script),
               "--steps", str(steps[t.name]), "--out", str(where / "out")]  # fmt: skip
        log = open(where / "run.log", "wb")  # noqa: SIM115
        procs.append((t.name, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)))
        log.close()
    for name, proc in procs:
        if proc.wait(timeout=7200) != 0:
            raise RuntimeError(f"the fault-free run of {name} failed (logs: {workdir / 'ref'})")
    return time.monotonic() - t0


# -- the measurements ---------------------------------------------------------------------------
def driver_worker_faults(
    made: list[Made], events: dict[str, list[Event]]
) -> tuple[dict[str, dict[str, list[float]]], list[Made]]:
    """Per kind of the driver's faults in workers: detection (the first ``error_detected``
    about its slot in its task's log) and recovery (the next commit); those never detected
    (named in the report, with the clock time, to look up in the kept logs)."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    undetected: list[Made] = []
    for m in made:
        log = events[m.extra["task"]]
        found = next((e for e in log if e["event"] == "error_detected" and e["ts"] >= m.ts
                      and e.get("slot") == m.extra["slot"]), None)  # fmt: skip
        if found is None:
            undetected.append(m)
            continue
        out[m.kind]["detection_s"].append(float(found["ts"]) - m.ts)
        nxt = next((e for e in log if e["event"] == "step_end" and e["ts"] > found["ts"]), None)
        if nxt is not None:
            out[m.kind]["recovery_s"].append(float(nxt["ts"]) - m.ts)
    return out, undetected


def worker_faults(events: list[Event]) -> tuple[dict[str, dict[str, list[float]]], int, int]:
    """Per kind of a task's injected faults: detection and recovery times; the faults fired
    and those never detected (:func:`bench.chaos.measure_faults`, as ``make soak`` counts)."""
    m = measure_faults(events)
    return m["by_kind"], int(m["fired"]), int(m["undetected"])


def cluster_faults(
    made: list[Made], events: dict[str, list[Event]], period_s: float
) -> tuple[dict[str, dict[str, list[float]]], list[str]]:
    """Per kind of the driver's faults: detection (the first record of it in any task's log
    within the period) and recovery (then every task that saw it committed a step again); the
    faults nobody recorded (an agent host none of whose slots a task held is not one)."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    unseen = []
    every = [{**e, "_log": n} for n, log in events.items() for e in log]
    every.sort(key=lambda e: e["ts"])
    ends = {n: [e["ts"] for e in log if e["event"] == "step_end"] for n, log in events.items()}
    for m in made:
        if m.trouble:
            continue
        window = [e for e in every if m.ts <= e["ts"] < m.ts + period_s + DOWN_S]
        seen = [e for e in window if _records(m, e)]
        if not seen:
            if m.kind in ("agent_kill", "link_cut") and not _held(m, events):
                continue
            unseen.append(f"{m.kind} {m.target} at {time.strftime('%H:%M:%S', time.gmtime(m.ts))}")
            continue
        first = seen[0]["ts"]
        out[m.kind]["detection_s"].append(first - m.ts)
        tasks = {e["_log"] for e in seen}
        later = [next((t for t in ends[n] if t > first), None) for n in tasks]
        if all(t is not None for t in later):
            out[m.kind]["recovery_s"].append(max(t for t in later if t is not None) - m.ts)
    return out, unseen


def _records(m: Made, e: Event) -> bool:
    """Whether event ``e`` records the cluster fault ``m``."""
    if m.kind in ("agent_kill", "link_cut"):
        return e["event"] == "error_detected" and e.get("node_name") == m.target
    if m.kind == "store_kill":
        return e["event"] == "control_plane" and "store was lost" in e.get("what", "")
    return e["event"] == "control_plane" and "adopted" in e.get("what", "")


def _held(m: Made, events: dict[str, list[Event]]) -> bool:
    """Whether some task had workers on ``m``'s node when it was lost: as the driver saw
    them then (``extra["held"]``), else any event naming the node before it."""
    if "held" in m.extra:
        return bool(m.extra["held"])
    for log in events.values():
        before = [e for e in log if e["ts"] <= m.ts and e.get("node_name") == m.target]
        if before:
            return True
    return False


def commits(events: list[Event], steps: int) -> tuple[int, int, int]:
    """Steps never committed, committed twice, and committed in an older epoch after a newer
    one had committed (a stale epoch: what fencing rules out)."""
    ends = sorted((e for e in events if e["event"] == "step_end"), key=lambda e: e["ts"])
    per_step = Counter(e["step"] for e in ends)
    stale, newest = 0, -1
    for e in ends:
        epoch = int(e.get("epoch", -1))
        stale += epoch < newest
        newest = max(newest, epoch)
    lost = sum(1 for s in range(steps) if s not in per_step)
    return lost, sum(1 for n in per_step.values() if n > 1), stale


def fallbacks(events: list[Event]) -> tuple[int, int]:
    """How often every replica of the state was gone and the task went on from its newest
    checkpoint, and the committed steps that redid (a write still in flight when its
    writer died: at most one step each, checkpointing every step)."""
    back = [e for e in events if e["event"] == "transition_end"
            and e.get("state_source") == "checkpoint"]  # fmt: skip
    epochs = {int(e.get("epoch", -1)): int(e.get("steps_redone", 0)) for e in back}
    return len(epochs), sum(epochs.values())


def ettr(events: list[Event]) -> tuple[float, float]:
    """The fraction of the task's wall time (first to last commit) it would take at its median
    step period (the time between two commits), and that period."""
    ts = sorted(e["ts"] for e in events if e["event"] == "step_end")
    if len(ts) < 3:
        return 0.0, 0.0
    period = statistics.median(b - a for a, b in itertools.pairwise(ts))
    return min((len(ts) - 1) * period / (ts[-1] - ts[0]), 1.0), period


def _p(values: list[float], q: float) -> str:
    return f"{percentile(values, q):.2f}" if values else "-"


def report(
    events: dict[str, list[Event]],
    views: dict[str, dict[str, Any]],
    made: list[Made],
    hands: list[Made],
    exact: dict[str, bool],
    steps: dict[str, int],
    wall: float,
    setup: str,
    period_s: float,
) -> tuple[list[Row], str]:
    """The rows and the markdown table of a soak."""
    base = {"system": SYSTEM, "scenario": SCENARIO}
    by_kind: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    fired = undetected = 0
    for log in events.values():
        figs, n, missed = worker_faults(log)
        fired, undetected = fired + n, undetected + missed
        for kind, f in figs.items():
            for metric, values in f.items():
                by_kind[kind][metric] += values
    cfigs, unseen = cluster_faults(made, events, period_s)
    hfigs, missed_hands = driver_worker_faults(hands, events)
    undetected += len(missed_hands)
    for kind, f in [*cfigs.items(), *hfigs.items()]:
        for metric, values in f.items():
            by_kind[kind][metric] += values
    human = [f"{m.kind} {m.target}: {m.trouble}" for m in made if m.trouble]
    human += [f"never detected: {u}" for u in unseen]
    human += [f"never detected: {m.kind} {m.target} at {_clock(m.ts)}" for m in missed_hands]
    human += [f"{n} ended {v['state']}" for n, v in views.items() if v["state"] != "done"]
    total = fired + len(hands) + len(made)
    rows = [
        make_row(**base, metric="faults", values=[total], unit="", note=setup),
        make_row(**base, metric="faults_workers", values=[fired + len(hands)], unit="",
                 note=f"{fired} fired by the workers (crash, hang, error kinds, slow), "
                 f"{len(hands)} made by the driver (kill -9, SIGSTOP); {undetected} never "
                 "detected"),
        make_row(**base, metric="faults_cluster", values=[len(made)], unit="",
                 note=", ".join(f"{k} {n}" for k, n in sorted(Counter(m.kind for m in made)
                                                               .items()))),
        make_row(**base, metric="wall_s", values=[wall], unit="s",
                 note="first submission to the last task's end"),
        make_row(**base, metric="needed_a_human", unit="",
                 values=[len(human) + undetected - len(missed_hands)],  # those named: in human
                 note=("; ".join(human)[:800] or "no trouble") + f"; {undetected} worker "
                 "faults never detected; goal 0"),
    ]  # fmt: skip
    lines = [f"# Cluster soak ({setup})", "",
             "| fault | count | detection p50 (s) | p99 | recovery p50 (s) | p99 |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for kind in sorted(by_kind):
        det, rec = by_kind[kind]["detection_s"], by_kind[kind]["recovery_s"]
        lines.append(f"| {kind} | {len(det)} | {_p(det, 50)} | {_p(det, 99)} | {_p(rec, 50)} "
                     f"| {_p(rec, 99)} |")  # fmt: skip
        if det:
            rows.append(make_row(**base, metric=f"detection_s[{kind}]", values=det, unit="s",
                                 note=f"p99 {_p(det, 99)} s"))  # fmt: skip
        if rec:
            rows.append(make_row(**base, metric=f"recovery_s[{kind}]", values=rec, unit="s",
                                 note=f"p99 {_p(rec, 99)} s; to the next commit"))  # fmt: skip
    lines += ["", "| task | state | steps | lost | twice | fallbacks (redone) | stale | ETTR | "
              "median step (s) | plans | bitwise |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for t in TASKS:
        log = events[t.name]
        lost, twice, stale = commits(log, steps[t.name])
        share, period = ettr(log)
        falls, redone = fallbacks(log)
        plans = sum(1 for e in log if e["event"] == "plan")
        tb = {**base, "scenario": f"{SCENARIO}", "unit": ""}
        rows += [
            make_row(**tb, metric=f"steps_lost[{t.name}]", values=[lost],
                     note=f"of {steps[t.name]}; goal 0"),
            make_row(**tb, metric=f"steps_twice[{t.name}]", values=[twice],
                     note=f"goal 0; {falls} checkpoint fallbacks (every replica gone) redid "
                     f"{redone}"),
            make_row(**tb, metric=f"stale_commits[{t.name}]", values=[stale],
                     note="a step committed in an older epoch after a newer one's; goal 0"),
            make_row(**tb, metric=f"bitwise_identical[{t.name}]",
                     values=[1.0 if exact[t.name] else 0.0],
                     note="final parameters == its fault-free run's, by name"),
            make_row(**tb, metric=f"ettr[{t.name}]", values=[share],
                     note=f"median step period {period:.3f} s; {plans} plan events; "
                     f"weight {t.weight:g}, {t.workers[0]}-{t.workers[1]} workers, tp {t.tp}"),
        ]  # fmt: skip
        lines.append(f"| {t.name} | {views[t.name]['state']} | {steps[t.name]} | {lost} | "
                     f"{twice} | {falls} ({redone}) | {stale} | {share:.2f} | {period:.3f} | "
                     f"{plans} | {'yes' if exact[t.name] else 'NO'} |")  # fmt: skip
    lines += ["", f"Needed a human: {'; '.join(human) or 'nothing'} "
              f"({undetected} worker faults never detected).", ""]  # fmt: skip
    return rows, "\n".join(lines)


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 100):02d} UTC"


def missing() -> str | None:
    """What this machine lacks for the soak, or ``None``."""
    if shutil.which("etcd") is None:
        return "needs etcd (apt-get install etcd-server)"
    if (why := netns.available()) is not None:
        return f"needs network namespaces ({why})"
    return None


def run(
    faults: int, period_s: float, worker_period_s: float, seed: int, workdir: Path
) -> tuple[list[Row], str]:
    """The soak and the fault-free runs in ``workdir``: the rows and the table."""
    events, views, made, hands, wall, fenced = soak(
        workdir, faults, period_s, worker_period_s, seed, timeout_s=3 * 3600
    )
    with open(workdir / "faults.json", "w") as f:  # to look a fault up in the kept logs
        json.dump({"cluster": [asdict(m) for m in made],
                   "workers": [asdict(m) for m in hands]}, f, indent=1)  # fmt: skip
    _, steps = task_specs(faults, seed)
    ref_wall = fault_free(workdir, steps)
    exact = {
        t.name: same_state(workdir / "soak-out" / t.name, workdir / "ref" / t.name / "out", t.tp)
        for t in TASKS
    }
    setup = (
        f"{faults} worker faults planned (kinds {len(FAULT_KINDS)}), a driver's worker fault "
        f"every {worker_period_s:g} s, a cluster fault every {period_s:g} s, seed {seed}; "
        f"4 agents x {SLOTS} slots, a leader and a standby "
        f"coordinator (etcd lease 2 s; {fenced} exit(s) of a coordinator on its own, a "
        f"leader fenced, started again as a supervisor would); fault-free runs "
        f"{ref_wall:.0f} s; load "
        f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores"
    )
    return report(events, views, made, hands, exact, steps, wall, setup, period_s)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.soak_cluster", __doc__, quick=f"{QUICK} worker faults planned, not "
                     f"{FAULTS}")  # fmt: skip
    p.add_argument("--faults", type=positive_int, default=None,
                   help=f"worker faults to plan (default {FAULTS}; the driver's and the "
                   "cluster's on top)")  # fmt: skip
    p.add_argument("--period", type=float, default=30.0,
                   help="seconds between two cluster faults (default 30)")  # fmt: skip
    p.add_argument("--worker-period", type=float, default=2.0,
                   help="seconds between two worker faults of the driver (2)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, default=None, help="leave every log in this new dir")
    args = p.parse_args(argv)
    if (why := missing()) is not None:
        p.error(why)
    if args.keep is not None and args.keep.exists():
        p.error(f"--keep {args.keep}: already exists")
    if args.period < 2 * DOWN_S:
        p.error(f"--period must be >= {2 * DOWN_S:g} s (a fault, its return, and a gap)")
    faults = args.faults or (QUICK if args.quick else FAULTS)
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        rows, table = run(faults, args.period, args.worker_period, args.seed, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="unicron-soak-cluster-") as tmp:
            rows, table = run(faults, args.period, args.worker_period, args.seed, Path(tmp))
    print_table(rows, title="The cluster soak")
    print(table)
    if not args.quick:
        save_scenario(rows, SCENARIO, RESULTS_DIR, replace=True)
        write_text_atomic(RESULTS_DIR / f"{SCENARIO}.md", table)
        write_summary(RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
