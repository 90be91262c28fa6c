"""The benchmark suite: which scenarios exist, which arms run in each, and how they are run.

Training scenarios run every arm in turn, repetition after repetition (A B C A B C ...), so a
slow phase of a shared machine hits every system alike; the figures of an arm are the
median, min and max over its repetitions. A trial that fails is reported as a ``failed`` row
with its error and the arm is not run again in that scenario; the other arms go on. Module
scenarios (``floor``, and ``planner`` / ``simulator`` where those modules exist) return
their own rows from ``run(quick)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import RESULTS_DIR, Row, check_row, load_rows, machine, make_row, now_iso
from bench.systems.base import Arm, Scenario, Settings, TrialError
from bench.systems.ddp import DdpArm
from bench.systems.torchft import DEFAULT_TIMEOUT_S, TorchftArm
from bench.systems.torchrun import GLOO_DEFAULT_TIMEOUT_S, TorchrunArm, TorchrunNodeArm
from bench.systems.unicron import UnicronArm

log = logging.getLogger("bench")

SYSTEMS = ("unicron", "torchrun", "torchft", "ddp")
TRAINING = ("steady", "crash", "error", "hang", "node")
MODULES = {"floor": "bench.floor", "planner": "bench.planner", "simulator": "bench.simulator"}
ORDER = ("floor", *TRAINING, "planner", "simulator")
SHOWN = {  # metrics reported for fault-free (False) and faulted (True) scenarios
    False: ("wall_s", "step_time_s", "false_alarms"),
    True: ("wall_s", "detection_s", "detection_heartbeat_s", "recovery_s", "steps_redone"),
}


def known_scenarios() -> list[str]:
    """Training scenarios, the floor, and the module scenarios whose module exists."""
    found = [n for n, m in MODULES.items() if importlib.util.find_spec(m) is not None]
    return [n for n in ORDER if n in TRAINING or n in found]


def training_scenario(name: str, settings: Settings) -> Scenario:
    """The faults of training scenario ``name``, at ``settings.fault_step`` on one rank."""
    at = f"rank={settings.fault_rank},step={settings.fault_step}"
    table = {
        "steady": Scenario(name="steady", description="no fault: steady-state step time"),
        "crash": Scenario(
            name="crash", description="a worker SIGKILLed mid-step", faults=(f"crash:{at}",)
        ),
        "error": Scenario(
            name="error",
            description=f"a worker raises a {settings.error_kind} error",
            faults=(f"error:{at},kind={settings.error_kind}",),
        ),
        "hang": Scenario(
            name="hang", description="a worker stops making progress", faults=(f"hang:{at}",)
        ),
        "node": Scenario(
            name="node",
            description="2 nodes of 2 workers; node 1 (agent and workers) vanishes",
            faults=(f"node:node=1,step={settings.fault_step}",),
        ),
    }
    return table[name]


def arms_for(scenario: str, settings: Settings, systems: Sequence[str]) -> list[Arm]:
    """The arms of ``scenario`` among ``systems``, in the order they take turns."""
    arms: list[Arm] = []
    k_all = settings.ckpt_every
    if "unicron" in systems:
        arms.append(UnicronArm())
    if "ddp" in systems and scenario == "steady":
        arms.append(DdpArm())
    if "torchrun" in systems:
        if scenario == "node":  # two agents, default and tuned rendezvous settings
            arms += [TorchrunNodeArm(ckpt_every=k_all[0], tuned=t) for t in (False, True)]
        elif scenario == "hang":
            arms.append(TorchrunArm(ckpt_every=k_all[0], pg_timeout_s=settings.hang_timeout_s))
        else:
            arms += [TorchrunArm(ckpt_every=k) for k in k_all]
    if "torchft" in systems:
        timeout = settings.hang_timeout_s if scenario == "hang" else DEFAULT_TIMEOUT_S
        arms.append(TorchftArm(timeout_s=timeout))
    return arms


def base_label(label: str) -> str:
    """The fault-free twin of an arm (``torchrun K=10 timeout=60s`` -> ``torchrun K=10``)."""
    return label.split(" timeout=")[0]


class Lookup:
    """Medians measured in this invocation, else the latest saved ones."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir
        self.rows: list[Row] = []

    def median(self, system: str, scenario: str, metric: str) -> float | None:
        """The median of (system, scenario, metric), or ``None`` if there is no ok row."""
        for source in (self.rows, load_rows(self.results_dir / f"{scenario}.json")):
            for row in source:
                key = (row["system"], row["scenario"], row["metric"], row["status"])
                if key == (system, scenario, metric, "ok") and row["median"] is not None:
                    return float(row["median"])
        return None


