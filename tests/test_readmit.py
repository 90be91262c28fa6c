"""An excluded slot comes back once it is healthy: the probe cool-down, its backoff, readmission.

The coordinator runs for real (its TCPStore, its escalation, its event log); the agent is a
stand-in that records what it is asked to do, and the clock is passed in. The end-to-end run
(a real probe process, a worker rejoining) is in ``tests/test_faults_e2e.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from unicron.control import readmission
from unicron.control.coordinator import (
    Coordinator,
    CoordinatorSettings,
    Kill,
    Probe,
    Spawn,
    TaskState,
)
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog, read_events
from unicron.detect.classify import verdict_for_kind
from unicron.runtime import health
from unicron.runtime.health import main as health_main
from unicron.runtime.health import probe


@dataclass
class FakeAgent:
    """Takes the coordinator's actions for its node and records them (in order, per kind)."""

    c: Coordinator
    node: int
    taken: list[Spawn | Kill | Probe] = field(default_factory=list)

    def _of(self, kind: type) -> list[int]:
        self.taken += self.c.take_actions(self.node)
        return [a.slot for a in self.taken if isinstance(a, kind)]

    @property
    def probes(self) -> list[int]:
        return self._of(Probe)

    @property
    def spawns(self) -> list[int]:
        return self._of(Spawn)

    @property
    def kills(self) -> list[int]:
        return self._of(Kill)


def _running(tmp_path: Path, **settings: float) -> tuple[Coordinator, FakeAgent, Path]:
    """A coordinator of 4 slots on node 0, its first epoch started at t = 0."""
    path = tmp_path / "events.jsonl"
    c = Coordinator(
        task="t",
        slots={s: 0 for s in range(4)},
        events=EventLog(path),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(**settings),  # type: ignore[arg-type]
    )
    agent = FakeAgent(c, node=0)
    c.attach(0)
    for s in range(4):
        c.worker_ready(s, 0.0)
    assert c.state is TaskState.RUNNING and c.members == (0, 1, 2, 3)
    return c, agent, path


def _actions(path: Path) -> list[tuple[str, int, str]]:
    events = read_events(path)
    return [(e["action"], e["slot"], e["reason"]) for e in events if e["event"] == "action"]


def test_an_excluded_slot_is_probed_after_the_cool_down_then_readmitted(tmp_path: Path) -> None:
    c, agent, path = _running(tmp_path, readmit_after_s=10.0)
    c.worker_failed(3, verdict_for_kind("ecc"), 1.0)
    assert c.slots[3].excluded and 3 not in c.members
    c.tick(10.9)
    assert agent.probes == []  # the cool-down is not over
    c.tick(11.0)
    c.tick(11.1)
    assert agent.probes == [3]  # probed once, while its probe runs
    c.probe_done(3, True, "cpu: fine", 12.0)
    assert not c.slots[3].excluded and 3 not in c.escalation.excluded_slots()
    assert agent.spawns == [3]  # a new worker there; it joins once ready
    c.worker_ready(3, 13.0)
    assert c.members == (0, 1, 2, 3)
    assert [a for a, _, _ in _actions(path)] == ["exclude", "readmit"]
    assert "passed its health probe after 11.0 s out: cpu: fine" in _actions(path)[-1][2]


def test_a_failed_probe_doubles_the_wait_each_time(tmp_path: Path) -> None:
    c, agent, path = _running(tmp_path, readmit_after_s=10.0)
    c.worker_failed(3, verdict_for_kind("ecc"), 0.0)
    c.tick(10.0)
    c.probe_done(3, False, "RuntimeError: matrix product wrong", 11.0)
    assert c.slots[3].excluded and agent.spawns == []
    action, slot, reason = _actions(path)[-1]
    assert (action, slot) == ("exclude", 3) and "next in 20 s" in reason
    c.tick(30.9)
    assert agent.probes == [3]
    c.tick(31.0)  # 11 + 10 x 2
    assert agent.probes == [3, 3]
    c.probe_done(3, False, "no answer in 120 s", 32.0)
    c.tick(71.9)
    assert agent.probes == [3, 3]
    c.tick(72.0)  # 32 + 10 x 4
    assert agent.probes == [3, 3, 3]


def test_the_probe_backoff_starts_again_once_a_slot_stayed_in_for_a_window(
    tmp_path: Path,
) -> None:
    # restart_window_s = 60: an exclusion more than a window after the last readmission is a
    # new episode (the backoff counted every exclusion for ever: after a few, a slot that
    # always passed its probe stayed out for minutes, and the task shrank to one worker)
    c, agent, _ = _running(tmp_path, readmit_after_s=10.0)
    for k, t in enumerate((0.0, 100.0)):  # excluded, back, excluded again 88 s later
        c.worker_failed(3, verdict_for_kind("ecc"), t)
        c.tick(t + 10.0)
        assert agent.probes == [3] * (k + 1)  # 10 s each time: not doubled
        c.probe_done(3, True, "cpu: fine", t + 12.0)
        assert not c.slots[3].excluded
    c.worker_failed(3, verdict_for_kind("ecc"), 130.0)  # 18 s after coming back: doubled
    c.tick(149.9)
    assert agent.probes == [3, 3]
    c.tick(150.0)
    assert agent.probes == [3, 3, 3]


