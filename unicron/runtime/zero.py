"""Sharded optimizer state across replicas: ZeRO-1 with a second copy of every share.

With ``zero: 1`` (``unicron run --zero 1``) the optimizer's state of a place (the shard of
the model one rank of every replica holds) is not kept by every replica: each parameter's
state is kept by two members of the place's data-parallel group, its *owner* and its
*buddy*, on another node where the group spans more than one (:func:`assign`: balanced by
bytes, a pure function of the parameters' sizes, the members' nodes and who keeps each share
now, so that a membership change moves only what it must). On a step both
compute the parameter's update from the reduced gradient, the owner sends the new value to
the others (one broadcast per member of the values it owns), and the others skip that
parameter in their optimizer (its gradient is ``None`` there). A rank's optimizer memory is
``2/D`` of the state instead of all of it (D replicas; with two, nothing is saved).

Why two: a lost rank's share of the state exists nowhere else in plain ZeRO-1 (Megatron's
distributed optimizer loses the job); here the buddy computed every update of it and holds it
at the committed step, so a membership change moves shares by name from whichever holder
lives (:func:`redistribute`, over :mod:`unicron.runtime.reshard`'s moves) and the run goes on
with the failure-free update bit for bit: each parameter's update is the same computation on
the same gradient as without sharding, whoever computes it. Only when both holders of a share
are lost is the state lost (:class:`~unicron.runtime.reshard.StateLost`: the checkpoint).

Called by the worker (:mod:`unicron.worker`): :meth:`Zero.step` in the commit, after the
vote; :func:`redistribute` in the ledger exchange of every epoch
(:mod:`unicron.runtime.transition`); :meth:`Zero.gather` before a checkpoint (the writer
gets every share; the files are the unsharded format) and :meth:`Zero.drop` after it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from unicron.runtime.group import EpochGroup
from unicron.runtime.reshard import Item, StateLost, digest, exchange, plan, receive, send
from unicron.runtime.reshard import state_of as _state_of

__all__ = ["Owners", "Zero", "assign", "redistribute"]


@dataclass(frozen=True)
class Owners:
    """Who keeps each parameter's optimizer state in one epoch (members of a place's
    data-parallel group, by their rank in it)."""

    owner: tuple[int, ...]
    """per parameter: the member that computes its update and sends the new value"""
    buddy: tuple[int, ...]
    """per parameter: the second member that computes its update (the owner when alone)"""

    def held(self, rank: int) -> list[int]:
        """The parameters whose state member ``rank`` keeps (owner or buddy)."""
        return [i for i, (o, b) in enumerate(zip(self.owner, self.buddy, strict=True))
                if rank in (o, b)]  # fmt: skip


def assign(
    sizes: Sequence[int],
    nodes: Sequence[int],
    keepers: Sequence[Collection[int]] | None = None,
) -> Owners:
    """The owners and buddies of parameters of ``sizes`` bytes among members on ``nodes``
    (per member, its node), preferring each parameter's current ``keepers`` (the members
    that hold its state now) so that a membership change moves only what it must: a share
    whose keepers live stays with them, unless one already keeps more than its part (twice
    the state over the members, plus the largest parameter), so that a returning member
    gets its part back. Largest first; a parameter without a current keeper goes to the
    member that keeps the fewest bytes so far (the lowest rank on ties), its buddy to the
    least loaded member on another node, else to the least loaded other member. Pure."""
    d = len(nodes)
    if d == 0:
        raise ValueError("a data-parallel group of no member")
    load = [0] * d
    cap = (2 if d > 1 else 1) * sum(sizes) / d + max(sizes, default=0)
    owner, buddy = [0] * len(sizes), [0] * len(sizes)

    def least(pool: Sequence[int]) -> int:
        return min(pool, key=lambda r: (load[r], r))

    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        now = [r for r in (keepers[i] if keepers else ()) if load[r] + sizes[i] <= cap]
        o = least(now) if now else least(range(d))
        others = [r for r in range(d) if r != o]
        pool = [r for r in others if nodes[r] != nodes[o]] or others
        stay = [r for r in now if r in pool]
        b = (least(stay) if stay else least(pool)) if pool else o
        load[o] += sizes[i]
        if b != o:
            load[b] += sizes[i]
        owner[i], buddy[i] = o, b
    return Owners(tuple(owner), tuple(buddy))


def _value_key(name: str) -> int:
    return digest(name)


def _state_key(name: str) -> int:
    return digest(f"optimizer state of {name}")


class Zero:
    """One worker's sharded optimizer over ``model``'s trainable parameters. Made by the
    worker when it adopts a shard (:meth:`unicron.worker._Runner._adopt`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.owners: Owners | None = None
        """this epoch's owners (:func:`redistribute` sets them)"""
        self.rank = 0
        """this member's rank in its place's data-parallel group, this epoch"""
        self.stale: set[str] = set()
        """parameters whose value is not the committed step's here: an update's broadcast
        that an epoch's end cut (the next ledger exchange brings them)"""

    def begin(self, nodes: Sequence[int], rank: int) -> None:
        """A new epoch whose state comes from the checkpoint (every member holds all of it):
        its owners among the place's members on ``nodes`` (:func:`assign`), this member being
        ``rank`` of them. :func:`redistribute` assigns them otherwise."""
        self.owners, self.rank = assign(self.sizes, nodes), rank

    def held(self) -> set[str]:
        """The parameters whose optimizer state this member keeps this epoch."""
        assert self.owners is not None
        return {self.names[i] for i in self.owners.held(self.rank)}

    def step(self, dp: EpochGroup, sent: Callable[[], None] | None = None) -> None:
        """The optimizer step of a committed step, gradients reduced in every ``.grad``:
        update the parameters this member keeps, then every owner broadcasts the new values
        of its parameters over ``dp``. An ``EpochOver`` on the way leaves the parameters not
        received yet in :attr:`stale` (the step is committed: the holders of each value have
        it) and is raised. ``sent`` is called once this member's own broadcast is out (an
        injected ``crash:...,phase=update`` fires there)."""
        assert self.owners is not None
        held = set(self.owners.held(self.rank))
        for i, p in enumerate(self.params):
            if i not in held:
                p.grad = None  # the optimizer skips a parameter without a gradient
        self.optimizer.step()
        self.stale = {self.names[i] for i in range(len(self.params)) if i not in held}
        for k in range(dp.world):
            ids = [i for i, o in enumerate(self.owners.owner) if o == k]
            if not ids:
                if k == self.rank and sent is not None:
                    sent()  # nothing of its own to send
                continue
            with torch.no_grad():
                if k == self.rank:
                    flat = torch.cat([self._bytes(self.params[i]) for i in ids])
                else:
                    n = sum(self.sizes[i] for i in ids)
                    flat = torch.empty(n, dtype=torch.uint8, device=self.params[ids[0]].device)
                dp.broadcast(flat, k)
                if k == self.rank:
                    if sent is not None:
                        sent()
                    continue
                at = 0
                for i in ids:
                    size = self.sizes[i]
                    if i not in held:  # a buddy computed the same value already
                        self._bytes(self.params[i]).copy_(flat[at : at + size])
                        self.stale.discard(self.names[i])
                    at += size

    @staticmethod
    def _bytes(p: torch.Tensor) -> torch.Tensor:
        """``p``'s storage as bytes (a view: writing it writes ``p``)."""
        return p.detach().reshape(-1).view(torch.uint8)

    def drop(self) -> None:
        """Forget the optimizer's state of the parameters this member does not keep (after
        a checkpoint's gather, a load of the whole state, a change of owners)."""
        held = self.held()
        for name, p in zip(self.names, self.params, strict=True):
            if name not in held:
                self.optimizer.state.pop(p, None)

    def gather(self, dp: EpochGroup, everyone: EpochGroup, writer: bool) -> None:
        """Before a checkpoint: every share of the state to the ``writer`` of this place (the
        member of replica 0), from their holders; :meth:`drop` after the write. Raises
        :class:`StateLost` if a share has no holder (cannot happen between two transitions)."""
        _move(self, dp, everyone, values=set(), states=True, writer=writer, nodes=None)


def redistribute(
    zero: Zero, dp: EpochGroup, everyone: EpochGroup, *, nodes: Sequence[int], holder: bool
) -> list[int]:
    """A new epoch of the place's members on ``nodes``: its owners (:func:`assign`, from the
    shares the members hold now) get their shares of the optimizer's state, and every member
    the committed parameters it lacks (a restarted member all of them; one whose update's
    broadcast was cut, :attr:`Zero.stale`), by name from the members that hold them:
    ``holder`` says this member is at the committed step the ledger exchange agreed on (else
    it offers nothing and takes everything). Every member of the epoch calls it
    (``everyone``): when some place's state is held by nobody, every member raises
    :class:`StateLost` (the checkpoint, for all places alike). Returns the members this one
    received from."""
    zero.rank = dp.rank
    values = set(zero.model.state_dict()) - zero.stale if holder else set()
    got = _move(zero, dp, everyone, values=values, states=holder, writer=False, nodes=nodes)
    zero.stale = set()
    zero.drop()
    return got


def _move(
    zero: Zero,
    dp: EpochGroup,
    everyone: EpochGroup,
    *,
    values: set[str],
    states: bool,
    writer: bool,
    nodes: Sequence[int] | None,
) -> list[int]:
    """The moves of :func:`redistribute` (``nodes``: the owners are assigned anew from the
    offers) and :meth:`Zero.gather` (``nodes`` None; the ``writer`` needs every state) over
    ``dp``. Each member offers the entries ``values`` (held at the committed step) and, if
    ``states``, the optimizer states it has; from the offers every member knows what every
    other needs: the entries it does not offer, and the states it keeps this epoch that it
    does not offer. A state is needed only where states exist (a stateful optimizer past its
    first step: then every kept parameter has one). One flag per member over ``everyone``
    says whether anything needed is held by nobody (then every member raises
    :class:`StateLost`). Returns the members this one received from."""
    has = set(_state_of(zero.model, zero.optimizer)) if states else set()
    offers = sorted({_value_key(n) for n in values} | {_state_key(n) for n in has})
    rows = exchange(dp, [int(writer), len(offers), *offers])
    offered = [set(r[2 : 2 + r[1]]) for r in rows]
    if nodes is not None:
        keepers = [{m for m, o in enumerate(offered) if _state_key(n) in o} for n in zero.names]
        zero.owners = assign(zero.sizes, nodes, keepers)
    assert zero.owners is not None
    state_keys = {_state_key(n) for n in zero.names}
    anywhere = {k for o in offered for k in o if k in state_keys}
    value_keys = {_value_key(n) for n in zero.model.state_dict()}
    needs = []
    for m, (r, o) in enumerate(zip(rows, offered, strict=True)):
        if nodes is None:  # a checkpoint's gather: the writer takes every share
            needs.append(anywhere - o if r[0] else set())
            continue
        kept = {_state_key(zero.names[i]) for i in zero.owners.held(m)}
        needs.append((value_keys - o) | ((kept if anywhere else set()) - o))
    moves, missing = plan(offered, needs, [(1, 0)] * len(rows))
    lost = torch.tensor([1 if missing else 0], dtype=torch.int64)
    if any(int(t.item()) for t in everyone.allgather(lost)):
        raise StateLost(f"{len(missing)} entries of a place's state are held by nobody")
    names = {_value_key(n): n for n in zero.model.state_dict()}
    names |= {_state_key(n): n for n in zero.names}
    got: list[int] = []
    for move in moves:
        if dp.rank == move.src:
            items: dict[str, Item] = {}
            for k in move.keys:
                n = names[k]
                old = items.get(n, Item(n, value=False, state=False))
                items[n] = Item(n, old.value or k == _value_key(n), old.state or k == _state_key(n))
            send(dp, move.dst, zero.model, zero.optimizer, list(items.values()))
        elif dp.rank == move.dst:
            receive(dp, move.src, zero.model, zero.optimizer)
            got.append(move.src)
    return got
