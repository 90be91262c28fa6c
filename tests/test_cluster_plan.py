"""The planner in the cluster's loop (:mod:`unicron.control.cluster`): its triggers from task
events (a slot excluded or readmitted, a straggler), a planner error that keeps the
allocation and shows in ``unicron status``, the decision time in ``plan`` events, and the
placement setting. No agents: nodes register and tasks are placed, nothing trains."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unicron.control import allocation
from unicron.control.cluster import Cluster, ClusterSettings
from unicron.control.planning import transition_s
from unicron.control.service import serve
from unicron.control.taskspec import TaskSpec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
TOKEN = "plan-token"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "state", host="127.0.0.1", settings=ClusterSettings(), embedded=True)
    try:
        yield c
    finally:
        c.close()


def submit(c: Cluster, name: str, now: float, **more: Any) -> dict[str, Any]:
    spec = TaskSpec.model_validate({"name": name, "script": SCRIPT, **more})
    return c.submit(spec, now)


def plans(c: Cluster, name: str) -> list[dict[str, Any]]:
    events, _ = c.events(name, 0)
    return [e for e in events if e["event"] == "plan" and "trigger" in e]


def test_an_excluded_slot_is_a_trigger_and_nobodys_until_readmitted(cluster: Cluster) -> None:
    now = time.time()
    cluster.register("n0", 2, "127.0.0.1", "i0", now)
    submit(cluster, "a", now, workers={"min": 1, "max": 2})
    a = cluster.tasks["a"]
    assert a.row.placement == [0, 0]
    cluster._triggers.clear()
    cluster._on_event(a, {"event": "action", "action": "exclude", "slot": 1, "ts": now})
    assert cluster._triggers == ["slot 1 of task a excluded"] and a.excluded == {1}
    cluster.tick(now + 0.01)
    submit(cluster, "b", now, weight=3.0)  # a heavier task: a free slot would be its
    assert cluster.tasks["b"].row.state == "queued" and not plans(cluster, "b")
    assert cluster._pending_adds == []  # the excluded slot is nobody's, not b's
    cluster._triggers.clear()
    cluster._on_event(a, {"event": "action", "action": "readmit", "slot": 1, "ts": now})
    assert cluster._triggers == ["slot 1 of task a readmitted"] and not a.excluded
    cluster._on_event(a, {"event": "error_detected", "kind": "straggler", "slot": 0, "ts": now})
    assert cluster._triggers[-1] == "straggler on slot 0 of task a"


def test_a_plan_event_carries_its_decision_time(cluster: Cluster) -> None:
    now = time.time()
    cluster.register("n0", 2, "127.0.0.1", "i0", now)
    submit(cluster, "a", now, workers={"min": 1, "max": 2})
    submit(cluster, "b", now, weight=3.0)  # takes one of a's slots
    (plan,) = plans(cluster, "a")
    assert plan["allocation"] == {"a": 1, "b": 1} and plan["placement"] == "planner"
    assert 0 < plan["decision_ms"] < 1000


def test_a_planner_error_keeps_the_allocation_and_status_says_so(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    cluster.register("n0", 2, "127.0.0.1", "i0", now)

    def broken(*_a: Any, **_k: Any) -> allocation.Decision:
        raise RuntimeError("no table for this model")

    monkeypatch.setattr(allocation, "decide", broken)
    view = submit(cluster, "a", now)
    assert view["state"] == "queued"  # nothing placed, nothing stopped
    want = "task a submitted: RuntimeError: no table for this model"
    assert view["plan_error"] == want == cluster.task_view("a")["plan_error"]
    status = _status(cluster)
    assert f"planner error (allocation kept): {want}" in " ".join(status.split())
    monkeypatch.undo()
    cluster._triggers.append("node n0 registered")
    cluster.tick(now + 0.1)  # the node's clock (status may take a node timeout under load)
    assert cluster.task_view("a")["plan_error"] == "" and cluster.tasks["a"].row.placement


def _status(cluster: Cluster) -> str:
    """``unicron status`` against ``cluster`` served on a free port: its output."""
    import argparse
    import contextlib
    import io
    import socket

    from unicron.control.client import status_main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = serve(cluster, TOKEN, "127.0.0.1", port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    out = io.StringIO()
    try:
        args = argparse.Namespace(
            task=None, json=False, coordinator=f"http://127.0.0.1:{port}", token_file=None
        )
        with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
            mp.setenv("UNICRON_TOKEN", TOKEN)
            status_main(args)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    return out.getvalue()


def test_the_placement_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="placement must be one of planner, keep, equal"):
        ClusterSettings(placement="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu must be one of A100-80GB, "):
        ClusterSettings(gpu="GTX-1080")


@pytest.mark.parametrize("described", [False, True])
def test_tasks_that_describe_their_model_are_placed_by_the_performance_model(
    cluster: Cluster, described: bool
) -> None:
    """The live cluster's allocation prices a task that describes its model with the
    performance model: gpt-13b cannot train on the 3 slots a running task could give up,
    so it waits and says why, where counting workers would have taken them."""
    now = time.time()
    cluster.register("n0", 4, "127.0.0.1", "i0", now)

    def model(preset: str) -> dict[str, Any]:
        return {"model": {"preset": preset}, "global_batch": 256} if described else {}

    submit(cluster, "small", now, workers={"min": 1, "max": 4}, **model("gpt-1.3b"))
    assert cluster.tasks["small"].row.placement == [0, 0, 0, 0]
    submit(cluster, "big", now, weight=2.0, workers={"min": 1, "max": 8}, **model("gpt-13b"))
    big = cluster.task_view("big")
    if not described:  # counting workers: the heavier task takes all but small's minimum
        assert cluster.tasks["small"].leaving == {1, 2, 3}
        assert [n for _, n in cluster._pending_adds] == [0, 0, 0] and big["waiting"] == ""
        return
    assert not cluster.tasks["small"].leaving and not cluster._pending_adds
    assert big["state"] == "queued"
    assert big["waiting"] == (
        "waits: no layout of gpt-13b at global batch 256 fits on up to 3 slot(s) of "
        "A100-80GB (4 per node)"
    )


def test_a_task_is_priced_by_its_own_measured_transitions(cluster: Cluster) -> None:
    now = time.time()
    cluster.register("n0", 2, "127.0.0.1", "i0", now)
    submit(cluster, "a", now, workers={"min": 1, "max": 2})
    submit(cluster, "b", now, workers={"min": 1, "max": 2})
    a, b = cluster.tasks["a"], cluster.tasks["b"]
    assert (
        transition_s(a, cluster.tasks.values()) == allocation.TRANSITION_S
    )  # nothing measured yet
    for d in (0.3, 0.1, 0.2):
        cluster._on_event(a, {"event": "transition_end", "rank": 0, "duration_s": d, "ts": now})
    cluster._on_event(a, {"event": "transition_end", "rank": 1, "duration_s": 9.0, "ts": now})
    assert transition_s(a, cluster.tasks.values()) == pytest.approx(0.2)  # rank 0's, their median
    assert transition_s(b, cluster.tasks.values()) == pytest.approx(
        0.2
    )  # none of its own: the cluster's


@pytest.mark.parametrize(
    ("more", "says"),
    [
        ({"weight": 0}, '"weight"],"msg":"Input should be greater than 0"'),
        ({"weight": -2.5}, '"weight"],"msg":"Input should be greater than 0"'),
        ({"workers": {"min": 3, "max": 2}}, "min (3) is above max (2)"),
        ({"model": {"preset": "no-such-model"}}, "model"),
        ({"model": {"layers": 2}}, "model"),
        ({"model": {"preset": "gpt-1.3b"}}, "model and global_batch go together"),
        ({"global_batch": 256}, "model and global_batch go together"),
        ({"model": {"preset": "gpt-1.3b"}, "global_batch": 0}, "global_batch"),
    ],
)
def test_what_the_planner_cannot_take_is_refused_at_submit(
    cluster: Cluster, more: dict[str, Any], says: str
) -> None:
    from fastapi.testclient import TestClient

    from unicron.control.service import make_app

    api = TestClient(make_app(cluster, TOKEN), raise_server_exceptions=False)
    body = {"name": "bad", "script": SCRIPT, **more}
    r = api.post("/v1/tasks", headers={"Authorization": f"Bearer {TOKEN}"}, json=body)
    assert r.status_code == 422 and says in r.text, r.text
    assert "bad" not in cluster.tasks


@pytest.mark.e2e
def test_an_unknown_placement_is_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "unicron", "coordinator", "--state-dir", str(tmp_path),
         "--placement", "fifo"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--placement: invalid choice: 'fifo'" in proc.stderr


def test_a_node_only_a_task_dropped_is_fenced_and_comes_back(cluster: Cluster) -> None:
    """A task judges nodes by its own heartbeats (a suspect confirmed by a failed
    collective): it may drop a node the cluster's table still counts live. Its agent goes on
    speaking: it is fenced all the same, and its new registration is accepted as the node's
    return (found by the cluster soak: such a node was never fenced, never returned, and its
    task waited 126 s for slots the planner saw as held)."""
    from unicron.control.nodetable import Fenced

    now = time.time()
    nid = cluster.register("m0", 2, "127.0.0.1", "k0", now)
    submit(cluster, "b", now, workers={"min": 1, "max": 2})
    b = cluster.tasks["b"]
    assert b.row.placement == [nid, nid] and b.controller is not None
    b.controller.lost_nodes.add(nid)  # the task dropped the node; the table did not
    assert not cluster.nodes[nid].lost
    with pytest.raises(Fenced, match=r"node m0 was declared lost .* task\(s\) b went on"):
        cluster.heartbeat("m0", "k0", now + 0.5)
    assert cluster.nodes[nid].lost
    assert cluster.register("m0", 2, "127.0.0.1", "k1", now + 0.6) == nid  # not a conflict
    assert nid not in b.controller.lost_nodes and not cluster.nodes[nid].lost
    assert cluster.heartbeat("m0", "k1", now + 0.7)


def test_a_node_declared_lost_is_fenced_until_it_registers_again(cluster: Cluster) -> None:
    """A partition that heals: the agent that speaks again after its task went on without
    its node is refused (its workers hold an epoch that is over) until it registers as a new
    process, which brings the node back to its tasks. A silence no task acted on (an agent
    starved for a moment) is not fenced."""
    from unicron.control.nodetable import Fenced

    now = time.time()
    nid = cluster.register("n0", 2, "127.0.0.1", "i0", now)
    submit(cluster, "a", now, workers={"min": 1, "max": 2})
    cluster.register("n1", 2, "127.0.0.1", "j0", now)
    a = cluster.tasks["a"]
    assert a.row.placement == [nid, nid] and a.controller is not None
    late = now + cluster.settings.node_timeout_s + 0.5
    cluster.heartbeat("n1", "j0", late)
    cluster.tick(late)
    assert cluster.nodes[nid].lost and nid not in a.controller.lost_nodes
    assert cluster.heartbeat("n0", "i0", late + 0.1)  # no task dropped it: live again
    assert not cluster.nodes[nid].lost
    a.controller.lost_nodes.add(nid)  # the task dropped the node (heartbeat_lost)
    cluster.nodes[nid].lost = True
    with pytest.raises(Fenced, match=r"node n0 was declared lost .* task\(s\) a went on"):
        cluster.heartbeat("n0", "i0", late + 1)
    with pytest.raises(Fenced):
        cluster.exchange("n0", "i0", a.row.uid, [], late + 1, None)
    assert cluster.nodes[nid].lost  # speaking did not bring it back
    assert cluster.register("n0", 2, "127.0.0.1", "i1", late + 2) == nid
    assert not cluster.nodes[nid].lost
    assert cluster.heartbeat("n0", "i1", late + 2)  # its task's assignment again


def _submit_3d(cluster: Cluster, now: float) -> Any:
    """Task ``a``: the Llama example at TP=2 x PP=2, 4 to 8 workers."""
    llama = str(ROOT / "examples" / "train_llama_parallel.py")
    spec = TaskSpec.model_validate(
        {"name": "a", "script": llama, "tp": 2, "pp": 2, "workers": {"min": 4, "max": 8}}
    )
    cluster.submit(spec, now)
    return cluster.tasks["a"]


def test_a_replica_no_node_holds_is_placed_and_grown_a_stage_per_node(cluster: Cluster) -> None:
    """TP=2 x PP=2 on nodes of two slots: each replica's stages on two nodes; each agent is
    told its slots' places (the assignment, then the coordinator's spawns of slots added
    later), as :mod:`unicron.control.replicas` groups the task's ranks."""
    from unicron.control.planning import assignment

    now = time.time()
    for k in range(2):
        cluster.register(f"n{k}", 2, "127.0.0.1", f"i{k}", now)
    a = _submit_3d(cluster, now)
    assert a.row.placement == [0, 0, 1, 1]
    told = [assignment(a, n, "127.0.0.1:1", b"k" * 32, None) for n in (0, 1)]
    assert [(x.slots, x.places) for x in told] == [((0, 1), (0, 1)), ((2, 3), (2, 3))]
    for k in range(2, 4):  # two more nodes: a second replica, a stage on each
        cluster.register(f"n{k}", 2, "127.0.0.1", f"i{k}", now)
    cluster.tick(now + 0.01)
    assert a.row.placement == [0, 0, 1, 1, 2, 2, 3, 3]
    c = a.controller
    assert c is not None
    spawned = {s.slot: s.place for n in (2, 3) for s in c.take_actions(n) if s.fresh}
    assert spawned == {4: 0, 5: 1, 6: 2, 7: 3}


