"""The step API (``unicron.worker.Loop``): a user's own loop heals bit for bit.

End to end: a Hugging Face Llama trained by its own loop, and the example GPT written as a
plain loop, each under injected faults, end with the parameters of their fault-free runs
(computed on another number of replicas, so the check also covers determinism across
replicas); a user's sampler keeps reading the same samples through a restart and a resume;
bad use of the API exits 2 with one line naming the mistake, before the step commits. Then
the pure parts: the sampler's committed position, the API outside ``unicron run``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, RunResult, run_unicron
from unicron.errors import UsageError
from unicron.runtime.data import SamplerData as _SamplerData
from unicron.worker import Loop, train

pytestmark = pytest.mark.timeout(180)

EXAMPLES = ROOT / "examples"
GPT_LOOP = EXAMPLES / "train_gpt_loop.py"
LLAMA = EXAMPLES / "train_llama.py"
MISUSE_SCRIPT = ROOT / "tests" / "scripts" / "misuse.py"


def _run(tmp: Path, script: Path, *run_args: str, steps: int, extra: tuple[str, ...] = ()) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    args = ("--steps", str(steps), "--out", str(tmp / "out"), *extra)
    return run_unicron(tmp, *run_args, script=script, script_args=args, steps=None)


def _ok(r: RunResult, steps: int) -> str:
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.task_end["status"] == "ok" and r.task_end["steps"] == steps
    sha: str = r.task_end["params_sha256"]
    return sha


@pytest.mark.long
@pytest.mark.e2e
def test_hugging_face_llama_with_its_own_loop_heals_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNICRON_PRELOAD", "transformers")  # imported once, by the zygote
    steps = 12
    clean = _run(tmp_path / "clean", LLAMA, "--nproc-per-node", "2", steps=steps)
    faults = ("--inject", "crash:rank=1,step=4", "--inject", "error:rank=2,step=8,kind=cuda")
    # a checkpoint every 2 steps: on a loaded machine the restarted workers may not be back
    # before the next fault, and the last holder of the state is the one that fails
    faulty = _run(tmp_path / "faulty", LLAMA, "--nproc-per-node", "3", "--checkpoint-every",
                  "2", *faults, steps=steps)  # fmt: skip
    assert _ok(faulty, steps) == _ok(clean, steps)
    assert len(faulty.of("fault_injected")) == 2
    assert {e["slot"] for e in faulty.of("action") if e["action"] == "restart"} >= {1, 2}
    assert any(e.get("microbatches_reused") for e in faulty.of("transition_end"))


@pytest.mark.e2e
def test_the_example_gpt_as_a_plain_loop_heals_bit_for_bit_and_matches_train(
    tmp_path: Path,
) -> None:
    steps = 16
    # train() is the step API's loop: the plain loop computes the same bits
    (tmp_path / "train").mkdir()
    clean = run_unicron(tmp_path / "train", "--nproc-per-node", "2", steps=steps)
    faults = ("--inject", "crash:rank=1,step=3", "--inject", "hang:rank=3,step=9")
    faulty = _run(tmp_path / "loop", GPT_LOOP, "--nproc-per-node", "4", *faults, steps=steps)
    assert _ok(faulty, steps) == _ok(clean, steps)
    assert {e["fault"] for e in faulty.of("fault_injected")} == {"crash", "hang"}
    assert "hang" in [e["kind"] for e in faulty.of("error_detected") if e["slot"] == 3]


@pytest.mark.long
@pytest.mark.e2e
def test_gradients_handed_over_and_clipped_by_the_loop_heal_bit_for_bit(tmp_path: Path) -> None:
    steps = 6
    clipped = ("--misuse", "none", "--clip")
    hooks = _run(tmp_path / "hooks", MISUSE_SCRIPT, "--nproc-per-node", "2", steps=steps,
                 extra=clipped)  # fmt: skip
    crash = ("--inject", "crash:rank=1,step=2")
    explicit = _run(tmp_path / "explicit", MISUSE_SCRIPT, "--nproc-per-node", "2", *crash,
                    steps=steps, extra=(*clipped, "--explicit"))  # fmt: skip
    assert _ok(explicit, steps) == _ok(hooks, steps)
    assert explicit.of("fault_injected")
    # the clipping ran on every committed step, on the mean gradient
    log = (tmp_path / "hooks" / "logs" / "worker0.0.log").read_text()
    assert [f"step {s}: clipped" in log for s in range(steps)] == [True] * steps, log
    # torchrun's variables, as the surviving worker saw them at each commit, are those of the
    # epoch the step committed in (the crash shrinks the world, the restart grows it back)
    survivor = (tmp_path / "explicit" / "logs" / "worker0.0.log").read_text()
    seen = re.findall(r"step (\d+): RANK=(\d+) WORLD_SIZE=(\d+) UNICRON_EPOCH=(\d+)", survivor)
    assert len(seen) == steps, survivor
    commits = {(e["step"], e["epoch"]): e["workers"] for e in explicit.of("step_end")}
    assert all(commits[(int(s), int(e))] == int(w) > int(r) for s, r, w, e in seen), seen
    assert len({w for _, _, w, _ in seen}) == 2, seen  # alone after the crash, then two again


SAMPLER_STEPS = 20
"""the worker crashed at step 4 rejoins at step 5 or 6 (0.15-0.35 s after the crash): enough
steps after that for a loaded machine to be slower still"""


@pytest.fixture(scope="module")
def sampler_clean(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fault-free run that reads a DistributedSampler's order: its parameters' SHA-256."""
    tmp = tmp_path_factory.mktemp("sampler-clean")
    r = _run(tmp, GPT_LOOP, "--nproc-per-node", "2", steps=SAMPLER_STEPS, extra=("--sampler",))
    return _ok(r, SAMPLER_STEPS)


