"""The exact reduction: the same bits for any grouping of micro-batches over replicas.

Pure tests of the tree and the bucket plan; adversarial float32 gradients (the whole float32
range, cancellations, one huge micro-batch among tiny ones) summed under many simulated
groupings, against the float64 sum it replaces; and the real exchange over gloo, with one
thread per member.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from unicron.runtime.ledger import assign
from unicron.runtime.reduce import (
    Exchange,
    Gatherer,
    Layout,
    LocalSums,
    Workspace,
    absorb,
    chunks,
    combine,
    cover,
    split,
)

M = 8
SIZES = (700, 3, 1200, 96)  # parameters of a small "model"
CAP = 1000  # elements per bucket: three buckets
Grouping = list[list[int]]  # per replica, its micro-batch ids in the order it adds them


def test_the_tree_splits_at_the_largest_power_of_two() -> None:
    assert split((0, 8)) == ((0, 4), (4, 8))
    assert split((0, 6)) == ((0, 4), (4, 6))
    assert split((4, 7)) == ((4, 6), (6, 7))
    assert split((3, 4)) is None


def test_cover_and_absorb() -> None:
    assert cover(range(8), 8) == [(0, 8)]
    assert cover([2, 3], 8) == [(2, 4)]
    assert cover([0, 1, 2], 8) == [(0, 2), (2, 3)]
    assert cover([1, 2], 8) == [(1, 2), (2, 3)]
    assert cover([], 8) == []
    assert absorb([(0, 2), (3, 4)], 2, 8) == ([(3, 4), (0, 2)], (0, 4))
    assert absorb([(0, 1)], 2, 8) == ([], (2, 3))
    with pytest.raises(AssertionError, match="already held"):
        absorb([(0, 4)], 2, 8)


def test_combine_evaluates_the_tree_over_any_partition() -> None:
    # strings show the order of the additions: the same for every partition of the leaves
    def leaves(nodes: list[tuple[int, int]]) -> str:
        return combine({n: str(n[0]) for n in nodes}, 5, lambda a, b: f"({a}+{b})") or ""

    want = "(((0+1)+(2+3))+4)"
    assert leaves([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]) == want
    parts = {(0, 2): "(0+1)", (2, 4): "(2+3)", (4, 5): "4"}
    assert combine(parts, 5, lambda a, b: f"({a}+{b})") == want
    assert combine({(2, 3): "2"}, 5, lambda a, b: a + b) == "2"  # the rest dropped


def test_bucket_plan() -> None:
    layout = Layout.plan(SIZES, CAP)
    assert layout.offsets == (0, 700, 703, 1903)
    # from the last parameter backwards: [96 + 1200 > cap] -> {96}, {1200}, {3, 700}
    assert layout.buckets == ((1903, 1999), (703, 1903), (0, 703))
    assert layout.bucket_of == (2, 2, 1, 0)
    assert Layout.plan(SIZES, 10**9).buckets == ((0, 1999),)
    assert Layout.plan(SIZES, 10**9, first_cap=100).buckets == ((1903, 1999), (0, 1903))
    assert chunks(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    starts, total = layout.out_starts(4)
    assert starts == [0, 96, 1296] and total == 1296 + 704


def adversarial_leaves(seed: int = 0) -> list[torch.Tensor]:
    """M float32 gradients whose float64 sum depends on the order of addition."""
    n = sum(SIZES)
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(M, n, generator=g) < 0.5, -1.0, 1.0).double()
    expo = torch.randint(-126, 127, (M, n), generator=g).double()
    leaves = (sign * torch.rand(M, n, generator=g).double().add(1.0) * 2.0**expo).float()
    leaves[:, :100] = 1.0  # cancellations: x + 1 - x
    leaves[0, :100], leaves[5, :100] = 2.0**100, -(2.0**100)
    leaves[3, 100:200] = 3.0e38  # one huge micro-batch among tiny ones
    leaves[[0, 1, 2, 4, 5, 6, 7], 100:200] = 1.0e-30
    return list(leaves)


def groupings() -> list[Grouping]:
    rng = random.Random(1)
    out: list[Grouping] = [assign(range(M), w) for w in range(1, M + 1)]
    out += [
        [[0, 1, 5], [2, 3, 4, 6, 7]],  # after a failure: a survivor did a lost leaf
        [[7, 6, 0], [5, 1], [4, 3, 2]],  # added out of order
    ]
    for _ in range(20):  # random partitions, random orders
        ids = list(range(M))
        rng.shuffle(ids)
        cuts = sorted(rng.sample(range(1, M), rng.randint(0, M - 1)))
        out.append([ids[a:b] for a, b in zip([0, *cuts], [*cuts, M], strict=True)])
    return out


def feed(
    sums: LocalSums,
    ids: list[int],
    leaves: list[torch.Tensor],
    on_bucket: Callable[[int], None] = lambda b: None,
) -> LocalSums:
    """Add micro-batches as the worker does: parameter by parameter, last one first, telling
    ``on_bucket`` which buckets the last micro-batch completes, as they complete."""
    layout = sums.layout
    for k, mb in enumerate(ids):
        sums.begin(mb)
        for i in reversed(range(len(layout.sizes))):
            if i == 1 and mb % 3 == 0:
                continue  # a parameter without a gradient in this micro-batch: zeros
            lo = layout.offsets[i]
            b = sums.add(i, leaves[mb][lo : lo + layout.sizes[i]].clone())
            if b is not None and k == len(ids) - 1:
                on_bucket(b)
        for b in sums.end(float(mb)):
            if k == len(ids) - 1:
                on_bucket(b)
    return sums


def local_sums(ids: list[int], leaves: list[torch.Tensor], layout: Layout) -> LocalSums:
    sums = feed(LocalSums(layout, M, exact=True, dtype=torch.float32), ids, leaves)
    assert sorted(sums.nodes) == cover(ids, M)
    return sums


def tree_reduce(grouping: Grouping, leaves: list[torch.Tensor]) -> torch.Tensor:
    """The exchange without processes: every owner combines its chunk of every bucket."""
    layout = Layout.plan(SIZES, CAP)
    replicas = [local_sums(ids, leaves, layout) for ids in grouping]
    out = torch.empty(layout.numel)
    for lo, hi in layout.buckets:
        for a, z in chunks(hi - lo, len(grouping)):
            got = {n: s.nodes[n][lo + a : lo + z].clone() for s in replicas for n in s.nodes}
            root = combine(got, M, lambda x, y: x.add_(y))
            assert root is not None
            out[lo + a : lo + z] = root
    return out


def float64_reduce(grouping: Grouping, leaves: list[torch.Tensor]) -> torch.Tensor:
    """What exact mode did before: float64 sums per replica, summed in float64, cast."""
    total = torch.zeros(leaves[0].numel(), dtype=torch.float64)
    for ids in grouping:
        local = torch.zeros_like(total)
        for mb in ids:
            local += leaves[mb].double()
        total += local
    return total.float()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_adversarial_gradients_same_bits_for_every_grouping() -> None:
    leaves = adversarial_leaves()
    ref = tree_reduce([list(range(M))], leaves)
    assert ref[:100].eq(0.0).all()  # ((2^100 + 1) + 1...) loses the ones: fine, but fixed
    for grouping in groupings():
        assert torch.equal(bits(tree_reduce(grouping, leaves)), bits(ref)), grouping
    # the float64 sum it replaces is not exact for these values: regrouping changes bits
    old = float64_reduce([list(range(M))], leaves)
    differ = [g for g in groupings() if not torch.equal(float64_reduce(g, leaves), old)]
    assert len(differ) >= 5, differ


class _Gloo:
    """:class:`unicron.runtime.reduce.Collectives` over a plain gloo group (no epochs)."""

    def __init__(self, pg: Any, rank: int, world: int) -> None:
        self.pg, self.rank, self.world = pg, rank, world

    def start_alltoall(self, out: Any, inp: Any, outs: list[int], ins: list[int]) -> Any:
        return self.pg.alltoall_base(out, inp, outs, ins, dist.AllToAllOptions())

    def start_allgather(self, out: Any, inp: Any) -> Any:
        return self.pg._allgather_base(out, inp)

    def start_allreduce(self, tensor: Any) -> Any:
        return self.pg.allreduce([tensor])

    def wait(self, work: Any) -> None:
        work.wait(timedelta(seconds=30))


def gloo_reduce(
    grouping: Grouping, leaves: list[torch.Tensor], *, exact: bool, overlap: bool = False
) -> torch.Tensor:
    """The real :class:`Exchange`, one thread per member on a gloo group (``overlap``: the
    exact all-gathers on a second group, started before ``finish`` by one :class:`Gatherer`
    that serves two steps in a row, as a worker's serves every step of an epoch)."""
    world, layout = len(grouping), Layout.plan(SIZES, CAP)
    store = dist.HashStore()
    results: dict[int, list[torch.Tensor]] = {r: [] for r in range(world)}

    def member(rank: int) -> None:
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
        gather = None
        if overlap:
            pg2 = dist.ProcessGroupGloo(
                dist.PrefixStore("gather", store), rank, world, timedelta(seconds=30)
            )
            gather = Gatherer(_Gloo(pg2, rank, world))
        ids = grouping[rank]
        sums = LocalSums(layout, M, exact=exact, dtype=torch.float32)
        for _ in range(2 if overlap else 1):
            feed(sums, ids[:-1], leaves)
            held = [cover(ids, M) for ids in grouping]
            space = Workspace(layout, world, torch.float32)
            ex = Exchange(_Gloo(pg, rank, world), sums, space, held, gather)
            launched: list[tuple[int, None, int]] = []

            def ready(b: int, ex: Exchange = ex, launched: list[Any] = launched) -> None:
                launched.append((b, ex.ready(b), ex.launched))

            # the last micro-batch starts the buckets as they are done, in order (0 waits for none)
            feed(sums, ids[-1:], leaves, ready)
            assert [(b, n) for b, _, n in launched] == ([(0, 1), (1, 2), (2, 3)] if ids else [])
            if overlap and exact and ids:  # every gather starts without waiting for finish()
                deadline = time.monotonic() + 20
                while ex.gathered < len(layout.buckets) and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert ex.gathered == len(layout.buckets)
            elif ids:
                assert ex.gathered == 0
            kept = {n: t.clone() for n, t in sums.nodes.items()}
            grads, losses = ex.finish()
            ex.close()
            assert losses == [float(mb) for mb in range(M)]
            # the partial results are untouched until the step commits (read in place, never
            # added to)
            assert kept.keys() == sums.nodes.keys()
            assert all(torch.equal(bits(sums.nodes[n]), bits(t)) for n, t in kept.items())
            results[rank].append(torch.cat(grads))
            sums.clear()
        if gather is not None:
            gather.stop()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(results[r] for r in range(world))
    for r in range(world):
        for got in results[r]:
            assert torch.equal(bits(got), bits(results[0][0]))
    return results[0][0]


@pytest.mark.timeout(60)
def test_the_exchange_over_gloo_gives_the_same_bits() -> None:
    leaves = adversarial_leaves()
    ref = tree_reduce([list(range(M))], leaves)
    groupings = [[list(range(M))], assign(range(M), 2), assign(range(M), 4)]
    for grouping in [*groupings, [[0, 1, 5], [2, 3, 4, 6, 7], []], [[6], [0, 1, 2, 3, 4, 5], [7]]]:
        for overlap in (False, True):
            got = gloo_reduce(grouping, leaves, exact=True, overlap=overlap)
            assert torch.equal(bits(got), bits(ref))
    # fast mode is a plain float32 sum: right to rounding on tame values, not exact
    tame = [torch.linspace(-1, 1, sum(SIZES)) * (mb + 1) for mb in range(M)]
    fast = gloo_reduce(assign(range(M), 2), tame, exact=False)
    want = torch.stack(tame).sum(0)
    want[700:703] -= tame[0][700:703] + tame[3][700:703] + tame[6][700:703]  # no gradient there
    assert torch.allclose(fast, want, rtol=1e-5, atol=1e-5)


def hook_into(sums: LocalSums, params: list[torch.Tensor]) -> None:
    """The worker's gradient hooks: each parameter's gradient to :meth:`LocalSums.hooked`."""

    def hook(i: int, p: torch.Tensor) -> None:
        sums.hooked(i, p)

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(functools.partial(hook, i))


def feed_autograd(
    sums: LocalSums, ids: list[int], leaves: list[torch.Tensor], *, first: bool
) -> LocalSums:
    """Add micro-batches as the worker does: real parameters, each micro-batch's backward
    pass accumulating into :meth:`LocalSums.grad_views` (set as ``.grad``), the gradient
    hooks calling :meth:`LocalSums.landed`; a micro-batch that starts a node through the
    hooks' :meth:`LocalSums.add` unless ``first`` (the worker's choice for large parameters,
    ``VIEWS_FIRST_MAX``). Parameter 1 has no gradient where :func:`feed` gives it none."""
    layout = sums.layout
    shapes = [torch.Size([n]) if n % 2 else torch.Size([2, n // 2]) for n in layout.sizes]
    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]

    hook_into(sums, params)
    for mb in ids:
        sums.begin(mb)
        views = sums.grad_views(shapes) if first or not sums.starting else [None] * len(params)
        for p, view in zip(params, views, strict=True):
            p.grad = view
        loss = torch.zeros(())
        for i, p in enumerate(params):
            if not (i == 1 and mb % 3 == 0):
                lo = layout.offsets[i]  # d(loss)/dp = the leaf's slice, exactly
                loss = loss + (p * leaves[mb][lo : lo + layout.sizes[i]].view(p.shape)).sum()
        loss.backward()
        assert all(
            p.grad is view for p, view in zip(params, views, strict=True) if view is not None
        )
        sums.end(float(mb))
        for p in params:
            p.grad = None
    return sums


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("exact", [True, False])
def test_autograd_accumulating_into_the_sums_gives_the_same_bits(exact: bool, first: bool) -> None:
    # the worker's default path (autograd adds each gradient into its view of a node buffer)
    # against LocalSums.add, for every grouping and order (siblings merged, out of order):
    # the same nodes, the same bits, -0.0 kept (a node's buffer starts as -0.0, not +0.0)
    layout = Layout.plan(SIZES, CAP)
    for seed in range(2):
        leaves = adversarial_leaves(seed)
        for leaf in leaves:
            leaf[200:210] = -0.0  # every micro-batch's: the sum is -0.0 too
        leaves[2][210:220] = -0.0
        leaves[2][700:703] = -0.0  # parameter 1, which micro-batches 0, 3, 6 lack (+0.0)
        for grouping in groupings():
            for ids in grouping:
                sums = LocalSums(layout, M, exact=exact, dtype=torch.float32)
                for _ in range(2):  # again on the first step's buffers
                    want = feed(LocalSums(layout, M, exact=exact, dtype=torch.float32), ids, leaves)
                    got = feed_autograd(sums, ids, leaves, first=first)
                    assert got.nodes.keys() == want.nodes.keys()
                    for n in want.nodes:
                        assert torch.equal(bits(got.nodes[n]), bits(want.nodes[n])), (ids, n)
                    sums.clear()
                if exact and ids == [2]:
                    assert bits(sums._free[0][200:220]).eq(bits(torch.tensor(-0.0))).all()


@pytest.mark.parametrize("exact", [True, False])
def test_sums_reuse_their_buffers_from_step_to_step(exact: bool) -> None:
    # steady state: the second step allocates nothing, and what the buffers held before (the
    # last step's sums) never leaks into the new ones: the same bits as fresh sums
    layout = Layout.plan(SIZES, CAP)
    steps = [adversarial_leaves(seed) for seed in range(3)]
    for ids in ([0, 1, 2, 3], [4, 5, 6], [7, 2, 0]):
        sums = LocalSums(layout, M, exact=exact, dtype=torch.float32)
        for k, leaves in enumerate(steps):
            feed(sums, ids, leaves)
            fresh = feed(LocalSums(layout, M, exact=exact, dtype=torch.float32), ids, leaves)
            assert sums.nodes.keys() == fresh.nodes.keys()
            for n in sums.nodes:
                assert torch.equal(bits(sums.nodes[n]), bits(fresh.nodes[n])), (ids, k, n)
            if k == 0:
                first = sums.allocated
            assert sums.allocated == first, (ids, k)  # nothing new after the first step
            sums.clear()


def test_sums_keep_only_the_buffers_a_step_used() -> None:
    layout = Layout.plan(SIZES, CAP)
    leaves = adversarial_leaves()
    sums = LocalSums(layout, M, exact=True, dtype=torch.float32)
    feed(sums, [0, 1, 2], leaves)  # (0, 2) and (2, 3): two buffers at once
    sums.clear()
    assert sums.allocated == 2
    feed(sums, [0, 1, 2], leaves)
    sums.clear()
    assert sums.allocated == 2  # reused
    feed(sums, [4], leaves)  # a step that needs one: the other is let go at its end
    sums.clear()
    feed(sums, [0, 1, 2], leaves)
    assert sums.allocated == 3


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_gradient_autograd_put_elsewhere_is_copied_in() -> None:
    # backward(create_graph=True) replaces .grad with a new tensor (the view + the gradient)
    # instead of adding into the view: landed() copies it in, the same values as add()
    layout = Layout.plan([6, 4], 100)
    nodes = {}
    for viewing in (False, True):
        sums = LocalSums(layout, 2, exact=True, dtype=torch.float32)
        params = [torch.zeros(6, requires_grad=True), torch.zeros(4, requires_grad=True)]
        hook_into(sums, params)
        for mb in range(2):
            sums.begin(mb)
            views = sums.grad_views([p.shape for p in params]) if viewing else [None, None]
            for p, view in zip(params, views, strict=True):
                p.grad = view
            g = torch.Generator().manual_seed(mb)
            loss = sum(((p * p + p) * torch.randn(p.shape, generator=g)).sum() for p in params)
            assert isinstance(loss, torch.Tensor)
            loss.backward(create_graph=True)
            if viewing:
                assert not any(p.grad is view for p, view in zip(params, views, strict=True))
            sums.end(float(mb))
            for p in params:
                p.grad = None
        nodes[viewing] = sums.nodes[(0, 2)].detach()
    assert torch.equal(bits(nodes[True]), bits(nodes[False]))
