"""``unicron plan``: spec validation, the report, and the command end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from unicron.cli import COMMANDS
from unicron.errors import UsageError
from unicron.planner.command import build_report
from unicron.planner.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "plans").glob("*.yaml"))
# unicron.cli with only the plan command registered: the real dispatcher and error handling,
# independent of the other commands' modules.
PLAN_ONLY = (
    "import sys, unicron.cli as c; c.COMMANDS = {'plan': c.COMMANDS['plan']}; "
    "sys.exit(c.main(sys.argv[1:]))"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PLAN_ONLY, "plan", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def _spec(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "tasks": [
            {"name": "a", "model": "gpt-1.3b", "global_batch": 256, "min_gpus": 8, "nodes": [0, 1]},
            {"name": "b", "model": "gpt-2.7b", "global_batch": 256, "nodes": [2, 3]},
        ],
        "event": {"nodes_lost": [1]},
    }
    doc.update(overrides)
    return doc


@pytest.mark.long
def test_examples_plan_within_the_cluster() -> None:
    assert EXAMPLES
    for path in EXAMPLES:
        spec = load_spec(path)
        report = build_report(spec)
        gpus = sum(r.gpus for r in report.rows)
        assert gpus <= report.units_available * report.unit_gpus, path.name
        assert report.total_waf == pytest.approx(sum(r.waf for r in report.rows))


def test_lost_node_is_taken_away_and_named_in_the_reason() -> None:
    report = build_report(parse_spec(_spec(), ROOT))
    a = next(r for r in report.rows if r.name == "a")
    assert report.units_available == 3
    assert a.reason.startswith("lost node 1;")
    assert sum(r.gpus for r in report.rows) <= 24
    for r in report.rows:
        if r.gpus:
            assert r.tp is not None and r.pp is not None and r.dp is not None
            assert r.tp * r.pp * r.dp == r.gpus


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_spec(cluster={"nodes": 4, "colour": "red"}), "cluster.colour: unknown field"),
        (_spec(extra=1), "extra: unknown field"),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "wieght": 1}]),
            "tasks[0].wieght: unknown field",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "weight": -1}]),
            "tasks[0].weight: must be >= 0, got -1",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "min_gpus": 64}]),
            "tasks[0].min_gpus: 64 is larger than the cluster (32 GPUs)",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-9b", "global_batch": 8}]),
            "tasks[0].model: unknown model 'gpt-9b'",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "nodes": [9]}]),
            "tasks[0].nodes[0]: node 9 does not exist",
        ),
        (_spec(event={"nodes_back": [0]}), "event.nodes_back[0]: node 0 is not down"),
    ],
)
def test_bad_specs_name_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError) as err:
        build_report(parse_spec(doc, ROOT))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_cluster_too_small_names_the_shortfall() -> None:
    doc = _spec(tasks=[{"name": "big", "model": "gpt-175b", "global_batch": 1536}], event=None)
    with pytest.raises(
        UsageError, match=r"^tasks\[0\]\.model: gpt-175b .* needs at least \d+ A100-80GB GPUs"
    ):
        build_report(parse_spec(doc, ROOT))
    doc = _spec(tasks=[{"name": "big", "model": "llama3-405b", "global_batch": 64}], event=None)
    with pytest.raises(UsageError, match=r"the cluster has 32$"):
        build_report(parse_spec(doc, ROOT))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"name": "m", "layers": 4, "hidden": 100, "heads": 3, "seq_len": 64, "vocab": 10},
            "tasks[0].model.hidden: must be a multiple of heads (3)",
        ),
        (
            {"preset": "llama3-8b", "kv_heads": 5},
            "tasks[0].model.kv_heads: must divide heads (32), got 5",
        ),
        (
            {"preset": "mixtral-8x7b", "active_experts": 9},
            "tasks[0].model.active_experts: must be <= experts (8), got 9",
        ),
        ({"preset": "llama3-9b"}, "tasks[0].model.preset: unknown model 'llama3-9b'"),
        ({"preset": "llama3-8b", "gated": "yes"}, "tasks[0].model.gated: must be true or false"),
        ({"preset": "llama3-8b", "colour": 1}, "tasks[0].model.colour: unknown field"),
    ],
)
def test_inconsistent_model_fields_name_the_field(model: dict[str, Any], message: str) -> None:
    doc = _spec(tasks=[{"name": "a", "model": model, "global_batch": 8}], event=None)
    with pytest.raises(UsageError) as err:
        parse_spec(doc, ROOT)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    "task",
    [
        {"name": "long", "model": {"preset": "llama3-8b", "seq_len": 131072}, "global_batch": 16},
        {"name": "moe", "model": "mixtral-8x7b", "global_batch": 256, "precision": "fp8"},
    ],
)
def test_todays_models_plan_with_their_layouts(task: dict[str, Any]) -> None:
    doc = {"cluster": {"nodes": 8, "gpu": "H100-80GB", "unit": "gpu"}, "tasks": [task]}
    (row,) = build_report(parse_spec(doc, ROOT)).rows
    assert 0 < row.gpus <= 64 and row.layout is not None and row.memory_gib is not None
    assert row.memory_gib <= 0.9 * 80
    assert (
        ("cp" in row.layout)
        if task["name"] == "long"
        else ("ep" in row.layout or "fsdp" in row.layout)
    )
    with pytest.raises(UsageError, match=r"^tasks\[0\]\.precision: fp8 needs a GPU with FP8"):
        parse_spec({"cluster": {"nodes": 8}, "tasks": [{**task, "precision": "fp8"}]}, ROOT)


@pytest.mark.e2e
def test_json_output_end_to_end() -> None:
    proc = _run(str(ROOT / "examples" / "plans" / "node-lost.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out["total_waf"], float) and out["total_waf"] > 0
    keys = {"name", "gpus", "tp", "pp", "dp", "micro_batch", "tflops_per_gpu", "waf"}
    assert len(out["tasks"]) == 3
    for task in out["tasks"]:
        assert keys <= task.keys()
    assert out["total_waf"] == pytest.approx(sum(t["waf"] for t in out["tasks"]))
    assert sum(t["gpus"] for t in out["tasks"]) <= 15 * 8


@pytest.mark.e2e
def test_table_output_end_to_end() -> None:
    proc = _run(str(ROOT / "examples" / "plans" / "task-added.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "gpt3-175b" in proc.stdout and "layout" in proc.stdout and "dist-opt" in proc.stdout


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_spec(bogus=True), "bogus: unknown field"),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-175b", "global_batch": 1536}]),
            "tasks[0].model:",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "min_gpus": 4096}]),
            "tasks[0].min_gpus:",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "gpt-1.3b", "global_batch": 8, "weight": -2}]),
            "tasks[0].weight:",
        ),
        (
            _spec(
                tasks=[
                    {
                        "name": "a",
                        "model": {"preset": "llama3-8b", "kv_heads": 3},
                        "global_batch": 8,
                    }
                ]
            ),
            "tasks[0].model.kv_heads:",
        ),
        (
            _spec(tasks=[{"name": "a", "model": "llama3-405b", "global_batch": 64}], event=None),
            "needs at least",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, doc: dict[str, Any], field: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = _run(str(path), "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], proc.stderr


@pytest.mark.e2e
def test_missing_file_exits_2(tmp_path: Path) -> None:
    proc = _run(str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.mark.e2e
@pytest.mark.skipif(
    any(importlib.util.find_spec(m.partition(":")[0]) is None for m, _ in COMMANDS.values()),
    reason="python -m unicron needs every command module (other issues) to exist",
)
def test_python_m_unicron_plan() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "unicron", "plan", "examples/plans/node-lost.yaml", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "total_waf" in json.loads(proc.stdout)


def test_layouts_lists_the_fastest_fitting_ones(tmp_path: Path) -> None:
    spec = parse_spec(_spec(), "spec")
    plain = build_report(spec)
    report = build_report(spec, layouts=5)
    for before, row in zip(plain.rows, report.rows, strict=True):
        assert before.fitting == () and row.layout == before.layout
        assert 0 < len(row.fitting) <= 5
        times = [f.iter_time_s for f in row.fitting]
        assert times == sorted(times)
        assert all(f.memory_bytes_per_gpu <= f.usable_bytes for f in row.fitting)
        assert row.fitting[0].gpus == row.gpus
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec()))
    proc = _run(str(path), "--json", "--layouts", "3")
    assert proc.returncode == 0, proc.stderr
    tasks = json.loads(proc.stdout)["tasks"]
    assert all(1 <= len(t["layouts"]) <= 3 for t in tasks)
    bad = _run(str(path), "--layouts", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
