"""``python -m bench.refresh``: every benchmark of the project once, on one version of the code.

    python -m bench.refresh --status        # each benchmark's rows: the code they measured
    python -m bench.refresh                 # run those not measured on this code, in order
    python -m bench.refresh --only tp --only chaos-zero
    python -m bench.refresh --check         # exit 1 unless every row measured this code
    python -m bench.refresh --prune         # ... dropping rows of old code a run did not make

The figures of the docs are made from ``bench/results`` (``bench.docs``), and every row names
the code it measured (its ``commit``: :func:`bench.common.code_state`, the last commit that
changed the package, the benchmarks, the examples or the dependencies). This command runs,
one after another, each benchmark whose rows do not all name the code of this checkout: the
default suite (``python -m bench``), the scenarios run only when named, the fault soaks, the
cluster benchmarks, the sim-to-real run and the cluster soak (:data:`ENTRIES`). So a refresh
that an interrupted session left half done goes on where it stopped, on the same code, and a
commit of results or docs between the two halves changes nothing. Then it derives what is
made from the rows: the simulator's measured constants (``bench.measured``), the
cross-check and constants tables (``bench/simulator.py``), the docs' tables and the summary.

It refuses to start on code that differs from its commit (the rows would name no commit one
could check out): commit first, and it stops if the code moves before a benchmark starts
(the tree edited, another commit made). Each benchmark's output goes to
``--logs DIR/NAME.log``; how long each took is kept in ``bench/results/runs.json`` (mode
``refresh``, written after each benchmark, the durations of an earlier refresh of the same
code kept). The machine should have nothing else to do while it runs: the figures are
timings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.chaos import WORKERS, scenario_name
from bench.common import (
    RESULTS_DIR,
    RUNS_FILE,
    bench_parser,
    code_state,
    load_rows,
    now_iso,
    record_run,
    write_json_atomic,
    write_summary,
)
from unicron.control import netns

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One benchmark command and the results files (stems in ``bench/results``) it writes."""

    name: str
    argv: tuple[str, ...]
    """What follows the interpreter: ``("-m", "bench.tp")``."""
    files: tuple[str, ...]


def _chaos(*, tp: int = 1, pp: int = 1, workers: int = WORKERS, depths: str = "",
           degrees: str = "", zero: bool = False, store: bool = False,
           order: str = "gpipe") -> Entry:  # fmt: skip
    """A fault soak's command, named as ``bench.chaos`` names its results file."""
    argv = ["-m", "bench.chaos"]
    argv += ["--tp", str(tp)] if tp > 1 else []
    argv += ["--pp", str(pp)] if pp > 1 else []
    argv += ["--workers", str(workers)] if workers != WORKERS else []
    argv += ["--pp-choices", depths] if depths else []
    argv += ["--tp-choices", degrees] if degrees else []
    argv += ["--zero"] if zero else []
    argv += ["--store"] if store else []
    argv += ["--schedule", order] if order != "gpipe" else []
    name = scenario_name(5, (tp, pp), workers, depths, zero, store, degrees, order)
    return Entry(name, tuple(argv), (name,))


SUITE = ("floor", "steady", "crash", "error", "hang", "node", "soak", "reduce", "store",
         "startup", "planner", "simulator")  # fmt: skip
"""The scenarios of ``python -m bench`` run without ``--scenario``."""


def _relayout(*, degrees: str = "", order: str = "gpipe") -> Entry:
    """A fault soak of TP=2 x PP=2 x DP=2 on 8 workers that may run at PP=1."""
    return _chaos(tp=2, pp=2, workers=8, depths="1", degrees=degrees, order=order)


ENTRIES: tuple[Entry, ...] = (
    Entry("suite", ("-m", "bench"), SUITE),
    *(Entry(n, ("-m", f"bench.{n}"), (n,)) for n in
      ("scale", "llama", "tp", "pipeline", "relayout", "zero", "transfer", "checkpoint")),
    _chaos(),
    _chaos(zero=True),
    _chaos(store=True),
    _chaos(tp=2),
    _chaos(tp=2, workers=8),
    _relayout(),
    _relayout(degrees="1"),
    _relayout(order="1f1b"),
    _relayout(degrees="1", order="1f1b"),
    Entry("cluster", ("-m", "bench.cluster"), ("cluster-kill", "cluster-load", "cluster-node")),
    Entry("cluster-exchange", ("-m", "bench.cluster.exchange"), ("cluster-exchange",)),
    Entry("standby", ("-m", "bench.standby"), ("cluster-standby",)),
    Entry("simreal", ("-m", "bench.simreal"), ("simreal",)),
    Entry("soak-cluster", ("-m", "bench.soak_cluster"), ("soak-cluster",)),
)  # fmt: skip
"""Every benchmark that writes ``bench/results``, in the order a refresh runs them."""
DERIVED: tuple[tuple[str, ...], ...] = (
    ("-m", "bench.measured"),
    ("bench/simulator.py", "--crosscheck"),
    ("bench/simulator.py", "--constants"),
    ("-m", "bench.docs"),
)
"""What is made from the rows, run after a refresh ran anything: the simulator's constants
first (the two simulator tables read them), the docs' tables last."""


