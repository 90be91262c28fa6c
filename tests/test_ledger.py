"""The micro-batch ledger: fixed samples per (step, micro-batch), assignment of missing ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron.runtime.ledger import Ledger, assign, mb_seed, missing


def test_samples_depend_only_on_seed_step_and_microbatch() -> None:
    a = Ledger(dataset_len=100, micro_batch_size=4, num_microbatches=8, seed=3)
    b = Ledger(dataset_len=100, micro_batch_size=4, num_microbatches=8, seed=3)
    # b visits steps in another order (a restarted worker joins late): same answers
    later = [b.samples(7, j) for j in range(8)]
    assert [a.samples(7, j) for j in range(8)] == later
    assert a.samples(0, 0) == b.samples(0, 0)
    assert Ledger(dataset_len=100, micro_batch_size=4, num_microbatches=8, seed=4).samples(
        0, 0
    ) != a.samples(0, 0)


def test_one_pass_visits_every_sample_once() -> None:
    led = Ledger(dataset_len=64, micro_batch_size=4, num_microbatches=4, seed=0)
    seen = [i for step in range(4) for mb in range(4) for i in led.samples(step, mb)]
    assert sorted(seen) == list(range(64))
    nxt = [i for step in range(4, 8) for mb in range(4) for i in led.samples(step, mb)]
    assert sorted(nxt) == list(range(64)) and nxt != seen  # a new permutation per pass


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        Ledger(dataset_len=10, micro_batch_size=0, num_microbatches=2)
    with pytest.raises(ValueError, match="out of range"):
        Ledger(dataset_len=10, micro_batch_size=1, num_microbatches=2).samples(0, 2)


def test_fresh_step_is_contiguous_blocks() -> None:
    assert assign(range(8), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert assign(range(8), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert assign([1, 5, 6], 2) == [[1, 5], [6]]
    assert assign([], 2) == [[], []]


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 16),
    world=st.integers(1, 6),
    dead=st.sets(st.integers(0, 5)),
    survivors=st.integers(1, 5),
)
def test_reuse_never_double_counts_and_completes_the_step(
    m: int, world: int, dead: set[int], survivors: int
) -> None:
    # epoch 1: every rank did its share; the ranks in `dead` are lost with their sums
    shares = assign(range(m), world)
    kept = [set(s) for r, s in enumerate(shares) if r not in dead]
    todo = missing(kept, m)
    # epoch 2: only the missing ids are spread over the new members
    again = assign(todo, survivors)
    done = sorted(mb for s in kept for mb in s) + sorted(mb for s in again for mb in s)
    assert sorted(done) == list(range(m))  # every id exactly once


def test_overlapping_sums_are_an_invariant_violation() -> None:
    with pytest.raises(AssertionError, match="done twice"):
        missing([{0, 1}, {1, 2}], 4)


def test_microbatch_seeds_differ() -> None:
    seeds = {mb_seed(0, s, j) for s in range(50) for j in range(16)}
    assert len(seeds) == 800
