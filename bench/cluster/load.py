"""The control plane under load: a real ``unicron coordinator`` and synthetic agents.

The coordinator is the real service (its own process, its SQLite state, its store). The
agents are not: ``agents`` synthetic node agents register (``POST /v1/agents/register``)
and heartbeat every ``heartbeat_s`` (``POST /v1/agents/{node}/heartbeat``), and ``tasks``
tasks are submitted (``POST /v1/tasks``, a real script path) with ``workers`` workers each,
so the cluster places them on the synthetic nodes. A node that finds a task in its
heartbeat's answer runs a synthetic supervisor for it, which speaks the supervisors'
protocol (:mod:`unicron.messages`, the rhythm of
:class:`unicron.control.client.TaskLink`): a first exchange with its census and a ``Ready``
per slot (all slots ready start the first epoch), then, once the task is running, per step
of ``step_s``: ``StepBegan``, ``StepComputed`` and the ``step_end`` event of every slot, each
sent at once, and with nothing to report an exchange at the rhythm the coordinator's last
reply asked for (``Reply.next_s`` within ``TaskLink``'s bounds, as a real supervisor does).
No worker process exists: the reports stand in for them (synthetic agents are acceptable for
this load test only; the other cluster figures use real ones).

Measured, over a window of ``duration_s`` after every task runs: the client-side latency of
every request (p50, p99, max; per kind too), the coordinator's CPU (``/proc/PID/stat``), the
state directory's size at the end, and what the load broke (nodes lost, actions sent to the
synthetic supervisors, ``error_detected`` events, tasks not running). The load generator
runs in ``procs`` processes (asyncio, ``httpx.AsyncClient``) so that its own CPU does not
queue the requests; ``client_lag`` (how late a request left against its schedule) tells
how much of a latency is the generator's.
"""

from __future__ import annotations

import array
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster.harness import LiveCluster, loadavg
from bench.common import Row, make_row
from bench.events import percentile
from bench.systems.base import TrialError
from unicron.control.client import TaskLink

SCENARIO = "cluster-load"
SYSTEM = "unicron cluster"
ROOT = Path(__file__).resolve().parents[2]
GOAL_P99_MS = 50.0
KINDS = ("heartbeat", "exchange", "register", "submit", "status")


