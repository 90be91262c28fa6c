"""Least privilege on a real cluster (docs/security.md): a coordinator and an agent as
processes, a task's workers read from ``/proc``. Their environment holds no token of the
cluster; the state directory is the owner's only; a task file may not set the loader's
variables; a CUDA task is refused on a node without GPUs, with the reason in ``status``;
SIGTERM, SIGINT and a failed start of the coordinator all stop its store and remove its
files."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from unicron.control import store as S
from unicron.control.client import Client, ServiceError
from unicron.control.workerenv import Account

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_gpt.py"
TOKEN = "admin-token-nodes-0123"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "UNICRON_TOKEN": TOKEN}

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float = 90.0) -> Any:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state == "Z"  # exited, not yet reaped by its parent


@dataclass
class Coordinator:
    proc: subprocess.Popen[bytes]
    state: Path
    url: str
    client: Client


def start_coordinator(state: Path, *extra: str) -> Coordinator:
    port = free_port()
    log = open(state.parent / f"coordinator-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicron", "coordinator", "--state-dir", str(state),
         "--port", str(port), *extra],
        env=ENV, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"
    client = Client(url, TOKEN, timeout_s=5.0)

    def answers() -> bool:
        assert proc.poll() is None, (state.parent / f"coordinator-{port}.log").read_text()
        try:
            client.request("GET", "/v1/nodes")
            return True
        except Exception:
            return False

    wait_for("coordinator", answers, 60)
    return Coordinator(proc, state, url, client)


def store_pid(state: Path) -> int:
    return int(json.loads((state / "store.json").read_text())["pid"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, str]]:
    """A coordinator and one agent (``n1``, two slots); the agent's environment carries the
    admin token and a marker its workers inherit."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    c = start_coordinator(tmp_path / "state")
    marker = f"UNICRON_TEST_MARKER_{uuid.uuid4().hex}"
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [sys.executable, "-m", "unicron", "agent", "--node-name", "n1", "--slots", "2",
         "--allow-root",
         "--log-dir", str(tmp_path / "logs"), "--coordinator", c.url],
        env={**ENV, marker: "1"}, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        wait_for("node n1", lambda: c.client.request("GET", "/v1/nodes"), 60)
        yield c, marker
    finally:
        for p in (agent, c.proc):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        c.client.close()
        if (c.state / "store.json").exists():  # a task was still running: the store stayed
            os.kill(store_pid(c.state), signal.SIGTERM)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def holding(marker: str) -> dict[int, dict[str, str]]:
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = environ(int(proc.name))
            except OSError:
                continue
            if marker in env:
                found[int(proc.name)] = env
    return found


def test_workers_hold_no_token_and_the_state_is_the_owners(
    cluster: tuple[Coordinator, str], tmp_path: Path
) -> None:
    c, marker = cluster
    spec = {"name": "env", "script": str(TRAIN), "args": ["--steps", "100000"],
            "workers": {"min": 2, "max": 2}, "env": {"HF_HOME": "/tmp/hf"}}  # fmt: skip
    c.client.request("POST", "/v1/tasks", json=spec)

    def workers() -> dict[int, dict[str, str]]:  # the zygote and the workers it forked
        return {p: e for p, e in holding(marker).items() if "UNICRON_TASK" in e}

    def training() -> bool:
        got = c.client.request("GET", "/v1/tasks/env/events")["events"]
        return any(e["event"] == "step_end" for e in got)

    wait_for("a step", training, 120)
    found = wait_for("the zygote and two workers", lambda: len(workers()) >= 3 and workers())
    agents = [e for e in holding(marker).values() if "UNICRON_TASK" not in e]
    assert agents and all(e.get("UNICRON_TOKEN") == TOKEN for e in agents)  # the agent has it
    for pid, env in found.items():
        assert "UNICRON_TOKEN" not in env and TOKEN not in "".join(env.values()), pid
        assert env["HF_HOME"] == "/tmp/hf"  # the task's own env, allow-listed, arrives
    # the training store: a worker's credential opens its own task's keys and no other's, and
    # a client without one gets nothing, not even the list of keys
    env = next(iter(found.values()))
    uid, key, address = env["UNICRON_TASK"], env["UNICRON_STORE_KEY"], env["UNICRON_STORE"]
    assert S.client(address, key).check([f"{uid}/epoch"])
    host, port = address.rsplit(":", 1)
    attacks = {
        "another task's keys": lambda: S.client(address, key).check(["other.1234/epoch"]),
        "no credential": lambda: _bare(host, port).check([f"{uid}/epoch"]),
        "the list of keys": lambda: _bare(host, port).list_keys(),
    }
    for what, attack in attacks.items():
        with pytest.raises((dist.DistError, RuntimeError)):
            attack()
            pytest.fail(what)
    # the state: the directory and every file in it, the owner's only
    state = c.state
    assert state.stat().st_mode & 0o777 == 0o700
    files = [p for p in state.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"state.db", "store.json", "store.log", "events.jsonl"}
    loose = [(str(p), oct(p.stat().st_mode & 0o777)) for p in files if p.stat().st_mode & 0o077]
    assert loose == []
    c.client.request("POST", "/v1/tasks/env/cancel")


