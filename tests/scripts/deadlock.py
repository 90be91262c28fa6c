"""The example GPT's own loop, in which one worker deadlocks once: at step ``--at-step`` the
worker of launch rank ``--rank`` takes a lock it already holds, inside its step, and waits for
ever without using CPU (a real hang, not a stopped process: its signal handlers still run).
The restarted worker in its slot finds the marker file the first one left and trains on
(``tests/test_faults_e2e.py``: the hang is healed, and the killed worker's log shows where it
hung)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt

import unicron.worker


def take_twice(lock: threading.Lock) -> None:
    with lock:
        lock.acquire()  # never returns


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=8)
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=0)
    loop = unicron.worker.Loop(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        micro_batch_size=16,
        num_microbatches=8,
        steps=args.steps,
        out=args.out,
    )
    marker = Path(args.out) / "deadlocked"
    for step in loop:
        for batch in step:
            step.backward(gpt.loss_fn(model, batch))
        if (
            step.index == args.at_step
            and int(os.environ["LOCAL_RANK"]) == args.rank
            and not marker.exists()
        ):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            take_twice(threading.Lock())
        step.commit()


if __name__ == "__main__":
    main()
