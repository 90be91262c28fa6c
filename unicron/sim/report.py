"""Write a simulation's results: ``summary.json``, ``summary.md`` and two PNG plots.

Called by :mod:`unicron.sim.command` after every policy ran. Every file is written
atomically (a temporary file, then ``os.replace``). Plots use matplotlib's Agg backend,
imported here only, so the command stays light until it has results to draw.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unicron.sim.metrics import PolicyResult, ratios
from unicron.sim.task import LOSSES

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def summary(results: list[PolicyResult], meta: dict[str, Any]) -> dict[str, Any]:
    """The summary.json document: run metadata, one object per policy, ratios vs Unicron."""
    return {
        "meta": meta,
        "policies": [r.to_json() for r in results],
        "unicron_over": {k: (v if math.isfinite(v) else None) for k, v in ratios(results).items()},
    }


def markdown(results: list[PolicyResult], meta: dict[str, Any]) -> str:
    """A markdown table: one row per policy, losses in hours of the reference."""
    r_over = ratios(results)
    head = ["policy", "accumulated WAF (EFLOP)", "effective", "Unicron / it"]
    head += [f"{k} (h)" for k in LOSSES]
    lines = [
        f"# Simulation: {meta.get('trace', '')}",
        "",
        f"{meta.get('nodes')} nodes x {meta.get('gpus_per_node')} {meta.get('gpu')}, "
        f"{len(meta.get('tasks', []))} tasks, {meta.get('duration_s', 0) / 86400:.3g} days.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        ratio = "1" if r.policy == "unicron" else f"{r_over.get(r.policy, float('nan')):.3f}"
        row = [r.policy, f"{r.accumulated_waf / 1e18:.4g}", f"{r.effective_fraction:.4f}", ratio]
        row += [f"{r.breakdown_s[k] / 3600:.2f}" for k in LOSSES]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Losses are hours of the whole cluster's reference WAF (see docs/simulator.md).",
        "",
    ]
    return "\n".join(lines)


def plots(results: list[PolicyResult], out: Path) -> list[Path]:
    """``waf.png`` (accumulated WAF over time per policy) and ``breakdown.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([t / 86400 for t, _ in r.series], [w / 1e18 for _, w in r.series], label=r.policy)
    ax.set_xlabel("days")
    ax.set_ylabel("accumulated WAF (EFLOP, weighted)")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "waf.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(results)
    for k in LOSSES:
        vals = [max(r.breakdown_s[k], 0.0) / 3600 for r in results]
        ax.bar([r.policy for r in results], vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("lost time (h of the cluster's reference WAF)")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(_save(fig, out / "breakdown.png"))
    plt.close(fig)
    return paths


def _save(fig: Figure, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return path


def write(results: list[PolicyResult], meta: dict[str, Any], out: Path) -> list[Path]:
    """Write everything into ``out`` (created if missing); return the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(summary(results, meta), indent=2, allow_nan=False) + "\n"
    _atomic_write(out / "summary.json", doc.encode())
    _atomic_write(out / "summary.md", markdown(results, meta).encode())
    return [out / "summary.json", out / "summary.md", *plots(results, out)]
