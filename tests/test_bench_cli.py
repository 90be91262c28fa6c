"""The suite's command line and harness, with fake systems: no benchmark really runs here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import bench.__main__ as cli
from bench.common import Row, load_rows, make_row, save_scenario
from bench.suite import SYSTEMS, derived_rows, known_scenarios, run_training, training_scenario
from bench.systems.base import Scenario, Settings, TrialError


@pytest.mark.parametrize("flag", ["--scenario", "--system"])
def test_unknown_name_lists_known_ones_and_exits_2(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([flag, "no-such-thing"]) == 2
    err = capsys.readouterr().err
    assert "no-such-thing" in err
    known = known_scenarios() if flag == "--scenario" else list(SYSTEMS)
    assert all(name in err for name in known)


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "crash" in out and "torchft" in out


def test_bad_reps_exits_2() -> None:
    assert cli.main(["--reps", "0"]) == 2


@dataclass
class FakeArm:
    """A system that returns fixed figures, or fails on a chosen repetition."""

    label: str
    recovery_s: float
    fail_on: int | None = None
    system: str = "fake"
    calls: int = 0

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        self.calls += 1
        if self.fail_on is not None and self.calls - 1 == self.fail_on:
            raise TrialError("torchrun exited with 1: RuntimeError: boom")
        return {
            "wall_s": 10.0 + self.calls,
            "recovery_s": self.recovery_s,
            "detection_s": 0.1,
            "steps_redone": 0.0,
            "steps_finished": 40.0,
        }


def settings(reps: int = 3) -> Settings:
    return Settings.make(quick=True, reps=reps)


def test_failing_system_is_reported_and_others_still_run(tmp_path: Path) -> None:
    good, bad = FakeArm("good", 0.5), FakeArm("bad", 5.0, fail_on=1)
    scenario = training_scenario("crash", settings())
    rows = run_training(scenario, [good, bad], settings(), tmp_path, host="test machine")
    assert good.calls == 3  # every repetition of the healthy system ran
    assert bad.calls == 2  # the failed one is not run again
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["system"] == "bad"
    assert "RuntimeError: boom" in failed[0]["note"] and "rep 2/3" in failed[0]["note"]
    good_wall = next(r for r in rows if r["system"] == "good" and r["metric"] == "wall_s")
    assert (good_wall["median"], good_wall["min"], good_wall["max"]) == (12.0, 11.0, 13.0)
    assert good_wall["repetitions"] == 3
    # the successful repetition of the failed system is still shown, with its count
    bad_rec = next(r for r in rows if r["system"] == "bad" and r["metric"] == "recovery_s")
    assert bad_rec["repetitions"] == 1
    assert not any(r["metric"] == "steps_finished" for r in rows)


def test_unexpected_exception_is_a_failure_too(tmp_path: Path) -> None:
    class Broken(FakeArm):
        def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
            raise ImportError("No module named 'torchft'")

    rows = run_training(
        training_scenario("crash", settings(1)), [Broken("x", 0.0)], settings(1), tmp_path, host="m"
    )
    assert rows[0]["status"] == "failed" and "No module named" in rows[0]["note"]


def test_arms_take_turns(tmp_path: Path) -> None:
    order: list[str] = []

    class Recording(FakeArm):
        def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
            order.append(self.label)
            return super().run(scenario, settings, workdir)

    arms = [Recording("A", 1.0), Recording("B", 1.0)]
    run_training(training_scenario("crash", settings(2)), arms, settings(2), tmp_path, host="m")
    assert order == ["A", "B", "A", "B"]


def test_default_timeout_hang_rows_are_derived(tmp_path: Path) -> None:
    from bench.common import make_row
    from bench.suite import Lookup

    s = settings(1)
    label = f"torchrun K={s.ckpt_every[0]} timeout={s.hang_timeout_s:g}s"
    rows = [
        make_row(
            system=label,
            scenario="hang",
            metric="detection_s",
            values=[s.hang_timeout_s + 0.5],
            host="m",
        )
    ]
    out = derived_rows(training_scenario("hang", s), rows, Lookup(tmp_path), s, host="m")
    bound = next(r for r in out if r["system"].endswith("default timeout"))
    assert bound["status"] == "derived" and bound["median"] == pytest.approx(1800.5)
    assert "derived, not measured" in bound["note"]


def test_module_rows_are_completed_or_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from bench import suite

    fake = types.ModuleType("fake_sim")
    fake.run = lambda quick: [  # type: ignore[attr-defined]
        {
            "system": "unicron",
            "metric": "wall_time",
            "median": 4.0,
            "min": 4.0,
            "max": 4.0,
            "repetitions": 1,
            "unit": "s",
        },
        {
            "system": "unicron",
            "metric": "broken",
            "median": 5.0,
            "min": 6.0,
            "max": 7.0,
            "repetitions": 1,
        },
    ]
    monkeypatch.setitem(suite.MODULES, "simulator", "fake_sim")
    monkeypatch.setitem(__import__("sys").modules, "fake_sim", fake)
    rows = suite.run_module("simulator", quick=True, host="m")
    assert rows[0]["status"] == "ok" and rows[0]["date"] and rows[0]["scenario"] == "simulator"
    assert rows[1]["status"] == "failed" and "min <= median" in rows[1]["note"]


def test_node_scenario_runs_two_agents_and_both_rendezvous_settings() -> None:
    from bench.suite import arms_for
    from bench.systems.torchrun import TorchrunNodeArm

    quick_arms = arms_for("node", settings(1), SYSTEMS)
    assert [a.tuned for a in quick_arms if isinstance(a, TorchrunNodeArm)] == [True]
    s = Settings.make(quick=False, reps=1)  # the full suite also runs the default rendezvous
    scenario = training_scenario("node", s)
    assert scenario.fault_kind == "node" and scenario.faults == (
        f"node:node=1,step={s.fault_step}",
    )
    arms = arms_for("node", s, SYSTEMS)
    labels = [a.label for a in arms]
    assert len(set(labels)) == len(labels)
    assert labels[0] == "unicron" and "torchft" in labels and "plain DDP" not in labels
    node_arms = [a for a in arms if isinstance(a, TorchrunNodeArm)]
    assert [a.tuned for a in node_arms] == [False, True]
    cmd = node_arms[1].command(1, 12345, "rid", scenario, s, Path("/w"))
    text = " ".join(cmd)
    assert "--nnodes 1:2 --nproc-per-node 2" in text and "--rdzv-backend c10d" in text
    assert "is_host=0,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2" in text
    default = " ".join(node_arms[0].command(0, 12345, "rid", scenario, s, Path("/w")))
    assert "--rdzv-conf is_host=1 " in default and "last_call_timeout" not in default


def test_unicron_node_command_starts_two_agents() -> None:
    from bench.systems.unicron import UnicronArm

    s = settings(1)
    text = " ".join(UnicronArm().command(training_scenario("node", s), s, Path("/w")))
    assert "--nnodes 2 --nproc-per-node 2" in text and "--inject node:node=1" in text
    crash = " ".join(UnicronArm().command(training_scenario("crash", s), s, Path("/w")))
    assert "--nnodes 1 --nproc-per-node 4" in crash


def test_node_fault_fires_on_the_node_leader_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.baselines import loop

    vanished: list[tuple[int, int | None]] = []
    monkeypatch.setattr(loop, "vanish_node", lambda d, node, agent: vanished.append((node, agent)))
    spec = ["node:node=1,step=5"]
    events = loop.EventWriter(str(tmp_path / "events.jsonl"))
    plans = [
        loop.FaultPlan.from_specs(spec, str(tmp_path), rank, events, node=node, node_leader=lead)
        for rank, node, lead in ((0, 0, True), (1, 0, False), (3, 1, False), (2, 1, True))
    ]
    for plan in plans:
        plan.maybe_fire(4, 1, 2)  # not the step
        plan.maybe_fire(5, 1, 2)
    assert vanished == [(1, None)]
    assert {p.name.partition("-")[0] for p in tmp_path.glob("node*-*")} == {"node0", "node1"}


def test_each_scenario_is_saved_as_it_ends_and_a_whole_run_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    def fake_suite(*args: Any, on_scenario: Any, **kwargs: Any) -> dict[str, list[Row]]:
        results_dir: Path = args[3]
        out = {}
        for name in ("crash", "steady"):
            seen.append((results_dir / "crash.json").exists())  # saved before the next began
            rows = [make_row(system="unicron", scenario=name, metric="wall_s", values=[1.0])]
            on_scenario(name, rows, 90.0)
            out[name] = rows
        return out

    monkeypatch.setattr(cli, "run_suite", fake_suite)
    full_only = make_row(system="torchft", scenario="steady", metric="wall_s", values=[7.0])
    save_scenario([full_only], "steady", tmp_path)
    assert cli.main(["--quick", "--results", str(tmp_path)]) == 0
    assert seen == [False, True]
    # a quick run merges: the row it does not make stays
    assert {r["system"]: r["median"] for r in load_rows(tmp_path / "steady.json")} == {
        "torchft": 7.0,
        "unicron": 1.0,
    }
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["quick"]["scenarios_s"] == {"crash": 90.0, "steady": 90.0}
    assert runs["quick"]["settings"]["quick"] is True
    assert "## Suite runs" in (tmp_path / "SUMMARY.md").read_text()
    # a partial run (one system, one scenario, other repetitions) is not the suite's duration
    (tmp_path / "runs.json").unlink()
    for argv in (["--system", "unicron"], ["--scenario", "crash"], ["--reps", "1"]):
        assert cli.main(["--quick", "--results", str(tmp_path), *argv]) == 0
    assert not (tmp_path / "runs.json").exists()
    assert len(load_rows(tmp_path / "steady.json")) == 2
    # the whole full suite stands for every row: it replaces; a damaged runs.json is rewritten
    (tmp_path / "runs.json").write_text("{not json")
    assert cli.main(["--results", str(tmp_path)]) == 0
    assert [r["system"] for r in load_rows(tmp_path / "steady.json")] == ["unicron"]
    assert set(json.loads((tmp_path / "runs.json").read_text())) == {"full"}


def test_the_summary_is_written_even_when_the_suite_is_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, on_scenario: Any, **kwargs: Any) -> dict[str, list[Row]]:
        rows = [make_row(system="unicron", scenario="crash", metric="wall_s", values=[3.0])]
        on_scenario("crash", rows, 10.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_suite", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--results", str(tmp_path)])
    assert "| unicron | wall_s | 3 s |" in (tmp_path / "SUMMARY.md").read_text()
    assert not (tmp_path / "runs.json").exists()  # not a whole run


BENCH_COMMANDS = (
    "chaos",
    "scale",
    "reduce",
    "llama",
    "tp",
    "pipeline",
    "relayout",
    "zero",
    "transfer",
    "checkpoint",
    "simulator",
    "planner",
)


@pytest.mark.parametrize("name", BENCH_COMMANDS)
def test_bench_command_parses_its_arguments(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` prints the usage and runs nothing; an unknown flag exits 2 with one line."""
    import importlib

    mod = importlib.import_module(f"bench.{name}")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(mod, "run", never)
    with pytest.raises(SystemExit) as done:
        mod.main(["--help"])
    assert done.value.code == 0
    assert f"python -m bench.{name}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        mod.main(["--quick", "--no-such-flag"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-such-flag" in err


