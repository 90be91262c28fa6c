"""Simulator engine and policies: steady throughput, hang cost, determinism, accounting."""

from __future__ import annotations

import math

import pytest

from unicron.sim.engine import TaskSpec, Workload, paper_workload, prepare, simulate
from unicron.sim.metrics import PolicyResult
from unicron.sim.policies import POLICIES, make_policy
from unicron.sim.task import LOSSES
from unicron.sim.trace import TraceEvent, generate

DAY = 86400.0


@pytest.fixture(scope="module")
def small():
    wl = Workload(
        nodes=4,
        gpus_per_node=8,
        gpu="A800-80GB",
        tasks=(
            TaskSpec(name="a", model="gpt-1.3b", global_batch=256, weight=1.0, max_nodes=2),
            TaskSpec(name="b", model="gpt-6.7b", global_batch=512, weight=2.0, max_nodes=2),
        ),
    )
    return prepare(wl)


def _check_identity(r: PolicyResult) -> None:
    lost = sum(r.breakdown_s[k] for k in LOSSES)
    assert r.effective_fraction + lost / r.duration_s == pytest.approx(1.0, abs=1e-9)
    for t in r.tasks:
        if t.ref_waf == 0:  # the reference plan gives it nothing: no per-task baseline
            continue
        lost_t = sum(t.breakdown_s[k] for k in LOSSES)
        assert t.effective_fraction + lost_t / r.duration_s == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_failures_runs_at_steady_throughput(small, name):
    policy = make_policy(name)
    r = simulate(small, [], policy, duration_s=DAY)
    assert small.reference == {"a": 2, "b": 2}
    expected = 0.0
    for p in small.perf:
        ref = p.spec.weight * p.flops[small.reference[p.spec.name]]
        task = next(t for t in r.tasks if t.name == p.spec.name)
        assert task.breakdown_s["detection"] == task.breakdown_s["transition"] == 0.0
        assert task.breakdown_s["idle"] == task.breakdown_s["lost_work"] == 0.0
        assert task.faults == 0
        expected += ref * DAY
    # steady overheads: synchronous checkpoints, redundant computation (unicron's layouts here
    # keep each share of the optimizer state twice and heal from peers: no checkpoint)
    factor = {"megatron", "megatron-30m", "megatron-wait", "varuna", "bamboo"}
    if name in factor:
        assert r.accumulated_waf < expected
        assert r.breakdown_s["sub_healthy"] > 0
    else:
        assert r.accumulated_waf == pytest.approx(expected, rel=1e-12)
        assert r.effective_fraction == pytest.approx(1.0, rel=1e-12)
    _check_identity(r)


def test_steady_rate_is_the_policy_factor(small):
    r = simulate(small, [], make_policy("bamboo"), duration_s=DAY)
    assert r.effective_fraction == pytest.approx(0.288, rel=1e-9)


@pytest.mark.parametrize(
    ("name", "timeout"), [("megatron", 600.0), ("megatron-30m", 1800.0), ("megatron-wait", 600.0)]
)
def test_hang_under_megatron_costs_the_timeout(small, name, timeout):
    # node1 belongs to task "a" (cluster order, a is allocated first)
    trace = [TraceEvent(time_s=5000.0, action="fault", node="node1", signal="hang")]
    r = simulate(small, trace, make_policy(name), duration_s=DAY)
    a = next(t for t in r.tasks if t.name == "a")
    b = next(t for t in r.tasks if t.name == "b")
    assert a.faults == 1 and b.faults == 0
    assert a.down_s["detection"] == pytest.approx(timeout)
    assert a.down_s["transition"] > 0
    assert a.down_s["lost_work"] > 0  # rolled back to the last checkpoint
    assert b.down_s["detection"] == 0.0
    _check_identity(r)


@pytest.fixture(scope="module")
def tight():
    """gpt-6.7b on one node of A800s: its sharded optimizer state fits once (64 GiB of 72
    usable) but not twice (74 GiB), so the runtime cannot keep a second copy of each share."""
    wl = Workload(
        nodes=2,
        gpus_per_node=8,
        gpu="A800-80GB",
        tasks=(TaskSpec(name="b", model="gpt-6.7b", global_batch=512, weight=1.0, max_nodes=1),),
    )
    return prepare(wl)


