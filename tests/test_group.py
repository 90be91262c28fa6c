"""One epoch's group against a real store and gloo, in one process: leaving a broken epoch."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from unicron.protocol import EpochInfo, done_key, epoch_info_key, epoch_key, epoch_prefix
from unicron.runtime.group import EpochGroup, EpochOver, EpochWatch

pytestmark = pytest.mark.e2e

TIMEOUT_S = 8.0
KEEP: list[EpochGroup] = []  # an abandoned group is never freed (as the worker does)


def _announce(store: dist.Store, info: EpochInfo) -> None:
    store.set(epoch_info_key("t", info.epoch), info.to_json())
    store.set(epoch_key("t"), str(info.epoch))


def _client(port: int) -> dist.Store:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=TIMEOUT_S)
    )


def test_a_peer_that_never_connects_does_not_block_leaving_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transition that stalled for ever: a peer arrives at an epoch's rendezvous, then
    leaves for a newer epoch before building its group. gloo's lazy connect on this member
    then waits in a store ``get`` for the peer's address for the whole group timeout. Had the
    group shared the worker's store client, every epoch check would wait behind that ``get``
    (a store client serves one request at a time) and the newer epoch would go unseen."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = EpochInfo(1, (0, 1), (0, 0), urgent=False)
    _announce(server, first)
    client = _client(server.port)
    watch = EpochWatch(client, "t")
    g = EpochGroup(
        client,
        watch,
        first,
        0,
        slice_s=0.05,
        timeout_s=TIMEOUT_S,
        pg_store=lambda: _client(server.port),
    )
    server.set(f"{epoch_prefix('t', 1)}/arrived/1", "1")  # the peer arrived, then left
    g.rendezvous()
    later = EpochInfo(2, (0,), (0,), urgent=True)
    announcer = threading.Timer(0.5, _announce, args=(server, later))
    announcer.start()
    t0 = time.monotonic()
    with pytest.raises(EpochOver):
        g.allgather(torch.zeros(2))
    left_s = time.monotonic() - t0
    announcer.join()
    KEEP.append(g)  # its gloo thread still waits for the peer: freeing it would join that
    assert left_s < TIMEOUT_S / 2, f"left the epoch after {left_s:.1f} s"  # ~0.5 s
    t0 = time.monotonic()
    assert watch.latest() == 2 and time.monotonic() - t0 < 1.0  # the control client is free


@pytest.mark.parametrize("send", [False, True])
def test_a_point_to_point_link_to_a_peer_that_never_connects_leaves_the_epoch(
    monkeypatch: pytest.MonkeyPatch, send: bool
) -> None:
    """As above, for a :class:`PeerLink` (the state transfer's pair over the epoch's group):
    its first operation connects the pair, in the calling thread for gloo's point-to-point
    ops, and that connect waits for the peer's address for the whole group timeout. It is
    issued from the link's waiter thread and waited for in slices: the member leaves when
    the newer epoch is announced."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = EpochInfo(1, (0, 1, 2), (0, 0, 0), urgent=False)
    _announce(server, first)
    client = _client(server.port)
    watch = EpochWatch(client, "t")
    g = EpochGroup(client, watch, first, 0, slice_s=0.05, timeout_s=TIMEOUT_S,
                   pg_store=lambda: _client(server.port))  # fmt: skip
    for peer in (1, 2):  # arrived, then left
        server.set(f"{epoch_prefix('t', 1)}/arrived/{peer}", "1")
    g.rendezvous()
    link = g.peer(2)
    assert link is not None and g.peer(2) is link
    announcer = threading.Timer(0.5, _announce, args=(server, EpochInfo(2, (0,), (0,), True)))
    announcer.start()
    t0 = time.monotonic()
    with pytest.raises(EpochOver):
        link.wait(link.ibroadcast(torch.zeros(3), 0 if send else 2))
    left_s = time.monotonic() - t0
    announcer.join()
    g.leave()
    KEEP.append(g)
    assert left_s < TIMEOUT_S / 2, f"left the epoch after {left_s:.1f} s"  # ~0.5 s


def test_a_left_groups_threads_run_only_when_nothing_else_wants_a_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A left gloo group is kept, and its event loop may spin on unread bytes of the old
    epoch (docs/runtime.md): after :meth:`EpochGroup.leave` its threads are SCHED_IDLE,
    and the training thread is not."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    only = EpochInfo(1, (0,), (0,), urgent=False)
    _announce(server, only)
    client = _client(server.port)
    g = EpochGroup(client, EpochWatch(client, "t"), only, 0, slice_s=0.05, timeout_s=TIMEOUT_S)
    g.rendezvous()
    g.allreduce(torch.ones(4))
    assert g._threads, "the group's construction started no thread"
    assert all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in g._threads)
    g.leave()
    KEEP.append(g)
    assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in g._threads)
    assert os.sched_getscheduler(0) != os.SCHED_IDLE


