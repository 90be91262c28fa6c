"""Sim-to-real: one scenario on a real cluster and in the simulator, side by side.

``python -m bench.simreal [--scenario FILE] [--placements planner,keep,equal] [--quick]``
(``make bench-simreal``). For each placement (``unicron coordinator --placement``) it starts
a real cluster of the scenario's nodes (:class:`unicron.control.lab.LocalCluster`: a
coordinator and one agent of one slot per node, in network namespaces, else on loopback),
submits the tasks, waits until every one runs, then plays the trace (a ``remove`` kills the
node's agent and workers with SIGKILL, an ``add`` starts its agent again) and cancels the
tasks at the end of the window. From the planner run's event logs it measures the runtime's
constants (each task's steps per second at each worker count, the node-loss detection, the
transition), runs ``unicron.sim.scenario.simulate`` with them, and prints and writes
(``bench/results/simreal.json`` rows, ``simreal.md`` tables): accumulated WAF per task,
time in each loss category, transitions, real against simulated; the planner's WAF over
the two baselines'; the planner's decision latency and the transitions per hour.

The analysis functions (:func:`task_figures`, :func:`constants`, :func:`decisions`) are pure
(event lists in, figures out) and tested on hand-made logs (``tests/test_bench_simreal.py``).
Units: accumulated WAF is weight x committed steps (docs/simulator.md, "Sim-to-real").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    bench_parser,
    make_row,
    save_scenario,
    write_json_atomic,
    write_text_atomic,
)
from unicron.control.client import ServiceError
from unicron.sim.scenario import Constants, Scenario, ScenarioTask

ROOT = Path(__file__).resolve().parents[1]
SCENARIO_FILE = ROOT / "examples" / "sim" / "simreal.yaml"
SCENARIO = "simreal"
PLACEMENTS = ("planner", "keep", "equal")
Events = list[dict[str, Any]]


# -- the real run ------------------------------------------------------------------------------
@dataclass
class RealRun:
    """One placement's real run: every task's events, the window, the node kills."""

    placement: str
    events: dict[str, Events]
    t0: float
    t1: float
    kills: list[tuple[int, float]]
    isolated: bool
    placements: dict[str, list[str]] = field(default_factory=dict)
    """task -> the nodes it ran on when the trace began"""
    loadavg: float | None = None
    """the machine's 1-minute load average at the end of the window"""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_node(cluster: Any, host: int) -> None:
    """The node vanishes: SIGKILL its agent and everything it started (in a namespace lab:
    every process in the namespace)."""
    proc = cluster.agents[host]
    pids = set(_descendants(proc.pid))
    ns = cluster.net.members[host].netns if cluster.isolated else None
    if ns is not None:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids |= {int(p) for p in out.stdout.split()}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _spec(sc: Scenario, t: ScenarioTask) -> dict[str, Any]:
    return {
        "name": t.name,
        "script": str(sc.script),
        "args": list(sc.args),
        "weight": t.weight,
        "workers": {"min": t.min_workers, "max": t.max_workers},
        "checkpoint": {"every": "auto"},  # the fallback when every replica is lost
    }


def run_real(
    sc: Scenario, placement: str, root: Path, *, say: Callable[[str], None] = print
) -> RealRun:
    """Run ``sc`` on a real cluster under ``placement``; see the module docstring."""
    from unicron.control import netns
    from unicron.control.lab import LocalCluster

    loopback = netns.available() is not None
    with LocalCluster(
        root,
        hosts=sc.nodes,
        slots=1,
        loopback=loopback,
        coordinator_args=("--placement", placement),
    ) as c:
        c.start_coordinator()
        for host in range(sc.nodes):
            c.start_agent(host)  # one at a time: node ids follow the host numbers
        for t in sc.tasks:
            c.submit(_spec(sc, t))

        def settled() -> bool:
            views = [c.task(t.name) for t in sc.tasks]
            for v in views:
                if v["state"] in ("done", "failed", "cancelled"):
                    raise RuntimeError(f"task {v['name']} ended {v['state']}: {v['outcome']}")
            return sum(v["workers"] for v in views) == sc.nodes and all(
                v["state"] == "running" and v["workers"] == len(v["placement"]) and v["step"] >= 2
                for v in views
            )

        c.wait_until(settled, "every task running on its first allocation", timeout_s=180)
        t0 = time.time()
        placements = {t.name: list(c.task(t.name)["placement"]) for t in sc.tasks}
        say(f"  [{placement}] every task runs; trace starts ({'netns' if c.isolated else 'lo'})")
        kills: list[tuple[int, float]] = []
        for ev in sc.trace:
            time.sleep(max(0.0, t0 + ev.time_s - time.time()))
            host = int(ev.node[1:])
            if ev.action == "remove":
                kills.append((host, time.time()))
                kill_node(c, host)
            else:
                c.start_agent(host, wait=False)
            say(f"  [{placement}] {time.time() - t0:6.1f} s  {ev.action} {ev.node}")
        time.sleep(max(0.0, t0 + sc.duration_s - time.time()))
        t1 = time.time()
        for t in sc.tasks:
            with contextlib.suppress(ServiceError):  # 409: it ended already (a failed task)
                c.client.request("POST", f"/v1/tasks/{t.name}/cancel")
        events = {t.name: c.events(t.name) for t in sc.tasks}
        load = os.getloadavg()[0]
        return RealRun(placement, events, t0, t1, kills, c.isolated, placements, load)


