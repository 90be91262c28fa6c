"""The exchange rhythm over the real service: an idle supervisor's link exchanges at the slow
rhythm the coordinator asks for, and a decision the coordinator takes on its own (a cancel
from the API, on the ticker's side of the service) still reaches it within that rhythm.

The service is the real one (a :class:`~unicron.control.cluster.Cluster` with its ticker
behind uvicorn on a free port); the supervisor is a real
:class:`~unicron.control.client.TaskLink` driven as an agent's loop drives it (a round every
20 ms), with reports that stand in for one worker. The decisions behind the rhythm are in
``tests/test_coordinator.py``.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unicron import messages as M
from unicron.control.client import Client, TaskLink
from unicron.control.cluster import Cluster
from unicron.control.service import serve
from unicron.control.taskspec import TaskSpec
from unicron.detect.classify import verdict_for_kind

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "rhythm-token"
ROUND_S = 0.02  # the agent's loop: unicron.control.agent.Agent.run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    cluster = Cluster(tmp_path / "state", host="127.0.0.1", embedded=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve(cluster, TOKEN, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    cluster.start_ticker()
    try:
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        cluster.close()


def _one_task(cluster: Cluster, client: Client) -> tuple[int, int, TaskLink]:
    """Node ``n0`` registered with one slot, task ``t`` submitted and assigned to it: the
    node's id, the task's slot and the agent's link to the task's coordinator."""
    nid = cluster.register("n0", 1, "127.0.0.1", "inst", time.time())
    spec = {"name": "t", "script": str(ROOT / "examples" / "train_gpt.py"),
            "workers": {"min": 1, "max": 1}, "checkpoint": {"every": 0}}  # fmt: skip
    cluster.submit(TaskSpec.model_validate(spec), time.time())
    (assignment,) = cluster.heartbeat("n0", "inst", time.time())
    (slot,) = assignment.slots
    link = TaskLink(client, "n0", "inst", assignment.uid,
                    lambda: M.Census(ts=time.time(), alive=(slot,)))  # fmt: skip
    return nid, slot, link


def test_an_idle_agent_exchanges_slowly_and_still_gets_a_cancel_within_its_rhythm(
    service: tuple[Cluster, str],
) -> None:
    cluster, url = service
    client = Client(url, TOKEN)
    try:
        nid, slot, link = _one_task(cluster, client)
        sent: list[float] = []

        def round_(reports: list[Any]) -> M.Reply:
            """One round of the agent's loop; ``sent``: when the link really exchanged."""
            now = time.time()
            reply = link.exchange(nid, reports, now, read_until=now)
            if link._last_ok == now:
                sent.append(now)
            time.sleep(ROUND_S)
            return reply

        round_([M.Ready(slot=slot, ts=time.time(), microbatches=8)])  # the first epoch starts
        epoch = cluster.tasks["t"].row.epoch
        assert epoch >= 1, cluster.task_view("t")
        round_([M.EpochEntered(slot=slot, ts=time.time(), epoch=epoch)])
        assert link.interval() == pytest.approx(0.25)  # nothing is due: the slow rhythm

        sent.clear()
        t0 = time.time()
        while time.time() - t0 < 2.0:
            round_([])
        # idle: about every 250 ms (8 in 2 s), not every 50 ms (40) nor every round (100)
        assert 4 <= len(sent) <= 12, [round(b - a, 3) for a, b in itertools.pairwise(sent)]

        cancelled = time.time()
        cluster.cancel("t", cancelled)  # the coordinator's decision, between two exchanges
        while not round_([]).over:
            assert time.time() - cancelled < 5.0, "the cancel never reached the agent"
        latency = time.time() - cancelled
        # within one slow interval and a request (loosely: the machine is shared)
        assert latency < 0.75, latency
    finally:
        client.close()