def test_the_slots_queued_for_a_task_are_numbered_after_its_placed_ranks(cluster: Cluster) -> None:
    """As the allocation sees a task, a slot queued for it is the rank it will get once added
    (after every placed one, in queue order): numbered before them (-1, -2, ...), a replica
    half queued grouped with the placed one that holds the state (found in review)."""
    from unicron.control import replicas
    from unicron.control.planning import plan_view

    now = time.time()
    cluster.register("n0", 4, "127.0.0.1", "i0", now)
    a = _submit_3d(cluster, now)
    assert a.row.placement == [0, 0, 0, 0]
    v = plan_view(a, [1, 1], 1.0)  # two slots queued on node 1
    assert v is not None and v.ranks == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    assert v.planned == {4, 5}
    assert replicas.groups(v.ranks, (2, 2)) == ((0, 1, 2, 3), (4, 5))
    # the layout its epoch runs at, and an excluded rank still in its coordinator's table
    assert v.layout == (2, 2) and v.apart == {}
    a.excluded.add(1)
    v = plan_view(a, [], 1.0)
    assert v is not None and 1 not in v.ranks and v.apart == {1: 0}


def test_an_fsdp_task_in_a_cluster_is_told_its_places_and_settings(cluster: Cluster) -> None:
    """FSDP=2: its replicas are blocks of two slots of a node, its places 0 and 1; the
    agent's settings say so (tp: the stage's ranks on one node); the allocation moves whole
    replicas of it and prices it as a data-parallel task (no tensor-parallel layout)."""
    from unicron.control.planning import assignment, plan_view

    now = time.time()
    cluster.register("n0", 4, "127.0.0.1", "i0", now)
    spec = TaskSpec.model_validate({
        "name": "f", "script": str(ROOT / "examples" / "train_llama_parallel.py"),
        "fsdp": 2, "workers": {"min": 2, "max": 4},
    })  # fmt: skip
    cluster.submit(spec, now)
    told = assignment(cluster.tasks["f"], 0, "127.0.0.1:1", b"k" * 32, None)
    assert told.places == (0, 1, 0, 1)
    assert (told.settings.tp, told.settings.fsdp, told.settings.pp) == (2, 2, 1)
    v = plan_view(cluster.tasks["f"], [], 1.0)
    assert v is not None and (v.tp, v.replica_ranks, v.layouts) == (2, 2, ())


def test_a_fault_that_fired_is_left_out_of_a_later_assignment(cluster: Cluster) -> None:
    """An agent started again (its node back) gets its task's faults from its assignment:
    one that fired already must not fire again (a fault waiting for ``members`` would, at
    the first step the epoch is whole again: found in review)."""
    from unicron.control.planning import assignment, fold
    from unicron.runtime.inject import parse

    now = time.time()
    cluster.register("n0", 2, "127.0.0.1", "i0", now)
    given = ["node:node=0,step=6,members=2", "crash:rank=1,step=9"]
    submit(cluster, "a", now, workers={"min": 1, "max": 2}, inject=given)
    a = cluster.tasks["a"]
    told = assignment(a, 0, "127.0.0.1:1", b"k" * 32, None)
    assert told.inject == tuple(given)
    fold(a, {"event": "fault_injected", "spec": parse(given[0]).spec, "ts": now}, cluster.nodes)
    told = assignment(a, 0, "127.0.0.1:1", b"k" * 32, None)
    assert told.inject == (given[1],)