def run_training(
    scenario: Scenario,
    arms: Sequence[Arm],
    settings: Settings,
    workroot: Path,
    host: str,
    on_trial: Callable[[str, int, dict[str, float] | str], None] | None = None,
) -> list[Row]:
    """Run the arms interleaved for ``settings.reps`` repetitions; return their rows."""
    samples: dict[str, dict[str, list[float]]] = {a.label: {} for a in arms}
    failed: dict[str, str] = {}
    for rep in range(settings.reps):
        for arm in arms:
            if arm.label in failed:
                continue
            workdir = workroot / scenario.name / arm.label.replace(" ", "_") / f"rep{rep}"
            workdir.mkdir(parents=True, exist_ok=True)
            try:
                metrics = arm.run(scenario, settings, workdir)
            except Exception as exc:  # any failure of a system is reported, never fatal
                reason = str(exc) if isinstance(exc, TrialError) else repr(exc)
                if not isinstance(exc, TrialError):
                    log.debug("%s", traceback.format_exc())
                failed[arm.label] = f"rep {rep + 1}/{settings.reps}: {reason} (logs: {workdir})"
                if on_trial:
                    on_trial(arm.label, rep, failed[arm.label])
                continue
            shutil.rmtree(workdir, ignore_errors=True)
            for metric, value in metrics.items():
                samples[arm.label].setdefault(metric, []).append(value)
            if on_trial:
                on_trial(arm.label, rep, metrics)
    rows: list[Row] = []
    for arm in arms:
        if arm.label in failed:
            rows.append(
                make_row(
                    system=arm.label,
                    scenario=scenario.name,
                    metric="trial",
                    status="failed",
                    note=failed[arm.label],
                    host=host,
                )
            )
        for metric, values in samples[arm.label].items():
            if metric not in SHOWN[bool(scenario.faults)]:
                continue
            note = scenario.description if metric == "wall_s" else ""
            if metric == "wall_s" and scenario.faults:
                note += f" ({', '.join(scenario.faults)}; {settings.steps} steps)"
            rows.append(
                make_row(
                    system=arm.label,
                    scenario=scenario.name,
                    metric=metric,
                    values=values,
                    host=host,
                    note=note,
                )
            )
    return rows


def derived_rows(
    scenario: Scenario, rows: list[Row], lookup: Lookup, settings: Settings, host: str
) -> list[Row]:
    """Ratios and bounds computed from measured medians (status ``derived``)."""
    out: list[Row] = []
    ok = {
        (r["system"], r["metric"]): float(r["median"])
        for r in rows
        if r["status"] == "ok" and r["median"] is not None
    }

    def add(system: str, metric: str, value: float, note: str, unit: str | None = None) -> None:
        out.append(
            make_row(
                system=system,
                scenario=scenario.name,
                metric=metric,
                values=[value],
                status="derived",
                note=note,
                unit=unit,
                host=host,
            )
        )

    labels = sorted({s for s, _ in ok})
    if scenario.name == "steady":
        ddp = ok.get(("plain DDP", "step_time_s"))
        for label in labels:
            step = ok.get((label, "step_time_s"))
            if ddp and step is not None and label != "plain DDP":
                add(
                    label,
                    "step_time_vs_ddp",
                    step / ddp,
                    "median step time / plain DDP's, same run",
                )
        return out
    floor = lookup.median("floor", "floor", "floor_s")
    for label in labels:
        wall = ok.get((label, "wall_s"))
        steady = lookup.median(base_label(label), "steady", "wall_s")
        # no fault cost for a node loss: its fault-free twin (two agents) is not measured, and
        # the survivors train the rest on half the workers
        if wall is not None and steady is not None and scenario.name != "node":
            add(
                label,
                "fault_cost_s",
                wall - steady,
                f"median wall with the fault - median fault-free wall ({base_label(label)})",
            )
        recovery = ok.get((label, "recovery_s"))
        if floor and recovery is not None:
            add(
                label,
                "recovery_over_floor",
                recovery / floor,
                f"median recovery / floor ({floor * 1e3:.1f} ms: PG build + state over loopback)",
            )
    if scenario.name == "hang":
        out += _default_timeout_rows(scenario, ok, settings, host)
    return out


