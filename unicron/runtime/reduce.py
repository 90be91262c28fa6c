"""The gradient reduction: a canonical summation tree, its buckets and its exchange.

Exact mode (``--reduce exact``, the default) makes the reduced gradient of a step a function
of the step's micro-batch gradients alone, whichever replica computed which micro-batch and
whatever the float32 values. The M micro-batch ids of a step are the leaves of one fixed
binary tree (:func:`split`); the value of a node is ``left + right`` in float32; the reduced
gradient is the root. A replica adds its micro-batches into the tree nodes it can complete
(:class:`LocalSums`: the *cover* of its ids, one node per replica in steady state, where the
ledger hands out aligned blocks) and keeps those nodes as its partial results until the step
commits. Every element range has one owner; the nodes' chunks go to the owners (an
all-to-all), each owner evaluates the tree over the nodes it received (:func:`combine`), and an
all-gather hands the result to everyone. Every addition is the same float32 addition, of the
same operands, whatever the grouping (IEEE addition is commutative, and each node's value is
its children's sum by construction), so the bits are the same.

Fast mode (``--reduce fast``) keeps one running float32 sum per replica and all-reduces it.

Both reduce in buckets (:class:`Layout`): a bucket is launched from the gradient hooks of a
replica's last micro-batch as soon as its parameters' gradients are in, in a fixed order, so
the exchange overlaps the rest of the backward pass. Called by the worker
(:mod:`unicron.worker`): it builds one :class:`Layout` and :class:`LocalSums`, feeds each
micro-batch's gradients to ``LocalSums`` and runs one :class:`Exchange` per step through the
epoch's group (:class:`Collectives`). Method, memory and traffic: docs/runtime.md.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

Node = tuple[int, int]
"""a node of a step's summation tree: the micro-batch ids ``lo .. hi-1``"""
T = TypeVar("T")
BUCKET_CAP_MB = 25.0
"""bucket size bound (DDP's default ``bucket_cap_mb``)"""
FIRST_BUCKET_MB = 1.0
"""the first bucket's bound (DDP's too): the exchange starts early in the backward pass"""
OVERLAP_BUCKETS = 1
"""exact mode: with more buckets than this, the all-gathers run on a second group of the
epoch, started as the all-to-alls finish (:class:`Exchange`); a single bucket is launched
when the backward pass is over, so there is nothing left to overlap. (It was 3 until
2026-12-01: the example model's 2 buckets overlapped too step 4 % faster, docs/benchmarks.md)"""

VIEWS_FIRST_MAX = 1 << 16
"""Mean elements per parameter up to which a node's *first* micro-batch also goes through
:meth:`LocalSums.grad_views` (the worker decides once). Its buffer must first be filled with
-0.0, and autograd then reads it back: a fill and an addition cost 3.4 ms more than the copy
the hook makes instead per 100 MB (12.3 against 8.9 ms, one core), while the hook's Python
costs some microseconds per parameter: at the example model's 16 K elements per parameter the
views win, at the 100M model's millions the copy does."""


# -- the tree (pure) -------------------------------------------------------------------------
def split(node: Node) -> tuple[Node, Node] | None:
    """The two children of ``node`` (None for a leaf): the left one covers the largest power
    of two of ids smaller than the node's size, so aligned blocks of 2^k ids are subtrees."""
    lo, hi = node
    n = hi - lo
    if n <= 1:
        return None
    half = 1 << ((n - 1).bit_length() - 1)
    return (lo, lo + half), (lo + half, hi)


@functools.cache
def _family(m: int) -> dict[Node, tuple[Node, Node]]:
    """node -> (parent, sibling) for every non-root node of the tree over ``m`` ids."""
    out: dict[Node, tuple[Node, Node]] = {}
    stack = [(0, m)]
    while stack:
        node = stack.pop()
        kids = split(node)
        if kids is not None:
            left, right = kids
            out[left], out[right] = (node, right), (node, left)
            stack += kids
    return out


def cover(ids: Iterable[int], m: int) -> list[Node]:
    """The largest tree nodes all of whose ids are in ``ids``, left to right: what a replica
    that computed ``ids`` holds once it has added every node it can complete."""
    return list(_cover(frozenset(ids), m))


@functools.lru_cache(maxsize=256)  # the worker asks for every member's at every step
def _cover(have: frozenset[int], m: int) -> tuple[Node, ...]:
    assert all(0 <= i < m for i in have), f"ids {sorted(have)} outside 0..{m - 1}"

    def visit(node: Node) -> list[Node]:
        if all(i in have for i in range(*node)):
            return [node]
        kids = split(node)
        return [] if kids is None else visit(kids[0]) + visit(kids[1])

    return tuple(visit((0, m))) if have else ()


