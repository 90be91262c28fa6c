"""Replicas of several ranks (tensor and pipeline parallel): the parts, the grouping, the
decisions.

The layers of :mod:`unicron.parallel` split a model the way Megatron-LM does and compute the
unsplit model's function (two ranks in two threads over a real gloo group); a replica's
replicated parameters get the same gradient on every rank, bit for bit; two pipeline stages
compute the whole model's loss and gradients bit for bit, the loss coming back to the
first. The coordinator forms epochs of whole replicas: a replica that lost a rank sits out,
its living rank waits (not killed, its last step no hang), and comes back whole with its
restarted rank. The end to end runs are in ``tests/test_model_parallel_e2e.py``.
"""

from __future__ import annotations

import datetime
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from unicron import messages as M
from unicron.control import replicas
from unicron.control.coordinator import Coordinator, CoordinatorSettings, TaskState
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog
from unicron.control.slots import SlotTable
from unicron.detect.classify import verdict_for_kind
from unicron.detect.monitor import MonitorSettings, StepMonitor
from unicron.parallel import (
    SCHEDULES,
    PairLink,
    PipelineParallel,
    TensorParallel,
    schedule,
    split_dims,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama_parallel

CFG = llama_parallel.LlamaConfig(layers=1, dim=32, heads=4, kv_heads=2, hidden=64, seq_len=16)


def _ranks(tp: int, body: Any) -> list[Any]:
    """Run ``body(tp_handle)`` on ``tp`` threads, each a rank of one gloo group."""
    store = dist.HashStore()
    out: list[Any] = [None] * tp
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, tp, datetime.timedelta(seconds=30))
            handle = TensorParallel(r, tp)
            handle.bind_epoch(lambda t: pg.allreduce([t]).wait(), RuntimeError)
            out[r] = body(handle)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


_BUILD = threading.Lock()  # the threads draw from one global RNG: one build at a time


def _step(tp: TensorParallel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with _BUILD:
        model, _, data = llama_parallel.build(tp, seed=3, cfg=CFG)
    x, y = data[0]
    batch = (torch.stack([x, data[1][0]]), torch.stack([y, data[1][1]]))
    loss = llama_parallel.loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}  # type: ignore[union-attr]


def test_a_split_model_computes_the_whole_models_function() -> None:
    (loss1, grads1) = _step(TensorParallel(0, 1))
    shards = _ranks(2, _step)
    for r, (loss, grads) in enumerate(shards):
        assert torch.allclose(loss, loss1, rtol=1e-5), (loss, loss1)
        for name, g in grads.items():
            whole = grads1[name]
            if g.shape == whole.shape:  # replicated: the whole gradient
                assert torch.allclose(g, whole, rtol=1e-4, atol=1e-6), name
                continue
            split = 0 if name.endswith((".q.weight", ".k.weight", ".v.weight", ".gate.weight",
                                        ".up.weight")) else 1  # fmt: skip
            part = whole.chunk(2, dim=split)[r]
            assert torch.allclose(g, part, rtol=1e-4, atol=1e-6), name
    # the replicated parameters' gradients agree bit for bit across the replica's ranks
    (_, a), (_, b) = shards
    same = [n for n in a if a[n].shape == b[n].shape and n.startswith(("tok", "norm", "head"))]
    assert same and all(torch.equal(a[n], b[n]) for n in same)


def _stage_step(pp: PipelineParallel) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = llama_parallel.LlamaConfig(layers=2, dim=32, heads=4, kv_heads=2, hidden=64,
                                     seq_len=16)  # fmt: skip
    with _BUILD:
        model, _, data = llama_parallel.build(pp.tp, seed=3, cfg=cfg, pp=pp)
    x, y = data[0]
    batch = (torch.stack([x, data[1][0]]), torch.stack([y, data[1][1]]))
    loss = llama_parallel.loss_fn(model, batch)
    if pp.last:
        pp.loss = float(loss.detach())  # the worker does this before the backward pass
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}  # type: ignore[union-attr]
    return float(loss.detach()), grads


