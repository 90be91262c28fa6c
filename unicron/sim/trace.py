"""Failure traces for the simulator: parse the shared CSV format, or generate one.

A trace is a time-ordered list of :class:`TraceEvent` on named nodes. Two sources:

* :func:`load_csv` reads ``milliseconds,add|remove,node`` lines (the format of the public
  spot-instance traces in ``../shared/data/traces/``, from the Oobleck SOSP'23 artifact,
  originally collected for Bamboo NSDI'23). ``remove`` means the node is gone (it is
  classified as the ``heartbeat_lost`` detector, SEV1); ``add`` means it is (back) in the
  cluster. A malformed line, an unknown action, a time going backwards or a ``remove`` of
  a node not in the cluster raises :class:`~unicron.errors.UsageError` naming the file and
  the line number. Spot traces name every replacement instance anew; the engine treats the
  trace's nodes as a pool (see :class:`unicron.sim.engine.Simulation`).
* :func:`generate` draws failures from a per-node rate (Poisson, seeded) with a mix of
  causes taken from a published report (:data:`LLAMA3_CAUSES`). Each cause is mapped to a
  classifier input (an error kind or a detector name); :func:`unicron.detect.classify` turns it
  into a severity at simulation time, the same table the runtime uses. SEV1 causes remove
  the node for a repair time and add it back.

Called by :mod:`unicron.sim.command` and the tests; :mod:`unicron.sim.engine` consumes the
events. Pure and deterministic: the same arguments give the same trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unicron.detect import classify  # the runtime's table: a kind's severity is the same
from unicron.errors import UsageError

Action = Literal["add", "remove", "fault"]

DETECTORS = frozenset({"hang", "straggler", "heartbeat_lost"})
"""Classifier inputs that are detector names (``classify_detector``); the rest are kinds."""


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One node event. ``signal`` is what the classifier is asked about."""

    time_s: float
    """Seconds since the start of the trace."""
    action: Action
    """``add``: node joins; ``remove``: node lost; ``fault``: an error on the node, which stays."""
    node: str
    """Node name as the trace spells it."""
    signal: str = ""
    """Classifier input for ``remove``/``fault``: a kind (``cuda``) or a detector (``hang``)."""
    cause: str = ""
    """Human label of the root cause (``GPU HBM3 memory``), for reports only."""


@dataclass(frozen=True, kw_only=True)
class Cause:
    """One row of a published interruption table, mapped onto the runtime's classifier."""

    name: str
    """Root-cause category as the source names it."""
    count: int
    """How often the source saw it (only the proportions matter)."""
    signal: str
    """Classifier input it shows up as in a training process (kind or detector name)."""
    repair_s: float
    """How long the node is out when the severity is SEV1 (assumption, see docs)."""


HOUR = 3600.0

# Llama 3 405B pre-training, 54-day snapshot on 16,384 H100 GPUs (2,048 nodes of 8):
# 419 unexpected interruptions, "Table 5: Root-cause categorization of unexpected
# interruptions" in Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783 (2024).
# The counts are the table's; the signal column is our mapping of each root cause onto the
# classifier input it would raise in a training process; repair times are assumptions.
LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause(name="Faulty GPU", count=148, signal="ecc", repair_s=12 * HOUR),
    Cause(name="GPU HBM3 memory", count=72, signal="ecc", repair_s=12 * HOUR),
    Cause(name="Software bug", count=54, signal="cuda", repair_s=0.0),
    Cause(name="Network switch/cable", count=35, signal="heartbeat_lost", repair_s=4 * HOUR),
    Cause(name="Host maintenance", count=32, signal="heartbeat_lost", repair_s=4 * HOUR),
    Cause(name="GPU SRAM memory", count=19, signal="ecc", repair_s=12 * HOUR),
    Cause(name="GPU system processor", count=17, signal="cuda", repair_s=0.0),
    Cause(name="NIC", count=7, signal="nccl", repair_s=0.0),
    Cause(name="NCCL watchdog timeouts", count=7, signal="hang", repair_s=0.0),
    Cause(name="Silent data corruption", count=6, signal="illegal_memory", repair_s=0.0),
    Cause(name="GPU thermal interface + sensor", count=6, signal="ecc", repair_s=12 * HOUR),
    Cause(name="SSD", count=3, signal="heartbeat_lost", repair_s=12 * HOUR),
    Cause(name="Power supply", count=3, signal="heartbeat_lost", repair_s=12 * HOUR),
    Cause(name="Server chassis", count=2, signal="heartbeat_lost", repair_s=12 * HOUR),
    Cause(name="IO expansion board", count=2, signal="heartbeat_lost", repair_s=12 * HOUR),
    Cause(name="Dependency", count=2, signal="user", repair_s=0.0),
    Cause(name="CPU", count=2, signal="heartbeat_lost", repair_s=12 * HOUR),
    Cause(name="System memory", count=2, signal="heartbeat_lost", repair_s=12 * HOUR),
)

