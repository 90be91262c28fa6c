"""The refresh of every benchmark on one version of the code (bench/refresh.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from bench import refresh
from bench.common import (
    CODE_PATHS,
    RESULTS_DIR,
    make_row,
    record_run,
    save_scenario,
    write_json_atomic,
)


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
    monkeypatch.setattr(refresh, "code_state", lambda: "abc1234+dirty")
    assert refresh.main([]) == 2
    assert "commit it first" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        refresh.main(["--only", "nope"])
    assert bad.value.code == 2


def test_a_refresh_stops_when_the_code_moves_under_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rows measured after an edit or a commit would name another code than those before."""
    answers = iter(["abc1234", "abc1234+dirty"])
    monkeypatch.setattr(refresh, "code_state", lambda: next(answers))
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(refresh, "_run", lambda argv, log: (ran.append(tuple(argv)), (0, 1.0))[1])
    assert refresh.main(["--logs", str(tmp_path)]) == 2
    assert ran == []
    assert "the code moved from abc1234 to abc1234+dirty" in capsys.readouterr().err


def test_the_simulators_constants_are_no_code_the_benchmarks_measure(tmp_path: Path) -> None:
    """The suite rewrites them from its rows as it runs: were they code, a refresh would make
    its own checkout dirty half way, and its later rows would name no commit."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip

    git("init", "-q")
    for name in ("unicron/sim/data/measured.json", "unicron/x.py", "bench/results/a.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    (tmp_path / "unicron/sim/data/measured.json").write_text("2")
    (tmp_path / "bench/results/a.json").write_text("2")
    assert git("status", "--porcelain", "--", *CODE_PATHS) == ""
    (tmp_path / "unicron/x.py").write_text("2")
    assert "unicron/x.py" in git("status", "--porcelain", "--", *CODE_PATHS)


def test_a_resumed_refresh_keeps_the_durations_of_the_same_codes_first_half(
    tmp_path: Path,
) -> None:
    assert refresh.took_before("abc", tmp_path) == ("", {})
    record_run(tmp_path, "refresh", started="x", total_s=3.0, scenarios_s={"tp": 3.0},
               settings={"code": "abc"})  # fmt: skip
    assert refresh.took_before("abc", tmp_path) == ("x", {"tp": 3.0})
    assert refresh.took_before("def", tmp_path) == ("", {})


def test_rows_of_another_code_a_run_did_not_make_are_listed_and_dropped_on_demand(
    tmp_path: Path,
) -> None:
    """A merging benchmark keeps rows of metrics it dropped (they would name old code for ever),
    but also a variant's rows made with other options: listed, dropped only with --prune."""
    llama = next(e for e in refresh.ENTRIES if e.name == "llama")
    old = make_row(system="torchft", scenario="llama", metric="gone_s", values=[1.0])
    new = make_row(system="unicron", scenario="llama", metric="wall_s", values=[1.0])
    undated = make_row(system="ddp", scenario="llama", metric="old_s", values=[1.0])
    del undated["date"], undated["commit"]  # as rows from before dates or commits were kept
    rows = [{**old, "commit": "abc", "date": "2026-12-01T00:00:00Z"},
            {**new, "commit": "def", "date": "2026-12-06T12:00:00Z"}, undated]  # fmt: skip
    write_json_atomic(tmp_path / "llama.json", rows)
    left = ["llama: torchft gone_s of abc, 2026-12-01T00:00", "llama: ddp old_s of ?, undated"]
    assert refresh.prune(llama, "def", "2026-12-06T11:00:00Z", tmp_path) == left
    assert not refresh.current(llama, "def", tmp_path)  # listed only: a variant's rows stay
    assert refresh.prune(llama, "def", "2026-12-06T11:00:00Z", tmp_path, drop=True) == left
    assert refresh.current(llama, "def", tmp_path)
    assert refresh.prune(llama, "def", "2026-12-06T11:00:00Z", tmp_path) == []
