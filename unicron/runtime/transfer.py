"""Moving the model and optimizer state to the members of an epoch that lack it, streamed.

Called by the worker (:mod:`unicron.worker`) during a transition, after the ledger exchange
has named the *holders* (members at the newest committed step, with identical parameters)
and the *needers* (joiners, restarted workers). Nothing is serialized into one blob:

1. the first holder broadcasts a *manifest*, as JSON (a few KB, one broadcast; no pickle, no
   ``torch.save``, whose meta-tensor records cost tens of ms): the shape and dtype of each of
   the model's tensors, and the optimizer's state dict with a :class:`Spec` (shape and dtype)
   in each tensor's place. The state dicts are walked once, dispatched on exact types, and
   the manifest encoded, before the transfer (:func:`inventory`: the worker takes it while
   the ledger exchange's all-gather is on the wire);
2. the state's tensors, in a fixed order, form one virtual byte stream cut into chunks of
   :data:`CHUNK_BYTES` (the optimizer's state starts a new one; the first chunks of each
   part ramp up from ``CHUNK_BYTES / RAMP``, so that the first is on the wire sooner); chunk
   ``k`` comes from holder ``k mod H`` (several holders send in parallel, each a share; a
   model within one chunk comes from the first alone, :func:`senders`),
   broadcast in a small group of that holder and the needers (a collective, because a gloo
   point-to-point wait cannot be left in slices: it closes the connection when it times out),
   or, from one holder to one needer in a larger epoch, sent over the epoch's own group
   (:class:`unicron.runtime.group.PeerLink`, whose waiter thread makes its waits sliced);
3. a chunk is sent from, and received into, the tensors' own memory when it lies in one
   tensor or in tensors that follow each other in one storage. The worker lays its state out
   so (:func:`lay_out_parameters` when it starts, :func:`lay_out_optimizer_state` after its
   first step), and a needer allocates the optimizer state it lacks as one buffer in stream
   order (:func:`fresh`): nothing is copied on either side. Any other chunk is packed into
   one of a few staging buffers, taken from a pool that the worker fills when it starts
   (:func:`warm_up`; a fresh buffer pays its page faults, about as much as the copy into
   it). At most :data:`WINDOW` packed chunks per peer are in flight, so the extra memory on
   either side is a few chunks, whatever the state's size; chunks in place are all posted
   at once.

A needer posts its model's chunks first (written into its own tensors; before the manifest
has arrived when the ledger exchange found its model's :func:`layout` to be the holders',
``agreed``), allocates the optimizer's tensors while they are on the wire, and hands them to
``optimizer.load_state_dict`` (which keeps them without copying; if it copied, it is called
again once they have landed). Every wait goes through
:class:`unicron.runtime.group.EpochGroup`'s sliced waits, so a superseded epoch is left at
once. Method and measurements: ``docs/runtime.md`` ("State transfer").
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import itertools
import json
import logging
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from unicron.runtime.stateorder import (
    _check_model,
    _numel,
    _optim_targets,
    _param_states,
    fresh,
    lay_out_optimizer_state,
    lay_out_parameters,
)
from unicron.runtime.statetree import (
    _DTYPE_NAME,
    Spec,
    _fill,
    _skeleton,
    _tensors,
    _unskeleton,
    decode,
    encode,
    state_nbytes,
    state_tensors,
)

__all__ = [  # what the worker, the benchmark and the tests take from here
    "Inventory",
    "Link",
    "Spec",
    "Stats",
    "Wire",
    "decode",
    "encode",
    "fresh",
    "inventory",
    "lay_out_optimizer_state",
    "lay_out_parameters",
    "layout",
    "model_tensors",
    "rehearse",
    "share",
    "state_nbytes",
    "state_tensors",
    "transfer",
    "warm_up",
]

log = logging.getLogger("unicron.runtime.transfer")

CHUNK_BYTES = 4 << 20
"""Size of one piece of the stream (the unit of parallelism and of the memory bound)."""
WINDOW = 4
"""Packed chunks in flight per peer pair: enough to keep loopback or a link busy."""
RAMP = 8
"""The first chunk of the model's and of the optimizer's part is ``CHUNK_BYTES / RAMP``,
the next twice that, up to ``CHUNK_BYTES`` (:class:`_Stream`)."""


class Link(Protocol):
    """Where chunks go: a group of a holder and the needers (:class:`Wire`, or a
    :class:`unicron.runtime.group.PeerLink` of one holder and one needer)."""

    rank: int
    world: int
    wire: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...
    def ibroadcast(self, tensor: torch.Tensor, src: int) -> Any: ...
    def wait(self, work: Any) -> None: ...


class Wire(Link, Protocol):
    """What the transfer needs of an epoch's group (:class:`unicron.runtime.group.EpochGroup`)."""

    def subgroup(self, ranks: list[int], name: str) -> Wire: ...
    def peer(self, other: int) -> Link | None: ...


