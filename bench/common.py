"""What the benchmark suite shares: the row schema, the machine, result files, table, summary.

A result row is one figure of one system in one scenario, over the repetitions of one run::

    {"system", "scenario", "metric", "median", "min", "max", "repetitions", "unit", "machine",
     "status", "note", "date", "commit"}

``commit`` names the code measured (:func:`code_version`: the last commit that changed the
package, the benchmarks, the examples or the dependencies, ``+dirty`` when they differ from
it); rows written before it existed have none, and the summary says so.

A figure of one error kind (the ``error`` scenario) carries the kind in its metric name,
``detection_s[cuda]``, so that (system, scenario, metric) stays the row's key.

``status`` is ``ok`` (measured), ``derived`` (computed from measured rows, or bounded by a
setting; ``note`` says how), ``failed`` (the system failed; ``note`` holds its error) or
``skipped`` (not run here; ``note`` says why). Results go to ``bench/results/<scenario>.json``
and ``bench/results/SUMMARY.md`` is generated from those files alone, so no figure is ever
typed by hand. ``bench/results/runs.json`` (not rows) keeps how long the latest whole-suite
run of each mode (``quick``, ``full``) took, scenario by scenario, with its settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RUNS_FILE = "runs.json"
"""The durations of whole-suite runs in the results folder (:func:`record_run`)."""
STATUSES = ("ok", "derived", "failed", "skipped")
ROW_KEYS = (
    "system",
    "scenario",
    "metric",
    "median",
    "min",
    "max",
    "repetitions",
    "unit",
    "machine",
    "status",
    "note",
    "date",
)
UNITS = {
    "wall_s": "s",
    "step_time_s": "s",
    "detection_s": "s",
    "detection_heartbeat_s": "s",
    "recovery_s": "s",
    "fault_cost_s": "s",
    "floor_s": "s",
    "steps_redone": "steps",
    "steps_finished": "steps",
    "false_alarms": "count",
    "epochs": "count",
    "step_time_p99_s": "s",
    "recovery_over_floor": "x",
    "step_time_vs_ddp": "x",
    "step_time_vs_plain": "x",
    "step_time_vs_sequential": "x",
    "step_time_vs_torch": "x",
    "step_time_vs_hand": "x",
    "peak_rss_mb": "MB",
}

Row = dict[str, Any]


def kind_metric(metric: str, kind: str | None) -> str:
    """``metric`` of one error kind (``detection_s[cuda]``); ``metric`` itself for no kind."""
    return f"{metric}[{kind}]" if kind else metric


def split_metric(metric: str) -> tuple[str, str | None]:
    """``detection_s[cuda]`` -> ``("detection_s", "cuda")``; ``wall_s`` -> ``("wall_s", None)``."""
    if metric.endswith("]") and "[" in metric:
        base, _, kind = metric[:-1].partition("[")
        return base, kind
    return metric, None


def machine() -> str:
    """One line describing this machine: CPU model, cores, OS, Python and torch versions."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "absent"
    return (
        f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch_version}"
    )


CODE_PATHS = (
    "unicron",
    "bench",
    "examples",
    "pyproject.toml",
    ":(exclude)bench/results",
    ":(exclude)unicron/sim/data/measured.json",
)
"""What a benchmark measures, as git pathspecs: the package, the benchmarks, the examples and
the dependencies; not the results, the docs or the tests, nor the simulator's constants that
``bench.measured`` derives from the results (the suite rewrites them as it runs: were they
code, a refresh would dirty its own checkout half way and its later rows name no commit)."""


