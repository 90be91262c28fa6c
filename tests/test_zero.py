"""The sharded optimizer (:mod:`unicron.runtime.zero`): who keeps which share (pure), and
members of real epoch groups (gloo, one thread each) stepping, losing members and taking
shares by name, against one unsharded AdamW bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_transfer import _run_group
from unicron.runtime.group import EpochGroup, EpochOver
from unicron.runtime.reshard import StateLost
from unicron.runtime.zero import Zero, assign, redistribute


def test_every_parameter_has_two_keepers_on_two_nodes_and_the_bytes_are_balanced() -> None:
    sizes = [400, 300, 300, 100, 100, 50, 50, 50]
    nodes = [0, 0, 1, 1]
    o = assign(sizes, nodes)
    for i in range(len(sizes)):
        assert o.owner[i] != o.buddy[i] and nodes[o.owner[i]] != nodes[o.buddy[i]]
    kept = [sum(sizes[i] for i in o.held(r)) for r in range(4)]
    assert sum(kept) == 2 * sum(sizes)
    assert max(kept) - min(kept) <= max(sizes)  # greedy, largest first
    assert assign(sizes, nodes) == o  # pure


def test_one_member_keeps_everything_and_two_keep_everything_each() -> None:
    o = assign([8, 4, 2], [0])
    assert o.owner == o.buddy == (0, 0, 0) and o.held(0) == [0, 1, 2]
    o = assign([8, 4, 2], [0, 0])  # one node: the buddy is the other member
    assert o.held(0) == o.held(1) == [0, 1, 2]
    with pytest.raises(ValueError):
        assign([8], [])


def test_shares_stay_with_their_keepers_and_a_returning_member_gets_its_part_back() -> None:
    """A membership change moves only what it must: member 3 of four lost, every share it did
    not keep stays where it was and each it kept gets one new keeper; member 3 back (holding
    nothing), it takes about its part again, not the whole reshuffle of a fresh plan."""
    sizes = [64, 48, 48, 32, 32, 32, 16, 16, 16, 16, 8, 8]
    four = assign(sizes, [0, 0, 1, 1])

    def keepers(o: Any, of: list[int]) -> list[set[int]]:
        return [{of[k] for k in (o.owner[i], o.buddy[i])} for i in range(len(sizes))]

    before = keepers(four, [0, 1, 2, 3])
    three = assign(sizes, [0, 0, 1], [{k for k in ks if k != 3} for ks in before])
    after = keepers(three, [0, 1, 2])
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert b - {3} <= a, i  # living keepers keep it
        assert len(a) == 2
    moved = sum(sizes[i] for i in range(len(sizes)) if before[i] - {3} != after[i])
    assert moved == sum(sizes[i] for i in range(len(sizes)) if 3 in before[i])
    back = assign(sizes, [0, 0, 1, 1], after)
    part = [sum(sizes[i] for i in back.held(r)) for r in range(4)]
    assert part[3] > 0 and max(part) <= 2 * sum(sizes) / 4 + max(sizes)
    fresh = assign(sizes, [0, 0, 1, 1])
    again = keepers(back, [0, 1, 2, 3])
    stayed = sum(sizes[i] for i in range(len(sizes)) if after[i] <= again[i])
    assert stayed > sum(
        sizes[i] for i in range(len(sizes)) if after[i] <= keepers(fresh, [0, 1, 2, 3])[i]
    )


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 8),
        torch.nn.Linear(8, 3),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _grads(model: torch.nn.Module, step: int) -> None:
    """The step's mean gradient, the same in every member (as the reduce leaves it)."""
    gen = torch.Generator().manual_seed(step)
    model.zero_grad(set_to_none=True)
    model(torch.randn(6, 24, generator=gen)).square().mean().backward()


def _reference(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _model()
    for s in range(steps):
        _grads(model, s)
        opt.step()
    return model, opt


def _steps(zero: Zero, g: EpochGroup, first: int, n: int) -> None:
    for s in range(first, first + n):
        _grads(zero.model, s)
        zero.step(g)


def _state_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items() if s}