@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    agents: int = 200
    slots: int = 2
    """slots per synthetic node"""
    tasks: int = 20
    workers: int = 4
    """workers per task (min = max): ``workers / slots`` nodes, one supervisor each"""
    heartbeat_s: float = 1.0
    step_s: float = 0.25
    """each task's step time: per step and slot three reports"""
    exchange_s: float | None = None
    """a supervisor with nothing to report exchanges this often; ``None``: at the rhythm the
    coordinator asks for (as a real one does)"""
    duration_s: float = 600.0
    """the measured window, after every task runs"""
    warmup_s: float = 10.0
    procs: int = 2

    def __post_init__(self) -> None:
        for name in ("agents", "slots", "tasks", "workers", "procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("heartbeat_s", "step_s", "exchange_s", "duration_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tasks * self.workers > self.agents * self.slots:
            raise ValueError("more workers than slots: the tasks would queue")


@dataclass
class Samples:
    """Per request: when it left (Unix s), its kind (index in :data:`KINDS`), its latency
    (s), whether it failed, and how late it left against its schedule (s)."""

    sent: array.array[float] = field(default_factory=lambda: array.array("d"))
    kind: array.array[int] = field(default_factory=lambda: array.array("b"))
    latency: array.array[float] = field(default_factory=lambda: array.array("d"))
    failed: array.array[int] = field(default_factory=lambda: array.array("b"))
    lag: array.array[float] = field(default_factory=lambda: array.array("d"))
    actions: int = 0
    steps: int = 0

    def add(self, kind: str, sent: float, latency: float, ok: bool, lag: float) -> None:
        self.sent.append(sent)
        self.kind.append(KINDS.index(kind))
        self.latency.append(latency)
        self.failed.append(0 if ok else 1)
        self.lag.append(lag)

    def dump(self) -> dict[str, Any]:
        return {
            k: getattr(self, k).tobytes() for k in ("sent", "kind", "latency", "failed", "lag")
        } | {
            "actions": self.actions,
            "steps": self.steps,
        }

    @classmethod
    def load(cls, d: dict[str, Any]) -> Samples:
        s = cls(actions=d["actions"], steps=d["steps"])
        for k in ("sent", "kind", "latency", "failed", "lag"):
            getattr(s, k).frombytes(d[k])
        return s


# -- the load generator (one process) ----------------------------------------------------------
class _Generator:
    """One load generator process's agents: registers them, heartbeats each on its own phase,
    and runs a synthetic supervisor for every task a heartbeat's answer places on one."""

    def __init__(self, url: str, token: str, names: list[str], s: LoadSettings) -> None:
        import httpx

        self.s = s
        self.names = names
        self.samples = Samples()
        self.instance = {n: secrets.token_hex(8) for n in names}
        self.nid: dict[str, int] = {}
        # one connection pool per agent, as every real agent has its own client
        self.http = {
            n: httpx.AsyncClient(
                base_url=url,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30.0,
                trust_env=False,
            )
            for n in names
        }
        self.supervisors: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.stop = asyncio.Event()
        self.errors: list[str] = []

    async def call(self, node: str, kind: str, path: str, body: Any, due: float) -> Any:
        http = self.http[node]
        sent = time.time()
        t0 = time.perf_counter()
        try:
            r = await http.post(path, json=body) if body is not None else await http.get(path)
            ok = r.status_code < 400
            out = r.json() if ok else None
        except Exception as exc:
            ok, out = False, None
            self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
        self.samples.add(kind, sent, time.perf_counter() - t0, ok, max(sent - due, 0.0))
        return out

    async def register(self) -> None:
        for name in self.names:
            body = {"name": name, "slots": self.s.slots, "address": "127.0.0.1",
                    "instance": self.instance[name]}  # fmt: skip
            got = await self.call(name, "register", "/v1/agents/register", body, time.time())
            if got is None:
                raise RuntimeError(f"could not register {name}: {self.errors[-1:]}")
            self.nid[name] = int(got["node"])

    async def heartbeats(self, name: str, phase: float) -> None:
        due = time.time() + phase
        while not self.stop.is_set():
            await asyncio.sleep(max(due - time.time(), 0.0))
            got = await self.call(name, "heartbeat", f"/v1/agents/{name}/heartbeat",
                                  {"instance": self.instance[name]}, due)  # fmt: skip
            for a in (got or {}).get("tasks", ()):
                key = (name, a["uid"])
                if key not in self.supervisors:
                    sup = self.supervise(name, a["uid"], a["name"], list(a["slots"]))
                    self.supervisors[key] = asyncio.create_task(sup)
            due += self.s.heartbeat_s

    async def supervise(self, node: str, uid: str, task: str, slots: list[int]) -> None:
        """One synthetic supervisor (see the module docstring)."""
        from unicron import messages as M

        path = f"/v1/agents/{node}/tasks/{uid}/exchange"
        now = time.time()
        pending: list[Any] = [M.Census(ts=now, alive=tuple(slots))]
        pending += [M.Ready(slot=s, ts=now, microbatches=8, state_bytes=1 << 20) for s in slots]
        last = asked = 0.0
        every = self.s.exchange_s or TaskLink.MIN_INTERVAL_S  # until the first reply says
        t0 = 0.0
        epoch: int | None = None
        step, schedule = 0, []  # (due, reports) of the current step
        while not self.stop.is_set():
            now = time.time()
            if epoch is None and not pending and now - asked >= 0.2:
                asked = now
                view = await self.call(node, "status", f"/v1/tasks/{task}", None, now)
                if view and view["state"] == "running":
                    epoch = int(view["epoch"])
                    pending += [M.EpochEntered(slot=s, ts=now, epoch=epoch) for s in slots]
                    t0 = time.time()
                    schedule = _step(step, t0, epoch, slots, uid, self.nid[node], self.s)
            while schedule and schedule[0][0] <= now:
                _, made = schedule.pop(0)
                pending += made(time.time())
                if not schedule:
                    self.samples.steps += 1
                    step += 1
                    assert epoch is not None
                    schedule = _step(step, t0, epoch, slots, uid, self.nid[node], self.s)
            if pending or now - last >= every:
                due = now if pending else last + every
                body = {"instance": self.instance[node], "read_until": now,
                        "reports": [M.to_wire(r) for r in pending]}  # fmt: skip
                pending = []
                got = await self.call(node, "exchange", path, body, due)
                last = time.time()
                if got is not None:
                    self.samples.actions += len(got.get("actions", ()))
                    if self.s.exchange_s is None:
                        every = _interval(float(got.get("next_s", TaskLink.MIN_INTERVAL_S)))
                    if got.get("over"):
                        return
            wake = last + every
            if schedule:
                wake = min(wake, schedule[0][0])
            await asyncio.sleep(max(min(wake - time.time(), 0.02), 0.0))


def _interval(asked: float) -> float:
    """The idle rhythm a real supervisor keeps for a reply's ``next_s`` (``TaskLink``)."""
    return min(max(asked, TaskLink.MIN_INTERVAL_S), TaskLink.MAX_INTERVAL_S)


def _step(
    step: int, t0: float, epoch: int, slots: list[int], uid: str, node: int, s: LoadSettings
) -> list[tuple[float, Any]]:
    """The reports of ``step`` of the slots ``slots`` with their due times: began, computed
    (at 80% of the step), committed (its ``step_end``, at the end)."""
    from unicron import messages as M

    begin = t0 + step * s.step_s
    compute = 0.8 * s.step_s

    def began(now: float) -> list[Any]:
        return [M.StepBegan(slot=x, ts=now, step=step, epoch=epoch) for x in slots]

    def computed(now: float) -> list[Any]:
        return [M.StepComputed(slot=x, ts=now, step=step, compute_s=compute, microbatches=2)
                for x in slots]  # fmt: skip

    def committed(now: float) -> list[Any]:
        return [
            M.Event(ts=now, name="step_end", fields={
                "ts": now, "epoch": epoch, "rank": x, "step": step, "loss": 1.0,
                "duration_s": s.step_s, "workers": s.workers, "task": uid, "node": node})
            for x in slots
        ]  # fmt: skip

    return [(begin, began), (begin + compute, computed), (begin + s.step_s * 0.95, committed)]


def _child(url: str, token: str, names: list[str], s: LoadSettings, conn: Any) -> None:
    """A load generator process: register ``names``, say so, heartbeat and supervise until
    told to stop, then send back its samples."""

    async def main() -> None:
        g = _Generator(url, token, names, s)
        await g.register()
        beats = [
            asyncio.create_task(g.heartbeats(n, s.heartbeat_s * i / len(names)))
            for i, n in enumerate(names)
        ]
        conn.send("registered")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        g.stop.set()
        await asyncio.gather(*beats, *g.supervisors.values(), return_exceptions=True)
        for http in g.http.values():
            await http.aclose()
        conn.send(g.samples.dump())

    asyncio.run(main())


# -- the harness -------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(s: LoadSettings, workdir: Path, on_progress: Any = print) -> dict[str, Any]:
    """Run the load once (see the module docstring); the raw figures."""
    ctx = mp.get_context("spawn")
    c = LiveCluster(workdir)
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        c.start_coordinator()
        c.answers()
        coord_pid = c.coordinator.proc.pid  # type: ignore[union-attr]
        names = [f"load-{i:03d}" for i in range(s.agents)]
        for k in range(s.procs):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_child, args=(c.url, c.token, names[k :: s.procs], s, theirs))
            p.start()
            procs.append(p)
            conns.append(mine)
        for conn in conns:
            if not conn.poll(300) or conn.recv() != "registered":
                raise TrialError("a load generator did not register its agents")
        on_progress(f"  {s.agents} synthetic agents registered and heartbeating")
        script = str(ROOT / "examples" / "train_gpt.py")
        for i in range(s.tasks):
            spec = {
                "name": f"load-task-{i:02d}",
                "script": script,
                "args": ["--steps", "1000000"],
                "workers": {"min": s.workers, "max": s.workers},
                "checkpoint": {"every": 0},
            }
            c.submit(spec)
        deadline = time.time() + 120
        while time.time() < deadline:
            views = c.client.request("GET", "/v1/tasks")
            if sum(v["state"] == "running" for v in views) == s.tasks:
                break
            time.sleep(0.5)
        else:
            raise TrialError(f"not every task running after 120 s: {[v['state'] for v in views]}")
        on_progress(f"  {s.tasks} tasks running; warm-up {s.warmup_s:g} s, then {s.duration_s:g} s")
        time.sleep(s.warmup_s)
        store_pid = int(json.loads((c.state_dir / "store.json").read_text())["pid"])
        t0, cpu0, store0 = time.time(), cpu_s(coord_pid), cpu_s(store_pid)
        size0 = dir_bytes(c.state_dir)
        cpu_samples: list[float] = []
        last_t, last_cpu, told = t0, cpu0, t0
        while (left := t0 + s.duration_s - time.time()) > 0:
            time.sleep(min(1.0, left))
            now, cpu = time.time(), cpu_s(coord_pid)
            cpu_samples.append((cpu - last_cpu) / (now - last_t))
            last_t, last_cpu = now, cpu
            if now - told >= 60:
                on_progress(f"  {now - t0:.0f} s of {s.duration_s:g} s")
                told = now
        t1, cpu1, store1 = time.time(), cpu_s(coord_pid), cpu_s(store_pid)
        size1 = dir_bytes(c.state_dir)
        parts = {
            "state.db": (c.state_dir / "state.db").stat().st_size,
            "its WAL": sum(p.stat().st_size for p in c.state_dir.glob("state.db-*")),
            "event logs": dir_bytes(c.state_dir / "tasks"),
        }
        views = c.client.request("GET", "/v1/tasks")
        nodes = c.client.request("GET", "/v1/nodes")
        for conn in conns:
            conn.send("stop")
        samples = [Samples.load(conn.recv()) for conn in conns]
        alarms = logged = 0
        kinds: Counter[str] = Counter()
        for v in views:
            after = 0
            while True:  # the service answers at most 10 000 events a call
                got = c.client.request("GET", f"/v1/tasks/{v['name']}/events?after={after}")
                found = [e for e in got["events"] if e["event"] == "error_detected"]
                alarms += len(found)
                kinds.update(str(e.get("kind")) for e in found)
                logged += len(got["events"])
                if not got["events"]:
                    break
                after = got["last"]
        return {
            "window": (t0, t1),
            "samples": samples,
            "coordinator_cpu": (cpu1 - cpu0) / (t1 - t0),
            "coordinator_cpu_max": max(cpu_samples, default=0.0),
            "store_cpu": (store1 - store0) / (t1 - t0),
            "state_mb": size1 / 1e6,
            "state_parts": ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items()),
            "state_growth_mb_per_h": (size1 - size0) / 1e6 / (t1 - t0) * 3600,
            "running": sum(v["state"] == "running" for v in views),
            "committed": sum(v["step"] + 1 for v in views),
            "nodes_lost": sum(n["state"] == "lost" for n in nodes),
            "alarms": alarms,
            "alarm_kinds": ", ".join(f"{k} x{n}" for k, n in kinds.most_common()) or "none",
            "states": ", ".join(f"{k} x{n}" for k, n in Counter(v["state"] for v in views).items()),
            "events": logged,
        }
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        c.close()