@pytest.mark.long
@pytest.mark.e2e
def test_a_restarted_worker_receives_the_samplers_position_with_the_state(
    tmp_path: Path, sampler_clean: str
) -> None:
    crash = ("--inject", "crash:rank=1,step=4")
    healed = _run(tmp_path, GPT_LOOP, "--nproc-per-node", "2", *crash,
                  steps=SAMPLER_STEPS, extra=("--sampler",))  # fmt: skip
    assert _ok(healed, SAMPLER_STEPS) == sampler_clean
    assert any(e["state_source"] == "peer_node" for e in healed.of("transition_end"))


@pytest.mark.long
@pytest.mark.e2e
def test_a_resumed_run_reads_the_samplers_position_from_the_checkpoint(
    tmp_path: Path, sampler_clean: str
) -> None:
    ckpt, sampler = tmp_path / "ckpt", ("--sampler",)
    first = _run(tmp_path / "first", GPT_LOOP, "--nproc-per-node", "1", "--checkpoint-dir",
                 str(ckpt), "--checkpoint-every", "3", steps=6, extra=sampler)  # fmt: skip
    _ok(first, 6)
    resumed = _run(tmp_path / "resumed", GPT_LOOP, "--nproc-per-node", "1", "--resume",
                   str(ckpt), steps=SAMPLER_STEPS, extra=sampler)  # fmt: skip
    assert _ok(resumed, SAMPLER_STEPS) == sampler_clean
    assert resumed.of("transition_end")[0]["state_source"] == "checkpoint"


MISUSE = {
    "partial": "commit() before computing this replica's micro-batches",
    "plain-backward": "a backward pass outside step.backward(loss)",
    "optimizer-step": "optimizer.step() called by the script",
    "wrong-microbatch": "is not this replica's to compute",
    "gpipe-short": "commit() before micro-batch",
}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "misuse",
    [  # the default run keeps one misuse caught by the step API, one by the hooks
        pytest.param(m, marks=[pytest.mark.long] if m not in ("partial", "plain-backward") else [])
        for m in sorted(MISUSE)
    ],
)
def test_bad_use_of_the_step_api_exits_2_naming_the_mistake_before_the_commit(
    tmp_path: Path, misuse: str
) -> None:
    misused = ("--misuse", misuse)
    r = _run(tmp_path, MISUSE_SCRIPT, "--nproc-per-node", "2", "--quiet", steps=4, extra=misused)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and MISUSE[misuse] in lines[0], r.stderr
    assert 2 not in {e["step"] for e in r.of("step_end")}  # the step never committed


# -- pure parts ---------------------------------------------------------------------------------
class _Shuffled(torch.utils.data.Sampler[int]):
    """A sampler whose order follows set_epoch (as DistributedSampler's does)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def test_sampler_data_reads_the_stream_from_the_committed_position() -> None:
    data = _SamplerData(_Shuffled(10), 2, 2)  # 4 samples a step: passes of 10 end mid-step
    stream = [*_Shuffled(10)]
    s = _Shuffled(10)
    s.set_epoch(1)
    stream += [*s]
    seen: list[int] = []
    for step in range(4):
        assert data.samples(step, 0) + data.samples(step, 1) == stream[4 * step : 4 * step + 4]
        seen += data.samples(step, 0) + data.samples(step, 1)
        data.advance()  # the step committed
    assert data.state() == (1, 6)
    # a joiner, or a resumed run, loads the position and reads what comes next
    other = _SamplerData(_Shuffled(10), 2, 2)
    other.load(data.state())
    assert other.samples(4, 0) == stream[16:18]


def test_a_sampler_that_ignores_set_epoch_and_reshuffles_is_refused() -> None:
    with pytest.raises(UsageError, match="other indices each time"):
        _SamplerData(torch.utils.data.RandomSampler(range(50)), 2, 2)


def test_the_step_api_outside_unicron_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNICRON_STORE", raising=False)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"unicron\.worker\.Loop runs under the launcher"):
        Loop(model=model, optimizer=opt, dataset=[torch.zeros(2)] * 4, micro_batch_size=1,
             num_microbatches=2, steps=1)  # fmt: skip
    assert "UNICRON_STORE" not in os.environ


def test_an_unknown_pipeline_schedule_is_refused_before_anything_starts() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refused = r"schedule must be one of gpipe, 1f1b, sequential, got 'x'"
    with pytest.raises(UsageError, match=refused):
        train(model=model, optimizer=opt, loss_fn=lambda m, b: m(b).sum(),
              dataset=[torch.zeros(2)] * 4, micro_batch_size=1, num_microbatches=2, steps=1,
              schedule="x")  # fmt: skip
