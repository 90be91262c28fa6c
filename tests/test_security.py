"""Attacks on the cluster service's door (docs/security.md), each failing as it should:
no token, a forged or non-ASCII one, a body before the token, an oversized body, an agent
acting for another node, forged and replayed reports, a user cancelling another's task,
rotated and expired credentials, user text that looks like markup; and a fuzz of every
operation with and without credentials."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from unicron.control.cluster import Cluster
from unicron.control.credentials import FILE, Credentials, digest, write_entries
from unicron.control.service import make_app
from unicron.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
ADMIN = "admin-token-0123"
TOKENS = {"alice": "alice-token-0123", "bob": "bob-token-01234", "n-a": "agent-a-token-01",
          "n-b": "agent-b-token-01"}  # fmt: skip
ROLES = {"alice": "user", "bob": "user", "n-a": "agent", "n-b": "agent"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("state")
    c = Cluster(state, host="127.0.0.1")
    write_entries(state / FILE, {n: {"role": ROLES[n], "sha256": digest(t.encode()),
                                     "expires": None} for n, t in TOKENS.items()})  # fmt: skip
    try:
        yield c
    finally:
        c.close(stop_store=True)


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> TestClient:
    creds = Credentials(ADMIN, path=cluster.state_dir / FILE)
    return TestClient(make_app(cluster, creds, max_body=64 << 10), raise_server_exceptions=False)


def spec(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "script": SCRIPT, "args": ["--steps", "3"], **more}


def test_the_token_is_checked_before_the_body_is_read(api: TestClient) -> None:
    for data in (b"{not json", b"\xff\xfe", b""):
        r = api.post("/v1/tasks", content=data, headers={"Content-Type": "application/json"})
        assert r.status_code == 401, (data, r.status_code)
    r = api.post("/v1/tasks", content=b"{not json", headers={**auth(ADMIN),
                 "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 422  # with the token, the body is read and found wrong


def test_a_body_over_the_limit_is_413_and_not_parsed(api: TestClient) -> None:
    big = json.dumps(spec("big", args=["x" * 70_000])).encode()
    for headers in ({}, auth(ADMIN)):
        r = api.post("/v1/tasks", content=big, headers={**headers,
                     "Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == (413 if headers else 401), r.status_code

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"name": "big", "args": ["'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"]}'

    r = api.post("/v1/tasks", content=chunks(), headers={**auth(ADMIN),
                 "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413
    assert "big" not in [t["name"] for t in api.get("/v1/tasks", headers=auth(ADMIN)).json()]


def test_a_websocket_without_a_token_is_closed_at_the_door(api: TestClient) -> None:
    from starlette.websockets import WebSocketDisconnect

    codes = []
    for headers in ({}, auth("wrong-token-000"), auth(ADMIN)):
        with (
            pytest.raises(WebSocketDisconnect) as exc,
            api.websocket_connect("/v1/ws", headers=headers),
        ):
            pass
        codes.append(exc.value.code)
    assert codes[:2] == [1008, 1008] and codes[2] != 1008  # no such route: the router's close


def test_odd_bearer_tokens_are_401_never_500(api: TestClient) -> None:
    for value in ("Bearer \xe9t\xe9-token-0123".encode("latin-1"), b"Bearer ", b"Bearer  ",
                  b"Basic " + ADMIN.encode(), b"bearer", ADMIN.encode()):  # fmt: skip
        r = api.get("/v1/tasks", headers={"Authorization": value})  # type: ignore[dict-item]
        assert r.status_code == 401, (value, r.status_code)


def test_openapi_declares_the_bearer_scheme(api: TestClient) -> None:
    schema = api.get("/openapi.json", headers=auth(ADMIN)).json()
    schemes = schema["components"]["securitySchemes"]
    assert [s["scheme"].lower() for s in schemes.values()] == ["bearer"]
    assert all("security" in op for ops in schema["paths"].values() for op in ops.values())
    assert api.get("/docs", headers=auth(ADMIN)).status_code == 200


def test_an_agent_acts_only_as_its_own_node(api: TestClient, caplog: Any) -> None:
    body = {"name": "n-b", "slots": 1, "address": "10.0.0.2", "instance": "i-a"}
    with caplog.at_level(logging.WARNING, logger="unicron.control.service"):
        r = api.post("/v1/agents/register", headers=auth(TOKENS["n-a"]), json=body)
        assert r.status_code == 403 and "may register only node n-a" in r.json()["detail"]
        r = api.post("/v1/agents/n-b/heartbeat", headers=auth(TOKENS["n-a"]),
                     json={"instance": "i-b"})  # fmt: skip
        assert r.status_code == 403
        for method, path in (("POST", "/v1/tasks"), ("GET", "/v1/tasks"), ("GET", "/metrics")):
            r = api.request(method, path, headers=auth(TOKENS["n-a"]), json=spec("agents"))
            assert r.status_code == 403, path
        r = api.post("/v1/agents/n-a/heartbeat", headers=auth(TOKENS["alice"]),
                     json={"instance": "i-a"})  # fmt: skip
        assert r.status_code == 403  # a user is no agent
    assert any("agent n-a may not" in m for m in caplog.messages)


def test_forged_and_replayed_reports_are_refused_with_a_reason(
    api: TestClient, cluster: Cluster, caplog: Any
) -> None:
    for node in ("n-a", "n-b"):
        r = api.post(
            "/v1/agents/register",
            headers=auth(TOKENS[node]),
            json={"name": node, "slots": 1, "address": "127.0.0.1", "instance": node},
        )
        assert r.status_code == 200, r.text  # fmt: skip
    view = api.post("/v1/tasks", headers=auth(ADMIN),
                    json=spec("pair", workers={"min": 2, "max": 2})).json()  # fmt: skip
    assert view["state"] == "pending", view
    uid = view["uid"]
    slot = {name: rank for rank, name in enumerate(view["placement"])}
    verdict = {"kind": "crash", "severity": 2, "action": "restart", "reason": "x", "scope": "slot"}

    def exchange(node: str, *reports: dict[str, Any], instance: str | None = None) -> Any:
        return api.post(f"/v1/agents/{node}/tasks/{uid}/exchange", headers=auth(TOKENS[node]),
                        json={"instance": instance or node, "reports": list(reports)})  # fmt: skip

    def detected(s: int) -> dict[str, Any]:
        return {"type": "Detected", "slot": s, "ts": time.time(), "step": 0, "verdict": verdict,
                "method": "exit", "extra": {"returncode": -9}}  # fmt: skip

    def errors() -> list[Any]:
        events, _ = cluster.events("pair", 0)
        return [e["slot"] for e in events if e["event"] == "error_detected"]

    with caplog.at_level(logging.INFO, logger="unicron.control.cluster"):
        r = exchange("n-a", detected(slot["n-b"]))  # another node's slot: dropped
        assert r.status_code == 200 and errors() == []
        assert any(f"for slot {slot['n-b']} (not on this node)" in m for m in caplog.messages)
        for bad, why in (
            ({"type": "Event", "ts": 1.0, "name": "epoch_begin", "fields": {}}, "epoch_begin"),
            ({"type": "Event", "ts": 1.0, "name": "action",
              "fields": {"action": "exclude", "slot": slot["n-b"]}}, "action"),
            ({"type": "Event", "ts": 1.0, "name": "step_end",
              "fields": {"epoch": "1", "step": 0}}, "epoch is not an integer"),
            ({"type": "Event", "ts": 1.0, "name": "step_end", "fields": {}}, "needs epoch"),
            ({"type": "EpochEntered", "slot": slot["n-a"], "ts": 1.0, "epoch": 99},
             "epoch 99 is not announced"),
            ({**detected(slot["n-a"]), "extra": {"slot": 1}}, "extra field 'slot'"),
        ):  # fmt: skip
            r = exchange("n-a", bad)
            assert r.status_code == 422 and why in r.json()["detail"], (bad, r.text)
            assert any(why in m and "refused the exchange of node n-a" in m
                       for m in caplog.messages), why  # fmt: skip
        assert errors() == []
        for raw in (
            b'{"type": "StepBegan", "slot": %d, "ts": 1e400, "step": 0}' % slot["n-a"],
            b'{"type": "CpuTime", "slot": %d, "ts": 1.0, "cpu_s": NaN}' % slot["n-a"],
        ):
            r = api.post(f"/v1/agents/n-a/tasks/{uid}/exchange", headers={**auth(TOKENS["n-a"]),
                         "Content-Type": "application/json"},
                         content=b'{"instance": "n-a", "reports": [%s]}' % raw)  # fmt: skip
            assert r.status_code == 422 and "not a finite number" in r.text, r.text
        # a replay from a process the node's name was taken from: refused (409)
        r = exchange("n-a", detected(slot["n-a"]), instance="an-old-agent")
        assert r.status_code == 409 and errors() == []
        r = exchange("n-a", detected(slot["n-a"]))  # its own slot: heard
        assert r.status_code == 200 and errors() == [slot["n-a"]]
    api.post("/v1/tasks/pair/cancel", headers=auth(ADMIN))


def test_the_events_api_answers_odd_numbers(api: TestClient, cluster: Cluster) -> None:
    """A diverged loss (NaN) in a task's log, an ``after`` beyond SQLite's integers: 200 and
    422, never 500."""
    api.post("/v1/tasks", headers=auth(ADMIN), json=spec("nan", workers={"min": 99, "max": 99}))
    cluster.state.add_event("nan", {"event": "step_end", "ts": 1.0, "loss": float("nan")})
    r = api.get("/v1/tasks/nan/events", headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["events"][-1]["loss"] == "NaN"
    for after in ("99999999999999999999999", "-1", "x"):
        r = api.get(f"/v1/tasks/nan/events?after={after}", headers=auth(ADMIN))
        assert r.status_code == 422, (after, r.status_code)


def test_a_user_cancels_only_their_own_tasks(api: TestClient) -> None:
    big = {"workers": {"min": 99, "max": 99}}
    r = api.post("/v1/tasks", headers=auth(TOKENS["alice"]), json=spec("alices", **big))
    assert r.status_code == 201 and r.json()["owner"] == "alice"
    uid = r.json()["uid"]
    assert len(uid.rsplit(".", 1)[1]) == 32  # 128 random bits: the prefix of its store keys
    for path in ("/v1/tasks/alices", "/v1/tasks"):  # bob does not learn it; an admin does
        got = api.get(path, headers=auth(TOKENS["bob"])).json()
        assert uid not in json.dumps(got) and "alices" in json.dumps(got)
        assert uid in json.dumps(api.get(path, headers=auth(ADMIN)).json())
    r = api.post("/v1/tasks/alices/cancel", headers=auth(TOKENS["bob"]))
    assert r.status_code == 403 and "belongs to alice" in r.json()["detail"]
    assert api.get("/v1/tasks/alices", headers=auth(TOKENS["bob"])).json()["state"] == "queued"
    r = api.post("/v1/tasks/alices/cancel", headers=auth(TOKENS["alice"]))
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    api.post("/v1/tasks", headers=auth(TOKENS["alice"]), json=spec("alices2", **big))
    r = api.post("/v1/tasks/alices2/cancel", headers=auth(ADMIN))  # an admin may
    assert r.status_code == 200


@pytest.mark.e2e
def test_token_command_bad_input_is_exit_2_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / FILE).write_text("[1, 2]")
    for argv, says in (
        (["add", "bad name", "--state-dir", str(tmp_path)], "NAME: letters"),
        (["add", "admin", "--state-dir", str(tmp_path)], "NAME: letters"),
        (["add", "x", "--state-dir", str(tmp_path / "no")], "not a directory"),
        (["revoke", "ghost", "--state-dir", str(tmp_path)], "no credential named ghost"),
        (["add", "x", "--expires-in", "-1", "--state-dir", str(tmp_path)], "--expires-in"),
        (["list", "--state-dir", str(tmp_path / "bad")], "not a credentials file"),
    ):
        proc = subprocess.run([sys.executable, "-m", "unicron", "token", *argv],
                              capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert says in proc.stderr, (argv, proc.stderr)


@pytest.mark.e2e
def test_rotated_and_expired_credentials_stop_working(tmp_path: Path) -> None:
    """``unicron token add`` twice under one name: the first token stops working at once,
    without a restart of the service (its file is read again when it changes)."""
    state = tmp_path / "state"
    state.mkdir()
    creds = Credentials(ADMIN, path=state / FILE)

    def add(name: str, *more: str) -> str:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "unicron",
                "token",
                "add",
                name,
                "--state-dir",
                str(state),
                *more,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, proc.stderr  # fmt: skip
        return proc.stdout.strip()

    first = add("carol")
    assert creds.who(first.encode()) is not None and creds.who(first.encode()).role == "user"
    second = add("carol")
    assert creds.who(first.encode()) is None and creds.who(second.encode()) is not None
    temp = add("dave", "--expires-in", "60", "--role", "agent")
    assert creds.who(temp.encode()) is not None
    assert creds.who(temp.encode(), now=time.time() + 61) is None
    assert (state / FILE).stat().st_mode & 0o777 == 0o600
    (state / FILE).write_text("{not json")  # a bad edit: the service keeps what it read
    assert creds.who(second.encode()) is not None
    with pytest.raises(UsageError, match="not a credentials file"):
        Credentials(ADMIN, path=state / FILE)  # ... and a start on it is refused


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("value", "why"),
    [("   ", "$UNICRON_TOKEN: a token must be"), ("t\xf6ken-0123", "$UNICRON_TOKEN: a token")],
)
def test_a_blank_or_non_ascii_token_is_exit_2_one_line(value: str, why: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UNICRON_TOKEN": value}
    proc = subprocess.run([sys.executable, "-m", "unicron", "status", "--coordinator",
                           "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert why in proc.stderr


def test_status_prints_user_text_as_text(cluster: Cluster, capsys: Any) -> None:
    """A reason with ``[/x]`` (rich markup's closing tag) in it is printed as it is."""
    import argparse

    from unicron.control import client as C

    class Fake(C.Client):  # the table, not the transport, is what this checks
        def __init__(self) -> None:
            self.url = "-"

        def request(self, method: str, path: str, **kwargs: Any) -> Any:
            if path == "/v1/nodes":
                return [{"name": "n[/x]", "state": "up", "slots": 1, "used": 0,
                         "address": "[bold]a", "silent_s": 0.1}]  # fmt: skip
            return [{"name": "t", "owner": "[/]", "state": "failed", "epoch": 0, "step": -1,
                     "workers": 0, "min_workers": 1, "max_workers": 1, "last_fault": "",
                     "waiting": "", "outcome": {"reason": "bad input [/x] here"}}]  # fmt: skip

    args = argparse.Namespace(task=None, json=False)
    original = C.connect
    C.connect = lambda _: Fake()  # type: ignore[assignment,return-value]
    try:
        assert C.status_main(args) == 0
    finally:
        C.connect = original
    out = capsys.readouterr().out
    assert "bad input [/x] here" in out and "n[/x]" in out and "[bold]a" in out


@pytest.mark.e2e
def test_fuzz_every_operation_with_and_without_credentials(tmp_path: Path) -> None:
    """schemathesis over every operation: with the admin's token no 5xx; without a token,
    or with a wrong one, nothing but 401."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    cluster = Cluster(tmp_path / "state", host="127.0.0.1")
    try:
        app = make_app(cluster, ADMIN)
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=auth(ADMIN))
        ops = [r.ok() for r in schema.get_all_operations()]
        assert len(ops) >= 10
        seen: dict[str, dict[int, int]] = {"admin": {}, "none": {}, "wrong": {}}

        def fuzz(op: Any, who: str, headers: dict[str, str]) -> None:
            @given(case=op.as_strategy())
            @settings(max_examples=6, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def check(case: Any) -> None:
                if who == "none":  # whatever bearer the case made up from the scheme, or none
                    case.headers = {
                        k: v
                        for k, v in (case.headers or {}).items()
                        if k.lower() != "authorization" or v != f"Bearer {ADMIN}"
                    }
                response = case.call(headers=headers)
                code = response.status_code
                seen[who][code] = seen[who].get(code, 0) + 1
                assert code < 500, (who, case.operation.label, response.text)
                assert who == "admin" or code == 401, (who, case.operation.label, code)

            check()

        for op in ops:
            fuzz(op, "admin", auth(ADMIN))
            fuzz(op, "none", {})
            fuzz(op, "wrong", auth("wrong-token-000"))
        assert set(seen["none"]) == {401} and set(seen["wrong"]) == {401}, seen
        assert any(s < 300 for s in seen["admin"]), seen
    finally:
        cluster.close(stop_store=True)


# -- TLS ----------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_tls_the_client_verifies_the_coordinator(cluster: Cluster, tmp_path: Path) -> None:
    """``make certs``' test CA: a client given it talks HTTPS; one without it refuses the
    certificate; plain HTTP to the TLS port gets nothing."""
    import shutil
    import socket
    import threading

    import httpx

    from unicron.control.client import Client
    from unicron.control.service import serve

    if shutil.which("openssl") is None:
        pytest.skip("no openssl here: make certs needs it")
    certs = tmp_path / "certs"
    made = subprocess.run(["make", "-s", "-C", str(ROOT), "certs", f"CERTS={certs}"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = serve(cluster, ADMIN, "127.0.0.1", port,
                tls=(str(certs / "coordinator.pem"), str(certs / "coordinator.key")))  # fmt: skip
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        good = Client(f"https://127.0.0.1:{port}", ADMIN, verify=str(certs / "ca.pem"))
        assert isinstance(good.request("GET", "/v1/nodes"), list)
        good.close()
        unknown = Client(f"https://127.0.0.1:{port}", ADMIN)  # the system's CAs only
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            unknown.request("GET", "/v1/nodes")
        unknown.close()
        plain = Client(f"http://127.0.0.1:{port}", ADMIN)
        with pytest.raises(httpx.TransportError):
            plain.request("GET", "/v1/nodes")
        plain.close()
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--host", "192.0.2.1"], "--host 192.0.2.1 is not a loopback address: serve TLS"),
        (["--tls-cert", "/no/cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "/no/c.pem", "--tls-key", "/no/k.pem"], "--tls-cert /no/c.pem: no such"),
    ],
)
def test_plain_http_off_loopback_is_refused(flags: list[str], says: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "unicron", "coordinator", "--state-dir",
                           str(tmp_path / "s"), *flags], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert says in proc.stderr and not (tmp_path / "s").exists()
