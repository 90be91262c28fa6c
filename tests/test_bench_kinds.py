"""The per-kind ``error`` scenario and the fault-free ``soak``: names, arms, rows (no real run)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.common import (
    kind_metric,
    make_row,
    merge_rows,
    save_scenario,
    split_metric,
    summary_markdown,
)
from bench.events import actions, alarms, measure, percentile
from bench.suite import (
    NO_DETECTOR,
    SYSTEMS,
    Lookup,
    cells_for,
    derived_rows,
    known_scenarios,
    run_cells,
    soak_steps,
    training_scenario,
)
from bench.systems.base import (
    ONE_PER_SEVERITY,
    Scenario,
    Settings,
    TrialError,
    error_kinds,
    figures,
)
from bench.systems.unicron import UnicronArm
from unicron.detect.classify import KINDS, Severity, verdict_for_kind


def quick(reps: int = 2) -> Settings:
    return Settings.make(quick=True, reps=reps)


def test_error_kinds_cover_the_table_but_unknown() -> None:
    kinds = error_kinds()
    assert set(kinds) == set(KINDS) - {"unknown"} and len(kinds) == len(set(kinds))
    severities = [int(verdict_for_kind(k).severity) for k in kinds]
    assert severities == sorted(severities, reverse=True)  # SEV3 first, SEV1 last
    assert Settings.make(quick=False).error_kinds == kinds
    assert quick().error_kinds == ONE_PER_SEVERITY
    assert quick().torchrun_error_kinds == (quick().error_kind,)
    assert Settings.make(quick=False).torchrun_error_kinds == ONE_PER_SEVERITY
    # the quick subset has every severity, and its order is the full one's
    assert {verdict_for_kind(k).severity for k in ONE_PER_SEVERITY} == set(Severity)
    assert list(ONE_PER_SEVERITY) == [k for k in kinds if k in ONE_PER_SEVERITY]


def test_settings_reject_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="error_kinds"):
        dataclasses.replace(quick(), error_kinds=("cuda", "gremlins"))
    with pytest.raises(ValueError, match="error_kinds"):
        dataclasses.replace(quick(), error_kinds=("ecc",))  # error_kind "cuda" missing
    with pytest.raises(ValueError, match="torchrun_error_kinds"):
        dataclasses.replace(quick(), torchrun_error_kinds=("cuda", "oom"))  # not an error kind
    with pytest.raises(ValueError, match="torchrun_error_kinds"):
        dataclasses.replace(quick(), torchrun_error_kinds=("ecc",))


def test_scenarios_are_listed() -> None:
    assert {"error", "soak"} <= set(known_scenarios())


def test_error_cells_per_kind() -> None:
    s = quick()
    cells = cells_for("error", s, SYSTEMS, Lookup(Path("/nonexistent")))
    by_kind: dict[str | None, list[str]] = {}
    for scenario, arm in cells:
        assert scenario.name == "error" and scenario.kind is not None
        assert scenario.faults == (
            f"error:rank={s.fault_rank},step={s.fault_step},kind={scenario.kind}",
        )
        assert scenario.metric("detection_s") == f"detection_s[{scenario.kind}]"
        by_kind.setdefault(scenario.kind, []).append(arm.label)
    assert list(by_kind) == list(ONE_PER_SEVERITY)
    per_kind = ["unicron", "torchrun K=10 timeout=60s"]
    for kind, labels in by_kind.items():  # quick: torchrun on the default kind only, no extras
        assert labels == (per_kind if kind == s.error_kind else ["unicron"]), kind
    full = Settings.make(quick=False)
    cells = cells_for("error", full, SYSTEMS, Lookup(Path("/nonexistent")))
    default = [arm.label for scenario, arm in cells if scenario.kind == full.error_kind]
    assert default == [
        "unicron", "torchrun K=10 timeout=60s", "torchrun K=10", "torchrun K=50", "torchft"
    ]  # fmt: skip
    # the full suite: Unicron on every kind, torchrun on one per severity (and no other arm)
    full_by_kind: dict[str | None, list[str]] = {}
    for scenario, arm in cells:
        full_by_kind.setdefault(scenario.kind, []).append(arm.label)
    assert list(full_by_kind) == list(error_kinds())
    for kind, labels in full_by_kind.items():
        if kind == full.error_kind:
            continue
        assert labels == (per_kind if kind in ONE_PER_SEVERITY else ["unicron"]), kind
    assert "SEV3 reattempt" in training_scenario("error", s, kind="conn_reset").description
    assert "SEV1 exclude" in training_scenario("error", s, kind="ecc").description


def test_soak_is_unicron_only_and_sized_by_the_step_time(tmp_path: Path) -> None:
    s = quick()
    assert soak_steps(s, None) == round(s.soak_s / 0.1)
    assert soak_steps(s, 0.05) == round(s.soak_s / 0.05)
    assert soak_steps(s, 1000.0) == s.steps  # never fewer than the other scenarios
    save_scenario(
        [make_row(system="unicron", scenario="steady", metric="step_time_s", values=[0.2])],
        "steady",
        tmp_path,
    )
    cells = cells_for("soak", s, SYSTEMS, Lookup(tmp_path))
    assert [arm.label for _, arm in cells] == ["unicron"]
    scenario = cells[0][0]
    assert not scenario.faults and scenario.steps == round(s.soak_s / 0.2)
    assert scenario.run_timeout_s(s) > s.soak_s
    assert scenario.run_reps(s) == 1  # one long run, whatever --reps says
    cmd = " ".join(UnicronArm().command(scenario, s, Path("/w")))
    assert f"--steps {scenario.steps}" in cmd and "--inject" not in cmd
    full = Settings.make(quick=False)
    assert full.soak_s == 600.0 and s.soak_s == 30.0


@dataclass
class Fake:
    """An arm returning fixed figures per kind; ``fail_kind`` raises for that kind."""

    label: str
    system: str
    pg_timeout_s: float | None = None
    fail_kind: str | None = None

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        if self.fail_kind is not None and scenario.kind == self.fail_kind:
            raise TrialError("unicron run exited with 1: boom")
        if not scenario.faults:
            return {
                "wall_s": 130.0,
                "false_alarms": 1.0,
                "alarm:straggler": 1.0,
                "epochs": 1.0,
                "step_time_s": 0.1,
                "step_time_p99_s": 0.3,
                "steps_finished": 1200.0,
            }
        out = {
            "wall_s": 20.0,
            "detection_s": 0.03 if self.system == "unicron" else 1.4,
            "recovery_s": 0.6,
            "steps_redone": 0.0,
            "epochs": 1.0 if scenario.kind == "conn_reset" else 2.0,
            "steps_finished": 40.0,
        }
        if self.system == "unicron":
            verdict = verdict_for_kind(scenario.kind or "cuda")
            out[f"action:{verdict.action}"] = 1.0
        return out


def test_error_rows_are_named_per_kind(tmp_path: Path) -> None:
    s = quick()
    unicron = Fake("unicron", "unicron", fail_kind="user")
    torchrun = Fake("torchrun K=10 timeout=60s", "torchrun", pg_timeout_s=60.0)
    cells = [
        (training_scenario("error", s, kind=kind), arm)
        for kind in ("conn_reset", "cuda", "user")
        for arm in (unicron, torchrun)
    ]
    rows = run_cells(cells, s, tmp_path, host="m")
    keys = {(r["system"], r["metric"]) for r in rows}
    assert len(keys) == len(rows)  # (system, scenario, metric) stays each row's key
    by = {(r["system"], r["metric"]): r for r in rows}
    assert by[("unicron", "detection_s[cuda]")]["unit"] == "s"
    assert by[("unicron", "epochs[conn_reset]")]["median"] == 1.0
    assert "target < 0.5 s: met" in by[("unicron", "detection_s[cuda]")]["note"]
    slow = by[("torchrun K=10 timeout=60s", "detection_s[cuda]")]["note"]
    assert "NOT met" in slow and "timeout 60 s" in slow and "does not enter" in slow
    note = by[("unicron", "epochs[conn_reset]")]["note"]
    assert "reattempt x1 (2/2 reps)" in note and "SEV3 reattempt" in note
    assert "restart x1" in by[("unicron", "epochs[cuda]")]["note"]
    assert "whole group" in by[("torchrun K=10 timeout=60s", "epochs[cuda]")]["note"]
    assert "kind=cuda" in by[("unicron", "wall_s[cuda]")]["note"]
    # a failing kind is one failed row; the arm still ran the other kinds, torchrun this one
    failed = [r for r in rows if r["status"] == "failed"]
    assert [(r["system"], r["metric"]) for r in failed] == [("unicron", "trial[user]")]
    assert ("torchrun K=10 timeout=60s", "detection_s[user]") in keys
    assert not any(r["metric"].startswith(("action:", "steps_finished")) for r in rows)


def test_error_derived_rows_only_for_the_default_kind(tmp_path: Path) -> None:
    s = quick(1)
    steady = [make_row(system="unicron", scenario="steady", metric="wall_s", values=[8.0])]
    rows = [
        make_row(system="unicron", scenario="error", metric=f"{m}[{k}]", values=[v])
        for k in ("conn_reset", "cuda")
        for m, v in (("wall_s", 18.0), ("recovery_s", 0.6))
    ]
    # a saved steady run may have had other settings (steps): no fault cost from it
    save_scenario(steady, "steady", tmp_path)
    assert derived_rows(training_scenario("error", s), rows, Lookup(tmp_path), s, host="m") == []
    lookup = Lookup(tmp_path)
    lookup.rows += steady  # measured in this invocation
    out = derived_rows(training_scenario("error", s), rows, lookup, s, host="m")
    assert [r["metric"] for r in out] == ["fault_cost_s[cuda]"]
    assert out[0]["median"] == pytest.approx(10.0) and out[0]["status"] == "derived"


def test_soak_rows(tmp_path: Path) -> None:
    s = quick(2)
    scenario = training_scenario("soak", s, step_time_s=0.1)
    arm = Fake("unicron", "unicron")
    rows = run_cells([(scenario, arm)], s, tmp_path, host="m")
    by = {r["metric"]: r for r in rows}
    assert {r["repetitions"] for r in rows} == {1}
    assert set(by) == {"wall_s", "false_alarms", "epochs", "step_time_s", "step_time_p99_s"}
    assert "straggler x1 (1/1 reps)" in by["false_alarms"]["note"]
    assert NO_DETECTOR in by["false_alarms"]["note"]
    assert by["epochs"]["unit"] == "count" and by["step_time_p99_s"]["unit"] == "s"
    assert derived_rows(scenario, rows, Lookup(tmp_path), s, host="m") == []


def test_metric_names_and_summary(tmp_path: Path) -> None:
    assert kind_metric("detection_s", "cuda") == "detection_s[cuda]"
    assert kind_metric("wall_s", None) == "wall_s"
    assert split_metric("detection_s[conn_reset]") == ("detection_s", "conn_reset")
    assert split_metric("wall_s") == ("wall_s", None)
    row = make_row(system="unicron", scenario="error", metric="detection_s[ecc]", values=[0.02])
    assert row["unit"] == "s"
    save_scenario([row], "error", tmp_path)
    assert "| unicron | detection_s[ecc] | 0.02 s |" in summary_markdown(tmp_path)


def test_events_actions_alarms_epochs_p99() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.1] * 99 + [5.0], 99) == pytest.approx(0.1 + 0.01 * 4.9)
    assert percentile([7.0], 99) == 7.0
    events = [
        {"ts": 0.0, "event": "epoch_begin", "epoch": 1, "members": [0, 1, 2, 3]},
        *[
            {"ts": 1.0 + i, "event": "step_end", "rank": 0, "step": i, "duration_s": 0.1}
            for i in range(10)
        ],
        {"ts": 5.5, "event": "error_detected", "kind": "straggler", "method": "monitor"},
        {"ts": 5.5, "event": "action", "action": "reconfigure"},
    ]
    outcome = measure(events)
    assert outcome.epochs == 1 and outcome.false_alarms == 1
    metrics = outcome.metrics()
    assert metrics["epochs"] == 1.0 and metrics["step_time_p99_s"] == pytest.approx(0.1)
    assert actions(events) == {"reconfigure": 1} and alarms(events) == {"straggler": 1}
    fig = figures(events, 12.0, Scenario(name="soak", description="x"))
    assert fig["action:reconfigure"] == 1.0 and fig["alarm:straggler"] == 1.0
    # torchft's epoch_begin is per replica (it has a rank): no job epochs to count
    per_rank = [{"ts": 0.0, "event": "epoch_begin", "rank": r} for r in range(4)]
    assert measure(per_rank).epochs is None and "epochs" not in measure(per_rank).metrics()
    assert measure([]).epochs is None


def test_a_rerun_drops_the_old_failure_of_that_kind_only() -> None:
    def row(metric: str, status: str = "ok") -> dict[str, object]:
        values = [] if status == "failed" else [1.0]
        return make_row(
            system="unicron", scenario="error", metric=metric, values=values, status=status
        )

    old = [row("trial[cuda]", "failed"), row("trial[user]", "failed"), row("wall_s[ecc]")]
    merged = merge_rows(old, [row("detection_s[cuda]")])
    assert [r["metric"] for r in merged] == ["trial[user]", "wall_s[ecc]", "detection_s[cuda]"]
    # a new failure replaces the old one and keeps the other figures of the kind
    again = merge_rows(merged, [row("trial[ecc]", "failed")])
    assert [r["metric"] for r in again] == [
        "trial[user]",
        "wall_s[ecc]",
        "detection_s[cuda]",
        "trial[ecc]",
    ]


def test_a_rerun_of_some_rows_keeps_them_in_their_place() -> None:
    """A ``--quick`` run re-measures the smallest size only: its rows take the places of the
    rows they replace, so a table's columns keep their order (they were appended: a grid's
    smallest size became its last column)."""

    def row(metric: str) -> dict[str, object]:
        return make_row(system="unicron", scenario="tp", metric=metric, values=[1.0])

    old = [row(f"whole_s[tp2/dim{d}]") for d in (128, 256, 384)]
    merged = merge_rows(old, [row("whole_s[pp2/dim128]"), row("whole_s[tp2/dim128]")])
    assert [r["metric"] for r in merged] == [
        "whole_s[tp2/dim128]", "whole_s[tp2/dim256]", "whole_s[tp2/dim384]",
        "whole_s[pp2/dim128]",
    ]  # fmt: skip
