"""The cluster service's API and the commands that use it: tokens, 4xx paths, bad input, a
fuzz of the API against its own OpenAPI schema, and the CLI's one-line errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from unicron.control.cluster import Cluster, ClusterSettings, Conflict
from unicron.control.service import make_app, serve
from unicron.control.state import open_state
from unicron.control.taskspec import TaskSpec

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("state"), host="127.0.0.1", settings=ClusterSettings())
    try:
        yield c
    finally:
        c.close(stop_store=True)


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> TestClient:
    return TestClient(make_app(cluster, TOKEN), raise_server_exceptions=False)


def spec(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "script": SCRIPT, "args": ["--steps", "3"], **more}


def test_no_token_or_a_wrong_one_gets_401_and_a_log_line(
    api: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="unicron.control.service"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path in (("GET", "/v1/tasks"), ("GET", "/metrics"),
                                 ("POST", "/v1/tasks"), ("GET", "/v1/nodes"),
                                 ("GET", "/openapi.json"), ("GET", "/docs")):  # fmt: skip
                r = api.request(method, path, headers=headers, json=spec("x"))
                assert r.status_code == 401, (method, path, headers)
                assert r.json() == {"detail": "missing or wrong token"}
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 18
    assert "no token" in refused[0] and "a wrong token" in refused[-1]
    assert api.get("/v1/tasks", headers=AUTH).status_code == 200
    assert api.get("/openapi.json", headers=AUTH).status_code == 200


def test_unknown_task_and_node_are_404(api: TestClient) -> None:
    for method, path in (("GET", "/v1/tasks/nope"), ("POST", "/v1/tasks/nope/cancel"),
                         ("GET", "/v1/tasks/nope/events")):  # fmt: skip
        r = api.request(method, path, headers=AUTH)
        assert r.status_code == 404 and r.json()["detail"] == "no task named nope"
    r = api.post("/v1/agents/ghost/heartbeat", headers=AUTH, json={"instance": "i"})
    assert r.status_code == 404 and "register first" in r.json()["detail"]


def test_bad_bodies_are_422_naming_the_field(api: TestClient) -> None:
    for body, field in (
        (spec("a", workers={"min": 3, "max": 2}), "min (3) is above max (2)"),
        (spec("a", colour="red"), "colour"),
        (spec("a", threads="many"), "threads"),
        ({"script": SCRIPT}, "name"),
    ):
        r = api.post("/v1/tasks", headers=AUTH, json=body)
        assert r.status_code == 422 and field in r.text, r.text
    r = api.post("/v1/tasks", headers=AUTH, json=spec("a", script="/no/such.py"))
    assert r.status_code == 422
    assert r.json()["detail"] == "script: no such file on the coordinator's host: /no/such.py"
    for data in (b"{not json", b"", b"\xff\xfe"):
        r = api.post(
            "/v1/tasks", headers={**AUTH, "Content-Type": "application/json"}, content=data
        )
        assert r.status_code == 422, (data, r.status_code)
    r = api.post("/v1/agents/register", headers=AUTH, json={"name": "bad name", "slots": 1,
                 "address": "x", "instance": "i"})  # fmt: skip
    assert r.status_code == 422
    names = [t["name"] for t in api.get("/v1/tasks", headers=AUTH).json()]
    assert "a" not in names  # nothing half-written


def test_conflicts_are_409(api: TestClient, cluster: Cluster) -> None:
    r = api.post("/v1/tasks", headers=AUTH, json=spec("queued", workers={"min": 64, "max": 64}))
    assert r.status_code == 201 and r.json()["state"] == "queued"
    r = api.post("/v1/tasks", headers=AUTH, json=spec("queued"))
    assert r.status_code == 409 and "a task named queued exists (queued)" in r.json()["detail"]
    r = api.post("/v1/tasks/queued/cancel", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    r = api.post("/v1/tasks/queued/cancel", headers=AUTH)
    assert r.status_code == 409 and "already ended (cancelled)" in r.json()["detail"]
    body = {"name": "n9", "slots": 1, "address": "10.0.0.9", "instance": "first"}
    assert api.post("/v1/agents/register", headers=AUTH, json=body).status_code == 200
    r = api.post("/v1/agents/register", headers=AUTH, json={**body, "instance": "second"})
    assert r.status_code == 409 and "node n9 is live" in r.json()["detail"]
    r = api.post("/v1/agents/n9/heartbeat", headers=AUTH, json={"instance": "second"})
    assert r.status_code == 409 and "taken over" in r.json()["detail"]
    # an exchange carrying an action, or something that is not a message: refused, not applied
    for reports in ([{"type": "Spawn", "slot": 0}], [{"type": "Ready", "slot": "x", "ts": 1}]):
        r = api.post("/v1/agents/n9/tasks/x.1/exchange", headers=AUTH,
                     json={"instance": "first", "reports": reports})  # fmt: skip
        assert r.status_code == 422, r.text


def test_metrics_are_prometheus_text(api: TestClient) -> None:
    r = api.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert (
        'unicron_tasks{state="queued"}' in r.text and "unicron_detection_seconds_bucket" in r.text
    )


def test_fuzz_the_api_against_its_own_schema(tmp_path: Path) -> None:
    """schemathesis: every operation, bounded examples; no 5xx, and the state still loads."""
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.submit(
            TaskSpec.model_validate(spec("seed", workers={"min": 2, "max": 2})), time.time()
        )
        fuzz(cluster)
    finally:
        cluster.close(stop_store=True)
    again = Cluster(tmp_path / "state", host="127.0.0.1")  # a restart loads what it left
    try:
        assert again.state.meta("schema") == "unicron-state/1" and "seed" in again.tasks
        assert len(again.nodes) > 0  # the fuzz registered nodes
    finally:
        again.close(stop_store=True)


def fuzz(cluster: Cluster) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    app = make_app(cluster, TOKEN)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    seen: dict[int, int] = {}
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 10, [o.label for o in ops]
    for op in ops:

        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def check(case: Any) -> None:
            response = case.call(headers=AUTH)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.operation.label, case.body, response.text)

        check()
    assert any(400 <= s < 500 for s in seen) and any(s < 300 for s in seen), seen
    reopened = open_state(cluster.state_dir)  # a second reader: the database is whole
    assert {t.name for t in reopened.tasks()} == {t.name for t in cluster.state.tasks()}
    reopened.close()


# -- a real server, the commands -------------------------------------------------------------
@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Iterator[str]:
    import socket

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
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def unicron(*args: str, url: str = "http://127.0.0.1:9", token: str = TOKEN) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UNICRON_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "unicron", *args, "--coordinator", url],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip


def test_submit_of_a_bad_task_file_is_exit_2_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text(f"name: t\nscript: {SCRIPT}\nworkers: {{min: 4, max: 2}}\n")
    proc = unicron("submit", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"unicron: error: {bad}: workers: Value error, workers: min (4) is above max (2)"
    ]


def test_status_json_submit_and_a_refused_token(server: str, tmp_path: Path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text(f"name: waits\nscript: {SCRIPT}\nworkers: {{min: 99, max: 99}}\n")
    proc = unicron("submit", str(task), url=server)
    assert proc.returncode == 0 and proc.stdout.strip() == "submitted waits: queued", proc.stderr
    proc = unicron("status", "--json", url=server)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout)
    waits = next(t for t in got["tasks"] if t["name"] == "waits")
    assert (waits["state"], waits["min_workers"]) == ("queued", 99)
    assert isinstance(got["nodes"], list)
    proc = unicron("status", "nope", url=server)
    assert proc.returncode == 2 and proc.stderr.strip() == "unicron: error: no task named nope"
    proc = unicron("status", url=server, token="wrong-token")
    assert proc.returncode == 2 and proc.stderr.strip() == "unicron: error: missing or wrong token"


def test_a_second_agent_under_a_live_name_exits_2(server: str, cluster: Cluster) -> None:
    cluster.register("busy", 1, "127.0.0.1", "the-first", time.time())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            cluster.heartbeat("busy", "the-first", time.time())

    threading.Thread(target=beat, daemon=True).start()
    try:
        proc = unicron("agent", "--node-name", "busy", "--slots", "1", "--allow-root", url=server)
    finally:
        stop.set()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()  # where it connects, then why it stopped
    assert len(lines) == 2 and f"node busy, 1 slot(s), connecting to {server}" in lines[0]
    assert "unicron: error: the coordinator refused node busy: node busy is live" in lines[1]


def test_an_agent_that_cannot_reach_the_coordinator_says_so_and_gives_up(tmp_path: Path) -> None:
    t0 = time.monotonic()
    # port 9: nobody answers
    agent = ("agent", "--node-name", "lone", "--connect-timeout", "1.5", "--allow-root")
    proc = unicron(*agent, "--log-dir", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        f"node lone, 1 slot(s), connecting to http://127.0.0.1:9 (worker logs in {tmp_path})"
        in lines[0]
    )
    assert "does not answer" in lines[1] and "retrying for 1.5 s" in lines[1], lines
    assert lines[-1].startswith(
        "unicron: error: node lone: cannot reach the coordinator at http://127.0.0.1:9 after 1.5 s:"
    ), lines
    assert len(lines) == 3 and time.monotonic() - t0 < 50
    proc = unicron("agent", "--connect-timeout", "0")
    assert proc.returncode == 2 and "--connect-timeout must be > 0" in proc.stderr


# -- what a person reads: node names, reused task names, counters over a restart -------------
def test_names_in_events_a_reused_name_and_counters_over_a_restart(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.register("gpu-7", 2, "127.0.0.1", "i1", time.time())
        cluster.register("gpu-3", 2, "127.0.0.1", "i2", time.time())  # node 1, named gpu-3
        cluster.submit(TaskSpec.model_validate(spec("t", workers={"min": 1, "max": 1})), 1.0)
        task = cluster.tasks["t"]
        assert task.events is not None and task.row.placement in ([0], [1])
        nid = task.row.placement[0]
        name = cluster.nodes[nid].row.name
        task.events.emit("error_detected", task="t", slot=0, rank=0, kind="killed", severity=2,
                         method="process")  # fmt: skip
        assert task.row.last_fault == f"killed (SEV2) on slot 0 (node {name})"
        task.events.emit("error_detected", task="t", node=1, kind="heartbeat_lost", severity=1,
                         method="heartbeat")  # fmt: skip
        assert task.row.last_fault == "heartbeat_lost (SEV1) on node gpu-3"
        found, _ = cluster.events("t", 0)
        assert [e.get("node_name") for e in found] == [None, "gpu-3"]  # beside "node": 1
        assert found[1]["node"] == 1
        uid = task.row.uid
    finally:
        cluster.close(stop_store=True)
    # the store went with the service: a new one, and the task adopted (it never had an
    # epoch: it waits for its workers as a new task does); cancelled, its name is free
    again = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        metrics = again.prometheus().decode()
        assert 'unicron_failures_total{kind="heartbeat_lost",severity="1"} 1.0' in metrics
        assert 'unicron_failures_total{kind="killed",severity="2"} 1.0' in metrics
        assert again.tasks["t"].row.state == "pending"
        again.cancel("t", 1.5)
        again.tick(1.6)  # no workers to stop: it ends at once
        assert again.tasks["t"].row.state == "cancelled"
        view = again.submit(TaskSpec.model_validate(spec("t", workers={"min": 9, "max": 9})), 2.0)
        assert view["name"] == "t" and view["uid"] != uid and view["state"] == "queued"
        with pytest.raises(Conflict, match="a task named t exists \\(queued\\)"):
            again.submit(TaskSpec.model_validate(spec("t")), 3.0)
        old = again.task_view(uid)  # the ended one, archived under its uid, events and all
        assert old["state"] == "cancelled" and old["last_fault"].startswith("heartbeat_lost")
        assert [e["event"] for e in again.events(uid, 0)[0]][:2] == ["error_detected"] * 2
        assert again.events("t", 0)[0] == []
    finally:
        again.close(stop_store=True)
    state = open_state(tmp_path / "state")  # the archive is in the state a restart loads
    try:
        assert {t.name: t.state for t in state.tasks()} == {uid: "cancelled", "t": "queued"}
        assert len(state.events(uid)) >= 2 and state.events("t") == []
    finally:
        state.close()


def test_logs_readable_or_json_and_the_report_is_run_s_table(server: str, cluster: Cluster) -> None:
    """``unicron logs``: one readable line an event (node names), ``--json`` the stored lines;
    ``unicron report``: the table ``unicron run`` prints (:func:`render`) of the same events,
    ``--json`` its data."""
    import io
    import json

    from rich.console import Console

    from unicron.control.report import render

    cluster.register("cli-node", 1, "127.0.0.1", "cli", time.time())
    cluster.submit(TaskSpec.model_validate(spec("shown", workers={"min": 1, "max": 1})), 1.0)
    task = cluster.tasks["shown"]
    assert task.events is not None and task.row.state == "pending", task.row
    nid = task.row.placement[0]
    name = cluster.nodes[nid].row.name  # "cli-node", or another free node of this module
    emit, t = task.events.emit, time.time()
    emit("step_end", ts=t, task="shown", step=0, loss=4.5, rank=0)
    emit("fault_injected", ts=t + 1, task="shown", fault="node", spec="node:node=0,step=1",
         node=nid, step=1)  # fmt: skip
    emit("error_detected", ts=t + 1.5, task="shown", node=nid, kind="heartbeat_lost",
         severity=1, method="heartbeat", reason="silent for 2 s")  # fmt: skip
    emit("action", ts=t + 1.6, task="shown", action="exclude", node=nid)
    emit("transition_end", ts=t + 2, task="shown", duration_s=0.4, state_source="peer_node",
         microbatches_reused=6, microbatches_recomputed=2, rank=0)  # fmt: skip
    emit("step_end", ts=t + 2.5, task="shown", step=1, loss=4.25, rank=0)
    emit("task_end", ts=t + 3, task="shown", status="ok", steps=2, final_loss=4.25,
         params_sha256="ab" * 32)  # fmt: skip
    events = cluster.events("shown", 0)[0]

    proc = unicron("logs", "shown", url=server)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(events) and "{" not in proc.stdout
    assert f" error_detected  node={name} kind=heartbeat_lost severity=1 " in lines[2]
    assert 'reason="silent for 2 s"' in lines[2] and "step=1 loss=4.25" in lines[5]
    proc = unicron("logs", "shown", "--json", url=server)
    assert [json.loads(x) for x in proc.stdout.splitlines()] == events

    proc = unicron("report", "shown", url=server)
    assert proc.returncode == 0, proc.stderr
    console = Console(file=io.StringIO(), width=160)
    render(events, console)
    assert proc.stdout == console.file.getvalue()  # type: ignore[attr-defined]
    assert (
        "exclude(node" in proc.stdout and f"{name})" in proc.stdout and "peer_node" in proc.stdout
    )
    proc = unicron("report", "shown", "--json", url=server)
    got = json.loads(proc.stdout)
    (inc,) = got["incidents"]
    assert (inc["detected_by"], inc["kind"], inc["reused"]) == ("heartbeat", "heartbeat_lost", 6)
    assert inc["actions"] == [f"exclude(node {name})"] and abs(inc["detection_s"] - 0.5) < 1e-6
    assert got["task_end"]["status"] == "ok" and got["steps_redone"] == 0
    proc = unicron("report", "nope", url=server)
    assert proc.returncode == 2 and proc.stderr.strip() == "unicron: error: no task named nope"
    # a long reason is shown whole by ``unicron status`` (wrapped in its cell, not cut)
    reason = "waited 600 s below the minimum of 4 workers for capacity; " * 2 + "the-last-word"
    cluster._end(task, "failed", reason, time.time())
    proc = unicron("status", url=server)
    assert proc.returncode == 0 and "the-last-word" in proc.stdout, proc.stdout


def test_a_restarted_service_adopts_a_task_without_the_slots_it_gave_back(tmp_path: Path) -> None:
    """A slot the task gave back (placement -1) is nobody's: the coordinator that adopts the
    task after a restart must not count it (found by the cluster soak: node -1 was declared
    silent, "no heartbeat from node -1", and its slots excluded)."""
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.register("gpu-0", 2, "127.0.0.1", "i1", time.time())
        cluster.submit(TaskSpec.model_validate(spec("t", workers={"min": 1, "max": 2})), 1.0)
        task = cluster.tasks["t"]
        assert task.row.placement == [0, 0]
        task.row.placement[1] = -1  # released, as the cluster's tick records it
        task.row.state = "running"
        cluster.state.save_task(task.row)
    finally:
        cluster.close(stop_store=True)
    again = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        c = again.tasks["t"].controller
        assert c is not None
        assert sorted(c.book.slots) == [0] and -1 not in c.book.heartbeats
        again.tick(time.time() + 10.0)  # past every timeout: only node 0 can be silent
        found, _ = again.events("t", 0)
        assert not [e for e in found if e.get("node") == -1], found
    finally:
        again.close(stop_store=True)


def test_a_task_that_cannot_be_adopted_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted service that cannot adopt one task (found by the cluster soak: a logged
    epoch naming a slot given back raised in the adoption and killed every coordinator's
    start, so nothing led the cluster) fails that task and adopts the others."""
    from unicron.control import cluster as cluster_module

    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.register("gpu-0", 2, "127.0.0.1", "i1", time.time())
        for name in ("good", "bad"):
            cluster.submit(TaskSpec.model_validate(spec(name, workers={"min": 1, "max": 1})), 1.0)
            row = cluster.tasks[name].row
            row.state = "running"
            cluster.state.save_task(row)
    finally:
        cluster.close(stop_store=True)
    real = cluster_module.logged_epoch

    def logged_epoch(state: Any, row: Any) -> Any:
        if row.name == "bad":
            raise KeyError(7)
        return real(state, row)

    monkeypatch.setattr(cluster_module, "logged_epoch", logged_epoch)
    again = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        again.tick(time.time())
        bad, good = again.tasks["bad"], again.tasks["good"]
        assert bad.row.state == "failed" and "not adopted: KeyError: 7" in bad.row.outcome["reason"]
        assert good.row.state in ("running", "waiting") and good.controller is not None
        (end,) = [e for e in again.events("bad", 0)[0] if e["event"] == "task_end"]
        assert end["status"] == "failed"
    finally:
        again.close(stop_store=True)


