"""Train the tiny Hugging Face Llama of ``llama.py`` with its own loop, under Unicron.

    unicron run --nproc-per-node 4 examples/train_llama.py --steps 100 --out runs/llama

The loop is plain PyTorch around ``model(**batch).loss``; Unicron's step API hands each
replica its micro-batches (collated by ``torch.utils.data.default_collate``, as a
``DataLoader`` would) and commits each step. ``--sampler``: the data in a
``DistributedSampler``'s order, its position committed with every step.
"""

from __future__ import annotations

import argparse

import llama
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
    model, optimizer, dataset = llama.build(seed=args.seed)
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
        collate=torch.utils.data.default_collate,
        sampler=sampler,
        out=args.out,
    )
    for step in loop:
        for batch in step:
            step.backward(model(**batch).loss)
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