def test_two_pipeline_stages_compute_the_whole_model_bit_for_bit() -> None:
    whole_loss, whole = _stage_step(PipelineParallel(0, 1, TensorParallel(0, 1)))
    store = dist.HashStore()
    out: list[Any] = [None, None]

    def stage(s: int) -> None:
        pg = dist.ProcessGroupGloo(store, s, 2, datetime.timedelta(seconds=30))

        def link(t: torch.Tensor, src: int) -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            pg.broadcast([t], opts).wait()

        pp = PipelineParallel(s, 2, TensorParallel(0, 1))
        pair = PairLink(link, s)
        pp.bind_epoch(pair if s == 1 else None, pair if s == 0 else None, RuntimeError)
        out[s] = _stage_step(pp)

    threads = [threading.Thread(target=stage, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (loss0, grads0), (loss1, grads1) = out
    assert loss0 == loss1 == whole_loss  # the first stage learns the loss with the gradient
    # the blocks are named by their place in the whole model: stage 1 holds blocks.1, the
    # name the layout change moves its state by (unicron.runtime.reshard)
    assert sorted([*grads0, *grads1]) == sorted(whole)
    assert any(n.startswith("blocks.1.") for n in grads1)
    for name, g in [*grads0.items(), *grads1.items()]:
        assert torch.equal(g, whole[name]), name


def test_a_failed_sum_breaks_the_attempt_and_later_sums_are_skipped() -> None:
    tp = TensorParallel(1, 2)
    calls = []

    def fail(t: torch.Tensor) -> None:
        calls.append(t)
        raise RuntimeError("Connection closed by peer")

    tp.bind_epoch(fail, RuntimeError)
    x = torch.ones(3)
    assert torch.equal(tp.all_reduce(x), x) and isinstance(tp.broken, RuntimeError)
    assert tp.all_reduce(x) is x and len(calls) == 1  # skipped once broken
    tp.reset()
    assert tp.broken is None
    with pytest.raises(ValueError, match="not divisible"):
        tp.shard(6, "heads")  # fine
        TensorParallel(0, 4).shard(6, "heads")


def test_without_a_group_a_split_layer_says_how_to_run_it() -> None:
    with pytest.raises(RuntimeError, match="unicron run --tp"):
        TensorParallel(0, 2).all_reduce(torch.ones(2))


# -- the grouping ------------------------------------------------------------------------------
def test_replicas_are_groups_of_tp_slots_of_one_node_in_slot_order() -> None:
    table = SlotTable({0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1})
    tp2 = (2, 1)
    assert replicas.group_of(table, 1, tp2) == (0, 1)
    assert replicas.group_of(table, 3, tp2) == (2, 3)
    assert replicas.group_of(table, 6, tp2) == (6,)  # node 1's third slot: never whole
    assert [replicas.place(table, s, tp2) for s in range(7)] == [0, 1, 0, 1, 0, 1, 0]
    assert replicas.whole(table, [2, 3, 0, 4, 5, 6], tp2) == (2, 3, 4, 5)
    assert replicas.whole(table, [3, 1, 0, 2], tp2) == (2, 3, 0, 1)  # each in place order
    assert replicas.whole(table, [0, 2, 4], (1, 1)) == (0, 2, 4)
    # a node holding whole replicas keeps them: tp 2 x pp 2 on 4 slots of one node
    assert replicas.groups({s: 0 for s in range(8)}, (2, 2)) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_a_replicas_stages_span_nodes_where_no_node_holds_one() -> None:
    """pp stages of tp slots of one node each: a tensor-parallel group never spans nodes."""
    # four nodes of two slots, tp 2 x pp 2: each replica is two nodes, a stage on each
    nodes = {s: s // 2 for s in range(8)}
    assert replicas.groups(nodes, (2, 2)) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # four nodes of one slot, pp 2: a stage per node
    assert replicas.groups({s: s for s in range(4)}, (1, 2)) == ((0, 1), (2, 3))
    # two nodes of three, tp 2 x pp 2: a block per node, and one slot of each never whole
    table = SlotTable({0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1})
    assert replicas.groups({k: s.node for k, s in table.items()}, (2, 2)) == (
        (0, 1, 3, 4), (2,), (5,)
    )  # fmt: skip
    assert replicas.place(table, 3, (2, 2)) == 2  # stage 1, tensor-parallel rank 0
    assert replicas.whole(table, [3, 4, 0, 1, 2], (2, 2)) == (0, 1, 3, 4)
    # slots added later (higher numbers) never move an earlier replica's slots
    grown = {**nodes, 8: 0, 9: 0, 10: 2, 11: 2}
    assert replicas.groups(grown, (2, 2))[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replicas.places(grown, (2, 2))[10] == 2
    # a slot completing a node's short block: that block comes after every whole one
    odd = {**nodes, 8: 4, 9: 5, 10: 5, 11: 4}
    assert replicas.groups(odd, (2, 2))[:3] == ((0, 1, 2, 3), (4, 5, 6, 7), (9, 10, 8, 11))
    # an odd block out: three nodes of two at pp 2 leave node 2's block short
    assert replicas.groups({s: s // 2 for s in range(6)}, (2, 2)) == ((0, 1, 2, 3), (4, 5))


def _coordinator(tmp: Path, monitor: StepMonitor | None = None) -> Coordinator:
    c = Coordinator(
        task="t",
        slots={0: 0, 1: 0, 2: 0, 3: 0},
        events=EventLog(tmp / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(replica_ranks=2, min_workers=2),
        monitor=monitor,
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(4)], 0.0)
    assert c.epoch == 1 and c.members == (0, 1, 2, 3)
    return c


def test_a_script_that_fails_on_every_rank_every_time_fails_the_task(tmp_path: Path) -> None:
    """Found with a model missing its forward under ``--tp 2``: every rank raised the
    script's own error at its first step, every restart; each slot was excluded past its
    restart limit, passed its health probe, was readmitted and failed again, for as long as
    anyone watched. Now such slots are excluded for good (a probe cannot mend a script) and
    the task fails with the script's error once none can come back."""
    c = _coordinator(tmp_path)
    user, t = verdict_for_kind("user"), 1.0
    for _ in range(c.escalation.settings.restart_limit + 1):
        for slot in range(4):
            if c.state is not TaskState.FAILED:
                c.exchange(0, [M.WorkerFailed(slot=slot, ts=t, verdict=user)], t)
            t += 0.1
    assert c.state is TaskState.FAILED and c.outcome is not None
    assert "Python error in the training script" in c.outcome.reason, c.outcome.reason


def test_a_lost_rank_takes_its_replica_out_and_its_partner_waits_alive(tmp_path: Path) -> None:
    c = _coordinator(tmp_path)
    c.exchange(0, [M.StepBegan(slot=0, ts=0.5, step=4, epoch=1, cpu_s=0.0)], 0.5)
    crash = M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))
    c.exchange(0, [crash], 1.0)
    assert c.epoch == 2 and c.members == (2, 3)  # replica (0, 1) sits out
    book = c.book
    assert book.slots[0].alive and book.slots[0].progress is None  # waits: no step to hang in
    assert [a for a in c.take_actions(0) if isinstance(a, M.Kill)] == []  # slot 0 not killed
    # the restarted rank is ready: the replica is whole again and comes back at a boundary
    c.exchange(0, [M.Ready(slot=1, ts=2.0, microbatches=8)], 2.0)
    assert c.epoch == 3 and c.members == (2, 3, 0, 1)


def test_a_waiting_ranks_late_report_of_the_old_epoch_starts_no_hang_clock(
    tmp_path: Path,
) -> None:
    """Seen beside CPU burners: slot 4, left out when its pair was excluded, reported the start
    of its step in the old epoch after the new one began; the monitor timed that step and 5 s
    later killed a rank that was only waiting (and held its shard)."""
    c = _coordinator(tmp_path, StepMonitor(MonitorSettings(warmup_steps=2)))
    crash = M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))
    c.exchange(0, [crash], 1.0)
    assert c.members == (2, 3)
    c.exchange(0, [M.StepBegan(slot=0, ts=1.05, step=4, epoch=1, cpu_s=0.0)], 1.1)
    assert c.monitor is not None and c.monitor.hang_deadline(0) is None
    assert c.book.slots[0].progress is None
    c.exchange(0, [], 400.0)
    assert c.book.slots[0].alive and not [
        e for e in c.events.events() if e["event"] == "error_detected"
    ]


def test_a_task_of_one_replica_waits_for_its_lost_rank(tmp_path: Path) -> None:
    c = Coordinator(
        task="t",
        slots={0: 0, 1: 0},
        events=EventLog(tmp_path / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(replica_ranks=2, min_workers=2),
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(2)], 0.0)
    c.exchange(0, [M.WorkerFailed(slot=0, ts=1.0, verdict=verdict_for_kind("segfault"))], 1.0)
    assert c.members == () and c.book.slots[1].alive
    c.exchange(0, [M.Ready(slot=0, ts=2.0, microbatches=8)], 2.0)
    assert c.members == (0, 1)


def test_a_rank_waiting_on_its_replica_is_no_hang_suspect(tmp_path: Path) -> None:
    from unicron.detect.stall import Phase

    c = _coordinator(tmp_path)
    began = [M.StepBegan(slot=s, ts=0.5, step=4, epoch=1, cpu_s=0.0) for s in range(4)]
    c.exchange(0, began, 0.5)
    wait = M.WaitingOnReplica(slot=0, ts=1.0, step=4, epoch=1, waiting=True)
    c.exchange(0, [wait], 1.0)
    assert c.book.slots[0].progress.phase is Phase.REDUCE  # type: ignore[union-attr]
    old = M.WaitingOnReplica(slot=1, ts=1.0, step=3, epoch=1, waiting=True)  # a late one
    c.exchange(0, [old], 1.0)
    assert c.book.slots[1].progress.phase is Phase.COMPUTE  # type: ignore[union-attr]
    done = M.WaitingOnReplica(slot=0, ts=1.5, step=4, epoch=1, waiting=False)
    c.exchange(0, [done], 1.5)
    p = c.book.slots[0].progress
    assert p is not None and p.phase is Phase.COMPUTE


def test_a_slot_lost_for_good_changes_the_layout_and_its_return_changes_it_back(
    tmp_path: Path,
) -> None:
    """TP=2 x PP=2 on 8 slots that may also run at PP=1: a crash (the rank comes back) keeps
    the layout, its replica waits; an exclusion (it does not, until its probe) moves the task
    to PP=1 on the six slots of whole pairs; the readmitted slot brings PP=2 back."""
    c = Coordinator(
        task="t",
        slots=dict.fromkeys(range(8), 0),
        events=EventLog(tmp_path / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(
            replica_ranks=4, tp=2, layouts=((2, 2), (2, 1)), min_workers=2, readmit_after_s=1.0
        ),
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(8)], 0.0)
    assert (c.epoch, c.members, c.book.layout[1]) == (1, tuple(range(8)), 0)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("segfault"))], 1.0)
    assert (c.members, c.book.layout[1]) == ((4, 5, 6, 7), 0)  # restarted in place: PP=2 kept
    c.exchange(0, [M.Ready(slot=1, ts=2.0, microbatches=8)], 2.0)
    assert (c.members, c.book.layout[1]) == ((4, 5, 6, 7, 0, 1, 2, 3), 0)
    c.exchange(0, [M.WorkerFailed(slot=5, ts=3.0, verdict=verdict_for_kind("ecc"))], 3.0)
    assert c.book.slots[5].excluded
    assert (c.members, c.book.layout[1]) == ((6, 7, 0, 1, 2, 3), 1)  # slot 4 waits for its pair
    assert c.book.size == 2
    # another slot excluded (past the escalation's window: not the node): PP=2 would train
    # four as PP=1 does, so nothing moves but the lost pair
    c.exchange(0, [M.WorkerFailed(slot=7, ts=99.0, verdict=verdict_for_kind("ecc"))], 99.0)
    assert (c.members, c.book.layout[1]) == ((0, 1, 2, 3), 1)
    c.exchange(0, [M.ProbeDone(slot=5, ts=100.0, ok=True, detail="ok")], 100.0)
    c.exchange(0, [M.Ready(slot=5, ts=100.5, microbatches=8)], 100.5)
    assert (set(c.members), c.book.layout[1]) == ({0, 1, 2, 3, 4, 5}, 1)  # pairs: PP=1 trains six
    c.exchange(0, [M.ProbeDone(slot=7, ts=101.0, ok=True, detail="ok")], 101.0)
    c.exchange(0, [M.Ready(slot=7, ts=101.5, microbatches=8)], 101.5)
    assert (set(c.members), c.book.layout[1]) == (set(range(8)), 0)  # whole again: its own depth
    began = [e.get("pp") for e in c.events.events() if e["event"] == "epoch_begin"]
    assert began[-5:] == [2, 1, 1, 1, 2]


