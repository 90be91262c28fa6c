"""Cross-check: our baselines on the Oobleck artifact's scenarios, beside its own figures.

The artifact (github SymbioticLab/Oobleck, branch sosp23-artifact, ``tools/simulator/``)
simulates Oobleck, Varuna and Bamboo training one of five models on 30 single-GPU nodes
under its ``5m`` .. ``6h`` traces (a node lost every 5 minutes .. 6 hours). Its figures are
in ``examples/sim/oobleck-artifact.yaml`` (the output of
``examples/sim/oobleck_artifact_run.py``, with the commit); :func:`run` replays the same
traces through our policies, with and without the artifact's behaviours they model
(:func:`mechanisms`), and :func:`report` puts the two side by side. Called by
``bench/simulator.py --crosscheck`` and the tests; pure except for reading the data file
and the traces.

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
from unicron.sim.policies import BAMBOO_ARTIFACT_OOM, make_policy

TRACES = ("5m", "10m", "30m", "1h", "3h", "6h")
SYSTEMS = ("oobleck", "varuna", "bamboo")
TOLERANCE = 0.15
"""The goal: each baseline within 15 % of the artifact (relative) in at least 80 % of its
cells; a cell closed by a mechanism names it (:attr:`Cell.closed_by`)."""
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
class Mechanism:
    """A behaviour of the artifact's baseline that ours models, switched by one policy field.

    The cross-check runs every policy with all of its system's mechanisms on (``on``) and
    once with all off (``off``), and names, per cell, those whose removal alone takes the
    cell out of the tolerance: a test recomputes the cell both ways. Each field's docstring
    in :mod:`unicron.sim.policies` gives the artifact's file and line."""

    name: str
    system: str
    field: str | None
    """The policy field that switches it; None: the measure's bookkeeping (:func:`measures`)."""
    on: Any
    off: Any


def mechanisms() -> tuple[Mechanism, ...]:
    """Every mechanism of the cross-check (policies.py documents each field)."""
    return (
        Mechanism(
            name="train-through-restart",
            system="varuna",
            field="train_through_restart",
            on=True,
            off=False,
        ),
        Mechanism(
            name="artifact-step-count",
            system="varuna",
            field="artifact_step_count",
            on=True,
            off=False,
        ),
        Mechanism(
            name="scheduled-step-bookkeeping",
            system="varuna",
            field=None,
            on=True,
            off=False,
        ),
        Mechanism(
            name="failover-in-flight",
            system="bamboo",
            field="failover_in_flight",
            on=True,
            off=False,
        ),
        Mechanism(
            name="measured-bamboo-tables",
            system="bamboo",
            field="measured_tables",
            on=True,
            off=False,
        ),
        Mechanism(
            name="measured-oom",
            system="bamboo",
            field="out_of_memory",
            on=BAMBOO_ARTIFACT_OOM,
            off=frozenset(),
        ),
        Mechanism(
            name="redundant-bookkeeping",
            system="bamboo",
            field="booked_useful",
            on=BAMBOO_USEFUL_SHARE,
            off=None,
        ),
    )


BAMBOO_USEFUL_SHARE = 0.1971
"""The share of a Bamboo step the artifact books as effective (bamboo_simulator.py line 128,
``redundant_ratio = 1 - 0.1971``)."""


def policy(system: str, without: frozenset[str] = frozenset()) -> Any:
    """``system``'s policy with its mechanisms on, except those named in ``without``."""
    pol = make_policy(system)
    values = {m.field: m.off if m.name in without else m.on for m in mechanisms() if m.field}
    return replace(pol, **{f: v for f, v in values.items() if hasattr(pol, f)})


def measures(r: Any, duration_s: float, booked_restart_s: float | None) -> tuple[float, float]:
    """(effective-time fraction, normalised throughput) of a result; with
    ``booked_restart_s`` (not None), the effective time booked as the artifact's Varuna books
    it. Mechanism *scheduled-step-bookkeeping*: varuna_simulator.py adds a step's time to the
    effective time when the step is scheduled (``create_training_step_complete_event``, line
    1099), so work a rollback discards stays in it and is added again, twice, as fallback
    time (``simulate_spot_instance_remove``, line 1241: two ``performance_ys`` entries per
    step); and it books every restart as restart time when the rendezvous starts (line 1066)
    even while the old configuration trains through it: ``booked_restart_s``, the restart
    seconds our run did not spend down. The fraction is over that sum, not wall time."""
    eff = float(r.effective_time_fraction)
    if booked_restart_s is not None:
        lost = sum(t.down_s["lost_work"] for t in r.tasks)
        eff = (duration_s * eff + lost) / (duration_s + 2 * lost + booked_restart_s)
    return eff, float(r.effective_fraction)


