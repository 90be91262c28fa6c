"""Figures in the docs made from ``bench/results``, never typed: ``python -m bench.docs``.

A block in a markdown file of ``docs/`` (or the README)::

    <!-- results pipeline step_time_s peak_rss_mb -->
    (the table, generated)
    <!-- /results -->

holds the rows of ``bench/results/pipeline.json`` whose metric is one of the names after the
file's (a name alone also selects its bracketed variants: ``step_time_s`` selects
``step_time_s[pp2/gpipe]``; no name: every row), in the file's order, as a table of system,
metric, median, spread, repetitions and the date measured (``+note`` among the names: and
each row's note). A block naming several files, ``<!-- results chaos,chaos-tp2 faults_healed
steps_lost -->``, is a line per file and a column per metric (:func:`across`). ``+grid`` among
the names pivots the rows (:func:`pivot`): a line per system and metric less its variant's
last part, a column per that part (``<!-- results relayout transition_s +grid -->``:
``transition_s[8->6/relayout/dim128]`` is the ``dim128`` cell of the line
``transition_s[8->6/relayout]``); ``+systems``, a line per metric and a column per system;
``+metrics``, a line per system and a column per metric; ``+scenarios``, a line per system
and metric and a column per scenario (the rows' ``scenario`` field). ``@TEXT`` among the names keeps
the rows whose system holds ``TEXT`` (``@state``: the systems ``unicron state 40 MB``, ...).

A block made by a command of the project, not by a results file::

    <!-- output python -m unicron.planner.calibration -->
    (the command's output, verbatim)
    <!-- /output -->

holds what ``python -m MODULE ARGS`` prints, run from the checkout with this interpreter (a
pure command: the same output on every machine; no shell). ``<!-- output long python -m ...
-->`` marks one that takes long (the default suite checks the others: ``--quick``); a
command that fails is an error (exit 2).

Every benchmark that writes to ``bench/results`` rewrites the results blocks as it saves its rows
(:func:`bench.common.save_scenario` calls :func:`refresh`); ``python -m bench.docs`` rewrites
them all and the output blocks, ``--check`` changes nothing and exits 1 naming each block
that differs from its results or its command's output (``tests/test_bench_docs.py`` runs it:
a figure typed into a block, or results committed without their docs, fail). A block that
names no results file, or whose names select no row, is an error (exit 2): a typo must not
leave an empty table.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from bench.common import (
    RESULTS_DIR,
    Row,
    bench_parser,
    fmt,
    load_rows,
    split_metric,
    write_text_atomic,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
"""the files whose blocks are generated"""

BLOCK = re.compile(r"(<!-- results (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
OUTPUT = re.compile(
    r"(<!-- output (?P<long>long )?python -m (?P<cmd>[^>]*?) -->\n)(?P<body>.*?)(<!-- /output -->)",
    re.S,
)
"""a block made by a command (:func:`output`)"""
OUTPUT_TIMEOUT_S = 600.0
HEADER = ("system", "metric", "median", "min .. max", "n", "measured")
PIVOTS = {"+grid", "+systems", "+metrics", "+scenarios"}
"""the names that make a block a pivot (:func:`pivot`)"""


class BlockError(ValueError):
    """A block that cannot be made: an unknown results file, names that select no row."""


def _selected(rows: Iterable[Row], names: list[str]) -> list[Row]:
    """The rows of the metrics ``names`` select (none: every row) whose system holds each
    ``@TEXT`` among them."""
    within = [n[1:] for n in names if n.startswith("@")]
    names = [n for n in names if not n.startswith("@")]
    rows = [r for r in rows if all(w in str(r.get("system", "")) for w in within)]
    if not names:
        return rows
    return [r for r in rows if r["metric"] in names or split_metric(r["metric"])[0] in names]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _load(stem: str, spec: str, results_dir: Path) -> list[Row]:
    path = results_dir / f"{stem}.json"
    if not path.exists():
        raise BlockError(f"results {spec!r}: no {path.name} in {results_dir}")
    return load_rows(path)


def _unit(row: Row) -> str:
    unit = str(row.get("unit") or "")
    return "" if unit in ("1", "ratio") else unit  # a ratio's unit is one: nothing to print


def _when(row: Row) -> str:
    """When a row was measured (to the minute, UTC) and, where it names it, on which commit."""
    when = str(row.get("date") or "")[:16].replace("T", " ")
    return f"{when} ({row['commit']})" if row.get("commit") else when


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _spread(row: Row) -> str:
    """``min .. max`` of a row of several repetitions, else blank."""
    reps = row.get("repetitions") or 0
    if row.get("min") is None or not isinstance(reps, int) or reps < 2:
        return ""
    return f"{fmt(row.get('min'))} .. {fmt(row.get('max'))}"


def _cell(row: Row) -> str:
    """A pivot's cell: the median, and in brackets its spread where the repetitions differ."""
    spread = _spread(row) if row.get("min") != row.get("max") else ""
    return fmt(row.get("median"), _unit(row)) + (f" ({spread})" if spread else "")


