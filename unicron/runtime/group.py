"""One epoch's process group, and leaving it fast when the epoch is over.

Called by the worker (:mod:`unicron.worker`) only. Every collective is issued asynchronously
and waited for in short slices; between slices the group asks the store whether a newer epoch
supersedes this one (TORCH-FACTS.md: in gloo only the ranks wired to a dead peer see an
error, the others block until the process-group timeout). The commit vote is arbitrated by a
single ``compare_set`` on the store, so every living member acts on the same outcome.

Each epoch's process group talks to the store through a TCPStore client of its own (the
``pg_store`` factory), never through the worker's control client. A store client serves one
request at a time; gloo's threads may block in a store ``get`` for as long as the process
group's timeout (a peer that left the epoch before connecting never publishes its address),
and a group abandoned in that state would otherwise block every epoch check, barrier and
vote of the worker behind it: the transition that stalls for ever.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unicron.protocol import EpochInfo, done_key, epoch_info_key, epoch_key, epoch_prefix
from unicron.runtime.bounded import BoundedStore

ControlStore = dist.Store | BoundedStore
"""a worker's control connection to the store (:class:`BoundedStore`; a plain c10d store in
tests and tools)"""


def _threads() -> set[int]:
    """Kernel ids of this process's threads (empty where ``/proc`` is missing)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


WAIT_REPORT_S = 0.5
"""a wait of a group with :attr:`EpochGroup.on_wait` that lasts longer than this is reported
(a tensor-parallel replica's sum: the rank waits on its replica, it does not hang itself)"""


class EpochOver(Exception):
    """This epoch was superseded (or its collective failed): go to the next one."""


class StoreLost(EpochOver):
    """The training store stopped answering (its process or its host is gone): this epoch
    is over for every member. The worker asks its agent where the store serves now
    (:meth:`unicron.runtime.link.AgentLink.where_store`) and waits there for the next epoch,
    which the coordinator announces on the new store (:mod:`unicron.control.store`)."""


@contextlib.contextmanager
def store_calls() -> Iterator[None]:
    """Store requests in this block (or function, as a decorator) that fail on the
    connection, or get no answer in their bound (:class:`~unicron.runtime.bounded.
    StoreTimeout`), raise :class:`StoreLost`; a ``wait`` that times out (``DistStoreError``)
    passes through."""
    try:
        yield
    except dist.DistNetworkError as exc:
        raise StoreLost(f"the training store stopped answering ({exc})") from exc


class CollectiveError(EpochOver):
    """A collective of this epoch raised (typically: a peer is gone)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _c10d(store: ControlStore) -> Callable[[], dist.Store]:
    """gloo's connection when the caller gives none: ``store`` itself, a c10d store (a
    :class:`BoundedStore` is not one: the worker hands the group a factory of its own)."""
    assert not isinstance(store, BoundedStore), "gloo needs a c10d store: pass pg_store"
    return lambda: store


class EpochWatch:
    """Reads the task's epoch announcements from the store, caching what it has seen."""

    def __init__(self, store: ControlStore, task: str) -> None:
        self.store = store
        self.task = task
        self._infos: dict[int, EpochInfo] = {}
        self._announced = False

    @store_calls()
    def latest(self) -> int:
        """The newest epoch announced (0 before the first); one store round trip once known."""
        key = epoch_key(self.task)
        if not self._announced:
            if not self.store.check([key]):
                return 0
            self._announced = True  # the key is never removed: from now on read it directly
        return int(self.store.get(key))

    @store_calls()
    def info(self, epoch: int) -> EpochInfo:
        if epoch not in self._infos:
            self._infos[epoch] = EpochInfo.from_json(
                self.store.get(epoch_info_key(self.task, epoch))
            )
        return self._infos[epoch]

    @store_calls()
    def task_over(self) -> bool:
        """The coordinator declared the task done or failed."""
        return bool(self.store.check([done_key(self.task)]))

    def superseded(self, epoch: int, *, urgent_only: bool) -> bool:
        """True if an epoch newer than ``epoch`` exists (and, with ``urgent_only``, one of the
        newer ones drops a member, so in-flight collectives must be left now)."""
        latest = self.latest()
        if latest <= epoch:
            return False
        if not urgent_only:
            return True
        return any(self.info(e).urgent for e in range(epoch + 1, latest + 1))


@dataclass(frozen=True)
class _Works:
    """Several collectives started as one (:meth:`EpochGroup.start_allgather` on gloo),
    waited for in order."""

    parts: list[Any]


