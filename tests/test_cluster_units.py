"""The cluster's pure parts: task files, the state directory, the agent/coordinator codec."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from unicron import messages as M
from unicron.control.state import DB, SCHEMA, NodeRow, TaskRow, open_state
from unicron.control.taskspec import load, parse
from unicron.detect.classify import Action, Scope, Severity, Verdict
from unicron.errors import UsageError
from unicron.protocol import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


# -- task files ----------------------------------------------------------------------------
def write(tmp: Path, text: str) -> Path:
    path = tmp / "task.yaml"
    path.write_text(text)
    return path


GOOD = f"name: gpt\nscript: {SCRIPT}\nargs: [--steps, '5']\nworkers: {{min: 2, max: 4}}\n"


def test_task_file_loads_and_resolves_a_relative_script(tmp_path: Path) -> None:
    spec = load(write(tmp_path, GOOD))
    assert (spec.name, spec.workers.min, spec.workers.max, spec.args) == (
        "gpt",
        2,
        4,
        ["--steps", "5"],
    )
    (tmp_path / "s.py").write_text("")
    spec = load(write(tmp_path, "name: x\nscript: s.py\n"))
    assert spec.script == str(tmp_path / "s.py")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("colour: red\n", "colour: Extra inputs are not permitted"),
        ("weight: heavy\n", "weight: Input should be a valid number"),
        ("threads: [1]\n", "threads: Input should be a valid integer"),
        ("workers: {min: 3, max: 2}\n", "min (3) is above max (2)"),
        ("workers: {min: 0}\n", "workers.min: Input should be greater than or equal to 1"),
        ("inject: ['crash:rank=x']\n", "inject: Value error, --inject 'crash:rank=x'"),
        ("inject: ['explode:rank=1,step=2']\n", "--inject 'explode"),
        ("model: {preset: no-such-model}\n", "model"),
        ("reduce: sloppy\n", "reduce: Input should be 'exact' or 'fast'"),
        ("checkpoint: {every: -1}\n", "checkpoint.every"),
        ("give_up_after: .nan\n", "give_up_after"),
    ],
)
def test_a_bad_task_file_is_one_line(tmp_path: Path, extra: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        load(write(tmp_path, GOOD + extra))
    msg = str(err.value)
    assert says in msg and "\n" not in msg and msg.startswith(str(tmp_path / "task.yaml"))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name: x\nscript: /no/such/script.py\n", "script not found: /no/such/script.py"),
        (f"script: {SCRIPT}\n", "name: Field required"),
        ("name: x\n", "script: Field required"),
        (f"name: 'bad name'\nscript: {SCRIPT}\n", "name: String should match pattern"),
        ("- a list\n", "must be a mapping"),
        ("name: [unclosed\n", "not YAML"),
    ],
)
def test_more_bad_task_files(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        load(write(tmp_path, text))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_numbers_in_args_are_their_text_and_every_problem_is_named(tmp_path: Path) -> None:
    spec = load(write(tmp_path, f"name: n\nscript: {SCRIPT}\nargs: [--steps, 150, --lr, 0.5]\n"))
    assert spec.args == ["--steps", "150", "--lr", "0.5"]
    bad = f"name: n\nscript: {SCRIPT}\nargs: [--flag, yes]\nthreads: many\nweight: -1\n"
    with pytest.raises(UsageError) as err:
        load(write(tmp_path, bad))
    msg = str(err.value)
    assert "\n" not in msg and "more)" not in msg
    for says in ("args.1: Input should be a valid string", "threads: Input should be a valid "
                 "integer", "weight: Input should be greater than 0"):  # fmt: skip
        assert says in msg, msg


def test_a_relative_checkpoint_dir_is_taken_from_the_task_file(tmp_path: Path) -> None:
    spec = load(write(tmp_path, GOOD + "checkpoint: {every: 5, dir: ck}\n"))
    assert spec.checkpoint.dir == str(tmp_path / "ck")


def test_missing_task_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="No such file"):
        load(tmp_path / "none.yaml")


def test_parse_takes_json_like_data() -> None:
    spec = parse({"name": "a", "script": str(SCRIPT), "checkpoint": {"every": "auto"}})
    assert spec.checkpoint.every == "auto" and spec.model_dump()["workers"] == {"min": 1, "max": 1}


# -- the state directory -------------------------------------------------------------------
def test_state_reloads_after_a_restart(tmp_path: Path) -> None:
    s = open_state(tmp_path / "st")
    s.save_node(NodeRow(0, "n0", 2, "10.0.0.2", "abc", 1.0))
    s.save_task(
        TaskRow("t", "t.1", {"name": "t"}, "running", 2.0, [0, 0], epoch=3, committed_step=7)
    )
    s.add_event("t", {"event": "step_end", "ts": 3.0, "step": 7})
    s.set_meta("alive_ts", "4.0")
    s.close()
    again = open_state(tmp_path / "st")
    assert again.nodes() == [NodeRow(0, "n0", 2, "10.0.0.2", "abc", 1.0)]
    (task,) = again.tasks()
    assert (task.state, task.placement, task.epoch, task.committed_step) == (
        "running",
        [0, 0],
        3,
        7,
    )
    assert again.events("t") == [(1, {"event": "step_end", "ts": 3.0, "step": 7})]
    assert again.meta("alive_ts") == "4.0" and again.meta("schema") == SCHEMA
    again.close()


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_foreign_directory_is_refused_and_untouched(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("precious")
    before = snapshot(tmp_path)
    with pytest.raises(UsageError, match=r"not a Unicron state directory \(holds thesis.tex\)"):
        open_state(tmp_path)
    assert snapshot(tmp_path) == before


def test_a_file_is_not_a_state_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        open_state(tmp_path / "f")


def test_a_corrupt_database_is_refused_and_untouched(tmp_path: Path) -> None:
    (tmp_path / DB).write_bytes(b"this is not sqlite at all" * 100)
    before = snapshot(tmp_path)
    with pytest.raises(UsageError, match=f"{DB} is not a readable state") as err:
        open_state(tmp_path)
    assert "\n" not in str(err.value)
    assert snapshot(tmp_path) == before


def test_a_database_of_another_schema_is_refused(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('schema', 'someone-else/9')")
    conn.commit()
    conn.close()
    before = snapshot(tmp_path)
    with pytest.raises(UsageError, match="has schema 'someone-else/9'"):
        open_state(tmp_path)
    assert snapshot(tmp_path) == before
    other = sqlite3.connect(tmp_path / "x.db")
    other.execute("CREATE TABLE t (a)")
    other.close()
    (tmp_path / "x.db").replace(tmp_path / DB)
    with pytest.raises(UsageError, match=r"not a readable state|no schema"):
        open_state(tmp_path)


@pytest.mark.e2e
def test_the_coordinator_refuses_a_foreign_state_dir_with_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "unicron", "coordinator", "--state-dir", str(tmp_path),
         "--port", "1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "not a Unicron state" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- the codec -----------------------------------------------------------------------------
VERDICT = Verdict("conn_reset", Severity.SEV3, Action.REATTEMPT, "peer reset", Scope.SLOT)

EXAMPLES: list[Any] = [
    M.Spawn(slot=1, place=3),
    M.Kill(slot=2, verdict=VERDICT),
    M.Kill(slot=2),
    M.Probe(slot=3),
    M.Ready(slot=0, ts=1.5, microbatches=8, state_bytes=100),
    M.EpochEntered(slot=0, ts=1.0, epoch=4),
    M.StepBegan(slot=1, ts=2.0, step=5, epoch=2, cpu_s=1.5),
    M.StepComputed(slot=1, ts=2.5, step=5, compute_s=0.25, microbatches=2, cpu_s=1.75),
    M.WaitingOnReplica(slot=1, ts=2.125, step=5, epoch=2, waiting=True),
    M.CpuTime(slot=1, ts=2.25, cpu_s=1.625),
    M.Event(ts=3.0, name="step_end", fields={"step": 5, "loss": 1.25, "members": [0, 1]}),
    M.Detected(slot=2, ts=4.0, step=None, verdict=VERDICT, method="process", extra={"rc": -9}),
    M.WorkerError(slot=1, ts=4.5, verdict=VERDICT, in_place=True, epoch=3),
    M.WorkerFailed(
        slot=1, ts=5.0, verdict=Verdict("lost", Severity.SEV1, Action.EXCLUDE, "x", Scope.NODE)
    ),
    M.WorkerLeft(slot=0, ts=6.0),
    M.WorkerDone(slot=0, ts=7.0, steps=3, final_loss=None, params_sha256="ab", rank=0, epoch=2),
    M.BadInput(ts=8.0, message="checkpoint of another model"),
    M.ProbeDone(slot=1, ts=9.0, ok=False, detail="no"),
    M.ProbeNotStarted(slot=1, ts=9.5, error="fork failed"),
    M.Census(ts=10.0, alive=(0, 1), ready=(1,)),
    M.Reply(actions=(M.Spawn(slot=1), M.Kill(slot=0, verdict=VERDICT), M.Probe(slot=2)), over=True),
    M.Assignment(
        uid="u1",
        name="t",
        slots=(0, 2),
        script="train.py",
        args=("--steps", "4"),
        inject=("crash:rank=0,step=3",),
        threads=1,
        store="10.0.0.1:29500",
        store_key="k",
        device="cpu",
        settings=WorkerSettings(tp=2, resume=True),
        env={"A": "1"},
        places=(0, 1),
    ),
    # what only the agent's local socket carries, through the same codec
    M.Hello(slot=1, pid=42, incarnation=0),
    M.Error(type_name="RuntimeError", message="boom", in_band=True, step=4, epoch=3),
    M.WhereStore(),
    M.StoreAt(address="10.0.0.1:29500"),
    M.NodeFault(),
    M.ZygoteUp(pid=7),
    M.Spawned(slot=1, pid=43, incarnation=1),
    M.Exited(pid=43, returncode=-9),
    M.SpawnWorker(slot=1, incarnation=1, env={"A": "1"}, script="t.py", argv=("-x",), log="l"),
]


def test_every_message_type_is_covered() -> None:
    assert {type(m).__name__ for m in EXAMPLES} == set(M.KINDS)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_codec_roundtrip(msg: Any) -> None:
    import json

    wire = json.loads(json.dumps(M.to_wire(msg)))
    assert M.from_wire(wire) == msg
    assert dataclasses.is_dataclass(msg)


@pytest.mark.parametrize(
    "bad",
    [{}, {"type": "Nope"}, {"type": "Spawn"}, {"type": "Spawn", "slot": "one"},
     {"type": "Spawn", "slot": True}, {"type": "Ready", "slot": 1, "ts": "now"},
     {"type": "StepBegan", "slot": 1, "ts": 1, "step": 1.5},
     {"type": "Kill", "slot": 1, "verdict": {"kind": "x"}}, {"type": "Reply", "actions": [{}]},
     {"type": "Probe", "slot": 1, "extra": 2}],
)  # fmt: skip
def test_codec_refuses_what_is_not_a_message(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not a message"):
        M.from_wire(bad)


def test_an_assignment_carries_its_workers_settings_typed_and_refuses_unknown_ones() -> None:
    """The assignment an agent gets with its heartbeat is a typed message of the one codec:
    its workers' settings arrive as :class:`~unicron.protocol.WorkerSettings`, and a setting
    this release does not know is refused, not dropped."""
    (assignment,) = [m for m in EXAMPLES if isinstance(m, M.Assignment)]
    wire = M.to_wire(assignment)
    assert M.from_wire(wire).settings == WorkerSettings(tp=2, resume=True)
    with pytest.raises(ValueError, match="not a message"):
        M.from_wire({**wire, "settings": {**wire["settings"], "nope": 1}})