def figures(raw: dict[str, Any], s: LoadSettings) -> dict[str, float]:
    """Metric -> value from :func:`measure`'s raw figures."""
    t0, t1 = raw["window"]
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    lags: list[float] = []
    failed = 0
    for smp in raw["samples"]:
        for sent, kind, latency, bad, lag in zip(smp.sent, smp.kind, smp.latency, smp.failed,
                                                 smp.lag, strict=True):  # fmt: skip
            if t0 <= sent < t1:
                lat[KINDS[kind]].append(latency * 1e3)
                lags.append(lag * 1e3)
                failed += bad
    every = [x for k in KINDS for x in lat[k]]
    if not every:
        raise TrialError("no request in the measured window")
    out = {
        "latency_p50_ms": percentile(every, 50),
        "latency_p99_ms": percentile(every, 99),
        "latency_max_ms": max(every),
        "requests_per_s": len(every) / (t1 - t0),
        "failed_requests": float(failed),
        "client_lag_p99_ms": percentile(lags, 99),
        "coordinator_cpu": raw["coordinator_cpu"],
        "coordinator_cpu_max": raw["coordinator_cpu_max"],
        "store_cpu": raw["store_cpu"],
        "state_mb": raw["state_mb"],
        "state_growth_mb_per_h": raw["state_growth_mb_per_h"],
        "tasks_running": float(raw["running"]),
        "nodes_lost": float(raw["nodes_lost"]),
        "actions": float(sum(x.actions for x in raw["samples"])),
        "alarms": float(raw["alarms"]),
        "steps_committed": float(raw["committed"]),
        "supervisor_steps": float(sum(x.steps for x in raw["samples"])),
    }
    for kind in ("heartbeat", "exchange"):
        if lat[kind]:
            out[f"latency_p50_ms[{kind}]"] = percentile(lat[kind], 50)
            out[f"latency_p99_ms[{kind}]"] = percentile(lat[kind], 99)
    return out


