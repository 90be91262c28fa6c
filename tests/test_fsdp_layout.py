"""FSDP inside a replica, the pure parts: the rounds of a replica's micro-batches
(:mod:`unicron.runtime.rounds`), the task setting and its geometry (a replica stage's ranks
on one node are tensor-parallel x FSDP), and what a worker is told (its FSDP place, while
its tensor-parallel handle stays one rank; a cluster's assignment: ``tests/test_cluster_plan.
py``). End to end: ``tests/test_fsdp_e2e.py``."""

from __future__ import annotations

from typing import Any

import pytest

from unicron import parallel
from unicron.control.taskspec import TaskSpec
from unicron.protocol import ENV_FSDP, ENV_TP, ENV_TP_RANK
from unicron.runtime.rounds import rounds


def test_a_replicas_micro_batches_go_round_by_round_one_a_place() -> None:
    assert rounds([0, 1, 2, 3], 2, 0) == [(0, (0, 1)), (2, (2, 3))]
    assert rounds([0, 1, 2, 3], 2, 1) == [(1, (0, 1)), (3, (2, 3))]
    # a short round: the extra places compute its first micro-batch again, not added
    assert rounds([4, 5, 6], 2, 1) == [(5, (4, 5)), (6, (6, None))]
    assert rounds([7], 4, 3) == [(7, (7, None, None, None))]
    assert rounds([], 2, 0) == []
    # every place sees the same rounds, and each real micro-batch is some place's
    left = [2, 3, 5, 8, 9]
    views = [rounds(left, 3, p) for p in range(3)]
    assert len({tuple(r for _, r in v) for v in views}) == 1
    assert sorted(m for _, r in views[0] for m in r if m is not None) == left


def _spec(**kw: Any) -> TaskSpec:
    return TaskSpec.model_validate({"name": "t", "script": "t.py", **kw})


def test_an_fsdp_replica_is_a_block_of_ranks_on_one_node() -> None:
    spec = _spec(fsdp=2, workers={"min": 2, "max": 6})
    assert spec.block == 2 and spec.replica_ranks == 2 and spec.smallest_replica == 2
    assert spec.layouts == ((2, 1),)  # the replica's ranks of a stage: 2, on one node
    with pytest.raises(ValueError, match="multiples of tp x fsdp x pp"):
        _spec(fsdp=2, workers={"min": 1, "max": 4})
    for other, said in (({"tp": 2}, "tp"), ({"pp": 2}, "pp"), ({"zero": 1}, "zero 1")):
        with pytest.raises(ValueError, match=f"fsdp 2 with {said}: an FSDP replica"):
            _spec(fsdp=2, workers={"min": 4, "max": 8}, **other)


def test_a_worker_of_an_fsdp_task_gets_its_place_and_a_tensor_parallel_rank_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel, "_TP", None)
    monkeypatch.setattr(parallel, "_FSDP", None)
    for name, value in ((ENV_TP, "2"), (ENV_FSDP, "2"), (ENV_TP_RANK, "1")):
        monkeypatch.setenv(name, value)
    tp, fsdp = parallel.tensor_parallel(), parallel.fsdp_parallel()
    assert (tp.rank, tp.size) == (0, 1)  # the script's layers are not split
    assert (fsdp.rank, fsdp.size) == (1, 2)
    assert parallel.layouts() == ((1, 1),)