def test_a_task_whose_coordinator_raises_fails_alone(tmp_path: Path) -> None:
    """A bug in one task's decisions (an exception out of its coordinator's tick: the
    cluster soak found one) fails that task; the cluster's ticker goes on for the others."""
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.register("gpu-0", 2, "127.0.0.1", "i1", time.time())
        for name in ("bad", "good"):
            cluster.submit(TaskSpec.model_validate(spec(name, workers={"min": 1, "max": 1})), 1.0)
        bad, good = (cluster.tasks[n].controller for n in ("bad", "good"))
        assert bad is not None and good is not None
        ticked: list[float] = []

        def broken(now: float, spare: int | None = None) -> None:
            raise IndexError("list index out of range")

        def counted(now: float, spare: int | None = None, tick: Any = good.tick) -> None:
            ticked.append(now)
            tick(now, spare)

        bad.tick, good.tick = broken, counted  # type: ignore[method-assign]
        cluster.tick(time.time())
        assert bad.over() and "its coordinator failed: IndexError" in bad.outcome.reason
        assert ticked and not good.over()
    finally:
        cluster.close(stop_store=True)


def test_the_ticker_tells_each_coordinator_the_slots_the_cluster_could_give_it(
    tmp_path: Path,
) -> None:
    """A task below its minimum waits where the planner has slots to give it
    (:func:`unicron.control.planning.spare_slots`): each tick hands the count over."""
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        cluster.register("gpu-0", 4, "127.0.0.1", "i1", time.time())
        cluster.submit(TaskSpec.model_validate(spec("a", workers={"min": 1, "max": 2})), 1.0)
        cluster.submit(TaskSpec.model_validate(spec("b", workers={"min": 1, "max": 1})), 1.0)
        a, b = (cluster.tasks[n].controller for n in ("a", "b"))
        assert a is not None and b is not None
        cluster.tick(time.time())
        # 4 slots: a holds 2 (1 above its minimum), b 1, 1 free
        assert (a.book.spare_slots, b.book.spare_slots) == (1, 2)
    finally:
        cluster.close(stop_store=True)


