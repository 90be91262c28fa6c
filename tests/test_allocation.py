"""The cluster's allocation (:mod:`unicron.control.allocation`) and a task coordinator's
side of a planned move (``release_slots``, ``add_slot``): pure decisions, no processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicron.control import replicas
from unicron.control.allocation import TaskView, decide
from unicron.control.coordinator import Coordinator, CoordinatorSettings, TaskState
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog, read_events
from unicron.messages import Kill, Spawn

DAY = 86400.0


def view(name: str, weight: float, lo: int, hi: int, ranks: dict[int, int], *, running: bool,
         mb: int | None = 8) -> TaskView:  # fmt: skip
    return TaskView(name=name, weight=weight, min_workers=lo, max_workers=hi, ranks=ranks,
                    running=running, microbatches=mb)  # fmt: skip


def moves(d: object) -> dict[str, tuple[int, int]]:
    return {m.task: (m.before, m.after) for m in d.moves}  # type: ignore[attr-defined]


def test_a_new_task_is_packed_node_by_node_in_rank_order() -> None:
    d = decide([view("a", 1, 1, 4, {}, running=False)], {0: 2, 1: 2}, DAY)
    (m,) = d.moves
    assert (m.before, m.after, m.add_on) == (0, 4, (0, 0, 1, 1))


def test_a_heavier_task_takes_slots_but_a_running_one_keeps_its_minimum() -> None:
    a = view("a", 1, 1, 4, {0: 0, 1: 0, 2: 1, 3: 1}, running=True)
    b = view("b", 3, 2, 4, {}, running=False)
    d = decide([a, b], {0: 2, 1: 2}, DAY)
    assert moves(d) == {"a": (4, 1), "b": (0, 3)}
    assert d.waf_after > d.waf_before
    release = next(m for m in d.moves if m.task == "a").release
    assert len(release) == 3 and 0 not in release  # the first rank stays
    add = next(m for m in d.moves if m.task == "b").add_on
    assert sorted(add) == sorted([1, 1, 0])  # the slots a gives back


def test_a_lighter_task_waits_and_nothing_moves_for_a_gain_below_the_transition() -> None:
    a = view("a", 3, 1, 4, {0: 0, 1: 0, 2: 1, 3: 1}, running=True)
    b = view("b", 1, 2, 4, {}, running=False)
    d = decide([a, b], {0: 2, 1: 2}, DAY)
    assert not d.changed and moves(d) == {"a": (4, 4), "b": (0, 0)}


def test_running_minimums_that_do_not_fit_move_nothing() -> None:
    a = view("a", 1, 3, 4, {0: 0, 1: 0, 2: 1, 3: 1}, running=True)
    b = view("b", 1, 2, 4, {4: 1, 5: 1}, running=True)
    d = decide([a, b], {0: 2}, DAY)  # node 1 lost: 2 slots left, minimums 3 + 2
    assert not d.changed


def test_slots_on_lost_nodes_are_not_held_and_freed_slots_are_taken_back() -> None:
    a = view("a", 1, 1, 4, {0: 0, 1: 0, 2: 1, 3: 1}, running=True)
    d = decide([a], {0: 2, 2: 2}, DAY)  # node 1 lost, node 2 free
    (m,) = d.moves
    assert (m.before, m.after, m.add_on) == (2, 4, (2, 2))


def _coordinator(tmp: Path) -> Coordinator:
    c = Coordinator(
        task="t",
        slots={s: 0 for s in range(4)},
        events=EventLog(tmp / "events.jsonl"),
        escalation=Escalation(EscalationSettings()),
        settings=CoordinatorSettings(),
    )
    c.attach(0)
    for s in range(4):
        c.worker_ready(s, 0.0, microbatches=8)
    assert c.state is TaskState.RUNNING and c.members == (0, 1, 2, 3)
    return c


def test_a_released_slot_leaves_at_a_step_boundary_then_is_stopped(tmp_path: Path) -> None:
    c = _coordinator(tmp_path)
    c.release_slots([2, 3], 1.0, "planner")
    assert c.members == (0, 1) and c.epoch == 2
    info = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "epoch_begin"]
    assert info[-1]["urgent"] is False  # members switch at the step boundary: no recompute
    c.tick(1.1)
    assert not any(isinstance(a, Kill) for a in c.take_actions(0))  # members not there yet
    for m in (0, 1):
        c.epoch_entered(m, 2, 1.2)
    c.tick(1.3)
    kills = [a for a in c.take_actions(0) if isinstance(a, Kill)]
    assert sorted(k.slot for k in kills) == [2, 3] and all(k.leave for k in kills)
    c.worker_left(2)
    c.worker_left(3)
    assert c.released() == {2, 3} and sorted(c.slots) == [0, 1]
    assert c.released() == set()  # told once


def test_an_added_slot_starts_fresh_and_joins_the_next_epoch(tmp_path: Path) -> None:
    c = _coordinator(tmp_path)
    c.step_committed(1, 0, 0.5)
    c.add_slot(4, 0, 1.0, "planner", 0)
    (spawn,) = [a for a in c.take_actions(0) if isinstance(a, Spawn)]
    assert spawn == Spawn(4, fresh=True)
    assert not c.slots[4].has_state  # a step committed: it receives the state
    c.worker_ready(4, 2.0, microbatches=8)
    assert c.members == (0, 1, 2, 3, 4)


def test_keep_moves_nothing_between_tasks_on_node_events_but_places_on_task_events() -> None:
    a = view("a", 1, 1, 4, {0: 0, 1: 1}, running=True)
    b = view("b", 3, 1, 4, {0: 2, 1: 3}, running=True)
    cap = {0: 1, 1: 1, 2: 1, 3: 1}
    assert moves(decide([a, b], cap, DAY)) == {"a": (2, 1), "b": (2, 3)}  # the planner moves
    kept = decide([a, b], cap, DAY, placement="keep", task_event=False)
    assert not kept.changed and "keep" in kept.reasons["a"]
    placed = decide([a, b], cap, DAY, placement="keep", task_event=True)
    assert moves(placed) == {"a": (2, 1), "b": (2, 3)}


def test_equal_shares_ignore_weights_and_respect_limits() -> None:
    a = view("a", 1, 1, 4, {0: 0, 1: 1, 2: 2, 3: 3}, running=True)
    b = view("b", 3, 1, 4, {}, running=False)
    cap = {n: 1 for n in range(5)}
    d = decide([a, b], cap, DAY, placement="equal")
    assert moves(d) == {"a": (4, 3), "b": (0, 2)}  # 5 over 2: the first submitted gets 3
    capped = view("c", 1, 1, 1, {}, running=False)
    assert moves(decide([capped], cap, DAY, placement="equal")) == {"c": (0, 1)}


def _modelled(name: str, preset: str, weight: float, hi: int, ranks: dict[int, int], *,
              running: bool, model: bool) -> TaskView:  # fmt: skip
    from unicron.planner import MODEL_PRESETS

    more = {"model": MODEL_PRESETS[preset], "global_batch": 256} if model else {}
    return TaskView(name=name, weight=weight, min_workers=1, max_workers=hi, ranks=ranks,
                    running=running, microbatches=None, **more)  # type: ignore[arg-type]  # fmt: skip


def test_the_performance_model_splits_otherwise_where_a_layout_does_not_fit() -> None:
    """gpt-13b needs 4 A100s: on the 3 free slots it would do nothing, so the performance
    model gives them to the small task, where counting workers gives them to the heavier."""
    from unicron.control.allocation import Hardware
    from unicron.planner import GPU_PRESETS

    hw = Hardware(GPU_PRESETS["A100-80GB"], 4)
    splits = {}
    for model in (False, True):
        small = _modelled("small", "gpt-1.3b", 1.0, 4, {0: 0}, running=True, model=model)
        big = _modelled("big", "gpt-13b", 2.0, 8, {}, running=False, model=model)
        d = decide([small, big], {0: 4}, DAY, hardware=hw)
        splits[model] = (moves(d), d.reasons)
    assert splits[False][0] == {"small": (1, 1), "big": (0, 3)}
    assert splits[True][0] == {"small": (1, 4), "big": (0, 0)}
    reasons = splits[True][1]
    assert "on 4: tp1 pp1 dp4" in reasons["small"], reasons
    assert reasons["big"] == (
        "waits: no layout of gpt-13b at global batch 256 fits on up to 3 slot(s) of A100-80GB "
        "(4 per node)"
    )
    assert "worker-equivalents" in reasons["small"] and "PFLOP/s" not in reasons["small"]


def test_a_count_that_divides_badly_is_worth_less_than_the_workers() -> None:
    """The same model priced by the performance model: 3 slots of a global batch of 256 are
    worth less than 3 workers (the layout's data-parallel degree must divide the batch)."""
    from unicron.control.allocation import Hardware, throughput
    from unicron.planner import GPU_PRESETS

    hw = Hardware(GPU_PRESETS["A100-80GB"], 4)
    t = _modelled("small", "gpt-1.3b", 1.0, 8, {}, running=False, model=True)
    rel = throughput(t, 8, hw)
    assert max(rel[u] / u for u in range(1, 9)) == 1.0  # the best count per slot is the unit
    assert rel[3] < 0.95 * 3 and rel[4] > 0.99 * 4  # 4 divides 256; 3 does not
    assert list(throughput(t, 8, None)) == list(range(9))  # no hardware: workers count


def test_a_measured_transition_is_what_the_planner_weighs() -> None:
    """A grow that repays a 0.2 s transition over the time to the next failure is made; the
    same grow against a transition as long as that time is not."""
    import dataclasses

    a = view("a", 1, 1, 4, {0: 0, 1: 0}, running=True, mb=None)
    short = dataclasses.replace(a, transition_s=0.2)
    long_ = dataclasses.replace(a, transition_s=10 * 3600.0)
    assert moves(decide([short], {0: 4}, 3600.0)) == {"a": (2, 4)}
    assert moves(decide([long_], {0: 4}, 3600.0)) == {"a": (2, 2)}
    assert "0.2 s transition" in decide([short], {0: 4}, 3600.0).reasons["a"]


def test_a_tensor_parallel_task_moves_in_whole_replicas_on_one_node() -> None:
    # nodes of 3 slots: a replica of 2 fits once per node, the third slot of each stays free
    a = TaskView(name="a", weight=1, min_workers=2, max_workers=6, ranks={}, running=False,
                 microbatches=8, replica_ranks=2)  # fmt: skip
    d = decide([a], {0: 3, 1: 3}, DAY)
    (m,) = d.moves
    assert (m.after, m.add_on) == (4, (0, 0, 1, 1))
    # a heavier task arrives: the running one gives back a whole replica (its ranks on one
    # node), never one rank of each
    held = {0: 0, 1: 0, 2: 1, 3: 1}
    running = TaskView(name="a", weight=1, min_workers=2, max_workers=6, ranks=held,
                       running=True, microbatches=8, replica_ranks=2)  # fmt: skip
    b = view("b", 5, 1, 4, {}, running=False)
    d = decide([running, b], {0: 3, 1: 3}, DAY)
    release = next(m for m in d.moves if m.task == "a").release
    assert sorted(release) in ([0, 1], [2, 3]), release


def test_a_replica_no_node_holds_spreads_its_stages_over_nodes_a_block_of_tp_each() -> None:
    """TP=2 x PP=2 on nodes of 3 slots: no node holds a replica of 4, so each stage goes to
    a node of its own (2 slots of one node: a tensor-parallel pair never spans nodes);
    the ranks group as the planner placed them (:func:`replicas.groups`)."""
    a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks={}, running=False,
                 microbatches=8, replica_ranks=4, tp=2)  # fmt: skip
    d = decide([a], {0: 3, 1: 3, 2: 3}, DAY)
    (m,) = d.moves
    assert m.after == 4 and len(m.add_on) == 4
    placed = dict(enumerate(m.add_on))  # the cluster numbers the ranks in this order
    (replica,) = replicas.groups(placed, (2, 2))
    assert [placed[r] for r in replica[:2]] == [placed[replica[0]]] * 2  # stage 0 on a node
    assert placed[replica[2]] == placed[replica[3]] != placed[replica[0]]
    # with room on one node the replica stays on it
    d = decide([a], {0: 4, 1: 3}, DAY)
    assert d.moves[0].add_on == (0, 0, 0, 0)
    # nodes of one slot hold no tensor-parallel pair: nothing is placed
    assert decide([a], {n: 1 for n in range(8)}, DAY).moves[0].after == 0


