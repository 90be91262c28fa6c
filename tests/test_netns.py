"""The namespace lab (:mod:`unicron.control.netns`): made, reachable, and gone after."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from unicron.control import netns

pytestmark = pytest.mark.e2e

WHY = netns.available()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


def leftovers(tag: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in (names + links).split() if w.startswith(f"uc{tag}")]


@needs_netns
def test_a_lab_is_made_reachable_and_removed() -> None:
    with netns.Lab(2) as lab:
        assert lab.host_address.startswith("10.213.") and lab.host_address.endswith(".1")
        assert [h.address.rsplit(".", 1)[1] for h in lab.members] == ["2", "3"]
        assert leftovers(lab.tag)
        # host 1 listens, host 0 connects: traffic crosses the bridge between namespaces
        server = lab.popen(1, [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('0.0.0.0', 29123)); s.listen();"
            "c, a = s.accept(); c.sendall(a[0].encode())"
        )], stdout=subprocess.PIPE)  # fmt: skip
        peer = lab.members[1].address
        client = (
            "import socket, time\n"
            "for _ in range(100):\n"
            f"    try: c = socket.create_connection(({peer!r}, 29123), 2); break\n"
            "    except OSError: time.sleep(0.05)\n"
            "print(c.recv(64).decode())\n"
        )
        got = subprocess.run(lab.command(0, [sys.executable, "-c", client]), capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert got.stdout.strip() == lab.members[0].address, got.stderr
        server.wait(timeout=30)
        # nothing of the host's network is in a namespace: only loopback and the veth
        links = subprocess.run(lab.command(0, ["ip", "-o", "link"]), capture_output=True,
                               text=True).stdout  # fmt: skip
        assert {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()} == {
            "lo",
            lab.members[0].ifname,
        }
        tag = lab.tag
    assert leftovers(tag) == []
    lab.close()  # idempotent


@needs_netns
def test_a_failure_inside_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.Lab(1) as lab:
        sleeper = lab.popen(0, ["sleep", "600"])
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    assert leftovers(lab.tag) == []


@needs_netns
def test_a_lab_whose_owner_died_is_swept() -> None:
    lab = netns.Lab(1)
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = netns.RECORDS / f"{lab.tag}.json"
    body = json.loads(record.read_text())
    record.write_text(json.dumps({**body, "pid": dead.pid}))
    assert lab.tag in netns.sweep()
    assert leftovers(lab.tag) == [] and not record.exists()
    lab.close()


def test_the_loopback_fallback() -> None:
    with netns.LoopbackLab(3) as lab:
        assert [h.address for h in lab.members] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        assert lab.command(2, ["echo", "hi"]) == ["echo", "hi"]
        out = lab.popen(0, ["echo", "hi"], stdout=subprocess.PIPE)
        assert out.communicate(timeout=10)[0] == b"hi\n"
    with pytest.raises(ValueError, match=r"hosts must be in 1\.\.200"):
        netns.LoopbackLab(0)


def test_the_agent_finds_the_interface_of_its_address() -> None:
    """What the agent hands its workers as GLOO_SOCKET_IFNAME (unicron.control.node)."""
    from unicron.control.node import _interface

    assert _interface("127.0.0.1") == "lo"
    assert _interface("192.0.2.254") is None  # an address no interface here holds


@needs_netns
def test_a_taken_tag_is_refused_and_the_other_lab_untouched() -> None:
    with netns.Lab(1) as first:
        with pytest.raises(netns.LabError, match="is taken"):
            netns.Lab(1, tag=first.tag)
        assert leftovers(first.tag)  # the refused lab removed nothing of the first