def test_the_task_env_may_not_set_the_loader(cluster: tuple[Coordinator, str]) -> None:
    c, _ = cluster
    for name in ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PATH",
                 "UNICRON_TOKEN", "NCCL_NET_PLUGIN", "bad name"):  # fmt: skip
        spec = {"name": "ld", "script": str(TRAIN), "env": {name: "/tmp/evil.so"}}
        with pytest.raises(ServiceError) as exc:
            c.client.request("POST", "/v1/tasks", json=spec)
        assert exc.value.status == 422 and name in exc.value.detail, exc.value.detail


def test_a_cuda_task_is_refused_on_a_node_without_gpus(
    cluster: tuple[Coordinator, str], tmp_path: Path
) -> None:
    from unicron.control.node import _gpus

    if _gpus() > 0:
        pytest.skip("this node has GPUs: nothing to refuse")
    c, _ = cluster
    task = tmp_path / "cuda.yaml"
    task.write_text(f"name: exact\nscript: {TRAIN}\ndevice: cuda\nreduce: exact\n")
    proc = subprocess.run([sys.executable, "-m", "unicron", "submit", str(task),
                           "--coordinator", c.url], capture_output=True, text=True,
                          timeout=60, env=ENV)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "reduce exact is not supported with device cuda" in proc.stderr
    task.write_text(f"name: gpu\nscript: {TRAIN}\ndevice: cuda\n")  # reduce: fast by default
    proc = subprocess.run([sys.executable, "-m", "unicron", "submit", str(task),
                           "--coordinator", c.url], capture_output=True, text=True,
                          timeout=60, env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    view = wait_for(
        "the refusal", lambda: (v := c.client.request("GET", "/v1/tasks/gpu"))["waiting"] and v
    )
    assert view["state"] == "queued" and view["workers"] == 0
    assert "device cuda: node n1 has no CUDA device" in view["waiting"]
    proc = subprocess.run([sys.executable, "-m", "unicron", "status", "--coordinator", c.url],
                          capture_output=True, text=True, timeout=60, env=ENV)  # fmt: skip
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.long),
    ],
)
def test_a_signal_stops_the_coordinator_and_its_store(tmp_path: Path, sig: int) -> None:
    c = start_coordinator(tmp_path / "state")
    pid = store_pid(c.state)
    try:
        assert not gone(pid)
        port = json.loads((c.state / "store.json").read_text())["port"]
        assert listening(port) == ["127.0.0.1"]  # where the coordinator was told, only
        c.proc.send_signal(sig)
        assert c.proc.wait(timeout=30) in (0, 130)
        wait_for("the store's exit", lambda: gone(pid), 30)
        assert not (c.state / "store.json").exists()
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def listening(port: int) -> list[str]:
    """The IPv4 and IPv6 addresses a socket listens on at ``port`` (``/proc/net/tcp*``)."""
    import ipaddress

    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # LISTEN
                raw = bytes.fromhex(addr)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(str(ipaddress.ip_address(words)))
    return found


