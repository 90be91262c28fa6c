"""The example task files (``examples/tasks/*.yaml``) submitted to a cluster, and ``unicron
report`` of a cluster task beside ``unicron run``'s timeline for the same fault.

One cluster for the module (:mod:`unicron.control.lab` on loopback: a coordinator and two
agents of two slots, separate processes): the GPT, the Llama and the planner's task go in
with ``unicron submit`` as they are, together with the checkpointing one (its directory moved
into this test's folder); then the resuming one goes on from its checkpoints. A few steps
each: this checks that each file is accepted and trains to its end, not what it computes
(test_cluster_e2e.py checks the bits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, TRAIN, run_unicron
from unicron.control.lab import LocalCluster
from unicron.control.report import incidents
from unicron.control.taskspec import load

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TASKS = ROOT / "examples" / "tasks"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster"), hosts=2, slots=2, loopback=True) as c:
        c.start_coordinator()
        for host in range(2):
            c.start_agent(host, wait=False)
        c.wait_nodes(2)
        yield c


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``unicron ARGS --coordinator URL`` as a user runs it (the token in the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "unicron", *args, "--coordinator", cluster.url],
        capture_output=True, text=True, timeout=60, env=cluster.env(),
    )  # fmt: skip


def moved(path: Path, checkpoints: Path) -> dict[str, Any]:
    """A task file as submitted, its checkpoint directory moved to ``checkpoints``."""
    spec = load(path)
    ck = spec.checkpoint.model_copy(update={"dir": str(checkpoints)})
    return spec.model_copy(update={"checkpoint": ck}).model_dump()


def cells(line: str) -> list[str]:
    """The cells of a row of a rich table."""
    return [c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]


def steps(cluster: LocalCluster, name: str) -> list[int]:
    return [e["step"] for e in cluster.events(name) if e["event"] == "step_end"]


@pytest.mark.long
def test_every_example_task_file_trains(cluster: LocalCluster, tmp_path: Path) -> None:
    files = {p.name for p in TASKS.glob("*.yaml")}
    assert files == {"gpt.yaml", "llama.yaml", "planner.yaml", "gpt-checkpoint.yaml",
                     "gpt-resume.yaml", "llama-tp.yaml", "llama-3d.yaml",
                     "llama-zero.yaml", "llama-fsdp.yaml"}, files  # fmt: skip
    # llama-tp.yaml, llama-zero.yaml, llama-fsdp.yaml and llama-3d.yaml (replicas of 4
    # ranks: a node of 8) have tests below
    for name in ("gpt.yaml", "llama.yaml", "planner.yaml"):
        proc = cli(cluster, "submit", str(TASKS / name))
        assert proc.returncode == 0 and proc.stdout.startswith("submitted "), proc.stderr
    checkpoints = tmp_path / "checkpoints"
    cluster.submit(moved(TASKS / "gpt-checkpoint.yaml", checkpoints))
    expected = {"gpt": 20, "llama": 10, "planned": 20, "gpt-ckpt": 10}
    views = {name: cluster.wait_task(name, timeout_s=240) for name in expected}
    for name, count in expected.items():
        assert views[name]["state"] == "done", views[name]
        assert steps(cluster, name) == list(range(count)), name
    assert views["planned"]["weight"] == 2.0
    assert any(checkpoints.iterdir())
    cluster.submit(moved(TASKS / "gpt-resume.yaml", checkpoints))
    view = cluster.wait_task("gpt-resume", timeout_s=120)
    assert view["state"] == "done", view
    resumed = steps(cluster, "gpt-resume")  # from the newest checkpoint (step 5 or 10) on
    assert resumed[0] in (5, 10) and resumed == list(range(resumed[0], 20)), resumed


@pytest.mark.long
def test_report_of_a_cluster_task_is_run_s_timeline(cluster: LocalCluster, tmp_path: Path) -> None:
    """The same fault in a cluster task and in ``unicron run``: ``unicron report`` prints the
    table ``unicron run`` printed, with the same fault, verdict and action."""
    fault = "crash:rank=1,step=5"
    spec = {"name": "faulty", "script": str(TRAIN), "args": ["--steps", "15"],
            "workers": {"min": 2, "max": 2}, "inject": [fault]}  # fmt: skip
    cluster.submit(spec)
    run = run_unicron(tmp_path, "--nproc-per-node", "2", "--inject", fault, steps=15)
    assert run.returncode == 0, run.stderr[-2000:]
    assert cluster.wait_task("faulty", timeout_s=120)["state"] == "done"
    proc = cli(cluster, "report", "faulty")
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if "│" in line or "┃" in line]
    header = next(line for line in run.stderr.splitlines() if "detected by" in line)
    assert cells(table[0]) == cells(header)  # the same columns
    (ran,) = incidents(run.events)
    assert cells(table[1])[:1] == [ran.fault] == ["crash:step=5,rank=1"], table
    assert "task faulty: ok after 15 steps" in proc.stdout
    proc = cli(cluster, "report", "faulty", "--json")
    (got,) = json.loads(proc.stdout)["incidents"]
    assert (got["fault"], got["kind"], got["actions"][:1]) == (
        ran.fault,
        ran.kind,
        [*ran.actions[:1]],
    )
    for inc in (got, ran.__dict__):
        assert None not in (inc["detection_s"], inc["transition_s"], inc["recovery_s"]), inc


@pytest.mark.long
@pytest.mark.parametrize(("name", "flag"), [("llama-tp", "--tp"), ("llama-fsdp", "--fsdp")])
def test_a_replica_of_two_ranks_heals_in_the_cluster_to_run_s_bits(
    cluster: LocalCluster, tmp_path: Path, name: str, flag: str
) -> None:
    """``examples/tasks/llama-tp.yaml`` (TP=2 replicas) or ``llama-fsdp.yaml`` (FSDP=2)
    submitted with a rank lost mid-run: its replica waits, the rank's shard comes from the
    same place in the other replica, and the run ends with the bits of a fault-free
    ``unicron run --tp 2`` (``--fsdp 2``) of the same script: the replicas on two nodes of
    the cluster, on one node there."""
    spec = load(TASKS / f"{name}.yaml").model_dump()
    spec["inject"] = ["crash:rank=0,step=5"]
    cluster.submit(spec)
    script = ROOT / "examples" / "train_llama_parallel.py"
    run = run_unicron(tmp_path, "--nproc-per-node", "4", flag, "2", script=script,
                      script_args=("--steps", "12"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    view = cluster.wait_task(name, timeout_s=180)
    assert view["state"] == "done", view
    assert view["outcome"]["params_sha256"] == run.task_end["params_sha256"]
    epochs = [tuple(e["members"]) for e in cluster.events(name) if e["event"] == "epoch_begin"]
    assert all(len(m) % 2 == 0 for m in epochs) and len(epochs) >= 3, epochs


@pytest.mark.long
def test_a_replica_across_the_clusters_two_hosts_trains_to_run_s_bits(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """``examples/tasks/llama-3d.yaml``'s TP=2 x PP=2 on the cluster's two hosts of two
    slots: no host holds a replica, so its two stages go to the two hosts (the agents told
    each slot's place); its first stage's rank 0 lost mid-run, the task falls back to its
    checkpoint (no other replica) and ends with the bits of ``unicron run --tp 2 --pp 2``
    on one node."""
    spec = load(TASKS / "llama-3d.yaml").model_dump()
    ck = tmp_path / "checkpoints"
    spec.update(name="llama-2hosts", pp_choices=[], workers={"min": 4, "max": 4},
                args=["--steps", "12"], inject=["crash:rank=0,step=6"],
                checkpoint={"every": 2, "dir": str(ck)})  # fmt: skip
    cluster.submit(spec)
    script = ROOT / "examples" / "train_llama_parallel.py"
    run = run_unicron(tmp_path, "--nproc-per-node", "4", "--tp", "2", "--pp", "2",
                      script=script, script_args=("--steps", "12"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    view = cluster.wait_task("llama-2hosts", timeout_s=180)
    assert view["state"] == "done", view
    assert view["outcome"]["params_sha256"] == run.task_end["params_sha256"]
    first, second = view["placement"][:2], view["placement"][2:]
    assert len(set(first)) == len(set(second)) == 1 and first != second, view["placement"]
    ends = [e for e in cluster.events("llama-2hosts") if e["event"] == "transition_end"]
    assert "checkpoint" in {e["state_source"] for e in ends}, ends


@pytest.mark.long
def test_a_sharded_optimizer_task_heals_in_the_cluster_to_the_unsharded_bits(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """``examples/tasks/llama-zero.yaml`` (``zero: 1``) on the cluster's two nodes, a rank
    lost mid-run: its shares heal from their keepers on the other node, and the run ends with
    the bits of a fault-free, unsharded ``unicron run``."""
    spec = load(TASKS / "llama-zero.yaml").model_dump()
    spec["inject"] = ["crash:rank=1,step=5"]
    cluster.submit(spec)
    script = ROOT / "examples" / "train_llama_parallel.py"
    run = run_unicron(tmp_path, "--nproc-per-node", "4", script=script,
                      script_args=("--steps", "12"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    view = cluster.wait_task("llama-zero", timeout_s=180)
    assert view["state"] == "done", view
    assert view["outcome"]["params_sha256"] == run.task_end["params_sha256"]
    ends = [e for e in cluster.events("llama-zero") if e["event"] == "transition_end"]
    assert "checkpoint" not in {e["state_source"] for e in ends}


@pytest.mark.long
def test_a_3d_task_changes_layout_in_the_cluster_to_run_s_bits(tmp_path: Path) -> None:
    """``examples/tasks/llama-3d.yaml`` (TP=2 x PP=2 x DP=2, ``pp_choices: [1]``) submitted
    to a node of 8 slots, slot 5 excluded by an ECC error and readmitted: PP=1 on six, PP=2
    on eight again, and the bits of a fault-free ``unicron run --tp 2 --pp 2``."""
    spec = load(TASKS / "llama-3d.yaml").model_dump()
    spec["inject"] = ["error:rank=5,step=4,kind=ecc"]
    spec["readmit_after"] = 1.0
    spec["args"] = ["--steps", "120"]
    script = ROOT / "examples" / "train_llama_parallel.py"
    (tmp_path / "run").mkdir()
    # steps enough for the excluded slot's probe to answer before the end: a fresh interpreter
    # importing torch, 0.6 s idle but 5-19 s at load 10, when 40 steps left ~9 s (two misses)
    run = run_unicron(tmp_path / "run", "--nproc-per-node", "8", "--tp", "2", "--pp", "2",
                      script=script, script_args=("--steps", "120"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    with LocalCluster(tmp_path / "cluster", hosts=1, slots=8, loopback=True) as c:
        c.start_coordinator()
        c.start_agent(0, wait=False)
        c.wait_nodes(1)
        c.submit(spec)
        view = c.wait_task("llama-3d", timeout_s=240)
        assert view["state"] == "done", view
        assert view["outcome"]["params_sha256"] == run.task_end["params_sha256"]
        began = [e for e in c.events("llama-3d") if e["event"] == "epoch_begin"]
    layouts = [(e["pp"], len(e["members"])) for e in began]
    assert layouts[0] == (2, 8) and (1, 6) in layouts and layouts[-1] == (2, 8), layouts


def test_the_planner_picks_the_layout_a_cluster_task_runs(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A TP=2 task that may also run at TP=1 and describes its model (GPT 1.3B at global
    batch 256): on the cluster's A100 slots the performance model rates TP=1 x DP=4 faster
    than TP=2 x DP=2 (no tensor-parallel sums), so the task runs at TP=1 from its first epoch
    (``epoch_begin`` says ``tp`` 1), each worker building that shard before its first step,
    and ends with the bits of a fault-free ``unicron run`` of the same script at TP=1."""
    spec = load(TASKS / "llama-tp.yaml").model_dump()
    spec.update(name="llama-planned", tp_choices=[1], model={"preset": "gpt-1.3b"},
                global_batch=256, workers={"min": 4, "max": 4})  # fmt: skip
    cluster.submit(spec)
    script = ROOT / "examples" / "train_llama_parallel.py"
    run = run_unicron(tmp_path, "--nproc-per-node", "4", script=script,
                      script_args=("--steps", "12"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    view = cluster.wait_task("llama-planned", timeout_s=180)
    assert view["state"] == "done", view
    began = [e for e in cluster.events("llama-planned") if e["event"] == "epoch_begin"]
    assert began and all(e["tp"] == 1 for e in began), began
    assert view["outcome"]["params_sha256"] == run.task_end["params_sha256"]