@pytest.mark.parametrize("name", ["unicron", "unicron-all"])
def test_unicron_finds_a_hang_in_seconds(small, tight, name):
    """Healing from peers loses no work: these layouts shard the optimizer state, twice over
    where it fits (``zero: 1``); where it does not (``tight``), the runtime heals from the
    background checkpoint, at most one interval of work lost (``unicron-all``: from peers)."""
    trace = [TraceEvent(time_s=5000.0, action="fault", node="node1", signal="hang")]
    r = simulate(small, trace, make_policy(name), duration_s=DAY)
    a = next(t for t in r.tasks if t.name == "a")
    assert 1.0 < a.down_s["detection"] < 60.0
    assert a.down_s["lost_work"] == 0.0
    trace = [TraceEvent(time_s=5000.0, action="fault", node="node0", signal="hang")]
    b = next(t for t in simulate(tight, trace, make_policy(name), duration_s=DAY).tasks)
    if name == "unicron-all":
        assert b.down_s["lost_work"] == 0.0
    else:
        assert 0.0 < b.down_s["lost_work"] < 1000.0  # the interval: ~100 s here


def test_the_runtime_heals_from_peers_where_the_sharded_state_fits_twice(small, tight):
    """What the planner picks for these tasks shards the optimizer state (ZeRO-1); the runtime
    rebuilds it from a peer when it keeps each share twice (``zero: 1``), which needs the
    memory: :attr:`peer_healable` says so per node count. Where it does not fit (``tight``),
    the ``unicron`` policy checkpoints the task (Young/Daly, raised to the write time) and
    reloads the checkpoint on a failure, where ``unicron-all`` heals from peers."""
    from unicron.planner import PerfOptions, evaluate, layout_table

    a, b6 = small.perf
    for p in small.perf:
        assert p.peer_healable is not None and len(p.peer_healable) == 5
    assert a.peer_healable is not None and a.peer_healable[1:3].all()  # dist-opt, twice over
    assert b6.peer_healable is not None and b6.peer_healable[2] and not b6.peer_healable[1]
    (b,) = tight.perf
    assert b.peer_healable is not None and not b.peer_healable[1]
    gpu = tight.workload.gpu_type()
    cfg = layout_table(b.model, 512, 8, gpu, 8, unit=8, options=PerfOptions(exact_batch=False))[1]
    assert cfg is not None and cfg.layout is not None and cfg.layout.sharding == "dist-opt"
    assert cfg.usable_bytes is not None and cfg.memory_bytes_per_gpu <= cfg.usable_bytes
    twice = evaluate(b.model, 512, cfg.layout, gpu, 8, PerfOptions(exact_batch=False,
                                                                   optimizer_copies=2))  # fmt: skip
    assert twice.usable_bytes is not None and twice.memory_bytes_per_gpu > twice.usable_bytes
    assert twice.iter_time_s == pytest.approx(cfg.iter_time_s, rel=0.01)  # the second step
    runtime, everyone = make_policy("unicron"), make_policy("unicron-all")
    r = simulate(tight, [], runtime, duration_s=DAY)
    task = next(iter(runtime._sim.tasks.values()))  # type: ignore[union-attr]
    assert not runtime.peer_heals(task) and everyone.heals == "all"
    interval = runtime.checkpoint_interval_s(runtime._sim, task)  # type: ignore[arg-type]
    assert 10.0 < interval == runtime.ckpt_interval(task) < 3600.0
    assert 0.99 < r.effective_fraction < 1.0  # the copies before the background writes
    trace = [TraceEvent(time_s=5000.0, action="fault", node="node0", signal="exit")]
    lost = {}
    for name in ("unicron", "unicron-all"):
        rr = simulate(tight, trace, make_policy(name), duration_s=DAY)
        lost[name] = rr.tasks[0].down_s
    assert lost["unicron-all"]["lost_work"] == 0.0 < lost["unicron"]["lost_work"]
    assert lost["unicron"]["transition"] > lost["unicron-all"]["transition"]