# -- the analysis (pure) -------------------------------------------------------------------------
def _of(events: Events, kind: str) -> Events:
    return sorted((e for e in events if e["event"] == kind), key=lambda e: float(e["ts"]))


def step_rates(events: Events, until: float) -> dict[int, float]:
    """Steps per second at each worker count: consecutive commits of one epoch (the first
    step of an epoch carries its transition and is left out)."""
    gaps: dict[int, list[float]] = {}
    steps = [e for e in _of(events, "step_end") if float(e["ts"]) <= until]
    for a, b in itertools.pairwise(steps):
        if a["epoch"] == b["epoch"]:
            gaps.setdefault(int(b["workers"]), []).append(float(b["ts"]) - float(a["ts"]))
    return {k: len(g) / sum(g) for k, g in sorted(gaps.items()) if sum(g) > 0}


def detections(events: Events, kills: list[tuple[int, float]], t0: float, t1: float) -> list[float]:
    """For each node kill in the window that took a worker of this task: the kill to the
    epoch its coordinator began without that node (what the simulator books as detection:
    the task is down until then)."""
    out = []
    epochs = _of(events, "epoch_begin")
    for host, tk in kills:
        if not t0 <= tk <= t1:
            continue
        seen = next(
            (
                float(e["ts"]) - tk
                for e in epochs
                if tk <= float(e["ts"]) <= tk + 30.0 and e.get("reason") == f"node {host} lost"
            ),
            None,
        )
        if seen is not None:
            out.append(seen)
    return out


def transitions(
    events: Events, rates: dict[int, float], kills: list[tuple[int, float]], t0: float, t1: float
) -> tuple[int, list[float]]:
    """Epochs begun in the window, and each epoch change's cost: the gap from the last
    commit before it to the first commit after it, less one step at the new size and less
    the detection when a node of the task was killed in that gap."""
    count = sum(1 for e in _of(events, "epoch_begin") if t0 < float(e["ts"]) <= t1)
    steps = _of(events, "step_end")
    errors = _of(events, "error_detected")
    costs = []
    for a, b in itertools.pairwise(steps):
        ta, tb = float(a["ts"]), float(b["ts"])
        if a["epoch"] == b["epoch"] or not t0 < tb <= t1:
            continue
        k = int(b["workers"])
        step_s = 1.0 / rates[k] if k in rates else 0.0
        detect = 0.0
        for _, tk in kills:
            if ta <= tk <= tb:
                seen = [float(e["ts"]) for e in errors if tk <= float(e["ts"]) <= tb]
                detect += (min(seen) - tk) if seen else 0.0
        costs.append(max(0.0, tb - ta - step_s - detect))
    return count, costs


