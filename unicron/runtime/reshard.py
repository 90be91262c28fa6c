"""A layout change: the state moved by name from the ranks that hold it to the ranks whose
new shard needs it, in memory (docs/runtime.md, Model-parallel replicas: Layout changes).

When an epoch runs the task at another pipeline depth than the one its members' state was
built for (8 workers at TP=2 x PP=2 lose two for good: TP=2 x PP=1 x DP=3 on the six left),
each member builds its shard of the new layout (the script's ``rebuild``), keeps the old
shard as the source, and every entry of the new shards' state is filled from the old ones:

1. the *offers and needs*: every member says which state-dict entries it holds at the
   newest committed step and which its new shard has, as 63-bit digests of their names
   (two all-gathers of int64s: the lengths, then the padded lists). A name means the same
   tensor in every layout because the model names its modules by their place in the whole
   model (``blocks.5``, not the stage's ``blocks.1``) and the tensor-parallel degree does
   not change: an entry is the same slice at the same tensor-parallel rank;
2. the *moves* (:func:`plan`, pure): each needed entry comes from the member itself if it
   holds it, else from the first holder at the same tensor-parallel rank; the moves from
   one member to another are a JSON manifest of the entries (shapes, dtypes, the optimizer's
   state per parameter) and their bytes in packs of about :data:`PACK_BYTES`;
3. the moves run in one global order (source, then destination), each over a
   :class:`~unicron.runtime.group.PeerLink` of the epoch's group (a subgroup of the pair on
   NCCL): the first move not done has both its members at it, so the order cannot deadlock.

Bits: every moved tensor is copied, never recomputed, so the new shards hold the committed
state exactly; whether the next steps are the old layout's bits depends on the model (two
pipeline stages compute the whole model's gradients bit for bit at a fixed tensor-parallel
degree: ``tests/test_model_parallel.py``). Called by the worker (:mod:`unicron.worker`) in
the ledger exchange of such an epoch. A superseded epoch or a lost member raises
:class:`~unicron.runtime.group.EpochOver` like any collective; the old shard is kept until the
new one is whole, so nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from unicron.parallel import PipelineParallel, split_dims
from unicron.runtime.group import EpochGroup

__all__ = [
    "PACK_BYTES",
    "WHOLE",
    "Item",
    "Move",
    "Part",
    "Shard",
    "Slicing",
    "Span",
    "StateLost",
    "digest",
    "exchange",
    "local_spans",
    "plan",
    "receive",
    "reshard",
    "send",
    "span_of",
    "state_of",
]

PACK_BYTES = 16 << 20
"""about how many bytes of tensors one message of a move carries (the sender packs them, so
a move costs that much memory beyond the two shards, not its whole size)"""


class StateLost(RuntimeError):
    """Some entry of the new layout's state is held by no member at the newest step."""


def digest(name: str) -> int:
    """A state-dict entry's name as a positive 63-bit integer (the offers' wire form)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1


Part = tuple[int, int]
"""a shard's tensor-parallel ``(degree, rank)``: of each split entry it holds the rank-th of
degree equal slices"""

Span = tuple[Fraction, Fraction]
"""a slice of a split entry along its split dimension, as fractions of the whole"""

WHOLE: Span = (Fraction(0), Fraction(1))


def span_of(part: Part) -> Span:
    """The slice of every split entry that a shard at ``part`` holds."""
    tp, rank = part
    return Fraction(rank, tp), Fraction(rank + 1, tp)


@dataclass
class Shard:
    """One build of this rank's part of the model for a layout: its modules, its optimizer,
    its pipeline stage (:attr:`pipe`: stage ``pipe.stage`` of ``pipe.stages``, whose ``tp`` is
    its tensor-parallel rank and degree). Built by the worker from the script's model, or by
    the script's ``rebuild`` for another layout."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pipe: PipelineParallel

    @property
    def part(self) -> Part:
        """Its tensor-parallel degree and rank."""
        return self.pipe.tp.size, self.pipe.tp.rank

    def entries(self) -> dict[int, str]:
        """The state-dict entries' names by :func:`digest`."""
        return {digest(name): name for name in self.model.state_dict()}

    def slicing(self) -> Slicing:
        """Where the slices of its split entries lie in its tensors."""
        return Slicing(self.part, split_dims(self.model))


