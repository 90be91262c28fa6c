"""The torchrun baseline of FSDP inside replicas (HSDP) in plain PyTorch.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 --max-restarts 3 -m bench.baselines.fsdp_ckpt [--fsdp 2] \\
        [--dim D --hidden H] --steps N --ckpt-every K --ckpt-dir DIR --events FILE \\
        [--inject SPEC]

The same work as ``examples/train_llama_parallel.py`` under ``unicron run --fsdp F``: the
model of ``examples/llama_parallel.py`` with each block, then the whole model, sharded by
PyTorch's ``fully_shard`` on a two-dimensional mesh (replicas x F: FSDP2's HSDP, sharded
inside a replica, replicated across), rank ``q * F + c`` being place ``c`` of replica ``q``;
the ledger's micro-batches (8 of 4 sequences a step, each replica a contiguous block, its
places taking them in turn, as Unicron's rounds do), each seeded the same way, gradients
accumulated without a sync until a rank's last micro-batch, AdamW. Every ``K`` steps the
state is saved with ``torch.distributed.checkpoint`` (DCP, FSDP2's recipe: each shard
written once); on any failure torchrun restarts the whole job and every rank loads the
newest checkpoint, redoing the steps since. Rank 0 writes Unicron-format events
(``epoch_begin`` per attempt, ``step_end``, ``task_end``); faults are ``unicron run
--inject`` specs, fired once per run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama_parallel

from bench.baselines.loop import CPU, exit_now, job_arguments, start_job
from unicron.parallel import TensorParallel
from unicron.runtime.device import seed
from unicron.runtime.ledger import Ledger, assign, mb_seed

MICROBATCHES, MICRO_BATCH_SIZE, SEED = 8, 4, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", type=int, default=2)
    job_arguments(p, llama_parallel.LlamaConfig.dim, llama_parallel.LlamaConfig.hidden)
    args = p.parse_args()
    job = start_job(args)
    rank, world, attempt, events = job.rank, job.world, job.attempt, job.events
    F = args.fsdp
    replicas, q, place = world // F, rank // F, rank % F
    mesh = init_device_mesh("cpu", (replicas, F), mesh_dim_names=("replicate", "shard"))
    cfg = llama_parallel.LlamaConfig(dim=args.dim, hidden=args.hidden)
    model, _, dataset = llama_parallel.build(TensorParallel(0, 1), seed=SEED, cfg=cfg)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)  # build()'s
    saved = sorted(Path(args.ckpt_dir).glob("dcp-step*/.metadata"), key=_step)
    start = 0
    if saved:  # the newest whole checkpoint (DCP writes its metadata last)
        msd, osd = get_state_dict(model, opt)
        at = torch.zeros((), dtype=torch.long)
        dcp.load({"model": msd, "optim": osd, "step": at}, checkpoint_id=str(saved[-1].parent))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)  # loaded in place
        start = int(at)
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=MICRO_BATCH_SIZE,
                    num_microbatches=MICROBATCHES, seed=SEED)  # fmt: skip
    mine = assign(range(MICROBATCHES), replicas)[q][place::F]
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
            model.set_requires_gradient_sync(i == len(mine) - 1)
            out = llama_parallel.loss_fn(model, batch)
            (out / len(mine)).backward()  # FSDP2 averages over the world: the global mean
            total += float(out.detach())
        opt.step()
        loss = total / len(mine)
        events.emit("step_end", epoch=attempt, rank=rank, step=step, loss=loss,
                    duration_s=time.perf_counter() - t0)  # fmt: skip
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": torch.tensor(step + 1)}
            where = Path(args.ckpt_dir) / f"dcp-step{step + 1}"
            dcp.save(state, checkpoint_id=str(where))  # collective: each shard written once
    if start < args.steps:
        events.emit("task_end", status="done", steps=args.steps, final_loss=loss)
    dist.destroy_process_group()
    return 0


def _step(metadata: Path) -> int:
    return int(metadata.parent.name.removeprefix("dcp-step"))


if __name__ == "__main__":
    main()
    exit_now()