def _tp2_or_tp1(tmp: Path) -> Coordinator:
    """TP=2 on 4 slots that may run at TP=1 (``--tp-choices 1``), epoch 1 started."""
    c = Coordinator(
        task="t",
        slots=dict.fromkeys(range(4), 0),
        events=EventLog(tmp / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(
            replica_ranks=2, tp=2, layouts=((2, 1), (1, 1)), min_workers=2, readmit_after_s=1.0
        ),
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(4)], 0.0)
    return c


def _enter_and_compute(c: Coordinator, members: tuple[int, ...], n: int, ts: float) -> None:
    """The members enter the current epoch (resharding to its layout) and compute step ``n``."""
    epoch = c.epoch
    entered = [M.EpochEntered(slot=m, ts=ts, epoch=epoch) for m in members]
    began = [M.StepBegan(slot=m, ts=ts, step=n, epoch=epoch) for m in members]
    done = [M.StepComputed(slot=m, ts=ts, step=n, compute_s=0.01) for m in members]
    end = {"epoch": epoch, "rank": 0, "step": n, "loss": 1.0, "duration_s": 0.01}
    c.exchange(0, [*entered, *began, *done, M.Event(ts=ts, name="step_end", fields=end)], ts)


def test_a_slot_lost_for_good_can_change_the_tensor_parallel_degree(tmp_path: Path) -> None:
    """TP=2 on 4 slots that may also run at TP=1 (``--tp-choices 1``): slot 1 excluded, its
    pair cannot be whole; TP=1 trains three (0, 2, 3) where TP=2 trains two, so the epoch
    runs at TP=1 x DP=3 and says so (``tp`` in ``epoch_begin`` and in the epoch the workers
    read); slot 1 back, TP=2 again on four."""
    c = _tp2_or_tp1(tmp_path)
    assert (c.members, c.book.layout) == ((0, 1, 2, 3), (0, 0))
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("ecc"))], 1.0)
    assert (c.members, c.book.layout, c.book.size) == ((0, 2, 3), (1, 1), 1)
    c.exchange(0, [M.ProbeDone(slot=1, ts=3.0, ok=True, detail="ok")], 3.0)
    c.exchange(0, [M.Ready(slot=1, ts=3.5, microbatches=8)], 3.5)
    assert (set(c.members), c.book.layout) == ({0, 1, 2, 3}, (0, 0))
    began = [(e["tp"], e["pp"]) for e in c.events.events() if e["event"] == "epoch_begin"]
    assert began == [(2, 1), (1, 1), (2, 1)]


def test_the_state_is_counted_at_the_layout_each_holder_entered(tmp_path: Path) -> None:
    """At TP=1 (slot 1 excluded) each member holds the whole model. The epoch back at TP=2
    is announced and being entered (``EpochEntered`` comes before the reshard); slot 3 is
    killed (a false hang beside CPU burners) while slot 2 restarts: slot 0 alone holds the
    state, all of it, and the task goes on (before, the places were counted at the announced
    TP=2 and it failed as if the state were gone: found by a loaded run). Once a step began
    in the TP=2 epoch, each holds a shard: losing both holders of place 1 loses the state,
    and without a checkpoint the task fails."""
    c = _tp2_or_tp1(tmp_path)
    _enter_and_compute(c, (0, 1, 2, 3), 0, 0.5)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("ecc"))], 1.0)
    assert (c.members, c.book.layout) == ((0, 2, 3), (1, 1))
    _enter_and_compute(c, (0, 2, 3), 1, 1.5)
    c.exchange(0, [M.WorkerFailed(slot=2, ts=2.0, verdict=verdict_for_kind("segfault"))], 2.0)
    assert c.members == (0, 3)
    c.exchange(0, [M.ProbeDone(slot=1, ts=3.0, ok=True, detail="ok")], 3.0)
    c.exchange(0, [M.Ready(slot=s, ts=3.5, microbatches=8) for s in (1, 2)], 3.5)
    assert (set(c.members), c.book.layout) == ({0, 1, 2, 3}, (0, 0))  # TP=2 announced
    # slots 0, 1, 2 say they enter it (before their reshard) and wait for 3, which is killed
    entered = [M.EpochEntered(slot=s, ts=3.8, epoch=c.epoch) for s in (0, 1, 2)]
    c.exchange(0, entered, 3.8)
    c.exchange(0, [M.WorkerFailed(slot=3, ts=4.0, verdict=verdict_for_kind("hang"))], 4.0)
    assert c.book.state is not TaskState.FAILED, c.book.outcome
    assert 0 in c.members  # the holder of the whole state trains on

    c = _tp2_or_tp1(tmp_path / "entered")
    _enter_and_compute(c, (0, 1, 2, 3), 0, 0.5)  # TP=2 entered: replicas (0, 1) and (2, 3)
    lost = [M.WorkerFailed(slot=s, ts=1.0, verdict=verdict_for_kind("segfault")) for s in (1, 3)]
    c.exchange(0, lost, 1.0)
    assert c.book.state is TaskState.FAILED and "state is gone" in c.book.outcome.reason