def test_a_task_that_may_run_shallower_is_planned_in_its_smallest_replicas() -> None:
    """TP=2 x PP=2 on 8 slots that may also run at PP=1 (``pp_choices``): a heavier task
    that wants 2 slots takes 2, not a whole replica of 4; the coordinator runs the 6 left
    at PP=1 (``membership.layout``)."""
    from unicron.control.taskspec import parse

    spec = parse({"name": "a", "script": "t.py", "tp": 2, "pp": 2, "pp_choices": [1],
                  "workers": {"min": 4, "max": 8}})  # fmt: skip
    assert (spec.depths, spec.replica_ranks, spec.smallest_replica) == ((2, 1), 4, 2)
    held = dict.fromkeys(range(8), 0)
    for grain, after in ((spec.replica_ranks, 4), (spec.smallest_replica, 6)):
        a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks=held,
                     running=True, microbatches=12, replica_ranks=grain)  # fmt: skip
        d = decide([a, view("b", 5, 2, 2, {}, running=False)], {0: 8}, DAY)
        assert moves(d) == {"a": (8, after), "b": (0, 2)}, grain


def test_a_task_of_two_layouts_gives_back_only_slots_that_leave_the_others_places() -> None:
    """Found by a review: TP=2 x PP=2 with ``pp_choices: [1]`` on nodes of 2, 2 and 4 free
    slots, replicas (0 1 | 2 3) and (4 5 | 6 7). Shrunk by a pair (its smallest replica),
    it gave back 2 3 (fewest on their node), out of the middle of its running layout: the
    rest regrouped as (0 1 | 4 5) with 6 7 short, so 4 5 6 7 each held another place's
    shard than the coordinator's table said, and the next epoch lost stage 1. Only the
    last block of the layout the epoch runs at can go without moving another place."""
    held = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2, 7: 2}
    b = view("b", 5, 2, 2, {}, running=False)
    for layout, release in (((1, 1), (2, 3)), ((2, 2), (6, 7))):  # not running: no places yet
        a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks=held, running=True,
                     microbatches=12, replica_ranks=2, tp=2, members=frozenset(held),
                     layout=layout)  # fmt: skip
        d = decide([a, b], {0: 2, 1: 2, 2: 4}, DAY)
        assert moves(d) == {"a": (8, 6), "b": (0, 2)}
        assert next(m for m in d.moves if m.task == "a").release == release, layout
    left = {r: n for r, n in held.items() if r not in (6, 7)}
    before = replicas.places(held, (2, 2))
    assert replicas.places(left, (2, 2)) == {r: before[r] for r in left}


