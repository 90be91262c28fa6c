"""Calibration of the performance model against published training runs (docs/planner.md).

The runs live in ``unicron/planner/data/runs.yaml`` with their sources, split into a
calibration set (the fitted constants of :class:`~unicron.planner.perf.PerfOptions` and
:data:`~unicron.planner.hardware.GPU_PRESETS` come from it) and a held-out set (never used
to fit; it says how far off the model is on runs it has not seen). :func:`predict` prices
one run at its published layout; :func:`report` does all; :func:`fit` searches the
constants again. ``python -m unicron.planner.calibration`` prints the table (``--fit``
refits first, ``--json`` prints JSON); ``bench/planner.py --accuracy`` writes it to
bench/results/. Throughput is compared per GPU in tokens/s: published TFLOP/s figures are
converted with the source's own formula (Megatron's eq. 3 counts the recomputed forward
pass; model FLOPs do not), so hardware and model FLOPs are never mixed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from unicron.planner import hardware
from unicron.planner.hardware import GIB, GPU_PRESETS, GPUSpec
from unicron.planner.model import MODEL_PRESETS, ModelSpec
from unicron.planner.perf import (
    DEFAULT_OPTIONS,
    Layout,
    ParallelConfig,
    PerfOptions,
    best_split,
    evaluate,
    megatron_flops_per_gpu,
)

DATA = Path(__file__).with_name("data") / "runs.yaml"
FROZEN = Path(__file__).with_name("data") / "heldout.yaml"
"""The frozen held-out set: its run ids, the digest of their entries and every change made
to them since, with the reason (:func:`held_out_digest`, :func:`check_frozen`)."""
TOLERANCE = 0.15
"""The goal: predicted throughput per GPU within 15% of the published figure."""
STACK_MEGATRON_2021 = 0.74
"""Fitted software-stack multiplier of the Megatron-LM of 2021 (fp16, no fused attention)."""
UNITS = ("tokens_per_s_per_gpu", "model_tflops_per_gpu", "megatron_tflops_per_gpu")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One published run: what was trained, how, and how fast."""

    id: str
    set: str
    """``calibration`` or ``held-out``."""
    source: str
    gpu: GPUSpec
    gpus: int
    model: ModelSpec
    global_batch: int
    layout: dict[str, Any]
    """The published layout fields; absent ones (micro-batch, vp, recompute, the layer split)
    are searched (``interleaved: true``: the source says the schedule is interleaved, vp > 1
    searched; ``split``: :attr:`~unicron.planner.perf.Layout.split`, else the search's)."""
    precision: str
    stack: str
    """``current`` or ``megatron-2021``."""
    value: float
    unit: str

    @property
    def generation(self) -> str:
        return "H100" if self.gpu.name.startswith("H") else "A100"

    def published_tokens_per_gpu(self) -> float:
        """The published figure in tokens/s per GPU, converted with the source's formula."""
        if self.unit == "tokens_per_s_per_gpu":
            return self.value
        if self.unit == "model_tflops_per_gpu":
            return self.value * 1e12 / self.model.flops_per_token
        per_token = megatron_flops_per_gpu(self.model, 1, 1, 1.0) / self.model.seq_len
        return self.value * 1e12 / per_token


@dataclass(frozen=True, kw_only=True)
class Prediction:
    run: Run
    config: ParallelConfig
    fits: bool
    """The model's memory estimate fits the GPU at the published layout (the run did)."""
    tokens_per_gpu: float

    @property
    def published(self) -> float:
        return self.run.published_tokens_per_gpu()

    @property
    def error(self) -> float:
        return self.tokens_per_gpu / self.published - 1.0


def _model(name: str, seq: int, models: dict[str, Any]) -> ModelSpec:
    if name in models:
        return ModelSpec(name=name, seq_len=seq, **models[name])
    return replace(MODEL_PRESETS[name], seq_len=seq)


