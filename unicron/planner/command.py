"""``unicron plan SPEC.yaml [--json] [--layouts N]``: the planner alone (DESIGN.md, commands).

:mod:`unicron.cli` calls :func:`add_arguments` then :func:`main`. The command loads the
spec (:mod:`unicron.planner.spec`), applies the event to the cluster, builds one
:class:`~unicron.planner.solver.TaskState` per task, calls
:func:`~unicron.planner.solver.solve` and prints a table (or ``--json``). Bad input raises
:class:`~unicron.errors.UsageError` (exit 2). No torch import.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from unicron.errors import UsageError
from unicron.planner.hardware import GIB
from unicron.planner.perf import (
    DEFAULT_OPTIONS,
    ParallelConfig,
    PerfOptions,
    best_config,
    fitting_layouts,
    throughput_table,
)
from unicron.planner.solver import (
    TaskState,
    expected_time_to_failure_s,
    solve,
    transition_time_s,
)
from unicron.planner.spec import PlanSpec, TaskSpec, load_spec


@dataclass(frozen=True, kw_only=True)
class Row:
    """One task's line of the report."""

    name: str
    gpus_before: int
    gpus: int
    tp: int | None
    pp: int | None
    dp: int | None
    micro_batch: int | None
    layout: str | None
    """The whole layout (:meth:`~unicron.planner.perf.ParallelConfig.describe`), or None."""
    memory_gib: float | None
    """Estimated peak memory per GPU of that layout, GiB."""
    achieved_flops: float
    waf: float
    reason: str
    fitting: tuple[ParallelConfig, ...] = ()
    """With ``--layouts N``: the N fastest layouts that fit on these GPUs (fastest first)."""

    @property
    def tflops_per_gpu(self) -> float:
        return self.achieved_flops / self.gpus / 1e12 if self.gpus else 0.0


@dataclass(frozen=True, kw_only=True)
class Report:
    rows: tuple[Row, ...]
    total_waf: float
    d_run_s: float
    units_available: int
    unit_gpus: int


def _options(task: TaskSpec) -> PerfOptions:
    if task.precision == DEFAULT_OPTIONS.precision:
        return DEFAULT_OPTIONS
    return PerfOptions(precision=task.precision)


def _too_small(spec: PlanSpec, task: TaskSpec, where: str, gpus: int) -> UsageError:
    """The one-line error for a task that fits in no layout: the shortfall in GPUs."""
    c = spec.cluster
    usable = c.gpu.memory_bytes * DEFAULT_OPTIONS.memory_usable_fraction
    state = 18.0 * task.model.params  # bf16 weights, fp32 gradients, Adam, fully sharded
    need = math.ceil(state / usable)
    what = (
        f"{task.model.name} ({task.model.params / 1e9:.1f}B parameters, "
        f"global_batch {task.global_batch})"
    )
    if need > gpus:
        return UsageError(
            f"{where}.model: {what} needs at least {need} {c.gpu.name} GPUs for its weights, "
            f"gradients and optimizer state ({state / GIB:,.0f} GiB at 18 bytes per parameter, "
            f"{usable / GIB:.0f} GiB usable per GPU); the cluster has {gpus}"
        )
    return UsageError(
        f"{where}.model: {what} fits in no parallel configuration on up to {gpus} "
        f"{c.gpu.name} GPUs (activations of one micro-batch of {task.model.seq_len} tokens "
        "do not fit beside the state); add GPUs or lower seq_len"
    )


def _flops_table(spec: PlanSpec, task: TaskSpec, where: str, units: int) -> np.ndarray:
    c = spec.cluster
    g = c.unit_gpus
    if task.profile is not None:
        gpus, flops = task.profile
        wanted = np.arange(units + 1, dtype=np.float64) * g
        table = np.interp(wanted, gpus, flops, left=0.0, right=float(flops[-1]))
        table[0] = 0.0
        return table
    table = throughput_table(
        task.model, task.global_batch, units * g, c.gpu, c.gpus_per_node, g, _options(task)
    )
    if units > 0 and not np.any(table[1:] > 0):
        raise _too_small(spec, task, where, units * g)
    return table