@pytest.mark.timeout(60)
def test_the_gradient_all_gather_fills_every_slice_in_rank_order() -> None:
    """On gloo it is one in-place broadcast per member (not torch's all-gather, which
    allocates the whole result again): every member ends with every member's part, whether
    its own part was given apart or already lay in its slice of the output."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = EpochInfo(1, (0, 1, 2), (0, 0, 0), urgent=False)
    _announce(server, info)
    n, results = 5, {}

    def member(rank: int) -> None:
        client = _client(server.port)
        g = EpochGroup(client, EpochWatch(client, "t"), info, rank, slice_s=0.05,
                       timeout_s=TIMEOUT_S, pg_store=lambda: _client(server.port))  # fmt: skip
        g.rendezvous()
        outs = []
        for in_place in (False, True):
            out = torch.full((3 * n,), -1.0)
            part = torch.arange(n, dtype=torch.float32) + 10 * rank + 100 * in_place
            if in_place:
                out[rank * n : (rank + 1) * n] = part
                part = out[rank * n : (rank + 1) * n]
            g.wait(g.start_allgather(out, part))
            outs.append(out)
        results[rank] = outs
        KEEP.append(g)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for in_place in (False, True):
        want = torch.cat([torch.arange(n) + 10 * r + 100 * in_place for r in range(3)]).float()
        for r in range(3):
            assert torch.equal(results[r][in_place], want), (r, in_place, results[r][in_place])


def _voters(n: int) -> tuple[dist.TCPStore, list[EpochGroup]]:
    """A store with epoch 1 of ``n`` members announced, and each member's group in it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = EpochInfo(1, tuple(range(n)), (0,) * n, urgent=False)
    _announce(server, info)
    groups = []
    for rank in range(n):
        client = _client(server.port)
        groups.append(EpochGroup(client, EpochWatch(client, "t"), info, rank, slice_s=0.05,
                                 timeout_s=TIMEOUT_S))  # fmt: skip
    return server, groups


def test_every_member_gets_the_same_vote_outcome_and_the_newest_epoch_with_it() -> None:
    """The commit vote: the last voter learns the outcome from its own ``compare_set``, the
    others from the store; each comes back with the newest epoch announced (the step
    boundary's check reads it there, without a round trip of its own). An abort proposed
    before the last vote wins for everyone."""
    server, groups = _voters(3)

    def vote_all(step: int, voters: list[EpochGroup]) -> dict[int, bool]:
        outcomes: dict[int, bool] = {}
        threads = [
            threading.Thread(target=lambda g=g: outcomes.__setitem__(g.rank, g.vote(step)))
            for g in voters
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return outcomes

    assert vote_all(0, groups) == {0: True, 1: True, 2: True}
    assert [g.latest_seen for g in groups] == [1, 1, 1]
    _announce(server, EpochInfo(2, (0, 1, 2, 3), (0, 0, 0, 0), urgent=False))  # a joiner
    assert vote_all(1, groups) == {0: True, 1: True, 2: True}  # not urgent: the step commits
    assert [g.latest_seen for g in groups] == [2, 2, 2]
    groups[2].abort(2)  # a member that cannot finish step 2 in this epoch
    assert vote_all(2, groups[:2]) == {0: False, 1: False}
    groups[0].abort(3)  # ... and one that aborts, then votes: the last voter loses too
    assert vote_all(3, groups) == {0: False, 1: False, 2: False}


def test_a_voter_that_sees_the_task_over_after_its_step_committed_commits_it_too() -> None:
    """The race seen under load (a PP=3 x DP=2 run ended ok without ``final.shard2.pt``): a
    member waits for the last step's decision in slices; one slice runs out, and before the
    member looks again the last voter commits the step, another member finishes and the
    coordinator declares the task over. The step was committed: the member applies it (it
    must write its final shard), it does not leave the epoch as if the task ended without
    it."""
    server, groups = _voters(3)
    slow = groups[0]
    outcomes: dict[int, bool] = {}

    class LateWatch(EpochWatch):
        """The slow member's first look after a slice: meanwhile the others voted (the last
        one committed) and the coordinator wrote the task's done key."""

        def superseded(self, epoch: int, *, urgent_only: bool) -> bool:
            if not outcomes:
                threads = [
                    threading.Thread(target=lambda g=g: outcomes.__setitem__(g.rank, g.vote(9)))
                    for g in groups[1:]
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=30)
                server.set(done_key("t"), "done")
            return super().superseded(epoch, urgent_only=urgent_only)

    slow.watch = LateWatch(slow.watch.store, "t")
    outcomes[slow.rank] = slow.vote(9)
    assert outcomes == {0: True, 1: True, 2: True}
