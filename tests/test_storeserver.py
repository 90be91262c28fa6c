"""The training store's door (:mod:`unicron.control.storeserver`): torch's own TCPStore client
gets the same answers from it as from torch's server, under a task's capability, and nothing
without one. The store runs as its own process, as on a cluster (:func:`store.start`)."""

from __future__ import annotations

import datetime as dt
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from unicron.control import store as S
from unicron.control.storeserver import capability


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, bytes, Path]]:
    info, proc = S.start(tmp_path, "127.0.0.1", die_with_us=True)
    try:
        yield info.address, S.secret_of(tmp_path), tmp_path / "store.log"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _tcp(address: str, timeout_s: float = 5.0) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=timeout_s))


def _script(s: dist.Store, address: str, key: str) -> list[Any]:
    """Every call the runtime and gloo make, and what each returned."""
    out: list[Any] = []
    s.set("t/k", "v")
    out += [s.get("t/k"), s.add("t/n", 5), s.add("t/n", -2), s.check(["t/k", "t/none"])]
    out += [s.compare_set("t/k", "v", "w"), s.compare_set("t/k", "x", "y")]
    out += [s.compare_set("t/new", "", "z"), s.compare_set("t/new2", "q", "z")]
    s.wait(["t/k"])
    try:
        s.wait(["t/absent"], dt.timedelta(seconds=0.2))
        out.append("no timeout")
    except dist.DistStoreError:
        out.append("timed out")
    out.append(s.multi_get(["t/k", "t/n"]))
    s.multi_set(["t/a", "t/b"], ["1", "2"])
    out += [s.delete_key("t/a"), s.delete_key("t/a")]
    s.append("t/b", "3")
    out.append(s.get("t/b"))

    def later() -> None:  # another client sets a key one waits for
        time.sleep(0.2)
        other = _tcp(address) if key == "" else dist.PrefixStore(key, _tcp(address))
        other.set("t/late", "1")

    threading.Thread(target=later).start()
    s.wait(["t/late", "t/k"], dt.timedelta(seconds=10))
    out.append(s.get("t/late"))
    return out


def test_the_client_gets_torchs_answers(served: tuple[str, bytes, Path]) -> None:
    address, secret, _ = served
    torchs = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    expected = _script(_tcp(f"127.0.0.1:{torchs.port}"), f"127.0.0.1:{torchs.port}", "")
    key = capability(secret, "t")
    assert _script(S.client(address, key), address, key) == expected


def test_a_process_group_rendezvous_and_sums_through_the_door(
    served: tuple[str, bytes, Path],
) -> None:
    address, secret, _ = served
    key = capability(secret, "task.a")
    sums: list[float] = []

    def member(rank: int) -> None:
        import torch

        store = dist.PrefixStore("task.a/1/pg", S.client(address, key))
        pg = dist.ProcessGroupGloo(store, rank, 2, dt.timedelta(seconds=30))
        t = torch.tensor([float(rank + 1)])
        pg.allreduce([t]).wait()
        sums.append(float(t))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == [3.0, 3.0]


def _refused(call: Callable[[], Any]) -> bool:
    try:
        call()
    except (dist.DistError, RuntimeError):
        return True
    return False


def _write(s: dist.Store, key: str) -> bool:
    """A write (no answer comes), then a read on the same connection, which fails once the
    store closed it."""
    s.set(key, "1")
    return s.check([key])


def test_without_the_tasks_capability_nothing_opens(served: tuple[str, bytes, Path]) -> None:
    """A stranger (no capability), a worker of task B (B's capability) and a client that
    asks for the list of keys: each refused, with the reason in the store's log; task A's
    own client goes on."""
    address, secret, log = served
    a = S.client(address, capability(secret, "A.1"))
    a.set("A.1/epoch", "3")
    b_key = capability(secret, "B.2")
    attacks = {
        "no capability": lambda: _tcp(address).get("A.1/epoch"),
        "a write without one": lambda: _write(_tcp(address), "A.1/done"),
        "another task's": lambda: S.client(address, b_key).get("A.1/epoch"),
        "another task's write": lambda: _write(S.client(address, b_key), "A.1/done"),
        "a capability made up": lambda: S.client(address, "0" * 32).check(["A.1/epoch"]),
        "the list of keys": lambda: _tcp(address).num_keys(),
    }
    for what, attack in attacks.items():
        assert _refused(attack), what
    assert a.get("A.1/epoch") == b"3" and not a.check(["A.1/done"])
    text = log.read_text()
    assert text.count("refused") >= len(attacks), text
    assert "not the capability of task b'A.1'" in text and "is not served" in text