def _last_part(metric: str) -> tuple[str, str]:
    """``transition_s[8->6/relayout/dim128]`` -> ``("transition_s[8->6/relayout]", "dim128")``,
    ``cpu_us[idle]`` -> ``("cpu_us", "idle")``; no variant: ``(metric, "")``."""
    base, kind = split_metric(metric)
    if kind is None:
        return metric, ""
    lead, _, last = kind.rpartition("/")
    return (f"{base}[{lead}]" if lead else base), last


def across(spec: str, results_dir: Path = RESULTS_DIR) -> str:
    """The table of a block naming several files (``A,B,... METRIC ...``): a line per file,
    a column per metric (its median, blank where the file has no such row), and when the
    file's rows were measured."""
    stems, *names = spec.split()
    if not names:
        raise BlockError(f"results {spec!r}: several files need the metrics to show")
    lines = [_line(("results", *(f"`{n}`" for n in names), "measured")),
             "|" + " --- |" * (len(names) + 2)]  # fmt: skip
    for stem in stems.split(","):
        rows = {r["metric"]: r for r in _load(stem, spec, results_dir)}
        if not rows.keys() & set(names):
            raise BlockError(f"results {spec!r}: no row of {stem}.json has those metrics")
        cells = [fmt(rows[n].get("median"), _unit(rows[n])) if n in rows else ""
                 for n in names]  # fmt: skip
        dates = sorted(_when(r) for r in rows.values())
        lines.append(_line((f"`{stem}`", *cells, dates[-1] if dates else "")))
    return "\n".join(lines) + "\n"


def pivot(spec: str, results_dir: Path = RESULTS_DIR) -> str:
    """The table of a block with ``+grid``, ``+systems`` or ``+metrics`` among its names
    (``FILE METRIC ... +grid``): with ``+grid`` a line per system and metric less its
    variant's last part and a column per that part, with ``+systems`` a line per metric and a
    column per system, with ``+metrics`` a line per system and a column per metric, with
    ``+scenarios`` a line per system and metric and a column per scenario, all in the file's
    order; a cell is the median with min .. max (:func:`_cell`), blank where
    no row is, and each line says when its rows were measured."""
    stem, *names = spec.split()
    by_system, by_metric, by_scenario = ("+systems" in names, "+metrics" in names,
                                         "+scenarios" in names)  # fmt: skip
    names = [n for n in names if n not in PIVOTS]
    if not names or "+note" in names or len(PIVOTS & set(spec.split())) != 1:
        raise BlockError(
            f"results {spec!r}: a pivot takes metrics and one of {', '.join(sorted(PIVOTS))}"
        )
    rows = _selected(_load(stem, spec, results_dir), names)
    if not rows:
        raise BlockError(f"results {spec!r}: no row of {stem}.json has those metrics")
    lines: dict[tuple[str, ...], dict[str, Row]] = {}
    for r in rows:
        key: tuple[str, ...]
        if by_system:
            key, column = (f"`{r['metric']}`",), str(r.get("system", ""))
        elif by_metric:
            key, column = (str(r.get("system", "")),), f"`{r['metric']}`"
        elif by_scenario:
            key, column = (str(r.get("system", "")), f"`{r['metric']}`"), str(r["scenario"])
        else:
            lead, column = _last_part(r["metric"])
            if not column:
                raise BlockError(f"results {spec!r}: {r['metric']} has no [variant] for +grid")
            key = (str(r.get("system", "")), f"`{lead}`")
        lines.setdefault(key, {})[column] = r
    columns = list(dict.fromkeys(c for cells in lines.values() for c in cells))
    head: tuple[str, ...] = (
        ("metric",) if by_system else ("system",) if by_metric else ("system", "metric")
    )
    out = [_line((*head, *columns, "measured")),
           "|" + " --- |" * (len(head) + len(columns) + 1)]  # fmt: skip
    for key, cells in lines.items():
        shown = [_cell(cells[c]) if c in cells else "" for c in columns]
        out.append(_line((*key, *shown, max(_when(r) for r in cells.values()))))
    return "\n".join(out) + "\n"