@cache
def load_runs(path: Path = DATA) -> tuple[Run, ...]:
    """Every run of the data file, in file order."""
    doc = yaml.safe_load(path.read_text())
    sources, models = doc["sources"], doc["models"]
    runs = []
    for r in doc["runs"]:
        assert r["source"] in sources, f"{r['id']}: unknown source {r['source']}"
        assert r["set"] in ("calibration", "held-out"), r["id"]
        assert r["published"]["unit"] in UNITS, r["id"]
        runs.append(
            Run(
                id=r["id"],
                set=r["set"],
                source=r["source"],
                gpu=GPU_PRESETS[r["gpu"]],
                gpus=r["gpus"],
                model=_model(r["model"], r["seq"], models),
                global_batch=r["batch"],
                layout=dict(r["layout"]),
                precision=r.get("precision", "bf16"),
                stack=r.get("stack", "current"),
                value=float(r["published"]["value"]),
                unit=r["published"]["unit"],
            )
        )
    return tuple(runs)


def held_out_digest(path: Path = DATA) -> str:
    """SHA-256 of the held-out runs' entries as the data file has them (each run with its
    source's and its model's entry, canonical JSON, in id order): any edit to a held-out run,
    its source note or its model shape changes it."""
    import hashlib

    doc = yaml.safe_load(path.read_text())
    entries = [
        {"run": r, "source": doc["sources"][r["source"]], "model": doc["models"].get(r["model"])}
        for r in sorted(doc["runs"], key=lambda r: r["id"])
        if r["set"] == "held-out"
    ]
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def check_frozen(path: Path = DATA, frozen: Path = FROZEN) -> list[str]:
    """What differs between the data file's held-out runs and the frozen record: ids added or
    dropped, or a digest that no recorded change accounts for (the last change's digest must
    be the current one). Empty when the protocol holds; tests/test_planner_calibration.py."""
    record = yaml.safe_load(frozen.read_text())
    ids = sorted(
        r["id"] for r in yaml.safe_load(path.read_text())["runs"] if r["set"] == "held-out"
    )
    out = []
    if ids != sorted(record["runs"]):
        gone, new = set(record["runs"]) - set(ids), set(ids) - set(record["runs"])
        out.append(
            f"held-out ids differ from {frozen.name}: dropped {sorted(gone)}, added {sorted(new)}"
        )
    last = record["changes"][-1] if record.get("changes") else record
    if last["digest"] != held_out_digest(path):
        out.append(
            f"held-out entries changed without a record in {frozen.name} (digest "
            f"{held_out_digest(path)[:12]}...): add a change with its date, runs, what and why"
        )
    return out


def sources(path: Path = DATA) -> dict[str, dict[str, Any]]:
    """The data file's sources (citation, where in it, whether recomputation is counted)."""
    return dict(yaml.safe_load(path.read_text())["sources"])


def options_for(
    run: Run, base: PerfOptions = DEFAULT_OPTIONS, stack: float | None = None
) -> PerfOptions:
    """The performance-model options a run was made with (precision, software stack)."""
    opts = replace(base, precision=run.precision)
    if run.stack == "megatron-2021":
        opts = replace(
            opts,
            stack_efficiency=STACK_MEGATRON_2021 if stack is None else stack,
            flash_attention=False,
            overlap=False,
            distributed_optimizer=False,
            fsdp=False,
            selective_recompute=False,
        )
    return opts


def _candidates(run: Run) -> list[Layout]:
    lay = run.layout
    tp, pp, cp = lay.get("tp", 1), lay.get("pp", 1), lay.get("cp", 1)
    dp = run.gpus // (tp * pp * cp)
    assert dp * tp * pp * cp == run.gpus, run.id
    if "vp" in lay:
        vps = [lay["vp"]]
    else:
        vps = [v for v in (2, 4, 8) if pp > 1 and best_split(run.model, pp, v) is not None]
        if not lay.get("interleaved", False):
            vps.insert(0, 1)
    splits = {v: best_split(run.model, pp, v) for v in vps}
    if "split" in lay:  # the source says how the layers were split
        splits = {v: Layout(pp=pp, vp=v, split=lay["split"]) for v in vps}
    mbs = [lay["mb"]] if "mb" in lay else [b for b in (1, 2, 4, 8) if run.global_batch % b == 0]
    recs = [lay["recompute"]] if "recompute" in lay else ["none", "selective", "full"]
    out = []
    for vp, mb, rec in itertools.product(vps, mbs, recs):
        split = splits[vp]
        if split is None:  # Megatron-Core cannot split the layers so: not a published layout
            continue
        m = math.ceil(run.global_batch / (mb * dp))
        if vp > 1 and "vp" not in lay and m % pp:
            continue
        out.append(
            replace(
                split,
                tp=tp,
                cp=cp,
                dp=dp,
                micro_batch=mb,
                sharding=lay.get("sharding", "dist-opt"),
                recompute=rec,
            )
        )
    return out


