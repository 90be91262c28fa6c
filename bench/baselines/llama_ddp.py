"""The Hugging Face Llama example's loop under plain DDP, started by torchrun: the baseline of
``bench/llama.py``.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m bench.baselines.llama_ddp --steps N --events FILE

The same work as ``examples/train_llama.py`` under Unicron: the model of
:mod:`examples.llama`, the ledger's micro-batches (8 of 4 sequences a step, each rank a
contiguous block of them), each micro-batch seeded the same way, AdamW; gradients are
accumulated locally (``no_sync``) and all-reduced by DDP in the last micro-batch's backward
pass. Rank 0 writes one ``step_end`` event per step (``duration_s``), the event log's format.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama

from bench.baselines.loop import CPU, EventWriter, exit_now
from unicron.runtime.device import seed
from unicron.runtime.ledger import Ledger, assign, mb_seed

MICROBATCHES, MICRO_BATCH_SIZE, SEED = 8, 4, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--events", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, dataset = llama.build(seed=SEED)
    model.train()
    ddp = DistributedDataParallel(model)
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=MICRO_BATCH_SIZE,
                    num_microbatches=MICROBATCHES, seed=SEED)  # fmt: skip
    mine = assign(range(MICROBATCHES), world)[rank]
    events = EventWriter(args.events if rank == 0 else None)
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses = []
        for i, mb in enumerate(mine):
            seed(mb_seed(SEED, step, mb), CPU)
            batch = torch.utils.data.default_collate([dataset[j] for j in ledger.samples(step, mb)])
            ctx = ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext()
            with ctx:
                loss = ddp(**batch).loss
                # DDP averages over the replicas: scale so the update is the mean over all M
                (loss * world / MICROBATCHES).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        events.emit("step_end", step=step, rank=rank, loss=sum(losses) / len(losses),
                    duration_s=round(time.perf_counter() - t0, 6), workers=world)  # fmt: skip
    dist.barrier()  # every rank done; then exit without tearing the group down
    return 0


if __name__ == "__main__":
    exit_now(main())