def test_the_probe_backoff_is_capped(tmp_path: Path) -> None:
    # a slot that keeps failing its probe is still probed every 8 cool-downs, not after
    # 2^k of them (at the defaults: within the 600 s a waiting task gives it)
    c, agent, _ = _running(tmp_path, readmit_after_s=10.0)
    c.worker_failed(3, verdict_for_kind("ecc"), 0.0)
    t = 0.0
    for k in range(6):  # waits of 10, 20, 40, 80, 80, 80 s
        t += 10.0 * min(2**k, 8)
        c.tick(t - 0.1)
        assert agent.probes == [3] * k
        c.tick(t)
        assert agent.probes == [3] * (k + 1)
        c.probe_done(3, False, "RuntimeError: matrix product wrong", t)


def test_slots_of_a_lost_node_are_not_probed(tmp_path: Path) -> None:
    c, agent, _ = _running(tmp_path, readmit_after_s=1.0)
    c.worker_failed(2, verdict_for_kind("ecc"), 0.0)
    c.lost_nodes.add(0)  # its node went away since
    c.tick(5.0)
    assert agent.probes == []
    c.probe_done(2, True, "late answer", 5.0)  # a probe that was already running
    assert c.slots[2].excluded and agent.spawns == []


def test_a_dropped_worker_is_probed_only_once_its_exit_is_handled(tmp_path: Path) -> None:
    c, agent, _ = _running(tmp_path, readmit_after_s=1.0)
    with c._lock:  # what worker_slow does when the planner drops a straggler
        readmission.exclude(c.book, 2, 0.0)
    c.tick(5.0)
    assert agent.probes == []  # its process still runs (the kill is on its way)
    c.worker_failed(2, verdict_for_kind("killed"), 5.0)
    c.tick(5.1)
    assert agent.probes == [2]


def test_a_probe_that_cannot_start_is_tried_again_later(tmp_path: Path) -> None:
    c, agent, _ = _running(tmp_path, readmit_after_s=1.0)
    c.worker_failed(3, verdict_for_kind("ecc"), 0.0)
    c.tick(1.0)
    assert agent.probes == [3]  # asked for; the agent cannot start it (out of descriptors)
    c.probe_not_started(3, "[Errno 24] Too many open files", 1.0)
    assert not c.slots[3].probing and c.slots[3].excluded
    c.tick(1.5)
    assert agent.probes == [3]
    c.tick(2.0)  # one more cool-down after the failed start
    assert agent.probes == [3, 3]


def test_readmission_can_be_turned_off_and_bad_settings_are_refused(tmp_path: Path) -> None:
    c, agent, _ = _running(tmp_path, readmit_after_s=float("inf"))
    c.worker_failed(1, verdict_for_kind("ecc"), 0.0)
    c.tick(1e9)
    assert agent.probes == []
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="readmit_after_s"):
            CoordinatorSettings(readmit_after_s=bad)


def test_the_probe_passes_here_and_a_device_error_fails_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "256x256 product and sum correct" in probe(1)
    assert health_main(["--slot", "0"]) == 0
    assert capsys.readouterr().out.startswith("cpu: ")

    def broken(slot: int) -> str:
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")

    monkeypatch.setattr(health, "probe", broken)
    assert health_main(["--slot", "0"]) == 1
    assert "uncorrectable ECC error" in capsys.readouterr().out


def test_a_node_excluded_says_so_for_each_of_its_slots_and_its_return_too(
    tmp_path: Path,
) -> None:
    """The cluster's planner parks a replica by its excluded ranks (``action`` events, per
    slot): a node excluded took every slot out of the plan but said so only for the slot
    whose failure tipped it (found in review: a replica with a rank on that node counted as
    whole), and its return only for the probed slot."""
    path = tmp_path / "events.jsonl"
    c = Coordinator(
        task="t",
        slots={s: s // 3 for s in range(6)},
        events=EventLog(path),
        escalation=Escalation(EscalationSettings(node_failure_limit=1)),
        settings=CoordinatorSettings(readmit_after_s=10.0),
    )
    agent = FakeAgent(c, node=0)
    for n in (0, 1):
        c.attach(n)
    for s in range(6):
        c.worker_ready(s, 0.0)
    c.worker_failed(2, verdict_for_kind("ecc"), 1.0)  # tips node 0 (limit 1)
    assert all(c.slots[s].excluded for s in (0, 1, 2))
    excluded = {slot for a, slot, _ in _actions(path) if a == "exclude"}
    assert excluded == {0, 1, 2}
    c.tick(11.0)
    assert agent.probes == [0, 1, 2]
    c.probe_not_started(1, "no device free", 11.1)  # slot 1 waits for another try
    c.probe_done(0, True, "cpu: fine", 12.0)  # the node is back, and slot 1 with it
    c.probe_done(2, True, "cpu: fine", 12.1)  # slot 2's own exclusion (its ecc) ends
    readmitted = [slot for a, slot, _ in _actions(path) if a == "readmit"]
    assert sorted(readmitted) == [0, 1, 2] and not any(c.slots[s].excluded for s in (0, 1, 2))
