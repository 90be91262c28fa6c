"""A training script that reports where it trains: ``unicron.worker.device()``, LOCAL_RANK and
the device of its parameters after ``train`` returns, one file per slot in ``--out``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt

import unicron.worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = unicron.worker.device()
    model, optimizer, dataset = gpt.build(seed=0)
    model.to(dev)
    unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=gpt.loss_fn,
        dataset=dataset,
        micro_batch_size=2,
        num_microbatches=2,
        steps=2,
    )
    where = {str(p.device) for p in model.parameters()}
    where |= {str(t.device) for s in optimizer.state.values() for t in s.values() if t.dim()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    line = f"{dev} {os.environ['LOCAL_RANK']} {os.environ['LOCAL_WORLD_SIZE']} {sorted(where)}"
    (Path(args.out) / f"slot{os.environ['UNICRON_SLOT']}.txt").write_text(line)


if __name__ == "__main__":
    main()
