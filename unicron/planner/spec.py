"""The ``unicron plan`` input file: a cluster, its tasks and one event (YAML).

:func:`load_spec` reads and validates it by hand (no schema library) and raises
:class:`~unicron.errors.UsageError` with one line naming the field and the problem, which
the CLI turns into exit code 2. The result is plain frozen dataclasses that
:mod:`unicron.planner.command` turns into :class:`~unicron.planner.solver.TaskState` lists.
The format is documented in docs/planner.md; examples live in examples/plans/.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from unicron.errors import UsageError
from unicron.planner.hardware import GB, GIB, GPU_PRESETS, GPUSpec
from unicron.planner.model import MODEL_PRESETS, ModelSpec

CLUSTER_FIELDS = {
    "nodes": "number of nodes",
    "gpus_per_node": "GPUs per node",
    "gpu": "a preset name or a mapping",
    "failure_rate_per_node_per_day": "failures per node per day",
    "unit": "node or gpu",
    "restart_s": "seconds a restarted worker needs before its first step",
    "checkpoint_gbps": "GB/s read from the persistent checkpoint",
    "down": "node ids already out of service",
}
TASK_FIELDS = (
    "name",
    "model",
    "global_batch",
    "weight",
    "min_gpus",
    "nodes",
    "profile",
    "precision",
)
GPU_FIELDS = ("name", "peak_tflops", "memory_gb", "intra_node_gbps", "inter_node_gbps")
GPU_OPTIONAL = ("fp8_peak_tflops", "memory_bw_gbps", "efficiency")
MODEL_FIELDS = ("name", "layers", "hidden", "heads", "seq_len", "vocab")
MODEL_INTS = ("kv_heads", "ffn_hidden", "experts", "active_experts")
MODEL_BOOLS = ("gated", "bias", "tied_embeddings", "learned_positions")
EVENT_FIELDS = ("nodes_lost", "nodes_back", "task_added", "task_done")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    failure_rate_per_node_per_day: float
    unit: str
    """``"node"`` or ``"gpu"``: the solver's allocation unit."""
    restart_s: float
    checkpoint_bw: float
    """Bytes/s a task reads its checkpoint at when no peer holds its state."""
    down: tuple[int, ...]

    @property
    def unit_gpus(self) -> int:
        return self.gpus_per_node if self.unit == "node" else 1


@dataclass(frozen=True, kw_only=True, eq=False)
class TaskSpec:
    name: str
    model: ModelSpec
    global_batch: int
    weight: float
    min_gpus: int
    nodes: tuple[int, ...]
    """Nodes the task holds before the event (whole nodes)."""
    profile: tuple[np.ndarray, np.ndarray] | None
    """Measured (gpus, FLOP/s) points replacing the performance model, or None."""
    precision: str = "bf16"
    """``bf16`` or ``fp8`` (GEMMs in FP8 where the GPU has it)."""


@dataclass(frozen=True, kw_only=True)
class EventSpec:
    nodes_lost: tuple[int, ...] = ()
    nodes_back: tuple[int, ...] = ()
    task_added: TaskSpec | None = None
    task_done: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    cluster: ClusterSpec
    tasks: tuple[TaskSpec, ...]
    event: EventSpec


def _fail(where: str, problem: str) -> UsageError:
    return UsageError(f"{where}: {problem}")


