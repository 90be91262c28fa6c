"""The loop of ``train_gpt_loop.py`` without Unicron: plain PyTorch, one process.

    python examples/plain_gpt_loop.py --steps 100

What a user has before adopting Unicron; ``docs/loop.md`` shows the diff to
``train_gpt_loop.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import gpt
import torch


def forever(loader: torch.utils.data.DataLoader[Any], sampler: Any) -> Iterator[Any]:
    """The loader's batches, pass after pass (a new shuffle each pass)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=args.seed)
    model.train()
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.micro_batch_size, sampler=sampler, drop_last=True
    )
    batches = forever(loader, sampler)
    for step in range(args.steps):
        for _ in range(args.microbatches):
            batch = next(batches)
            loss = gpt.loss_fn(model, batch) / args.microbatches
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item() * args.microbatches:.4f}", flush=True)


if __name__ == "__main__":
    main()