def test_step_reports_wait_for_the_rhythm_and_go_out_with_the_next_urgent_report(
    service: tuple[Cluster, str],
) -> None:
    """A training worker reports every step's begin, end and commit; those reports wait for
    the next exchange of the rhythm (not one request per agent round), and any other report
    goes out at once, carrying the held ones before it, as does the agent's last round."""
    cluster, url = service
    client = Client(url, TOKEN)
    try:
        nid, slot, link = _one_task(cluster, client)
        sent: list[float] = []

        def round_(reports: list[Any]) -> None:
            now = time.time()
            link.exchange(nid, reports, now, read_until=now)
            if link._last_ok == now:
                sent.append(now)
            time.sleep(ROUND_S)

        round_([M.Ready(slot=slot, ts=time.time(), microbatches=8)])
        epoch = cluster.tasks["t"].row.epoch
        round_([M.EpochEntered(slot=slot, ts=time.time(), epoch=epoch)])

        def step_reports(step: int) -> list[Any]:
            ts = time.time()
            end = {"epoch": epoch, "rank": 0, "step": step, "loss": 1.0, "duration_s": 0.01}
            return [M.StepBegan(slot=slot, ts=ts, step=step, epoch=epoch),
                    M.StepComputed(slot=slot, ts=ts, step=step, compute_s=0.01),
                    M.Event(ts=ts, name="step_end", fields=end)]  # fmt: skip

        sent.clear()
        t0, step = time.time(), 0
        while time.time() - t0 < 2.0:
            step += 1
            round_(step_reports(step))
        # a step every round (~100 in 2 s): about every 250 ms, not once per round
        assert 4 <= len(sent) <= 20, [round(b - a, 3) for a, b in itertools.pairwise(sent)]
        for _ in range(10):  # the last round may have been the rhythm's own exchange
            if cluster.tasks["t"].row.committed_step < step:
                break
            step += 1
            round_(step_reports(step))
        assert cluster.tasks["t"].row.committed_step < step  # the last ones are held

        before = len(sent)
        round_([M.CpuTime(slot=slot, ts=time.time(), cpu_s=1.0)])  # not a step report
        assert len(sent) == before + 1  # at once ...
        assert cluster.tasks["t"].row.committed_step == step  # ... with the held ones

        step += 1
        round_(step_reports(step))
        now = time.time()
        link.exchange(nid, [], now, read_until=now, flush=True)  # the agent's last round
        assert link._last_ok == now and cluster.tasks["t"].row.committed_step == step
    finally:
        client.close()


def test_a_refused_report_is_dropped_alone_and_the_others_reach_the_coordinator(
    service: tuple[Cluster, str],
) -> None:
    """An exchange the cluster refuses for one report (422 naming its position) costs that
    report only: the link drops it and sends the others in the next round, and the node's
    later reports go through (before, the link kept the refused report and every later
    exchange of the task from that node was refused with it, until the node was judged
    silent: the soak's exit report with ``returncode: None``)."""
    cluster, url = service
    client = Client(url, TOKEN)
    try:
        nid, slot, link = _one_task(cluster, client)
        forged = M.Event(ts=time.time(), name="forged", fields={"slot": slot})
        ready = M.Ready(slot=slot, ts=time.time(), microbatches=8)
        now = time.time()
        link.exchange(nid, [forged, ready], now, read_until=now)  # refused: 422, refused=0
        assert cluster.tasks["t"].row.epoch == 0  # nothing of it was heard
        deadline = time.time() + 10
        while cluster.tasks["t"].row.epoch < 1:  # the ready alone, in a next round
            assert time.time() < deadline, "the report behind the refused one never went out"
            now = time.time()
            link.exchange(nid, [], now, read_until=now)
            time.sleep(ROUND_S)
        epoch = cluster.tasks["t"].row.epoch
        now = time.time()
        link.exchange(nid, [M.EpochEntered(slot=slot, ts=now, epoch=epoch)], now, read_until=now)
        assert link._last_ok == now and not link._pending  # later reports go through
    finally:
        client.close()


@pytest.mark.parametrize("lost", ["timeout", "unreadable"])
def test_an_answer_lost_on_the_way_back_is_given_again(
    service: tuple[Cluster, str], lost: str
) -> None:
    """The exchange that reported a crash (of the task's starting worker) reached the
    coordinator, whose answer (the restart's ``Spawn``) was lost on the way back (here: a
    timeout raised after the real request). The link's next exchange carries the crash
    again, applied once (its index was heard), and the agent's census, which has no worker in
    the slot: the ``Spawn`` comes again. Before, the crash was applied twice (two restarts
    counted) and the census ignored."""
    import httpx

    cluster, url = service
    client = Client(url, TOKEN)
    try:
        nid, slot, _ = _one_task(cluster, client)
        alive = {slot}
        uid = cluster.tasks["t"].row.uid
        link = TaskLink(client, "n0", "inst", uid,
                        lambda: M.Census(ts=time.time(), alive=tuple(alive)))  # fmt: skip
        real = client.request

        def lose(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)  # the coordinator hears it and answers ...
            if lost == "timeout":  # ... into the void
                raise httpx.ReadTimeout("the answer was lost")
            raise ValueError("Expecting value: line 1 column 1 (char 0)")  # ... or garbled

        client.request = lose  # type: ignore[method-assign]
        alive.clear()
        now = time.time()
        crash = M.WorkerFailed(slot=slot, ts=now, verdict=verdict_for_kind("segfault"))
        assert link.exchange(nid, [crash], now, read_until=now).actions == ()
        client.request = real  # type: ignore[method-assign]
        deadline = time.time() + 10
        while True:
            time.sleep(ROUND_S)
            now = time.time()
            reply = link.exchange(nid, [], now, read_until=now)
            if reply.actions:
                break
            assert time.time() < deadline, "the restart's Spawn never came again"
        assert reply.actions == (M.Spawn(slot),)
        # the crash report went out twice, and was applied once: one restart decided
        events, _ = cluster.events("t", 0)
        assert [e["slot"] for e in events if e["event"] == "action"] == [slot]
    finally:
        client.close()