def test_a_node_lost_while_healing_from_peers_loses_no_work_after_the_move() -> None:
    """A task whose layout heals from peers on two nodes but not on one: a node lost there
    costs nothing (its state lives on), and the checkpoints of the one-node layout start at
    the loss; before, the work since the task's start was counted lost at the next failure."""
    wl = Workload(
        nodes=2,
        gpus_per_node=8,
        gpu="A800-80GB",
        tasks=(TaskSpec(name="b", model="gpt-6.7b", global_batch=512, weight=1.0, max_nodes=2),),
    )
    prepared = prepare(wl)
    (b,) = prepared.perf
    assert b.peer_healable is not None and b.peer_healable[2] and not b.peer_healable[1]
    trace = [
        TraceEvent(time_s=30_000.0, action="remove", node="node1", signal="heartbeat_lost"),
        TraceEvent(time_s=40_000.0, action="fault", node="node0", signal="exit"),
    ]
    task = simulate(prepared, trace, make_policy("unicron"), duration_s=DAY).tasks[0]
    assert 0.0 < task.down_s["lost_work"] < 1000.0  # one interval at most, not 30,000 s


def test_lost_node_megatron_waits_unicron_replans(small):
    trace = [
        TraceEvent(time_s=1000.0, action="remove", node="node3", signal="heartbeat_lost"),
        TraceEvent(time_s=1000.0 + 6 * 3600, action="add", node="node3"),
    ]
    meg = simulate(small, trace, make_policy("megatron-wait"), duration_s=DAY)
    uni = simulate(small, trace, make_policy("unicron"), duration_s=DAY)
    b_meg = next(t for t in meg.tasks if t.name == "b")
    assert b_meg.down_s["idle"] == pytest.approx(6 * 3600 - 600, rel=1e-6)
    assert uni.accumulated_waf > meg.accumulated_waf
    _check_identity(meg)
    _check_identity(uni)


def test_same_seed_same_result():
    prepared = prepare(paper_workload())
    t1 = generate(nodes=16, duration_s=3 * DAY, rate_per_node_day=0.3, seed=7)
    t2 = generate(nodes=16, duration_s=3 * DAY, rate_per_node_day=0.3, seed=7)
    t3 = generate(nodes=16, duration_s=3 * DAY, rate_per_node_day=0.3, seed=8)
    assert t1 == t2 and t1 != t3
    for name in POLICIES:
        r1 = simulate(prepared, t1, make_policy(name), duration_s=3 * DAY)
        r2 = simulate(prepared, t2, make_policy(name), duration_s=3 * DAY)
        assert r1.to_json() == r2.to_json()
        assert r1.series == r2.series
        _check_identity(r1)


def test_harsh_trace_orders_policies():
    prepared = prepare(paper_workload())
    trace = generate(nodes=16, duration_s=7 * DAY, rate_per_node_day=0.5, seed=1)
    res = {n: simulate(prepared, trace, make_policy(n), duration_s=7 * DAY) for n in POLICIES}
    assert res["unicron"].accumulated_waf > res["megatron"].accumulated_waf
    assert res["megatron"].accumulated_waf >= res["megatron-30m"].accumulated_waf
    assert res["torchft"].lost_samples > 0
    assert all(math.isfinite(r.accumulated_waf) for r in res.values())


def test_peer_healing_covers_the_model_parallel_replicas_the_runtime_heals() -> None:
    """Replicated state in replicas of ``tp x pp`` ranks heal from a peer, their stages on one
    node or several (the runtime's model-parallel replicas, tests/test_model_parallel_e2e.py);
    sharded state, context or expert parallelism, interleaved stages, a tensor-parallel group
    wider than a node or a single replica do not."""
    from unicron.planner import Layout
    from unicron.sim.engine import heals_from_peers

    assert heals_from_peers(Layout(dp=8, sharding="ddp"), 8)
    assert heals_from_peers(Layout(tp=2, pp=2, dp=4, sharding="ddp"), 8)
    assert heals_from_peers(Layout(tp=8, pp=4, dp=2, sharding="ddp"), 8)  # a stage a node
    assert not heals_from_peers(Layout(tp=4, pp=4, dp=1, sharding="ddp"), 8)  # no other replica
    assert not heals_from_peers(Layout(tp=16, dp=2, sharding="ddp"), 8)  # TP across nodes
    assert not heals_from_peers(Layout(tp=2, dp=4, sharding="dist-opt"), 8)
    assert not heals_from_peers(Layout(cp=2, dp=4, sharding="ddp"), 8)
    assert not heals_from_peers(Layout(pp=2, vp=2, dp=4, sharding="ddp"), 8)
