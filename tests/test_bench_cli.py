"""The suite's command line and harness, with fake systems: no benchmark really runs here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import bench.__main__ as cli
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
