"""A training script whose model cannot fit in a slot: a trillion parameters, built on the
``meta`` device (no memory is allocated), handed to ``unicron.worker.train`` as usual."""

from __future__ import annotations

import torch

import unicron.worker


def main() -> None:
    model = torch.nn.Linear(1 << 20, 1 << 20, device="meta")
    optimizer = torch.optim.AdamW(model.parameters())
    unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda m, batch: m(batch).sum(),
        dataset=[torch.zeros(1 << 20)] * 8,
        micro_batch_size=1,
        num_microbatches=2,
        steps=2,
    )


if __name__ == "__main__":
    main()
