"""Moving the model and optimizer state to the members of an epoch that lack it, streamed.

Called by the worker (:mod:`unicron.worker`) during a transition, after the ledger exchange
has named the *holders* (members at the newest committed step, with identical parameters)
and the *needers* (joiners, restarted workers). Nothing is serialized into one blob:

1. the first holder broadcasts a *manifest*: the model's and the optimizer's state dicts
   with every tensor replaced by its :class:`Spec` (shape and dtype), as JSON (a few KB, one
   broadcast; no pickle, no ``torch.save``, whose meta-tensor records cost tens of ms);
2. the state's tensors, in a fixed order, form one virtual byte stream cut into chunks of
   :data:`CHUNK_BYTES` (the optimizer's state starts a new one); chunk ``k`` comes from
   holder ``k mod H`` (several holders send in
   parallel, each a share), broadcast in a small group of that holder and the needers (a
   collective, because a gloo point-to-point wait cannot be left in slices: it closes the
   connection when it times out);
3. a chunk is sent from, and received into, the tensors' own memory when it lies in one
   tensor or in tensors that follow each other in one storage: a needer allocates the
   optimizer state it lacks as one buffer in stream order (:func:`fresh`), so its moments
   (two thirds of an AdamW state) land in place. Any other chunk is packed into one of a
   few staging buffers, allocated once per transfer and reused (a fresh buffer per chunk
   pays its page faults every time). At most :data:`WINDOW` chunks per peer are in flight,
   so the extra memory on either side is a few chunks, whatever the state's size.

A needer writes the model's tensors in place and the optimizer's state into fresh (or its
own, when every shape agrees) tensors, then hands them to ``optimizer.load_state_dict``,
which keeps them without copying. Every wait goes through
:class:`unicron.runtime.group.EpochGroup`'s sliced waits, so a superseded epoch is left at
once. Method and measurements: ``docs/runtime.md`` ("State transfer").
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

CHUNK_BYTES = 4 << 20
"""Size of one piece of the stream (the unit of parallelism and of the memory bound)."""
WINDOW = 4
"""Chunks in flight per peer pair: enough to keep loopback or a link busy."""


class Wire(Protocol):
    """What the transfer needs of an epoch's group (:class:`unicron.runtime.group.EpochGroup`)."""

    rank: int
    world: int
    wire: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...
    def ibroadcast(self, tensor: torch.Tensor, src: int) -> Any: ...
    def wait(self, work: Any) -> None: ...
    def subgroup(self, ranks: list[int], name: str) -> Wire: ...


@dataclass(frozen=True)
class Stats:
    """What one member did in one transfer (for logs and the benchmark)."""

    nbytes: int
    chunks: int
    packed: int  # chunks that spanned several tensors (copied through a staging buffer)


@dataclass(frozen=True, slots=True)
class Spec:
    """Where the manifest has a tensor: its shape and dtype (its bytes come in the stream)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


# -- the state as a list of tensors --------------------------------------------------------
def _walk(obj: Any, out: list[Any]) -> Any:
    """A copy of ``obj`` with tensors replaced by their :class:`Spec`; the tensors (or, in a
    manifest, the specs) go to ``out`` in a fixed order (dicts with integer keys, the
    optimizer's state, and with string keys, sorted)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return Spec(tuple(obj.shape), obj.dtype)
    if isinstance(obj, Spec):
        out.append(obj)
        return obj
    if isinstance(obj, dict):
        keys = list(obj)
        if all(isinstance(k, int) for k in keys) or all(isinstance(k, str) for k in keys):
            keys = sorted(keys)
        return {k: _walk(obj[k], out) for k in keys}
    if isinstance(obj, list | tuple):
        return type(obj)(_walk(v, out) for v in obj)
    return obj


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """Inverse of :func:`_walk`: put the next tensor wherever a :class:`Spec` stands."""
    if isinstance(skeleton, Spec):
        return next(tensors)
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Any, list[torch.Tensor]]:
    """(manifest skeleton, the state's tensors in stream order), without copying a tensor."""
    tensors: list[torch.Tensor] = []
    sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    skeleton = _walk(sd, tensors)
    return skeleton, tensors


def state_nbytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state the transfer moves (parameters, buffers, optimizer state)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer)[1])