METRICS = {  # name: (unit, note)
    "latency_p50_ms": ("ms", "client-side latency of every request in the window"),
    "latency_p99_ms": ("ms", f"every request, client-side (goal < {GOAL_P99_MS:g} ms)"),
    "latency_max_ms": ("ms", "the slowest request"),
    "latency_p50_ms[heartbeat]": ("ms", "POST /v1/agents/{node}/heartbeat"),
    "latency_p99_ms[heartbeat]": ("ms", "POST /v1/agents/{node}/heartbeat"),
    "latency_p50_ms[exchange]": ("ms", "POST /v1/agents/{node}/tasks/{uid}/exchange"),
    "latency_p99_ms[exchange]": ("ms", "POST /v1/agents/{node}/tasks/{uid}/exchange"),
    "requests_per_s": ("1/s", "requests answered per second in the window"),
    "failed_requests": ("count", "requests with a transport error or a 4xx/5xx answer"),
    "client_lag_p99_ms": ("ms", "how late the generator sent a request against its schedule "
                          "(the generator's own delay, not the service's)"),
    "coordinator_cpu": ("cores", "the coordinator process's CPU over the window (/proc)"),
    "coordinator_cpu_max": ("cores", "its busiest second"),
    "store_cpu": ("cores", "the store process's CPU over the window"),
    "state_mb": ("MB", "the state directory after the window (SQLite with WAL, event logs)"),
    "state_growth_mb_per_h": ("MB/h", "its growth over the window, per hour"),
    "tasks_running": ("count", "tasks still running at the end (all of them: nothing broke)"),
    "nodes_lost": ("count", "nodes the service shows lost at the end (goal 0)"),
    "actions": ("count", "actions (kill, spawn, probe) the supervisors received (goal 0)"),
    "alarms": ("count", "error_detected events in the tasks' logs (goal 0)"),
    "steps_committed": ("steps", "steps the tasks committed, as the service shows them"),
}  # fmt: skip