def build_report(spec: PlanSpec, layouts: int = 0) -> Report:
    """Apply the event, solve, and describe every task. Pure apart from nothing: no I/O.
    ``layouts``: also list each task's that many fastest fitting layouts on its GPUs."""
    c, ev = spec.cluster, spec.event
    down = (set(c.down) | set(ev.nodes_lost)) - set(ev.nodes_back)
    up_nodes = c.nodes - len(down)
    units = up_nodes * (1 if c.unit == "node" else c.gpus_per_node)
    g = c.unit_gpus
    tasks = [t for t in spec.tasks if t.name != ev.task_done]
    wheres = [f"tasks[{i}]" for i, t in enumerate(spec.tasks) if t.name != ev.task_done]
    if ev.task_added is not None:
        tasks.append(ev.task_added)
        wheres.append("event.task_added")
    d_run = expected_time_to_failure_s(c.failure_rate_per_node_per_day, max(up_nodes, 1))
    states: list[TaskState] = []
    lost_by_task: dict[str, list[int]] = {}
    for task, where in zip(tasks, wheres, strict=True):
        lost = [n for n in task.nodes if n in ev.nodes_lost]
        survivors = len(task.nodes) - len(lost)
        current = survivors * c.gpus_per_node // g
        if lost:
            lost_by_task[task.name] = lost
        # nearest source: a surviving peer (a node's NICs) or else the checkpoint
        bw = c.gpu.inter_node_bw * c.gpus_per_node if survivors else c.checkpoint_bw
        states.append(
            TaskState(
                name=task.name,
                weight=task.weight,
                min_units=math.ceil(task.min_gpus / g),
                current_units=current,
                flops=_flops_table(spec, task, where, units),
                transition_s=transition_time_s(task.model, bw, c.restart_s),
                must_transition=bool(lost),
            )
        )
    plan = solve(states, units, d_run)
    rows = []
    for task, state in zip(tasks, states, strict=True):
        u = plan.allocation[task.name]
        gpus = u * g
        cfg = None
        if task.profile is None and gpus:
            cfg = best_config(
                task.model, task.global_batch, gpus, c.gpu, c.gpus_per_node, _options(task)
            )
        flops = float(state.flops[u]) if u >= state.min_units else 0.0
        reason = plan.reasons[task.name]
        if task.name in lost_by_task:
            ids = lost_by_task[task.name]
            reason = f"lost node{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}; {reason}"
        if ev.task_added is not None and task.name == ev.task_added.name:
            reason = f"new task; {reason}"
        if cfg is not None and cfg.note:
            reason = f"{reason}; layout chosen for {cfg.note}"
        fitting: tuple[ParallelConfig, ...] = ()
        if layouts and cfg is not None:
            fitting = tuple(
                fitting_layouts(
                    task.model, task.global_batch, gpus, c.gpu, c.gpus_per_node, _options(task)
                )[:layouts]
            )
        rows.append(
            Row(
                name=task.name,
                gpus_before=len(task.nodes) * c.gpus_per_node,
                gpus=gpus,
                tp=cfg.tp if cfg else None,
                pp=cfg.pp if cfg else None,
                dp=cfg.dp if cfg else None,
                micro_batch=cfg.micro_batch if cfg else None,
                layout=cfg.describe() if cfg else None,
                memory_gib=cfg.memory_bytes_per_gpu / GIB if cfg else None,
                achieved_flops=flops,
                waf=task.weight * flops,
                reason=reason,
                fitting=fitting,
            )
        )
    return Report(
        rows=tuple(rows),
        total_waf=plan.total_waf,
        d_run_s=d_run,
        units_available=units,
        unit_gpus=g,
    )


