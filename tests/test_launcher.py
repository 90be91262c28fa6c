"""A zygote started ahead of its task (:func:`unicron.runtime.launcher.prewarm`, what
``unicron run`` starts per node while its coordinator comes up): it takes its task's
environment from the agent that adopts it, and ends if none comes."""

from __future__ import annotations

import json
import os
import time
from multiprocessing.connection import Listener
from pathlib import Path

import pytest

from unicron.messages import ZygoteUp, from_wire
from unicron.protocol import ENV_AGENT, ENV_AUTHKEY
from unicron.runtime.launcher import prewarm

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_an_adopted_zygote_takes_its_tasks_environment_and_reports_to_its_agent(
    tmp_path: Path,
) -> None:
    key = os.urandom(16)
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        host, port = listener.address
        env = {k: v for k, v in os.environ.items() if k not in (ENV_AGENT, ENV_AUTHKEY)}
        zygote = prewarm(env, str(tmp_path / "zygote.log"))
        try:
            assert zygote.stdin is not None
            task_env = {**env, ENV_AGENT: f"{host}:{port}", ENV_AUTHKEY: key.hex()}
            zygote.stdin.write(json.dumps(task_env).encode() + b"\n")
            zygote.stdin.close()
            conn = listener.accept()  # only with the address it was given on stdin
            up = from_wire(conn.recv())
            assert isinstance(up, ZygoteUp) and up.pid == zygote.pid
            # the stdin a zygote the agent starts itself has: what its workers inherit
            assert os.readlink(f"/proc/{zygote.pid}/fd/0") == os.devnull
            conn.close()  # the agent goes: the zygote ends
            assert zygote.wait(timeout=30) == 0
        finally:
            zygote.kill()
            zygote.wait()


def test_a_zygote_nobody_adopts_ends_when_its_stdin_closes(tmp_path: Path) -> None:
    zygote = prewarm(dict(os.environ), str(tmp_path / "zygote.log"))
    try:
        assert zygote.stdin is not None
        zygote.stdin.close()
        started = time.monotonic()
        assert zygote.wait(timeout=60) == 0
        assert time.monotonic() - started < 60
    finally:
        zygote.kill()
        zygote.wait()