def _assert_same(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: Any) -> None:
    for a, b in zip(model.state_dict().values(), ref[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    theirs = _state_by_name(*ref)
    for name, state in _state_by_name(model, opt).items():
        for k, v in state.items():
            assert torch.equal(v, theirs[name][k]), (name, k)


def test_sharded_steps_a_lost_member_and_a_joiner_keep_the_unsharded_bits() -> None:
    """Four members step 3 times with the optimizer's state sharded (each keeps half of it);
    member 1 is lost: the three left take its shares by name from the buddies and step twice;
    a fresh member joins and takes the parameters and its shares. Every member's parameters
    and every kept state are AdamW's unsharded ones, bit for bit."""
    built = [_model() for _ in range(4)]
    zeros = [Zero(m, o) for m, o in built]

    def first(g: EpochGroup) -> int:
        z = zeros[g.rank]
        assert (
            redistribute(z, g, g, nodes=[0, 0, 1, 1], holder=True) == []
        )  # all at step 0: nothing moves
        _steps(z, g, 0, 3)
        return len(_state_by_name(z.model, z.optimizer))

    kept = _run_group(4, first)
    params = len(zeros[0].names)
    assert all(isinstance(k, int) for k in kept), kept
    assert sum(kept) == 2 * params and max(kept) < params  # two keepers each, none keeps all
    ref = _reference(3)
    for m, o in built:
        _assert_same(m, o, ref)

    left = [zeros[0], zeros[2], zeros[3]]  # member 1 lost

    def second(g: EpochGroup) -> list[int]:
        z = left[g.rank]
        got = redistribute(z, g, g, nodes=[0, 1, 1], holder=True)
        _steps(z, g, 3, 2)
        assert set(_state_by_name(z.model, z.optimizer)) == z.held()
        return got

    got = _run_group(3, second)
    assert all(isinstance(x, list) for x in got), got
    assert any(got)  # shares of the lost member moved
    ref = _reference(5)
    for z in left:
        _assert_same(z.model, z.optimizer, ref)

    fresh = Zero(*_model())
    group = [*left, fresh]

    def third(g: EpochGroup) -> list[int]:
        z = group[g.rank]
        got = redistribute(z, g, g, nodes=[0, 1, 1, 0], holder=g.rank < 3)
        _steps(z, g, 5, 1)
        return got

    got = _run_group(4, third)
    assert all(isinstance(x, list) for x in got), got
    assert got[3]  # the joiner received the parameters and its shares
    ref = _reference(6)
    for z in group:
        _assert_same(z.model, z.optimizer, ref)


def test_a_share_whose_two_keepers_are_lost_is_lost_for_every_member() -> None:
    built = [_model() for _ in range(4)]
    zeros = [Zero(m, o) for m, o in built]

    def first(g: EpochGroup) -> None:
        redistribute(zeros[g.rank], g, g, nodes=[0, 0, 0, 0], holder=True)
        _steps(zeros[g.rank], g, 0, 2)

    assert _run_group(4, first) == [None] * 4
    owners = zeros[0].owners
    assert owners is not None
    gone = {owners.owner[0], owners.buddy[0]}  # both keepers of the largest parameter
    left = [z for r, z in enumerate(zeros) if r not in gone]

    def second(g: EpochGroup) -> None:
        redistribute(left[g.rank], g, g, nodes=[0] * len(left), holder=True)

    results = _run_group(len(left), second)
    assert all(isinstance(x, StateLost) for x in results), results


def test_a_gather_gives_the_writer_every_share_and_drop_takes_them_back() -> None:
    zeros = [Zero(*_model()) for _ in range(3)]

    def body(g: EpochGroup) -> tuple[int, int]:
        z = zeros[g.rank]
        redistribute(z, g, g, nodes=[0, 1, 2], holder=True)
        _steps(z, g, 0, 2)
        z.gather(g, g, writer=g.rank == 0)
        whole = len(_state_by_name(z.model, z.optimizer))
        z.drop()
        return whole, len(_state_by_name(z.model, z.optimizer))

    results = _run_group(3, body)
    params = len(zeros[0].names)
    assert results[0] == (params, len(zeros[0].held()))
    assert all(isinstance(r, tuple) and r[0] == r[1] < params for r in results[1:]), results
    ref = _reference(2)
    _assert_same(zeros[0].model, zeros[0].optimizer, ref)


def test_an_update_whose_broadcast_is_cut_is_completed_from_the_keepers() -> None:
    """Member 2 is lost after the vote, before it sends the new values of the parameters it
    owns: the others' broadcast is cut (the epoch ends under it), the step is committed all
    the same, and the next epoch brings each member the values it missed from their buddies."""
    zeros = [Zero(*_model()) for _ in range(3)]

    def first(g: EpochGroup) -> None:
        redistribute(zeros[g.rank], g, g, nodes=[0, 1, 2], holder=True)
        _steps(zeros[g.rank], g, 0, 2)

    assert _run_group(3, first) == [None] * 3

    def cut(g: EpochGroup) -> Any:
        z = zeros[g.rank]
        redistribute(z, g, g, nodes=[0, 1, 2], holder=True)
        if g.rank == 2:
            return None  # lost before its broadcast
        try:
            _steps(z, g, 2, 1)
        except Exception as exc:
            return exc
        return "not cut"

    results = _run_group(3, cut, supersede=True)
    # the epoch superseded, or the lost member's connection closed (a CollectiveError)
    assert all(isinstance(x, EpochOver) for x in results[:2]) and results[2] is None, results
    owners = zeros[0].owners
    assert owners is not None
    owned_by_2 = {zeros[0].names[i] for i, o in enumerate(owners.owner) if o == 2}
    for z in zeros[:2]:
        assert z.stale == owned_by_2 - z.held() and z.stale  # missed, not computed here
    left = zeros[:2]

    def heal(g: EpochGroup) -> None:
        redistribute(left[g.rank], g, g, nodes=[0, 1], holder=True)

    assert _run_group(2, heal) == [None, None]
    ref = _reference(3)
    for z in left:
        assert z.stale == set()
        _assert_same(z.model, z.optimizer, ref)
