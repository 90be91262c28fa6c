"""Fault injection specs: the ``--inject`` contract of DESIGN.md, parsed once, used everywhere.

``crash:rank=R,step=S[,mb=K]``   SIGKILL the worker of launch rank R during step S (after K of
                                 its micro-batches; default: half of them, i.e. mid-step)
``hang:rank=R,step=S``           the worker stops making progress without exiting
``error:rank=R,step=S,kind=K``   the worker raises an error of classified kind K
``slow:rank=R,step=S,factor=F``  the worker's compute becomes F times slower from step S on
                                 (until that process ends: a restarted worker is not slow)
``node:node=N,step=S``           node N's agent and workers vanish at step S

``rank`` is the worker's launch rank (its slot on the node, like torchrun's ``RANK``): it stays
with the slot when the worker is restarted, while epoch ranks change. Each fault fires once.
The runner, the worker, the tests and the benchmark baselines all parse specs here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from unicron.errors import UsageError

FAULTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # fault -> (required keys, optional keys)
    "crash": (frozenset({"rank", "step"}), frozenset({"mb"})),
    "hang": (frozenset({"rank", "step"}), frozenset()),
    "error": (frozenset({"rank", "step", "kind"}), frozenset()),
    "slow": (frozenset({"rank", "step", "factor"}), frozenset()),
    "node": (frozenset({"node", "step"}), frozenset()),
}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault; ``fault`` is its type, the other fields its parameters."""

    fault: str
    step: int
    rank: int | None = None
    node: int | None = None
    mb: int | None = None
    kind: str | None = None
    factor: float | None = None

    @property
    def spec(self) -> str:
        """The fault as an ``--inject`` spec again (round-trips through :func:`parse`)."""
        fields = {k: v for k, v in asdict(self).items() if k != "fault" and v is not None}
        return self.fault + ":" + ",".join(f"{k}={v}" for k, v in fields.items())

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse(spec: str, known_kinds: frozenset[str] | None = None) -> Fault:
    """Parse one ``--inject`` spec; raise :class:`UsageError` naming what is wrong.

    ``known_kinds`` are the error kinds accepted for ``error:`` (the classification table's
    kinds); ``None`` accepts any kind.
    """
    head, sep, body = spec.partition(":")
    if head not in FAULTS:
        raise UsageError(f"--inject {spec!r}: unknown fault {head!r} (known: {', '.join(FAULTS)})")
    required, optional = FAULTS[head]
    params: dict[str, str] = {}
    for item in body.split(",") if sep and body else []:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise UsageError(f"--inject {spec!r}: expected key=value, got {item!r}")
        if key not in required | optional:
            allowed = ", ".join(sorted(required | optional))
            raise UsageError(
                f"--inject {spec!r}: unknown key {key!r} for {head} (allowed: {allowed})"
            )
        params[key] = value
    missing = required - params.keys()
    if missing:
        raise UsageError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}")
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key == "kind":
            if known_kinds is not None and value not in known_kinds:
                known = ", ".join(sorted(known_kinds))
                raise UsageError(f"--inject {spec!r}: unknown kind {value!r} (known: {known})")
            values[key] = value
        elif key == "factor":
            try:
                values[key] = float(value)
            except ValueError:
                raise UsageError(
                    f"--inject {spec!r}: factor must be a number, got {value!r}"
                ) from None
            if not values[key] >= 1.0:
                raise UsageError(f"--inject {spec!r}: factor must be >= 1, got {value}")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise UsageError(
                    f"--inject {spec!r}: {key} must be an integer, got {value!r}"
                ) from None
            if values[key] < 0:
                raise UsageError(f"--inject {spec!r}: {key} must be >= 0, got {value}")
    return Fault(fault=head, **values)


def slowdown(faults: Iterable[Fault], fired: Collection[str]) -> float:
    """How many times slower a worker computes: the largest factor among the ``slow`` faults
    it has fired (their specs in ``fired``), 1.0 if none. The worker calls it after each
    step's compute. A slow fault whose step went by while the slot was out (excluded, or a
    worker restarted past it) never fired: it slows nothing, as any other unfired fault."""
    return max(
        (f.factor or 1.0 for f in faults if f.fault == "slow" and f.spec in fired), default=1.0
    )