@dataclass(frozen=True)
class Stats:
    """What one member did in one transfer (for logs and the benchmark)."""

    nbytes: int
    chunks: int
    packed: int  # chunks that spanned several tensors (copied through a staging buffer)


# -- the byte stream and its chunks ---------------------------------------------------------
class _Stream:
    """The tensors as one byte stream: which part of which tensor chunk ``k`` covers.

    Chunks are ``chunk`` bytes, but a new one starts at each tensor index in ``breaks`` (the
    optimizer's first tensor: a needer's fresh optimizer state is one buffer, and a chunk
    that began among the model's tensors would not land in place). With ``ramp`` r > 1 the
    first chunks after each such start are ``chunk / r``, then twice that, up to ``chunk``:
    a sender that must pack the first chunk has it on the wire sooner, and packs the next
    while it goes."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        chunk: int,
        breaks: tuple[int, ...] = (),
        sizes: list[int] | None = None,
        ramp: int = 1,
    ):
        self.tensors = tensors
        """in stream order; a receiver may append the later ones before their first chunk"""
        self.sizes = [t.numel() * t.element_size() for t in tensors] if sizes is None else sizes
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self.nbytes = self.starts[-1]
        self.chunk = chunk
        cuts = sorted({0, self.nbytes, *(self.starts[i] for i in breaks)})
        self.bounds = []
        for lo, end in itertools.pairwise(cuts):
            size = max(chunk // ramp, 1)
            while lo < end:
                self.bounds.append((lo, min(lo + size, end)))
                lo, size = lo + size, min(2 * size, chunk)
        self.count = len(self.bounds)
        self._views: dict[int, torch.Tensor] = {}

    def pieces(self, k: int) -> list[tuple[int, int, int]]:
        """(tensor index, first byte, end byte) of every tensor part in chunk ``k``."""
        lo, hi = self.bounds[k]
        i = bisect.bisect_right(self.starts, lo) - 1
        out = []
        while i < len(self.tensors) and self.starts[i] < hi:
            a, b = max(lo, self.starts[i]), min(hi, self.starts[i + 1])
            if b > a:
                out.append((i, a - self.starts[i], b - self.starts[i]))
            i += 1
        return out

    def _bytes(self, i: int) -> torch.Tensor:
        """Tensor ``i`` as flat bytes (a view; made once per tensor)."""
        view = self._views.get(i)
        if view is None:
            t = self.tensors[i]
            view = self._views[i] = (
                (t.detach() if t.requires_grad else t).reshape(-1).view(torch.uint8)
            )
        return view

    def _part(self, i: int, a: int, b: int) -> torch.Tensor:
        view = self._bytes(i)
        return view if a == 0 and b == self.sizes[i] else view[a:b]

    def view(self, k: int, wire: torch.device) -> torch.Tensor | None:
        """Chunk ``k`` as a view of the tensors' own memory, if it lies in one tensor, or in
        tensors that follow each other in one storage (a needer's fresh optimizer state,
        :func:`fresh`), on the wire's device: sent from and received into place. Else None
        (it goes through a staging buffer)."""
        pieces = self.pieces(k)
        i, a, b = pieces[0]
        t = self.tensors[i]
        if t.device != wire or not t.is_contiguous():
            return None
        if len(pieces) == 1:
            return self._bytes(i)[a:b]
        # each later tensor starts where the stream says, counted from the first's address,
        # and the span lies in the first's storage: then it is that storage's memory (live
        # allocations do not overlap), and bytes written there land in each tensor
        base = t.data_ptr() - self.starts[i]
        for j, _, _ in pieces[1:]:
            u = self.tensors[j]
            if u.data_ptr() != base + self.starts[j] or u.device != wire or not u.is_contiguous():
                return None
        storage = t.untyped_storage()
        start = t.storage_offset() * t.element_size() + a
        if start + self.size(k) > storage.nbytes():
            return None
        span = torch.empty(0, dtype=torch.uint8, device=t.device)
        return span.set_(storage, start, (self.size(k),), (1,))

    def size(self, k: int) -> int:
        lo, hi = self.bounds[k]
        return hi - lo

    def pack(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """Copy chunk ``k`` into ``out`` (a staging buffer, :meth:`size` bytes; the sender's
        side) and return it."""
        parts = [self._part(i, a, b) for i, a, b in self.pieces(k)]
        if all(p.device == out.device for p in parts):
            return torch.cat(parts, out=out)
        at = 0
        for p in parts:
            out[at : at + p.numel()].copy_(p)
            at += p.numel()
        return out

    def unpack(self, k: int, buf: torch.Tensor) -> None:
        """Copy a received buffer into the tensors of chunk ``k`` (the receiver's side)."""
        pieces = self.pieces(k)
        for (i, a, b), src in zip(pieces, buf.split([b - a for _, a, b in pieces]), strict=True):
            assert self.tensors[i].is_contiguous(), "a destination must be contiguous"
            self._part(i, a, b).copy_(src)


class _Staging:
    """The buffers packed chunks pass through: ``slots`` of them, taken from this process's
    pool (:func:`warm_up`) or allocated on first use, reused within the transfer and given
    back to the pool when it ends well. The chunk with sequence number ``seq`` gets buffer
    ``seq mod slots``; a caller that keeps at most ``slots`` chunks in flight, and lands (or
    waits for) the oldest before it starts a new one, never reuses a buffer still on the
    wire."""

    def __init__(self, slots: int, nbytes: int, wire: torch.device) -> None:
        self.nbytes = nbytes
        self.wire = wire
        self.bufs: list[torch.Tensor | None] = [None] * slots

    def get(self, seq: int, size: int) -> torch.Tensor:
        j = seq % len(self.bufs)
        buf = self.bufs[j]
        if buf is None:
            buf = self.bufs[j] = _take(self.wire, self.nbytes)
        return buf[:size]

    def give_back(self) -> None:
        """The transfer is over and no operation writes into these buffers any more (never
        called after a failure: an abandoned gloo operation may still write into one)."""
        with _POOL_LOCK:
            _POOL.extend(b for b in self.bufs if b is not None)
        self.bufs = [None] * len(self.bufs)


_POOL: list[torch.Tensor] = []
"""Staging buffers kept between transfers, their pages touched: a fresh buffer's page faults
cost about as much as the copy into it (0.3 ms per MB here)."""
_POOL_LOCK = threading.Lock()


def _take(wire: torch.device, nbytes: int) -> torch.Tensor:
    """A staging buffer of at least ``nbytes`` on ``wire``: a pooled one if there is one,
    else a new one."""
    with _POOL_LOCK:  # threads of one process may transfer at once (the tests' members)
        for i, buf in enumerate(_POOL):
            if buf.device == wire and buf.numel() >= nbytes:
                return _POOL.pop(i)
    return torch.empty(nbytes, dtype=torch.uint8, device=wire)


def warm_up(wire: torch.device, slots: int = WINDOW, nbytes: int = CHUNK_BYTES) -> None:
    """Fill this process's pool with ``slots`` staging buffers of ``nbytes`` on ``wire``,
    their pages touched, and run this module's first calls once: on the CPU a whole
    transfer between two threads (:func:`rehearse`), else a manifest's encode and decode.
    Called by the worker when it starts (:mod:`unicron.worker`), so that neither a holder
    nor a restarted worker pays them during a transfer, while every member waits (a restarted
    worker pays them before it is ready, while the others train); costs ``slots x nbytes`` of
    memory for the life of the process (16 MB by default)."""
    with _POOL_LOCK:
        have = sum(1 for b in _POOL if b.device == wire and b.numel() >= nbytes)
        _POOL.extend(
            torch.zeros(nbytes, dtype=torch.uint8, device=wire) for _ in range(slots - have)
        )
    if wire.type == "cpu":
        rehearse()  # its manifest is encoded and decoded too
    else:
        decode(encode({"w": Spec((1,), torch.float32), "state": {0: (1.0, [None])}}))


class _Pair:
    """A :class:`Wire` over a gloo group of two threads of this process (:func:`rehearse`)."""

    def __init__(self, pg: Any, rank: int) -> None:
        self.pg, self.rank, self.world, self.wire = pg, rank, 2, torch.device("cpu")

    def ibroadcast(self, tensor: torch.Tensor, src: int) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.ibroadcast(tensor, src).wait()

    def wait(self, work: Any) -> None:
        work.wait()

    def subgroup(self, ranks: list[int], name: str) -> Wire:
        raise AssertionError("a rehearsal has one holder and one needer")

    def peer(self, other: int) -> Link | None:
        raise AssertionError("a rehearsal has one holder and one needer")


def rehearse(timeout_s: float = 5.0) -> bool:
    """Transfer a tiny model's state (a linear layer and a layer norm, AdamW's moments) from
    one thread of this process to another over a gloo group of their own (an in-memory
    store), so that the process's first real transfer does not pay first-use costs: 1-2 ms
    of a 5 MB transfer, measured on this path and not on the Python calls alone
    (`bench/results/transfer-history.md`). Called by :func:`warm_up`; takes 20-40 ms. True if
    the needer's state arrived intact. A failure is logged, and the process's first transfer
    then pays those costs."""
    import torch.distributed as dist

    store = dist.HashStore()
    with torch.random.fork_rng():  # the process's random stream is left as it was
        torch.manual_seed(0)
        models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)) for _ in "ab"]
    optimizers = [torch.optim.AdamW(m.parameters()) for m in models]
    models[0](torch.ones(2, 4)).sum().backward()
    optimizers[0].step()  # the holder has moments, the needer none
    states: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
            model, optimizer = models[rank], optimizers[rank]
            # one model's layout on both, as for a restarted worker: the path a real one takes
            transfer(_Pair(pg, rank), model, optimizer, holders=[0], needers=[1],
                     device=torch.device("cpu"), chunk_bytes=64, ramp=2, agreed=True)  # fmt: skip
            tensors = state_tensors(model, optimizer)[1]
            states[rank] = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        except BaseException as exc:  # a rehearsal that fails must not stop the worker
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout_s)
    if errors or len(states) != 2 or not torch.equal(states[0], states[1]):
        log.warning("the transfer's rehearsal failed (the first transfer pays its first "
                    "calls): %r", errors[:1])  # fmt: skip
        return False
    return True


