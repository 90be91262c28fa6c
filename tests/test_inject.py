"""``--inject`` specs: parsed once, round-trip, one-line errors."""

from __future__ import annotations

import pytest

from unicron.errors import UsageError
from unicron.runtime.inject import parse, slowdown


@pytest.mark.parametrize(
    "spec",
    [
        "crash:rank=1,step=30",
        "crash:rank=0,step=5,mb=1",
        "hang:rank=2,step=3",
        "error:rank=1,step=2,kind=cuda",
        "slow:rank=0,step=9,factor=2.5",
        "node:node=1,step=4",
    ],
)
def test_round_trip(spec: str) -> None:
    fault = parse(spec, frozenset({"cuda"}))
    assert parse(fault.spec, frozenset({"cuda"})) == fault
    assert fault.fault == spec.split(":")[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("boom:rank=1,step=1", "unknown fault 'boom'"),
        ("crash:rank=1", "missing step"),
        ("crash:rank=x,step=1", "rank must be an integer"),
        ("crash:rank=-1,step=1", "rank must be >= 0"),
        ("crash:rank=1,step=1,color=red", "unknown key 'color'"),
        ("crash:rank1,step=1", "expected key=value"),
        ("error:rank=1,step=1,kind=nope", "unknown kind 'nope'"),
        ("slow:rank=1,step=1,factor=0.5", "factor must be >= 1"),
        ("slow:rank=1,step=1,factor=fast", "factor must be a number"),
    ],
)
def test_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse(spec, frozenset({"cuda"}))
    assert "\n" not in str(info.value)


def test_only_a_slow_fault_that_fired_slows_the_worker() -> None:
    # a slow fault whose step went by while its slot was out never fired (no event): a worker
    # started past it must not be silently slow (the soak's ghost stragglers and hangs)
    early, late = parse("slow:rank=2,step=5,factor=4"), parse("slow:rank=2,step=9,factor=2")
    assert slowdown([early, late], fired=set()) == 1.0
    assert slowdown([early, late], fired={late.spec}) == 2.0
    assert slowdown([early, late], fired={early.spec, late.spec}) == 4.0
    assert slowdown([parse("crash:rank=2,step=5")], fired={"crash:step=5,rank=2"}) == 1.0