def code_state() -> str:
    """The commit of the code this checkout measures: the last commit that changed
    :data:`CODE_PATHS` (so a commit of results or docs alone leaves it as it was, and rows
    measured before and after it name the same code), with ``+dirty`` when those paths
    differ from it; ``unknown`` outside a git checkout. Asked anew each call (``bench.refresh``
    checks before each benchmark that the code did not move); rows use :func:`code_version`."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        # 12 digits, not %h: git lengthens its abbreviations as the repository grows, and the
        # same code would then name itself otherwise than its rows (found in review)
        commit = git("log", "-1", "--format=%H", "--", *CODE_PATHS)[:12]
        dirty = git("status", "--porcelain", "--", *CODE_PATHS)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not commit:
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


code_version = functools.cache(code_state)
""":func:`code_state` asked once per process, at its first row: a benchmark's rows all name one
code (an edit while it runs makes them ``+dirty`` only if it came before that first row;
``bench.refresh`` checks the code before each benchmark it starts)."""


def now_iso() -> str:
    """The current UTC time, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def make_row(
    *,
    system: str,
    scenario: str,
    metric: str,
    values: Sequence[float] = (),
    status: str = "ok",
    note: str = "",
    unit: str | None = None,
    host: str | None = None,
) -> Row:
    """A result row from the values of the repetitions (median, min, max of them)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    vals = [float(v) for v in values]
    return {
        "system": system,
        "scenario": scenario,
        "metric": metric,
        "median": statistics.median(vals) if vals else None,
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
        "repetitions": len(vals),
        "unit": unit if unit is not None else UNITS.get(split_metric(metric)[0], ""),
        "machine": host if host is not None else machine(),
        "status": status,
        "note": note,
        "date": now_iso(),
        "commit": code_version(),
    }


def check_row(row: Row) -> None:
    """Raise ``ValueError`` naming the first way ``row`` breaks the schema."""
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise ValueError(f"row misses {', '.join(missing)}: {row}")
    if row["status"] not in STATUSES:
        raise ValueError(f"row status {row['status']!r} not in {STATUSES}")
    for key in ("system", "scenario", "metric", "machine"):
        if not isinstance(row[key], str) or not row[key]:
            raise ValueError(f"row {key} must be a non-empty string: {row}")
    stats = [row["median"], row["min"], row["max"]]
    if row["status"] in ("ok", "derived") and row["median"] is None:
        raise ValueError(f"a {row['status']} row needs a median: {row}")
    if all(v is not None for v in stats) and not row["min"] <= row["median"] <= row["max"]:
        raise ValueError(f"row needs min <= median <= max: {row}")
    if not isinstance(row["repetitions"], int) or row["repetitions"] < 0:
        raise ValueError(f"row repetitions must be an int >= 0: {row}")
    if "commit" in row and (not isinstance(row["commit"], str) or not row["commit"]):
        raise ValueError(f"row commit must be a non-empty string: {row}")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_figure(fig: Any, path: Path) -> None:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG through a temporary file and
    a rename, then close it (the benchmarks' plots: ``transfer.png``, ``tp.png``)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_rows(path: Path) -> list[Row]:
    """The rows of one results file (empty if it does not exist)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    return list(data) if isinstance(data, list) else []


def merge_rows(old: Iterable[Row], new: Iterable[Row]) -> list[Row]:
    """``new`` rows replace ``old`` rows of the same (system, scenario, metric), in their
    place; an old
    ``trial`` row (``trial[kind]``: a failure) goes as soon as that system, scenario and kind
    has new rows, so a successful rerun does not keep the old failure beside its figures."""
    new = list(new)
    fresh = {(r["system"], r["scenario"], r["metric"]) for r in new}
    cells = {(r["system"], r["scenario"], split_metric(r["metric"])[1]) for r in new}

    def stale(r: Row) -> bool:
        if (r["system"], r["scenario"], r["metric"]) in fresh:
            return True
        base, kind = split_metric(r["metric"])
        return base == "trial" and (r["system"], r["scenario"], kind) in cells

    # a new row takes the place of the row it replaces (the tables keep their order), the
    # others go at the end
    by_key = {(r["system"], r["scenario"], r["metric"]): r for r in new}
    out: list[Row] = []
    for r in old:
        key = (r["system"], r["scenario"], r["metric"])
        if key in by_key:
            out.append(by_key.pop(key))
        elif not stale(r):
            out.append(r)
    return out + list(by_key.values())


def save_scenario(
    rows: list[Row], scenario: str, results_dir: Path = RESULTS_DIR, *, replace: bool = False
) -> Path:
    """Merge this run's rows of ``scenario`` into ``results_dir/<scenario>.json``, or with
    ``replace`` (the run measured every system of it) put them in place of the old ones.

    When merging, systems not run this time keep their earlier rows (each row carries its
    date); failed rows replace the figures they would have measured, so a failure is never
    hidden. Replacing drops rows that this run no longer makes (an arm the settings left out).
    """
    for row in rows:
        check_row(row)
    path = results_dir / f"{scenario}.json"
    kept = [] if replace else load_rows(path)
    write_json_atomic(path, merge_rows(kept, rows))
    if results_dir == RESULTS_DIR:  # the summary and the docs' tables follow the results
        from bench import docs  # (it builds on this module)

        write_summary(results_dir)
        try:
            docs.refresh()
        except docs.BlockError as exc:  # the rows are saved; tests/test_bench_docs.py says so
            print(f"bench: the docs' tables not rewritten: {exc}", file=sys.stderr)
    return path


def record_run(
    results_dir: Path,
    mode: str,
    *,
    started: str,
    total_s: float,
    scenarios_s: dict[str, float],
    settings: dict[str, Any],
) -> Path:
    """Keep in ``results_dir/runs.json`` how long this whole-suite run of ``mode`` took.

    Called by ``python -m bench`` after a run of every scenario and system with the default
    repetitions; the entry of ``mode`` (``quick`` or ``full``) is replaced, the other kept.
    """
    path = results_dir / RUNS_FILE
    runs = _load_runs(results_dir)
    runs[mode] = {
        "started": started,
        "total_s": round(total_s, 1),
        "scenarios_s": {name: round(s, 1) for name, s in scenarios_s.items()},
        "machine": machine(),
        "settings": settings,
    }
    write_json_atomic(path, runs)
    return path


def _load_runs(results_dir: Path) -> dict[str, Any]:
    """``runs.json`` as mode -> run; empty if it is missing or unreadable (it is rewritten
    whole by the next run, so a damaged one is only a lost record, never a stopped suite)."""
    path = results_dir / RUNS_FILE
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in runs.items() if isinstance(v, dict)} if isinstance(runs, dict) else {}