def test_a_coordinator_that_takes_over_fences_the_old_ones_store_writes(tmp_path: Path) -> None:
    """Each coordinator on a state counts one more generation and writes it to the training
    store as its fencing token for every task it runs: a write of the one before it that
    arrives after the takeover (queued in a cut host's kernel) is refused (found by the
    cluster soak: the old leader's epoch landed after the new one had read the store)."""
    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    again = None
    try:
        cluster.register("gpu-0", 1, "127.0.0.1", "i1", time.time())
        cluster.submit(TaskSpec.model_validate(spec("t", workers={"min": 1, "max": 1})), 1.0)
        task = cluster.tasks["t"]
        task.row.state = "running"
        cluster.state.save_task(task.row)
        assert task.controller is not None
        old, uid = task.controller.store, task.row.uid
        old.set(f"{uid}/before", "1")
        again = Cluster(tmp_path / "state", host="127.0.0.1")  # the old one is fenced, alive
        assert again.store.token == cluster.store.token + 1
        new = again.tasks["t"].controller
        assert new is not None and new.store.get(f"{uid}/before") == b"1"
        old.set(f"{uid}/after", "1")  # refused: its connection is closed
        assert not new.store.check([f"{uid}/after"])
        new.store.set(f"{uid}/after", "2")
        assert new.store.get(f"{uid}/after") == b"2"
    finally:
        if again is not None:
            again.close(stop_store=True)
        cluster.close(stop_store=True)