@pytest.mark.parametrize("argv", [["--reps=0"], ["--reps", "x"], ["--size=huge"]])
def test_bench_scale_rejects_bad_values(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench.scale

    monkeypatch.setattr(bench.scale, "run", lambda *a: [])
    with pytest.raises(SystemExit) as done:
        bench.scale.main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_bench_scale_keeps_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.scale

    seen: list[tuple[object, ...]] = []
    monkeypatch.setattr(bench.scale, "run", lambda *a: seen.append(a) or [])
    monkeypatch.setattr(bench.scale, "save_scenario", lambda *a, **k: None)
    assert bench.scale.main(["--quick", "--size=100m", "--size", "example", "--reps=2"]) == 0
    assert seen == [(True, ("100m", "example"), 2)]


@pytest.mark.parametrize("argv", [["--schedule", "1f1b"], ["--pp", "2", "--schedule", "zigzag"]])
def test_bench_chaos_refuses_a_schedule_without_a_pipeline(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An order of a pipeline's micro-batches without a pipeline (or an order that does not
    exist) is one line and exit 2, before anything runs."""
    import bench.chaos

    monkeypatch.setattr(bench.chaos, "run", lambda *a: [])
    with pytest.raises(SystemExit) as done:
        bench.chaos.main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(
    "name", ["simreal", "gpu_check", "measured", "cluster", "cluster.exchange", "docs"]
)
def test_every_other_bench_command_refuses_an_unknown_flag_in_one_line(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands outside the suite parse like its own: ``--help`` exits 0, an unknown
    flag is one line and exit 2 (both before anything runs)."""
    import importlib

    mod = importlib.import_module(f"bench.{name}")
    main = (
        mod.main if hasattr(mod, "main") else importlib.import_module(f"bench.{name}.__main__").main
    )
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and f"python -m bench.{name}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["--no-such-flag"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "--no-such-flag" in err


def test_the_suite_derives_the_simulators_constants_before_its_simulator_scenario(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The ``simulator`` scenario simulates Unicron with the constants of the same run's
    crash, error, hang and node rows, not with those of the run before."""
    calls: list[str] = []

    def suite(scenarios: list[str], *_: Any, on_scenario: Any = None, **__: Any) -> dict:
        for name in scenarios:
            calls.append(name)
            on_scenario(name, [], 1.0)
        return {}

    monkeypatch.setattr(cli, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(cli, "run_suite", suite)
    monkeypatch.setattr(cli.measured, "refresh", lambda: calls.append("constants") or False)
    assert cli.main(["--scenario", "node", "--scenario", "simulator"]) == 0
    assert calls == ["node", "constants", "simulator", "constants"]