@dataclass(frozen=True)
class Slicing:
    """A shard's split entries (name -> the dimension each is split along) and its
    :data:`Part`: turns a :data:`Span` of an entry into a range of its local tensor."""

    part: Part
    dims: dict[str, int]

    def local(self, name: str, t: torch.Tensor, span: Span) -> torch.Tensor:
        """The view of ``t`` (this shard's tensor of entry ``name``, or one of the
        optimizer's state of that shape) holding ``span`` of the whole."""
        dim = self.dims.get(name)
        if dim is None:
            if span == WHOLE:
                return t
            raise ValueError(
                f"{name}: the layout change needs a slice of it, but the model does not mark it "
                f"split over tensor-parallel ranks (unicron.parallel.TP_DIM)"
            )
        tp, rank = self.part
        whole = t.shape[dim] * tp
        start, size = (span[0] - Fraction(rank, tp)) * whole, (span[1] - span[0]) * whole
        if start.denominator != 1 or size.denominator != 1:
            raise ValueError(
                f"{name}: {t.shape[dim]} x {tp} elements along dim {dim} do not split at "
                f"{span[0]}..{span[1]} (a degree that does not divide the layer)"
            )
        if start < 0 or start + size > t.shape[dim]:
            raise ValueError(
                f"{name}: {span[0]}..{span[1]} of it lies outside the slice of rank {rank} of "
                f"{tp} (a move planned from the wrong holder)"
            )
        return t.narrow(dim, int(start), int(size))


UNSPLIT = Slicing((1, 0), {})
"""the slicing of a shard whose entries all move whole (a sharded optimizer's shares)"""


@dataclass(frozen=True)
class Move:
    """Entries that member :attr:`src` sends to member :attr:`dst` (digests, sorted; a split
    entry may come in several slices from several members: :attr:`spans`, one per key, or
    empty when every key moves whole)."""

    src: int
    dst: int
    keys: tuple[int, ...]
    spans: tuple[Span, ...] = ()

    def pieces(self) -> list[tuple[int, Span]]:
        """Each key with the slice it carries."""
        return list(zip(self.keys, self.spans or [WHOLE] * len(self.keys), strict=True))


def _cut(gaps: list[Span], have: Span) -> tuple[list[Span], list[Span]]:
    """The parts of ``gaps`` inside ``have`` and those outside it."""
    inside, outside = [], []
    for lo, hi in gaps:
        a, b = max(lo, have[0]), min(hi, have[1])
        if a < b:
            inside.append((a, b))
            outside += [g for g in ((lo, a), (b, hi)) if g[0] < g[1]]
        else:
            outside.append((lo, hi))
    return inside, outside


