"""The benchmark suite: which scenarios exist, which arms run in each, and how they are run.

Training scenarios run every arm in turn, repetition after repetition (A B C A B C ...), so a
slow phase of a shared machine hits every system alike; the figures of an arm are the
median, min and max over its repetitions. The ``error`` scenario is one run per error kind
(``settings.error_kinds``), its cells (kind, arm) taking turns the same way, and its figures
are named per kind (``detection_s[cuda]``). The ``soak`` scenario is a long fault-free Unicron
run that counts false alarms. A trial that fails is reported as a ``failed`` row
with its error and the arm is not run again in that scenario; the other arms go on. Module
scenarios (``floor``, ``reduce``, ``checkpoint``, and ``planner`` / ``simulator`` where those
modules exist) return their own rows from ``run(quick)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import (
    RESULTS_DIR,
    Row,
    check_row,
    code_version,
    kind_metric,
    load_rows,
    machine,
    make_row,
    now_iso,
)
from bench.systems.base import Arm, Scenario, Settings, TrialError
from bench.systems.ddp import DdpArm
from bench.systems.torchft import DEFAULT_TIMEOUT_S, TorchftArm
from bench.systems.torchrun import GLOO_DEFAULT_TIMEOUT_S, TorchrunArm, TorchrunNodeArm
from bench.systems.unicron import UnicronArm
from unicron.detect.classify import verdict_for_kind

log = logging.getLogger("bench")

SYSTEMS = ("unicron", "torchrun", "torchft", "ddp")
TRAINING = ("steady", "crash", "error", "hang", "node", "soak")
MODULES = {
    "floor": "bench.floor",
    "reduce": "bench.reduce",
    "scale": "bench.scale",
    "llama": "bench.llama",
    "tp": "bench.tp",
    "pipeline": "bench.pipeline",
    "relayout": "bench.relayout",
    "zero": "bench.zero",
    "store": "bench.store",
    "startup": "bench.startup",
    "transfer": "bench.transfer",
    "checkpoint": "bench.checkpoint",
    "planner": "bench.planner",
    "simulator": "bench.simulator",
    "cluster-kill": "bench.cluster.kill",
    "cluster-load": "bench.cluster.load",
    "cluster-node": "bench.cluster.node",
    "cluster-standby": "bench.standby",
}
CLUSTER = ("cluster-kill", "cluster-load", "cluster-node", "cluster-standby")
ORDER = (
    "floor", *TRAINING, "reduce", "scale", "llama", "tp", "pipeline", "relayout", "zero", "store",
    "startup", "transfer", "checkpoint", "planner", "simulator", *CLUSTER,
)  # fmt: skip
ALONE = frozenset(
    {"scale", "llama", "tp", "pipeline", "relayout", "zero", "transfer", "checkpoint", *CLUSTER}
)
"""scenarios run only when named (``--scenario``): they are long (a 100M-parameter model, a
1 GB state, a Hugging Face model and torchrun, a 10-minute soak of the cluster service), and
the whole suite keeps to its hour; the cluster's also run as ``python -m bench.cluster``"""
SHOWN = {  # metrics reported per scenario, in this order (the default: faulted scenarios)
    "steady": ("wall_s", "step_time_s", "false_alarms"),
    "soak": ("wall_s", "false_alarms", "epochs", "step_time_s", "step_time_p99_s"),
    "error": ("wall_s", "detection_s", "recovery_s", "epochs", "steps_redone"),
    None: ("wall_s", "detection_s", "detection_heartbeat_s", "recovery_s", "steps_redone"),
}
ERROR_DETECTION_TARGET_S = 0.5
"""Issue 3's target for a crash or a raised error: detected within 0.5 s."""
SOAK_STEP_S = 0.1
"""Step time assumed for the soak's step count when no steady-state step time is saved."""
NO_DETECTOR = "torchrun, torchft, plain DDP: no detector, 0 by construction (not run)"


def shown(scenario: str) -> tuple[str, ...]:
    """The figures of ``scenario`` that become rows (the others only show progress)."""
    return SHOWN.get(scenario, SHOWN[None])


def known_scenarios() -> list[str]:
    """Training scenarios, the floor, and the module scenarios whose module exists."""
    found = [n for n, m in MODULES.items() if importlib.util.find_spec(m) is not None]
    return [n for n in ORDER if n in TRAINING or n in found]


