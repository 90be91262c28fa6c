"""docs/benchmarks.md states the suite's settings: its table must say what the code runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.systems.base import Settings, error_kinds

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def _kinds(kinds: tuple[str, ...]) -> str:
    if kinds == error_kinds():
        return f"every kind of `unicron.detect.classify.KINDS` but `unknown` ({len(kinds)})"
    return ", ".join(f"`{k}`" for k in kinds)


def _ks(ks: tuple[int, ...]) -> str:
    return " and ".join(str(k) for k in ks)


def test_the_settings_table_matches_the_code() -> None:
    q, f = Settings.make(quick=True), Settings.make(quick=False)
    expected = [
        ("steps N, fault at step", f"{q.steps}, {q.fault_step}", f"{f.steps}, {f.fault_step}"),
        ("checkpoint interval K (torchrun)", _ks(q.ckpt_every), _ks(f.ckpt_every)),
        ("repetitions", str(q.reps), str(f.reps)),
        (
            "hang: process-group / collective timeout",
            f"{q.hang_timeout_s:g} s",
            f"{f.hang_timeout_s:g} s",
        ),
        ("error kinds (Unicron)", _kinds(q.error_kinds), _kinds(f.error_kinds)),
        ("error kinds (torchrun)", _kinds(q.torchrun_error_kinds), _kinds(f.torchrun_error_kinds)),
        (
            "error: torchrun process-group timeout",
            f"{q.error_pg_timeout_s:g} s",
            f"{f.error_pg_timeout_s:g} s",
        ),
        ("soak: target wall time", f"{q.soak_s:g} s", f"{f.soak_s:g} s"),
    ]
    text = DOC.read_text(encoding="utf-8")
    for row in expected:
        assert "| " + " | ".join(row) + " |" in text, row


def test_the_docs_tables_of_results_are_the_results() -> None:
    """Every generated table in the docs is what ``bench/results`` makes of it (a figure typed
    into one, or results committed without ``python -m bench.docs``, fail here)."""
    from bench import docs

    assert docs.stale() == []
    assert any(docs.BLOCK.search(p.read_text(encoding="utf-8")) for p in docs.DOCS)
    assert docs.stale_outputs(quick=True) == []  # the commands' tables (the long: below)


@pytest.mark.long
def test_the_docs_tables_of_long_commands_are_their_output() -> None:
    """The output blocks marked long (the planner's own picks: a search per published run)."""
    from bench import docs

    assert docs.stale_outputs() == []


def test_an_output_block_is_what_its_command_prints(tmp_path: Path) -> None:
    from bench import docs

    doc = tmp_path / "d.md"
    doc.write_text("a\n<!-- output python -m platform -->\n| typed |\n<!-- /output -->\nb\n")
    assert docs.stale_outputs([doc]) == [f"{doc}: output python -m platform"]
    assert docs.refresh_outputs([doc]) == [doc]
    import platform

    assert doc.read_text() == (
        f"a\n<!-- output python -m platform -->\n{platform.platform()}\n<!-- /output -->\nb\n"
    )
    assert docs.stale_outputs([doc]) == [] and docs.refresh_outputs([doc]) == []
    # a long block is left out of the quick check; a failing command is an error
    doc.write_text("<!-- output long python -m platform -->\nx\n<!-- /output -->\n")
    assert docs.stale_outputs([doc], quick=True) == [] and len(docs.stale_outputs([doc])) == 1
    doc.write_text("<!-- output python -m json.tool /nonexistent -->\n<!-- /output -->\n")
    with pytest.raises(docs.BlockError, match=r"exit 2: .*can't open"):
        docs.stale_outputs([doc])


def test_a_results_block_is_made_again_and_a_typed_figure_is_stale(tmp_path: Path) -> None:
    import json

    import pytest

    from bench import docs
    from bench.common import make_row

    rows = [make_row(system="unicron", scenario="s", metric=m, values=v, unit="s", note="")
            for m, v in (("step_time_s[pp2]", [0.25, 0.5, 0.75]), ("wall_s", [3.0]))]  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(rows))
    doc = tmp_path / "d.md"
    doc.write_text("a\n<!-- results s step_time_s -->\n| typed | 0.1 s |\n<!-- /results -->\nb\n")
    assert docs.stale([doc], tmp_path) == [f"{doc}: results s step_time_s"]  # typed
    assert docs.refresh([doc], tmp_path) == [doc]
    text = doc.read_text()
    assert "| unicron | `step_time_s[pp2]` | 0.5 s | 0.25 .. 0.75 | 3 |" in text
    assert "wall_s" not in text and "typed" not in text and text.startswith("a\n")
    assert docs.refresh([doc], tmp_path) == []  # made again: the same
    assert docs.stale([doc], tmp_path) == []
    doc.write_text(text.replace("0.5 s", "0.4 s"))  # a figure typed over
    assert len(docs.stale([doc], tmp_path)) == 1
    assert docs.rendered(doc.read_text(), tmp_path) == text
    assert docs.table("s wall_s +note", tmp_path).splitlines()[0].endswith("| note |")
    (tmp_path / "t.json").write_text(json.dumps(rows[1:]))  # wall_s only
    lines = docs.table("s,t wall_s step_time_s[pp2]", tmp_path).splitlines()
    assert lines[0] == "| results | `wall_s` | `step_time_s[pp2]` | measured |"
    assert lines[2].startswith("| `s` | 3 s | 0.5 s |") and lines[3].startswith("| `t` | 3 s |  |")
    for spec, why in (("nope", "no nope.json"), ("s no_such_metric", "no row")):
        with pytest.raises(docs.BlockError, match=why):
            docs.table(spec, tmp_path)