def ours(
    prepared: Any, events: Any, duration_s: float, system: str, without: frozenset[str]
) -> tuple[float, float]:
    """Our (effective-time fraction, normalised throughput) for one cell, with ``system``'s
    mechanisms on except those in ``without``."""
    pol = policy(system, without)
    r = engine.simulate(prepared, events, pol, duration_s=duration_s)
    booked = None
    if system == "varuna" and "scheduled-step-bookkeeping" not in without:
        booked = 0.0
        if pol.train_through_restart:
            p = prepared.perf[0]
            run = engine.TaskRun(perf=p, ref_waf=prepared.ref_waf(p.spec.name), target=0)
            booked = pol.restart_cost_s(run) * sum(t.faults for t in r.tasks)
    return measures(r, duration_s, booked)


def names(system: str) -> frozenset[str]:
    """The mechanisms of ``system``."""
    return frozenset(m.name for m in mechanisms() if m.system == system)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One system on one trace: ours (mechanisms on, and all off) and the artifact's."""

    model: str
    trace: str
    system: str
    ours_effective: float
    ours_norm_tput: float
    ours_tput: float
    """Our average samples/s: the normalised throughput times the artifact's 30-node rate,
    which our GPU is calibrated to."""
    art_effective: float
    art_norm_tput: float
    art_tput: float
    bare_effective: float
    """Ours with none of the system's mechanisms."""
    bare_norm_tput: float
    closed_by: tuple[str, ...] = ()
    """Mechanisms without any one of which the cell would miss the tolerance (only for a
    cell that misses it with none of them and meets it with all)."""

    @property
    def within(self) -> bool:
        return _close(self.ours_effective, self.art_effective) and _close(
            self.ours_norm_tput, self.art_norm_tput
        )

    @property
    def bare_within(self) -> bool:
        return _close(self.bare_effective, self.art_effective) and _close(
            self.bare_norm_tput, self.art_norm_tput
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


def prepare(data: dict[str, Any], art_model: str) -> tuple[Any, float]:
    """One model's scenario (30 calibrated nodes) and its FLOPs per sample."""
    m = data["models"][art_model]
    spec = engine.model_spec(m["ours"])
    wl = engine.Workload(
        nodes=int(data["nodes"]),
        gpus_per_node=int(data["gpus_per_node"]),
        gpu=GPU,
        tasks=(engine.TaskSpec(name="t", model=m["ours"], global_batch=m["global_batch"]),),
    )
    target = float(m["full_tput"]) * spec.flops_per_token * spec.seq_len
    wl = replace(wl, gpu_spec=calibrated_gpu(wl, target))
    return engine.prepare(wl), spec.flops_per_token * spec.seq_len


def cell(
    data: dict[str, Any],
    art_model: str,
    tr: str,
    system: str,
    *,
    prepared: tuple[Any, float] | None = None,
    trace_dir: Path = TRACE_DIR,
) -> Cell:
    """One cell: ours with the system's mechanisms, without them, and the artifact's."""
    p, _flops_per_sample = prepare(data, art_model) if prepared is None else prepared
    events = trace.load_csv(trace_dir / f"{tr}.csv")
    duration = max(e.time_s for e in events)

    def sim(without: frozenset[str]) -> tuple[float, float]:
        return ours(p, events, duration, system, without)

    m = data["models"][art_model]
    art = m["traces"][tr][system]
    full = float(m["full_tput"])
    (eff, norm), (bare_eff, bare_norm) = sim(frozenset()), sim(names(system))
    out = Cell(
        model=art_model,
        trace=tr,
        system=system,
        ours_effective=eff,
        ours_norm_tput=norm,
        ours_tput=norm * full,
        art_effective=float(art["effective"]),
        art_norm_tput=float(art["throughput"]) / full,
        art_tput=float(art["throughput"]),
        bare_effective=bare_eff,
        bare_norm_tput=bare_norm,
    )
    if not out.within or out.bare_within:
        return out
    needed = []
    for name in sorted(names(system)):
        w_eff, w_norm = sim(frozenset({name}))
        if not (_close(w_eff, out.art_effective) and _close(w_norm, out.art_norm_tput)):
            needed.append(name)
    return replace(out, closed_by=tuple(needed))


def run(
    data: dict[str, Any],
    trace_dir: Path = TRACE_DIR,
    *,
    models: tuple[str, ...] | None = None,
    traces: tuple[str, ...] | None = None,
) -> list[Cell]:
    """Every (model, trace, system) cell of the data file (or of ``models`` x ``traces``)."""
    cells: list[Cell] = []
    for art_model, m in data["models"].items():
        if models is not None and art_model not in models:
            continue
        prepared = prepare(data, art_model)
        for tr in m["traces"]:
            if traces is not None and tr not in traces:
                continue
            for system in SYSTEMS:
                cells.append(
                    cell(data, art_model, tr, system, prepared=prepared, trace_dir=trace_dir)
                )
    return cells


def counts(cells: list[Cell]) -> dict[str, tuple[int, int, int]]:
    """Per system: cells within the tolerance without mechanisms, with them, and in all."""
    out: dict[str, tuple[int, int, int]] = {}
    for system in SYSTEMS:
        mine = [c for c in cells if c.system == system]
        out[system] = (sum(c.bare_within for c in mine), sum(c.within for c in mine), len(mine))
    return out


def verdict(c: Cell) -> str:
    """The table's last column: within, within by named mechanisms, or not."""
    if not c.within:
        return "**no**"
    if c.bare_within:
        return "yes"
    return "yes, by " + (", ".join(c.closed_by) if c.closed_by else "the mechanisms together")


def markdown(cells: list[Cell]) -> str:
    """The table: per cell ours (with and without mechanisms) / the artifact's."""
    lines = [
        "| model | trace | system | eff. time ours | eff. time artifact | norm. tput ours "
        "| norm. tput artifact | tput ours (samples/s) | tput artifact (samples/s) "
        "| ours without mechanisms (eff. / tput) | within 15 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c.model} | {c.trace} | {c.system} | {c.ours_effective:.3f} | "
            f"{c.art_effective:.3f} | {c.ours_norm_tput:.3f} | {c.art_norm_tput:.3f} | "
            f"{c.ours_tput:.4g} | {c.art_tput:.4g} | "
            f"{c.bare_effective:.3f} / {c.bare_norm_tput:.3f} | {verdict(c)} |"
        )
    return "\n".join(lines) + "\n"


def summary(cells: list[Cell]) -> str:
    """The counts per system and the mechanisms (also spliced into docs/simulator.md)."""
    lines = [
        "| system | within 15 %, without mechanisms | with them |",
        "|---|---|---|",
    ]
    for system, (bare, within, n) in counts(cells).items():
        lines.append(f"| {system} | {bare} of {n} | {within} of {n} |")
    lines += [
        "",
        "| mechanism | system | policy field: cross-check value (default) |",
        "|---|---|---|",
    ]
    for m in mechanisms():
        if m.field is None:
            lines.append(f"| {m.name} | {m.system} | none: the measure (`crosscheck.measures`) |")
            continue
        default = getattr(make_policy(m.system), m.field)
        on = sorted(m.on) if isinstance(m.on, frozenset) else m.on
        dflt = sorted(default) if isinstance(default, frozenset) else default
        lines.append(f"| {m.name} | {m.system} | `{m.field}`: {on} ({dflt}) |")
    misses = [f"{c.model} {c.trace} {c.system}" for c in cells if not c.within]
    lines += ["", f"Outside 15 % with the mechanisms: {', '.join(misses) or 'none'}."]
    return "\n".join(lines) + "\n"


def report(cells: list[Cell]) -> str:
    """``bench/results/crosscheck.md``: what was compared, the counts, the mechanisms, the
    table (written by ``bench/simulator.py --crosscheck``, never by hand)."""
    head = f"""# Cross-check: our baselines against the Oobleck artifact's own models

Generated by `python bench/simulator.py --crosscheck` (unicron/sim/crosscheck.py); the
artifact's figures, with the command and commit that produced them:
examples/sim/oobleck-artifact.yaml. 30 single-GPU nodes; our GPU calibrated per model to
the artifact's measured 30-node Oobleck throughput. Effective time: useful step time / all
time (the artifact's breakdown); norm. tput: average throughput / healthy 30-node
throughput. A cell is within when both are within 15 % (or both below {ABS_FLOOR}).
Mechanisms: the artifact's behaviours our policies model (file and line in the field's
docstring, unicron/sim/baselines.py); ours runs with its system's mechanisms on, and once
with none. *yes, by M*: the cell misses without M alone and meets the tolerance with it
(tests/test_sim_baselines.py recomputes such cells both ways).

"""
    return head + summary(cells) + "\n" + markdown(cells)