def soak_steps(settings: Settings, step_time_s: float | None) -> int:
    """Steps of the soak: ``settings.soak_s`` at ``step_time_s`` (:data:`SOAK_STEP_S` if none)."""
    step = step_time_s if step_time_s and step_time_s > 0 else SOAK_STEP_S
    return max(settings.steps, round(settings.soak_s / step))


def training_scenario(
    name: str, settings: Settings, kind: str | None = None, step_time_s: float | None = None
) -> Scenario:
    """The faults of training scenario ``name``, at ``settings.fault_step`` on one rank.

    ``kind``: the error kind of the ``error`` scenario (default ``settings.error_kind``);
    ``step_time_s``: the steady-state step time the ``soak`` scenario sizes its run by.
    """
    at = f"rank={settings.fault_rank},step={settings.fault_step}"
    kind = kind or settings.error_kind
    verdict = verdict_for_kind(kind)
    soak = soak_steps(settings, step_time_s)
    table = {
        "steady": Scenario(name="steady", description="no fault: steady-state step time"),
        "crash": Scenario(
            name="crash", description="a worker SIGKILLed mid-step", faults=(f"crash:{at}",)
        ),
        "error": Scenario(
            name="error",
            description=(
                f"a worker raises a {kind} error "
                f"(Unicron's table: SEV{int(verdict.severity)} {verdict.action})"
            ),
            faults=(f"error:{at},kind={kind}",),
            kind=kind,
        ),
        "soak": Scenario(
            name="soak",
            description=(
                f"no fault, {soak} steps (~{settings.soak_s:g} s at "
                f"{(step_time_s or SOAK_STEP_S) * 1e3:.0f} ms a step): false alarms"
            ),
            steps=soak,
            timeout_s=3 * settings.soak_s + 120.0,
            reps=1,
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


def arms_for(
    scenario: str, settings: Settings, systems: Sequence[str], kind: str | None = None
) -> list[Arm]:
    """The arms of ``scenario`` among ``systems``, in the order they take turns.

    In the ``error`` scenario every kind runs Unicron, and the kinds of
    ``settings.torchrun_error_kinds`` (one per severity) torchrun with a 60 s process-group
    timeout (``settings.error_pg_timeout_s``); the default kind (``settings.error_kind``, or
    ``kind`` None) also runs torchrun with gloo's default timeout (and every K) and torchft.
    The ``soak`` is Unicron's alone: the baselines have no detector to raise a false alarm.
    """
    arms: list[Arm] = []
    k_all = settings.ckpt_every
    kind = kind or settings.error_kind
    # the extra arms of the error scenario (gloo's default timeout, every K, torchft) only run
    # in the full suite: the quick one must stay under 10 minutes
    every_arm = scenario != "error" or (kind == settings.error_kind and not settings.quick)
    if "unicron" in systems:
        arms.append(UnicronArm())
    if scenario == "soak":
        return arms
    if "ddp" in systems and scenario == "steady":
        arms.append(DdpArm())
    if "torchrun" in systems:
        if scenario == "node":  # two agents, default (full suite only) and tuned rendezvous
            tunings = (True,) if settings.quick else (False, True)
            arms += [TorchrunNodeArm(ckpt_every=k_all[0], tuned=t) for t in tunings]
        elif scenario == "hang":
            arms.append(TorchrunArm(ckpt_every=k_all[0], pg_timeout_s=settings.hang_timeout_s))
        elif scenario == "error":
            if kind in settings.torchrun_error_kinds:
                timeout = settings.error_pg_timeout_s
                arms.append(TorchrunArm(ckpt_every=k_all[0], pg_timeout_s=timeout))
            if every_arm:
                arms += [TorchrunArm(ckpt_every=k) for k in k_all]
        else:
            arms += [TorchrunArm(ckpt_every=k) for k in k_all]
    if "torchft" in systems and every_arm:
        timeout = settings.hang_timeout_s if scenario == "hang" else DEFAULT_TIMEOUT_S
        arms.append(TorchftArm(timeout_s=timeout))
    return arms


def cells_for(
    name: str, settings: Settings, systems: Sequence[str], lookup: Lookup
) -> list[tuple[Scenario, Arm]]:
    """The (scenario, arm) trials of training scenario ``name``, in the order they take turns:
    one scenario per error kind in ``error``, the soak sized by the saved step time."""
    if name == "error":
        return [
            (training_scenario(name, settings, kind=kind), arm)
            for kind in settings.error_kinds
            for arm in arms_for(name, settings, systems, kind)
        ]
    step = lookup.median("unicron", "steady", "step_time_s") if name == "soak" else None
    scenario = training_scenario(name, settings, step_time_s=step)
    return [(scenario, arm) for arm in arms_for(name, settings, systems)]


def base_label(label: str) -> str:
    """The fault-free twin of an arm (``torchrun K=10 timeout=60s`` -> ``torchrun K=10``)."""
    return label.split(" timeout=")[0]


class Lookup:
    """Medians measured in this invocation, else the latest saved ones."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir
        self.rows: list[Row] = []

    def median(
        self, system: str, scenario: str, metric: str, *, this_run: bool = False
    ) -> float | None:
        """The median of (system, scenario, metric), or ``None`` if there is no ok row;
        ``this_run``: only from this invocation (a figure that depends on the settings)."""
        saved = [] if this_run else load_rows(self.results_dir / f"{scenario}.json")
        for source in (self.rows, saved):
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
    return run_cells([(scenario, a) for a in arms], settings, workroot, host, on_trial)


def run_cells(
    cells: Sequence[tuple[Scenario, Arm]],
    settings: Settings,
    workroot: Path,
    host: str,
    on_trial: Callable[[str, int, dict[str, float] | str], None] | None = None,
) -> list[Row]:
    """Run the (scenario, arm) cells in turn for ``settings.reps`` repetitions; their rows.

    The cells of one call share a scenario name and differ at most in the error kind; a
    cell that fails is reported as a ``failed`` row (``trial[kind]``) and not run again.
    """
    trials: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(cells))}
    failed: dict[int, str] = {}
    reps = max((scenario.run_reps(settings) for scenario, _ in cells), default=0)
    for rep in range(reps):
        for i, (scenario, arm) in enumerate(cells):
            if i in failed or rep >= scenario.run_reps(settings):
                continue
            name = arm.label + (f" [{scenario.kind}]" if scenario.kind else "")
            folder = arm.label.replace(" ", "_") + (f"-{scenario.kind}" if scenario.kind else "")
            workdir = workroot / scenario.name / folder / f"rep{rep}"
            workdir.mkdir(parents=True, exist_ok=True)
            try:
                metrics = arm.run(scenario, settings, workdir)
            except Exception as exc:  # any failure of a system is reported, never fatal
                reason = str(exc) if isinstance(exc, TrialError) else repr(exc)
                if not isinstance(exc, TrialError):
                    log.debug("%s", traceback.format_exc())
                failed[i] = (
                    f"rep {rep + 1}/{scenario.run_reps(settings)}: {reason} (logs: {workdir})"
                )
                if on_trial:
                    on_trial(name, rep, failed[i])
                continue
            shutil.rmtree(workdir, ignore_errors=True)
            trials[i].append(metrics)
            if on_trial:
                on_trial(name, rep, metrics)
    rows: list[Row] = []
    for i, (scenario, arm) in enumerate(cells):
        if i in failed:
            rows.append(
                make_row(
                    system=arm.label,
                    scenario=scenario.name,
                    metric=scenario.metric("trial"),
                    status="failed",
                    note=failed[i],
                    host=host,
                )
            )
        samples: dict[str, list[float]] = {}
        for metrics in trials[i]:
            for metric, value in metrics.items():
                samples.setdefault(metric, []).append(value)
        for metric in shown(scenario.name):
            values = samples.get(metric)
            if not values:
                continue
            rows.append(
                make_row(
                    system=arm.label,
                    scenario=scenario.name,
                    metric=scenario.metric(metric),
                    values=values,
                    host=host,
                    note=row_note(scenario, arm, metric, values, trials[i], settings),
                )
            )
    return rows


def _counts(trials: Sequence[dict[str, float]], prefix: str) -> str:
    """What the ``prefix`` counts (``action:``) of the trials say: ``restart x1 (2/2 reps)``."""
    per_rep = [
        ", ".join(
            f"{key.removeprefix(prefix)} x{value:g}"
            for key, value in sorted(t.items())
            if key.startswith(prefix)
        )
        or "none"
        for t in trials
    ]
    if not per_rep:
        return "none"
    if len(set(per_rep)) == 1:
        return f"{per_rep[0]} ({len(per_rep)}/{len(per_rep)} reps)"
    return "per rep: " + "; ".join(per_rep)


def row_note(
    scenario: Scenario,
    arm: Arm,
    metric: str,
    values: Sequence[float],
    trials: Sequence[dict[str, float]],
    settings: Settings,
) -> str:
    """The note of one measured row: what ran, and for the error kinds and the soak what the
    figure means (the target, what Unicron did, why torchrun's timeout does not enter)."""
    if metric == "wall_s":
        note = scenario.description
        if scenario.faults:
            note += f" ({', '.join(scenario.faults)}; {scenario.run_steps(settings)} steps)"
        return note
    timeout = getattr(arm, "pg_timeout_s", None)
    if scenario.name == "error" and metric == "detection_s":
        target = ERROR_DETECTION_TARGET_S
        met = "met" if max(values) < target else "NOT met"
        note = f"target < {target:g} s: {met} (max {max(values):.3g} s)"
        if timeout is not None:
            default = " (gloo's default)" if timeout == GLOO_DEFAULT_TIMEOUT_S else ""
            note += (
                f"; process-group timeout {timeout:g} s{default}: the raising worker exits and "
                "the agent sees the exit, so the timeout does not enter"
            )
        return note
    if scenario.name == "error" and metric == "epochs":
        if arm.system == "unicron":
            assert scenario.kind is not None
            verdict = verdict_for_kind(scenario.kind)
            return (
                f"actions: {_counts(trials, 'action:')}; table: SEV{int(verdict.severity)} "
                f"{verdict.action}"
            )
        if arm.system == "torchrun":
            return "one per attempt: the agent restarts the whole group"
        return ""
    if scenario.name == "soak" and metric == "false_alarms":
        return f"error_detected with no fault, by kind: {_counts(trials, 'alarm:')}; {NO_DETECTOR}"
    if scenario.name == "soak" and metric == "epochs":
        return f"1 means no restart; actions: {_counts(trials, 'action:')}"
    return ""


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
    if not scenario.faults and scenario.name != "steady":
        return out
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
    # per error kind only the default one: its arms are the ones every scenario compares
    kind = settings.error_kind if scenario.name == "error" else None
    for label in labels:
        wall = ok.get((label, kind_metric("wall_s", kind)))
        # the fault-free wall of the same steps: only a steady run of this invocation has them
        steady = lookup.median(base_label(label), "steady", "wall_s", this_run=True)
        # no fault cost for a node loss: its fault-free twin (two agents) is not measured, and
        # the survivors train the rest on half the workers
        if wall is not None and steady is not None and scenario.name != "node":
            add(
                label,
                kind_metric("fault_cost_s", kind),
                wall - steady,
                f"median wall with the fault - median fault-free wall ({base_label(label)})",
            )
        recovery = ok.get((label, kind_metric("recovery_s", kind)))
        if floor and recovery is not None:
            add(
                label,
                kind_metric("recovery_over_floor", kind),
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
        "commit": code_version(),
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
    on_scenario: Callable[[str, list[Row], float], None] | None = None,
) -> dict[str, list[Row]]:
    """Run ``scenarios`` for ``systems``; return scenario -> rows.

    ``on_scenario(name, rows, seconds)`` is called as each scenario ends (``python -m bench``
    saves its rows then, so an interrupted suite keeps what it finished).
    """
    host = machine()
    lookup = Lookup(results_dir)
    out: dict[str, list[Row]] = {}
    workroot = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
    for name in [n for n in ORDER if n in scenarios]:
        log.info("scenario %s", name)
        began = time.monotonic()
        if name in MODULES:
            rows = run_module(name, settings.quick, host)
        else:
            cells = cells_for(name, settings, systems, lookup)
            rows = run_cells(cells, settings, workroot, host, on_trial)
            scenario = cells[0][0] if cells else training_scenario(name, settings)
            rows += derived_rows(scenario, rows, lookup, settings, host)
        lookup.rows += rows
        out[name] = rows
        if on_scenario:
            on_scenario(name, rows, time.monotonic() - began)
    if not any(workroot.rglob("*.log")):
        shutil.rmtree(workroot, ignore_errors=True)
    return out