@pytest.mark.long
def test_a_failed_start_stops_the_store(tmp_path: Path) -> None:
    """The port is taken: uvicorn gives up, and the store started before it goes too."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        state = tmp_path / "state"
        proc = subprocess.run(
            [sys.executable, "-m", "unicron", "coordinator", "--state-dir", str(state),
             "--port", str(port)],
            env=ENV, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    assert proc.returncode != 0
    assert not (state / "store.json").exists()
    wait_for("the store's exit", lambda: not stores_of(state), 30)


def _stop(agent: subprocess.Popen[bytes], c: Coordinator) -> None:
    """SIGTERM to the agent and the coordinator, each waited for, and to the store if a task
    was still running (the coordinator leaves the store to it)."""
    for p in (agent, c.proc):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    c.client.close()
    if (c.state / "store.json").exists():
        os.kill(store_pid(c.state), signal.SIGTERM)


def _bare(host: str, port: str) -> dist.TCPStore:
    return dist.TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=5))


def stores_of(state: Path) -> list[int]:
    """Store processes started for ``state`` (their ``--out`` names it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except OSError:
            continue
        ours = b"unicron.control.store" in cmd and str(state).encode() in cmd
        if ours and not gone(int(proc.name)):
            found.append(int(proc.name))
    return found


@pytest.mark.long
def test_a_rotated_agent_credential_stops_working_while_training_goes_on(
    tmp_path: Path,
) -> None:
    """The agent of n1 holds an agent credential in a file. Rotated mid-run: the old token
    gets 401 at once; the agent's reports wait until its file holds the new one; the task
    finishes all the same."""
    c = start_coordinator(tmp_path / "state")

    def token(name: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "unicron", "token", "add", name, "--role", "agent",
             "--state-dir", str(c.state)],
            capture_output=True, text=True, timeout=60, env=ENV,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    tok = tmp_path / "agent.tok"
    old = token("n1")
    tok.write_text(old + "\n")
    env = {k: v for k, v in ENV.items() if k != "UNICRON_TOKEN"}
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [sys.executable, "-m", "unicron", "agent", "--node-name", "n1", "--slots", "2",
         "--allow-root",
         "--log-dir", str(tmp_path / "logs"), "--coordinator", c.url, "--token-file", str(tok)],
        env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        wait_for("node n1", lambda: c.client.request("GET", "/v1/nodes"), 60)
        spec = {"name": "rot", "script": str(TRAIN), "args": ["--steps", "40"],
                "workers": {"min": 2, "max": 2}, "checkpoint": {"every": 0}}  # fmt: skip
        c.client.request("POST", "/v1/tasks", json=spec)

        def step() -> int:
            got = c.client.request("GET", "/v1/tasks/rot/events")["events"]
            return max((e["step"] for e in got if e["event"] == "step_end"), default=-1)

        wait_for("a step", lambda: step() >= 0, 120)
        new = token("n1")  # rotated: from now on the agent's old token is refused
        stale = Client(c.url, old, timeout_s=5.0)
        with pytest.raises(ServiceError) as exc:
            stale.request("POST", "/v1/agents/n1/heartbeat", json={"instance": "x"})
        assert exc.value.status == 401
        stale.close()
        port = c.url.rsplit(":", 1)[1]
        coordinator_log = tmp_path / f"coordinator-{port}.log"
        wait_for(  # the agent's next requests are refused: its reports wait
            "a refused request of n1",
            lambda: "refused POST /v1/agents/n1" in coordinator_log.read_text(),
        )
        tok.write_text(new + "\n")
        view = wait_for(
            "the task's end",
            lambda: (v := c.client.request("GET", "/v1/tasks/rot"))["state"] in
            ("done", "failed") and v, 180,
        )  # fmt: skip
        assert view["state"] == "done", view
        assert agent.poll() is None  # the agent lived through it
    finally:
        _stop(agent, c)


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])  # the real uid
    raise AssertionError(pid)


