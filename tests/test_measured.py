"""The simulator's measured constants: derived from ``bench/results`` into package data
(:mod:`bench.measured`), read only from there (:mod:`unicron.sim.measured`), the same from
an installed wheel as from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import measured as bench_measured
from unicron.sim import measured
from unicron.sim.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]


def _row(metric: str, value: float, date: str = "2026-01-02T03:04:05Z") -> dict[str, object]:
    return {"system": "unicron", "metric": metric, "median": value, "date": date}


def _results(tmp: Path) -> Path:
    res = tmp / "results"
    res.mkdir()
    other = {"system": "torchrun", "metric": "detection_s[nccl]", "median": 9.0}
    files = {
        "error": [_row("detection_s[nccl]", 0.03), _row("detection_s[cuda]", 0.07), other],
        "crash": [_row("detection_s", 0.05)],
        "node": [_row("detection_heartbeat_s", 0.9), _row("detection_s", 0.1)],
        "hang": [_row("detection_s", 2.5)],
    }
    for name, rows in files.items():
        (res / f"{name}.json").write_text(json.dumps(rows))
    return res


def test_constants_are_derived_from_the_unicron_rows_and_read_back(tmp_path: Path) -> None:
    res = _results(tmp_path)
    out = tmp_path / "measured.json"
    doc = bench_measured.write(out, res)
    assert doc["provenance"]["command"] == "python -m bench.measured"
    assert {s["file"] for s in doc["sources"]} == {
        "error.json",
        "crash.json",
        "node.json",
        "hang.json",
    }
    m = measured.load(out)
    got = (m.exception_detect_s, m.exit_detect_s, m.node_detect_s, m.hang_floor_s)
    assert got == pytest.approx((0.03, 0.06, 0.9, 2.5))
    assert m.source.startswith("bench/results (2026-01-02) via python -m bench.measured")
    assert bench_measured.stale(doc, res) == []


def test_a_results_folder_without_a_needed_row_is_refused(tmp_path: Path) -> None:
    res = _results(tmp_path)
    (res / "hang.json").write_text("[]")
    with pytest.raises(bench_measured.ResultsError, match=r"hang\.json.*hang_floor_s"):
        bench_measured.derive(res)
    assert bench_measured.main(["--results", str(res), "--out", str(tmp_path / "m.json")]) == 2
    assert not (tmp_path / "m.json").exists()


def test_a_missing_or_malformed_data_file_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    fix = r"missing\.json.*python -m bench\.measured"
    with pytest.raises(measured.MeasuredDataError, match=fix):
        measured.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"constants": {"exit_detect_s": 1.0}}))
    with pytest.raises(measured.MeasuredDataError, match="exception_detect_s"):
        measured.load(bad)


def test_a_stale_data_file_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _results(tmp_path)
    out = tmp_path / "measured.json"
    doc = bench_measured.write(out, res)
    args = ["--check", "--results", str(res), "--out", str(out)]
    assert bench_measured.main(args) == 0
    doc["provenance"]["date"] = "2026-03-01T00:00:00Z"
    out.write_text(json.dumps(doc))
    # a rerun of the node scenario since: new rows, dated after the file was written
    rerun = _row("detection_heartbeat_s", 0.7, "2026-06-01T00:00:00Z")
    (res / "node.json").write_text(json.dumps([rerun]))
    assert bench_measured.main(args) == 1
    err = capsys.readouterr().err
    assert "warning:" in err and "stale" in err
    assert "before source rows of 2026-06-01T00:00:00Z" in err
    assert "differs: node_detect_s" in err
    assert bench_measured.refresh(out, res)  # the suite's last step rewrites it ...
    assert bench_measured.main(args) == 0
    written = out.read_text()
    assert not bench_measured.refresh(out, res)  # ... and leaves a fresh one alone
    assert out.read_text() == written


def test_the_package_data_file_is_fresh_and_the_policy_uses_it() -> None:
    doc = json.loads(measured.DATA.read_text())
    assert bench_measured.stale(doc) == [], "run python -m bench.measured"
    uni = make_policy("unicron")
    assert uni.node_detect_s == doc["constants"]["node_detect_s"]  # type: ignore[attr-defined]


def _simulate(cwd: Path, pythonpath: Path, out: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    where = subprocess.run(
        [sys.executable, "-c", "import unicron.sim.measured as m; print(m.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(pythonpath), where  # the copy meant, not another one
    args = ["--rate", "0.4", "--days", "1", "--policies", "unicron,megatron", "--out", out]
    p = subprocess.run(
        [sys.executable, "-m", "unicron", "simulate", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    summary: dict[str, object] = json.loads((cwd / out / "summary.json").read_text())
    return summary


@pytest.mark.long
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_simulate_from_an_installed_wheel_matches_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build's own files stay out of the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "unicron", src / "unicron", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(dist),
        ],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=180,
    )
    (wheel,) = dist.glob("unicron-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=180,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    installed = _simulate(outside, site, "out")
    checkout = _simulate(ROOT, ROOT, str(tmp_path / "out-checkout"))
    meta = installed["meta"]
    assert isinstance(meta, dict) and "bench/results" in meta["unicron_constants"]["source"]
    assert installed == checkout