def test_the_first_commit_leaves_the_state_in_every_member_of_its_epoch(tmp_path: Path) -> None:
    """PP=2 x DP=2 on four nodes of one slot: rank 0's report that step 0 committed comes in
    before node 3's reports that its slot computed it (its agent holds step reports for the
    exchange's rhythm), then slot 1 crashes. Slot 3, stage 1 of the live replica, holds the
    state all the same: it took part in the commit, so the task goes on (it failed as if the
    state were gone: found by a loaded run)."""
    c = Coordinator(
        task="t",
        slots={s: s for s in range(4)},
        events=EventLog(tmp_path / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(replica_ranks=2, tp=1, min_workers=2),
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(4)], 0.0)
    assert c.members == (0, 1, 2, 3)
    epoch = c.epoch
    for m in c.members:
        began = [M.EpochEntered(slot=m, ts=0.1, epoch=epoch), M.StepBegan(slot=m, ts=0.1, step=0)]
        c.exchange(m, began, 0.1)
    for m in (0, 1, 2):
        c.exchange(m, [M.StepComputed(slot=m, ts=0.2, step=0, compute_s=0.01)], 0.2)
    end = {"epoch": epoch, "rank": 0, "step": 0, "loss": 1.0, "duration_s": 0.01}
    c.exchange(0, [M.Event(ts=0.3, name="step_end", fields=end)], 0.3)
    assert c.book.trained and c.book.slots.holders() == [0, 1, 2, 3]
    c.exchange(1, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("killed"))], 1.0)
    assert c.book.state is TaskState.RUNNING, c.book.outcome
    assert c.members == (2, 3)


def test_an_excluded_node_keeps_the_last_copy_of_a_stage(tmp_path: Path) -> None:
    """PP=2 x DP=2, each replica's stages on two nodes: replicas (0, 1) and (2, 3), stage 0
    on node 0, stage 1 on node 1. Slot 3 crashes, and the crash tips node 1 over its failure
    limit: node 1 is excluded, and slot 1 there is kept running, the last copy of stage 1
    (before, a holder on another node was enough to kill it: stage 1 was lost and the task
    failed)."""
    nodes = {0: 0, 1: 1, 2: 0, 3: 1}
    c = Coordinator(
        task="t",
        slots=nodes,
        events=EventLog(tmp_path / "events.jsonl"),
        escalation=Escalation(EscalationSettings(node_failure_limit=1)),
        settings=CoordinatorSettings(replica_ranks=2, tp=1, min_workers=2),
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(4)], 0.0)
    _enter_and_compute(c, (0, 1, 2, 3), 0, 0.5)
    c.exchange(1, [M.WorkerFailed(slot=3, ts=1.0, verdict=verdict_for_kind("segfault"))], 1.0)
    b = c.book
    assert 1 in b.escalation.excluded_nodes()
    assert b.state is TaskState.RUNNING, b.outcome
    assert b.slots[1].kept and b.slots[1].killed_at is None and 1 in b.slots.holders()


def test_a_copy_of_a_shard_is_counted_at_the_layout_its_holder_holds(tmp_path: Path) -> None:
    """The judges' question "who else holds what this worker holds" (:meth:`other_holders`,
    behind every kill of a last copy) counts each holder at the layout of its state, like
    :meth:`state_held`. TP=2 on 4 slots, slot 1 excluded: TP=1 on (0, 2, 3) is announced,
    but until they reshard, slot 3 holds place 1's shard alone (its pair's is gone) and slot
    0's is on 2 (before, counted at the announced TP=1, 3 had two copies: a hang kill of a
    last copy); while they enter (the one shard or the whole model: not known here) none
    is sure; from their first step at TP=1 each holds the whole model. Back: at TP=1 with
    TP=2 announced, each still holds the whole model (before: 0 had one copy, 3 none)."""
    c = _tp2_or_tp1(tmp_path)
    _enter_and_compute(c, (0, 1, 2, 3), 0, 0.5)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("ecc"))], 1.0)
    b = c.book
    assert (c.members, b.layout) == ((0, 2, 3), (1, 1))  # announced, nobody entered
    assert (b.other_holders(0), b.other_holders(3)) == ([2], [])
    assert not b.state_survives(3) and b.state_held()
    entered = [M.EpochEntered(slot=s, ts=1.2, epoch=c.epoch) for s in (0, 2, 3)]
    c.exchange(0, entered, 1.2)
    assert [b.other_holders(s) for s in (0, 2, 3)] == [[], [], []]
    assert b.state_held()  # generous where the judges are careful: see state_held
    _enter_and_compute(c, (0, 2, 3), 1, 1.5)
    assert (b.other_holders(0), b.other_holders(3)) == ([2, 3], [0, 2])

    c.exchange(0, [M.ProbeDone(slot=1, ts=3.0, ok=True, detail="ok")], 3.0)
    c.exchange(0, [M.Ready(slot=1, ts=3.5, microbatches=8)], 3.5)
    assert (set(c.members), b.layout) == ({0, 1, 2, 3}, (0, 0))  # TP=2 announced
    assert (b.other_holders(0), b.other_holders(3)) == ([2, 3], [0, 2])
    assert 1 not in b.slots.holders()  # restarted after a commit: it takes a shard at sync


def test_the_performance_model_picks_among_the_layouts_that_can_run(tmp_path: Path) -> None:
    """With a ``rate`` (the performance model's achieved FLOP/s of ``(tp, pp)`` on ``n``
    slots: a cluster task that describes its ``model``) the fastest layout wins, not the one
    training the most slots: here TP=2 is twice as fast a slot, so slot 1 excluded leaves
    the pair (2, 3) at TP=2 (rate 4) rather than TP=1 on three (rate 3); where nothing fits
    (every rate 0) the slots are counted."""
    asked: list[tuple[int, int, int]] = []

    def rate(tp: int, pp: int, n: int) -> float:
        asked.append((tp, pp, n))
        return n * (2.0 if tp == 2 else 1.0)

    def coordinator(rate: Any) -> Coordinator:
        c = Coordinator(
            task="t",
            slots=dict.fromkeys(range(4), 0),
            events=EventLog(tmp_path / f"events-{len(asked)}-{rate is None}.jsonl"),
            escalation=Escalation(EscalationSettings()),
            settings=CoordinatorSettings(
                replica_ranks=2, tp=2, layouts=((2, 1), (1, 1)), min_workers=1, rate=rate
            ),
        )
        c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(4)], 0.0)
        c.exchange(0, [M.WorkerFailed(slot=1, ts=1.0, verdict=verdict_for_kind("ecc"))], 1.0)
        return c

    c = coordinator(rate)
    assert (c.members, c.book.layout) == ((2, 3), (0, 0))
    assert (2, 1, 2) in asked and (1, 1, 3) in asked
    c = coordinator(lambda tp, pp, n: 0.0)  # nothing fits: as without a model
    assert (c.members, c.book.layout) == ((0, 2, 3), (1, 1))


def test_the_performance_models_rate_of_a_layout_is_its_fastest_fitting_one() -> None:
    """:func:`layout_rate` over the planner's search: GPT 1.3B at global batch 256 on A100s,
    a positive FLOP/s at TP=1 and TP=2 on 8 GPUs, TP=1 the faster (no tensor-parallel sums);
    0 where the layout cannot be (TP=8 on 4 GPUs, 0 GPUs)."""
    from unicron.control.allocation import layout_rate
    from unicron.planner import GPU_PRESETS, MODEL_PRESETS, PerfOptions

    args = (MODEL_PRESETS["gpt-1.3b"], 256, GPU_PRESETS["A100-80GB"], 8, PerfOptions())
    one, two = layout_rate(*args, 1, 1, 8), layout_rate(*args, 2, 1, 8)
    assert one > two > 0
    assert layout_rate(*args, 8, 1, 4) == 0.0 and layout_rate(*args, 1, 1, 0) == 0.0


