"""FSDP inside a replica under ``unicron run --fsdp 2``, end to end: two replicas of two
ranks on 4 workers, each rank holding half of every parameter and of the optimizer's state
(PyTorch's ``fully_shard``), computing its own micro-batches in rounds
(docs/runtime.md, FSDP inside a replica).

The fault-free reference is the plain data-parallel run of the same model on 4 workers: the
exact reduce takes every micro-batch's gradient slice alone, so the sharded run ends with
the unsharded bits, its place 0 holding the first half of each parameter's rows and place 1
the rest. A rank lost mid-step (place 0 of replica 0, after its first round), a rank of the
other replica, and a hung rank take their replica out of the step; the other replica's
finished micro-batches are kept, the living partner waits, and the replica comes back whole,
its restarted rank taking its shards from the same place in the live replica. The run still
ends with the unsharded bits. Bad layouts and a script that does not shard are refused with
one line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "train_llama_parallel.py"
STEPS = 9
LONG = pytest.mark.long  # a case like one the default suite runs


def _llama(run: Any, *flags: str, steps: int = STEPS, extra: tuple[str, ...] = ()) -> Any:
    return run(*flags, script=SCRIPT, script_args=("--steps", str(steps), "--out", "out", *extra))


def _state(r: Any) -> dict[str, torch.Tensor]:
    """The run's final model state, whole: ``final.pt``, or the places' shards (rows of each
    parameter, in place order) put together."""
    out = r.out.parent / "out"
    if (out / "final.pt").exists():
        return torch.load(out / "final.pt")
    shards = [torch.load(p) for p in sorted(out.glob("final.shard*.pt"))]
    assert shards, sorted(out.iterdir())
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def test_fsdp_replicas_heal_to_the_unsharded_bits(run: Any) -> None:
    """The later faults wait for both replicas to be back (``members=4``): beside CPU
    burners replica 1 came back only at step 7, and the hang then stopped the last copy of
    place 0's shard, with no checkpoint (the task failed, rightly). Replica 0 trains alone
    meanwhile, at its own pace: beside burners it once did steps 4-13 (0.26 s each) in the
    2.6 s replica 1 took to come back, the run ended with 14 steps before the hang could
    fire, and the test saw no hang. 50 steps leave it about 10 s at that pace."""
    steps = 50  # room for the later faults, whatever the machine's pace
    plain = _llama(run, "--nproc-per-node", "4", steps=steps)
    faulty = _llama(
        run,
        "--nproc-per-node", "4", "--fsdp", "2",
        "--checkpoint-every", "0",  # no checkpoint to fall back on: replicas heal each other
        "--inject", "crash:rank=0,step=2,mb=1",  # place 0 of replica 0, in its second round
        "--inject", "crash:rank=3,step=4,members=4",  # place 1 of replica 1
        "--inject", "hang:rank=0,step=7,members=4",  # its partner waits in the all-gathers
        steps=steps,
    )  # fmt: skip
    for r in (plain, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.task_end["status"] == "ok" and r.task_end["steps"] == steps
    want, got = _state(plain), _state(faulty)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # each rank kept half of each parameter: the files are the places' shards
    shard = torch.load(faulty.out.parent / "out" / "final.shard0.pt")
    assert shard["tok.weight"].shape[0] * 2 == want["tok.weight"].shape[0]
    # replica grain: the broken replica left whole, only the dead and the hung ranks restarted
    epochs = [tuple(e["members"]) for e in faulty.of("epoch_begin")]
    assert (2, 3) in epochs and (0, 1) in epochs, epochs
    restarted = sorted(e["slot"] for e in faulty.of("action") if e["action"] == "restart")
    assert restarted == [0, 0, 3], restarted
    (hang,) = [e for e in faulty.of("error_detected") if e["kind"] == "hang"]
    assert hang["slot"] == 0
    partial = [e for e in faulty.of("transition_end") if e.get("microbatches_reused")]
    assert partial and all(
        e["microbatches_reused"] + e["microbatches_recomputed"] == 8 for e in partial
    )
    assert sorted(e["step"] for e in faulty.of("step_end")) == list(range(steps))


def test_short_rounds_and_uneven_shards_keep_the_unsharded_bits(run: Any) -> None:
    """FSDP=3 on 3 workers, 4 micro-batches a step: a round of three, then one whose two
    other places compute a padding micro-batch (not added), and every parameter's rows split
    3 ways unevenly (FSDP pads them): the plain one-worker run's bits."""
    plain = _llama(run, "--nproc-per-node", "1", steps=3, extra=("--microbatches", "4"))
    three = _llama(run, "--nproc-per-node", "3", "--fsdp", "3", steps=3,
                   extra=("--microbatches", "4"))  # fmt: skip
    for r in (plain, three):
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = _state(plain), _state(three)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.long
def test_every_fsdp_replica_broken_falls_back_to_the_sharded_checkpoint(run: Any) -> None:
    """A rank of each replica lost in one step (the replicas on two nodes): no place's shards
    survive in a whole replica, so every rank reads its place's shard of the newest
    checkpoint (the automatic interval at a 1 s MTBF), redoes the steps since, and the run
    still ends with the plain run's bits."""
    plain = _llama(run, "--nproc-per-node", "4", steps=12)
    faulty = _llama(
        run, "--nnodes", "2", "--nproc-per-node", "2", "--fsdp", "2", "--mtbf", "1",
        "--inject", "crash:rank=0,step=8", "--inject", "crash:rank=2,step=8", steps=12,
    )  # fmt: skip
    for r in (plain, faulty):
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = _state(plain), _state(faulty)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert "checkpoint" in {e["state_source"] for e in faulty.of("transition_end")}


