"""Moving the model and optimizer state to the members of an epoch that lack it, streamed.

Called by the worker (:mod:`unicron.worker`) during a transition, after the ledger exchange
has named the *holders* (members at the newest committed step, with identical parameters)
and the *needers* (joiners, restarted workers). Nothing is serialized into one blob:

1. the first holder broadcasts a *manifest*: the model's and the optimizer's state dicts
   with every tensor replaced by a ``meta`` tensor of the same shape and dtype (a few KB);
2. the state's tensors, in a fixed order, form one virtual byte stream cut into chunks of
   :data:`CHUNK_BYTES`; chunk ``k`` comes from holder ``k mod H`` (several holders send in
   parallel, each a share), broadcast in a small group of that holder and the needers (a
   collective, because a gloo point-to-point wait cannot be left in slices: it closes the
   connection when it times out);
3. a chunk that lies inside one tensor is sent from, and received into, that tensor's own
   memory (no copy); a chunk that spans several small tensors is packed into a buffer. At
   most :data:`WINDOW` chunks per peer are in flight, so the extra memory on either side is
   a few chunks, whatever the state's size.

A needer writes the model's tensors in place and the optimizer's moments into fresh (or its
own, when shapes agree) tensors, then hands them to ``optimizer.load_state_dict``, which
keeps them without copying. Every wait goes through :class:`unicron.runtime.group.EpochGroup`'s
sliced waits, so a superseded epoch is left at once. Method and measurements:
``docs/runtime.md`` ("State transfer").
"""

from __future__ import annotations

import bisect
import io
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
    packed: int  # chunks that spanned several tensors (copied through a buffer)


# -- the state as a list of tensors --------------------------------------------------------
def _walk(obj: Any, out: list[torch.Tensor]) -> Any:
    """A copy of ``obj`` with tensors replaced by ``meta`` tensors; the tensors go to ``out``
    in a fixed order (dicts with integer keys, the optimizer's state, sorted)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        keys = list(obj)
        if all(isinstance(k, int) for k in keys) or all(isinstance(k, str) for k in keys):
            keys = sorted(keys)
        return {k: _walk(obj[k], out) for k in keys}
    if isinstance(obj, list | tuple):
        return type(obj)(_walk(v, out) for v in obj)
    return obj


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """Inverse of :func:`_walk`: put the next tensor wherever a ``meta`` tensor stands."""
    if isinstance(skeleton, torch.Tensor):
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


# -- the byte stream and its chunks ---------------------------------------------------------
class _Stream:
    """The tensors as one byte stream: which part of which tensor chunk ``k`` covers."""

    def __init__(self, tensors: list[torch.Tensor], chunk: int) -> None:
        self.tensors = tensors
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self.nbytes = self.starts[-1]
        self.chunk = chunk
        self.count = -(-self.nbytes // chunk)

    def pieces(self, k: int) -> list[tuple[int, int, int]]:
        """(tensor index, first byte, end byte) of every tensor part in chunk ``k``."""
        lo, hi = k * self.chunk, min((k + 1) * self.chunk, self.nbytes)
        i = bisect.bisect_right(self.starts, lo) - 1
        out = []
        while i < len(self.tensors) and self.starts[i] < hi:
            a, b = max(lo, self.starts[i]), min(hi, self.starts[i + 1])
            if b > a:
                out.append((i, a - self.starts[i], b - self.starts[i]))
            i += 1
        return out

    def _bytes(self, i: int) -> torch.Tensor:
        t = self.tensors[i]
        return t.detach().reshape(-1).view(torch.uint8)

    def view(self, k: int, wire: torch.device) -> torch.Tensor | None:
        """Chunk ``k`` as a view of one tensor's memory, if it lies in one tensor on the wire's
        device (sent from and received into place); else None (it goes through a buffer)."""
        pieces = self.pieces(k)
        if len(pieces) != 1:
            return None
        i, a, b = pieces[0]
        t = self.tensors[i]
        if t.device != wire or not t.is_contiguous():
            return None
        return self._bytes(i)[a:b]

    def size(self, k: int) -> int:
        return min(self.chunk, self.nbytes - k * self.chunk)

    def pack(self, k: int, wire: torch.device) -> torch.Tensor:
        """Chunk ``k`` copied into one buffer on the wire's device (the sender's side)."""
        return torch.cat([self._bytes(i)[a:b].to(wire) for i, a, b in self.pieces(k)])

    def unpack(self, k: int, buf: torch.Tensor) -> None:
        """Copy a received buffer into the tensors of chunk ``k`` (the receiver's side)."""
        at = 0
        for i, a, b in self.pieces(k):
            assert self.tensors[i].is_contiguous(), "a destination must be contiguous"
            self._bytes(i)[a:b].copy_(buf[at : at + b - a])
            at += b - a


def share(k: int, holders: list[int]) -> int:
    """The holder that sends chunk ``k``: round robin, so each sends an equal share."""
    return holders[k % len(holders)]


# -- the manifest ---------------------------------------------------------------------------
def _send_manifest(g: Wire, src: int, skeleton: Any) -> Any:
    """Broadcast the skeleton from ``src`` (size, then bytes) to the whole group."""
    if g.rank == src:
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(g.wire)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=g.wire)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=g.wire)
    g.broadcast(size, src)
    if g.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=g.wire)
    g.broadcast(payload, src)
    if g.rank == src:
        return skeleton
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)