def _coordinator_3d(tmp: Path, monitor: StepMonitor | None = None) -> Coordinator:
    """TP=2 x PP=2 on the 8 slots of one node, which may also run at PP=1; every slot ready."""
    c = Coordinator(
        task="t",
        slots=dict.fromkeys(range(8), 0),
        events=EventLog(tmp / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(
            replica_ranks=4, tp=2, layouts=((2, 2), (2, 1)), min_workers=4
        ),
        monitor=monitor,
    )
    c.exchange(0, [M.Ready(slot=s, ts=0.0, microbatches=8) for s in range(8)], 0.0)
    return c


def test_the_planner_taking_a_pair_changes_the_layout_and_giving_it_back_restores_it(
    tmp_path: Path,
) -> None:
    """The planner's moves, as the cluster makes them: two slots of a TP=2 x PP=2 task that
    may run at PP=1 go to another task (at a step boundary: the six left run at PP=1), and
    two new slots come back (PP=2 on eight once they are ready)."""
    c = _coordinator_3d(tmp_path)
    c.release_slots([6, 7], 1.0, "planner")
    assert (c.members, c.book.layout[1]) == ((0, 1, 2, 3, 4, 5), 1)
    entered = [M.EpochEntered(slot=s, ts=1.5, epoch=2) for s in range(6)]
    c.exchange(0, [*entered, M.WorkerLeft(slot=6, ts=1.6), M.WorkerLeft(slot=7, ts=1.6)], 1.6)
    assert 6 not in c.book.slots and 7 not in c.book.slots  # stopped, the other task's
    for slot, place in ((8, 2), (9, 3)):  # replica (4, 5, 8, 9): stage 1
        c.add_slot(slot, 0, 2.0, "planner", place)
    c.exchange(0, [M.Ready(slot=s, ts=3.0, microbatches=8) for s in (8, 9)], 3.0)
    assert (c.members, c.book.layout[1]) == ((0, 1, 2, 3, 4, 5, 8, 9), 0)
    began = [e for e in c.events.events() if e["event"] == "epoch_begin"]
    assert [(e["pp"], e["urgent"]) for e in began] == [(2, False), (1, False), (2, False)]


def test_the_first_step_at_a_new_depth_is_cold_for_the_hang_detector(tmp_path: Path) -> None:
    """A layout change rebuilds every rank's shard: the next step of each is judged as a
    restarted worker's first (``rejoin_hang_s`` at least), a crash that keeps the layout is
    not (seen beside CPU burners: one rank's first step at PP=1 took 3.6 s, its peers 0.13 s,
    and their evidence killed it as hung, then the stall detector others)."""
    settings = MonitorSettings(warmup_steps=2)
    c = _coordinator_3d(tmp_path, StepMonitor(settings))
    t = 1.0
    for step in range(10):
        c.exchange(0, [M.StepBegan(slot=s, ts=t, step=step, epoch=1) for s in range(8)], t)
        t += 0.13
        done = [M.StepComputed(slot=s, ts=t, step=step, compute_s=0.12) for s in range(8)]
        c.exchange(0, done, t)
    assert c.monitor is not None
    c.release_slots([6, 7], t, "planner")
    assert c.book.layout[1] == 1
    c.exchange(0, [M.StepBegan(slot=s, ts=t, step=10, epoch=2) for s in range(6)], t)
    c.exchange(
        0,
        [M.StepComputed(slot=s, ts=t + 0.13, step=10, compute_s=0.12) for s in range(5)],
        t + 0.13,
    )
    assert c.monitor.hang_deadline(5) == pytest.approx(t + settings.rejoin_hang_s)


def test_the_moves_of_a_layout_change_take_each_entry_from_the_same_tensor_rank() -> None:
    from unicron.runtime.reshard import Move, digest, plan

    a, b, c, d = (digest(n) for n in ("blocks.0.w", "blocks.1.w", "tok.weight", "head.weight"))
    assert digest("blocks.0.w") == a and a > 0 and len({a, b, c, d}) == 4
    # PP=2 -> PP=1 at TP=2: members 0, 1 were stage 0 (tp ranks 0, 1), 2, 3 stage 1; member 4
    # (tp rank 0) is new; each new shard is the whole model at its tensor-parallel rank
    offers = [{a, c}, {a, c}, {b, d}, {b, d}, set()]
    needs = [{a, b, c, d}] * 5
    moves, missing = plan(offers, needs, [(2, 0), (2, 1), (2, 0), (2, 1), (2, 0)])
    assert missing == []
    assert moves == [
        Move(0, 2, tuple(sorted([a, c]))), Move(0, 4, tuple(sorted([a, c]))),
        Move(1, 3, tuple(sorted([a, c]))), Move(2, 0, tuple(sorted([b, d]))),
        Move(2, 4, tuple(sorted([b, d]))), Move(3, 1, tuple(sorted([b, d]))),
    ]  # fmt: skip
    # only members at the newest step offer: an entry nobody at its tensor rank holds is lost
    moves, missing = plan([{a}, {b}], [{a, b}, {a, b}], [(2, 0), (2, 1)])
    assert missing == sorted([a, b]) and moves == []


def test_the_ledger_exchange_is_read_place_by_place() -> None:
    from unicron.runtime.replica import plan

    def row(step: int, mask: list[int], checkpoint: int = -1) -> list[int]:
        return [step, 0, 0, 0, 0, *mask, 7, checkpoint, 0]  # ... mask, layout, ckpt, moved

    a, b = [1, 1, 0, 0], [0, 0, 1, 1]
    sp = plan([row(5, a), row(5, a), row(5, b), row(5, b)], 2, 4)
    assert (sp.target, sp.holders, sp.kept, sp.done) == (5, [[0, 1], [0, 1]], [True, True],
                                                         [{0, 1}, {2, 3}])  # fmt: skip
    # replica 0's place 1 restarted: it needs its shard, replica 0's sums do not count
    sp = plan([row(5, a), row(-1, [0] * 4), row(5, b), row(5, b)], 2, 4)
    assert sp.holders == [[0, 1], [1]] and sp.kept == [False, True] and sp.done[0] == set()
    # the ranks of replica 1 left the step at different points: none of its sums count
    sp = plan([row(5, a), row(5, a), row(5, b), row(5, [0, 0, 1, 0])], 2, 4)
    assert sp.kept == [True, False] and not sp.lost
    # no rank at place 1 holds the newest state, nor does any step have both places: the
    # checkpoint
    assert plan([row(5, a), row(-1, a), row(5, b), row(3, b)], 2, 4).lost
    # replica 0 went back to the checkpoint of step 3 (every rank of place 1 at step 5 was
    # lost); replica 1's place 0 waited outside with step 5: step 3 is whole, so that rank
    # receives it, rather than everyone reading the checkpoint again
    rows = [row(3, [0] * 4, 3), row(3, [0] * 4, 3), row(5, a, 3), row(-1, [0] * 4, 3)]
    sp = plan(rows, 2, 4)
    assert (sp.target, sp.holders, sp.kept, sp.lost) == (3, [[0], [0]], [True, False], False)
    # ... unless a checkpoint is newer than the newest whole step: then it is the checkpoint
    rows = [row(3, [0] * 4, 4), row(3, [0] * 4, 4), row(5, a, 4), row(-1, [0] * 4, 4)]
    assert plan(rows, 2, 4).lost


def test_a_task_whose_shard_is_gone_everywhere_fails_at_once_without_a_checkpoint(
    tmp_path: Path,
) -> None:
    from unicron.control.book import TaskState

    c = _coordinator(tmp_path)  # replicas (0, 1) and (2, 3), no checkpoint
    done = [M.StepComputed(slot=s, ts=0.5, step=0, compute_s=0.1) for s in range(4)]
    c.exchange(0, done, 0.5)
    c.step_committed(1, 0, 0.6)  # the fresh models are the task's state no more
    for n, slot in enumerate((0, 2)):  # place 0 of both replicas
        c.exchange(
            0, [M.WorkerFailed(slot=slot, ts=1.0 + n, verdict=verdict_for_kind("segfault"))],
            1.0 + n,
        )  # fmt: skip
    assert c.book.state is TaskState.FAILED
    assert "every replica holding the model state is gone" in c.book.outcome.reason  # type: ignore[union-attr]


def test_both_replicas_broken_in_one_step_come_back_together(tmp_path: Path) -> None:
    """Place 0 of one replica and place 1 of the other lost in the same step: each replica
    alone lacks a shard (a rollback to the checkpoint); together they hold both, so the first
    one back waits for the other's restart."""
    c = _coordinator(tmp_path)
    done = [M.StepComputed(slot=s, ts=0.5, step=0, compute_s=0.1) for s in range(4)]
    c.exchange(0, done, 0.5)
    c.step_committed(1, 0, 0.6)
    for slot in (0, 3):
        c.exchange(0, [M.WorkerFailed(slot=slot, ts=1.0, verdict=verdict_for_kind("segfault"))],
                   1.0)  # fmt: skip
    assert c.members == ()
    c.exchange(0, [M.Ready(slot=0, ts=2.0, microbatches=8)], 2.0)
    assert c.members == ()  # slot 2 holds place 0, its partner is restarting
    c.exchange(0, [M.Ready(slot=3, ts=2.5, microbatches=8)], 2.5)
    assert sorted(c.members) == [0, 1, 2, 3]


def test_a_checkpoint_of_one_layout_loads_into_another_by_name(tmp_path: Path) -> None:
    """After a layout change the newest checkpoint may be the old layout's (PP=2, a file per
    stage): a PP=1 shard reads its entries by name from both stages' files, parameters and
    the optimizer's state alike, bit for bit (the worker's fallback, ``transition._by_name``)."""
    from unicron.runtime import byname as B
    from unicron.runtime import checkpoint as C

    cfg = llama_parallel.LlamaConfig(layers=2, dim=32, heads=4, kv_heads=2, hidden=64,
                                     seq_len=16)  # fmt: skip
    tp = TensorParallel(0, 1)

    def build(stage: int, stages: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        with _BUILD:
            model, opt, _ = llama_parallel.build(
                tp, seed=3, cfg=cfg, pp=PipelineParallel(stage, stages, tp)
            )
        return model, opt

    root = tmp_path / "ck"
    stages = [build(s, 2) for s in range(2)]
    for place, (model, opt) in enumerate(stages):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5 + place)
        opt.step()  # the moments exist
        snap = C.snapshot(model, opt, step=7, ledger={"seed": 0})
        C.write(C.shard_root(root, place, 2), snap.parts, step=7, world=1, reduce="exact",
                model=snap.model, ledger={"seed": 0}, now=0.0)  # fmt: skip
    assert C.newest_step(root, 2) == 7
    whole, opt = build(0, 1)
    assert B.restore_by_name(B.load_by_name(root, [0, 1], 2, 7), whole, opt) == 7
    params = dict(whole.named_parameters())
    for model, old_opt in stages:
        for name, p in model.named_parameters():
            assert torch.equal(params[name], p), name
            mine, theirs = opt.state[params[name]], old_opt.state[p]
            assert mine.keys() == theirs.keys() and all(
                torch.equal(mine[k], theirs[k]) for k in mine
            ), name
    # an entry no file holds (a stage's files missing) is an error, not a silent zero
    with pytest.raises(C.CheckpointError, match="missing"):
        B.restore_by_name(B.load_by_name(root, [0], 2, 7), *build(0, 1))


def test_a_checkpoint_of_another_tensor_parallel_degree_is_joined_and_cut(
    tmp_path: Path,
) -> None:
    """After a change of degree the newest checkpoint may be the other degree's: a TP=1 shard
    reads a TP=2 checkpoint's two files and joins each split entry's slices (parameters and
    AdamW moments); a TP=2 rank reads a TP=1 checkpoint and cuts its slice; bit for bit the
    whole model's (``transition._by_name`` with ``restore_by_name(part=, of=)``)."""
    from unicron.runtime import byname as B
    from unicron.runtime import checkpoint as C

    def build(tp: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        handle = TensorParallel(rank, tp)
        with _BUILD:
            model, opt, _ = llama_parallel.build(handle, seed=3, cfg=CFG)
        return model, opt

    def stepped(tp: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, opt = build(tp, rank)
        for p in model.parameters():
            p.grad = p.detach() * 0.5 + 0.25  # elementwise: the slices of the whole's
        opt.step()
        return model, opt

    def write(root: Path, shards: list[Any]) -> None:
        for place, (model, opt) in enumerate(shards):
            snap = C.snapshot(model, opt, step=5, ledger={"seed": 0})
            C.write(C.shard_root(root, place, len(shards)), snap.parts, step=5, world=1,
                    reduce="exact", model=snap.model, ledger={"seed": 0}, now=0.0)  # fmt: skip

    whole, whole_opt = stepped(1, 0)
    dims = split_dims(whole)
    write(tmp_path / "tp2", [stepped(2, 0), stepped(2, 1)])
    write(tmp_path / "tp1", [(whole, whole_opt)])

    def same(model: torch.nn.Module, opt: torch.optim.Optimizer, tp: int, rank: int) -> None:
        ref = dict(whole.named_parameters())

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            return t.chunk(tp, dims[name])[rank] if name in dims and t.dim() else t

        for name, p in model.named_parameters():
            assert torch.equal(p, cut(name, ref[name])), name
            mine, theirs = opt.state[p], whole_opt.state[ref[name]]
            for k in theirs:
                assert torch.equal(mine[k], cut(name, theirs[k])), (name, k)

    model, opt = build(1, 0)
    parts = B.load_by_name(tmp_path / "tp2", [0, 1], 2, 5)
    assert B.restore_by_name(parts, model, opt, part=(1, 0), of=(2, [0, 1])) == 5
    same(model, opt, 1, 0)
    for rank in (0, 1):
        model, opt = build(2, rank)
        parts = B.load_by_name(tmp_path / "tp1", [0], 1, 5)
        assert B.restore_by_name(parts, model, opt, part=(2, rank), of=(1, [0])) == 5
        same(model, opt, 2, rank)
    # one of the two files missing from the join: an error, not half a weight
    model, opt = build(1, 0)
    with pytest.raises(C.CheckpointError):
        B.restore_by_name(B.load_by_name(tmp_path / "tp2", [0], 2, 5), model, opt,
                          part=(1, 0), of=(2, [0, 1]))  # fmt: skip


def test_a_reducer_closed_for_another_shard_leaves_its_parameters_alone() -> None:
    """A layout change trains a new shard with a new reducer; should the old shard be
    trained again (the move failed and the next epoch is back at its layout), its
    parameters must not still call the old reducer's hooks (a stray backward refused)."""
    from unicron.runtime.gradients import Reducer

    model = torch.nn.Linear(3, 2)
    strays: list[int] = []

    def reducer() -> Reducer:
        return Reducer(list(model.parameters()), 2, exact=True, bucket_cap_mb=1.0,
                       device=torch.device("cpu"), stray=lambda: strays.append(1))  # fmt: skip

    old = reducer()
    model(torch.ones(1, 3)).sum().backward()
    assert len(strays) == 2  # one per parameter: a backward outside a step
    old.close()
    reducer()  # the new reducer, hooked on the same parameters
    strays.clear()
    model(torch.ones(1, 3)).sum().backward()
    assert len(strays) == 2  # the new reducer's hooks alone


def test_a_moves_bytes_travel_in_packs_of_bounded_size() -> None:
    from unicron.runtime.reshard import PACK_BYTES, _packs

    small, big = (
        torch.zeros(PACK_BYTES // 16, dtype=torch.uint8),
        torch.zeros(2 * PACK_BYTES, dtype=torch.uint8),
    )
    packs = _packs([small] * 20 + [big, small])
    assert [len(p) for p in packs] == [16, 4, 1, 1]  # a larger tensor is a pack of its own
    assert all(sum(t.numel() for t in p) <= PACK_BYTES for p in packs if len(p) > 1)
    assert _packs([]) == [[]]


def test_the_last_live_copy_of_a_shard_is_killed_for_a_hang_only_on_strong_evidence(
    tmp_path: Path,
) -> None:
    """Found by the cluster soak: place 1 of replica 0 hung and was restarted; place 1 of
    replica 1, only slow (4x), passed its hang allowance with its partner done and was
    killed too: the shard's last copy gone, the task went back to its checkpoint and redid a
    step. The last live holder of a shard is killed as a lone worker would be: at twice its
    allowance (or with its CPU time standing still)."""
    c = _coordinator(tmp_path, StepMonitor(MonitorSettings(warmup_steps=2)))
    t = 0.0
    for step in range(6):  # the monitor learns a 0.1 s step (its allowance: the 1 s floor)
        for m in c.members:
            c.step_started(m, step, t, epoch=c.epoch)
        for m in c.members:
            c.step_computed(m, step, t + 0.1, compute_s=0.1, microbatches=4)
        t += 0.1
        c.step_committed(c.epoch, step, t)
        c.tick(t)
    c.exchange(0, [M.WorkerFailed(slot=1, ts=t, verdict=verdict_for_kind("hang"))], t)
    assert c.members == (2, 3) and c.book.other_holders(3) == []
    for m in (2, 3):
        c.step_started(m, 6, t, epoch=c.epoch)
    c.step_computed(2, 6, t + 0.1, compute_s=0.1, microbatches=4)
    killed: list[int] = []
    for i in range(1, 26):  # 0.1 s apart: 2.5 s, past twice the 1 s allowance
        c.heartbeat(0, t + i / 10)
        c.tick(t + i / 10)
        killed += [a.slot for a in c.take_actions(0) if isinstance(a, M.Kill)]
        if i == 15:  # 1.5 x the allowance, its partner done: once enough, not for this one
            assert 3 not in killed
    assert 3 in killed


def test_a_change_of_the_tensor_parallel_degree_gathers_and_cuts_the_slices() -> None:
    """TP=2 -> TP=1: a member at tensor rank 0 keeps its half of a split entry and takes the
    other half from rank 1; a new member takes both halves; a replicated entry comes whole
    from any degree's holder. TP=1 -> TP=2: each new rank takes its half of the whole."""
    from fractions import Fraction as F

    from unicron.runtime.reshard import Move, digest, local_spans, plan

    w, n = digest("blocks.0.attn.q.weight"), digest("norm.weight")
    half, other, whole = (F(0), F(1, 2)), (F(1, 2), F(1)), (F(0), F(1))

    def both(w_span: Any) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The two keys in a move's order, with their spans."""
        keys = tuple(sorted([n, w]))
        return keys, tuple(w_span if k == w else whole for k in keys)

    offers = [{w, n}, {w, n}, set()]
    needs = [{w, n}] * 3
    moves, missing = plan(offers, needs, [(2, 0), (2, 1), (1, 0)], [(1, 0)] * 3, {w})
    assert missing == []
    assert moves == [
        Move(0, 1, (w,), (half,)),  # rank 1's new whole: rank 0's half; its own half it keeps
        Move(0, 2, *both(half)),
        Move(1, 0, (w,), (other,)),
        Move(1, 2, (w,), (other,)),
    ]  # fmt: skip
    assert local_spans((1, 0), (2, 1), split=True) == other
    assert local_spans((2, 1), (2, 0), split=True) is None
    # back up: the TP=1 holders' whole is cut for each new rank; a split entry that only
    # rank 0's holders held (rank 1's all lost) is lost for rank 1's needers
    moves, missing = plan([{w, n}, set()], [{w, n}] * 2, [(1, 0), (2, 1)], [(2, 0), (2, 1)], {w})
    assert missing == [] and moves == [Move(0, 1, *both(other))]
    moves, missing = plan([{w}, set()], [{w}] * 2, [(2, 0), (2, 1)], [(1, 0), (1, 0)], {w})
    assert missing == [w]


def test_a_change_of_the_degree_moves_the_state_between_real_members_exactly() -> None:
    """Members of a real epoch group (gloo, one thread each): two TP=2 ranks that hold the
    state after a step and a fresh member re-form as three TP=1 shards, and back to TP=2 on
    three (ranks 0, 1, 0): every new shard holds the whole model's parameters and AdamW
    moments, sliced, bit for bit (the update is elementwise: slices of one whole)."""
    from tests.test_transfer import _run_group
    from unicron.runtime.reshard import Shard, reshard

    def shard(tp: int, rank: int, step: bool) -> Shard:
        handle = TensorParallel(rank, tp)
        pipe = PipelineParallel(0, 1, handle)
        with _BUILD:
            model, opt, _ = llama_parallel.build(handle, seed=3, cfg=CFG, pp=pipe)
        if step:
            for p in model.parameters():
                p.grad = p.detach() * 0.5 + 0.25  # elementwise: slices of the whole's
            opt.step()
        return Shard(model, opt, pipe)

    whole = shard(1, 0, step=True)
    dims = split_dims(whole.model)
    assert dims["blocks.0.attn.q.weight"] == 0 and dims["blocks.0.mlp.down.weight"] == 1

    def expected(name: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        if name not in dims or tp == 1:
            return t
        return t.chunk(tp, dims[name])[rank]

    def check(s: Shard) -> None:
        tp, rank = s.part
        ref, got = whole.model.state_dict(), s.model.state_dict()
        ref_p, got_p = dict(whole.model.named_parameters()), dict(s.model.named_parameters())
        for name in ref:
            assert torch.equal(got[name], expected(name, ref[name], tp, rank)), name
        for name, p in got_p.items():
            mine, theirs = s.optimizer.state[p], whole.optimizer.state[ref_p[name]]
            assert mine.keys() == theirs.keys(), name
            for k in mine:
                want = theirs[k] if theirs[k].dim() == 0 else expected(name, theirs[k], tp, rank)
                assert torch.equal(mine[k], want), (name, k)

    def down(g: Any) -> Shard:
        source = shard(2, g.rank, step=True) if g.rank < 2 else None
        target = shard(1, 0, step=False)
        reshard(g, source=source, target=target)
        return target

    for got in _run_group(3, down):
        assert isinstance(got, Shard), got
        check(got)

    def up(g: Any) -> Shard:
        source = shard(1, 0, step=True) if g.rank < 2 else None
        target = shard(2, g.rank % 2, step=False)
        reshard(g, source=source, target=target)
        return target

    for got in _run_group(3, up):
        assert isinstance(got, Shard), got
        check(got)


def test_a_cluster_task_with_a_model_and_layout_choices_is_priced_by_the_planner() -> None:
    """The cluster's coordinator settings carry the performance model's rate for a task that
    describes its ``model`` and may change its layout, and only then."""
    from unicron.control.planning import coordinator_settings
    from unicron.control.taskspec import TaskSpec

    base = {"name": "t", "script": __file__, "workers": {"min": 2, "max": 8}, "tp": 2,
            "model": {"preset": "gpt-1.3b"}, "global_batch": 256}  # fmt: skip
    spec = TaskSpec.model_validate({**base, "tp_choices": [1]})
    settings = coordinator_settings(spec, None, 0, gpu="A100-80GB", gpus_per_node=8)
    assert settings.layouts == ((2, 1), (1, 1)) and settings.rate is not None
    assert settings.rate(1, 1, 8) > settings.rate(2, 1, 8) > 0
    assert coordinator_settings(spec, None, 0).rate is None  # no GPU named: slots counted
    fixed = TaskSpec.model_validate(base)
    assert coordinator_settings(fixed, None, 0, gpu="A100-80GB").rate is None


def test_a_slice_that_cannot_be_cut_is_refused_with_its_name() -> None:
    """A layout change asks each shard for a slice of a split entry: a slice of an entry the
    model does not mark split, or one a degree cannot cut evenly, is refused naming the
    entry (never a silent copy of the wrong elements)."""
    from fractions import Fraction as F

    from unicron.runtime.reshard import WHOLE, Slicing

    t = torch.arange(12.0).reshape(6, 2)
    half = Slicing((2, 1), {"w": 0})  # rank 1 of 2 holds rows 6..11 of the whole's 12
    assert torch.equal(half.local("w", t, (F(3, 4), F(1))), t[3:])
    assert torch.equal(half.local("w", t, (F(1, 2), F(1))), t)
    assert Slicing((2, 0), {}).local("norm", t, WHOLE) is t
    with pytest.raises(ValueError, match="does not mark it split"):
        Slicing((2, 0), {}).local("norm", t, (F(0), F(1, 2)))
    with pytest.raises(ValueError, match="do not split"):
        half.local("w", t, (F(1, 2), F(5, 7)))
    with pytest.raises(ValueError, match="outside the slice of rank 1"):
        half.local("w", t, (F(0), F(1, 2)))  # rank 0's half, not this rank's


# -- a pipeline's schedules (pure) ------------------------------------------------------------
def _ops(order: list[tuple[bool, int]], stage: int, stages: int) -> list[tuple[str, str, int]]:
    """The link operations of ``stage`` computing in ``order``: ("send"/"recv", way, k), way
    "up" for activations to the next stage, "down" for gradients to the previous one."""
    ops: list[tuple[str, str, int]] = []
    for fwd, k in order:
        if fwd:
            ops += [("recv", "up", k)] if stage > 0 else []
            ops += [("send", "up", k)] if stage < stages - 1 else []
        else:
            ops += [("recv", "down", k)] if stage < stages - 1 else []
            ops += [("send", "down", k)] if stage > 0 else []
    return ops


def _runs(orders: list[list[tuple[bool, int]]], link: str) -> bool:
    """Whether every stage, computing in its order, gets through its link operations,
    receives blocking, over ``link``: ``posted``, a channel per direction and pair of stages
    whose sends are posted (the worker's :class:`~unicron.runtime.replica.StageLink`);
    ``blocking``, the same channels with sends that wait for their receive (a rendezvous
    transport); ``shared``, one channel of blocking broadcasts per pair, which the two stages
    must post in the same order (:class:`~unicron.parallel.PairLink`)."""
    stages = len(orders)
    todo = {s: _ops(order, s, stages) for s, order in enumerate(orders)}

    def channel(s: int, op: str, way: str) -> tuple[int, str]:  # (the pair's lower stage, way)
        low = s if (op, way) in (("send", "up"), ("recv", "down")) else s - 1
        return low, "both" if link == "shared" else way

    boxes: dict[tuple[int, str], list[int]] = {}
    while any(todo.values()):
        moved = False
        for s, ops in todo.items():
            if not ops:
                continue
            op, way, k = ops[0]
            at = channel(s, op, way)
            if link == "posted":
                box = boxes.setdefault(at, [])
                if op == "send":
                    box.append(k)
                elif box and box[0] == k:
                    box.pop(0)
                else:
                    continue
            else:  # a rendezvous: the neighbour's next operation must be its other half
                peer = at[0] + 1 if at[0] == s else at[0]
                if not todo[peer] or channel(peer, *todo[peer][0][:2]) != at:
                    continue  # the neighbour is busy with another channel
                pop, pway, pk = todo[peer][0]
                if (pway, pk) != (way, k) or pop == op:
                    return False  # the channel's next broadcast differs on the two sides
                todo[peer].pop(0)
            ops.pop(0)
            moved = True
        if not moved:
            return False  # every stage waits on another: a deadlock
    return True


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_every_schedule_computes_each_microbatch_once_and_runs_over_the_workers_links(
    kind: str, stages: int, n: int
) -> None:
    orders = [schedule(kind, n, stage, stages) for stage in range(stages)]
    for stage, order in enumerate(orders):
        assert [k for f, k in order if f] == [k for f, k in order if not f] == list(range(n))
        for k in range(n):
            assert order.index((True, k)) < order.index((False, k))
        held = max(
            sum(f for f, _ in order[: i + 1]) - sum(not f for f, _ in order[: i + 1])
            for i in range(len(order))
        )  # micro-batches whose activations are held at once
        assert held == {"gpipe": n, "1f1b": min(stages - stage, n), "sequential": 1}[kind]
    assert _runs(orders, "posted"), (kind, n, stages)


def test_1f1b_needs_a_channel_per_direction_and_posted_sends() -> None:
    """In 1F1B's steady state the first stage sends micro-batch 1's activation before it
    receives micro-batch 0's gradient, while the second sends that gradient first: over one
    ordered channel (PairLink) the two disagree, and with a channel per direction whose sends
    wait for their receive both wait on their send. GPipe and one at a time run over any."""
    orders = [schedule("1f1b", 4, s, 2) for s in range(2)]
    assert _runs(orders, "posted")
    assert not _runs(orders, "shared")
    assert not _runs(orders, "blocking")
    for kind in ("gpipe", "sequential"):
        for link in ("shared", "blocking"):
            assert _runs([schedule(kind, 4, s, 3) for s in range(3)], link), (kind, link)


def test_an_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, sequential"):
        schedule("interleaved", 4, 0, 2)
