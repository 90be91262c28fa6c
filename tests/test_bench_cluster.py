"""The cluster benchmarks' own logic (bench/cluster): figures from stamped logs and samples,
the event-log tail, the command line. The measurements themselves run real clusters and
belong to ``python -m bench.cluster``, not here."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.cluster import kill, load
from bench.cluster.__main__ import main
from bench.cluster.harness import EventTail, Stamped


def _log(steps: list[int], *, adopted_at: float = 8.0) -> list[Stamped]:
    """Steps committed one a second from t=0 (worker clock = the line's time), a restart
    adopted at ``adopted_at``: the lines of the outage appear then, in a burst."""
    lines = [Stamped(0.0, {"ts": 0.0, "event": "epoch_begin", "epoch": 1})]
    for i, step in enumerate(steps):
        t = float(i)
        seen = t if t < 5.0 else (adopted_at + 0.1 if t < adopted_at else t + 0.2)
        lines.append(Stamped(seen, {"ts": t, "event": "step_end", "step": step, "epoch": 1}))
    lines.append(Stamped(adopted_at, {"ts": adopted_at, "event": "control_plane", "away_s": 3.0}))
    return sorted(lines, key=lambda s: s.seen)


def test_kill_figures_from_a_clean_restart() -> None:
    view = {"outcome": {"params_sha256": "abc"}}
    got = kill.figures(_log(list(range(12))), 12, 5.0, 6.5, 7.5, view, "abc")
    assert got["answer_s"] == pytest.approx(1.0)
    assert got["adopt_s"] == pytest.approx(1.5)
    # step 7 was committed at t=7 (after the restart at 6.5) but logged only at 8.1
    assert got["commit_s"] == pytest.approx(8.1 - 6.5)
    assert got["logged_s"] == pytest.approx(8.1 - 6.5)
    assert got["steps_lost"] == 0 and got["steps_twice"] == 0
    assert got["bitwise_identical"] == 1 and got["epochs"] == 1 and got["away_s"] == 3.0
    assert got["pause_s"] == pytest.approx(1.0)


def test_kill_figures_count_lost_and_repeated_steps_and_a_different_result() -> None:
    view = {"outcome": {"params_sha256": "abc"}}
    got = kill.figures(_log([0, 1, 2, 3, 4, 4, 5, 6, 8, 9]), 10, 5.0, 6.5, 7.5, view, "def")
    assert got["steps_lost"] == 1 and got["steps_twice"] == 1
    assert got["bitwise_identical"] == 0


def test_kill_figures_refuse_a_run_the_new_coordinator_never_adopted() -> None:
    lines = [s for s in _log(list(range(10))) if s.event["event"] != "control_plane"]
    with pytest.raises(Exception, match="control_plane"):
        kill.figures(lines, 10, 5.0, 6.5, 7.5, {"outcome": {}}, "abc")


def test_load_figures_keep_the_window_and_split_by_kind() -> None:
    s = load.LoadSettings(agents=2, tasks=1, workers=2, duration_s=10.0)
    smp = load.Samples()
    for i in range(100):  # in the window: 1..100 ms, half heartbeats
        smp.add("heartbeat" if i % 2 else "exchange", 10.0 + i * 0.05, (i + 1) / 1e3, True, 0.01)
    smp.add("exchange", 5.0, 9.0, False, 0.0)  # before the window: left out
    smp.add("exchange", 12.0, 0.5, False, 0.2)  # in it, failed
    raw = {
        "window": (10.0, 20.0),
        "samples": [load.Samples.load(smp.dump())],
        **dict.fromkeys(("coordinator_cpu", "coordinator_cpu_max", "store_cpu"), 0.5),
        **dict.fromkeys(("state_mb", "state_growth_mb_per_h"), 1.0),
        **dict.fromkeys(("running", "committed", "nodes_lost", "alarms", "events"), 0),
        "alarm_kinds": "none",
        "states": "running x1",
    }
    got = load.figures(raw, s)
    assert got["requests_per_s"] == pytest.approx(10.1)
    assert got["failed_requests"] == 1
    assert got["latency_max_ms"] == pytest.approx(500.0)
    assert got["latency_p50_ms[heartbeat]"] == pytest.approx(51.0)
    assert got["client_lag_p99_ms"] == pytest.approx(10.0)


def test_load_settings_refuse_more_workers_than_slots() -> None:
    with pytest.raises(ValueError, match="more workers than slots"):
        load.LoadSettings(agents=2, slots=2, tasks=2, workers=4)


def _wait_for(tail: EventTail, lines: int) -> None:
    deadline = time.time() + 5
    while len(tail.snapshot()) < lines and time.time() < deadline:
        time.sleep(0.005)


def test_the_tail_stamps_lines_as_they_appear(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventTail(path, poll_s=0.005).start()
    try:
        time.sleep(0.05)
        t = time.time()
        with open(path, "a") as f:
            f.write(json.dumps({"ts": 1.0, "event": "a"}) + "\n" + '{"ts": 2.0, "ev')
            f.flush()
            _wait_for(tail, 1)  # the first line is seen, the half line is not taken
            time.sleep(0.02)
            assert len(tail.snapshot()) == 1
            f.write('ent": "b"}\n')
        _wait_for(tail, 2)
    finally:
        tail.stop()
    got = tail.snapshot()
    assert [s.event["event"] for s in got] == ["a", "b"]
    assert t <= got[0].seen < got[1].seen


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--agents", "1", "--tasks", "20"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "python -m bench.cluster:" in capsys.readouterr().err
