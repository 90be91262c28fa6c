"""The fault soak's schedule and its per-fault measurement (bench/chaos.py), on plain data."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from bench.chaos import (
    FAULT_KINDS,
    FIRST_STEP,
    OUT_STEPS,
    OUT_STEPS_DEFAULT,
    STORE,
    WORKERS,
    measure_faults,
    same_state,
    scenario_name,
    schedule,
)
from unicron.runtime.inject import parse


def test_the_schedule_is_seeded_mixed_and_parseable() -> None:
    planned, steps = schedule(100, seed=3)
    assert planned == schedule(100, seed=3)[0] and planned != schedule(100, seed=4)[0]
    assert len(planned) == 100 and steps > planned[-1].step
    kinds = Counter(p.kind for p in planned)
    assert set(kinds) == set(FAULT_KINDS)  # every kind, about equally often
    assert max(kinds.values()) - min(kinds.values()) <= 1
    assert {p.rank for p in planned} == set(range(WORKERS))
    assert len({p.step for p in planned}) == 100 and planned[0].step == FIRST_STEP
    for p in planned:
        f = parse(p.spec)
        assert (f.rank, f.step) == (p.rank, p.step)


def test_more_workers_spread_the_faults_and_keep_their_own_results_file() -> None:
    planned, _ = schedule(100, seed=0, workers=8)
    assert {p.rank for p in planned} == set(range(8))
    assert scenario_name(5, (2, 1)) == "chaos-tp2"
    assert scenario_name(5, (2, 1), workers=8) == "chaos-w8-tp2"
    assert scenario_name(5) == "chaos"
    assert scenario_name(5, (2, 2), workers=8, depths="1") == "chaos-w8-tp2-pp2-ppc1"
    assert scenario_name(5, (2, 2), 8, "1", degrees="1") == "chaos-w8-tp2-pp2-ppc1-tpc1"


def test_two_runs_that_ended_at_other_degrees_compare_joined_whole(tmp_path: Path) -> None:
    """A soak with ``--tp-choices`` may end at TP=1 where the fault-free run ended at TP=2:
    the split entries' two slices are joined, the replicated ones taken once, and the largest
    difference of an entry is reported (0 for the same numbers)."""
    import torch

    from bench.chaos import joined_state, max_param_diff

    q = torch.arange(8.0).reshape(4, 2)  # blocks.0.attn.q.weight: column split (dim 0)
    norm = torch.ones(2)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for r in range(2):
        torch.save({"blocks.0.attn.q.weight": q.chunk(2)[r], "norm.weight": norm},
                   a / f"final.shard{r}.pt")  # fmt: skip
    torch.save({"blocks.0.attn.q.weight": q + 0.5, "norm.weight": norm}, b / "final.pt")
    assert torch.equal(joined_state(a, 2)["blocks.0.attn.q.weight"], q)
    assert max_param_diff(a, b, 2, 1) == 0.5
    assert max_param_diff(a, a, 2, 2) == 0.0


def test_two_runs_that_ended_at_other_depths_compare_by_name(tmp_path: Path) -> None:
    """A soak with layout changes may end at PP=1 where the fault-free run ended at PP=2:
    the final parameters are compared entry by entry, per tensor-parallel rank."""
    w = {f"blocks.{i}.w": torch.full((2,), float(i)) for i in range(2)}
    pp2, pp1 = tmp_path / "pp2", tmp_path / "pp1"
    for d in (pp2, pp1):
        d.mkdir()
    for place, names in enumerate((["blocks.0.w"], ["blocks.0.w"], ["blocks.1.w"], ["blocks.1.w"])):
        torch.save({n: w[n] + place % 2 for n in names}, pp2 / f"final.shard{place}.pt")
    for place in range(2):  # tensor rank 0 and 1 of one stage holding both blocks
        torch.save({n: t + place for n, t in w.items()}, pp1 / f"final.shard{place}.pt")
    assert same_state(pp2, pp1, tp=2)
    torch.save({n: t + 2 for n, t in w.items()}, pp1 / "final.shard1.pt")
    assert not same_state(pp2, pp1, tp=2)


def test_no_fault_is_planned_on_a_slot_an_earlier_one_took_out() -> None:
    # a fault on a slot that is restarting or excluded at its step never fires: the plan
    # keeps each slot free for its presumed time out after a fault (when every slot is out,
    # the one back first)
    for seed in range(5):
        planned, _ = schedule(100, seed=seed)
        back_at = dict.fromkeys(range(WORKERS), 0)
        for p in planned:
            if back_at[p.rank] > p.step:
                assert back_at[p.rank] == min(back_at.values()), (seed, p)
            back_at[p.rank] = p.step + OUT_STEPS.get(p.kind, OUT_STEPS_DEFAULT)
    planned, _ = schedule(100, seed=0)  # the soak's default plan: never
    back_at = dict.fromkeys(range(WORKERS), 0)
    for p in planned:
        assert back_at[p.rank] <= p.step, p
        back_at[p.rank] = p.step + OUT_STEPS.get(p.kind, OUT_STEPS_DEFAULT)


def test_each_fault_is_measured_to_its_slots_detection_and_the_next_step() -> None:
    events = [
        {"ts": 1.0, "event": "fault_injected", "fault": "hang", "rank": 2, "step": 5},
        {"ts": 1.2, "event": "error_detected", "slot": 1, "kind": "conn_reset"},  # another slot
        {"ts": 2.1, "event": "error_detected", "slot": 2, "kind": "hang"},
        {"ts": 2.2, "event": "action", "action": "restart"},
        {"ts": 2.5, "event": "step_end", "rank": 0, "step": 5, "duration_s": 0.1},
        {"ts": 3.0, "event": "fault_injected", "fault": "error", "kind": "ecc", "rank": 3},
        {"ts": 3.01, "event": "error_detected", "slot": 3, "kind": "ecc"},
        {"ts": 3.02, "event": "action", "action": "exclude"},
        {"ts": 3.3, "event": "step_end", "rank": 0, "step": 6, "duration_s": 0.1},
        {"ts": 4.0, "event": "fault_injected", "fault": "crash", "rank": 0, "step": 9},
        {"ts": 5.0, "event": "action", "action": "readmit"},
    ]
    m = measure_faults(events)
    assert (m["fired"], m["undetected"]) == (3, 1)  # the crash was never seen
    hang = m["by_kind"]["hang"]
    assert hang["detection_s"] == [2.1 - 1.0] and hang["recovery_s"] == [2.5 - 1.0]
    assert m["by_kind"]["error:ecc"]["detection_s"][0] == 3.01 - 3.0
    assert (m["exclusions"], m["readmissions"], m["restarts"]) == (1, 1, 1)
    assert m["steps_lost"] == 0 and m["median_step_s"] == 0.1


def test_store_kills_are_planned_on_no_slot_and_measured_to_the_loss_record() -> None:
    planned, _ = schedule(60, seed=3, store=True)
    kills = [p for p in planned if p.kind == STORE]
    assert len(kills) >= 2 and all(p.rank == -1 and p.spec.startswith("store:") for p in kills)
    assert STORE not in {p.kind for p in schedule(60, seed=3)[0]}
    assert scenario_name(5, store=True) == "chaos-store"
    events = [
        {"ts": 1.0, "event": "step_end", "rank": 0, "step": 4, "duration_s": 0.1},
        {"ts": 2.05, "event": "control_plane", "what": "the training store was lost: ..."},
        {"ts": 2.6, "event": "step_end", "rank": 0, "step": 5, "duration_s": 0.1},
    ]
    m = measure_faults(events, store_kills=[2.0, 9.0])  # the second never seen
    assert (m["fired"], m["undetected"]) == (2, 1)
    store = m["by_kind"][STORE]
    assert store["detection_s"] == [2.05 - 2.0] and store["recovery_s"] == [2.6 - 2.0]
