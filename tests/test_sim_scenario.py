"""The sim-to-real scenario in the simulator (:mod:`unicron.sim.scenario`): the file, the
measured tables, and the Unicron policy's runtime-faithful options (a reserved minimum, a
measured transition, the join delay of a growing task)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from unicron.errors import UsageError
from unicron.sim import scenario as S

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sim" / "simreal.yaml"
RATES = {"light": {1: 0.5, 2: 1.0}, "heavy": {2: 1.0, 3: 1.5}}


def constants(**more: float) -> S.Constants:
    return S.Constants(rates=RATES, **{"node_detect_s": 0.5, "transition_s": 0.2, **more})


def test_the_example_scenario_loads_and_starts_as_the_real_cluster_does() -> None:
    sc = S.load(EXAMPLE)
    assert sc.nodes == 5 and [t.name for t in sc.tasks] == ["light", "heavy"]
    assert sc.script.is_file() and [e.action for e in sc.trace][:2] == ["remove", "add"]
    prepared = S.prepare(sc, RATES)
    assert prepared.reference == {"light": 2, "heavy": 3}  # what allocation.decide starts with


GOOD = "nodes: 2\nduration_s: 10\nscript: {script}\ntasks: [{{name: a}}]\n"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("trace: [[1, remove, n5]]\n", "unknown node 'n5'"),
        ("trace: [[1, add, n0]]\n", "node n0 is already up"),
        ("trace: [[3, remove, n0], [2, add, n0]]\n", "seconds: must be a number >= 3"),
        ("trace: [[12, remove, n0]]\n", "not before duration_s"),
        ("trace: [[1, explode, n0]]\n", "action must be remove or add"),
        ("colour: red\n", "unknown field 'colour'"),
    ],
)
def test_a_bad_scenario_is_one_line(tmp_path: Path, extra: str, says: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(GOOD.format(script=EXAMPLE) + extra)
    with pytest.raises(UsageError, match=says) as err:
        S.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    ("tasks", "says"),
    [
        ("[{name: a, min: 3, max: 2}]", r"min \(3\) is above max \(2\)"),
        ("[{name: a, weight: 0}]", "weight: must be > 0"),
        ("[{name: a}, {name: a}]", "names must be unique"),
        ("[]", "tasks: must be a non-empty list"),
    ],
)
def test_bad_tasks_are_refused(tmp_path: Path, tasks: str, says: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"nodes: 2\nduration_s: 10\nscript: {EXAMPLE}\ntasks: {tasks}\n")
    with pytest.raises(UsageError, match=says):
        S.load(path)


def test_unmeasured_worker_counts_follow_the_runtime_model_from_the_nearest_measured() -> None:
    task = S.ScenarioTask(name="t", weight=1.0, min_workers=1, max_workers=3)
    table = S.measured_table(task, {2: 1.0}, 5, 8)
    model = S.model_table(task, 5, 8)  # M / ceil(M / k): 1, 2, 8/3 (capped at 3 workers)
    assert list(model) == pytest.approx([0, 1, 2, 8 / 3, 0, 0])
    assert list(table) == pytest.approx([0, 0.5, 1.0, 4 / 3, 0, 0])


def test_a_lost_node_costs_detection_and_transition_and_the_planner_moves_a_slot() -> None:
    sc = S.load(EXAMPLE)
    r = S.simulate(sc, constants())
    heavy = next(t for t in r.tasks if t.name == "heavy")
    light = next(t for t in r.tasks if t.name == "light")
    assert heavy.breakdown_s["detection"] == pytest.approx(2 * 0.5)  # two losses of heavy's
    assert light.breakdown_s["detection"] == pytest.approx(0.5)  # one of light's
    assert heavy.transitions >= 2 and light.transitions >= 2  # slots moved light -> heavy
    total = r.effective_fraction + sum(r.breakdown_s.values()) / r.duration_s
    assert total == pytest.approx(1.0)


def test_a_join_delay_keeps_a_growing_task_at_its_old_size_for_that_long() -> None:
    sc = S.load(EXAMPLE)
    fast = S.simulate(sc, constants())
    cold = S.simulate(sc, constants(join_cold_s=10.0))
    assert cold.accumulated_waf < fast.accumulated_waf
    light = next(t for t in cold.tasks if t.name == "light")
    assert (
        light.breakdown_s["sub_healthy"]
        > next(t for t in fast.tasks if t.name == "light").breakdown_s["sub_healthy"]
    )
    # every growth of the example lands on a node new to its task: a warm delay changes nothing
    warm = S.simulate(sc, constants(join_s=10.0))
    assert warm.accumulated_waf == pytest.approx(fast.accumulated_waf)


def test_the_minimum_is_reserved_unless_preemption_is_switched_on() -> None:
    from unicron.sim import engine
    from unicron.sim.policies import Unicron
    from unicron.sim.trace import TraceEvent

    sc = S.load(EXAMPLE)
    prepared = S.prepare(sc, {"light": {1: 1.0}, "heavy": {3: 3.0}})
    # four of five nodes lost: light (weight 1) and heavy (weight 3) have one node left
    trace = [
        *S.sim_trace(sc)[: sc.nodes],
        *(TraceEvent(time_s=1.0, action="remove", node=n) for n in ("n0", "n2", "n3")),
    ]
    for preempt, light_nodes in ((False, 1), (True, 0)):
        policy = Unicron(node_detect_s=0.1, transition_fixed_s=0.1, preempt_below_min=preempt)
        r = engine.simulate(prepared, trace, policy, duration_s=10.0)
        light = next(t for t in r.tasks if t.name == "light")
        assert light.final_nodes == light_nodes, preempt


def test_plan_flops_are_what_the_planner_sees_and_flops_what_is_booked() -> None:
    sc = S.load(EXAMPLE)
    p = S.prepare(sc, RATES).by_name("heavy")
    assert p.plan_flops is not None and not np.array_equal(p.plan_flops, p.flops)
    assert p.flops[3] == pytest.approx(1.5)


def test_a_task_never_placed_reserves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"nodes: 5\nduration_s: 30\nmicrobatches: 10\nscript: {EXAMPLE}\n"
        "tasks: [{name: light, weight: 1, max: 4}, {name: heavy, weight: 3, max: 5}]\n"
        "trace: [[5, remove, n4]]\n"
    )
    sc = S.load(path)
    assert S.prepare(sc, {"light": {1: 1.0}, "heavy": {5: 5.0}}).reference == {
        "light": 0,
        "heavy": 5,
    }
    consts = S.Constants(
        rates={"light": {1: 1.0}, "heavy": {5: 5.0}}, node_detect_s=0.5, transition_s=0.2
    )
    r = S.simulate(sc, consts)  # queued in the runtime: heavy keeps the four nodes left
    assert {t.name: t.final_nodes for t in r.tasks} == {"light": 0, "heavy": 4}