def joins(
    events: Events, nodes_at_t0: list[int], kills: list[tuple[int, float]], t1: float
) -> tuple[list[float], list[float]]:
    """Each slot a task got (``slot N added`` by the planner, or readmitted when its node came
    back) to the first epoch with it as a member; a slot given back first is left out.
    Split by whether the task already had a process on that node (warm: it ran there since
    the node last started; ``nodes_at_t0`` where it ran when the trace began) or not (cold)."""
    epochs = _of(events, "epoch_begin")
    actions = _of(events, "action")
    warm_nodes = set(nodes_at_t0)
    lost = sorted(kills, key=lambda k: k[1])
    warm: list[float] = []
    cold: list[float] = []
    for a in actions:
        ts, slot, node = float(a["ts"]), a.get("slot"), int(a.get("node", -1))
        while lost and lost[0][1] <= ts:
            warm_nodes.discard(lost.pop(0)[0])
        added = a.get("action") == "reconfigure" and f"slot {slot} added" in a.get("reason", "")
        if ts > t1 or not (added or a.get("action") == "readmit"):
            continue
        released = next(
            (float(r["ts"]) for r in actions
             if float(r["ts"]) > ts and f"slot {slot} released" in r.get("reason", "")),
            t1,
        )  # fmt: skip
        hit = next(
            (float(e["ts"]) for e in epochs
             if ts <= float(e["ts"]) <= released and slot in e["members"]),
            None,
        )  # fmt: skip
        if hit is not None:
            (warm if node in warm_nodes else cold).append(hit - ts)
        warm_nodes.add(node)
    return warm, cold


def task_figures(
    events: Events,
    *,
    weight: float,
    ref_rate: float,
    kills: list[tuple[int, float]],
    t0: float,
    t1: float,
    rates: dict[int, float],
) -> dict[str, Any]:
    """One task's real figures over the window, booked as the simulator books them (seconds
    of its reference rate ``ref_rate``, weighted steps per second): useful, detection,
    transition, and sub-healthy as the rest (idle and lost work: none here)."""
    steps = sum(1 for e in _of(events, "step_end") if t0 < float(e["ts"]) <= t1)
    det = detections(events, kills, t0, t1)
    count, costs = transitions(events, rates, kills, t0, t1)
    span = t1 - t0
    useful_s = weight * steps / ref_rate if ref_rate > 0 else 0.0
    end = next((e for e in _of(events, "task_end") if float(e["ts"]) < t1), None)
    return {
        "ended": None if end is None else f"{end['status']} at {float(end['ts']) - t0:.0f} s",
        "steps": steps,
        "accumulated_waf": weight * steps,
        "breakdown_s": {
            "detection": sum(det),
            "transition": sum(costs),
            "lost_work": 0.0,
            "sub_healthy": span - useful_s - sum(det) - sum(costs),
            "idle": 0.0,
        },
        "transitions": count,
        "detections_s": det,
        "transition_costs_s": costs,
    }


def constants(run: RealRun, sc: Scenario) -> Constants:
    """The simulator's constants from the real run (:class:`unicron.sim.scenario.Constants`):
    step rates per task and worker count, median detection, median transition cost."""
    from unicron.sim import measured

    rates = {t.name: step_rates(run.events[t.name], run.t1) for t in sc.tasks}
    det: list[float] = []
    costs: list[float] = []
    warm: list[float] = []
    cold: list[float] = []
    for t in sc.tasks:
        det += detections(run.events[t.name], run.kills, run.t0, run.t1)
        costs += transitions(run.events[t.name], rates[t.name], run.kills, run.t0, run.t1)[1]
        at_t0 = [int(n[1:]) for n in run.placements.get(t.name, [])]
        w, c = joins(run.events[t.name], at_t0, run.kills, run.t1)
        warm, cold = warm + w, cold + c
    return Constants(  # means: the simulator's totals then carry the real run's
        rates=rates,
        node_detect_s=statistics.mean(det) if det else measured.load().node_detect_s,
        transition_s=statistics.mean(costs) if costs else 0.0,
        join_s=statistics.median(warm) if warm else 0.0,
        join_cold_s=statistics.median(cold) if cold else 0.0,
    )


def decisions(events: dict[str, Events], t0: float, t1: float) -> dict[str, Any]:
    """The planner's decisions on the coordinator up to ``t1`` (one per trigger that changed
    a task; the plan events of one decision share ts and trigger): decision latency, and
    transitions (epochs begun) per hour over the window."""
    seen: dict[tuple[float, str], float] = {}
    epochs = 0
    for evs in events.values():
        for e in _of(evs, "plan"):
            if "decision_ms" in e and float(e["ts"]) <= t1:
                seen[(float(e["ts"]), str(e.get("trigger")))] = float(e["decision_ms"])
        epochs += sum(1 for e in _of(evs, "epoch_begin") if t0 < float(e["ts"]) <= t1)
    ms = sorted(seen.values())
    return {
        "decisions": len(ms),
        "decision_ms_p50": statistics.median(ms) if ms else None,
        "decision_ms_max": max(ms) if ms else None,
        "transitions_per_hour": epochs * 3600.0 / (t1 - t0) if t1 > t0 else 0.0,
        "triggers": sorted({trigger for _, trigger in seen}),
    }