def test_a_smaller_tensor_parallel_degree_gives_back_a_whole_block_of_the_running_one() -> None:
    """TP=2 x PP=2 that may run at TP=1 and PP=1 (its smallest replica: one slot), asked
    to give back one slot: any one slot would move another rank's place at the layout it
    runs at (slot 7 going leaves 6 alone at place 0, not 2), so it gives back the last
    block of two, one slot more than asked."""
    held = dict.fromkeys(range(8), 0)
    a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks=held, running=True,
                 microbatches=7, replica_ranks=1, tp=1, members=frozenset(held),
                 layout=(2, 2))  # fmt: skip
    d = decide([a, view("b", 5, 1, 1, {}, running=False)], {0: 8}, DAY)
    assert moves(d) == {"a": (8, 6), "b": (0, 1)}
    assert sorted(next(m for m in d.moves if m.task == "a").release) == [6, 7]


def test_a_task_of_two_layouts_gives_back_what_keeps_places_before_anything_else() -> None:
    """Found in review of the rule above: only whole blocks of the running layout were
    offered, and a block taken cut short the smallest replicas it overlapped. TP=2 x PP=2
    running, ``tp_choices: [1]`` (smallest replica: PP=2 of one rank), one rank left over on
    node 1: it is what goes (it moves no place), not half of the one whole replica; and
    TP=4 x PP=2 over a smallest TP=2 x PP=2 reaches its target through blocks of the running
    layout instead of stopping short."""
    held = {0: 0, 1: 1, 2: 0, 3: 0, 4: 0}
    a = TaskView(name="a", weight=1, min_workers=2, max_workers=5, ranks=held, running=True,
                 microbatches=16, replica_ranks=2, tp=1, members=frozenset({0, 2, 3, 4}),
                 layout=(2, 2))  # fmt: skip
    d = decide([a, view("b", 50, 3, 3, {}, running=False)], {0: 4, 1: 4}, DAY)
    assert next(m for m in d.moves if m.task == "a").release == (1,)
    held = {0: 1, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1, 10: 0}
    a = TaskView(name="a", weight=1, min_workers=4, max_workers=11, ranks=held, running=True,
                 microbatches=16, replica_ranks=4, tp=2,
                 members=frozenset({0, 1, 3, 5, 6, 7, 8, 9}), layout=(4, 2))  # fmt: skip
    d = decide([a, view("b", 50, 8, 8, {}, running=False)], {0: 4, 1: 8}, DAY)
    assert moves(d) == {"a": (11, 4), "b": (0, 8)}


