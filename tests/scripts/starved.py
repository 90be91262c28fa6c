"""The example GPT's own loop, with one worker starved of CPU for one step: at step
``--starve-step`` the worker of launch rank ``--starve-rank`` starts a throttler process that
stops and continues it (SIGSTOP / SIGCONT) so that it runs a small share of the time, until
that step commits. The share is chosen from its own earlier steps so that the step lasts
about twice the monitor's hang allowance (``max(3 x median step, 1 s)``) while the worker
keeps computing, as on a machine whose cores other processes took: it must not be killed as
hung (``tests/test_faults_e2e.py``)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt

import unicron.worker

THROTTLE = """
import os, signal, sys, time
pid, duty, period = int(sys.argv[1]), float(sys.argv[2]), 0.1
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(period * (1 - duty))
        os.kill(pid, signal.SIGCONT)
        time.sleep(period * duty)
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--starve-rank", type=int, default=1)
    p.add_argument("--starve-step", type=int, default=8)
    args = p.parse_args()
    model, optimizer, dataset = gpt.build(seed=0)
    loop = unicron.worker.Loop(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=8,
        steps=args.steps,
        out=args.out,
    )
    starved = False
    walls: list[float] = []
    cpus: list[float] = []
    for step in loop:
        wall, cpu = time.perf_counter(), time.process_time()
        throttler = None
        if (
            not starved
            and step.index == args.starve_step
            and int(os.environ["LOCAL_RANK"]) == args.starve_rank
        ):
            starved = True
            target = 2 * max(3 * statistics.median(walls[2:]), 1.0)
            duty = min(max(statistics.median(cpus[2:]) / target, 0.08), 0.5)
            argv = [sys.executable, "-c", THROTTLE, str(os.getpid()), str(duty)]
            throttler = subprocess.Popen(argv)
            print(f"starved at {duty:.0%} of the time for about {target:.2f} s", flush=True)
        for batch in step:
            step.backward(gpt.loss_fn(model, batch))
        step.commit()
        if throttler is not None:
            throttler.terminate()
            throttler.wait()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)


if __name__ == "__main__":
    main()
