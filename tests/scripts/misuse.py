"""The example GPT's own loop with one mistake in step 2 (``--misuse KIND``): the step API
must refuse it with one line and exit 2 before the step commits (``tests/test_loop.py``).
``--misuse none --explicit``: no mistake, and the gradients handed over by the loop
(``torch.autograd.grad``, ``step.add_gradients``) instead of taken by the hooks; ``--clip``:
gradients clipped before the optimizer step (``commit(before_optimizer=...)``), with the
norm printed at each commit, with torchrun's variables as the worker sees them."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt
import torch

import unicron.worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--misuse", required=True)
    p.add_argument("--explicit", action="store_true")
    p.add_argument("--clip", action="store_true")
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
    params = list(model.parameters())
    clipped: list[float] = []

    def clip() -> None:
        clipped.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))

    for step in loop:
        if args.misuse == "gpipe-short" and step.index == 2:
            losses = [gpt.loss_fn(model, batch) for batch in step.batches()]
            for loss in losses[:-1]:  # GPipe's order, one backward pass missing
                step.backward(loss)
            step.commit()
        if args.misuse == "wrong-microbatch" and step.index == 2:
            step.batch((step.microbatches[0] + 4) % 8)  # another replica's micro-batch
        for batch in step:
            loss = gpt.loss_fn(model, batch)
            if args.misuse == "plain-backward" and step.index == 2:
                loss.backward()  # not step.backward(loss)
            if args.explicit:
                trainable = [p for p in model.parameters() if p.requires_grad]
                grads = torch.autograd.grad(loss, trainable, allow_unused=True)
                step.add_gradients(grads, float(loss))
            else:
                step.backward(loss)
            if args.misuse == "partial" and step.index == 2:
                break  # commits with micro-batches left
        if args.misuse == "optimizer-step" and step.index == 2:
            optimizer.step()  # the commit steps the optimizer
        clipped.clear()
        if not step.commit(before_optimizer=clip if args.clip else None):
            continue
        if clipped:
            print(f"step {step.index}: clipped a gradient norm of {clipped[0]:.4f}", flush=True)
        env = " ".join(f"{k}={os.environ[k]}" for k in ("RANK", "WORLD_SIZE", "UNICRON_EPOCH"))
        print(f"step {step.index}: {env}", flush=True)  # torchrun's variables of this epoch


if __name__ == "__main__":
    main()