def test_a_pivot_block_puts_variants_or_systems_in_columns(tmp_path: Path) -> None:
    import json

    import pytest

    from bench import docs
    from bench.common import make_row

    def row(system: str, metric: str, values: list[float], unit: str = "s") -> dict:
        return make_row(system=system, scenario="p", metric=metric, values=values, unit=unit)

    rows = [row("unicron", "transition_s[8->6/relayout/dim128]", [0.25, 0.5, 0.75]),
            row("unicron", "transition_s[8->6/relayout/dim256]", [1.0]),
            row("torch", "transition_s[8->6/relayout/dim256]", [2.0, 2.0]),
            row("unicron", "wall_s", [3.0]),
            row("model", "share", [0.9], unit="ratio")]  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(rows))
    grid = docs.table("p transition_s +grid", tmp_path).splitlines()
    assert grid[0] == "| system | metric | dim128 | dim256 | measured |"
    assert grid[1] == "| --- | --- | --- | --- | --- |" and len(grid) == 4
    # the spread where the repetitions differ, none for one or equal ones, blank for no row
    line = "`transition_s[8->6/relayout]`"
    assert grid[2].startswith(f"| unicron | {line} | 0.5 s (0.25 .. 0.75) | 1 s |")
    assert grid[3].startswith(f"| torch | {line} |  | 2 s |")
    by_system = docs.table("p transition_s wall_s +systems", tmp_path).splitlines()
    assert by_system[0] == "| metric | unicron | torch | measured |"
    line = "`transition_s[8->6/relayout/dim"
    assert by_system[2].startswith(f"| {line}128]` | 0.5 s (0.25 .. 0.75) |  |")
    assert by_system[3].startswith(f"| {line}256]` | 1 s | 2 s |")
    assert by_system[4].startswith("| `wall_s` | 3 s |  |") and len(by_system) == 5
    assert "| 0.9 |" in docs.table("p share", tmp_path)  # a ratio's unit is not printed
    by_metric = docs.table("p transition_s wall_s +metrics", tmp_path).splitlines()
    assert by_metric[0] == (
        "| system | `transition_s[8->6/relayout/dim128]` | `transition_s[8->6/relayout/dim256]` "
        "| `wall_s` | measured |"
    )
    assert by_metric[2].startswith("| unicron | 0.5 s (0.25 .. 0.75) | 1 s | 3 s |")
    assert by_metric[3].startswith("| torch |  | 2 s |  |") and len(by_metric) == 4
    by_scenario = docs.table("p wall_s +scenarios", tmp_path).splitlines()
    assert by_scenario[0] == "| system | metric | p | measured |"
    assert by_scenario[2].startswith("| unicron | `wall_s` | 3 s |")
    # @TEXT keeps the systems that hold TEXT
    assert docs.table("p @torch transition_s +metrics", tmp_path).count("\n") == 3
    assert "unicron" not in docs.table("p @orc wall_s transition_s", tmp_path)
    for spec, why in (("p wall_s +grid", r"no \[variant\]"), ("p +grid", "pivot"),
                      ("p transition_s +grid +note", "pivot"),
                      ("p transition_s +grid +systems", "pivot"), ("p nope +systems", "no row"),
                      ("p @nobody wall_s", "no row"),
                      ("q transition_s +grid", "no q.json")):  # fmt: skip
        with pytest.raises(docs.BlockError, match=why):
            docs.table(spec, tmp_path)
    doc = tmp_path / "d.md"
    doc.write_text("<!-- results p transition_s +grid -->\n| typed |\n<!-- /results -->\n")
    assert docs.stale([doc], tmp_path) == [f"{doc}: results p transition_s +grid"]
    assert docs.refresh([doc], tmp_path) == [doc] and docs.stale([doc], tmp_path) == []
    assert "\n".join(grid) in doc.read_text()