def predict(run: Run, options: PerfOptions | None = None, gpu: GPUSpec | None = None) -> Prediction:
    """Price ``run`` at its published layout; unknown fields take the fastest value that fits."""
    opts = options if options is not None else options_for(run)
    g = gpu if gpu is not None else run.gpu
    best: tuple[bool, float, ParallelConfig] | None = None
    for lay in _candidates(run):
        cfg = evaluate(run.model, run.global_batch, lay, g, 8, opts)
        fits = cfg.memory_bytes_per_gpu <= cfg.usable_bytes
        key = (fits, -cfg.iter_time_s, cfg)
        if best is None or key[:2] > best[:2]:
            best = key
    assert best is not None, run.id
    fits, _, cfg = best
    tokens = run.global_batch * run.model.seq_len / cfg.iter_time_s / run.gpus
    return Prediction(run=run, config=cfg, fits=fits, tokens_per_gpu=tokens)


def megatron_2021() -> tuple[Run, ...]:
    """The Narayanan et al. 2021 runs (the model's first calibration, kept for comparison)."""
    return tuple(r for r in load_runs() if r.source == "megatron-2021")


def predict_measurement(
    run: Run, gpu: GPUSpec | None = None, options: PerfOptions | None = None
) -> float:
    """Predicted TFLOP/s per GPU of ``run`` in Megatron's eq. 3 unit (recompute counted)."""
    pred = predict(run, options, gpu)
    per_gpu = megatron_flops_per_gpu(run.model, run.global_batch, run.gpus, pred.config.iter_time_s)
    return per_gpu / 1e12


# -- fitting ---------------------------------------------------------------------------------

PARAMS = (
    "ampere",
    "hopper",
    "efficiency_half_hidden",
    "efficiency_half_tokens",
    "ampere_attention",
    "hopper_attention",
    "fp8_efficiency",
    "overlap_cost",
    "stack_2021",
)


def current_params() -> dict[str, float]:
    """The constants in force: GPU efficiencies, :class:`PerfOptions` defaults, the 2021 stack."""
    return {
        "ampere": hardware.EFFICIENCY_AMPERE,
        "hopper": hardware.EFFICIENCY_HOPPER,
        "efficiency_half_hidden": DEFAULT_OPTIONS.efficiency_half_hidden,
        "efficiency_half_tokens": DEFAULT_OPTIONS.efficiency_half_tokens,
        "ampere_attention": hardware.ATTENTION_AMPERE,
        "hopper_attention": hardware.ATTENTION_HOPPER,
        "fp8_efficiency": DEFAULT_OPTIONS.fp8_efficiency,
        "overlap_cost": DEFAULT_OPTIONS.overlap_cost,
        "stack_2021": STACK_MEGATRON_2021,
    }


def _predict_with(run: Run, p: dict[str, float]) -> Prediction:
    base = replace(
        DEFAULT_OPTIONS,
        efficiency_half_hidden=p["efficiency_half_hidden"],
        efficiency_half_tokens=p["efficiency_half_tokens"],
        fp8_efficiency=p["fp8_efficiency"],
        overlap_cost=p["overlap_cost"],
    )
    gen = "hopper" if run.generation == "H100" else "ampere"
    gpu = replace(run.gpu, efficiency=p[gen], attention_efficiency=p[f"{gen}_attention"])
    return predict(run, options_for(run, base, stack=p["stack_2021"]), gpu)


def _loss(runs: Sequence[Run], p: dict[str, float]) -> float:
    errs = [
        math.log(_predict_with(r, p).tokens_per_gpu / r.published_tokens_per_gpu()) for r in runs
    ]
    return float(np.sqrt(np.mean(np.square(errs))))


