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
from typing import Any

import torch

from unicron.parallel import PipelineParallel
from unicron.runtime.group import EpochGroup

__all__ = [
    "PACK_BYTES",
    "Item",
    "Move",
    "Shard",
    "StateLost",
    "digest",
    "exchange",
    "plan",
    "receive",
    "reshard",
    "send",
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


@dataclass
class Shard:
    """One build of this rank's part of the model for a layout: its modules, its optimizer,
    its pipeline stage (:attr:`pipe`: stage ``pipe.stage`` of ``pipe.stages``). Built by the
    worker from the script's model, or by the script's ``rebuild`` for another layout."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pipe: PipelineParallel

    def entries(self) -> dict[int, str]:
        """The state-dict entries' names by :func:`digest`."""
        return {digest(name): name for name in self.model.state_dict()}


@dataclass(frozen=True)
class Move:
    """Entries that member :attr:`src` sends to member :attr:`dst` (digests, sorted)."""

    src: int
    dst: int
    keys: tuple[int, ...]


def plan(
    offers: Sequence[set[int]], needs: Sequence[set[int]], tp_ranks: Sequence[int]
) -> tuple[list[Move], list[int]]:
    """The moves that give every member the entries it ``needs`` from those that ``offers``
    them (only members at the newest committed step offer; a member at another
    tensor-parallel rank holds other slices under the same names), in the order they run,
    and the needed entries nobody offers (digests; non-empty: the state is lost). Pure."""
    moves: dict[tuple[int, int], list[int]] = {}
    missing: set[int] = set()
    for dst, need in enumerate(needs):
        for key in sorted(need - offers[dst]):
            src = next(
                (m for m, o in enumerate(offers) if key in o and tp_ranks[m] == tp_ranks[dst]),
                None,
            )
            if src is None:
                missing.add(key)
            else:
                moves.setdefault((src, dst), []).append(key)
    ordered = [Move(s, d, tuple(keys)) for (s, d), keys in sorted(moves.items())]
    return ordered, sorted(missing)


def reshard(
    g: EpochGroup,
    *,
    source: Shard | None,
    target: Shard,
    tp_rank: int,
) -> None:
    """Fill ``target`` (this member's new shard) from ``source`` (the shard holding the
    committed state here; ``None``: this member holds none) and from the other members'
    sources. Every member of ``g`` calls it in the same epoch. Raises :class:`StateLost` when
    some entry is held by nobody (the caller falls back to the checkpoint) and ``EpochOver``
    when the epoch ends under it."""
    have = source.entries() if source is not None else {}
    want = target.entries()
    rows = exchange(g, [tp_rank, len(have), *sorted(have), *sorted(want)])
    offers = [set(r[2 : 2 + r[1]]) for r in rows]
    needs = [set(r[2 + r[1] :]) for r in rows]
    moves, missing = plan(offers, needs, [r[0] for r in rows])
    if missing:
        raise StateLost(f"{len(missing)} entries of the new layout's state are held by nobody")
    if source is not None:
        _copy(source, target, [have[k] for k in sorted(want.keys() & have.keys())])
    for move in moves:
        if g.rank == move.src:
            assert source is not None
            items = [Item(have[k], value=True, state=True) for k in move.keys]
            send(g, move.dst, source.model, source.optimizer, items)
        elif g.rank == move.dst:
            receive(g, move.src, target.model, target.optimizer)


@dataclass(frozen=True)
class Item:
    """What a move carries of the state-dict entry :attr:`name`: its tensor (``value``), the
    optimizer's state of that parameter (``state``, where there is one), or both."""

    name: str
    value: bool
    state: bool


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


def _copy(source: Shard, target: Shard, names: list[str]) -> None:
    """The entries this member keeps across the change: copied from its old shard."""
    sd, td = source.model.state_dict(), target.model.state_dict()
    states = state_of(source.model, source.optimizer)
    params = dict(target.model.named_parameters())
    with torch.no_grad():
        for name in names:
            td[name].copy_(sd[name])
            if name in states and name in params:
                target.optimizer.state[params[name]] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in states[name].items()
                }


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
) -> None:
    """Member ``dst``'s ``items`` of this member's ``model`` and ``optimizer``: a manifest
    (names, the optimizer's state per parameter: shapes and dtypes, or plain values), then
    the tensors in packs. :func:`receive` on ``dst`` takes them."""
    sd, states = model.state_dict(), state_of(model, optimizer)
    tensors: list[torch.Tensor] = []
    manifest: list[dict[str, Any]] = []
    for item in items:
        entry: dict[str, Any] = {"name": item.name, "value": item.value, "state": {}}
        if item.value:
            tensors.append(sd[item.name])
        for k, v in sorted(states.get(item.name, {}).items() if item.state else ()):
            if isinstance(v, torch.Tensor):
                entry["state"][k] = [list(v.shape), str(v.dtype).removeprefix("torch.")]
                tensors.append(v)
            else:
                entry["state"][k] = {"value": v}
        manifest.append(entry)
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
    g: EpochGroup, src: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """What :func:`send` on ``src`` sends, into ``model``'s tensors and ``optimizer``'s
    state."""
    link, _, them = _pair(g, src)
    size = torch.zeros(1, dtype=torch.int64)
    link.broadcast(size, them)
    text = torch.empty(int(size[0]), dtype=torch.uint8)
    link.broadcast(text, them)
    head = json.loads(bytes(text.numpy()))
    sizes = list(head["packs"])
    td, params = model.state_dict(), dict(model.named_parameters())
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

    with torch.no_grad():
        for entry in head["entries"]:
            t = td[entry["name"]]
            if entry["value"]:
                t.copy_(take(t.shape, t.dtype))
            state: dict[str, Any] = {}
            for k, spec in entry["state"].items():
                if isinstance(spec, dict):
                    state[k] = spec["value"]
                    continue
                shape, dtype = spec
                got = take(shape, getattr(torch, dtype)).clone()
                state[k] = got.to(t.device) if got.dim() else got  # a scalar step stays here
            if state:
                optimizer.state[params[entry["name"]]] = state
    assert at == pack.numel() and not sizes, (at, pack.numel(), sizes)
