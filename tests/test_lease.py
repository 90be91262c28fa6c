"""A leader lease in etcd (:mod:`unicron.control.lease`), and an agent's client that follows
whichever coordinator leads (:class:`unicron.control.client.Client` with several URLs).

The lease tests need etcd (the distribution's ``etcd-server``) and are skipped without it;
the failover tests need nothing but sockets.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest

from unicron.control.client import Client
from unicron.control.lab import etcd_command
from unicron.control.lease import Etcd, Leadership


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd here (apt-get install etcd-server)")
    client, peer = _port(), _port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        etcd_command(tmp_path / "etcd", "127.0.0.1", client, peer),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.post(f"{url}/v3/kv/range", json={"key": "eA=="}, timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


def test_one_leads_the_other_waits_and_takes_over_when_the_lease_lapses(etcd: str) -> None:
    a = Leadership(etcd, "t", "http://a")
    b = Leadership(etcd, "t", "http://b")
    assert a.acquire()
    lost: list[float] = []
    a.hold(lambda: lost.append(time.monotonic()))
    won: list[bool] = []
    waiting = threading.Thread(target=lambda: won.append(b.acquire()))
    waiting.start()
    time.sleep(2 * a.ttl_s)  # renewed all along: b waits
    assert not won and a.etcd.get(a.key) == "http://a"
    stopped = time.monotonic()
    a._stop.set()  # a stops renewing (its host cut off)
    waiting.join(timeout=20)
    assert won == [True] and b.etcd.get(b.key) == "http://b"
    assert a.ttl_s - 0.5 < time.monotonic() - stopped < 10 * a.ttl_s
    b.resign()
    assert Etcd(etcd, timeout_s=1.0).get(b.key) is None  # resigned: the next leads at once


def test_a_leader_that_cannot_renew_fences_itself_before_its_lease_lapses(etcd: str) -> None:
    a = Leadership(etcd, "t", "http://a")
    assert a.acquire()
    renewed = a.renewed
    lost: list[float] = []
    a.etcd = type(a.etcd)("http://127.0.0.1:9", timeout_s=0.2)  # etcd out of reach
    a.hold(lambda: lost.append(time.monotonic()))
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and lost[0] - renewed < a.ttl_s  # before the lease can lapse in etcd


class _Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_the_client_moves_to_the_coordinator_that_answers_and_stays() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    refused = f"http://127.0.0.1:{_port()}"  # nobody listens: refused at once
    leader = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        c = Client(f"{refused},{leader}", "t")
        assert c.request("GET", "/v1/nodes") == {"ok": True}
        assert c.url == leader
        assert c.request("GET", "/v1/nodes") == {"ok": True} and c.url == leader
        c.close()
    finally:
        server.shutdown()


def test_with_none_answering_the_client_keeps_to_one_that_refused_not_one_that_is_silent() -> None:
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)  # accepts nothing: times out
    fillers = []
    for _ in range(4):  # fill the backlog so that connecting waits
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(silent.getsockname())
        fillers.append(f)
    refused = f"http://127.0.0.1:{_port()}"
    c = Client(f"http://127.0.0.1:{silent.getsockname()[1]},{refused}", "t", timeout_s=0.5)
    try:
        with pytest.raises(httpx.TransportError):
            c.request("GET", "/v1/nodes")
        assert c.url == refused
    finally:
        c.close()
        silent.close()
        for f in fillers:
            f.close()