class _Pending:
    """One job of a :class:`PeerLink`'s waiter thread (an operation's issue or its wait),
    waited for like a gloo work (:meth:`wait`), so that :meth:`EpochGroup._wait` slices it."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self, call: Callable[[], Any]) -> None:
        """On the waiter thread: ``call`` (the GIL is released while gloo waits)."""
        try:
            self.result = call()
        except BaseException as exc:  # handed to the caller's wait
            self.error = exc
        self.done.set()

    def wait(self, timeout: dt.timedelta) -> None:
        """As a gloo work's ``wait``: a ``RuntimeError`` that says "timed out" while the job
        runs; its own error, as a :class:`CollectiveError`, once it failed."""
        if not self.done.wait(timeout.total_seconds()):
            raise RuntimeError("timed out")
        if self.error is not None:
            raise CollectiveError(self.error) from self.error


class PeerLink:
    """Sends to and receives from one other member over the epoch's own gloo group, without
    a process group of the two (:meth:`EpochGroup.peer`).

    Used by the state transfer (:mod:`unicron.runtime.transfer`) when one holder sends to one
    needer in a larger epoch: a subgroup of the two would cost a new process group (its
    threads, its listening socket, its connection) where the epoch's group has the pair
    already: a first tiny broadcast over a new subgroup took 1.28 ms here, the first
    operation over a link 0.55 ms, its connection included
    (`bench/results/transfer-history.md`). A gloo
    point-to-point wait cannot be left in slices (a timed-out wait closes the connection), so
    the link's waiter thread waits for each operation in turn, for as long as the group's
    timeout, and the caller waits for that in slices (:meth:`wait`), leaving a superseded
    epoch at once like any collective. The first operation is issued by that thread too: it
    connects the pair (lazily, in the issuing thread for point-to-point ops), and a peer
    that left before publishing its address would hold that thread for the whole timeout.
    The thread ends when the group is left (:meth:`EpochGroup.leave`), once the wait it is in
    returns (a peer gone closes the connection; a peer that left the epoch alive, at the
    timeout).

    The operations on one link are matched in the order each side posts them. Its
    ``ibroadcast(tensor, src)`` is the :class:`unicron.runtime.transfer.Link` of a pair:
    ``src`` (an epoch rank, this member or the peer) sends, the other receives."""

    def __init__(self, group: EpochGroup, peer: int) -> None:
        assert peer != group.rank, peer
        self.group, self.peer = group, peer
        self.rank, self.world, self.wire = group.rank, group.world, group.wire
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._connected = False

    def ibroadcast(self, tensor: torch.Tensor, src: int) -> _Pending:
        """Start sending ``tensor`` to the peer (``src`` is this member) or receiving it from
        the peer (``src`` is the peer); see :meth:`wait`."""
        pg = self.group.pg
        if src == self.rank:
            issue = functools.partial(pg.send, [tensor], self.peer, 0)
        else:
            assert src == self.peer, (src, self.peer)
            issue = functools.partial(pg.recv, [tensor], self.peer, 0)
        if self._connected:
            work = self.group._start(issue)
        else:
            issued = self._post(issue)
            self.wait(issued)  # issued: the pair is connected
            work, self._connected = issued.result, True
        return self._post(work.wait)

    def _post(self, call: Callable[[], Any]) -> _Pending:
        """Hand ``call`` to the waiter thread (started with the link's first job)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._waiter, name=f"unicron-peer-{self.peer}", daemon=True
            )
            self._thread.start()
        pending = _Pending()
        self._jobs.put(functools.partial(pending.run, call))
        return pending

    def _waiter(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def wait(self, pending: _Pending) -> None:
        """Wait for ``pending`` in slices, leaving at once if the epoch is superseded
        (:meth:`EpochGroup.wait`)."""
        self.group.wait(pending)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.wait(self.ibroadcast(tensor, src))

    def close(self) -> None:
        """End the waiter thread once the jobs handed to it are over."""
        if self._thread is not None:
            self._jobs.put(None)


class EpochGroup:
    """The members of one epoch, their process group and the commit vote.

    Built by the worker on entering an epoch; abandoned (never reused) when the epoch is over.
    ``backend`` is ``gloo`` (CPU tensors on the wire; CUDA tensors are staged through the
    CPU) or ``nccl`` (tensors on ``device``; a superseded epoch's communicator is aborted,
    never waited out): :func:`unicron.runtime.device.backend` chooses.
    """

    def __init__(
        self,
        store: ControlStore,
        watch: EpochWatch,
        info: EpochInfo,
        rank: int,
        *,
        slice_s: float,
        timeout_s: float,
        pg_store: Callable[[], dist.Store] | None = None,
        backend: str = "gloo",
        device: torch.device | None = None,
    ) -> None:
        assert backend in ("gloo", "nccl"), backend
        self.backend = backend
        self.wire = device if backend == "nccl" and device is not None else torch.device("cpu")
        """where tensors handed to this group's collectives and point-to-point ops live"""
        self.info = info
        self.rank = rank
        self.world = len(info.members)
        self.watch = watch
        self.slice = dt.timedelta(seconds=slice_s)
        self.timeout_s = timeout_s
        prefix = epoch_prefix(watch.task, info.epoch)
        self.store: ControlStore = (
            store.prefixed(prefix)
            if isinstance(store, BoundedStore)
            else dist.PrefixStore(prefix, store)
        )
        self._base = store
        self.latest_seen: int | None = None
        """the newest epoch announced, as read with the last vote's outcome (its step's
        boundary check needs no round trip of its own); None before a vote"""
        self._pg_store = pg_store or _c10d(store)
        self.pg: Any = None
        self._left = False
        self._threads: set[int] = set()  # gloo: the threads its construction started
        self.subgroups: dict[str, EpochGroup] = {}  # by name and ranks; left with this group
        self._path = ""  # a subgroup's store keys: its parents' names and ranks, nested
        self.on_wait: Callable[[bool], None] | None = None
        """told True when one of this group's waits passes :data:`WAIT_REPORT_S`, False when
        that wait ends (the worker tells its agent: :class:`unicron.protocol.WaitingOnReplica`)"""
        self.peers: dict[int, PeerLink] = {}  # by epoch rank; closed with this group

    # -- membership -------------------------------------------------------------------------
    def _check(self, *, urgent_only: bool = True) -> None:
        if self.watch.superseded(self.info.epoch, urgent_only=urgent_only):
            raise EpochOver(f"epoch {self.info.epoch} superseded")

    @store_calls()
    def rendezvous(self) -> None:
        """Wait until every member arrived, then build the process group.

        The wait is a store barrier in slices, left at once if a newer epoch appears (a member
        that died before arriving never stalls the others past the next announcement).
        """
        self.store.set(f"arrived/{self.rank}", "1")
        keys = [f"arrived/{r}" for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait(keys, self.slice)
                break
            except dist.DistStoreError:
                self._check(urgent_only=False)
                if self.watch.task_over():
                    raise EpochOver("the task is over") from None
                if time.monotonic() > deadline:
                    raise EpochOver(f"rendezvous of epoch {self.info.epoch} timed out") from None
        # gloo connects lazily (TORCH_GLOO_LAZY_INIT, set by the agent): the connection is made
        # inside the first collective, which is waited for in slices like any other, so a
        # member that vanishes after arriving cannot block the others here
        try:
            self.pg = self._build(dist.PrefixStore("pg", self._own_store()))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise CollectiveError(exc) from exc

    def _own_store(self) -> dist.Store:
        """This epoch's keys on a store connection that no other group and no control path
        shares (see the module docstring)."""
        return dist.PrefixStore(epoch_prefix(self.watch.task, self.info.epoch), self._pg_store())

    def _build(self, store: dist.Store) -> Any:
        timeout = dt.timedelta(seconds=self.timeout_s)
        if self.backend == "gloo":
            before = _threads()
            pg = dist.ProcessGroupGloo(store, self.rank, self.world, timeout)
            self._threads = _threads() - before  # its event loop and its two workers
            return pg
        opts = dist.ProcessGroupNCCL.Options()  # CUDA builds only
        opts._timeout = timeout  # the watchdog's last resort; a superseded epoch aborts first
        return dist.ProcessGroupNCCL(store, self.rank, self.world, opts)

    def leave(self) -> None:
        """Give up this epoch's communicator. NCCL: abort it, so that kernels of an abandoned
        collective stop and the device is free for the next epoch's. Gloo: the group is kept
        (an abandoned gloo operation ends when its peers' sockets close; TORCH-FACTS.md), its
        threads at the lowest priority (``SCHED_IDLE``): its event loop can spin on for the
        life of the process (a peer's part of a collective this member left, never read:
        level-triggered, a whole core; found beside a CPU burner, it made every later step
        slower), and must not take a core from training."""
        for sub in self.subgroups.values():
            sub.leave()
        for link in self.peers.values():
            link.close()
        self.peers = {}
        if self._left:
            return
        self._left = True
        if self.backend == "nccl" and self.pg is not None:
            self.pg.abort()
        for tid in self._threads:
            with contextlib.suppress(OSError, AttributeError):  # gone; not Linux
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

    def peer(self, other: int) -> PeerLink | None:
        """A :class:`PeerLink` between this member and member ``other`` (one per pair and
        epoch), or None on NCCL (whose point-to-point operations build a communicator of
        the pair in any case: a :meth:`subgroup` is no dearer there)."""
        if self.backend != "gloo":
            return None
        if other not in self.peers:
            self.peers[other] = PeerLink(self, other)
        return self.peers[other]

    def subgroup(self, ranks: list[int], name: str) -> EpochGroup:
        """A process group of some members (``ranks``: this epoch's ranks; this member is one
        of them), e.g. a state holder and the members it sends to. Its collectives are waited
        for in slices like this group's; it lives and is left with this group. Every member
        in ``ranks`` calls it with the same ``name``; a second call with the same name and
        ranks in this epoch returns the same group (no new store round trips, connections)."""
        key = f"{name}/{'-'.join(map(str, ranks))}"
        if key in self.subgroups:
            return self.subgroups[key]
        sub = copy.copy(self)
        sub.rank, sub.world = ranks.index(self.rank), len(ranks)
        sub.subgroups, sub.peers, sub._left, sub._threads = {}, {}, False, set()
        # a subgroup of a subgroup (a replica's data-parallel group and its own subgroups)
        # keeps its keys apart from its cousins' of the same name and ranks
        sub._path = f"{self._path}sub/{key}/"
        sub.on_wait = None
        try:
            sub.pg = sub._build(dist.PrefixStore(f"{self._path}sub/{key}", self._own_store()))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise CollectiveError(exc) from exc
        self.subgroups[key] = sub
        return sub

    # -- collectives ------------------------------------------------------------------------
    def _wait(self, work: Any) -> None:
        if self.on_wait is None:
            self._wait_for(work, None)
            return
        tell, report_at, said = self.on_wait, time.monotonic() + WAIT_REPORT_S, False

        def between() -> None:  # between two slices: tell once the wait has lasted long
            nonlocal said
            if not said and time.monotonic() >= report_at:
                said = True
                tell(True)

        try:
            self._wait_for(work, between)
        finally:
            if said:
                tell(False)

    def _wait_for(self, work: Any, between: Callable[[], None] | None) -> None:
        if isinstance(work, _Works):
            for part in work.parts:
                self._wait_for(part, between)
            return
        if self.backend == "nccl":
            self._poll(work, between)
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(self.slice)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc):
                    raise CollectiveError(exc) from exc
                # any newer epoch ends a collective that is still waiting: members leave an old
                # epoch at different step boundaries, so a peer may never join this one
                self._check(urgent_only=False)
                if time.monotonic() > deadline:
                    raise CollectiveError(exc) from exc
                if between is not None:
                    between()

    def _poll(self, work: Any, between: Callable[[], None] | None = None) -> None:
        """NCCL: ``wait(timeout)`` does not return control to the CPU in slices, so poll the
        work's completion and look at the epoch between polls; a superseded epoch aborts the
        communicator (:meth:`leave`) instead of waiting for a watchdog timeout."""
        deadline = time.monotonic() + self.timeout_s
        next_look = time.monotonic() + self.slice.total_seconds()
        while not work.is_completed():
            time.sleep(0.0005)
            if time.monotonic() < next_look:
                continue
            next_look = time.monotonic() + self.slice.total_seconds()
            if between is not None:
                between()
            if self.watch.superseded(self.info.epoch, urgent_only=False) or (
                time.monotonic() > deadline
            ):
                self.leave()
                raise EpochOver(f"epoch {self.info.epoch} superseded; NCCL communicator aborted")
        try:
            work.wait()  # raises the collective's error, if any; orders the current stream
        except RuntimeError as exc:
            raise CollectiveError(exc) from exc

    def wait(self, work: Any) -> None:
        """Wait for ``work`` (from :meth:`ibroadcast` or a ``start_*`` collective) in slices,
        like any collective, leaving at once if the epoch is superseded. (Gloo's
        point-to-point ``send``/``recv`` go through a :class:`PeerLink`: a timed-out wait on
        them closes the connection, so they cannot be waited for in slices here.)"""
        self._wait(work)

    def ibroadcast(self, tensor: torch.Tensor, src: int) -> Any:
        """Start broadcasting ``tensor`` (on :attr:`wire`) from member ``src``; see :meth:`wait`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._start(lambda: self.pg.broadcast([tensor], opts))

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the members (staged through :attr:`wire`)."""
        wired = tensor if tensor.device == self.wire else tensor.to(self.wire)
        self._wait(self.pg.allreduce([wired]))
        if wired is not tensor:
            tensor.copy_(wired)

    def allgather(
        self, tensor: torch.Tensor, meanwhile: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """Every member's ``tensor`` (one shape for all), in rank order. ``meanwhile`` runs
        while it is on the wire (the worker's ledger exchange takes its state's inventory
        there, :func:`unicron.runtime.transfer.inventory`)."""
        wired = tensor.to(self.wire)
        out = [torch.empty_like(wired) for _ in range(self.world)]
        work = self._start(lambda: self.pg.allgather([out], [wired]))
        if meanwhile is not None:
            meanwhile()
        self._wait(work)
        return [t.to(tensor.device) for t in out]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        wired = tensor if tensor.device == self.wire else tensor.to(self.wire)
        self._wait(self.pg.broadcast([wired], opts))
        if wired is not tensor:
            tensor.copy_(wired)

    # asynchronous collectives of the gradient exchange (:mod:`unicron.runtime.reduce`):
    # started from gradient hooks, waited for in slices by :meth:`wait`
    def start_alltoall(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Any:
        """Send ``in_splits[j]`` elements of ``inp`` to member j, receive into ``out``."""
        return self._start(
            lambda: self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
        )

    def start_allgather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Every member's ``inp`` into ``out``, in rank order (equal sizes).

        Gloo: ``inp`` goes into this member's slice of ``out``, then one broadcast per member,
        each in place on its slice. Torch's gloo all-gather gathers into a freshly allocated
        tensor of the whole result and copies that into ``out`` afterwards: for the 100M
        model's gradient a 400 MB allocation and copy per step that DDP's all-reduce does not
        make (docs/runtime.md, Speed)."""
        if self.backend != "gloo":
            return self._start(lambda: self.pg._allgather_base(out, inp))
        n = inp.numel()
        assert out.numel() == n * self.world, f"all-gather of {n} into {out.numel()}"
        slots = [out[j * n : (j + 1) * n] for j in range(self.world)]
        if slots[self.rank].data_ptr() != inp.data_ptr():
            slots[self.rank].copy_(inp)
        works = []
        for root, slot in enumerate(slots):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            works.append(self._start(functools.partial(self.pg.broadcast, [slot], opts)))
        return _Works(works)

    def start_allreduce(self, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` in place over the members (asynchronously)."""
        return self._start(lambda: self.pg.allreduce([tensor]))

    def _start(self, issue: Callable[[], Any]) -> Any:
        try:
            return issue()
        except RuntimeError as exc:
            raise CollectiveError(exc) from exc

    # -- commit -----------------------------------------------------------------------------
    @store_calls()
    def vote(self, step: int) -> bool:
        """After a successful reduce: True if every member reduced (apply the update).

        Each member adds its vote; the last one proposes "commit". A member that sees the
        epoch superseded first proposes "abort". ``compare_set`` keeps the first proposal, so
        all living members act on the same outcome; a member that lost the vote keeps its local
        sum and retries in the next epoch.

        Four store round trips per member: the last voter learns the outcome from its
        ``compare_set`` (it returns the value kept), the others wait for it; each reads the
        newest epoch in the same request as its last one (:attr:`latest_seen`). TCPStore's
        ``get`` and ``multi_get`` wait for their keys first, a round trip of their own (on an
        idle loopback ``check`` took 76 us, ``get`` 150 us, ``multi_get`` of two keys 172 us).
        """
        decision = f"decide/{step}"
        if self.store.add(f"vote/{step}", 1) == self.world:
            outcome = self.store.compare_set(decision, "", "commit")
            self.latest_seen = self.watch.latest()
            return outcome == b"commit"
        while True:
            try:
                self.store.wait([decision], self.slice)
                break
            except dist.DistStoreError:
                if self.watch.superseded(self.info.epoch, urgent_only=True):
                    self.store.compare_set(decision, "", "abort")
                elif self.watch.task_over():
                    # the task ends with its last step committed: a member whose slice ran out
                    # just before that step's decision (a loaded machine) finds it here and
                    # applies it like the others (it may have a final shard to write);
                    # undecided, the step was not the one that ended the task
                    if self.store.check([decision]):
                        break
                    raise EpochOver("the task is over") from None
        prefix = epoch_prefix(self.watch.task, self.info.epoch)
        outcome, latest = self._base.multi_get([f"{prefix}/{decision}", epoch_key(self.watch.task)])
        self.latest_seen = int(latest)
        return outcome == b"commit"

    def abort(self, step: int) -> None:
        """This member cannot finish ``step`` in this epoch: make sure nobody commits it
        (nobody commits through a store that is gone: the next epoch's ledger exchange
        settles who applied the step, :func:`unicron.runtime.transition.sync`)."""
        with contextlib.suppress(StoreLost), store_calls():
            self.store.compare_set(f"decide/{step}", "", "abort")