# -- the manifest as JSON -------------------------------------------------------------------
def encode(skeleton: Any) -> bytes:
    """The skeleton as JSON. Lists stay arrays; a spec, a dict (whose keys may be integers)
    and a tuple become one-key objects tagged ``T``, ``D`` and ``U``. Floats keep every bit
    (``repr`` round-trips; NaN and infinities included). Raises ``TypeError`` naming any
    other kind of value (a state dict holds numbers, strings, None and containers)."""
    return json.dumps(_plain(skeleton), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`."""
    return _unplain(json.loads(data))


def _plain(obj: Any) -> Any:
    if isinstance(obj, Spec):
        return {"T": [list(obj.shape), str(obj.dtype).removeprefix("torch.")]}
    if isinstance(obj, dict):
        return {"D": [[_plain(k), _plain(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"U": [_plain(v) for v in obj]}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"the state dict holds a {type(obj).__name__}, which the transfer cannot send")


def _unplain(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_unplain(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    ((tag, body),) = obj.items()
    if tag == "T":
        dtype = getattr(torch, body[1])
        assert isinstance(dtype, torch.dtype), body
        return Spec(tuple(body[0]), dtype)
    if tag == "D":
        return {_unplain(k): _unplain(v) for k, v in body}
    assert tag == "U", tag
    return tuple(_unplain(v) for v in body)


# -- the byte stream and its chunks ---------------------------------------------------------
class _Stream:
    """The tensors as one byte stream: which part of which tensor chunk ``k`` covers.

    Chunks are ``chunk`` bytes, but a new one starts at each tensor index in ``breaks`` (the
    optimizer's first tensor: a needer's fresh optimizer state is one buffer, and a chunk
    that began among the model's tensors would not land in place)."""

    def __init__(self, tensors: list[torch.Tensor], chunk: int, breaks: tuple[int, ...] = ()):
        self.tensors = tensors
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self.nbytes = self.starts[-1]
        self.chunk = chunk
        cuts = sorted({0, self.nbytes, *(self.starts[i] for i in breaks)})
        self.bounds = [
            (lo, min(lo + chunk, end))
            for first, end in itertools.pairwise(cuts)
            for lo in range(first, end, chunk)
        ]
        self.count = len(self.bounds)
        self._views: dict[int, torch.Tensor] = {}
        self._next: dict[int, bool] = {}

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
        if i not in self._views:
            self._views[i] = self.tensors[i].detach().reshape(-1).view(torch.uint8)
        return self._views[i]

    def _joined(self, i: int) -> bool:
        """Tensor ``i + 1`` starts in memory where tensor ``i`` ends (one storage, both
        contiguous): a chunk may run across them in place."""
        if i not in self._next:
            a, b = self.tensors[i], self.tensors[i + 1]
            self._next[i] = (
                a.device == b.device
                and a.is_contiguous()
                and b.is_contiguous()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.data_ptr() + self.sizes[i] == b.data_ptr()
            )
        return self._next[i]

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
        if not all(self._joined(j) for j, _, _ in pieces[:-1]):
            return None
        start = t.storage_offset() * t.element_size() + a
        span = torch.empty(0, dtype=torch.uint8, device=t.device)
        return span.set_(t.untyped_storage(), start, (self.size(k),), (1,))

    def size(self, k: int) -> int:
        lo, hi = self.bounds[k]
        return hi - lo

    def pack(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """Copy chunk ``k`` into ``out`` (a staging buffer, :meth:`size` bytes; the sender's
        side) and return it."""
        parts = [self._bytes(i)[a:b] for i, a, b in self.pieces(k)]
        if all(p.device == out.device for p in parts):
            return torch.cat(parts, out=out)
        at = 0
        for p in parts:
            out[at : at + p.numel()].copy_(p)
            at += p.numel()
        return out

    def unpack(self, k: int, buf: torch.Tensor) -> None:
        """Copy a received buffer into the tensors of chunk ``k`` (the receiver's side)."""
        at = 0
        for i, a, b in self.pieces(k):
            assert self.tensors[i].is_contiguous(), "a destination must be contiguous"
            self._bytes(i)[a:b].copy_(buf[at : at + b - a])
            at += b - a


class _Staging:
    """The buffers packed chunks pass through: ``slots`` of them, allocated on first use and
    reused. The chunk with sequence number ``seq`` gets buffer ``seq mod slots``; a caller
    that keeps at most ``slots`` chunks in flight, and lands (or waits for) the oldest before
    it starts a new one, never reuses a buffer still on the wire."""

    def __init__(self, slots: int, nbytes: int, wire: torch.device) -> None:
        self.nbytes = nbytes
        self.wire = wire
        self.bufs: list[torch.Tensor | None] = [None] * slots

    def get(self, seq: int, size: int) -> torch.Tensor:
        j = seq % len(self.bufs)
        buf = self.bufs[j]
        if buf is None:
            buf = self.bufs[j] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.wire)
        return buf[:size]


def share(k: int, holders: list[int]) -> int:
    """The holder that sends chunk ``k``: round robin, so each sends an equal share."""
    return holders[k % len(holders)]


# -- the manifest ---------------------------------------------------------------------------
MANIFEST_HEAD = 64 << 10
"""Bytes of the manifest's first broadcast: its length, then as much of the JSON as fits (a
model of a few hundred tensors needs no second broadcast)."""


def _send_manifest(g: Wire, src: int, skeleton: Any) -> Any:
    """Broadcast the skeleton from ``src`` to the whole group as JSON: one broadcast of
    :data:`MANIFEST_HEAD` bytes (an int64 length and the JSON's start), and one of the rest
    if the JSON is longer."""
    head = torch.zeros(MANIFEST_HEAD, dtype=torch.uint8)
    room = MANIFEST_HEAD - 8
    data = b""
    if g.rank == src:
        data = encode(skeleton)
        head[:8].view(torch.int64)[0] = len(data)
        first = data[:room]
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    wired = head.to(g.wire)
    g.broadcast(wired, src)
    if g.rank == src:
        if len(data) > room:
            g.broadcast(torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8).to(g.wire), src)
        return skeleton
    head = wired.cpu()
    n = int(head[:8].view(torch.int64)[0])
    data = head[8 : 8 + min(n, room)].numpy().tobytes()
    if n > room:
        rest = torch.empty(n - room, dtype=torch.uint8, device=g.wire)
        g.broadcast(rest, src)
        data += rest.cpu().numpy().tobytes()
    return decode(data)


def fresh(specs: list[Spec], device: torch.device) -> list[torch.Tensor]:
    """Empty tensors for ``specs`` that follow each other in one buffer (each at the next
    offset its dtype allows), so that the stream lands in them in place (:meth:`_Stream.view`)
    and not through a staging buffer. Scalars (the optimizer's step counts) live on the CPU,
    as the optimizer keeps them; they share the buffer when ``device`` is the CPU."""
    cpu = torch.device("cpu")
    where = [cpu if not s.shape else device for s in specs]
    offsets: list[int] = []
    ends: dict[torch.device, int] = {}
    for s, d in zip(specs, where, strict=True):
        size = s.dtype.itemsize
        at = -(-ends.get(d, 0) // size) * size
        offsets.append(at)
        ends[d] = at + _numel(s.shape) * size
    bufs = {d: torch.empty(n, dtype=torch.uint8, device=d) for d, n in ends.items()}
    return [
        bufs[d][at : at + _numel(s.shape) * s.dtype.itemsize].view(s.dtype).view(s.shape)
        for s, d, at in zip(specs, where, offsets, strict=True)
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _own_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A needer's model and optimizer tensors in stream order (gathered before the manifest
    arrives, while the holder prepares it)."""
    mine: list[torch.Tensor] = []
    _walk(model.state_dict(), mine)
    optim_own: list[torch.Tensor] = []
    _walk(optimizer.state_dict(), optim_own)
    return mine, optim_own


def _targets(
    skeleton: Any, mine: list[torch.Tensor], optim_own: list[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """A needer's destination tensors, in stream order: the model's own (checked against the
    manifest), the optimizer's own if every shape agrees, else fresh ones (:func:`fresh`)."""
    wanted: list[Spec] = []
    _walk(skeleton["model"], wanted)
    if len(mine) != len(wanted):
        raise RuntimeError(
            f"this worker's model has {len(mine)} tensors, the holder's {len(wanted)}"
        )
    for i, (own, spec) in enumerate(zip(mine, wanted, strict=True)):
        if tuple(own.shape) != spec.shape or own.dtype != spec.dtype:
            raise RuntimeError(
                f"this worker's model differs from the holder's (tensor {i}: "
                f"{tuple(own.shape)} {own.dtype}, holder {spec.shape} {spec.dtype})"
            )
    optim_wanted: list[Spec] = []
    _walk(skeleton["optim"], optim_wanted)
    if len(optim_own) == len(optim_wanted) and all(
        tuple(t.shape) == s.shape and t.dtype == s.dtype
        for t, s in zip(optim_own, optim_wanted, strict=True)
    ):
        return [*mine, *optim_own]
    return [*mine, *fresh(optim_wanted, device)]


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
) -> Stats:
    """Bring every needer's model and optimizer to the holders' state (collective: every
    member of ``g`` calls it with the same ``holders`` and ``needers``; the others only take
    part in the manifest's broadcast). Raises :class:`unicron.runtime.group.EpochOver` if the epoch
    is superseded or a peer fails on the way."""
    assert holders and needers and not set(holders) & set(needers)
    skeleton: Any = None
    tensors: list[torch.Tensor] = []
    if g.rank in holders:
        skeleton, tensors = state_tensors(model, optimizer)
    elif g.rank in needers:
        own = _own_tensors(model, optimizer)
    skeleton = _send_manifest(g, holders[0], skeleton)
    model_specs: list[Spec] = []
    _walk(skeleton["model"], model_specs)
    breaks = (len(model_specs),)  # the optimizer's state starts a chunk
    if g.rank in holders:
        stream = _Stream(tensors, chunk_bytes, breaks)
        return _send(g, stream, holders, needers, window)
    if g.rank in needers:
        tensors = _targets(skeleton, *own, device)
        stream = _Stream(tensors, chunk_bytes, breaks)
        stats = _receive(g, stream, holders, needers, window)
        optim_sd = _fill(skeleton, iter(tensors))["optim"]
        optimizer.load_state_dict(optim_sd)
        return stats
    return Stats(nbytes=0, chunks=0, packed=0)


def _links(g: Wire, holders: list[int], needers: list[int]) -> dict[int, tuple[Wire, int]]:
    """Holder -> (the group of that holder and every needer, the holder's rank in it), for
    this member: the epoch's own group when it has no other member, else a subgroup."""
    if len(holders) == 1 and g.world == 1 + len(needers):
        return {holders[0]: (g, holders[0])}
    mine = holders if g.rank in needers else [g.rank]
    return {h: (g.subgroup([h, *needers], f"transfer/{h}"), 0) for h in mine}


def _send(g: Wire, s: _Stream, holders: list[int], needers: list[int], window: int) -> Stats:
    link, src = _links(g, holders, needers)[g.rank]
    mine = [k for k in range(s.count) if share(k, holders) == g.rank]
    staging = _Staging(window, min(s.chunk, s.nbytes), g.wire)
    inflight: list[Any] = []
    packed = 0
    for seq, k in enumerate(mine):
        buf = s.view(k, g.wire)
        if buf is None:  # the buffer's last chunk (seq - window) was waited for below
            buf = s.pack(k, staging.get(seq, s.size(k)))
            packed += 1
        inflight.append(link.ibroadcast(buf, src))
        if len(inflight) >= window:
            link.wait(inflight.pop(0))
    for work in inflight:
        link.wait(work)
    nbytes = sum(s.size(k) for k in mine) * len(needers)
    return Stats(nbytes=nbytes, chunks=len(mine) * len(needers), packed=packed)


def _receive(g: Wire, s: _Stream, holders: list[int], needers: list[int], window: int) -> Stats:
    links = _links(g, holders, needers)
    limit = window * len(holders)
    staging = _Staging(limit, min(s.chunk, s.nbytes), g.wire)
    inflight: list[tuple[Wire, Any, int, torch.Tensor | None]] = []
    packed = 0

    def land(item: tuple[Wire, Any, int, torch.Tensor | None]) -> None:
        link, work, k, buf = item
        link.wait(work)
        if buf is not None:
            s.unpack(k, buf)

    for k in range(s.count):
        into = s.view(k, g.wire)
        buf = None
        if into is None:  # the buffer's last chunk (k - limit) was landed below
            into = buf = staging.get(k, s.size(k))
            packed += 1
        link, src = links[share(k, holders)]
        inflight.append((link, link.ibroadcast(into, src), k, buf))
        if len(inflight) >= limit:
            land(inflight.pop(0))
    for item in inflight:
        land(item)
    return Stats(nbytes=s.nbytes, chunks=s.count, packed=packed)