def fit(runs: Sequence[Run] | None = None, rounds: int = 4) -> dict[str, float]:
    """Coordinate search of :data:`PARAMS` minimising the RMS log error on the calibration set."""
    calib = [r for r in (runs or load_runs()) if r.set == "calibration"]
    p = current_params()
    bounds = {
        "ampere": (0.3, 1.0),
        "hopper": (0.3, 1.0),
        "efficiency_half_hidden": (0.0, 4000.0),
        "efficiency_half_tokens": (0.0, 4000.0),
        "ampere_attention": (0.2, 2.0),
        "hopper_attention": (0.2, 2.0),
        "fp8_efficiency": (0.2, 1.0),
        "overlap_cost": (0.0, 0.9),
        "stack_2021": (0.3, 1.5),
    }
    best = _loss(calib, p)
    step = 0.2
    for _ in range(rounds):
        for name in PARAMS:
            lo, hi = bounds[name]
            for factor in (1 - step, 1 - step / 2, 1 + step / 2, 1 + step):
                trial = dict(p)
                start = p[name] if p[name] else (lo + hi) / 4
                trial[name] = min(hi, max(lo, start * factor))
                loss = _loss(calib, trial)
                if loss < best - 1e-9:
                    best, p = loss, trial
        step /= 2
    return p


# -- the report --------------------------------------------------------------------------------


def report(runs: Sequence[Run] | None = None) -> list[Prediction]:
    """Every run predicted with the constants in force."""
    return [predict(r) for r in (runs or load_runs())]


def summary(preds: Sequence[Prediction]) -> list[dict[str, Any]]:
    """Per set and GPU generation: runs, share within :data:`TOLERANCE`, RMS and worst error."""
    out = []
    for set_ in ("calibration", "held-out"):
        for gen in ("A100", "H100"):
            errs = [p.error for p in preds if p.run.set == set_ and p.run.generation == gen]
            if not errs:
                continue
            out.append(
                {
                    "set": set_,
                    "generation": gen,
                    "runs": len(errs),
                    "within_15pct": sum(abs(e) <= TOLERANCE for e in errs),
                    "share_within": sum(abs(e) <= TOLERANCE for e in errs) / len(errs),
                    "rms_error": float(np.sqrt(np.mean(np.square(errs)))),
                    "max_abs_error": float(max(abs(e) for e in errs)),
                }
            )
    return out


