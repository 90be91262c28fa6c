"""The example GPT's own loop with one mistake in step 2 (``--misuse KIND``): the step API
must refuse it with one line and exit 2 before the step commits (``tests/test_loop.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt

import unicron.worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--misuse", required=True)
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=0)
    loop = unicron.worker.Loop(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        micro_batch_size=4,
        num_microbatches=8,
        steps=args.steps,
    )
    for step in loop:
        if args.misuse == "wrong-microbatch" and step.index == 2:
            step.batch((step.microbatches[0] + 4) % 8)  # another replica's micro-batch
        for batch in step:
            loss = gpt.loss_fn(model, batch)
            if args.misuse == "plain-backward" and step.index == 2:
                loss.backward()  # not step.backward(loss)
            step.backward(loss)
            if args.misuse == "partial" and step.index == 2:
                break  # commits with micro-batches left
        if args.misuse == "optimizer-step" and step.index == 2:
            optimizer.step()  # the commit steps the optimizer
        step.commit()


if __name__ == "__main__":
    main()
