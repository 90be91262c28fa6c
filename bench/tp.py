"""Model-parallel replicas: Unicron against plain PyTorch under torchrun and against torchft,
TP=2, PP=2 and FSDP=2 (x DP=2).

In one run, interleaved: ``examples/train_llama_parallel.py`` under ``unicron run --tp 2`` (or
``--pp 2``, ``--fsdp 2``) and the same model, micro-batches and seeds in plain PyTorch
(``bench/baselines/tp_ckpt.py``: the replica's sums and pipeline links over torch process
groups, DDP across replicas, a shard checkpoint every ``K`` steps; at FSDP=2
``bench/baselines/fsdp_ckpt.py``: FSDP2's HSDP, a DCP checkpoint every ``K`` steps), 4 CPU
workers each, per layout; also torchft at TP=2 and PP=2 (``bench/baselines/tp_torchft.py``:
a replica group of two ranks per torchrun, torchft's Manager and DDP across the groups, a
lighthouse; not at FSDP=2: its FSDP path, torchft's own device mesh under FSDP2, is not
built into ``bench/baselines``). Fault-free, at the
smallest model: the median ``duration_s`` of ``step_end`` after the
warm-up steps (``step_time_vs_plain`` divides Unicron's by the baseline's). Then, at each
model size: rank 0 (place 0 of replica 0: tensor rank 0, or the first stage) SIGKILLed
mid-step half-way (half a checkpoint interval after the baseline's checkpoint):
``detection_s`` (Unicron: the fault to its ``error_detected``), ``recovery_s`` (the fault to
the first step at or after the interrupted one that finishes: Unicron re-forms the replica
and recomputes its micro-batches; torchrun restarts every rank and redoes the steps since the
checkpoint; torchft's other group goes on alone once its quorum drops the lost one) and
``steps_redone``; ``whole_s`` (the fault to the first step at or after the interrupted one
committed with the whole global batch: torchft's restarted group back in the quorum) and
``steps_shrunk`` (steps committed without every replica: their lost micro-batches dropped,
torchft's semantics; 0 for the others, which recompute them). Metrics carry ``[layout]`` or
``[layout/dimD]``; the plot
``bench/results/tp.png`` draws recovery against the replica's state size, per layout.

Run only when named: ``python -m bench.tp [--quick]`` or ``python -m bench --scenario tp``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    Row,
    bench_parser,
    free_port,
    load_rows,
    make_row,
    print_table,
    save_figure,
    save_scenario,
    write_summary,
)
from bench.events import read_events

SCENARIO = "tp"
ROOT = Path(__file__).resolve().parents[1]
NPROC, CKPT_EVERY = 4, 10
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "fsdp2": (1, 1, 2)}  # (tp, pp, fsdp): each
# x DP=2 on NPROC workers
DIMS = {True: (128,), False: (128, 256, 384)}  # model width (hidden units: twice it)
PLAN = {True: (30, 5, 1), False: (40, 10, 2)}  # quick: (steps, warm-up steps, repetitions)
ARMS = ("unicron", "torchrun", "torchft")
TORCHFT_LAYOUTS = ("tp2", "pp2")  # torchft's replica group of a replica's ranks (its HSDP
# recipe, with TP or PP in place of FSDP)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip


def _model(dim: int) -> list[str]:
    return ["--dim", str(dim), "--hidden", str(2 * dim)]


def _command(arm: str, layout: str, dim: int, steps: int, workdir: Path, fault: str | None
             ) -> list[str]:  # fmt: skip
    tp, pp, fsdp = LAYOUTS[layout]
    events = str(workdir / "events.jsonl")
    inject = ["--inject", fault] if fault else []
    if arm == "torchrun" and fsdp > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), "--max-restarts", "3",
                "-m", "bench.baselines.fsdp_ckpt", "--fsdp", str(fsdp), *_model(dim),
                "--steps", str(steps), "--ckpt-every", str(CKPT_EVERY),
                "--ckpt-dir", str(workdir), "--events", events, *inject]  # fmt: skip
    if arm == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), "--max-restarts", "3",
                "-m", "bench.baselines.tp_ckpt", "--tp", str(tp), "--pp", str(pp), *_model(dim),
                "--steps", str(steps), "--ckpt-every", str(CKPT_EVERY),
                "--ckpt-dir", str(workdir), "--events", events, *inject]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(NPROC),
            "--tp", str(tp), "--pp", str(pp), "--fsdp", str(fsdp), "--quiet", "--events", events,
            "--log-dir", str(workdir / "logs"), *inject,
            str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps),
            *_model(dim)]  # fmt: skip


def _events(arm: str, layout: str, dim: int, steps: int, workdir: Path,
            fault: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    workdir.mkdir(parents=True)
    if arm == "torchft":
        _torchft(layout, dim, steps, workdir, fault)
    else:
        cmd = _command(arm, layout, dim, steps, workdir, fault)
        subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    return [dict(e) for e in read_events(workdir / "events.jsonl")]


def _torchft(layout: str, dim: int, steps: int, workdir: Path, fault: str | None) -> None:
    """One torchft run: a lighthouse and a torchrun per replica group of ``tp x pp`` ranks."""
    from bench.systems.torchft import _lighthouse_binary, unavailable

    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    tp, pp, _ = LAYOUTS[layout]
    size = tp * pp
    port = free_port()
    logs = [open(workdir / name, "w") for name in ("lighthouse.log", "group0.log", "group1.log")]  # noqa: SIM115
    lighthouse = subprocess.Popen(
        [str(_lighthouse_binary()), "--min_replicas", "1", "--join_timeout_ms", "1000",
         "--bind", f"127.0.0.1:{port}"], stdout=logs[0], stderr=subprocess.STDOUT,
    )  # fmt: skip
    groups: list[subprocess.Popen[bytes]] = []
    try:
        for q in range(NPROC // size):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(size), "--max-restarts", "3",
                   "-m", "bench.baselines.tp_torchft", "--replica-id", str(q), "--pp", str(pp),
                   "--replicas", str(NPROC // size), "--lighthouse", f"http://127.0.0.1:{port}",
                   "--steps", str(steps), "--marker-dir", str(workdir),
                   "--events", str(workdir / "events.jsonl"), *_model(dim),
                   *(["--inject", fault] if fault else [])]  # fmt: skip
            groups.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=logs[q + 1],
                                           stderr=subprocess.STDOUT))  # fmt: skip
        for q, g in enumerate(groups):
            if g.wait(timeout=900) != 0:
                raise RuntimeError(f"torchft replica group {q} exited with {g.returncode}")
    finally:
        for g in groups:
            if g.poll() is None:
                g.kill()
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
        for f in logs:
            f.close()


def state_mb(dim: int) -> float:
    """A replica's training state at width ``dim`` (MB: parameters and AdamW's two moments,
    float32), whatever the layout splits it into."""
    sys.path.insert(0, str(ROOT / "examples"))
    import llama_parallel

    from unicron.parallel import TensorParallel

    cfg = llama_parallel.LlamaConfig(dim=dim, hidden=2 * dim)
    model = llama_parallel.Llama(cfg, TensorParallel(0, 1))
    return 3 * 4 * sum(p.numel() for p in model.parameters()) / 1e6


def step_time(arm: str, layout: str, dim: int, steps: int, warmup: int, workdir: Path) -> float:
    """One fault-free run: its median step time after ``warmup`` steps."""
    evs = _events(arm, layout, dim, steps, workdir)
    ends = [e for e in evs if e["event"] == "step_end"]
    return statistics.median(float(e["duration_s"]) for e in ends if int(e["step"]) >= warmup)


def _fault_step(steps: int) -> int:
    """Half-way, and half a checkpoint interval past the baseline's last checkpoint (its
    expected loss: a failure falls anywhere between two checkpoints)."""
    return steps // 2 // CKPT_EVERY * CKPT_EVERY + CKPT_EVERY // 2


def crash(arm: str, layout: str, dim: int, steps: int, workdir: Path) -> dict[str, float]:
    """Rank 0 SIGKILLed mid-step half-way: ``detection_s`` (Unicron's), ``recovery_s``,
    ``whole_s``, ``steps_redone`` and ``steps_shrunk`` (the module's docstring). Pure over the
    run's events once it ran."""
    at = _fault_step(steps)
    return figures(_events(arm, layout, dim, steps, workdir, f"crash:rank=0,step={at},mb=1"),
                   at, arm)  # fmt: skip


def figures(evs: list[dict[str, Any]], at: int, arm: str) -> dict[str, float]:
    """:func:`crash`'s figures from a run's events, the fault at step ``at``. A step a
    torchft replica group commits says how many groups took part (``replicas``); every step
    of the others is whole. Steps are counted once each (torchft: each group writes its
    own)."""
    ts = float(next(e for e in evs if e["event"] == "fault_injected")["ts"])
    out: dict[str, float] = {}
    detected = min((float(e["ts"]) for e in evs if e["event"] == "error_detected"
                    and float(e["ts"]) >= ts), default=None)  # fmt: skip
    if arm == "unicron" and detected is not None:
        out["detection_s"] = detected - ts
    ends = [e for e in evs if e["event"] == "step_end" and float(e["ts"]) > ts]
    groups = max((int(e.get("replicas", 1)) for e in evs if e["event"] == "step_end"), default=1)
    whole = [e for e in ends if int(e.get("replicas", groups)) == groups]
    out["recovery_s"] = min(float(e["ts"]) for e in ends if int(e["step"]) >= at) - ts
    back = [float(e["ts"]) for e in whole if int(e["step"]) >= at]
    if back:  # else never whole again before the run's end (no row: the note says so)
        out["whole_s"] = min(back) - ts
    out["steps_redone"] = len({int(e["step"]) for e in ends if int(e["step"]) < at})
    out["steps_shrunk"] = len({int(e["step"]) for e in ends if int(e.get("replicas", groups))
                               < groups})  # fmt: skip
    return out


def arms(layout: str) -> tuple[str, ...]:
    """The systems run at ``layout``."""
    return tuple(a for a in ARMS if a != "torchft" or layout in TORCHFT_LAYOUTS)


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario tp``)."""
    steps, warmup, reps = PLAN[quick]
    dims = DIMS[quick]
    load = os.getloadavg()[0]  # the figures' context: a shared machine's other work
    times: dict[tuple[str, str], list[float]] = {}
    got: dict[tuple[str, str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-tp-") as tmp:
        for rep in range(reps):
            for layout in LAYOUTS:
                for arm in arms(layout):
                    where = Path(tmp) / f"{rep}-{layout}-{arm}"
                    t = step_time(arm, layout, dims[0], steps, warmup, where)
                    times.setdefault((arm, layout), []).append(t)
                    for dim in dims:
                        found = crash(arm, layout, dim, steps, Path(f"{where}-crash{dim}"))
                        for key, value in found.items():
                            got.setdefault((arm, layout, dim, key), []).append(value)
    machine = f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
    how = {
        "unicron": "; the replica re-formed, its micro-batches recomputed by the live one",
        "torchrun": f"; every rank restarted, shards reloaded (a checkpoint every {CKPT_EVERY}; "
        "DCP's at FSDP)",
        "torchft": "; the lost rank's replica group restarted by its torchrun, its shards "
        "from the live group; the live group went on alone meanwhile (half the batch)",
    }
    rows: list[Row] = []
    for layout, (tp, pp, fsdp) in LAYOUTS.items():
        split = f"FSDP={fsdp}" if fsdp > 1 else f"TP={tp} x PP={pp}"
        shape = f"{split} x DP=2 on {NPROC} CPU workers"
        note = (
            f"examples/llama_parallel.py (2 layers, dim {dims[0]}), {shape}, {steps} steps, "
            f"median after step {warmup}; {machine}"
        )
        for arm in arms(layout):
            rows.append(make_row(system=arm, scenario=SCENARIO, metric=f"step_time_s[{layout}]",
                                 values=times[(arm, layout)], note=note))  # fmt: skip
        ratio = statistics.median(times[("unicron", layout)]) / statistics.median(
            times[("torchrun", layout)]
        )
        said = "median step time / plain PyTorch's at the layout, same run"
        rows.append(make_row(system="unicron", scenario=SCENARIO,
                             metric=f"step_time_vs_plain[{layout}]", values=[ratio],
                             status="derived", note=said))  # fmt: skip
        for dim in dims:
            kind = f"{layout}/dim{dim}"
            crash_note = (
                f"{shape}, dim {dim} (state {state_mb(dim):.1f} MB a replica): rank 0 (place "
                f"0 of replica 0) SIGKILLed mid-step at step {_fault_step(steps)}; {machine}"
            )
            for arm in arms(layout):
                for key in ("detection_s", "recovery_s", "whole_s", "steps_redone",
                            "steps_shrunk"):  # fmt: skip
                    values = got.get((arm, layout, dim, key))
                    if values is None:
                        continue
                    text = crash_note + (how[arm] if key.endswith("_s") else "")
                    runs = len(got[(arm, layout, dim, "recovery_s")])
                    whole = len(got.get((arm, layout, dim, "whole_s"), []))
                    if key == "recovery_s" and whole < runs:
                        text += (f"; in {runs - whole} of {runs} run(s) never whole again "
                                 "before the run's end")  # fmt: skip
                    rows.append(make_row(system=arm, scenario=SCENARIO, metric=f"{key}[{kind}]",
                                         values=values, note=text))  # fmt: skip
    return rows


def plot(rows: list[Row], path: Path) -> None:
    """Recovery time against a replica's state size, one line per layout and system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for layout in LAYOUTS:
        for arm, style in (("unicron", "-o"), ("torchrun", "--s"), ("torchft", ":^")):
            pts = sorted(
                (state_mb(int(r["metric"].split("/dim")[1][:-1])), r["median"])
                for r in rows
                if r["system"] == arm
                and r["metric"].startswith(f"whole_s[{layout}/")
                and r["median"] is not None
            )
            if pts:
                label = (
                    f"{arm} {layout}"
                    + {
                        "unicron": " (replica re-formed)",
                        "torchrun": " (job restarted)",
                        "torchft": " (other group alone)",
                    }[arm]
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xlabel("state of one replica (MB: parameters + AdamW moments)")
    ax.set_ylabel("fault -> interrupted step done, whole batch (s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("A lost rank of a model-parallel replica (4 CPU workers, gloo)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.tp", __doc__, quick="the smallest model, fewer steps, one repetition")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="Model-parallel replicas: Unicron vs torchrun and torchft, "
                "TP=2, PP=2 and FSDP=2 x DP=2")  # fmt: skip
    # a full run measured every row of the scenario: it replaces them all
    results = ROOT / "bench" / "results"
    save_scenario(rows, SCENARIO, results, replace=not quick)
    plot(load_rows(results / f"{SCENARIO}.json"), results / "tp.png")  # every size measured
    write_summary(ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