def markdown(preds: Sequence[Prediction]) -> str:
    """The table docs/planner.md shows."""
    lines = [
        "| run | set | GPU | GPUs | layout | published tok/s/GPU | model | error "
        "| memory GiB (usable) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in preds:
        mem = f"{p.config.memory_bytes_per_gpu / GIB:.0f} ({p.config.usable_bytes / GIB:.0f})"
        if not p.fits:
            mem += " over"
        lines.append(
            f"| {p.run.id} | {p.run.set} | {p.run.gpu.name} | {p.run.gpus} | "
            f"{p.config.describe()} | {p.published:,.0f} | {p.tokens_per_gpu:,.0f} | "
            f"{100 * p.error:+.1f}% | {mem} |"
        )
    lines += [
        "",
        "| set | GPU | runs | within 15% | RMS error | worst |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary(preds):
        lines.append(
            f"| {s['set']} | {s['generation']} | {s['runs']} | {s['within_15pct']} "
            f"({100 * s['share_within']:.0f}%) | {100 * s['rms_error']:.1f}% | "
            f"{100 * s['max_abs_error']:.1f}% |"
        )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The planner's own pick for a run's model, batch and GPUs, against what was published."""

    run: Run
    config: ParallelConfig | None
    """:func:`~unicron.planner.perf.best_config` with the run's options; None: nothing fits."""
    best_published: float
    """The best published tokens/s per GPU of the same model (shape and sequence) on the same
    GPU, in any run of the data file."""

    @property
    def tokens_per_gpu(self) -> float:
        if self.config is None:
            return 0.0
        return (
            self.run.global_batch * self.run.model.seq_len / self.config.iter_time_s / self.run.gpus
        )

    @property
    def over_best(self) -> float:
        """How much faster than the best published run the planner predicts its pick."""
        return self.tokens_per_gpu / self.best_published - 1.0

    @property
    def same_layout(self) -> bool:
        """The pick is the published layout (every degree the source gives)."""
        if self.config is None or self.config.layout is None:
            return False
        lay, pub = self.config.layout, self.run.layout
        dp = self.run.gpus // (pub.get("tp", 1) * pub.get("pp", 1) * pub.get("cp", 1))
        fields: dict[str, object] = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "vp": lay.vp}
        fields |= {"mb": lay.micro_batch, "sharding": lay.sharding}
        fields |= {"recompute": lay.recompute, "split": lay.split}
        degrees = all(pub.get(k, 1) == fields[k] for k in ("tp", "pp", "cp"))
        return lay.dp == dp and degrees and all(pub[k] == v for k, v in fields.items() if k in pub)


def choices(runs: Sequence[Run] | None = None) -> list[Choice]:
    """Every run's model, batch and GPU count planned from scratch (slow: seconds a run)."""
    from unicron.planner.perf import best_config

    runs = runs or load_runs()
    best: dict[tuple[str, int, str, str], float] = {}
    for r in runs:
        key = (r.model.name, r.model.seq_len, r.gpu.name, r.precision)
        best[key] = max(best.get(key, 0.0), r.published_tokens_per_gpu())
    out = []
    for r in runs:
        cfg = best_config(r.model, r.global_batch, r.gpus, r.gpu, 8, options_for(r))
        key = (r.model.name, r.model.seq_len, r.gpu.name, r.precision)
        out.append(Choice(run=r, config=cfg, best_published=best[key]))
    return out


def choice_markdown(picks: Sequence[Choice]) -> str:
    """The table of the planner's own picks docs/planner.md shows."""
    lines = [
        "| run | set | GPUs | the planner's layout | predicted tok/s/GPU | best published "
        "| over best | published layout? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in picks:
        lay = c.config.describe() if c.config is not None else "none fits"
        lines.append(
            f"| {c.run.id} | {c.run.set} | {c.run.gpus} | {lay} | {c.tokens_per_gpu:,.0f} | "
            f"{c.best_published:,.0f} | {100 * c.over_best:+.1f}% | "
            f"{'yes' if c.same_layout else 'no'} |"
        )
    lines += [
        "",
        "| set | GPU | runs | pick at most 15% over the best published | worst | "
        "picks that are the published layout: error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for set_ in ("calibration", "held-out"):
        for gen in ("A100", "H100"):
            group = [c for c in picks if c.run.set == set_ and c.run.generation == gen]
            if not group:
                continue
            ok = sum(c.over_best <= TOLERANCE for c in group)
            same = [c for c in group if c.same_layout]
            errs = ", ".join(
                f"{c.run.id} {100 * (c.tokens_per_gpu / c.run.published_tokens_per_gpu() - 1):+.1f}%"  # noqa: E501
                for c in same
            )
            lines.append(
                f"| {set_} | {gen} | {len(group)} | {ok} ({100 * ok / len(group):.0f}%) | "
                f"{100 * max(c.over_best for c in group):+.1f}% | {errs or 'none'} |"
            )
    return "\n".join(lines)


def as_json(preds: Sequence[Prediction]) -> dict[str, Any]:
    return {
        "runs": [
            {
                "id": p.run.id,
                "set": p.run.set,
                "source": p.run.source,
                "gpu": p.run.gpu.name,
                "gpus": p.run.gpus,
                "layout": p.config.describe(),
                "published_tokens_per_s_per_gpu": p.published,
                "predicted_tokens_per_s_per_gpu": p.tokens_per_gpu,
                "error": p.error,
                "memory_gib": p.config.memory_bytes_per_gpu / GIB,
                "usable_gib": p.config.usable_bytes / GIB,
                "fits": p.fits,
            }
            for p in preds
        ],
        "summary": summary(preds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unicron.planner.calibration")
    parser.add_argument("--fit", action="store_true", help="refit the constants, print them")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--digest",
        action="store_true",
        help="print the held-out runs' digest (for a recorded change in data/heldout.yaml)",
    )
    parser.add_argument(
        "--choice",
        action="store_true",
        help="plan every run from scratch and compare the pick with the best published run "
        "(instead of the accuracy table)",
    )
    args = parser.parse_args(argv)
    if args.digest:
        print(held_out_digest())
        return 0
    if args.fit:
        params = fit()
        print(json.dumps(params, indent=2))
        return 0
    if args.choice and not args.json:
        print(choice_markdown(choices()))
        return 0
    preds = report()
    print(json.dumps(as_json(preds), indent=2) if args.json else markdown(preds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
