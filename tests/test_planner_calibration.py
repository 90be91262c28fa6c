"""Calibration: the published runs, their sources, the fit, and the held-out accuracy."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from unicron.planner import calibration

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def preds() -> list[calibration.Prediction]:
    return calibration.report()


def test_every_run_names_a_source_and_the_sets_are_separate() -> None:
    runs = calibration.load_runs()
    sources = calibration.sources()
    ids = Counter(r.id for r in runs)
    assert max(ids.values()) == 1
    for source in sources.values():
        assert source["cite"] and source["where"] and isinstance(source["recompute_counted"], bool)
    for r in runs:
        assert r.source in sources and r.unit in calibration.UNITS
        # the recomputed pass is counted exactly when the figure is in Megatron's eq. 3 unit
        assert sources[r.source]["recompute_counted"] == (r.unit == "megatron_tflops_per_gpu")
    per_set = Counter((r.set, r.generation) for r in runs)
    for gen in ("A100", "H100"):
        assert per_set[("calibration", gen)] >= 5 and per_set[("held-out", gen)] >= 10


def test_units_are_converted_with_the_source_formula() -> None:
    run = next(r for r in calibration.load_runs() if r.id == "m21-175b-1536")
    # eq. 3 counts four passes (the recomputed forward): tokens/s = TFLOP/s / eq3 per token
    m = run.model
    eq3 = (
        96
        * m.layers
        * m.hidden**2
        * (1 + m.seq_len / (6 * m.hidden) + m.vocab / (16 * m.layers * m.hidden))
    )
    assert run.published_tokens_per_gpu() == pytest.approx(141e12 / eq3)
    llama = next(r for r in calibration.load_runs() if r.id == "llama3-405b-8k-16384")
    assert llama.published_tokens_per_gpu() == pytest.approx(400e12 / llama.model.flops_per_token)


def test_calibration_set_is_fitted(preds: list[calibration.Prediction]) -> None:
    rows = {(s["set"], s["generation"]): s for s in calibration.summary(preds)}
    assert rows[("calibration", "A100")]["rms_error"] < 0.06
    assert rows[("calibration", "H100")]["rms_error"] < 0.15


def test_held_out_accuracy(preds: list[calibration.Prediction]) -> None:
    """The goal is 80% of held-out runs within 15% on each generation. A100 meets it; H100
    does not yet (docs/planner.md: Llama 3 405B and NeMo Llama 3 8B); this pins what is
    measured so that a change making it worse fails."""
    rows = {(s["set"], s["generation"]): s for s in calibration.summary(preds)}
    assert rows[("held-out", "A100")]["share_within"] >= 0.80
    assert rows[("held-out", "H100")]["share_within"] >= 0.70
    for gen in ("A100", "H100"):
        assert rows[("held-out", gen)]["rms_error"] < 0.20


def test_memory_estimate_fits_most_published_layouts(preds: list[calibration.Prediction]) -> None:
    fits = [p.fits for p in preds]
    assert sum(fits) / len(fits) >= 0.85
    # the A100-40GB runs are tight: the model must not call the big ones impossible
    tight = [p for p in preds if p.run.gpu.name == "A100-40GB" and p.run.model.params > 5e9]
    assert tight and all(p.fits for p in tight)


def test_the_constants_in_force_are_the_fitted_ones() -> None:
    # refitting from them gains next to nothing on the calibration set (RMS log error)
    calib = [r for r in calibration.load_runs() if r.set == "calibration"]
    now = calibration._loss(calib, calibration.current_params())
    fitted = calibration.fit(rounds=1)
    assert all(math.isfinite(v) for v in fitted.values())
    assert calibration._loss(calib, fitted) > now - 0.005


def test_command_prints_the_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "unicron.planner.calibration"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| held-out | H100 |" in proc.stdout and "llama3-405b-8k-16384" in proc.stdout