def system(s: LoadSettings) -> str:
    """The rows' system: ``unicron cluster``, with the idle exchange interval where it is
    fixed instead of the coordinator's (a what-if)."""
    if s.exchange_s is None:
        return SYSTEM
    return f"{SYSTEM} idle exchange {s.exchange_s * 1e3:g} ms"


def run(
    quick: bool,
    *,
    settings: LoadSettings | None = None,
    host: str | None = None,
) -> list[Row]:
    """The rows of this scenario (one soak; ``quick``: 60 s)."""
    s = settings or LoadSettings(duration_s=60.0 if quick else 600.0)
    before = loadavg()
    with tempfile.TemporaryDirectory(prefix="unicron-bench-load-") as tmp:
        try:
            raw = measure(s, Path(tmp))
            got = figures(raw, s)
        except TrialError as exc:
            return [make_row(system=system(s), scenario=SCENARIO, metric="trial", status="failed",
                             note=str(exc), host=host)]  # fmt: skip
    after = loadavg()
    rhythm = (
        "exchanging at the coordinator's rhythm when idle (Reply.next_s)"
        if s.exchange_s is None
        else f"exchanging every {s.exchange_s * 1e3:g} ms when idle"
    )
    setup = (
        f"{s.agents} synthetic agents heartbeating every {s.heartbeat_s:g} s; {s.tasks} tasks x "
        f"{s.workers} workers ({s.tasks * s.workers // s.slots} supervisors) stepping every "
        f"{s.step_s:g} s, {rhythm}; "
        f"{s.duration_s:g} s window; {s.procs} generator processes; machine: {before} before, "
        f"{after} after"
    )
    if os.nice(0) != 0:  # a shared machine: the run may have asked the scheduler for a share
        setup += f"; generator and service at nice {os.nice(0)}"
    rows = []
    for metric, (unit, note) in METRICS.items():
        if metric not in got:
            continue
        if metric == "state_mb":
            note = f"{note}: {raw['state_parts']}; {raw['events']} events in SQLite"
        if metric == "alarms":
            note = f"{note}: {raw['alarm_kinds']}"
        if metric == "tasks_running":
            note = f"{note}; states at the end: {raw['states']}"
        if metric == "latency_p99_ms":
            met = "met" if got[metric] < GOAL_P99_MS else "NOT met"
            note = f"{note}: {met}; {setup}"
        value = [got[metric]]
        rows.append(make_row(system=system(s), scenario=SCENARIO, metric=metric, values=value,
                             unit=unit, note=note, host=host))  # fmt: skip
    return rows