# -- report ------------------------------------------------------------------------------------
def _pct(real: float, sim: float) -> str:
    return f"{100.0 * (sim - real) / real:+.1f} %" if real else "-"


def compare(sc: Scenario, run: RealRun, consts: Constants, sim: Any) -> dict[str, Any]:
    """Real against simulated, per task and for the cluster."""
    from unicron.sim.scenario import prepare

    prepared = prepare(sc, consts.rates)
    out: dict[str, Any] = {
        "tasks": {},
        "constants": {
            "node_detect_s": consts.node_detect_s,
            "transition_s": consts.transition_s,
            "join_s": consts.join_s,
            "join_cold_s": consts.join_cold_s,
            "rates_steps_per_s": {
                t: {str(k): v for k, v in r.items()} for t, r in consts.rates.items()
            },
        },
    }
    by_name = {t.name: t for t in sim.tasks}
    for t in sc.tasks:
        real = task_figures(
            run.events[t.name],
            weight=t.weight,
            ref_rate=prepared.ref_waf(t.name),
            kills=run.kills,
            t0=run.t0,
            t1=run.t1,
            rates=consts.rates[t.name],
        )
        s = by_name[t.name]
        out["tasks"][t.name] = {
            "reference_workers": prepared.reference[t.name],
            "real": real,
            "sim": {
                "accumulated_waf": s.accumulated_waf,
                "breakdown_s": s.breakdown_s,
                "transitions": s.transitions,
            },
            "waf_diff": (s.accumulated_waf - real["accumulated_waf"]) / real["accumulated_waf"]
            if real["accumulated_waf"]
            else None,
        }
    real_total = sum(v["real"]["accumulated_waf"] for v in out["tasks"].values())
    out["cluster"] = {"real": real_total, "sim": sim.accumulated_waf}
    return out


