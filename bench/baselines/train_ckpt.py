"""The torchrun baseline: DDP over gloo, a rank-0 checkpoint every K steps, load on start.

Run under ``torchrun --nproc-per-node 4 --max-restarts R -m bench.baselines.train_ckpt`` (or
two agents of 2 workers, the node scenario). This is the usual practice Unicron is compared
against: on any failure torchrun restarts the whole worker group, and every worker resumes
from the last checkpoint on local disk, redoing the steps since. Faults come from the same
``--inject`` specs as ``unicron run``; the events go to ``--events`` in Unicron's format
(``epoch_begin`` marks each attempt, ``epoch`` = restart count).

Work-around for the torch 2.13 gloo restart bug (TORCH-FACTS.md, pytorch/pytorch#135712): the
harness runs torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.baselines.loop import (
    NUM_MICROBATCHES,
    EventWriter,
    FaultPlan,
    Trainer,
    accumulate,
    exit_now,
    local_microbatches,
    setup_threads,
)
from unicron.runtime.digest import params_sha256


def parse_args() -> argparse.Namespace:
    """Command line of one worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=0, help="0: never checkpoint")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--pg-timeout-s", type=float, default=1800.0, help="gloo default: 1800")
    p.add_argument("--model-size", default="example", help="a name of examples.gpt.SIZES")
    return p.parse_args()


def save_checkpoint(path: Path, trainer: Trainer, next_step: int) -> None:
    """Write the state atomically (temporary file, then rename)."""
    tmp = path.with_suffix(".tmp")
    state = {"model": trainer.model.state_dict(), "opt": trainer.opt.state_dict()}
    torch.save({"state": state, "step": next_step}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, trainer: Trainer) -> int:
    """Load the newest checkpoint if there is one; return the step to resume at."""
    if not path.exists():
        return 0
    ckpt = torch.load(path, weights_only=False)
    trainer.model.load_state_dict(ckpt["state"]["model"])
    trainer.opt.load_state_dict(ckpt["state"]["opt"])
    return int(ckpt["step"])


def main() -> None:
    """One worker of the torchrun baseline."""
    args = parse_args()
    setup_threads(args.ckpt_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(args.events)
    ckpt_path = Path(args.ckpt_dir) / "ckpt.pt"
    # Several agents on one machine (the node scenario): the harness gives each agent's
    # environment BENCH_NODE; a node fault is fired by the node's local rank 0, which takes
    # its agent (the parent) and the node's other workers down with it.
    node = int(os.environ["BENCH_NODE"]) if "BENCH_NODE" in os.environ else None
    faults = FaultPlan.from_specs(
        args.inject,
        args.ckpt_dir,
        rank,
        events,
        node=node,
        node_leader=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        agent_pid=os.getppid() if node is not None else None,
    )

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    trainer = Trainer.create(args.model_size)
    start = load_checkpoint(ckpt_path, trainer)
    model = DistributedDataParallel(trainer.model)
    ids = local_microbatches(rank, world)
    scale = 1.0 / len(ids)  # DDP averages over ranks: the mean over all micro-batches
    assert world * len(ids) == NUM_MICROBATCHES
    if rank == 0:
        events.emit("epoch_begin", epoch=attempt, step=start, members=list(range(world)))

    loss = float("nan")  # a restart after the last checkpoint (step == steps) trains nothing
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        trainer.opt.zero_grad(set_to_none=True)
        loss = accumulate(
            model,
            trainer,
            step,
            ids,
            scale,
            model.no_sync,
            faults.at(step, len(ids)),
        )
        trainer.opt.step()
        if rank == 0:
            events.emit(
                "step_end",
                epoch=attempt,
                rank=rank,
                step=step,
                loss=loss,
                duration_s=time.perf_counter() - t0,
            )
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                save_checkpoint(ckpt_path, trainer, step + 1)
    if rank == 0 and start < args.steps:  # a restart of a finished run does not end it again
        events.emit(
            "task_end",
            status="done",
            steps=args.steps,
            final_loss=loss,
            params_sha256=params_sha256(trainer.model),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