def share(k: int, holders: list[int]) -> int:
    """The holder that sends chunk ``k``: round robin, so each sends an equal share."""
    return holders[k % len(holders)]


# -- the manifest ---------------------------------------------------------------------------
MANIFEST_HEAD = 64 << 10
"""Bytes of the manifest's first broadcast: its length, then as much of the JSON as fits (a
model of a few hundred tensors needs no second broadcast)."""


def _manifest(
    model: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[bytes, list[torch.Tensor], int]:
    """A holder's manifest (JSON: the specs of the model's tensors ``model``, in stream order,
    and the optimizer's state dict with its tensors' specs), its tensors in stream order, and
    how many of them are the model's. A needer writes the model's tensors into its own, so
    the model's state dict's other contents are not sent."""
    tensors = list(model)
    model_specs = [["T", list(t.shape), _DTYPE_NAME[t.dtype]] for t in tensors]
    n_model = len(tensors)
    optim = _skeleton(optimizer.state_dict(), tensors)
    data = json.dumps({"model": model_specs, "optim": optim}, separators=(",", ":")).encode()
    return data, tensors, n_model


def _manifest_parts(data: bytes, wire: torch.device) -> list[torch.Tensor]:
    """The manifest ``data`` as a first holder broadcasts it: a head of :data:`MANIFEST_HEAD`
    bytes (an int64 length and the JSON's start) and, if the JSON is longer, the rest."""
    room = MANIFEST_HEAD - 8
    head = bytearray(MANIFEST_HEAD)
    first = data[:room]
    head[:8] = len(data).to_bytes(8, "little")
    head[8 : 8 + len(first)] = first
    parts = [torch.frombuffer(head, dtype=torch.uint8).to(wire)]
    if len(data) > room:
        parts.append(torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8).to(wire))
    return parts


