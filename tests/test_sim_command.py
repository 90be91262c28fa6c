"""``unicron simulate`` end to end: bad input exits 2, summary.json schema, traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unicron.errors import UsageError
from unicron.sim.trace import LLAMA3_CAUSES, generate, load_csv

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "unicron", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.e2e
def test_malformed_trace_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,node1\n0,add,node2\n1000,explode,node1\n")
    p = _run("--trace", str(bad), "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    assert f"{bad}:3" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize(
    ("line", "what"), [("abc,add,node1", "not an integer"), ("5,remove", "expected")]
)
def test_load_csv_errors(tmp_path, line, what):
    f = tmp_path / "t.csv"
    f.write_text(f"0,add,node1\n{line}\n")
    with pytest.raises(UsageError, match=rf"t\.csv:2: .*{what}"):
        load_csv(f)


@pytest.mark.e2e
def test_unknown_policy_lists_known_ones(tmp_path):
    p = _run("--rate", "0.1", "--policies", "unicron,nope", "--out", str(tmp_path))
    assert p.returncode == 2
    assert "nope" in p.stderr
    for name in ("unicron", "megatron", "oobleck", "varuna", "bamboo", "torchft"):
        assert name in p.stderr


def test_summary_schema(tmp_path):
    from unicron.cli import main

    out = tmp_path / "out"
    rc = main(["simulate", "--rate", "0.5", "--days", "2", "--seed", "3", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "summary.json").read_text())
    names = [p["policy"] for p in doc["policies"]]
    assert names == ["unicron", "unicron-all", "megatron", "oobleck", "varuna", "bamboo", "torchft"]
    for p in doc["policies"]:
        assert p["accumulated_waf"] > 0
        assert 0 < p["effective_fraction"] <= 1
        assert set(p["breakdown_s"]) == {
            "detection",
            "transition",
            "lost_work",
            "sub_healthy",
            "idle",
        }
        assert len(p["tasks"]) == 6
    assert set(doc["unicron_over"]) == set(names) - {"unicron"}
    assert (out / "summary.md").read_text().startswith("# Simulation")
    for png in ("waf.png", "breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared traces not present")
def test_shared_traces_parse():
    for f in sorted(SHARED.glob("*.csv")):
        events = load_csv(f)
        assert events and all(e.action in ("add", "remove") for e in events)
        assert [e.time_s for e in events] == sorted(e.time_s for e in events)


def test_generated_trace_follows_rate_and_mix():
    events = generate(nodes=200, duration_s=100 * 86400, rate_per_node_day=0.05, seed=0)
    failures = [e for e in events if e.action in ("remove", "fault")]
    assert 800 < len(failures) < 1200  # expect ~1000
    assert {e.cause for e in failures} <= {c.name for c in LLAMA3_CAUSES}
    removes = sum(e.action == "remove" for e in failures)
    assert 0.5 < removes / len(failures) < 0.85  # SEV1 share of the Llama 3 mix (~0.7)
    assert generate(nodes=3, duration_s=86400, rate_per_node_day=0.0, seed=0) == []
