"""The simulator's measured constants, derived from the benchmark results into package data.

    python -m bench.measured            # write unicron/sim/data/measured.json
    python -m bench.measured --check    # warn (exit 1) if that file is stale

The simulator's Unicron policy (:mod:`unicron.sim.measured`) needs four latencies the
runtime measures here: how fast a communication error, a crash and a lost node are
detected, and the hang detector's floor. :func:`derive` takes them from the Unicron rows of
``bench/results/{error,crash,node,hang}.json``; :func:`document` adds the provenance (this
command, the git commit, the date, the rows used) and :func:`main` writes it, atomically,
to the package data file that ``unicron simulate`` reads, from a checkout and from an
installed wheel alike. ``python -m bench`` runs this step at its end; run it by hand after
changing those result files another way. :func:`stale` says what makes a written file out
of date against the results (``--check``, and the test suite's check).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, bench_parser, now_iso, write_json_atomic
from unicron.sim.measured import DATA

COMMAND = "python -m bench.measured"
COMM_KINDS = ("nccl", "timeout", "conn_reset", "conn_refused")
CRASH_KINDS = ("cuda", "oom", "illegal_memory")

RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "exception_detect_s": (("error",), tuple(f"detection_s[{k}]" for k in COMM_KINDS)),
    "exit_detect_s": (
        ("crash", "error"),
        ("detection_s", *(f"detection_s[{k}]" for k in CRASH_KINDS)),
    ),
    "node_detect_s": (("node",), ("detection_heartbeat_s",)),
    "hang_floor_s": (("hang",), ("detection_s",)),
}
"""Constant -> (result files, metrics): the constant is the median of those rows' medians.

* comm errors: ``detection_s[kind]`` of the communication kinds (error.json);
* crashes: crash.json ``detection_s`` and error.json's crash kinds;
* lost node: node.json ``detection_heartbeat_s`` (the node-health path; a dead host has no
  process left to report);
* hang: hang.json ``detection_s``, the statistical detector's floor."""


SOURCES = frozenset(name for files, _ in RULES.values() for name in files)
"""The result files (stems) the constants come from: ``python -m bench`` derives the constants
again as soon as it saved one, so that its ``simulator`` scenario runs on them."""


class ResultsError(ValueError):
    """The result files lack a row a constant needs, or cannot be read."""


def _unicron_rows(name: str, results: Path) -> list[dict[str, Any]]:
    path = results / f"{name}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path}: cannot read: {exc}") from exc
    return [r for r in data if isinstance(r, dict) and r.get("system") == "unicron"]


def derive(results: Path = RESULTS_DIR) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The constants and the source rows each came from (file, metric, median, date)."""
    constants: dict[str, float] = {}
    sources: list[dict[str, Any]] = []
    for constant, (files, metrics) in RULES.items():
        used = [
            {
                "constant": constant,
                "file": f"{name}.json",
                "metric": r["metric"],
                "median": float(r["median"]),
                "date": str(r.get("date", "")),
            }
            for name in files
            for r in _unicron_rows(name, results)
            if r.get("metric") in metrics
        ]
        if not used:
            raise ResultsError(
                f"{results}: no unicron row of {', '.join(metrics)} in "
                f"{', '.join(f + '.json' for f in files)} (for {constant})"
            )
        constants[constant] = float(statistics.median(u["median"] for u in used))
        sources.extend(used)
    return constants, sources


def _commit(root: Path) -> str:
    """The checkout's commit, ``+dirty`` when the result files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", str(RESULTS_DIR)],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def document(results: Path = RESULTS_DIR, *, date: str | None = None) -> dict[str, Any]:
    """The package data file's content: constants, provenance, source rows."""
    constants, sources = derive(results)
    return {
        "constants": constants,
        "provenance": {
            "command": COMMAND,
            "commit": _commit(Path(__file__).resolve().parents[1]),
            "date": date or now_iso(),
            "results": "bench/results",
        },
        "sources": sources,
    }


def stale(doc: dict[str, Any], results: Path = RESULTS_DIR) -> list[str]:
    """Why ``doc`` (a written data file) is out of date against ``results``; [] if it is not.

    Stale: written before one of its source rows was measured, or derived from other rows
    than the result files hold now (another commit's results, or a run since)."""
    try:
        constants, sources = derive(results)
    except ResultsError as exc:
        return [str(exc)]
    reasons = []
    written = str(doc.get("provenance", {}).get("date", ""))
    newer = sorted({s["date"] for s in sources if s["date"] > written})
    if newer:
        reasons.append(f"written {written or '(undated)'}, before source rows of {newer[-1]}")
    if doc.get("sources") != sources or doc.get("constants") != constants:
        changed = sorted(
            k for k in constants if doc.get("constants", {}).get(k) != constants[k]
        ) or ["the source rows"]
        reasons.append(
            f"derived from other rows than {results} holds now "
            f"(commit {doc.get('provenance', {}).get('commit', '?')}; differs: "
            f"{', '.join(changed)})"
        )
    return reasons


def write(path: Path = DATA, results: Path = RESULTS_DIR) -> dict[str, Any]:
    """Derive and write the data file atomically; returns what was written."""
    doc = document(results)
    write_json_atomic(path, doc)
    return doc


def refresh(path: Path = DATA, results: Path = RESULTS_DIR) -> bool:
    """Rewrite the data file if it is missing or stale (:func:`stale`); True if written. The
    suite's last step: a run that changed none of the source rows leaves the file (and its
    date and commit) as it was."""
    try:
        if not stale(json.loads(path.read_text(encoding="utf-8")), results):
            return False
    except (OSError, ValueError):
        pass
    write(path, results)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """0: written (or fresh with ``--check``); 1: stale; 2: the results lack a row."""
    p = bench_parser("bench.measured", __doc__)
    p.add_argument("--check", action="store_true", help="only say whether the file is stale")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, metavar="DIR")
    p.add_argument("--out", type=Path, default=DATA, metavar="FILE")
    args = p.parse_args(argv)
    if args.check:
        try:
            doc = json.loads(args.out.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"{COMMAND}: {args.out}: cannot read: {exc}", file=sys.stderr)
            return 1
        reasons = stale(doc, args.results)
        for r in reasons:
            print(f"warning: {args.out} is stale: {r}; run {COMMAND}", file=sys.stderr)
        return 1 if reasons else 0
    try:
        doc = write(args.out, args.results)
    except ResultsError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v:.4g}" for k, v in doc["constants"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