class _Incoming:
    """A needer's receipt of the manifest: the head's receive is posted when this is made;
    :meth:`read` waits for it, and receives the rest (if any) after whatever the needer
    posted in between, as the first holder sends it (:func:`_lead`)."""

    def __init__(self, link: Link, src: int) -> None:
        self.link, self.src = link, src
        self.head = torch.empty(MANIFEST_HEAD, dtype=torch.uint8, device=link.wire)
        self.work = link.ibroadcast(self.head, src)

    def read(self) -> Any:
        """The manifest, decoded from JSON."""
        self.link.wait(self.work)
        head = self.head.cpu().numpy()
        room = MANIFEST_HEAD - 8
        n = int.from_bytes(head[:8].tobytes(), "little")
        data = head[8 : 8 + min(n, room)].tobytes()
        if n > room:
            rest = torch.empty(n - room, dtype=torch.uint8, device=self.link.wire)
            self.link.broadcast(rest, self.src)
            data += rest.cpu().numpy().tobytes()
        return json.loads(data)


# -- what a member has, taken before the transfer ---------------------------------------------
def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's state dict's tensors in stream order (one walk)."""
    out: list[torch.Tensor] = []
    _tensors(model.state_dict(), out)
    return out


def layout(tensors: list[torch.Tensor]) -> int:
    """A digest (63 bits) of the tensors' shapes and dtypes, in order. The worker puts its
    model's (:func:`model_tensors`) in its ledger row: needers whose model's layout is the
    holders' post their model's receives before the manifest arrives (:func:`transfer`'s
    ``agreed``)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(f"{tuple(t.shape)}{_DTYPE_NAME[t.dtype]};".encode())
    return int.from_bytes(h.digest(), "big") >> 1