@contextlib.contextmanager
def _enterable_by_all(paths: list[Path]) -> Iterator[None]:
    """Let every account enter (o+x, not list) the directories above ``paths`` that it may
    not (this machine's Python lives under /root, 0700), as a site installs for the account
    its workers run as; the modes are restored after."""
    changed: dict[Path, int] = {}
    for path in paths:
        for d in [path.resolve(), *path.resolve().parents]:
            mode = d.stat().st_mode
            if d.is_dir() and not mode & 0o001 and d not in changed:
                changed[d] = mode & 0o7777
                d.chmod(changed[d] | 0o001)
    try:
        yield
    finally:
        for d, mode in changed.items():
            d.chmod(mode)


@pytest.mark.long  # ~12 s; the account switch's parts are tested in test_agent.py
@pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")
def test_an_agent_run_as_root_runs_its_workers_as_the_unprivileged_account(
    tmp_path: Path,
) -> None:
    """``--run-as nobody``: the zygote, every worker (a restarted one too) run as nobody and
    the task ends; an agent started as root says how to choose, in one line, exit 2."""
    python = [Path(sys.executable).resolve(), Path(sys.prefix), Path(sys.base_prefix), ROOT]
    with _enterable_by_all(python):
        _run_as_nobody(tmp_path)


def _run_as_nobody(tmp_path: Path) -> None:
    for flags, says in (
        ([], "give --run-as USER"),
        (["--run-as", "root"], "is root: add --allow-root"),
        (["--run-as", "no-such-account-here"], "no such account"),
    ):
        refused = subprocess.run(
            [sys.executable, "-m", "unicron", "agent", "--coordinator", "http://127.0.0.1:9",
             *flags], env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 2 and says in refused.stderr, (flags, refused.stderr)
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    c = start_coordinator(tmp_path / "state")
    logs = Path(f"/tmp/unicron-test-run-as-{uuid.uuid4().hex}")  # a parent nobody may enter
    marker = f"UNICRON_TEST_MARKER_{uuid.uuid4().hex}"
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [sys.executable, "-m", "unicron", "agent", "--node-name", "n1", "--slots", "2",
         "--run-as", "nobody", "--log-dir", str(logs), "--coordinator", c.url],
        env={**ENV, marker: "1"}, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        wait_for("node n1", lambda: c.client.request("GET", "/v1/nodes"), 60)
        spec = {"name": "nobody", "script": str(TRAIN), "args": ["--steps", "30"],
                "workers": {"min": 2, "max": 2}, "checkpoint": {"every": 0},
                "inject": ["crash:rank=1,step=12"]}  # fmt: skip
        c.client.request("POST", "/v1/tasks", json=spec)
        seen: dict[int, int] = {}

        def training() -> bool:
            for pid, env in holding(marker).items():
                if "UNICRON_TASK" in env:
                    with contextlib.suppress(OSError):
                        seen[pid] = _uid(pid)
            v = c.client.request("GET", "/v1/tasks/nobody")
            return v["state"] in ("done", "failed") and v

        view = wait_for("the task's end", training, 180)
        assert view["state"] == "done", view
        assert len(seen) >= 3, seen  # the zygote and two workers at least
        assert set(seen.values()) == {Account.named("nobody").uid}, seen
        events = c.client.request("GET", "/v1/tasks/nobody/events")["events"]
        assert any(e["event"] == "action" and e["action"] == "restart" for e in events)
        assert all(p.stat().st_uid == Account.named("nobody").uid for p in logs.rglob("*.log")
                   if p.name.startswith("worker"))  # fmt: skip
    finally:
        _stop(agent, c)
        shutil.rmtree(logs, ignore_errors=True)