def plan(
    offers: Sequence[set[int]],
    needs: Sequence[set[int]],
    holds: Sequence[Part],
    wants: Sequence[Part] | None = None,
    split: frozenset[int] | set[int] = frozenset(),
) -> tuple[list[Move], list[int]]:
    """The moves that give every member the entries it ``needs`` (for its new shard at
    ``wants``; default: ``holds``) from those that ``offers`` them (only members at the newest
    committed step offer; each holds its entries at ``holds``), in the order they run, and the
    needed entries nobody offers (digests; non-empty: the state is lost). Pure.

    An entry of ``split`` is held in slices (:func:`span_of`): a member needs its new part's
    slice, covered by its own old slice where they overlap (:func:`local_spans`; not a move)
    and the rest from the first holders of the other slices, those at its own part first
    (a change of the tensor-parallel degree gathers or cuts slices). Any other entry is
    replicated over the tensor-parallel ranks: it comes whole from a holder at the same part,
    or at another degree's (a holder at the same degree and another rank may hold a slice the
    model does not mark split: never taken)."""
    wants = holds if wants is None else wants
    moves: dict[tuple[int, int], list[tuple[int, Span]]] = {}
    missing: set[int] = set()
    for dst, need in enumerate(needs):
        want = wants[dst]
        order = sorted(
            (m for m in range(len(offers)) if m != dst), key=lambda m: (holds[m] != want, m)
        )
        for key in sorted(need):
            cut = key in split
            gaps = [span_of(want) if cut else WHOLE]
            if key in offers[dst]:
                if not cut:
                    continue
                gaps = _cut(gaps, span_of(holds[dst]))[1]
            for src in order:
                if not gaps:
                    break
                if key not in offers[src]:
                    continue
                if not cut and holds[src][0] == want[0] and holds[src] != want:
                    continue
                inside, gaps = _cut(gaps, span_of(holds[src]) if cut else WHOLE)
                moves.setdefault((src, dst), []).extend((key, s) for s in inside)
            if gaps:
                missing.add(key)
    ordered = []
    for (s, d), pieces in sorted(moves.items()):
        pieces.sort()
        whole = all(span == WHOLE for _, span in pieces)
        spans = () if whole else tuple(span for _, span in pieces)
        ordered.append(Move(s, d, tuple(k for k, _ in pieces), spans))
    return ordered, sorted(missing)


def local_spans(want: Part, hold: Part, split: bool) -> Span | None:
    """What a member keeps of an entry it holds at ``hold`` for its new shard at ``want``
    (``None``: nothing)."""
    if not split:
        return WHOLE
    inside = _cut([span_of(want)], span_of(hold))[0]
    return inside[0] if inside else None


def reshard(
    g: EpochGroup,
    *,
    source: Shard | None,
    target: Shard,
) -> None:
    """Fill ``target`` (this member's new shard) from ``source`` (the shard holding the
    committed state here; ``None``: this member holds none) and from the other members'
    sources. Every member of ``g`` calls it in the same epoch. Raises :class:`StateLost` when
    some entry is held by nobody (the caller falls back to the checkpoint) and ``EpochOver``
    when the epoch ends under it."""
    have = source.entries() if source is not None else {}
    want = target.entries()
    hold = source.part if source is not None else target.part
    cut_from = source.slicing() if source is not None else UNSPLIT
    cut_into = target.slicing()
    mine = {digest(n) for n in (*cut_into.dims, *cut_from.dims)}
    row = [*hold, *target.part, len(have), len(mine), *sorted(have), *sorted(mine), *sorted(want)]
    rows = exchange(g, row)
    offers = [set(r[6 : 6 + r[4]]) for r in rows]
    split = {k for r in rows for k in r[6 + r[4] : 6 + r[4] + r[5]]}
    needs = [set(r[6 + r[4] + r[5] :]) for r in rows]
    holds, wants = [(r[0], r[1]) for r in rows], [(r[2], r[3]) for r in rows]
    moves, missing = plan(offers, needs, holds, wants, split)
    if missing:
        raise StateLost(f"{len(missing)} entries of the new layout's state are held by nobody")
    if source is not None:
        kept = []
        for k in sorted(want.keys() & have.keys()):
            span = local_spans(target.part, source.part, k in split)
            if span is not None:
                kept.append(Item(have[k], value=True, state=True, span=span))
        _copy(source, cut_from, target, cut_into, kept)
    for move in moves:
        if g.rank == move.src:
            assert source is not None
            items = [Item(have[k], value=True, state=True, span=s) for k, s in move.pieces()]
            send(g, move.dst, source.model, source.optimizer, items, cut_from)
        elif g.rank == move.dst:
            receive(g, move.src, target.model, target.optimizer, cut_into)


@dataclass(frozen=True)
class Item:
    """What a move carries of the state-dict entry :attr:`name`: its tensor (``value``), the
    optimizer's state of that parameter (``state``, where there is one), or both; of a split
    entry the slice :attr:`span` (the optimizer's state of the parameter's shape sliced
    alike)."""

    name: str
    value: bool
    state: bool
    span: Span = WHOLE