@dataclass(frozen=True)
class Inventory:
    """A member's state as the transfer walks it: the model's tensors and the optimizer's
    state tensors, each in stream order, and, for a member that may be the first holder, its
    manifest. The worker takes it while the ledger exchange's all-gather is on the wire
    (:mod:`unicron.worker`), where a member waits for its peers in any case; taken inside the
    transfer, the holder's walks and encoding (0.6-0.9 ms at 5 MB of state) came before the
    manifest could leave. Valid until the state changes (the next step)."""

    model: list[torch.Tensor]
    optim: list[torch.Tensor]
    manifest: bytes | None


def inventory(
    model: list[torch.Tensor], optimizer: torch.optim.Optimizer, *, manifest: bool
) -> Inventory:
    """The :class:`Inventory` of a member whose model's tensors are ``model``
    (:func:`model_tensors`); with ``manifest`` (a member with state, which may be chosen to
    send it) the manifest is encoded too, if it can be: a state the manifest cannot describe
    gets none, and the ``TypeError`` is raised by the transfer that needs it, if one does."""
    if manifest:
        try:
            data, tensors, n_model = _manifest(model, optimizer)
        except TypeError:
            pass
        else:
            return Inventory(model, tensors[n_model:], data)
    own: list[torch.Tensor] = []
    _tensors(optimizer.state_dict(), own)
    return Inventory(model, own, None)


