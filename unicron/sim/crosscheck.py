"""Cross-check: our baselines on the Oobleck artifact's scenarios, beside its own figures.

The artifact (github SymbioticLab/Oobleck, branch sosp23-artifact, ``tools/simulator/``)
simulates Oobleck, Varuna and Bamboo training one model on 30 single-GPU nodes under its
``5m`` .. ``6h`` traces (a node lost every 5 minutes .. 6 hours). Its figures are typed into
``examples/sim/oobleck-artifact.yaml`` with their source; :func:`run` replays the same
traces through our policies and :func:`compare` puts the two side by side. Called by
``bench/simulator.py --crosscheck``; pure except for reading the data file and the traces.

Two measures, both dimensionless so that our planner's throughput scale and the artifact's
measured one need not agree: the *effective-time fraction* (the artifact's "Effective
Time": useful step time over all time) and the *normalised throughput* (average samples/s
over the healthy 30-node throughput: for us our reference rate, for the artifact its
measured Oobleck rate on 30 nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from unicron.errors import UsageError
from unicron.planner import GPUSpec
from unicron.sim import engine, trace
from unicron.sim.policies import Varuna, make_policy

TRACES = ("5m", "10m", "30m", "1h", "3h", "6h")
SYSTEMS = ("oobleck", "varuna", "bamboo")
TOLERANCE = 0.15
"""The goal: every baseline within 15 % of the artifact (relative), or a documented reason."""
ABS_FLOOR = 0.03
"""Below this (both sides near 0, e.g. Varuna on 5m) a difference counts as absolute."""
GPU = "A100-80GB"
"""The GPU our scenarios start from (assumption: the artifact does not name its GPU). Its
compute and bandwidths are then scaled per model so that our 30-node throughput equals the
artifact's measured Oobleck throughput (:func:`calibrated_gpu`): iteration times, and so
the cost of a lost iteration, match; memory stays 80 GB."""

DATA = Path(__file__).resolve().parents[2] / "examples" / "sim" / "oobleck-artifact.yaml"
TRACE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One system on one trace: ours and the artifact's."""

    model: str
    trace: str
    system: str
    ours_effective: float
    ours_norm_tput: float
    ours_tput: float
    """Our average samples/s (planner scale, not the artifact's)."""
    art_effective: float
    art_norm_tput: float
    art_tput: float
    reason: str
    """Why the cell misses the tolerance (from the data file), or "" when it does not."""
    alt_norm_tput: float | None = None
    """Varuna only: our normalised throughput when its checkpoint schedule counts the steps
    a rollback discards, as the artifact's does (``Varuna(artifact_step_count=True)``)."""

    @property
    def within(self) -> bool:
        return _close(self.ours_effective, self.art_effective) and _close(
            self.ours_norm_tput, self.art_norm_tput
        )


def _close(ours: float, theirs: float) -> bool:
    if max(abs(ours), abs(theirs)) < ABS_FLOOR:
        return True
    return abs(ours - theirs) <= TOLERANCE * max(abs(theirs), ABS_FLOOR)


def load(path: Path = DATA) -> dict[str, Any]:
    """The data file as a mapping (UsageError if unreadable)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from exc
    if not isinstance(data, dict) or "models" not in data:
        raise UsageError(f"{path}: expected a mapping with 'models'")
    return data


def calibrated_gpu(wl: engine.Workload, target_flops: float) -> GPUSpec:
    """``wl``'s GPU with peak FLOP/s and bandwidths scaled by one factor so that the task's
    throughput on all ``wl.nodes`` nodes is ``target_flops`` (every term of the planner's
    iteration time scales with that factor; memory does not change)."""
    gpu = wl.gpu_type()
    f = engine.prepare(wl).perf[0].flops[wl.nodes]
    k = target_flops / f
    return replace(
        gpu,
        name=f"{gpu.name} x{k:.3g}",
        peak_flops=gpu.peak_flops * k,
        intra_node_bw=gpu.intra_node_bw * k,
        inter_node_bw=gpu.inter_node_bw * k,
    )


def run(data: dict[str, Any], trace_dir: Path = TRACE_DIR) -> list[Cell]:
    """Every (model, trace, system) cell of the data file, ours beside the artifact's."""
    cells: list[Cell] = []
    reasons = data.get("reasons", {}) or {}
    for art_model, m in data["models"].items():
        spec = engine.model_spec(m["ours"])
        flops_per_sample = spec.flops_per_token * spec.seq_len
        wl = engine.Workload(
            nodes=int(data["nodes"]),
            gpus_per_node=int(data["gpus_per_node"]),
            gpu=GPU,
            tasks=(engine.TaskSpec(name="t", model=m["ours"], global_batch=m["global_batch"]),),
        )
        target = float(m["full_tput"]) * flops_per_sample
        wl = replace(wl, gpu_spec=calibrated_gpu(wl, target))
        prepared = engine.prepare(wl)
        for tr, row in m["traces"].items():
            events = trace.load_csv(trace_dir / f"{tr}.csv")
            duration = max(e.time_s for e in events)
            for system in SYSTEMS:
                r = engine.simulate(prepared, events, make_policy(system), duration_s=duration)
                alt = None
                if system == "varuna":
                    quirk = Varuna(artifact_step_count=True)
                    alt = engine.simulate(prepared, events, quirk, duration_s=duration)
                art = row[system]
                cells.append(
                    Cell(
                        model=art_model,
                        trace=tr,
                        system=system,
                        ours_effective=r.effective_time_fraction,
                        ours_norm_tput=r.effective_fraction,
                        ours_tput=r.accumulated_waf / duration / flops_per_sample,
                        art_effective=float(art["effective"]),
                        art_norm_tput=float(art["throughput"]) / float(m["full_tput"]),
                        art_tput=float(art["throughput"]),
                        reason=str(reasons.get(f"{art_model}/{tr}/{system}", "")),
                        alt_norm_tput=None if alt is None else alt.effective_fraction,
                    )
                )
    return cells


def markdown(cells: list[Cell]) -> str:
    """The table: per cell ours / the artifact's, and whether it is within 15 %."""
    lines = [
        "| model | trace | system | eff. time ours | eff. time artifact | norm. tput ours "
        "| norm. tput artifact | tput ours (samples/s) | tput artifact (samples/s) "
        "| norm. tput ours, artifact's step count | within 15 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        verdict = "yes" if c.within else ("no: " + c.reason if c.reason else "**no**")
        lines.append(
            f"| {c.model} | {c.trace} | {c.system} | {c.ours_effective:.3f} | "
            f"{c.art_effective:.3f} | {c.ours_norm_tput:.3f} | {c.art_norm_tput:.3f} | "
            f"{c.ours_tput:.4g} | {c.art_tput:.4g} | "
            f"{'' if c.alt_norm_tput is None else f'{c.alt_norm_tput:.3f}'} | {verdict} |"
        )
    return "\n".join(lines) + "\n"
