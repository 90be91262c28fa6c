"""Row schema, result files and the generated summary of the benchmark suite (bench/common.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.common import (
    ROW_KEYS,
    check_row,
    code_version,
    load_rows,
    machine,
    make_row,
    record_run,
    save_scenario,
    summary_markdown,
    write_summary,
)


def test_make_row_has_the_schema() -> None:
    row = make_row(system="unicron", scenario="crash", metric="recovery_s", values=[3.0, 1.0, 2.0])
    assert set(ROW_KEYS) <= row.keys()
    assert (row["median"], row["min"], row["max"], row["repetitions"]) == (2.0, 1.0, 3.0, 3)
    assert row["unit"] == "s" and row["status"] == "ok"
    assert "cores" in row["machine"] and "torch" in row["machine"]
    check_row(row)


def test_a_row_names_the_commit_it_measured() -> None:
    row = make_row(system="unicron", scenario="crash", metric="wall_s", values=[1.0])
    root = str(Path(__file__).resolve().parents[1])
    last = subprocess.run(  # the last commit of the code, not of results or docs
        ["git", "-C", root, "log", "-1", "--format=%H", "--", "unicron", "bench", "examples",
         "pyproject.toml", ":(exclude)bench/results",
         ":(exclude)unicron/sim/data/measured.json"],
        capture_output=True,
        text=True,
    ).stdout.strip()[:12]  # fmt: skip
    assert row["commit"] == code_version()
    assert row["commit"].removesuffix("+dirty") == (last or "unknown")
    with pytest.raises(ValueError, match="commit"):
        check_row({**row, "commit": ""})
    legacy = {k: v for k, v in row.items() if k != "commit"}
    check_row(legacy)  # rows written before commits were recorded stay readable


def test_failed_row_needs_no_figures() -> None:
    row = make_row(system="torchft", scenario="crash", metric="trial", status="failed", note="boom")
    check_row(row)
    assert row["median"] is None and row["repetitions"] == 0


@pytest.mark.parametrize(
    "change",
    [{"status": "great"}, {"median": None}, {"min": 5.0}, {"system": ""}, {"repetitions": -1}],
)
def test_check_row_rejects_bad_rows(change: dict[str, object]) -> None:
    row = make_row(system="a", scenario="b", metric="wall_s", values=[1.0, 2.0])
    row.update(change)
    with pytest.raises(ValueError):
        check_row(row)


def test_make_row_rejects_unknown_status() -> None:
    with pytest.raises(ValueError, match="status"):
        make_row(system="a", scenario="b", metric="c", status="meh")


def test_save_merges_by_system_and_metric(tmp_path: Path) -> None:
    host = machine()
    first = [
        make_row(system=s, scenario="crash", metric="wall_s", values=[1.0], host=host)
        for s in ("unicron", "torchrun K=10")
    ]
    save_scenario(first, "crash", tmp_path)
    again = [make_row(system="unicron", scenario="crash", metric="wall_s", values=[9.0], host=host)]
    path = save_scenario(again, "crash", tmp_path)
    rows = load_rows(path)
    assert {r["system"]: r["median"] for r in rows} == {"torchrun K=10": 1.0, "unicron": 9.0}
    assert json.loads(path.read_text()) == rows
    assert not list(tmp_path.glob("*.tmp"))


def test_summary_is_generated_from_the_files(tmp_path: Path) -> None:
    assert "No results yet" in summary_markdown(tmp_path)
    rows = [
        make_row(system="unicron", scenario="crash", metric="recovery_s", values=[0.25, 0.3]),
        make_row(
            system="torchft",
            scenario="crash",
            metric="trial",
            status="failed",
            note="ImportError: x | y",
        ),
    ]
    save_scenario(rows, "crash", tmp_path)
    text = write_summary(tmp_path).read_text()
    assert "## crash" in text and "| unicron | recovery_s | 0.275 s |" in text
    assert "ImportError: x \\| y" in text  # pipes escaped inside the table
    assert "do not edit by hand" in text
    assert f", on {code_version()}." in text  # which code the figures are of


def test_save_with_replace_drops_rows_this_run_no_longer_makes(tmp_path: Path) -> None:
    old = [
        make_row(system=s, scenario="error", metric="wall_s[oom]", values=[1.0])
        for s in ("unicron", "torchrun K=10 timeout=60s")
    ]
    save_scenario(old, "error", tmp_path)
    new = [make_row(system="unicron", scenario="error", metric="wall_s[oom]", values=[2.0])]
    rows = load_rows(save_scenario(new, "error", tmp_path, replace=True))
    assert [(r["system"], r["median"]) for r in rows] == [("unicron", 2.0)]


def test_runs_are_recorded_per_mode_and_summarised(tmp_path: Path) -> None:
    save_scenario(
        [make_row(system="unicron", scenario="crash", metric="wall_s", values=[1.0])],
        "crash",
        tmp_path,
    )
    for mode, total in (("full", 3000.0), ("quick", 540.0), ("full", 3120.0)):
        record_run(
            tmp_path,
            mode,
            started="2026-11-29T22:00:00Z",
            total_s=total,
            scenarios_s={"crash": total / 2, "steady": total / 2},
            settings={"reps": 3},
        )
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert set(runs) == {"full", "quick"} and runs["full"]["total_s"] == 3120.0
    assert runs["full"]["settings"] == {"reps": 3} and "cores" in runs["full"]["machine"]
    text = summary_markdown(tmp_path)
    assert "| full | 2026-11-29T22:00:00Z | 52.0 min | crash 26.0, steady 26.0 |" in text
    assert "| quick |" in text and "## runs" not in text  # not a results file