# -- the transfer ---------------------------------------------------------------------------
def transfer(
    g: Wire,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    holders: list[int],
    needers: list[int],
    device: torch.device,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
    ramp: int = RAMP,
    have: Inventory | None = None,
    agreed: bool = False,
) -> Stats:
    """Bring every needer's model and optimizer to the holders' state (collective: every
    member of ``g`` calls it with the same ``holders``, ``needers`` and ``agreed``; the others
    return at once). The manifest goes from the first holder to the needers; the chunks come
    from every holder (:func:`senders`: the first alone for a small model).

    ``have``: this member's :func:`inventory`, taken beforehand (else here; a first holder's
    without a manifest gets one here). ``agreed``: every needer's model has the holders'
    :func:`layout` (the worker compares them in the ledger exchange), so a needer posts its
    model's receives at once, before the manifest arrives, and the model's bytes move while it
    decodes the manifest and allocates the optimizer's state; without it, a needer whose model
    differs gets a clear error from the manifest, never a receive of the wrong size (gloo
    aborts the process when more bytes arrive than a receive was posted for).

    Raises :class:`unicron.runtime.group.EpochOver` if the epoch is superseded or a peer fails
    on the way. Python's cyclic garbage collector waits until it is over (a collection in the
    middle costs 0.1-3 ms here)."""
    assert holders and needers and not set(holders) & set(needers)
    paused = gc.isenabled()
    gc.disable()
    try:
        if have is None:
            have = inventory(model_tensors(model), optimizer, manifest=g.rank == holders[0])
        holders = senders(
            sum(t.numel() * t.element_size() for t in have.model), holders, chunk_bytes
        )
        if g.rank == holders[0]:
            data = (
                have.manifest if have.manifest is not None else _manifest(have.model, optimizer)[0]
            )
            return _lead(g, have, data, holders, needers, chunk_bytes, window, ramp, agreed)
        if g.rank in holders:  # the first holder's manifest describes this member's state
            stream = _Stream([*have.model, *have.optim], chunk_bytes, (len(have.model),), ramp=ramp)
            return _send(g, stream, holders, needers, window, {})
        if g.rank in needers:
            plan = (chunk_bytes, window, ramp)
            return _need(g, have, optimizer, holders, needers, device, plan, agreed)
        return Stats(nbytes=0, chunks=0, packed=0)
    finally:
        if paused:
            gc.enable()


def senders(model_bytes: int, holders: list[int], chunk_bytes: int) -> list[int]:
    """The holders that send: all of them, or only the first when the model (its state
    dict's ``model_bytes``) fits in one chunk. Such a state is a few chunks, which one sender
    streams in a few milliseconds; a second sender then only adds a process to schedule (at
    5 MB of state on 2 cores: 7.6 against 6.1 ms, `bench/results/transfer-history.md`).
    Every member decides alike: each has the model (a needer whose model differs is refused
    once it reads the manifest)."""
    return holders[:1] if model_bytes <= chunk_bytes else holders


def _optimizer_start(s: _Stream, n_model: int) -> int:
    """The first chunk of the optimizer's part (``s.count`` if it has no bytes)."""
    return next((k for k, (lo, _) in enumerate(s.bounds) if lo >= s.starts[n_model]), s.count)


def _lead(
    g: Wire,
    have: Inventory,
    data: bytes,
    holders: list[int],
    needers: list[int],
    chunk_bytes: int,
    window: int,
    ramp: int,
    agreed: bool,
) -> Stats:
    """The first holder's part: the manifest ``data``, then its share of the chunks. In the
    order the needers post their receives: the manifest's head first; its rest (a manifest
    beyond :data:`MANIFEST_HEAD`) next, or, when ``agreed``, after the model's chunks."""
    stream = _Stream([*have.model, *have.optim], chunk_bytes, (len(have.model),), ramp=ramp)
    link, src = _links(g, holders, needers)[g.rank]
    head, *rest = _manifest_parts(data, g.wire)
    works = [link.ibroadcast(head, src)]

    def send_rest() -> None:
        works.extend(link.ibroadcast(part, src) for part in rest)

    if agreed:
        stats = _send(
            g,
            stream,
            holders,
            needers,
            window,
            {_optimizer_start(stream, len(have.model)): send_rest},
        )
    else:
        send_rest()
        stats = _send(g, stream, holders, needers, window, {})
    for work in works:
        link.wait(work)
    return stats


