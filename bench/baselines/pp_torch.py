"""Plain PyTorch's own pipeline parallelism at a PP x DP layout: ``torch.distributed.pipelining``.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 -m bench.baselines.pp_torch --pp 2 [--layers L] \\
        [--dim D --hidden H] [--schedule gpipe|1f1b] --steps N --events FILE

The yardstick of ``bench/pipeline.py`` for a pipeline's steady step time: the model of
``examples/llama_parallel.py`` (drawn whole, seeded, as Unicron's example draws it), rank
``q * P + stage`` holding stage ``stage`` of replica ``q`` (an equal share of the blocks;
the first stage the embedding, the last the final norm and the head), each stage a
``PipelineStage`` over its replica's process group, driven by PyTorch's ``ScheduleGPipe``
(or ``Schedule1F1B``) over the replica's micro-batches (``--microbatches`` of 4 sequences a
step, 8 by default, spread over the replicas), the gradients averaged across replicas on
each stage's group in one all-reduce after the schedule (DDP under the schedule fails here:
torch 2.13's reducer asserts on its rebuilt buckets after the first step), AdamW. Fault-free
only: rank 0 writes Unicron-format events (``epoch_begin``, ``step_end`` with
``duration_s``, ``task_end``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama_parallel

from bench.baselines.loop import EventWriter, exit_now, setup_threads
from unicron.parallel import TensorParallel
from unicron.runtime.ledger import Ledger, assign

MICROBATCHES, MICRO_BATCH_SIZE, SEED = 8, 4, 0
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(nn.Module):
    """Stage ``stage`` of ``stages`` of a whole ``llama_parallel.Llama`` (its modules, not
    copies): the embedding on the first, an equal share of the blocks, the final norm and the
    head on the last; its input is the token ids (first) or the previous stage's output."""

    def __init__(self, whole: llama_parallel.Llama, stage: int, stages: int) -> None:
        super().__init__()
        per = len(whole.blocks) // stages
        self.tok = whole.tok if stage == 0 else None
        self.blocks = nn.ModuleList(whole.blocks[str(i)]
                                    for i in range(stage * per, (stage + 1) * per))  # fmt: skip
        last = stage == stages - 1
        self.norm: nn.Module | None = whole.norm if last else None
        self.head: nn.Module | None = whole.head if last else None
        self.register_buffer("cos", whole.cos, persistent=False)
        self.register_buffer("sin", whole.sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        if self.head is not None and self.norm is not None:
            return self.head(self.norm(x))
        return x


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean next-byte cross-entropy (the schedule scales by 1/micro-batches)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=llama_parallel.LlamaConfig.layers)
    p.add_argument("--dim", type=int, default=llama_parallel.LlamaConfig.dim)
    p.add_argument("--hidden", type=int, default=llama_parallel.LlamaConfig.hidden)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=MICROBATCHES, help="a step's")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--events", default=None)
    args = p.parse_args()
    setup_threads(None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    events = EventWriter(args.events if rank == 0 else None)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    P = args.pp
    replicas, q, stage = world // P, rank // P, rank % P
    # every rank creates every group, in one order (new_group is collective)
    pp_groups = [dist.new_group([r * P + s for s in range(P)]) for r in range(replicas)]
    dp_groups = [dist.new_group(list(range(s, world, P))) for s in range(P)]
    cfg = llama_parallel.LlamaConfig(layers=args.layers, dim=args.dim, hidden=args.hidden)
    whole, _, dataset = llama_parallel.build(TensorParallel(0, 1), seed=SEED, cfg=cfg)
    module = StageModule(whole, stage, P)
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    mine = assign(range(args.microbatches), replicas)[q]
    pipe = PipelineStage(module, stage, P, torch.device("cpu"), group=pp_groups[q])
    schedule = SCHEDULES[args.schedule](pipe, n_microbatches=len(mine), loss_fn=_loss)
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=MICRO_BATCH_SIZE,
                    num_microbatches=args.microbatches, seed=SEED)  # fmt: skip
    events.emit("epoch_begin", epoch=0, step=0, members=list(range(world)))
    loss: float | None = None  # known on the last stage (rank 0 is the first: left out)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        samples = [dataset[j] for mb in mine for j in ledger.samples(step, mb)]
        x, y = torch.utils.data.default_collate(samples)
        losses: list[torch.Tensor] = []
        if stage == 0:
            schedule.step(x)
        elif stage == P - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if replicas > 1:  # the replicas' mean gradient, one flat all-reduce
            grads = [w.grad for w in params if w.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_groups[stage])
            flat.div_(replicas)
            at = 0
            for g in grads:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        opt.step()
        if losses:
            loss = float(torch.stack(losses).detach().mean())
        events.emit("step_end", epoch=0, rank=rank, step=step, loss=loss,
                    duration_s=time.perf_counter() - t0)  # fmt: skip
    events.emit("task_end", status="done", steps=args.steps, final_loss=loss)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
    exit_now()
