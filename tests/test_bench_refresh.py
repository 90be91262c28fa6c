"""The refresh of every benchmark on one version of the code (bench/refresh.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import refresh
from bench.common import RESULTS_DIR, make_row, save_scenario


def test_every_results_file_has_the_benchmark_that_writes_it() -> None:
    """A results file no entry writes would never be refreshed: its figures would go stale."""
    written = [stem for e in refresh.ENTRIES for stem in e.files]
    assert len(written) == len(set(written)), "two benchmarks write one file"
    rows_files = {
        p.stem
        for p in RESULTS_DIR.glob("*.json")
        if isinstance(json.loads(p.read_text(encoding="utf-8")), list)
    }
    assert rows_files <= set(written), rows_files - set(written)


def test_every_entry_runs_a_module_or_script_of_the_checkout() -> None:
    root = Path(refresh.__file__).resolve().parents[1]
    for cmd in [e.argv for e in refresh.ENTRIES] + list(refresh.DERIVED):
        if cmd[0] == "-m":
            assert importlib.util.find_spec(cmd[1]) is not None, cmd
        else:
            assert (root / cmd[0]).is_file(), cmd


def _rows(tmp: Path, scenario: str, commit: str | None) -> None:
    row = make_row(system="unicron", scenario=scenario, metric="wall_s", values=[1.0])
    if commit is None:
        del row["commit"]
    else:
        row["commit"] = commit
    save_scenario([row], scenario, tmp)


def test_an_entry_is_current_only_when_every_row_of_every_file_measured_this_code(
    tmp_path: Path,
) -> None:
    cluster = next(e for e in refresh.ENTRIES if e.name == "cluster")
    assert not refresh.current(cluster, "abc", tmp_path)  # nothing measured yet
    _rows(tmp_path, "cluster-kill", "abc")
    _rows(tmp_path, "cluster-load", "abc")
    assert not refresh.current(cluster, "abc", tmp_path)  # a file missing
    _rows(tmp_path, "cluster-node", None)  # a row from before commits were recorded
    assert not refresh.current(cluster, "abc", tmp_path)
    assert refresh.commits(cluster, tmp_path)[0] == {"abc", "?"}
    _rows(tmp_path, "cluster-node", "abc")
    assert refresh.current(cluster, "abc", tmp_path)
    assert not refresh.current(cluster, "def", tmp_path)
    table = "\n".join(refresh.status("abc", tmp_path))
    assert "| cluster | cluster-kill, cluster-load, cluster-node | abc | " in table
    assert "| chaos | chaos | - | never | 0 | no |" in table
    bad = make_row(system="torchft", scenario="cluster-kill", metric="trial", status="failed")
    save_scenario([{**bad, "commit": "abc"}], "cluster-kill", tmp_path)
    assert refresh.failed(cluster, tmp_path) == 1 and refresh.current(cluster, "abc", tmp_path)


def test_a_refresh_refuses_code_that_is_not_committed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(refresh, "code_version", lambda: "abc1234+dirty")
    assert refresh.main([]) == 2
    assert "commit it first" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        refresh.main(["--only", "nope"])
    assert bad.value.code == 2