def _need(
    g: Wire,
    have: Inventory,
    optimizer: torch.optim.Optimizer,
    holders: list[int],
    needers: list[int],
    device: torch.device,
    plan: tuple[int, int, int],
    agreed: bool,
) -> Stats:
    """A needer's part of :func:`transfer` (``have``: its own model's and optimizer's
    tensors; ``plan``: chunk bytes, window, ramp). Its model's chunks are on the wire before
    it allocates the optimizer's state (with ``agreed``, before the manifest arrives), and
    the optimizer takes that state while its chunks are on the wire."""
    chunk_bytes, window, ramp = plan
    mine, own = have.model, have.optim
    links = _links(g, holders, needers)
    incoming = _Incoming(*links[holders[0]])
    rx = _Receiver(links, holders, window, chunk_bytes)
    posted = 0
    if agreed:  # the model's layout is the holders': its stream part needs no manifest
        early = _Stream(list(mine), chunk_bytes, ramp=ramp)
        for k in range(early.count):
            rx.post(early, k)
        posted = early.count
    manifest = incoming.read()
    _check_model(mine, manifest["model"])
    specs: list[Spec] = []
    skeleton = _unskeleton(manifest["optim"], specs)
    sizes = [t.numel() * t.element_size() for t in mine]
    sizes += [_numel(s.shape) * s.dtype.itemsize for s in specs]
    stream = _Stream(list(mine), chunk_bytes, (len(mine),), sizes, ramp)
    first = _optimizer_start(stream, len(mine))
    assert posted in (0, first), (posted, first)
    for k in range(posted, first):
        rx.post(stream, k)
    targets = _optim_targets(specs, own, device)  # while the model's chunks are on the wire
    stream.tensors.extend(targets)
    loaded: list[bool] = []

    def load() -> None:  # while the optimizer's chunks are on the wire
        optimizer.load_state_dict(_fill(skeleton, iter(targets)))
        loaded.append(_holds(optimizer, targets))

    rx.idle = load
    for k in range(first, stream.count):
        rx.post(stream, k)
    rx.finish()
    if not loaded[0]:  # the optimizer copied (cast or moved) what it was given: again, now
        optimizer.load_state_dict(_fill(skeleton, iter(targets)))
    return Stats(nbytes=stream.nbytes, chunks=stream.count, packed=rx.packed)


def _holds(optimizer: torch.optim.Optimizer, targets: list[torch.Tensor]) -> bool:
    """The optimizer's state tensors are the ``targets`` objects themselves, in stream order
    (its ``load_state_dict`` kept them; a cast or a move would have made new ones)."""
    after: list[torch.Tensor] = []  # the order of its state dict's "state", built faster
    for state in _param_states(optimizer):
        _tensors(state, after)
    return len(after) == len(targets) and all(map(operator.is_, after, targets))


def _links(g: Wire, holders: list[int], needers: list[int]) -> dict[int, tuple[Link, int]]:
    """Holder -> (the group of that holder and every needer, the holder's rank in it), for
    this member: the epoch's own group when it has no other member; else, for one sender and
    one needer, the pair's link over the epoch's group (:meth:`Wire.peer`, where offered: no
    group of their own to build); else a subgroup. Several holders sending to one needer
    keep a subgroup each: each group's own gloo threads carry a holder's share (at 100 MB,
    two holders' links over the one epoch group took 71 against 52 ms,
    `bench/results/transfer-history.md`)."""
    if len(holders) == 1 and g.world == 1 + len(needers):
        return {holders[0]: (g, holders[0])}
    mine = holders if g.rank in needers else [g.rank]
    if len(holders) == 1 and len(needers) == 1:
        pair = g.peer(needers[0] if g.rank == holders[0] else holders[0])
        if pair is not None:
            return {holders[0]: (pair, holders[0])}
    return {h: (g.subgroup([h, *needers], f"transfer/{h}"), 0) for h in mine}


