"""The example GPT at a chosen size, as a ``unicron run`` script (the ``transfer`` scenario).

    unicron run --nproc-per-node 2 bench/sized_gpt.py --size 100MB --steps 5

``--size`` names a configuration of ``examples/gpt.py``'s model whose training state (the
parameters and AdamW's two moments, float32) is about that large: :data:`SIZES`. Sequences
are short (16 bytes) and micro-batches small, so that even the 1 GB model steps in seconds on
a CPU; the point is the state's size, not the model's quality.
"""

from __future__ import annotations

import argparse

import torch

from examples import gpt

SIZES = {
    "5MB": gpt.GPTConfig(dim=96, layers=3, heads=4, seq_len=16, dropout=0.0),
    "100MB": gpt.GPTConfig(dim=256, layers=10, heads=4, seq_len=16, dropout=0.0),
    "1GB": gpt.GPTConfig(dim=768, layers=12, heads=12, seq_len=16, dropout=0.0),
}
"""state size -> model configuration (state = 12 bytes per parameter)"""


def build(size: str, seed: int = 0) -> tuple[gpt.GPT, torch.optim.Optimizer, gpt.ByteDataset]:
    """The model of ``size``, its AdamW optimizer and the dataset (as :func:`gpt.build`)."""
    return gpt.build(seed=seed, cfg=SIZES[size])


def main() -> None:
    import unicron.worker

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="5MB")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model, optimizer, dataset = build(args.size)
    unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=gpt.loss_fn,
        dataset=dataset,
        micro_batch_size=1,
        num_microbatches=2,
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