def _runs_markdown(results_dir: Path) -> list[str]:
    """The "Suite runs" section of the summary: each mode's latest whole-suite duration."""
    runs = _load_runs(results_dir)
    if not runs:
        return []
    lines = [
        "## Suite runs",
        "",
        "The latest run of the whole suite in each mode (every scenario and system), timed.",
        "",
        "| mode | started | total | per scenario (min) |",
        "|---|---|---|---|",
    ]
    for mode in sorted(runs):
        run = runs[mode]
        parts = ", ".join(f"{n} {s / 60:.1f}" for n, s in run.get("scenarios_s", {}).items())
        total = f"{run.get('total_s', 0) / 60:.1f} min"
        lines.append(f"| {mode} | {run.get('started', '')} | {total} | {_md_escape(parts)} |")
    return [*lines, ""]


def fmt(value: Any, unit: str = "") -> str:
    """A figure for a table: 3 significant digits, the unit after it."""
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    else:
        text = str(value)
    return f"{text} {unit}".strip() if unit and unit != "x" else (text + "x" if unit else text)


def _cells(row: Row) -> list[str]:
    """The table cells of a row; missing fields (a module's hand-made rows) show as blank."""
    unit = str(row.get("unit") or "")
    reps = row.get("repetitions") or 0
    spread = (
        f"{fmt(row.get('min'))} .. {fmt(row.get('max'))}"
        if row.get("min") is not None and isinstance(reps, int) and reps > 1
        else ""
    )
    return [
        str(row.get("scenario", "")),
        str(row.get("system", "")),
        str(row.get("metric", "")),
        fmt(row.get("median"), unit),
        spread,
        str(reps),
        str(row.get("status", "ok")),
        str(row.get("note", "")),
    ]


HEADER = ["scenario", "system", "metric", "median", "min .. max", "n", "status", "note"]


def print_table(rows: list[Row], title: str = "Unicron benchmarks") -> None:
    """Print the rows as a table on the terminal (rich)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for name in HEADER:
        table.add_column(name, overflow="fold", max_width=60 if name == "note" else None)
    for row in rows:
        cells = _cells(row)
        style = {"failed": "red", "derived": "cyan", "skipped": "dim"}.get(row.get("status", ""))
        table.add_row(*(escape(c) for c in cells), style=style)  # "detection_s[cuda]"
    Console(width=200).print(table)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(results_dir: Path = RESULTS_DIR) -> str:
    """The markdown summary of every ``results_dir/*.json`` (the README links it)."""
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m bench` from the JSON files in this folder; do not edit by hand.",
        "Method, baselines and caveats: [docs/benchmarks.md](../../docs/benchmarks.md).",
        "Medians over the repetitions (n), with the smallest and largest value.",
        "Status `derived` rows are computed from measured rows or bounded by a setting (see",
        "their note); `failed` rows carry the error.",
        "",
    ]
    files = sorted(p for p in results_dir.glob("*.json") if p.name != RUNS_FILE)
    if not files:
        return "\n".join([*lines, "No results yet: run `python -m bench --quick`.", ""])
    lines += _runs_markdown(results_dir)
    machines: set[str] = set()
    for path in files:
        rows = load_rows(path)
        if not rows:
            continue
        machines.update(str(r.get("machine", "")) for r in rows)
        dates = sorted(str(r["date"]) for r in rows if r.get("date"))
        when = f"Measured {dates[0]} .. {dates[-1]}" if dates else "Undated rows"
        commits = sorted({str(r.get("commit") or "before commits were recorded") for r in rows})
        when += f", on {', '.join(commits)}."
        lines += [f"## {path.stem}", "", when, ""]
        lines.append("| " + " | ".join(HEADER[1:]) + " |")
        lines.append("|" + "---|" * (len(HEADER) - 1))
        for row in rows:
            lines.append("| " + " | ".join(_md_escape(c) for c in _cells(row)[1:]) + " |")
        lines.append("")
    lines += ["## Machines", ""] + [f"- {m}" for m in sorted(machines) if m] + [""]
    return "\n".join(lines)


def write_summary(results_dir: Path = RESULTS_DIR) -> Path:
    """Regenerate ``results_dir/SUMMARY.md`` from the JSON files there."""
    path = results_dir / "SUMMARY.md"
    write_text_atomic(path, summary_markdown(results_dir))
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BenchParser(argparse.ArgumentParser):
    """The command-line parser of every ``python -m bench.*`` command: ``--help`` prints the
    usage and exits 0 without running anything; an unknown flag or a bad value prints one
    line (``prog: error: ...``) and exits 2. Each command's ``main`` builds one."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def bench_parser(prog: str, doc: str | None, quick: str | None = None) -> BenchParser:
    """A :class:`BenchParser` for ``python -m prog`` described by the first line of ``doc``
    (the module's docstring), with ``--quick`` (help text ``quick``) when given."""
    p = BenchParser(prog=f"python -m {prog}", description=(doc or "").strip().splitlines()[0])
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)