def commits(entry: Entry, results_dir: Path = RESULTS_DIR) -> tuple[set[str], list[str]]:
    """The codes ``entry``'s rows name (``?`` for a row that names none) and their dates,
    sorted; both empty when none of its files exists."""
    found: set[str] = set()
    dates: list[str] = []
    for stem in entry.files:
        for row in load_rows(results_dir / f"{stem}.json"):
            found.add(str(row.get("commit") or "?"))
            dates.append(str(row.get("date") or ""))
    return found, sorted(d for d in dates if d)


def failed(entry: Entry, results_dir: Path = RESULTS_DIR) -> int:
    """How many of ``entry``'s rows say a system failed (a measurement of the code all the
    same: running it again changes nothing until the machine or the code does)."""
    return sum(
        row.get("status") == "failed"
        for stem in entry.files
        for row in load_rows(results_dir / f"{stem}.json")
    )


def current(entry: Entry, code: str, results_dir: Path = RESULTS_DIR) -> bool:
    """Whether every file of ``entry`` exists and all its rows measured ``code``."""
    if any(not (results_dir / f"{stem}.json").exists() for stem in entry.files):
        return False
    return commits(entry, results_dir)[0] == {code}


def prune(
    entry: Entry, code: str, since: str, results_dir: Path = RESULTS_DIR, *, drop: bool = False
) -> list[str]:
    """The rows of ``entry``'s files that name another code and are dated before ``since``,
    the start of its run that just ended well: rows its command did not make this time, one
    line each. They are a metric or an arm since removed, which a merging benchmark keeps for
    ever (``--check`` could never pass), or a variant made with other options than the
    refresh's (``bench.cluster --exchange-s 0.25``: rows of their own system), to be measured
    again by that command, or figures a failed trial did not replace. So they are only listed,
    and dropped with ``drop`` (``--prune``: found in review, a variant's rows and the last good
    figures of a failed trial went silently, and a docs table with them)."""
    left = []
    for stem in entry.files:
        path = results_dir / f"{stem}.json"
        rows = load_rows(path)
        keep = [r for r in rows if r.get("commit") == code or str(r.get("date") or "") >= since]
        if len(keep) == len(rows):
            continue
        left += [
            f"{stem}: {r.get('system')} {r.get('metric')} of {r.get('commit') or '?'}, "
            f"{str(r.get('date') or 'undated')[:16]}"
            for r in rows
            if r not in keep
        ]
        if drop:
            write_json_atomic(path, keep)
    return left