def absorb(held: Collection[Node], mb: int, m: int) -> tuple[list[Node], Node]:
    """Adding leaf ``mb`` to the nodes ``held``: the held siblings it is added to, from the
    leaf up, and the node that results."""
    assert not any(lo <= mb < hi for lo, hi in held), f"micro-batch {mb} is already held"
    node, chain, family = (mb, mb + 1), [], _family(m)
    while node in family:
        parent, sibling = family[node]
        if sibling not in held:
            break
        chain.append(sibling)
        node = parent
    return chain, node


def combine(
    parts: Mapping[Node, T],
    m: int,
    add: Callable[[T, T], T],
    last: Callable[[T, T], T] | None = None,
) -> T | None:
    """The root of the tree over ``m`` ids given the values of disjoint nodes ``parts``.

    ``add(left, right)`` sums two node values (it may work in place on either operand);
    ``last``, if given, makes the root's own sum instead (e.g. into the output). A subtree
    with no part in it is absent (the ``--on-lost drop`` control); None if nothing is.
    """
    family = _family(m)
    assert all(n in family or n == (0, m) for n in parts), f"not tree nodes: {list(parts)}"
    assert sum(hi - lo for lo, hi in parts) == len({i for n in parts for i in range(*n)})

    def value(node: Node) -> T | None:
        if node in parts:
            return parts[node]
        kids = split(node)
        if kids is None:
            return None
        left, right = value(kids[0]), value(kids[1])
        if left is None or right is None:
            return right if left is None else left
        return (last if last is not None and node == (0, m) else add)(left, right)

    return value((0, m))


