"""Train the small byte-level GPT of ``gpt.py`` under Unicron.

    unicron run --nproc-per-node 4 examples/train_gpt.py --steps 100 --out runs/gpt

The model code is plain PyTorch; the only Unicron call is ``unicron.worker.train``.
"""

from __future__ import annotations

import argparse

import gpt

import unicron.worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--out", default=None, help="rank 0 writes OUT/final.pt here")
    p.add_argument("--model-size", choices=sorted(gpt.SIZES), default="example")
    p.add_argument(
        "--adversarial",
        action="store_true",
        help="scale each micro-batch's loss by 2^k, k in -40..40 drawn per micro-batch: "
        "gradients whose float64 sum depends on the grouping (the exactness bench)",
    )
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=args.seed, size=args.model_size)
    model.train()
    result = unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=gpt.adversarial_loss_fn if args.adversarial else gpt.loss_fn,
        dataset=dataset,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.microbatches,
        steps=args.steps,
        seed=args.seed,
        out=args.out,
    )
    if result is not None and result.rank == 0:
        print(
            f"done: {result.steps} steps, loss {result.final_loss:.4f}, "
            f"params {result.params_sha256[:16]}"
        )


if __name__ == "__main__":
    main()