def status(code: str, results_dir: Path = RESULTS_DIR) -> list[str]:
    """One markdown line per entry: its files, the code its rows measured, when, how many
    rows say a system failed, and whether every row measured ``code``."""
    lines = [
        f"Code of this checkout: {code}",
        "",
        "| benchmark | files | measured on | when | failed rows | on this code |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in ENTRIES:
        found, dates = commits(e, results_dir)
        when = f"{dates[0][:10]} .. {dates[-1][:10]}" if dates else "never"
        lines.append(
            f"| {e.name} | {', '.join(e.files)} | {', '.join(sorted(found)) or '-'} | "
            f"{when} | {failed(e, results_dir)} | "
            f"{'yes' if current(e, code, results_dir) else 'no'} |"
        )
    return lines


def lacking() -> list[str]:
    """What this machine lacks for some benchmark (each then fails, and says so in its rows
    or its log): one line each, empty when nothing."""
    out = []
    if importlib.util.find_spec("torchft") is None:
        out.append("torchft (pip install -e '.[bench]'): the torchft arms fail")
    if shutil.which("etcd") is None:
        out.append("etcd (apt-get install etcd-server): standby fails")
    if (why := netns.available()) is not None:
        out.append(f"network namespaces ({why}): cluster, standby, soak-cluster fall short")
    return out


def _run(argv: Sequence[str], log: Path) -> tuple[int, float]:
    """Run ``python ARGV`` from the checkout, its output into ``log``; (exit code, seconds)."""
    began = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        rc = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    return rc, time.monotonic() - began


def took_before(code: str, results_dir: Path = RESULTS_DIR) -> tuple[str, dict[str, float]]:
    """When an earlier refresh of ``code`` started and how long each of its benchmarks took
    (``runs.json``, mode ``refresh``; ``("", {})`` if none): a refresh cut short and resumed
    keeps the start of the first half and the durations of both."""
    try:
        runs = json.loads((results_dir / RUNS_FILE).read_text(encoding="utf-8"))
        last = runs["refresh"]
        if last["settings"]["code"] != code:
            return "", {}
        return str(last["started"]), {str(k): float(v) for k, v in last["scenarios_s"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", {}


def _tables() -> None:
    """The summary and the docs' tables again, after rows were dropped (as a benchmark does
    after it saved its rows), so that a refresh stopped here leaves them in step."""
    from bench import docs  # (it builds on bench.common, as this module does)

    write_summary()
    try:
        docs.refresh()
    except docs.BlockError as exc:
        print(f"bench.refresh: the docs' tables not rewritten: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_parser("bench.refresh", __doc__)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="the table of what measured what")
    what.add_argument("--check", action="store_true",
                      help="exit 1 unless every benchmark's rows measured this code")  # fmt: skip
    what.add_argument("--list", action="store_true", help="the benchmarks and their commands")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run this benchmark (repeatable), measured already or not")  # fmt: skip
    p.add_argument("--prune", action="store_true",
                   help="drop the rows of another code a benchmark's run did not make "
                        "(default: list them)")  # fmt: skip
    p.add_argument("--logs", type=Path, default=None, metavar="DIR",
                   help="where each benchmark's output goes (default: a new temp dir)")  # fmt: skip
    args = p.parse_args(argv)
    names = {e.name for e in ENTRIES}
    unknown = sorted(set(args.only) - names)
    if unknown:
        p.error(
            f"--only {', '.join(unknown)}: no such benchmark (known: {', '.join(sorted(names))})"
        )
    code = code_state()
    if args.list:
        for e in ENTRIES:
            print(f"{e.name:<34} python {' '.join(e.argv)}")
        return 0
    for line in lacking():
        print(f"bench.refresh: this machine lacks {line}", file=sys.stderr)
    if args.status or args.check:
        print("\n".join(status(code)))
        return 1 if args.check and not all(current(e, code) for e in ENTRIES) else 0
    if code == "unknown" or code.endswith("+dirty"):
        print(f"bench.refresh: the code is {code}: commit it first, so that every row names "
              "a commit one can check out", file=sys.stderr)  # fmt: skip
        return 2
    todo = [e for e in ENTRIES if e.name in args.only] if args.only else [
        e for e in ENTRIES if not current(e, code)]  # fmt: skip
    logs = args.logs or Path(tempfile.mkdtemp(prefix="unicron-refresh-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench.refresh: code {code}; {len(todo)} of {len(ENTRIES)} benchmarks to run; "
          f"logs in {logs}", flush=True)  # fmt: skip
    started, took = took_before(code)
    started, failed = started or now_iso(), []
    for e in todo:
        if (now := code_state()) != code:
            # a commit or an edit (or a benchmark writing into the code) since the start:
            # what runs now would name another code than the rows before it
            print(f"bench.refresh: the code moved from {code} to {now} during the refresh; "
                  "stopping (run it again on the new code)", file=sys.stderr)  # fmt: skip
            return 2
        since = now_iso()
        print(f"{since} {e.name}: python {' '.join(e.argv)}", flush=True)
        rc, took[e.name] = _run(e.argv, logs / f"{e.name}.log")
        print(f"{now_iso()} {e.name}: exit {rc} after {took[e.name]:.0f} s", flush=True)
        if rc != 0:
            failed.append(e.name)
        elif left := prune(e, code, since, drop=args.prune):
            fate = "dropped" if args.prune else "kept (--prune drops them)"
            print(f"{e.name}: {len(left)} row(s) of another code its run did not make, {fate}:",
                  flush=True)  # fmt: skip
            print("\n".join(f"  {line}" for line in left), flush=True)
            if args.prune:
                _tables()
        record_run(RESULTS_DIR, "refresh", started=started, total_s=sum(took.values()),
                   scenarios_s=took, settings={"code": code})  # fmt: skip
    if todo:
        for cmd in DERIVED:
            rc, _ = _run(cmd, logs / f"derived-{cmd[-1].strip('-').replace('.', '-')}.log")
            print(f"{now_iso()} python {' '.join(cmd)}: exit {rc}", flush=True)
            if rc != 0:
                failed.append(" ".join(cmd))
        write_summary()
    missing = [e.name for e in ENTRIES if not current(e, code)]
    print(f"bench.refresh: failed: {', '.join(failed) or 'none'}; not on {code} yet: "
          f"{', '.join(missing) or 'none'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