LLAMA3_RATE_PER_NODE_DAY = 419 / (2048 * 54)
"""Unexpected interruptions per 8-GPU node per day in the Llama 3 405B run (~0.0038)."""


def _classify_severity(signal: str) -> int:
    """Severity (1..3) of a classifier input, through the runtime's table."""
    verdict = (
        classify.classify_detector(signal)
        if signal in DETECTORS
        else classify.verdict_for_kind(signal)
    )
    return int(verdict.severity)


def load_csv(path: str | Path) -> list[TraceEvent]:
    """Parse a ``milliseconds,add|remove,node`` trace; raise UsageError naming file:line.

    Rejected (each names the line): a malformed line, an unknown action, a time earlier than
    the line before it, a ``remove`` of a node that is not in the cluster at that point (never
    added, or already removed), and an ``add`` of a node that is already in.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read trace: {exc.strerror}") from exc
    events: list[TraceEvent] = []
    live: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        ev = _parse_line(line, where)
        if events and ev.time_s < events[-1].time_s:
            raise UsageError(
                f"{where}: time {ev.time_s * 1000:.0f} ms goes backwards "
                f"(the line before is at {events[-1].time_s * 1000:.0f} ms)"
            )
        if ev.action == "remove":
            if ev.node not in live:
                raise UsageError(f"{where}: node {ev.node!r} removed but not in the cluster")
            live.discard(ev.node)
        else:
            if ev.node in live:
                raise UsageError(f"{where}: node {ev.node!r} added twice")
            live.add(ev.node)
        events.append(ev)
    if not events:
        raise UsageError(f"{path}: trace has no events")
    return events


def _parse_line(line: str, where: str) -> TraceEvent:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        raise UsageError(f"{where}: expected 'milliseconds,add|remove,node', got {line!r}")
    ms, action, node = parts
    try:
        value = int(ms)
    except ValueError:
        raise UsageError(f"{where}: time {ms!r} is not an integer number of milliseconds") from None
    if value < 0:
        raise UsageError(f"{where}: time {value} is negative")
    if action not in ("add", "remove"):
        raise UsageError(f"{where}: action {action!r} is not 'add' or 'remove'")
    if not node:
        raise UsageError(f"{where}: empty node name")
    act: Action = "remove" if action == "remove" else "add"
    signal = "heartbeat_lost" if act == "remove" else ""
    cause = "node removed (trace)" if act == "remove" else ""
    return TraceEvent(time_s=value / 1000.0, action=act, node=node, signal=signal, cause=cause)


def generate(
    *,
    nodes: int,
    duration_s: float,
    rate_per_node_day: float,
    seed: int,
    causes: tuple[Cause, ...] = LLAMA3_CAUSES,
    prefix: str = "node",
) -> list[TraceEvent]:
    """Draw a failure trace: Poisson failures per node, causes by the table's proportions.

    Every node starts in the cluster (no ``add`` at 0). A cause whose classifier verdict is
    SEV1 removes the node and adds it back ``repair_s`` later; SEV2/SEV3 causes are
    ``fault`` events (the node stays). A node that is out does not fail again until it is
    back. Node names are ``{prefix}1`` .. ``{prefix}{nodes}``.
    """
    if nodes < 1:
        raise ValueError(f"nodes: must be >= 1, got {nodes}")
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    if not rate_per_node_day >= 0 or math.isinf(rate_per_node_day):
        raise ValueError(
            f"rate_per_node_day: must be a finite number >= 0, got {rate_per_node_day}"
        )
    severity = {c.signal: _classify_severity(c.signal) for c in causes}
    weights = [c.count for c in causes]
    rate_s = rate_per_node_day / 86400.0
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    if rate_s == 0:
        return events
    for i in range(1, nodes + 1):
        name = f"{prefix}{i}"
        t = rng.expovariate(rate_s)
        while t < duration_s:
            cause = rng.choices(causes, weights=weights)[0]
            if severity[cause.signal] == 1:
                events.append(
                    TraceEvent(
                        time_s=t, action="remove", node=name, signal=cause.signal, cause=cause.name
                    )
                )
                t += max(cause.repair_s, 1.0)
                if t < duration_s:
                    events.append(TraceEvent(time_s=t, action="add", node=name))
            else:
                events.append(
                    TraceEvent(
                        time_s=t, action="fault", node=name, signal=cause.signal, cause=cause.name
                    )
                )
            t += rng.expovariate(rate_s)
    events.sort(key=lambda e: (e.time_s, e.node))
    return events
