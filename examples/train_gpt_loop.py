"""The small GPT of ``gpt.py`` trained by a plain PyTorch loop of its own, under Unicron.

    unicron run --nproc-per-node 4 examples/train_gpt_loop.py --steps 100 --out runs/gpt

The loop is the user's; Unicron hands each replica its micro-batches of each step and
commits the step (``docs/loop.md`` shows the diff against the same loop without Unicron).
``--sampler`` reads the data in the order of a ``DistributedSampler`` (one replica, shuffled,
seeded) instead of the ledger's: its position is committed with every step.
"""

from __future__ import annotations

import argparse

import gpt
import torch

import unicron.worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--out", default=None, help="rank 0 writes OUT/final.pt here")
    p.add_argument("--sampler", action="store_true", help="a DistributedSampler's order")
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=args.seed)
    model.train()
    sampler = None
    if args.sampler:
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed
        )
    loop = unicron.worker.Loop(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.microbatches,
        steps=args.steps,
        seed=args.seed,
        sampler=sampler,
        out=args.out,
    )
    for step in loop:
        for batch in step:
            loss = gpt.loss_fn(model, batch)
            step.backward(loss)
        if step.commit() and step.index % 10 == 0 and step.rank == 0:
            print(f"step {step.index}: loss {step.loss:.4f} ({step.world} replicas)", flush=True)
    result = loop.result
    if result is not None and result.rank == 0:
        print(
            f"done: {result.steps} steps, loss {result.final_loss:.4f}, "
            f"params {result.params_sha256[:16]}"
        )


if __name__ == "__main__":
    main()