def markdown(
    sc: Any,
    cmp: dict[str, Any],
    totals: dict[str, float],
    dec: dict[str, Any],
    runs: dict[str, RealRun],
    note: str,
) -> str:
    """The tables of ``simreal.md``."""
    lines = [
        f"# Sim-to-real ({note})",
        "",
        f"{sc.nodes} nodes x 1 slot, {len(sc.tasks)} tasks, window {sc.duration_s:g} s, "
        f"{len(sc.trace)} trace events; accumulated WAF = weight x steps committed in the window; "
        "losses in seconds of each task's reference rate.",
        "",
        "| task (weight) | WAF real | WAF sim | sim vs real | detection s real / sim | "
        "transition s real / sim | sub-healthy s real / sim | transitions real / sim |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in sc.tasks:
        v = cmp["tasks"][t.name]
        r, s = v["real"], v["sim"]
        rb, sb = r["breakdown_s"], s["breakdown_s"]
        lines.append(
            f"| {t.name} ({t.weight:g}){' ' + r['ended'] if r['ended'] else ''} "
            f"| {r['accumulated_waf']:.0f} | {s['accumulated_waf']:.1f} "
            f"| {_pct(r['accumulated_waf'], s['accumulated_waf'])} "
            f"| {rb['detection']:.2f} / {sb['detection']:.2f} "
            f"| {rb['transition']:.2f} / {sb['transition']:.2f} "
            f"| {rb['sub_healthy']:.1f} / {sb['sub_healthy']:.1f} "
            f"| {r['transitions']} / {s['transitions']} |"
        )
    c = cmp["cluster"]
    lines += [
        f"| cluster | {c['real']:.0f} | {c['sim']:.1f} | {_pct(c['real'], c['sim'])} | | | | |",
        "",
        "Constants measured in the planner run: node-loss detection "
        f"{cmp['constants']['node_detect_s']:.2f} s (mean), transition "
        f"{cmp['constants']['transition_s']:.2f} s (mean), a new slot to the epoch its worker "
        f"joins {cmp['constants']['join_s']:.2f} s on a node where the task runs already, "
        f"{cmp['constants']['join_cold_s']:.2f} s on a node new to it (medians); "
        "steps/s per worker count: "
        + "; ".join(
            f"{name} " + ", ".join(f"{k}: {v:.2f}" for k, v in r.items())
            for name, r in cmp["constants"]["rates_steps_per_s"].items()
        )
        + ".",
        "",
        "| placement | " + " | ".join(f"{t.name} WAF" for t in sc.tasks) + " | cluster WAF "
        "| planner / this |",
        "|---|" + "---|" * (len(sc.tasks) + 2),
    ]
    for p, run in runs.items():
        per = [
            sum(1 for e in _of(run.events[t.name], "step_end") if run.t0 < float(e["ts"]) <= run.t1)
            * t.weight
            for t in sc.tasks
        ]
        ratio = totals["planner"] / totals[p] if totals.get(p) and "planner" in totals else None
        lines.append(
            f"| {p} | "
            + " | ".join(f"{w:.0f}" for w in per)
            + f" | {totals[p]:.0f} | "
            + (f"{ratio:.3f}" if ratio is not None else "-")
            + " |"
        )
    lines += [
        "",
        f"Planner decisions (planner run): {dec['decisions']} that changed a task, latency p50 "
        f"{_ms(dec['decision_ms_p50'])}, max {_ms(dec['decision_ms_max'])}; "
        f"transitions {dec['transitions_per_hour']:.0f} per hour "
        f"(triggers: {'; '.join(dec['triggers'])}).",
    ]
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


BOOKED = (("detection", "detection_s"), ("transition", "transition_s"),
          ("sub_healthy", "subhealthy_s"))  # fmt: skip
"""the losses booked per task, as named in a breakdown and in the rows"""


def rows(cmp: dict[str, Any], totals: dict[str, float], dec: dict[str, Any]) -> list[Any]:
    """The results rows: per task (and the cluster) the real run's and the simulator's
    accumulated WAF, their ratio, the seconds each booked to each loss and the transitions;
    the placements' cluster WAF; the planner's decisions."""
    out = []
    for name, v in cmp["tasks"].items():
        for side in ("real", "sim"):
            got = v[side]
            figures = [("accumulated_waf", got["accumulated_waf"], "weighted steps")]
            figures += [(metric, got["breakdown_s"][key], "s") for key, metric in BOOKED]
            figures.append(("transitions", got["transitions"], "count"))
            out += [make_row(system=f"unicron-{side}", scenario=SCENARIO,
                             metric=f"{metric}[{name}]", values=[value], unit=unit)
                    for metric, value, unit in figures]  # fmt: skip
        if v["waf_diff"] is not None:
            out.append(
                make_row(
                    system="unicron-sim",
                    scenario=SCENARIO,
                    metric=f"sim_over_real[{name}]",
                    values=[1 + v["waf_diff"]],
                    unit="x",
                    status="derived",
                )
            )
    k = cmp["constants"]
    for metric, value, what in (
        ("node_detect_s", k["node_detect_s"], "mean, the kill to the epoch without the node"),
        ("transition_mean_s", k["transition_s"], "mean cost of an epoch change"),
        ("join_warm_s", k["join_s"], "median, a new slot to its worker's epoch, the task "
                                      "already on the node"),
        ("join_cold_s", k["join_cold_s"], "median, the same on a node new to the task"),
    ):  # fmt: skip
        if value is not None:
            out.append(make_row(system="measured", scenario=SCENARIO, metric=metric,
                                values=[value], unit="s", note=f"planner run: {what}"))  # fmt: skip
    for name, rates in k["rates_steps_per_s"].items():
        out += [make_row(system="measured", scenario=SCENARIO, metric=f"steps_per_s[{name}/{n}]",
                         values=[rate], unit="1/s", note="planner run: at n workers")
                for n, rate in rates.items()]  # fmt: skip
    c = cmp["cluster"]
    for side in ("real", "sim"):
        out.append(make_row(system=f"unicron-{side}", scenario=SCENARIO,
                            metric="accumulated_waf[cluster]", values=[c[side]],
                            unit="weighted steps"))  # fmt: skip
    if c["real"]:
        out.append(make_row(system="unicron-sim", scenario=SCENARIO,
                            metric="sim_over_real[cluster]", values=[c["sim"] / c["real"]],
                            unit="x", status="derived"))  # fmt: skip
    for p, total in totals.items():
        out.append(
            make_row(
                system=f"placement-{p}",
                scenario=SCENARIO,
                metric="cluster_accumulated_waf",
                values=[total],
                unit="weighted steps",
            )
        )
        if p != "planner" and "planner" in totals and total > 0:
            out.append(
                make_row(
                    system=f"placement-{p}",
                    scenario=SCENARIO,
                    metric="planner_over_placement",
                    values=[totals["planner"] / total],
                    unit="x",
                    status="derived",
                )
            )
    if dec["decision_ms_p50"] is not None:  # each figure a row of its own (not a spread)
        out += [make_row(system="unicron-real", scenario=SCENARIO, metric=f"plan_decision_ms[{q}]",
                         values=[dec[f"decision_ms_{q}"]], unit="ms",
                         note=f"{q} of the planner's decisions that changed a task")
                for q in ("p50", "max")]  # fmt: skip
    out.append(
        make_row(
            system="unicron-real",
            scenario=SCENARIO,
            metric="transitions_per_hour",
            values=[dec["transitions_per_hour"]],
            unit="1/h",
        )
    )
    return out


def quick(sc: Scenario) -> Scenario:
    """A 40-second smoke version of ``sc``: one node lost and back."""
    from unicron.sim.trace import TraceEvent

    last = f"n{sc.nodes - 1}"
    trace = (
        TraceEvent(time_s=10.0, action="remove", node=last),
        TraceEvent(time_s=25.0, action="add", node=last),
    )
    return replace(sc, duration_s=40.0, trace=trace)


def main(argv: list[str] | None = None) -> int:
    from unicron.sim import scenario as S

    p = bench_parser("bench.simreal", __doc__)
    p.add_argument("--scenario", default=str(SCENARIO_FILE), help="scenario file (YAML)")
    p.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help="comma-separated, from planner, keep, equal (planner always runs)",
    )
    p.add_argument("--quick", action="store_true", help="a 40-s window, the planner only")
    p.add_argument(
        "--from",
        dest="again",
        metavar="DIR",
        help="analyse the runs kept in DIR (a previous run's logs) instead of running again",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results directory (default bench/results; --quick writes nothing unless given)",
    )
    args = p.parse_args(argv)
    sc = S.load(Path(args.scenario))
    placements = (
        ["planner"]
        if args.quick
        else [x for x in PLACEMENTS if x == "planner" or x in args.placements.split(",")]
    )
    if args.quick:
        sc = quick(sc)
    work = Path(args.again or tempfile.mkdtemp(prefix="unicron-simreal-"))
    print(f"sim-to-real: {args.scenario}, placements {', '.join(placements)}; logs in {work}")
    runs = {}
    for pl in placements:
        kept = work / pl / "run.json"
        if args.again:
            runs[pl] = RealRun(**json.loads(kept.read_text()))
            continue
        runs[pl] = run_real(sc, pl, work / pl)
        write_json_atomic(kept, asdict(runs[pl]))
    totals = {
        pl: sum(
            t.weight
            * sum(1 for e in _of(r.events[t.name], "step_end") if r.t0 < float(e["ts"]) <= r.t1)
            for t in sc.tasks
        )
        for pl, r in runs.items()
    }
    consts = constants(runs["planner"], sc)
    sim = S.simulate(sc, consts)
    cmp = compare(sc, runs["planner"], consts, sim)
    dec = decisions(runs["planner"].events, runs["planner"].t0, runs["planner"].t1)
    first, last = min(r.t0 for r in runs.values()), max(r.t1 for r in runs.values())
    loads = [r.loadavg for r in runs.values() if r.loadavg is not None]
    note = (
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(first))}"
        f"-{time.strftime('%H:%M UTC', time.gmtime(last))}, "
        f"{'network namespaces' if runs['planner'].isolated else 'loopback'}, "
        + (
            f"load average {min(loads):.0f}-{max(loads):.0f} at the runs' ends"
            if loads
            else "load average not recorded"
        )
        + f" on {os.cpu_count()} cores shared with other sessions"
    )
    text = markdown(sc, cmp, totals, dec, runs, note)
    print(text)
    out = Path(args.out) if args.out else (None if args.quick else RESULTS_DIR)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "simreal.md", text)
        write_json_atomic(
            out / "simreal-detail.json",
            {
                "note": note,
                "comparison": cmp,
                "totals": totals,
                "decisions": dec,
                "kills": {pl: [(h, tk - r.t0) for h, tk in r.kills] for pl, r in runs.items()},
            },
        )
        print(f"wrote {save_scenario(rows(cmp, totals, dec), SCENARIO, out, replace=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