UNSHARDED = """
import llama_parallel, torch, unicron.fsdp, unicron.worker
model, opt, data = llama_parallel.build(llama_parallel.TensorParallel(0, 1))
for block in model.blocks.values() if BLOCKS else ():
    unicron.fsdp.fully_shard(block)  # and not the whole model: its own parameters are not
opt = torch.optim.AdamW(model.parameters())
unicron.worker.train(model=model, optimizer=opt, loss_fn=llama_parallel.loss_fn,
                     dataset=data, micro_batch_size=2, num_microbatches=4, steps=2)
"""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--nproc-per-node", "4", "--fsdp", "3"), "--fsdp 3: 3 ranks of a stage must divide"),
        pytest.param(
            ("--nproc-per-node", "4", "--fsdp", "2", "--tp", "2"), "fsdp 2 with tp", marks=LONG
        ),
        pytest.param(
            ("--nproc-per-node", "4", "--fsdp", "2", "--zero", "1"),
            "fsdp 2 with zero 1",
            marks=LONG,
        ),  # both also in tests/test_fsdp_layout.py, without a run
        (("--nproc-per-node", "4", "--fsdp", "2", "--min-workers", "3"), "multiple of --fsdp 2"),
    ],
)
def test_a_bad_fsdp_layout_gets_one_line_and_exit_2(
    run: Any, flags: tuple[str, ...], message: str
) -> None:
    r = _llama(run, *flags, steps=2)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        pytest.param(
            False, "--fsdp 2: the model has no module sharded with fully_shard", marks=LONG
        ),
        (True, "--fsdp 2: parameters tok.weight, norm.weight, head.weight are not sharded"),
    ],
)
def test_a_model_not_sharded_under_fsdp_is_refused_with_one_line(
    run: Any, tmp_path: Path, blocks: bool, message: str
) -> None:
    script = tmp_path / "unsharded.py"
    head = f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); BLOCKS = {blocks}\n"
    script.write_text(head + UNSHARDED)
    r = run("--nproc-per-node", "2", "--fsdp", "2", script=script)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
    assert "Traceback" not in r.stderr