def exchange(g: EpochGroup, row: list[int]) -> list[list[int]]:
    """Every member's ``row`` of int64s (any length), in rank order: two all-gathers."""
    n = g.allgather(torch.tensor([len(row)], dtype=torch.int64))
    width = max(int(t.item()) for t in n)
    padded = torch.zeros(width, dtype=torch.int64)
    padded[: len(row)] = torch.tensor(row, dtype=torch.int64)
    return [t.tolist()[: int(k.item())] for t, k in zip(g.allgather(padded), n, strict=True)]


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state per parameter name (entries of ``model`` that are parameters
    with state)."""
    by_param = {id(p): name for name, p in model.named_parameters()}
    return {by_param[id(p)]: s for p, s in optimizer.state.items() if id(p) in by_param and s}


def _outgoing(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, items: list[Item], slicing: Slicing
) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """The manifest of ``items`` and their tensors, in order (each slice cut as
    :attr:`Item.span` says)."""
    sd, states = model.state_dict(), state_of(model, optimizer)
    tensors: list[torch.Tensor] = []
    manifest: list[dict[str, Any]] = []
    for item in items:
        t = sd[item.name]
        entry: dict[str, Any] = {"name": item.name, "value": item.value, "state": {}}
        if item.span != WHOLE:
            entry["span"] = [item.span[0].numerator, item.span[0].denominator,
                             item.span[1].numerator, item.span[1].denominator]  # fmt: skip
        if item.value:
            tensors.append(slicing.local(item.name, t, item.span))
            entry["shape"] = list(tensors[-1].shape)
        for k, v in sorted(states.get(item.name, {}).items() if item.state else ()):
            if isinstance(v, torch.Tensor):
                sliced = item.span != WHOLE and v.dim() > 0 and v.shape == t.shape
                v = slicing.local(item.name, v, item.span) if sliced else v
                entry["state"][k] = [list(v.shape), str(v.dtype).removeprefix("torch."), sliced]
                tensors.append(v)
            else:
                entry["state"][k] = {"value": v}
        manifest.append(entry)
    return manifest, tensors


@dataclass
class _Into:
    """Where a stream of entries lands: a shard's state-dict tensors and parameters by name
    (read once per stream), its optimizer and its :class:`Slicing`."""

    tensors: dict[str, torch.Tensor]
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    slicing: Slicing

    @classmethod
    def of(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, slicing: Slicing
    ) -> _Into:
        return cls(model.state_dict(), dict(model.named_parameters()), optimizer, slicing)


def _incoming(entry: dict[str, Any], into: _Into, take: Any) -> None:
    """One manifest ``entry`` into the shard's tensor and its optimizer's state, each tensor
    read with ``take(shape, dtype)``."""
    name, slicing, optimizer = entry["name"], into.slicing, into.optimizer
    t = into.tensors[name]
    span = WHOLE
    if "span" in entry:
        a, b, c, d = entry["span"]
        span = (Fraction(a, b), Fraction(c, d))
    with torch.no_grad():
        if entry["value"]:
            dest = slicing.local(name, t, span)
            if list(dest.shape) != entry["shape"]:
                raise ValueError(
                    f"{name}: {entry['shape']} sent for {list(dest.shape)} here (a slice of a "
                    "tensor-parallel split the model does not mark: unicron.parallel.TP_DIM)"
                )
            dest.copy_(take(dest.shape, t.dtype))
        param = into.params.get(name)
        if param is None or not entry["state"]:
            return
        state = optimizer.state[param] if span != WHOLE else {}
        for k, spec in entry["state"].items():
            if isinstance(spec, dict):
                state[k] = spec["value"]
                continue
            shape, dtype, sliced = spec
            got = take(shape, getattr(torch, dtype)).clone()
            if sliced:
                buf = state.get(k)
                if not isinstance(buf, torch.Tensor) or buf.shape != t.shape:
                    buf = state[k] = torch.zeros(t.shape, dtype=got.dtype, device=t.device)
                slicing.local(name, buf, span).copy_(got)
            else:
                state[k] = got.to(t.device) if got.dim() else got  # a scalar step stays here
        optimizer.state[param] = state


def _copy(
    source: Shard, cut_from: Slicing, target: Shard, cut_into: Slicing, items: list[Item]
) -> None:
    """The entries this member keeps across the change (its own slices of them): copied
    from its old shard (``cut_from``, ``cut_into``: the two shards' :meth:`Shard.slicing`)."""
    manifest, tensors = _outgoing(source.model, source.optimizer, items, cut_from)
    stream = iter(tensors)

    def take(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        t = next(stream)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"a kept entry has shape {tuple(t.shape)} here, {tuple(shape)} wanted")
        return t

    into = _Into.of(target.model, target.optimizer, cut_into)
    for entry in manifest:
        _incoming(entry, into, take)


def _pair(g: EpochGroup, other: int) -> tuple[Any, int, int]:
    """A link to member ``other``, this member's and ``other``'s ranks on it."""
    link = g.peer(other)
    if link is not None:
        return link, g.rank, other
    sub = g.subgroup(sorted([g.rank, other]), "reshard")
    return sub, int(g.rank > other), int(other > g.rank)


def _packs(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into packs of about :data:`PACK_BYTES` (a larger tensor is a
    pack of its own): what one message carries."""
    packs: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if packs[-1] and size + t.numel() * t.element_size() > PACK_BYTES:
            packs.append([])
            size = 0
        packs[-1].append(t)
        size += t.numel() * t.element_size()
    return packs


def send(
    g: EpochGroup,
    dst: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    items: list[Item],
    slicing: Slicing | None = None,
) -> None:
    """Member ``dst``'s ``items`` of this member's ``model`` and ``optimizer`` (split entries
    cut by ``slicing``): a manifest (names, slices, the optimizer's state per parameter:
    shapes and dtypes, or plain values), then the tensors in packs. :func:`receive` on
    ``dst`` takes them."""
    manifest, tensors = _outgoing(model, optimizer, items, slicing or UNSPLIT)
    packs = [
        torch.cat([t.detach().reshape(-1).contiguous().cpu().view(torch.uint8) for t in pack])
        for pack in _packs(tensors)
        if pack
    ]
    head = {"entries": manifest, "packs": [p.numel() for p in packs]}
    text = torch.frombuffer(bytearray(json.dumps(head).encode()), dtype=torch.uint8)
    link, me, _ = _pair(g, dst)
    link.broadcast(torch.tensor([text.numel()], dtype=torch.int64), me)
    link.broadcast(text, me)
    for pack in packs:
        link.broadcast(pack, me)


def receive(
    g: EpochGroup,
    src: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    slicing: Slicing | None = None,
) -> None:
    """What :func:`send` on ``src`` sends, into ``model``'s tensors and ``optimizer``'s
    state (slices where ``slicing`` puts them)."""
    link, _, them = _pair(g, src)
    size = torch.zeros(1, dtype=torch.int64)
    link.broadcast(size, them)
    text = torch.empty(int(size[0]), dtype=torch.uint8)
    link.broadcast(text, them)
    head = json.loads(bytes(text.numpy()))
    sizes = list(head["packs"])
    pack, at = torch.empty(0, dtype=torch.uint8), 0

    def take(shape: list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of the stream (the next pack received when this one is read)."""
        nonlocal pack, at
        if at == pack.numel():
            pack, at = torch.empty(sizes.pop(0), dtype=torch.uint8), 0
            link.broadcast(pack, them)
        n = math.prod(shape) * dtype.itemsize
        out = pack[at : at + n].view(dtype).reshape(shape)
        at += n
        return out

    into = _Into.of(model, optimizer, slicing or UNSPLIT)
    for entry in head["entries"]:
        _incoming(entry, into, take)
    assert at == pack.numel() and not sizes, (at, pack.numel(), sizes)