def chunks(n: int, world: int) -> list[tuple[int, int]]:
    """Owner ``j``'s element range of a bucket of ``n`` elements: equal chunks of
    ``ceil(n / world)`` (the last ones shorter or empty)."""
    c = -(-n // world)
    return [(min(j * c, n), min((j + 1) * c, n)) for j in range(world)]


# -- the bucket plan (pure) ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where each parameter's gradient lives in a flat buffer, and the buckets.

    Parameters lie in model order; buckets are contiguous ranges of whole parameters, taken
    from the last parameter backwards (the order in which the backward pass finishes them)
    and launched in that order.
    """

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]
    bucket_of: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @classmethod
    def plan(cls, sizes: Sequence[int], cap: int, first_cap: int | None = None) -> Layout:
        """Buckets of at most ``cap`` elements, the first of at most ``first_cap`` (default
        ``cap``); a larger parameter gets a bucket of its own."""
        if cap < 1:
            raise ValueError(f"bucket cap must be >= 1 element, got {cap}")
        limit = cap if first_cap is None else first_cap
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        buckets: list[tuple[int, int]] = []
        bucket_of = [0] * len(sizes)
        end = sum(sizes)
        start = end
        for i in reversed(range(len(sizes))):
            if start < end and end - offsets[i] > limit:
                buckets.append((start, end))
                end, limit = start, cap
            start = offsets[i]
            bucket_of[i] = len(buckets)
        if start < end or not buckets:
            buckets.append((start, end))
        return cls(
            sizes=tuple(sizes), offsets=offsets, buckets=tuple(buckets), bucket_of=tuple(bucket_of)
        )

    def out_starts(self, world: int) -> tuple[list[int], int]:
        """Where each bucket starts in the reduced buffer of a group of ``world``, and its
        size: bucket b takes ``world * ceil(n_b / world)`` elements there (the all-gather's
        equal chunks), its parameters at the same relative offsets as in the flat buffer."""
        starts, at = [], 0
        for lo, hi in self.buckets:
            starts.append(at)
            at += world * -(-(hi - lo) // world)
        return starts, at


# -- a replica's partial results -------------------------------------------------------------
class LocalSums:
    """The partial results of one replica for the current step, kept until the step commits.

    Exact: one float32 buffer per tree node held (:func:`cover` of the ids added). Fast: one
    running sum. For each micro-batch the worker calls :meth:`begin`, then :meth:`add` once per
    parameter as its gradient becomes ready (from a gradient hook), then :meth:`end`. Or,
    between :meth:`begin` and the backward pass, :meth:`grad_views`, which lets autograd's
    own accumulation do :meth:`add`'s addition, and :meth:`landed` from the hook.
    """

    def __init__(
        self,
        layout: Layout,
        m: int,
        *,
        exact: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        self.layout, self.m, self.exact, self.dtype = layout, m, exact, dtype
        self.device = device or torch.device("cpu")
        self.nodes: dict[Node, torch.Tensor] = {}
        self.losses: dict[int, float] = {}
        self._free: list[torch.Tensor] = []  # buffers to reuse: no fresh pages per step
        self._peak = 0  # the most buffers in use at once during the current step
        self.allocated = 0
        """buffers allocated so far (in steady state, none after the first step)"""
        self._mb: int | None = None
        self._target = torch.empty(0)
        self._chain: list[torch.Tensor] = []
        self._first = False
        self._added: list[bool] = []
        self._pending: list[int] = []
        self._slices = [slice(o, o + n) for o, n in zip(layout.offsets, layout.sizes, strict=True)]
        self._views: list[torch.Tensor] | None = None  # the current micro-batch's (grad_views)
        self._view_cache: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @property
    def starting(self) -> bool:
        """The current micro-batch starts a node (it is copied, not added, into its buffer)."""
        return self._first

    @property
    def viewing(self) -> bool:
        """The current micro-batch's gradients go through :meth:`grad_views`."""
        return self._views is not None

    @property
    def ids(self) -> set[int]:
        """The micro-batch ids in these sums."""
        return set(self.losses)

    def _buffer(self) -> torch.Tensor:
        """A node buffer, with whatever it held before (the first micro-batch added into it
        copies instead of adding)."""
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)

    def begin(self, mb: int) -> None:
        """Micro-batch ``mb`` starts: decide which held nodes its gradient is added into."""
        assert self._mb is None and mb not in self.losses, f"micro-batch {mb} twice"
        self._mb = mb
        self._added = [False] * len(self.layout.sizes)
        self._pending = [0] * len(self.layout.buckets)
        for i in range(len(self.layout.sizes)):
            self._pending[self.layout.bucket_of[i]] += 1
        if not self.exact:
            self._first = not self.nodes  # the running sum starts as a copy, not zeros + add
            if self._first:
                self.nodes[(0, self.m)] = self._buffer()
            self._target, self._chain = self.nodes[(0, self.m)], []
            self._peak = max(self._peak, 1)
            return
        chain, result = absorb(self.nodes, mb, self.m)
        # the nodes take their final shape now (the exchange may read a finished bucket of the
        # result before the backward pass is over); the merged siblings are read until then
        bufs = [self.nodes.pop(n) for n in chain]
        self._target = bufs[0] if bufs else self._buffer()
        self._chain, self._first = bufs[1:], not bufs
        self.nodes[result] = self._target
        self._peak = max(self._peak, len(self.nodes) + len(self._chain))

    def add(self, index: int, grad: torch.Tensor | None) -> int | None:
        """Parameter ``index``'s gradient of the current micro-batch (None: no gradient, i.e.
        zeros). Returns the bucket this completes, if it does."""
        assert self._mb is not None and not self._added[index]
        s = self._slices[index]
        g = (
            grad.reshape(-1)
            if grad is not None
            else torch.zeros(1, dtype=self.dtype, device=self.device)
        )
        target = self._target[s]
        if self._first:
            target.copy_(g.expand(s.stop - s.start))
        else:
            target.add_(g)
        return self._merged(index, target)

    def grad_views(self, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """For the current micro-batch (after :meth:`begin`): each parameter's place in the
        node buffer its gradient is added into, shaped like the parameter (``shapes``).

        The worker sets them as the parameters' ``.grad`` before the backward pass; autograd
        then accumulates each gradient into its view in place (``grad += new``: the addition
        :meth:`add` makes, of the same operands), and the gradient hook calls :meth:`landed`
        instead of :meth:`add`: no tensor work in Python per gradient, as in DDP's
        ``gradient_as_bucket_view``. A buffer that starts a node is filled with -0.0, the
        identity of IEEE addition (``-0.0 + g`` is ``g`` for every float, -0.0 included, where
        +0.0 would turn a gradient's -0.0 into +0.0). The views of a buffer are made once."""
        assert self._mb is not None and not any(self._added)
        key = id(self._target)
        hit = self._view_cache.get(key)
        if hit is None or hit[0] is not self._target:
            pairs = zip(self._slices, shapes, strict=True)
            views = [self._target[s].view(shape) for s, shape in pairs]
            self._view_cache[key] = hit = (self._target, views)
        if self._first:
            self._target.fill_(-0.0)
        self._views = hit[1]
        return hit[1]

    def landed(self, index: int, grad: torch.Tensor | None) -> int | None:
        """Parameter ``index``'s gradient of the current micro-batch is in its view of
        :meth:`grad_views` (``grad``: the parameter's ``.grad`` as the hook sees it). Returns
        the bucket this completes, if it does. A ``.grad`` that is not the view (autograd
        replaces rather than accumulates while it records a graph, ``create_graph=True``) holds
        the same sum, and is copied in."""
        assert self._mb is not None and self._views is not None and not self._added[index]
        view = self._views[index]
        if grad is not view:
            if grad is None:
                return self.add(index, None)
            view.copy_(grad)
        return self._merged(index, self._target[self._slices[index]] if self._chain else view)

    def hooked(self, index: int, param: torch.Tensor) -> int | None:
        """The gradient hook's work for parameter ``index`` (``param``, whose ``.grad`` holds
        its gradient of the current micro-batch): :meth:`landed` where the micro-batch goes
        through :meth:`grad_views`, else :meth:`add` and the ``.grad`` dropped. Returns the
        bucket this completes, if it does."""
        if self.viewing:
            return self.landed(index, param.grad)
        bucket = self.add(index, param.grad)
        param.grad = None
        return bucket

    def _merged(self, index: int, target: torch.Tensor) -> int | None:
        """The rest of adding parameter ``index``'s gradient into ``target`` (its flat slice of
        the node buffer): the merged siblings' slices, then the bucket's count."""
        s = self._slices[index]
        for other in self._chain:
            target.add_(other[s])
        self._added[index] = True
        b = self.layout.bucket_of[index]
        self._pending[b] -= 1
        return b if self._pending[b] == 0 else None

    def end(self, loss: float) -> list[int]:
        """The micro-batch's backward is over: parameters without a gradient count as zeros.
        Returns the buckets completed by them."""
        done = [
            b for i, a in enumerate(self._added) if not a and (b := self.add(i, None)) is not None
        ]
        assert self._mb is not None
        self._free += self._chain  # merged into the target: free for the next leaves
        self.losses[self._mb] = loss
        self._mb, self._chain, self._views = None, [], None
        return done

    def abandon(self) -> None:
        """A micro-batch failed half-way: its partial additions spoiled the sums; drop all."""
        self._mb, self._chain, self._views = None, [], None
        self.clear()

    def clear(self) -> None:
        """The step committed (or the sums are void): start empty, keeping as many buffers as
        the step had in use at once (the next step, alike in steady state, allocates none;
        a step that held more after a failure does not keep its extra memory for ever)."""
        assert self._mb is None
        self._free = (self._free + list(self.nodes.values()))[: max(self._peak, 1)]
        kept = {id(b) for b in self._free}
        self._view_cache = {k: v for k, v in self._view_cache.items() if k in kept}
        self._peak = 0
        self.nodes.clear()
        self.losses.clear()

    def node_list(self) -> list[Node]:
        return sorted(self.nodes)


# -- the exchange ----------------------------------------------------------------------------
class Collectives(Protocol):
    """What :class:`Exchange` needs of an epoch's group (:class:`unicron.runtime.group.EpochGroup`):
    asynchronous collectives, waited for by :meth:`wait` (which leaves a superseded epoch)."""

    rank: int
    world: int

    def start_alltoall(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Any: ...

    def start_allgather(self, out: torch.Tensor, inp: torch.Tensor) -> Any: ...

    def start_allreduce(self, tensor: torch.Tensor) -> Any: ...

    def wait(self, work: Any) -> None: ...


@dataclass
class Workspace:
    """Buffers of one group size, reused from step to step: the reduced gradient and the
    owners' receive buffers."""

    layout: Layout
    world: int
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    out: torch.Tensor = field(init=False)
    starts: list[int] = field(init=False)
    _recv: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.starts, total = self.layout.out_starts(self.world)
        self.out = torch.zeros(total, dtype=self.dtype, device=self.device)

    def recv(self, bucket: int, n: int) -> torch.Tensor:
        key = (bucket, n)
        if key not in self._recv:
            self._recv = {k: v for k, v in self._recv.items() if k[0] != bucket}
            self._recv[key] = torch.empty(n, dtype=self.dtype, device=self.device)
        return self._recv[key]

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's slice of the reduced buffer (flat)."""
        out = []
        for i, (off, n) in enumerate(zip(self.layout.offsets, self.layout.sizes, strict=True)):
            b = self.layout.bucket_of[i]
            at = self.starts[b] + off - self.layout.buckets[b][0]
            out.append(self.out[at : at + n])
        return out


class Gatherer:
    """The thread that starts exact mode's all-gathers on an epoch's second group, step
    after step: each step's :class:`Exchange` hands it a job per bucket, in bucket order.

    Made by the worker at an epoch's first step, with the epoch's ``gather`` subgroup, and
    stopped when it makes the next epoch's or finishes (a thread started for every step cost
    0.4-2.5 ms of each step with 4 workers on 2 cores: ``Thread.start`` returns only once the
    new thread has run). A job blocked on a superseded epoch's collective ends when the
    group is left, as the sliced waits raise; the thread then reads the stop and ends."""

    def __init__(self, group: Collectives) -> None:
        self.group = group
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="unicron-gather", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread after the jobs submitted before it (it must not raise)."""
        self._jobs.put(job)

    def stop(self) -> None:
        """End the thread after the jobs already submitted (they see their exchange closed)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class Exchange:
    """One step's reduction of every member's :class:`LocalSums`.

    ``held[r]`` lists the tree nodes member r holds at the end of its micro-batches (every
    member derives the same lists from the ledger). :meth:`ready` is called for each bucket as
    this member's sums for it are final (from the last micro-batch's gradient hooks);
    buckets are launched in layout order only, so every member issues the same collectives in
    the same order. :meth:`finish` launches what is left and waits for the result.

    Exact mode: a bucket's all-gather needs its all-to-all finished (the owner sums what it
    received). Given a ``gather`` :class:`Gatherer` (the thread of a second group of the same
    members), that thread waits for each all-to-all in bucket order, sums, and starts the
    gather on that group, while the backward pass goes on: every member issues each group's
    collectives in the same order, and the hooks never wait (a member waiting on a peer
    inside its backward pass would look slow or hung itself). Without one, the gathers start
    in :meth:`finish`, after the backward pass: on the 100M model 400 MB of gradient then
    cross the wire after the step's computation (docs/runtime.md, Speed).
    """

    def __init__(
        self,
        group: Collectives,
        sums: LocalSums,
        space: Workspace,
        held: Sequence[Sequence[Node]],
        gather: Gatherer | None = None,
    ) -> None:
        assert len(held) == group.world and space.world == group.world
        self.g, self.sums, self.space = group, sums, space
        self.held = [sorted(h) for h in held]
        self._ready = [False] * len(space.layout.buckets)
        self._a2a: list[Any] = []
        self._recv: list[torch.Tensor] = []  # bucket b's all-to-all lands in _recv[b]
        self._gathers: list[Any] = []
        self.launched = 0
        self._gatherer = gather if sums.exact else None
        self._gg = None if self._gatherer is None else self._gatherer.group
        self._failed: BaseException | None = None
        self._closed = False
        self._pending = 0  # buckets handed to the gatherer whose job has not ended
        self._idle = threading.Condition()

    def ready(self, bucket: int) -> None:
        """This member's sums of ``bucket`` are final: launch every bucket now in order."""
        self._ready[bucket] = True
        while self.launched < len(self._ready) and self._ready[self.launched]:
            self._launch(self.launched)
            self.launched += 1
            if self._gatherer is not None:
                with self._idle:
                    self._pending += 1
                self._gatherer.submit(functools.partial(self._gather_job, self.launched - 1))

    @property
    def gathered(self) -> int:
        """Buckets whose all-gather has been started (exact mode)."""
        return len(self._gathers)

    def _gather_job(self, b: int) -> None:
        """On the gatherer's thread, bucket ``b``'s turn: wait for its all-to-all and start
        its all-gather on the gather group. Skipped after a failure (kept for :meth:`finish`)
        or once the exchange is closed."""
        try:
            if self._failed is None and not self._closed:
                self.g.wait(self._a2a[b])
                self._gathers.append(self._gather(b))
        except BaseException as exc:  # re-raised by finish(), on the caller's thread
            self._failed = exc
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def close(self) -> None:
        """The step is abandoned (or finished): the gatherer skips its jobs left. Called by
        the worker whenever it drops an exchange."""
        self._closed = True

    def _launch(self, b: int) -> None:
        lo, hi = self.space.layout.buckets[b]
        if not self.sums.exact:
            at = self.space.starts[b]
            dst = self.space.out[at : at + hi - lo]
            src = self.sums.nodes.get((0, self.sums.m))
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src[lo:hi])
            self._a2a.append(self.g.start_allreduce(dst))
            return
        mine = self.held[self.g.rank]
        assert mine == self.sums.node_list(), f"holding {self.sums.node_list()}, expected {mine}"
        parts = chunks(hi - lo, self.g.world)
        bufs = [self.sums.nodes[n] for n in mine]
        rank = self.g.rank
        a, z = parts[rank]
        if len(bufs) == 1:
            inp = bufs[0][lo:hi]
            if self._own_in_place:  # the first or last chunk: the rest is contiguous
                inp = bufs[0][lo + z : hi] if rank == 0 else bufs[0][lo : lo + a]
        else:
            pieces = [buf[lo + a : lo + b] for a, b in parts for buf in bufs]
            inp = (
                torch.cat(pieces)
                if pieces
                else torch.empty(0, dtype=self.sums.dtype, device=self.sums.device)
            )
        in_splits = [len(mine) * (hi_ - lo_) for lo_, hi_ in parts]
        out_splits = [len(h) * (z - a) for h in self.held]
        if self._own_in_place:
            in_splits[rank] = out_splits[rank] = 0
        recv = self.space.recv(b, sum(out_splits))
        self._recv.append(recv)
        self._a2a.append(self.g.start_alltoall(recv, inp, out_splits, in_splits))

    @property
    def _own_in_place(self) -> bool:
        """Exact: this member reads its own chunk of each bucket from its local sums, not
        from an all-to-all to itself (gloo copies a member's part to itself): when it holds
        one node and its chunk is the bucket's first or last (the first or last member), so
        that the rest, which it sends, is contiguous."""
        r, w = self.g.rank, self.g.world
        return w > 1 and len(self.held[r]) == 1 and r in (0, w - 1)

    def finish(self) -> tuple[list[torch.Tensor], list[float]]:
        """Launch what is left, wait: (each parameter's summed gradient, the micro-batch
        losses of the step by id, NaN for those nobody holds)."""
        for b in range(len(self._ready)):
            if not self._ready[b]:
                self.ready(b)
        m = self.sums.m
        lossbuf = torch.zeros(2 * m, dtype=torch.float64, device=self.sums.device)
        for mb, loss in self.sums.losses.items():
            lossbuf[mb], lossbuf[m + mb] = loss, 1.0
        losswork = self.g.start_allreduce(lossbuf)
        if self._gatherer is not None:
            with self._idle:
                self._idle.wait_for(lambda: self._pending == 0)
            if self._failed is not None:
                raise self._failed
        elif self.sums.exact:
            for b, work in enumerate(self._a2a):
                self.g.wait(work)
                self._gathers.append(self._gather(b))
        if self.sums.exact:
            for work in self._gathers:
                (self._gg or self.g).wait(work)
        else:
            for work in self._a2a:
                self.g.wait(work)
        self.g.wait(losswork)
        losses = [float(lossbuf[i]) if lossbuf[m + i] else float("nan") for i in range(m)]
        return self.space.grads(), losses

    def _gather(self, b: int) -> Any:
        """Owner's part of bucket ``b``: the tree over what it received, then the all-gather."""
        lo, hi = self.space.layout.buckets[b]
        parts = chunks(hi - lo, self.g.world)
        a, z = parts[self.g.rank]
        c = parts[0][1] - parts[0][0]
        rank, own, recv = self.g.rank, self._own_in_place, self._recv[b]
        start = self.space.starts[b]
        out = self.space.out[start : start + self.g.world * c]
        slot = out[rank * c : (rank + 1) * c]
        got: dict[Node, torch.Tensor] = {}
        local: set[int] = set()  # this member's sums: read, never written
        at = 0
        for r, nodes in enumerate(self.held):
            for n in nodes:
                if own and r == rank:
                    got[n] = self.sums.nodes[n][lo + a : lo + z]
                    local.add(id(got[n]))
                else:
                    got[n] = recv[at : at + z - a]
                    at += z - a

        def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # in place on a received operand (IEEE addition commutes: the same bits)
            if id(x) not in local:
                return x.add_(y)
            return y.add_(x) if id(y) not in local else torch.add(x, y)

        def last(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the root, into place
            return torch.add(x, y, out=slot) if z - a == c else add(x, y)

        root = combine(got, self.sums.m, add, last)
        mine = root if root is not None and z - a == c else None
        if mine is None:
            mine = torch.zeros(c, dtype=self.sums.dtype, device=self.sums.device)
            if root is not None:
                mine[: z - a] = root
        return (self._gg or self.g).start_allgather(out, mine)
