"""The ledger exchange's state moves (:mod:`unicron.runtime.transition`), driven in one
process with the group and the move itself stood in for: a member whose tensors a move
writes in place no longer claims its old state when the move is cut (found in review: a
needer at an older step, its holder lost mid-transfer, went on claiming that step with a
mixture of both, and the next epoch trained on it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from unicron.runtime import transition
from unicron.runtime.group import EpochOver
from unicron.runtime.transfer import layout, model_tensors


class _Group:
    """The epoch's group of two as member 1 sees it: member 0 holds step 5."""

    def __init__(self, theirs: list[int]) -> None:
        self.theirs = theirs
        self.world = 2

    def allgather(self, mine: torch.Tensor, meanwhile: Any = None) -> list[torch.Tensor]:
        if meanwhile is not None:
            meanwhile()
        return [torch.tensor(self.theirs), mine]


def _runner(model: torch.nn.Module) -> SimpleNamespace:
    """Member 1 of two data-parallel replicas, holding step 4 (it missed the last commit)."""
    return SimpleNamespace(
        step=4, has_state=True, M=2, R=1, place=0, zero=None, old=None, device=None,
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        store=SimpleNamespace(check=lambda keys: True),
        ctx=SimpleNamespace(task="t", node=1, checkpoint=None),
        mb=SimpleNamespace(done=set()), data=SimpleNamespace(state=lambda: (-1, -1)),
        dp=SimpleNamespace(rank=1),
    )  # fmt: skip


def test_a_needer_whose_transfer_is_cut_holds_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(3, 2)
    r = _runner(model)
    holder = [5, 0, 0, -1, -1, 0, 0, layout(model_tensors(model)), -1, 0]

    def cut(*_: Any, **__: Any) -> None:
        raise EpochOver("the holder was lost mid-transfer")

    monkeypatch.setattr(transition, "transfer", cut)
    with pytest.raises(EpochOver):
        transition.sync(r, _Group(holder))  # type: ignore[arg-type]
    assert r.has_state is False  # its tensors may be half step 4, half step 5
