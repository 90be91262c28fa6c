"""A training script whose loss raises a user error (ValueError) from step 5 on, every time.

The model and data of ``examples/train_gpt.py``; only the loss function is broken, so the
error repeats on every restart and nothing can heal it. The committed step is read from the
AdamW state (its ``step`` counter), which a restarted worker receives with the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt

import unicron.worker

FAIL_AT_STEP = 5
MESSAGE = "user_error.py: loss_fn rejects every batch from step 5 on"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=0)

    def committed_steps() -> int:
        state = next(iter(optimizer.state.values()), None)
        return int(state["step"]) if state else 0

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        if committed_steps() >= FAIL_AT_STEP:
            raise ValueError(MESSAGE)
        return gpt.loss_fn(m, batch)

    unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        dataset=dataset,
        micro_batch_size=4,
        num_microbatches=8,
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
