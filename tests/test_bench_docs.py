"""docs/benchmarks.md states the suite's settings: its table must say what the code runs."""

from __future__ import annotations

from pathlib import Path

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