def test_a_model_parallel_task_is_priced_at_its_own_layouts_only() -> None:
    """Found in review: the allocation priced a task that describes its model at the
    performance model's best layout on each count, one its coordinator cannot run: GPT 6.7B
    at global batch 16 that runs at TP=2 x PP=2 or TP=2 x PP=1 was worth more on 6 slots
    than on 4 (TP=2 x PP=3), where it can train 4 of them (PP=1 on 6 has a data-parallel
    degree of 3, which does not divide the batch)."""
    from unicron.control.allocation import Hardware, layout_of, throughput
    from unicron.planner import GPU_PRESETS, MODEL_PRESETS

    hw = Hardware(GPU_PRESETS["A100-80GB"], 4)
    base: dict[str, Any] = dict(name="t", weight=1.0, min_workers=4, max_workers=8, ranks={},
                                running=False, replica_ranks=2, tp=2,
                                model=MODEL_PRESETS["gpt-6.7b"], global_batch=16)  # fmt: skip
    free, own = TaskView(**base), TaskView(**base, layouts=((2, 2), (2, 1)))
    assert throughput(free, 8, hw)[6] > throughput(free, 8, hw)[4]
    assert "tp2 pp3" in layout_of(free, 6, 8, 8, hw)
    assert throughput(own, 8, hw)[6] <= throughput(own, 8, hw)[4]
    assert layout_of(own, 6, 8, 8, hw).startswith("on 6: tp2 pp2 ")


