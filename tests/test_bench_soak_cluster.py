"""The cluster soak's measurements (``bench/soak_cluster.py``) on event logs made up here: the
soak itself is a long benchmark (``make soak-cluster``), never part of the test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.soak_cluster import (
    Made,
    cluster_faults,
    commits,
    driver_worker_faults,
    ettr,
    fallbacks,
    live_workers,
    task_specs,
)

ROOT = Path(__file__).resolve().parents[1]


def ev(ts: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "event": event, **fields}


def test_commits_count_steps_never_committed_twice_and_in_a_stale_epoch() -> None:
    log = [ev(1, "step_end", step=0, epoch=1), ev(2, "step_end", step=1, epoch=2),
           ev(3, "step_end", step=1, epoch=3), ev(4, "step_end", step=3, epoch=2)]  # fmt: skip
    lost, twice, stale = commits(log, steps=4)
    assert (lost, twice, stale) == (1, 1, 1)  # step 2 never; step 1 twice; epoch 2 after 3


def test_ettr_is_the_share_of_wall_time_at_the_median_step_period() -> None:
    steady = [ev(float(t), "step_end", step=t) for t in range(11)]
    assert ettr(steady) == (1.0, 1.0)
    stalled = [*steady, ev(30.0, "step_end", step=11)]  # 19 s without a commit
    share, period = ettr(stalled)
    assert period == 1.0 and share == pytest.approx(11 / 30)


def test_a_checkpoint_fallback_is_counted_once_per_epoch_with_its_redone_steps() -> None:
    log = [ev(1, "transition_end", epoch=4, rank=r, state_source="checkpoint", steps_redone=1)
           for r in (0, 1)]  # fmt: skip
    log += [ev(2, "transition_end", epoch=5, rank=0, state_source="peer_node")]
    assert fallbacks(log) == (1, 1)


def test_a_cluster_fault_is_detected_by_the_record_that_names_it() -> None:
    made = [Made("agent_kill", "n3", 10.0), Made("store_kill", "1", 40.0),
            Made("coordinator_kill", "host 0", 70.0), Made("link_cut", "n4", 100.0)]  # fmt: skip
    a = [ev(5.0, "step_end", step=1, node_name="n3"),
         ev(11.5, "error_detected", node_name="n2"),  # another node's: not this fault's
         ev(12.0, "error_detected", node_name="n3"), ev(13.0, "step_end", step=2),
         ev(40.2, "control_plane", what="the training store was lost: ..."),
         ev(41.0, "step_end", step=3),
         ev(72.0, "control_plane", what="coordinator restarted: task adopted"),
         ev(73.0, "step_end", step=4),
         ev(99.0, "step_end", step=5, node_name="n4")]  # fmt: skip
    figs, unseen = cluster_faults(made, {"a": a}, period_s=20.0)
    assert figs["agent_kill"]["detection_s"] == [2.0] and figs["agent_kill"]["recovery_s"] == [3.0]
    assert figs["store_kill"]["detection_s"] == [pytest.approx(0.2)]
    assert figs["coordinator_kill"]["recovery_s"] == [3.0]
    assert unseen == ["link_cut n4 at " + unseen[0].split(" at ")[1]]  # held, never recorded
    # a node whose task had given back every slot there before it was lost (the driver saw
    # no worker on it): only the cluster's node table sees that loss, no task's log
    spare = [Made("agent_kill", "n4", 100.0, extra={"held": False})]
    assert cluster_faults(spare, {"a": a}, period_s=20.0)[1] == []


def test_a_driver_fault_in_a_worker_is_detected_about_its_slot() -> None:
    made = [Made("worker_kill", "a slot 2", 10.0, extra={"task": "a", "slot": 2}),
            Made("worker_stop", "a slot 1", 20.0, extra={"task": "a", "slot": 1})]  # fmt: skip
    a = [ev(10.1, "error_detected", slot=3), ev(10.3, "error_detected", slot=2),
         ev(11.0, "step_end", step=5)]  # fmt: skip
    figs, undetected = driver_worker_faults(made, {"a": a})
    assert figs["worker_kill"]["detection_s"] == [pytest.approx(0.3)]
    assert figs["worker_kill"]["recovery_s"] == [pytest.approx(1.0)]
    assert undetected == [made[1]]  # the stopped worker of slot 1 was never found


def test_live_workers_are_found_by_their_log_file(tmp_path: Path) -> None:
    folder = tmp_path / "workers-n2" / "gpt-a.0123abcd"
    folder.mkdir(parents=True)
    with open(folder / "worker7.3.log", "wb") as log, open(folder / "zygote-node0.log", "wb") as z:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        worker = subprocess.Popen(sleeper, stdout=log)
        zygote = subprocess.Popen(sleeper, stdout=z)
    try:
        assert live_workers(tmp_path) == [(worker.pid, "gpt-a", 7)]
    finally:
        for p in (worker, zygote):
            p.kill()
            p.wait()


def test_the_tasks_plan_their_share_of_the_worker_faults() -> None:
    specs, steps = task_specs(1000, seed=0)
    assert [len(s["inject"]) for s in specs] == [450, 350, 200]
    assert all(s["checkpoint"]["every"] == 1 for s in specs)
    # the tensor-parallel task keeps two replicas: a rank lost leaves one to heal from
    assert [s["workers"]["min"] // s["tp"] for s in specs] == [2, 2, 2]
    assert all(steps[s["name"]] == int(s["args"][1]) for s in specs)