def _mapping(value: Any, where: str, allowed: tuple[str, ...] | list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"must be a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise _fail(f"{where}.{key}" if where else str(key), "unknown field")
    return value


def _required(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise _fail(f"{where}.{key}" if where else key, "missing required field")
    return data[key]


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"must be an integer, got {value!r}")
    if value < minimum:
        raise _fail(where, f"must be >= {minimum}, got {value}")
    return value


def _float(value: Any, where: str, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(where, f"must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise _fail(where, f"must be {'>' if strict else '>='} {minimum:g}, got {value:g}")
    return float(value)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a non-empty string, got {value!r}")
    return value


def _node_list(value: Any, where: str, nodes: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail(where, f"must be a list of node ids, got {value!r}")
    ids = tuple(_int(v, f"{where}[{i}]", 0) for i, v in enumerate(value))
    for i, v in enumerate(ids):
        if v >= nodes:
            raise _fail(f"{where}[{i}]", f"node {v} does not exist (nodes 0..{nodes - 1})")
    if len(set(ids)) != len(ids):
        raise _fail(where, "lists a node twice")
    return ids


def _gpu(value: Any, where: str) -> GPUSpec:
    if isinstance(value, str):
        if value not in GPU_PRESETS:
            raise _fail(where, f"unknown GPU {value!r} (presets: {', '.join(GPU_PRESETS)})")
        return GPU_PRESETS[value]
    data = _mapping(value, where, GPU_FIELDS + GPU_OPTIONAL)
    for key in GPU_FIELDS:
        _required(data, key, where)
    extra: dict[str, float] = {}
    if "fp8_peak_tflops" in data:
        extra["fp8_peak_flops"] = (
            _float(data["fp8_peak_tflops"], f"{where}.fp8_peak_tflops", 0) * 1e12
        )
    if "memory_bw_gbps" in data:
        extra["memory_bw"] = _float(data["memory_bw_gbps"], f"{where}.memory_bw_gbps", 0, True) * GB
    if "efficiency" in data:
        eff = _float(data["efficiency"], f"{where}.efficiency", 0, strict=True)
        if eff > 1:
            raise _fail(f"{where}.efficiency", f"must be <= 1, got {eff:g}")
        extra["efficiency"] = eff
    return GPUSpec(
        name=_str(data["name"], f"{where}.name"),
        peak_flops=_float(data["peak_tflops"], f"{where}.peak_tflops", 0, strict=True) * 1e12,
        memory_bytes=_float(data["memory_gb"], f"{where}.memory_gb", 0, strict=True) * GIB,
        intra_node_bw=_float(data["intra_node_gbps"], f"{where}.intra_node_gbps", 0, True) * GB,
        inter_node_bw=_float(data["inter_node_gbps"], f"{where}.inter_node_gbps", 0, True) * GB,
        **extra,
    )


def _model(value: Any, where: str) -> ModelSpec:
    if isinstance(value, str):
        if value not in MODEL_PRESETS:
            raise _fail(where, f"unknown model {value!r} (presets: {', '.join(MODEL_PRESETS)})")
        return MODEL_PRESETS[value]
    data = _mapping(value, where, ("preset", *MODEL_FIELDS, *MODEL_INTS, *MODEL_BOOLS))
    fields: dict[str, Any] = {}
    if "preset" in data:  # a preset with some fields changed (e.g. seq_len: 131072)
        preset = data["preset"]
        if not isinstance(preset, str) or preset not in MODEL_PRESETS:
            known = ", ".join(MODEL_PRESETS)
            raise _fail(f"{where}.preset", f"unknown model {preset!r} (presets: {known})")
        fields = {
            f.name: getattr(MODEL_PRESETS[preset], f.name) for f in dataclasses.fields(ModelSpec)
        }
    else:
        for key in MODEL_FIELDS:
            _required(data, key, where)
    for key in MODEL_FIELDS[1:] + MODEL_INTS:
        if key in data:
            fields[key] = _int(data[key], f"{where}.{key}", 1)
    for key in MODEL_BOOLS:
        if key in data:
            if not isinstance(data[key], bool):
                raise _fail(f"{where}.{key}", f"must be true or false, got {data[key]!r}")
            fields[key] = data[key]
    if "name" in data:
        fields["name"] = _str(data["name"], f"{where}.name")
    try:
        return ModelSpec(**fields)
    except ValueError as exc:  # inconsistent fields: ModelSpec names the field first
        raise UsageError(f"{where}.{exc}") from exc


def _profile(value: Any, where: str, base: Path) -> tuple[np.ndarray, np.ndarray]:
    path = base / _str(value, where)
    try:
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise _fail(where, f"cannot read {path}: {exc.strerror}") from exc
    if not rows or [c.strip() for c in rows[0]] != ["gpus", "flops"]:
        raise _fail(where, f"{path}: first line must be the header 'gpus,flops'")
    gpus: list[int] = []
    flops: list[float] = []
    for i, row in enumerate(rows[1:], start=2):
        try:
            g, f_ = int(row[0]), float(row[1])
        except (ValueError, IndexError) as exc:
            raise _fail(where, f"{path} line {i}: expected 'gpus,flops', got {row!r}") from exc
        if g <= 0 or not (math.isfinite(f_) and f_ >= 0):
            raise _fail(where, f"{path} line {i}: gpus must be > 0 and flops >= 0")
        gpus.append(g)
        flops.append(f_)
    if not gpus or len(set(gpus)) != len(gpus):
        raise _fail(where, f"{path}: needs at least one row and no GPU count twice")
    order = np.argsort(gpus)
    return np.asarray(gpus, dtype=np.float64)[order], np.asarray(flops)[order]


def _task(value: Any, where: str, cluster: ClusterSpec, base: Path) -> TaskSpec:
    data = _mapping(value, where, TASK_FIELDS)
    total_gpus = cluster.nodes * cluster.gpus_per_node
    min_gpus = _int(data.get("min_gpus", 0), f"{where}.min_gpus", 0)
    if min_gpus > total_gpus:
        raise _fail(
            f"{where}.min_gpus", f"{min_gpus} is larger than the cluster ({total_gpus} GPUs)"
        )
    precision = data.get("precision", "bf16")
    if precision not in ("bf16", "fp8"):
        raise _fail(f"{where}.precision", f"must be 'bf16' or 'fp8', got {precision!r}")
    if precision == "fp8" and cluster.gpu.fp8_peak_flops <= 0:
        raise _fail(f"{where}.precision", f"fp8 needs a GPU with FP8 ({cluster.gpu.name} has none)")
    return TaskSpec(
        precision=precision,
        name=_str(_required(data, "name", where), f"{where}.name"),
        model=_model(_required(data, "model", where), f"{where}.model"),
        global_batch=_int(_required(data, "global_batch", where), f"{where}.global_batch", 1),
        weight=_float(data.get("weight", 1.0), f"{where}.weight", 0),
        min_gpus=min_gpus,
        nodes=_node_list(data.get("nodes", []), f"{where}.nodes", cluster.nodes),
        profile=_profile(data["profile"], f"{where}.profile", base) if "profile" in data else None,
    )


def _cluster(value: Any) -> ClusterSpec:
    data = _mapping(value, "cluster", list(CLUSTER_FIELDS))
    nodes = _int(_required(data, "nodes", "cluster"), "cluster.nodes", 1)
    unit = data.get("unit", "node")
    if unit not in ("node", "gpu"):
        raise _fail("cluster.unit", f"must be 'node' or 'gpu', got {unit!r}")
    return ClusterSpec(
        nodes=nodes,
        gpus_per_node=_int(data.get("gpus_per_node", 8), "cluster.gpus_per_node", 1),
        gpu=_gpu(data.get("gpu", "A100-80GB"), "cluster.gpu"),
        failure_rate_per_node_per_day=_float(
            data.get("failure_rate_per_node_per_day", 0.01),
            "cluster.failure_rate_per_node_per_day",
            0,
        ),
        unit=unit,
        restart_s=_float(data.get("restart_s", 30.0), "cluster.restart_s", 0),
        checkpoint_bw=_float(data.get("checkpoint_gbps", 2.0), "cluster.checkpoint_gbps", 0, True)
        * GB,
        down=_node_list(data.get("down", []), "cluster.down", nodes),
    )


def _event(value: Any, cluster: ClusterSpec, base: Path, tasks: list[TaskSpec]) -> EventSpec:
    if value is None:
        return EventSpec()
    data = _mapping(value, "event", EVENT_FIELDS)
    lost = _node_list(data.get("nodes_lost", []), "event.nodes_lost", cluster.nodes)
    back = _node_list(data.get("nodes_back", []), "event.nodes_back", cluster.nodes)
    for i, n in enumerate(lost):
        if n in cluster.down:
            raise _fail(f"event.nodes_lost[{i}]", f"node {n} is already down")
    for i, n in enumerate(back):
        if n not in cluster.down:
            raise _fail(f"event.nodes_back[{i}]", f"node {n} is not down (see cluster.down)")
    added = None
    if "task_added" in data:
        added = _task(data["task_added"], "event.task_added", cluster, base)
        if added.nodes:
            raise _fail("event.task_added.nodes", "a new task holds no nodes yet")
        if added.name in {t.name for t in tasks}:
            raise _fail("event.task_added.name", f"task {added.name!r} already exists")
    done = None
    if "task_done" in data:
        done = _str(data["task_done"], "event.task_done")
        if done not in {t.name for t in tasks}:
            raise _fail("event.task_done", f"no task named {done!r}")
    return EventSpec(nodes_lost=lost, nodes_back=back, task_added=added, task_done=done)


def parse_spec(data: Any, base: Path) -> PlanSpec:
    """Validate a parsed YAML document; ``base`` resolves relative profile paths."""
    doc = _mapping(data, "", ("cluster", "tasks", "event"))
    cluster = _cluster(_required(doc, "cluster", ""))
    raw_tasks = doc.get("tasks", [])
    if not isinstance(raw_tasks, list):
        raise _fail("tasks", "must be a list")
    tasks = [_task(t, f"tasks[{i}]", cluster, base) for i, t in enumerate(raw_tasks)]
    seen: dict[int, str] = {}
    names: set[str] = set()
    for i, t in enumerate(tasks):
        if t.name in names:
            raise _fail(f"tasks[{i}].name", f"task {t.name!r} appears twice")
        names.add(t.name)
        for n in t.nodes:
            if n in cluster.down:
                raise _fail(f"tasks[{i}].nodes", f"node {n} is down (cluster.down)")
            if n in seen:
                raise _fail(f"tasks[{i}].nodes", f"node {n} is also held by task {seen[n]!r}")
            seen[n] = t.name
    event = _event(doc.get("event"), cluster, base, tasks)
    return PlanSpec(cluster=cluster, tasks=tuple(tasks), event=event)


def load_spec(path: Path) -> PlanSpec:
    """Read and validate a plan spec file; every problem is a one-line UsageError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}{where}: not valid YAML") from exc
    return parse_spec(data, path.parent)


__all__ = ["ClusterSpec", "EventSpec", "PlanSpec", "TaskSpec", "load_spec", "parse_spec"]