def test_what_a_task_gives_back_never_moves_a_placed_ranks_place() -> None:
    """The invariant over many shapes: whatever the plan takes from a running task (several
    layouts, slots on several nodes, an excluded rank in the table), every rank it keeps
    has the place it had at the layout its epoch runs at."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        tp, pp = rng.choice(((2, 1), (2, 2), (4, 1), (2, 3)))
        small_tp = rng.choice([d for d in (1, 2) if tp % d == 0])
        small_pp = rng.choice([d for d in (1, pp) if pp % d == 0])
        sizes = [rng.choice((2, 4, 6, 8)) for _ in range(rng.randint(1, 4))]
        held = {}
        for node, size in enumerate(sizes):
            for _ in range(rng.randint(0, size)):
                held[len(held)] = node
        if not held:
            continue
        excluded = {r: n for r, n in held.items() if rng.random() < 0.1}
        ranks = {r: n for r, n in held.items() if r not in excluded}
        a = TaskView(name="a", weight=1, min_workers=0, max_workers=len(ranks), ranks=ranks,
                     running=True, microbatches=rng.randint(1, 16),
                     replica_ranks=small_tp * small_pp, tp=small_tp,
                     members=frozenset(ranks), layout=(tp, pp), apart=excluded)  # fmt: skip
        want = rng.randint(1, sum(sizes))
        d = decide([a, view("b", 50, want, want, {}, running=False)], dict(enumerate(sizes)), DAY)
        gone = set(next(m for m in d.moves if m.task == "a").release)
        table = ranks | excluded
        before = replicas.places(table, (tp, pp))
        after = replicas.places({r: n for r, n in table.items() if r not in gone}, (tp, pp))
        assert after == {r: before[r] for r in after}, (tp, pp, held, gone)


def test_the_partner_of_an_excluded_rank_waits_and_is_not_given_back() -> None:
    """Found by the model-parallel soak: an excluded rank left its partner a short replica,
    the plan rounded the task down to whole replicas and gave the partner away, and the
    replica never came back when the excluded rank was readmitted."""
    held = {0: 0, 1: 0, 3: 0}  # rank 2 excluded: 3 waits for it
    a = TaskView(name="a", weight=1, min_workers=2, max_workers=4, ranks=held, running=True,
                 microbatches=8, replica_ranks=2, parked=frozenset({3}))  # fmt: skip
    d = decide([a], {0: 3}, DAY)
    (m,) = d.moves
    assert m.release == () and (m.before, m.after) == (2, 2)


def test_a_replica_with_a_stage_on_a_lost_node_is_parked_not_regrouped() -> None:
    """TP=2 x PP=2 on nodes of 2 slots: replicas (0 1 | 2 3) and (4 5 | 6 7), each stage on
    a node of its own. Node 1 is lost and the plan comes before the coordinator excluded its
    slots: grouped without ranks 2 and 3, ranks 0 1 paired with 4 5, and a heavier task took
    6 7, half of the one whole replica. Now the broken replica's live ranks wait (parked),
    and nothing of the whole one is given away for less than a replica."""
    held = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    assert replicas.groups(held, (2, 2)) == ((0, 1, 2, 3), (4, 5, 6, 7))
    a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks=held, running=True,
                 microbatches=8, replica_ranks=4, tp=2)  # fmt: skip
    d = decide([a, view("b", 5, 2, 2, {}, running=False)], {0: 2, 2: 2, 3: 2}, DAY)
    assert moves(d) == {"a": (4, 4), "b": (0, 0)}
    assert all(m.release == () for m in d.moves)


def test_replicas_are_packed_but_never_all_on_one_node_where_another_has_room() -> None:
    """Found by the cluster soak: a task packed onto one node lost every replica with that
    node and went back to its checkpoint, redoing steps; a second node holds one replica."""
    d = decide([view("a", 1, 2, 4, {}, running=False)], {0: 4, 1: 4}, DAY)
    (m,) = d.moves
    assert (m.after, m.add_on) == (4, (0, 0, 0, 1))
    tp = TaskView(name="t", weight=1, min_workers=4, max_workers=4, ranks={}, running=False,
                  microbatches=8, replica_ranks=2)  # fmt: skip
    (m,) = decide([tp], {0: 4, 1: 4}, DAY).moves
    assert m.add_on == (0, 0, 1, 1)
    # one replica alone: nothing to spread
    (m,) = decide([view("c", 1, 1, 1, {}, running=False)], {0: 4, 1: 4}, DAY).moves
    assert m.add_on == (0,)
    # shrinking to two replicas gives back from its biggest node rather than leave one node
    a = view("a", 1, 1, 4, {0: 0, 1: 0, 2: 0, 3: 1}, running=True)
    b = view("b", 5, 2, 2, {}, running=False)
    d = decide([a, b], {0: 3, 1: 1}, DAY)
    assert moves(d) == {"a": (4, 2), "b": (0, 2)}
    release = next(m for m in d.moves if m.task == "a").release
    kept = {n for r, n in a.ranks.items() if r not in release}
    assert kept == {0, 1}, release


def test_a_shrinking_task_gives_back_ranks_that_hold_no_state_first() -> None:
    """Found by the cluster soak: a node came back, its slots were readmitted (no state yet)
    and the plan gave back the task's replicas that held the state, leaving one holder; its
    next fault sent the task back to its checkpoint."""
    ranks = {0: 0, 1: 0, 2: 0, 5: 1, 8: 2, 9: 3}
    a = TaskView(name="a", weight=1, min_workers=2, max_workers=6, ranks=ranks, running=True,
                 microbatches=8, members=frozenset({5, 8, 9}))  # fmt: skip
    b = view("b", 5, 2, 2, {}, running=False)
    d = decide([a, b], {0: 3, 1: 1, 2: 1, 3: 1}, DAY)
    assert moves(d) == {"a": (6, 4), "b": (0, 2)}
    release = next(m for m in d.moves if m.task == "a").release
    assert set(release) <= {0, 1, 2}, release


def test_a_shrinking_task_gives_back_its_planned_slots_first_and_the_cluster_cancels_them() -> None:
    """Found by the cluster soak: a task held two real slots outside its epoch and one only
    planned (queued until its node frees); the plan gave back the real ones, the release of
    a planned rank had no effect, and with a node lost the task fell below its minimum."""
    from unicron.control.planning import cancel_planned

    ranks = {0: 0, 1: 0, 2: 1}  # 2: the task's first queued addition (after its 2 placed)
    a = TaskView(name="a", weight=1, min_workers=1, max_workers=6, ranks=ranks, running=True,
                 microbatches=8, members=frozenset({0}), planned=frozenset({2}))  # fmt: skip
    b = view("b", 5, 1, 1, {}, running=False)
    d = decide([a, b], {0: 2, 1: 1}, DAY)  # it gives one back: not real rank 1
    assert moves(d) == {"a": (3, 2), "b": (0, 1)}
    (release,) = (m.release for m in d.moves if m.task == "a")
    assert release == (2,)
    pending = [("a", 2), ("b", 1), ("a", 0)]
    assert cancel_planned(pending, "a", release, placed=2) == [("b", 1), ("a", 0)]
    assert cancel_planned(pending, "a", (3, 1), placed=2) == [("a", 2), ("b", 1)]
    assert cancel_planned(pending, "b", (0,), placed=2) == pending


def test_the_slots_a_cluster_could_give_a_task_are_free_or_held_above_a_minimum() -> None:
    """What each running task could still get from the planner (the coordinator waits for
    them below its minimum instead of failing): free slots of live nodes, and what other
    running tasks hold above their minimums; not an excluded slot, a lost node's, or a rank
    given back but not yet gone (it holds its slot until then)."""
    from unicron.control.planning import Task, spare_slots
    from unicron.control.state import NodeRow, TaskRow
    from unicron.control.taskspec import TaskSpec

    def task(name: str, placement: list[int], lo: int, *, running: bool = True) -> Task:
        spec = TaskSpec(name=name, script="t.py", workers={"min": lo, "max": 8})
        row = TaskRow(name, f"{name}.1", {}, "running" if running else "queued", 0.0, placement)
        return Task(row, spec, controller=object() if running else None)  # type: ignore[arg-type]

    live = {n: NodeRow(n, f"n{n}", 4, f"10.0.0.{n}", "", 0.0) for n in (0, 1)}  # node 2 lost
    a = task("a", [0, 0, 0, 1, 2], 2)  # 4 on live nodes: 2 above its minimum
    b = task("b", [1, 1, -1], 1)  # rank 2 given back long ago (-1)
    b.excluded.add(1)  # its slot is nobody's: b holds 1, none above its minimum
    c = task("c", [1], 1)
    c.leaving.add(0)  # given back, not gone yet: its slot is used, c holds 0
    q = task("q", [], 3, running=False)
    # node 0: 4 - 3 (a) = 1 free; node 1: 4 - 1 (a) - 1 (b) - 1 (c) - 1 (b's excluded) = 0
    assert spare_slots(live, [a, b, c, q]) == {"a": 1, "b": 1 + 2, "c": 1 + 2}
    assert spare_slots(live, [task("run", [0, 0, 0, 0, 1, 1, 1, 1], 8)]) == {"run": 0}


def test_planned_ranks_group_as_they_will_once_placed() -> None:
    """Found in review: the slots queued for a task were numbered before its placed ones
    (-1, -2, ...), so a replica half placed and half queued grouped with the placed replica
    that holds the state, and a shrink gave back half of that one. Numbered after the placed
    ranks, in queue order, the queued ones complete their own replica, which goes first."""
    ranks = {0: 0, 1: 0, 2: 0, 3: 0, 4: 2, 5: 2, 6: 1, 7: 1}  # 6, 7: queued on node 1
    a = TaskView(name="a", weight=1, min_workers=4, max_workers=8, ranks=ranks, running=True,
                 microbatches=8, replica_ranks=4, tp=2, members=frozenset({0, 1, 2, 3}),
                 planned=frozenset({6, 7}))  # fmt: skip
    b = view("b", 5, 4, 4, {}, running=False)
    d = decide([a, b], {0: 4, 1: 2, 2: 2}, DAY)
    assert moves(d) == {"a": (8, 4), "b": (0, 4)}
    (release,) = (m.release for m in d.moves if m.task == "a")
    assert sorted(release) == [4, 5, 6, 7]


def test_a_replica_of_several_ranks_is_added_whole_once_all_its_slots_are_free() -> None:
    """Found in review: the cluster added a planned replica a rank at a time as its nodes
    freed up, and gave each rank its place at once; a replica split over two ticks was then
    numbered across two planned replicas (a rank built one stage, its epoch wanted another;
    two one-node replicas each spanned two nodes). Now a task of several ranks per replica
    gets all its queued slots in one tick, once every one is free; a task of one rank per
    replica each as it is free, before queued tasks start."""
    from types import SimpleNamespace

    from unicron.control.planning import settle

    def task(state: str, ranks: int, running: bool) -> Any:
        spec = SimpleNamespace(device="cpu", replica_ranks=ranks)
        return SimpleNamespace(row=SimpleNamespace(state=state), spec=spec,
                               controller=object() if running else None)  # fmt: skip

    tasks = {"mp": task("running", 4, True), "dp": task("running", 1, True),
             "q": task("queued", 1, False)}  # fmt: skip
    pending = [("mp", 1)] * 4 + [("mp", 2)] * 4 + [("dp", 1), ("dp", 2), ("q", 2)]
    now = settle(pending, {1: 3, 2: 5}, tasks, {})  # node 1 has 3 of mp's 4 free
    assert now.add == [("dp", 1), ("dp", 2)] and now.start == {"q": [2]}
    assert now.kept == [("mp", 1)] * 4 + [("mp", 2)] * 4
    later = settle(now.kept, {1: 4, 2: 4}, tasks, {})
    assert later.add == now.kept and later.kept == []
    placement = {r: n for r, n in enumerate([0] * 4 + [n for _, n in later.add])}
    assert replicas.groups(placement, (2, 2)) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    gone = settle(pending, {2: 8}, tasks, {2: 0})  # node 1 gone (node 2 without CUDA: cpu)
    assert all(name != "mp" for name, _ in gone.add + gone.kept)  # no part of a replica
    assert gone.add == [("dp", 2)] and gone.start == {"q": [2]}