def test_a_recorded_store_of_another_secret_is_not_adopted(tmp_path: Path) -> None:
    info, adopted = S.ensure(tmp_path, "127.0.0.1")
    try:
        assert not adopted
        assert S.ensure(tmp_path, "127.0.0.1") == (info, True)
        (tmp_path / S.SECRET).write_text("ab" * 32)  # another cluster's secret
        again, adopted = S.ensure(tmp_path, "127.0.0.1")
        assert not adopted and again.port != info.port
        S.stop(tmp_path)
    finally:
        for pid in (info.pid,):
            subprocess.run(["kill", str(pid)], check=False)


def test_a_coordinator_fenced_by_a_higher_token_writes_nothing_more(
    served: tuple[str, bytes, Path],
) -> None:
    """A fenced leader's writes, queued in its host's kernel while its link was cut and
    delivered after its successor took over, must not land (found by the cluster soak: the
    old leader's epoch 52 set over the new leader's view, two different epochs 52). A
    connection that wrote a lower token than the task's highest is refused every write of
    the task's keys, and so is a lower token; readers, workers (no token) and other tasks
    are untouched."""
    address, secret, log = served
    key = capability(secret, "t")
    old, new, worker = (S.client(address, key) for _ in range(3))
    old.set("t/coordinator-fence", "1")
    old.set("t/epoch", "51")
    new.set("t/coordinator-fence", "2")  # the adopter: its fence, then it reads the state
    assert new.get("t/epoch") == b"51"  # (a set is not answered: the get orders them)
    old.set("t/epoch", "52")  # a set is not answered: refused, its connection closed
    assert new.get("t/epoch") == b"51"  # what the successor read stays
    with pytest.raises(dist.DistError):
        old.get("t/epoch")
    late = S.client(address, key)
    late.set("t/coordinator-fence", "1")
    with pytest.raises(dist.DistError):
        late.get("t/epoch")
    new.set("t/epoch", "52")  # the leader's own
    worker.set("t/epoch/vote", "1")  # wrote no token: not fenced
    worker.set("t", "root")  # a key at the task's root is no fence (and is served)
    assert worker.get("t") == b"root"
    other = S.client(address, capability(secret, "u"))
    other.set("u/coordinator-fence", "1")
    other.set("u/epoch", "3")  # another task's fence is its own
    assert (new.get("t/epoch"), new.get("t/epoch/vote")) == (b"52", b"1")
    assert "by a fenced coordinator (token 1, the task's 2)" in log.read_text()


def test_a_stall_of_the_stores_event_loop_is_logged(caplog: Any) -> None:
    """A request or a descheduled process that holds the loop past ``STALL_S`` leaves a
    warning with its length (how a stalled store is told from stalled clients)."""
    import asyncio
    import logging
    import time

    from unicron.control.storeserver import watch_stalls

    async def main() -> None:
        watch = asyncio.create_task(watch_stalls(every_s=0.02, stall_s=0.3))
        await asyncio.sleep(0.1)
        time.sleep(0.5)  # the loop held, as by a stuck request
        await asyncio.sleep(0.1)
        watch.cancel()

    with caplog.at_level(logging.WARNING, logger="unicron.store"):
        asyncio.run(main())
    stalls = [float(r.args[0]) for r in caplog.records if "stalled" in r.getMessage()]
    assert stalls and max(stalls) >= 0.4, stalls  # more on a loaded machine, never none