def table(spec: str, results_dir: Path = RESULTS_DIR) -> str:
    """The markdown table of one block's ``spec`` (``FILE [METRIC ...]``; several files:
    :func:`across`; ``+grid`` or ``+systems``: :func:`pivot`), ending in a newline."""
    stem, *names = spec.split()
    if "," in stem:
        return across(spec, results_dir)
    if PIVOTS & set(names):
        return pivot(spec, results_dir)
    notes = "+note" in names
    names = [n for n in names if n != "+note"]
    rows = _selected(_load(stem, spec, results_dir), names)
    if not rows:
        raise BlockError(f"results {spec!r}: no row of {stem}.json has those metrics")
    header = (*HEADER, "note") if notes else HEADER
    lines = [_line(header), "|" + " --- |" * len(header)]
    for r in rows:
        median = fmt(r.get("median"), _unit(r))
        reps = str(r.get("repetitions") or 0)
        cells = [str(r.get("system", "")), f"`{r['metric']}`", median, _spread(r), reps, _when(r)]
        cells += [str(r.get("note") or "")] if notes else []
        lines.append(_line(cells))
    return "\n".join(lines) + "\n"


def rendered(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """``text`` with every block's table made again from ``results_dir``."""
    return BLOCK.sub(lambda m: m.group(1) + table(m.group("spec"), results_dir) + m.group(4), text)


def stale(paths: Iterable[Path] = DOCS, results_dir: Path = RESULTS_DIR) -> list[str]:
    """``file: spec`` of every block whose table is not what its results make."""
    out = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            if m.group("body") != table(m.group("spec"), results_dir):
                out.append(f"{_shown(path)}: results {m.group('spec')}")
    return out


def output(cmd: str) -> str:
    """What ``python -m CMD`` prints (``cmd``: a module and its arguments, split as a shell
    would, run by no shell), from the checkout, as an output block's body."""
    argv = [sys.executable, "-m", *shlex.split(cmd)]
    try:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                           timeout=OUTPUT_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise BlockError(f"output {cmd!r}: no end within {OUTPUT_TIMEOUT_S:g} s") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise BlockError(f"output {cmd!r}: exit {r.returncode}: {last}")
    return r.stdout if r.stdout.endswith("\n") else r.stdout + "\n"


def _outputs(text: str, quick: bool) -> Iterable[re.Match[str]]:
    return (m for m in OUTPUT.finditer(text) if not (quick and m.group("long")))


def stale_outputs(paths: Iterable[Path] = DOCS, *, quick: bool = False) -> list[str]:
    """``file: command`` of every output block whose body is not what its command prints
    (``quick``: leave out the ``long`` ones)."""
    out = []
    for path in paths:
        for m in _outputs(path.read_text(encoding="utf-8"), quick):
            if m.group("body") != output(m.group("cmd")):
                out.append(f"{_shown(path)}: output python -m {m.group('cmd')}")
    return out


def refresh_outputs(paths: Iterable[Path] = DOCS) -> list[Path]:
    """Run every output block's command again and write its output; the files that changed."""
    return _rewrite(
        paths,
        lambda text: OUTPUT.sub(lambda m: m.group(1) + output(m.group("cmd")) + m.group(5), text),
    )


def refresh(paths: Iterable[Path] = DOCS, results_dir: Path = RESULTS_DIR) -> list[Path]:
    """Rewrite the blocks of ``paths`` from ``results_dir``; the files that changed. A block
    that cannot be made raises :class:`BlockError` and leaves its file as it was."""
    return _rewrite(paths, lambda text: rendered(text, results_dir))


def _rewrite(paths: Iterable[Path], make: Callable[[str], str]) -> list[Path]:
    """Write each of ``paths`` whose text ``make`` changes (atomically); those files."""
    changed = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = make(text)
        if new != text:
            write_text_atomic(path, new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.docs", __doc__)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    p.add_argument("--quick", action="store_true",
                   help="leave out the output blocks marked long")  # fmt: skip
    args = p.parse_args(argv)
    try:
        if args.check:
            found = stale() + stale_outputs(quick=args.quick)
            for name in found:
                print(f"stale: {name} (python -m bench.docs)", file=sys.stderr)
            return 1 if found else 0
        for path in sorted({*refresh(), *refresh_outputs()}):
            print(f"wrote {_shown(path)}")
    except BlockError as exc:
        print(f"python -m bench.docs: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