def _targets(
    skeleton: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[Any, list[torch.Tensor]]:
    """A needer's destination tensors, in stream order: the model's own (checked against the
    manifest), the optimizer's own where shapes agree, else fresh ones on ``device``."""
    wanted: list[torch.Tensor] = []
    _walk(skeleton["model"], wanted)
    mine: list[torch.Tensor] = []
    _walk(model.state_dict(), mine)
    if len(mine) != len(wanted):
        raise RuntimeError(
            f"this worker's model has {len(mine)} tensors, the holder's {len(wanted)}"
        )
    out: list[torch.Tensor] = []
    for i, (own, spec) in enumerate(zip(mine, wanted, strict=True)):
        if own.shape != spec.shape or own.dtype != spec.dtype:
            raise RuntimeError(
                f"this worker's model differs from the holder's (tensor {i}: "
                f"{tuple(own.shape)} {own.dtype}, holder {tuple(spec.shape)} {spec.dtype})"
            )
        out.append(own)
    optim_wanted: list[torch.Tensor] = []
    _walk(skeleton["optim"], optim_wanted)
    optim_own: list[torch.Tensor] = []
    _walk(optimizer.state_dict(), optim_own)
    for j, spec in enumerate(optim_wanted):
        own_t = optim_own[j] if j < len(optim_own) else None
        if own_t is not None and own_t.shape == spec.shape and own_t.dtype == spec.dtype:
            out.append(own_t)
        else:  # scalars (the step count) stay on the CPU, as the optimizer keeps them
            where = torch.device("cpu") if spec.dim() == 0 else device
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=where))
    return skeleton, out


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
    if g.rank in holders:
        skeleton, tensors = state_tensors(model, optimizer)
    else:
        skeleton, tensors = None, []
    skeleton = _send_manifest(g, holders[0], skeleton)
    if g.rank in holders:
        stream = _Stream(tensors, chunk_bytes)
        return _send(g, stream, holders, needers, window)
    if g.rank in needers:
        skeleton, tensors = _targets(skeleton, model, optimizer, device)
        stream = _Stream(tensors, chunk_bytes)
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
    inflight: list[tuple[Any, torch.Tensor]] = []
    packed = 0
    for k in mine:
        buf = s.view(k, g.wire)
        if buf is None:
            buf = s.pack(k, g.wire)
            packed += 1
        inflight.append((link.ibroadcast(buf, src), buf))
        if len(inflight) >= window:
            link.wait(inflight.pop(0)[0])
    for work, _ in inflight:
        link.wait(work)
    nbytes = sum(s.size(k) for k in mine) * len(needers)
    return Stats(nbytes=nbytes, chunks=len(mine) * len(needers), packed=packed)


def _receive(g: Wire, s: _Stream, holders: list[int], needers: list[int], window: int) -> Stats:
    links = _links(g, holders, needers)
    inflight: list[tuple[Wire, Any, int, torch.Tensor, bool]] = []
    packed = 0
    limit = window * len(holders)

    def land(item: tuple[Wire, Any, int, torch.Tensor, bool]) -> None:
        link, work, k, buf, direct = item
        link.wait(work)
        if not direct:
            s.unpack(k, buf)

    for k in range(s.count):
        buf = s.view(k, g.wire)
        direct = buf is not None
        if buf is None:
            buf = torch.empty(s.size(k), dtype=torch.uint8, device=g.wire)
            packed += 1
        link, src = links[share(k, holders)]
        inflight.append((link, link.ibroadcast(buf, src), k, buf, direct))
        if len(inflight) >= limit:
            land(inflight.pop(0))
    for item in inflight:
        land(item)
    return Stats(nbytes=s.nbytes, chunks=s.count, packed=packed)
