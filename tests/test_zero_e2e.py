"""The sharded optimizer under ``unicron run --zero 1``, end to end: each parameter's AdamW
state on two replicas, not on all (:mod:`unicron.runtime.zero`). Ranks lost mid-step, a
hang, a tensor-parallel layout: the run ends with the bits of the *unsharded* fault-free run
(the same update, whoever computes it), healed from the buddies without a checkpoint; both
keepers of a share lost at once: the checkpoint (written from the gathered shares), to the
same bits."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT
from tests.test_model_parallel_e2e import _same, _shards

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "train_llama_parallel.py"
STEPS = 16  # room for the later faults, which wait for the task to be whole again


def _run(run: Any, *flags: str) -> Any:
    return run(*flags, script=SCRIPT, script_args=("--steps", str(STEPS), "--out", "out"))


def _sources(r: Any) -> list[str]:
    return [e["state_source"] for e in r.of("transition_end")]


def test_lost_ranks_heal_from_their_buddies_to_the_unsharded_bits(run: Any) -> None:
    clean = _run(run, "--nproc-per-node", "4")
    faulty = _run(
        run, "--nproc-per-node", "4", "--zero", "1", "--checkpoint-every", "0",
        "--inject", "crash:rank=1,step=3,mb=1",  # mid-step: its shares live on its buddies
        # each once the rank lost before is back (four members): not while a share is single.
        # The others wait for it (--min-workers 4), so the faults come whatever the machine's
        # pace (beside CPU burners three ranks once trained to the end before it was back)
        "--inject", "crash:rank=2,step=6,members=4",
        "--inject", "hang:rank=3,step=9,members=4", "--min-workers", "4",
    )  # fmt: skip
    for r in (clean, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.task_end["status"] == "ok" and r.task_end["steps"] == STEPS
    assert faulty.task_end["params_sha256"] == clean.task_end["params_sha256"]
    assert sorted(e["step"] for e in faulty.of("step_end")) == list(range(STEPS))
    # no checkpoint was ever written (--checkpoint-every 0): the shares came from the buddies
    # (rank 0's own transitions may all be "local": beside burners the epoch without a lost
    # rank was superseded by its return before rank 0 logged one that took shares)
    assert "checkpoint" not in _sources(faulty)
    # beside CPU burners the hang rule (its 1 s floor) may also restart a rank that was only
    # starved (seen: slot 0 at step 13, around a 2.8 s step); it healed like the others (the
    # bits above), and the injected faults' restarts are still exactly these, one each. A
    # crashed rank may be judged hung before its exit is heard of (seen: a ~2 s stall of the
    # whole machine right after the kill): its CPU stands still as a hung one's does, and the
    # restart is the same, so a hang restart of a faulted slot counts as its fault's
    faulted = {e["rank"] for e in faulty.of("fault_injected")}
    restarted = sorted(
        e["slot"]
        for e in faulty.of("action")
        if e["action"] == "restart"
        and not (e["reason"].startswith("hang on slot") and e["slot"] not in faulted)
    )
    assert restarted == [1, 2, 3]


@pytest.mark.long
def test_a_lost_node_heals_from_the_buddies_on_the_other_node(run: Any) -> None:
    """Two nodes of two: every share has a keeper on each node (the ownership plan puts the
    buddy on another node), so losing a whole node loses no share."""
    clean = _run(run, "--nproc-per-node", "4")
    faulty = _run(
        run, "--nnodes", "2", "--nproc-per-node", "2", "--zero", "1", "--checkpoint-every",
        "0", "--inject", "node:node=1,step=5",
    )  # fmt: skip
    for r in (clean, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
    assert faulty.task_end["params_sha256"] == clean.task_end["params_sha256"]
    assert [len(e["members"]) for e in faulty.of("epoch_begin")][:2] == [4, 2]
    assert "checkpoint" not in _sources(faulty)


@pytest.mark.long
def test_a_tensor_parallel_task_with_sharded_optimizer_heals_to_the_unsharded_bits(
    run: Any,
) -> None:
    """TP=2 x DP=3: each place's three members keep two thirds of its shard's state."""
    layout = ("--nproc-per-node", "6", "--tp", "2")
    clean = _run(run, *layout)
    faulty = _run(
        run, *layout, "--zero", "1", "--checkpoint-every", "0",
        "--inject", "crash:rank=0,step=3,mb=1",  # rank 0 of a tensor-parallel group
        "--inject", "crash:rank=5,step=7",
    )  # fmt: skip
    _same(clean, faulty, STEPS)
    assert "checkpoint" not in _sources(faulty)


@pytest.mark.long
def test_both_keepers_of_a_share_lost_fall_back_to_the_gathered_checkpoint(run: Any) -> None:
    """DP=3: two members lost in one step hold every share of some parameters together; the
    checkpoint, written by replica 0 from the gathered shares, brings the same bits."""
    clean = _run(run, "--nproc-per-node", "3")
    faulty = _run(
        run, "--nproc-per-node", "3", "--zero", "1", "--checkpoint-every", "2",
        "--inject", "crash:rank=0,step=5,mb=1", "--inject", "crash:rank=1,step=5,mb=1",
    )  # fmt: skip
    for r in (clean, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
    assert faulty.task_end["params_sha256"] == clean.task_end["params_sha256"]
    assert "checkpoint" in _sources(faulty)
    saved = [e["step"] for e in faulty.of("checkpoint_saved") if e["ok"]]
    assert saved and all(s % 2 == 0 for s in saved), saved
    assert len(_shards(faulty)) == 0  # one rank a replica: final.pt, no shards


def test_a_member_lost_in_the_last_update_leaves_no_replica_stale(run: Any) -> None:
    """DP=3: rank 0 dies in the last step's update, after sending the values it owns, while
    the others' broadcasts go out. A member that missed some values does not finish with
    them: it waits for the next epoch, where a member that finished serves them, and the run
    ends with the unsharded fault-free bits (before: "replicas finished with different
    parameters", every time)."""
    steps = ("--steps", "6", "--out", "out")
    clean = run("--nproc-per-node", "3", script=SCRIPT, script_args=steps)
    faulty = run(
        "--nproc-per-node", "3", "--zero", "1", "--checkpoint-every", "0",
        "--inject", "crash:rank=0,step=5,phase=update", script=SCRIPT, script_args=steps,
    )  # fmt: skip
    for r in (clean, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.task_end["status"] == "ok" and r.task_end["steps"] == 6
    assert faulty.task_end["params_sha256"] == clean.task_end["params_sha256"]
    assert [e["step"] for e in faulty.of("fault_injected")] == [5]
    assert "checkpoint" not in _sources(faulty)


def test_zero_with_pipeline_depth_choices_is_refused_in_one_line(run: Any) -> None:
    r = run(
        "--nproc-per-node", "4", "--pp", "2", "--zero", "1", "--pp-choices", "1",
        script=SCRIPT, script_args=("--steps", "2"),
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "zero 1 with pp_choices" in lines[0], r.stderr
