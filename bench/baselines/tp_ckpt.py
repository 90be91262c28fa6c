"""The torchrun baseline at a tensor-parallel layout: TP=2 x DP=2 in plain PyTorch.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 --max-restarts 3 -m bench.baselines.tp_ckpt \\
        --steps N --ckpt-every K --ckpt-dir DIR --events FILE [--inject SPEC]

The same work as ``examples/train_llama_parallel.py`` under ``unicron run --tp 2``: the model of
``examples/llama_parallel.py`` split over the replica's process group (``TensorParallel.bind``,
ranks 2q and 2q+1 form replica q), DDP across replicas on each place's group, the ledger's
micro-batches (8 of 4 sequences a step, each replica a contiguous block), each seeded the
same way, AdamW. Replica 0's rank at each place writes its shard every K steps; on any
failure torchrun restarts the whole job and every rank loads its place's shard, redoing the
steps since. Rank 0 writes Unicron-format events (``epoch_begin`` per attempt,
``step_end``, ``task_end``); faults are ``unicron run --inject`` specs, fired once per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama_parallel

from bench.baselines.loop import CPU, EventWriter, FaultPlan, setup_threads
from unicron.parallel import TensorParallel
from unicron.runtime.device import seed
from unicron.runtime.digest import params_sha256
from unicron.runtime.ledger import Ledger, assign, mb_seed

TP, MICROBATCHES, MICRO_BATCH_SIZE, SEED = 2, 8, 4, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=0, help="0: never checkpoint")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])
    args = p.parse_args()
    setup_threads(args.ckpt_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(args.events if rank == 0 else None)
    faults = FaultPlan.from_specs(args.inject, args.ckpt_dir, rank, EventWriter(args.events))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    replicas, q, place = world // TP, rank // TP, rank % TP
    tp_groups = [dist.new_group(list(range(r * TP, r * TP + TP))) for r in range(replicas)]
    dp_groups = [dist.new_group(list(range(c, world, TP))) for c in range(TP)]
    tp = TensorParallel(place, TP)
    tp.bind(tp_groups[q])
    model, opt, dataset = llama_parallel.build(tp, seed=SEED)
    model.train()
    shard = Path(args.ckpt_dir) / f"ckpt-tp{place}.pt"
    start = 0
    if shard.exists():
        ckpt = torch.load(shard, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = int(ckpt["step"])
    ddp = DistributedDataParallel(model, process_group=dp_groups[place])
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=MICRO_BATCH_SIZE,
                    num_microbatches=MICROBATCHES, seed=SEED)  # fmt: skip
    mine = assign(range(MICROBATCHES), replicas)[q]
    events.emit("epoch_begin", epoch=attempt, step=start, members=list(range(world)))
    loss = float("nan")
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(mine):
            faults.maybe_fire(step, i, len(mine))
            seed(mb_seed(SEED, step, mb), CPU)
            batch = torch.utils.data.default_collate([dataset[j] for j in ledger.samples(step, mb)])
            ctx = ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext()
            with ctx:
                out = llama_parallel.loss_fn(ddp, batch)
                (out / len(mine)).backward()
            total += float(out.detach())
        opt.step()
        loss = total / len(mine)
        events.emit("step_end", epoch=attempt, rank=rank, step=step, loss=loss,
                    duration_s=time.perf_counter() - t0)  # fmt: skip
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            if q == 0:
                tmp = shard.with_suffix(".tmp")
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}
                torch.save(state, tmp)
                os.replace(tmp, shard)
            dist.barrier()  # every shard of the step is written before any rank goes on
    if start < args.steps:
        events.emit("task_end", status="done", steps=args.steps, final_loss=loss,
                    params_sha256=params_sha256(model))  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
    # no interpreter teardown (bench/baselines/train_ckpt.py says why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
