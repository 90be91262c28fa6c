"""The Unicron policy's constants, measured by the benchmarks and shipped as package data.

``python -m bench`` runs the real runtime (processes, gloo) and writes its figures to
``bench/results``; its last step, ``python -m bench.measured``, derives from those rows how
fast each kind of failure is detected and the hang detector's floor, and writes them with
their provenance (the command, the git commit, the date, the source rows) to
``unicron/sim/data/measured.json``, which ships in the wheel. :func:`load` reads only that
file, so ``unicron simulate`` gives the same numbers from a checkout and from an install; a
missing or unreadable file is an error (:class:`MeasuredDataError`), never a fallback.
Whether the file is stale against ``bench/results`` is checked where those files are (the
benchmark command's ``--check`` and the test suite), not here. What cannot be measured on
these machines is a named assumption with a source (:data:`ASSUMPTIONS`). Called by
:meth:`unicron.sim.policies.Unicron.measured`; the command records the constants and their
provenance in ``summary.json`` (``meta.unicron_constants``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from unicron.errors import UsageError

DATA = Path(__file__).resolve().parent / "data" / "measured.json"
"""The package data file ``python -m bench.measured`` writes."""

ASSUMPTIONS: dict[str, tuple[float, str]] = {
    "regroup_s": (
        30.0,
        "rebuild the NCCL groups and restart a worker at cluster scale; not measurable on a "
        "CPU/gloo machine. MegaScale (Jiang et al., NSDI'24, section 3.5) brought job "
        "initialisation on 2,048 GPUs under 30 s after optimising it (from 1,047 s)",
    ),
    "state_bandwidth": (
        0.0,
        "state from a peer at the GPU preset's inter-node bandwidth x GPUs per node "
        "(unicron/planner/hardware.py: one 200 Gb/s NIC per A100/A800 GPU, 400 Gb/s per "
        "H100); not measurable here (loopback)",
    ),
}
"""Name -> (value, source) of what the simulator assumes for Unicron (0: computed)."""


class MeasuredDataError(UsageError):
    """The package data file is missing or malformed (a broken install or checkout)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Detection latencies in seconds and where they came from."""

    exception_detect_s: float
    exit_detect_s: float
    node_detect_s: float
    hang_floor_s: float
    source: str
    """One line: the results' dates, and the command, commit and date that derived them."""


FIELDS = ("exception_detect_s", "exit_detect_s", "node_detect_s", "hang_floor_s")


def load(path: Path = DATA) -> Measured:
    """The measured constants from the package data file (``MeasuredDataError`` if it is
    missing or lacks a field)."""
    fix = "reinstall the package, or run `python -m bench.measured` in a checkout"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MeasuredDataError(
            f"{path}: the simulator's measured constants: {exc.strerror or exc}; {fix}"
        ) from None
    except ValueError as exc:
        raise MeasuredDataError(f"{path}: not JSON ({exc}); {fix}") from None
    try:
        constants = {k: float(doc["constants"][k]) for k in FIELDS}
        prov = doc["provenance"]
        dates = sorted({str(s["date"])[:10] for s in doc["sources"] if s.get("date")})
        source = (
            f"bench/results ({', '.join(dates) or 'undated'}) via {prov['command']} "
            f"at {str(prov['commit'])[:12]}, {prov['date']}"
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MeasuredDataError(f"{path}: malformed, missing or bad {exc}; {fix}") from None
    return Measured(**constants, source=source)
