"""The torchrun baseline at a model-parallel layout (TP x PP x DP) in plain PyTorch.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 --max-restarts 3 -m bench.baselines.tp_ckpt [--tp 2] [--pp 1] \\
        [--dim D --hidden H] --steps N --ckpt-every K --ckpt-dir DIR --events FILE \\
        [--inject SPEC]

The same work as ``examples/train_llama_parallel.py`` under ``unicron run --tp T --pp P``: the
model of ``examples/llama_parallel.py``, rank ``q * T * P + stage * T + t`` holding tensor
rank ``t`` of pipeline stage ``stage`` of replica ``q`` (Unicron's places); the tensor sums
over the stage's process group (``TensorParallel.bind``), the pipeline's activations and
gradients broadcast over a two-rank group per link (``PipelineParallel.bind_epoch``), DDP
across replicas on each place's group; the ledger's micro-batches (8 of 4 sequences a step,
each replica a contiguous block), each seeded the same way, AdamW. Replica 0's rank at each
place writes its shard every K steps; on any failure torchrun restarts the whole job and
every rank loads its place's shard, redoing the steps since. Rank 0 writes Unicron-format
events (``epoch_begin`` per attempt, ``step_end``, ``task_end``); faults are ``unicron run
--inject`` specs, fired once per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama_parallel

from bench.baselines.loop import CPU, exit_now, job_arguments, start_job
from unicron.parallel import PairLink, PipelineParallel, TensorParallel
from unicron.runtime.device import seed
from unicron.runtime.digest import params_sha256
from unicron.runtime.ledger import Ledger, assign, mb_seed

MICROBATCHES, MICRO_BATCH_SIZE, SEED = 8, 4, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    job_arguments(p, llama_parallel.LlamaConfig.dim, llama_parallel.LlamaConfig.hidden)
    args = p.parse_args()
    job = start_job(args)
    rank, world, attempt, events = job.rank, job.world, job.attempt, job.events
    T, P = args.tp, args.pp
    size = T * P
    replicas, q, place = world // size, rank // size, rank % size
    stage, t = place // T, place % T
    # every rank creates every group, in one order (new_group is collective)
    tp_groups = {(r, s): dist.new_group([r * size + s * T + k for k in range(T)])
                 for r in range(replicas) for s in range(P)}  # fmt: skip
    dp_groups = [dist.new_group(list(range(c, world, size))) for c in range(size)]
    links: dict[tuple[int, int], tuple[list[int], Any]] = {}
    for r in range(replicas):
        for s in range(P - 1):
            for k in range(T):
                pair = [r * size + s * T + k, r * size + (s + 1) * T + k]
                links[(r, s * T + k)] = (pair, dist.new_group(pair))
    tp = TensorParallel(t, T)
    tp.bind(tp_groups[(q, stage)])
    pp = PipelineParallel(stage, P, tp)

    def link(key: tuple[int, int]) -> PairLink:
        pair, group = links[key]
        me = pair.index(rank)
        return PairLink(lambda x, src: dist.broadcast(x, src=pair[src], group=group), me)

    pp.bind_epoch(
        link((q, place - T)) if stage > 0 else None,
        link((q, place)) if stage < P - 1 else None,
        RuntimeError,
    )
    cfg = llama_parallel.LlamaConfig(dim=args.dim, hidden=args.hidden)
    model, opt, dataset = llama_parallel.build(tp, seed=SEED, cfg=cfg, pp=pp if P > 1 else None)
    model.train()
    shard = Path(args.ckpt_dir) / f"ckpt-place{place}.pt"
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
            job.faults.maybe_fire(step, i, len(mine))
            seed(mb_seed(SEED, step, mb), CPU)
            batch = torch.utils.data.default_collate([dataset[j] for j in ledger.samples(step, mb)])
            ctx = ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext()
            with ctx:
                out = llama_parallel.loss_fn(ddp, batch)
                if pp.last:  # the loss the earlier stages receive with the gradient
                    pp.loss = float(out.detach())
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
    exit_now()