def _send(
    g: Wire,
    s: _Stream,
    holders: list[int],
    needers: list[int],
    window: int,
    before: dict[int, Callable[[], None]],
) -> Stats:
    """A holder's share of the chunks (:func:`share`), posted in order; ``before[k]`` runs
    before the first of them at or after chunk ``k`` (at the end if there is none). A chunk
    sent from the tensors' own memory is posted at once; at most ``window`` packed ones are
    in flight (their staging buffers bound the extra memory)."""
    link, src = _links(g, holders, needers)[g.rank]
    mine = [k for k in range(s.count) if share(k, holders) == g.rank]
    staging = _Staging(window, min(s.chunk, s.nbytes), g.wire)
    staged: list[Any] = []  # packed chunks in flight, oldest first
    works: list[Any] = []
    packed = 0
    hooks = sorted(before.items())
    for k in mine:
        while hooks and hooks[0][0] <= k:
            hooks.pop(0)[1]()
        buf = s.view(k, g.wire)
        if buf is None:
            if len(staged) >= window:  # the buffer's last chunk is on the wire
                link.wait(staged.pop(0))
            buf = s.pack(k, staging.get(packed, s.size(k)))
            packed += 1
            staged.append(link.ibroadcast(buf, src))
        else:
            works.append(link.ibroadcast(buf, src))
    for _, hook in hooks:
        hook()
    for work in [*works, *staged]:
        link.wait(work)
    staging.give_back()
    nbytes = sum(s.size(k) for k in mine) * len(needers)
    return Stats(nbytes=nbytes, chunks=len(mine) * len(needers), packed=packed)


class _Receiver:
    """A needer's receives of the chunks, posted one by one (:meth:`post`) and waited for
    at the end (:meth:`finish`). A chunk received into the tensors' own memory is posted at
    once; at most ``window`` per holder land in staging buffers at a time (the oldest is
    waited for and unpacked before its buffer takes another). :attr:`idle`, once set, runs
    once: before the first such wait, else in :meth:`finish`."""

    def __init__(
        self, links: dict[int, tuple[Link, int]], holders: list[int], window: int, nbytes: int
    ) -> None:
        self.links, self.holders = links, holders
        self.limit = window * len(holders)
        wire = next(iter(links.values()))[0].wire
        self.staging = _Staging(self.limit, nbytes, wire)
        self.staged: list[tuple[Link, Any, _Stream, int, torch.Tensor]] = []  # oldest first
        self.works: list[tuple[Link, Any]] = []
        self.packed = 0
        self.idle: Callable[[], None] | None = None

    def post(self, s: _Stream, k: int) -> None:
        """Post the receive of chunk ``k`` of ``s``."""
        link, src = self.links[share(k, self.holders)]
        into = s.view(k, link.wire)
        if into is None:
            if len(self.staged) >= self.limit:
                self._run_idle()
                self._land(self.staged.pop(0))
            buf = self.staging.get(self.packed, s.size(k))
            self.packed += 1
            self.staged.append((link, link.ibroadcast(buf, src), s, k, buf))
        else:
            self.works.append((link, link.ibroadcast(into, src)))

    def finish(self) -> None:
        """Wait for every chunk posted and land it."""
        self._run_idle()
        for link, work in self.works:
            link.wait(work)
        for item in self.staged:
            self._land(item)
        self.staging.give_back()

    def _run_idle(self) -> None:
        if self.idle is not None:
            idle, self.idle = self.idle, None
            idle()

    @staticmethod
    def _land(item: tuple[Link, Any, _Stream, int, torch.Tensor]) -> None:
        link, work, s, k, buf = item
        link.wait(work)
        s.unpack(k, buf)