def _default_timeout_rows(
    scenario: Scenario, ok: dict[tuple[str, str], float], settings: Settings, host: str
) -> list[Row]:
    """Hang figures with the default timeouts, bounded from the short-timeout runs."""
    out = []
    t = settings.hang_timeout_s
    for label, default, who in (
        (
            TorchrunArm(ckpt_every=settings.ckpt_every[0], pg_timeout_s=t).label,
            GLOO_DEFAULT_TIMEOUT_S,
            "gloo's default process-group timeout",
        ),
        (TorchftArm(timeout_s=t).label, DEFAULT_TIMEOUT_S, "torchft's default timeout"),
    ):
        if t == default:
            continue
        target = base_label(label) + " default timeout"
        for metric in ("detection_s", "recovery_s"):
            value = ok.get((label, metric))
            if value is None:
                continue
            note = (
                f"derived, not measured: measured with a {t:g} s timeout ({value:.1f} s), "
                f"detection is timeout-bound, so {value:.1f} - {t:g} + {default:g} s "
                f"({who})"
            )
            out.append(
                make_row(
                    system=target,
                    scenario=scenario.name,
                    metric=metric,
                    values=[value - t + default],
                    status="derived",
                    note=note,
                    host=host,
                )
            )
    return out


def skipped_rows(scenario: str, systems: Sequence[str], host: str, reason: str) -> list[Row]:
    """One ``skipped`` row per system, with the reason."""
    return [
        make_row(
            system=s, scenario=scenario, metric="trial", status="skipped", note=reason, host=host
        )
        for s in systems
    ]


def run_module(name: str, quick: bool, host: str) -> list[Row]:
    """Rows of a module scenario; a failure becomes one ``failed`` row."""
    try:
        rows = list(importlib.import_module(MODULES[name]).run(quick))
    except Exception as exc:  # report, never fatal
        return [
            make_row(
                system=name,
                scenario=name,
                metric="trial",
                status="failed",
                note=f"{type(exc).__name__}: {exc}",
                host=host,
            )
        ]
    defaults = {
        "machine": host,
        "status": "ok",
        "note": "",
        "scenario": name,
        "date": now_iso(),
        "unit": "",
    }
    checked: list[Row] = []
    for row in rows:
        row = {**defaults, **row}
        try:
            check_row(row)
        except ValueError as exc:
            row = make_row(
                system=str(row.get("system") or name),
                scenario=name,
                metric=str(row.get("metric") or "trial"),
                status="failed",
                note=f"bad row from {MODULES[name]}: {exc}",
                host=host,
            )
        checked.append(row)
    return checked


def run_suite(
    scenarios: Sequence[str],
    systems: Sequence[str],
    settings: Settings,
    results_dir: Path = RESULTS_DIR,
    on_trial: Callable[[str, int, dict[str, float] | str], None] | None = None,
) -> dict[str, list[Row]]:
    """Run ``scenarios`` for ``systems``; return scenario -> rows (not yet saved)."""
    host = machine()
    lookup = Lookup(results_dir)
    out: dict[str, list[Row]] = {}
    workroot = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
    for name in [n for n in ORDER if n in scenarios]:
        log.info("scenario %s", name)
        if name in MODULES:
            rows = run_module(name, settings.quick, host)
        else:
            scenario = training_scenario(name, settings)
            arms = arms_for(name, settings, systems)
            rows = run_training(scenario, arms, settings, workroot, host, on_trial)
            rows += derived_rows(scenario, rows, lookup, settings, host)
        lookup.rows += rows
        out[name] = rows
    if not any(workroot.rglob("*.log")):
        shutil.rmtree(workroot, ignore_errors=True)
    return out
