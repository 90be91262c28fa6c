"""The Unicron policy's constants, read from the runtime's measured benchmark results.

``python -m bench`` runs the real runtime (processes, gloo) and writes its figures to
``bench/results/*.json`` (docs/benchmarks.md). :func:`load` reads the Unicron rows the
simulator needs: how fast each kind of failure is detected, and the hang detector's
floor. What cannot be measured on these machines is a named assumption with a source
(:data:`ASSUMPTIONS`). Called by :func:`unicron.sim.policies.make_policy`; the command
records which source was used in ``summary.json`` (``meta.unicron_constants``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

COMM_KINDS = ("nccl", "timeout", "conn_reset", "conn_refused")
CRASH_KINDS = ("cuda", "oom", "illegal_memory")

ASSUMPTIONS: dict[str, tuple[float, str]] = {
    "regroup_s": (
        30.0,
        "rebuild the NCCL groups and restart a worker at cluster scale; not measurable on a "
        "CPU/gloo machine. MegaScale (Jiang et al., NSDI'24, section 3.5) brought job "
        "initialisation on 2,048 GPUs under 30 s after optimising it (from 1,047 s)",
    ),
    "state_bandwidth": (
        0.0,
        "state from a peer at the GPU preset's inter-node bandwidth x GPUs per node "
        "(unicron/planner/hardware.py: one 200 Gb/s NIC per A100/A800 GPU, 400 Gb/s per "
        "H100); not measurable here (loopback)",
    ),
}
"""Name -> (value, source) of what the simulator assumes for Unicron (0: computed)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Detection latencies in seconds and where each came from."""

    exception_detect_s: float
    exit_detect_s: float
    node_detect_s: float
    hang_floor_s: float
    source: str
    """``bench/results`` (with the files' dates) or the fallback's name."""


DESIGN_TARGETS = Measured(
    exception_detect_s=0.2,
    exit_detect_s=0.5,
    node_detect_s=3.0,
    hang_floor_s=1.5,
    source="DESIGN.md targets (bench/results not found)",
)
"""Used only where ``bench/results`` is absent (an installed package without the tree)."""


def _rows(name: str, results: Path) -> list[dict[str, Any]]:
    data = json.loads((results / f"{name}.json").read_text())
    return [r for r in data if isinstance(r, dict) and r.get("system") == "unicron"]


def _median(rows: list[dict[str, Any]], metrics: list[str]) -> float:
    values = [float(r["median"]) for r in rows if r.get("metric") in metrics]
    if not values:
        raise KeyError(", ".join(metrics))
    return float(statistics.median(values))


def load(results: Path = RESULTS) -> Measured:
    """The measured constants (DESIGN targets if the result files are missing or lack a row).

    * comm errors: median of ``detection_s[kind]`` for the communication kinds (error.json);
    * crashes: median of crash.json ``detection_s`` and error.json's crash kinds;
    * lost node: node.json ``detection_heartbeat_s`` (the node-health path; a dead host
      has no process left to report);
    * hang: hang.json ``detection_s`` is the statistical detector's floor.
    """
    try:
        error = _rows("error", results)
        crash = _rows("crash", results)
        node = _rows("node", results)
        hang = _rows("hang", results)
        dates = sorted(
            {str(r.get("date", ""))[:10] for r in error + crash + node + hang if r.get("date")}
        )
        return Measured(
            exception_detect_s=_median(error, [f"detection_s[{k}]" for k in COMM_KINDS]),
            exit_detect_s=_median(
                crash + error, ["detection_s", *(f"detection_s[{k}]" for k in CRASH_KINDS)]
            ),
            node_detect_s=_median(node, ["detection_heartbeat_s"]),
            hang_floor_s=_median(hang, ["detection_s"]),
            source=f"bench/results ({', '.join(dates) or 'undated'})",
        )
    except (OSError, ValueError, KeyError):
        return DESIGN_TARGETS