def report_json(report: Report) -> dict[str, Any]:
    """The ``--json`` object: ``tasks`` (one object per task) and ``total_waf`` (FLOP/s)."""
    return {
        "tasks": [
            {
                "name": r.name,
                "gpus_before": r.gpus_before,
                "gpus": r.gpus,
                "tp": r.tp,
                "pp": r.pp,
                "dp": r.dp,
                "micro_batch": r.micro_batch,
                "layout": r.layout,
                "memory_gib": None if r.memory_gib is None else round(r.memory_gib, 1),
                "tflops_per_gpu": round(r.tflops_per_gpu, 3),
                "achieved_flops": r.achieved_flops,
                "waf": r.waf,
                "reason": r.reason,
                "layouts": [_fitting_json(f, r.gpus) for f in r.fitting],
            }
            for r in report.rows
        ],
        "total_waf": report.total_waf,
        "units_available": report.units_available,
        "unit_gpus": report.unit_gpus,
        "d_run_s": None if math.isinf(report.d_run_s) else report.d_run_s,
    }


def _fitting_json(cfg: ParallelConfig, gpus: int) -> dict[str, Any]:
    return {
        "layout": cfg.describe(),
        "memory_gib": round(cfg.memory_bytes_per_gpu / GIB, 1),
        "tflops_per_gpu": round(cfg.achieved_flops / gpus / 1e12, 3),
    }


def _print_table(report: Report) -> None:
    from rich.console import Console
    from rich.markup import escape  # task names and reasons come from the user's file
    from rich.table import Table

    d_run = "inf" if math.isinf(report.d_run_s) else f"{report.d_run_s / 3600:.3g} h"
    table = Table(
        title=f"plan: {report.units_available} units of {report.unit_gpus} GPU(s), D_run {d_run}"
    )
    for col in ("task", "GPUs", "layout", "GiB/GPU", "TFLOP/s/GPU", "PFLOP/s", "WAF (PFLOP/s)"):
        table.add_column(col, justify="left" if col == "task" else "right")
    table.add_column("reason")
    for r in report.rows:
        table.add_row(
            escape(r.name),
            f"{r.gpus_before} -> {r.gpus}",
            r.layout or "-",
            "-" if r.memory_gib is None else f"{r.memory_gib:.0f}",
            f"{r.tflops_per_gpu:.1f}",
            f"{r.achieved_flops / 1e15:.2f}",
            f"{r.waf / 1e15:.2f}",
            escape(r.reason),
        )
    table.add_section()
    table.add_row("total", "", "", "", "", "", f"{report.total_waf / 1e15:.2f}", "")
    console = Console(width=200)
    console.print(table)
    for r in report.rows:
        if not r.fitting:
            continue
        sub = Table(
            title=f"{r.name}: the {len(r.fitting)} fastest layouts that fit on {r.gpus} GPUs"
        )
        for col in ("#", "layout", "GiB/GPU", "TFLOP/s/GPU"):
            sub.add_column(col, justify="left" if col == "layout" else "right")
        for i, f in enumerate(r.fitting, 1):
            row = _fitting_json(f, r.gpus)
            sub.add_row(
                str(i), row["layout"], f"{row['memory_gib']:.0f}", f"{row['tflops_per_gpu']:.1f}"
            )
        console.print(sub)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Called by :mod:`unicron.cli` to declare the command's arguments."""
    parser.add_argument("spec", type=Path, metavar="SPEC.yaml", help="cluster, tasks and event")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--layouts",
        type=_count,
        default=0,
        metavar="N",
        help="also list each task's N fastest layouts that fit in memory on its GPUs",
    )


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def main(args: argparse.Namespace) -> int:
    """Called by :mod:`unicron.cli`; returns the exit code."""
    report = build_report(load_spec(args.spec), layouts=args.layouts)
    if args.json:
        print(json.dumps(report_json(report), indent=2))
    else:
        _print_table(report)
    return 0
