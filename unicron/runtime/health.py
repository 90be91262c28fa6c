"""The health probe of an excluded slot: may it take a worker again?

The coordinator excludes a slot that keeps failing (SEV1: an ECC error, too many restarts, a
dropped straggler). After a cool-down it asks the slot's agent to probe it; the agent runs
``python -m unicron.runtime.health --slot N`` as a fresh process in that slot's place and reports
the exit status: 0 and the slot is readmitted (a new worker starts there and joins the next
epoch), anything else and it stays out for twice as long.

The probe does what a training step needs of the device, on a small scale, and checks the
answer: a matrix product against a float64 reference, and an all-reduce-shaped sum. It runs
on the slot's own device, the one its workers train on (``UNICRON_DEVICE``, set by the agent
as for a worker: :mod:`unicron.runtime.device`); on CUDA it synchronises, so a sticky
device error (an
uncorrectable ECC error, a lost context) fails it; on CPU it checks the arithmetic and the
process start (imports, memory). The agent writes its output to ``health<slot>.<k>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from unicron.runtime.device import ENV_DEVICE

SIZE = 256
"""Side of the probe's square matrices (a few MFLOP: milliseconds on any device)."""
TOLERANCE = 1e-3
"""Largest relative error of the float32 product against the float64 reference."""


def probe(slot: int) -> str:
    """Exercise the slot's device; return a one-line summary, raise ``RuntimeError`` if the
    results are wrong (device errors raise on their own)."""
    start = time.perf_counter()
    device = torch.device(os.environ.get(ENV_DEVICE, "cpu"))
    gen = torch.Generator().manual_seed(slot)
    a = torch.randn(SIZE, SIZE, generator=gen)
    b = torch.randn(SIZE, SIZE, generator=gen)
    reference = a.double() @ b.double()
    product = (a.to(device) @ b.to(device)).double().cpu()
    error = float((product - reference).norm() / reference.norm())
    if not error < TOLERANCE:  # also NaN
        raise RuntimeError(f"matrix product wrong on {device}: relative error {error:.3g}")
    parts = [a.to(device) for _ in range(4)]
    total = torch.stack(parts).sum(0).cpu()
    if not torch.allclose(total, 4 * a, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"sum wrong on {device}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    return f"{device}: {SIZE}x{SIZE} product and sum correct in {ms:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    """``python -m unicron.runtime.health --slot N``: 0 and a line when healthy, else 1, why."""
    p = argparse.ArgumentParser(prog="python -m unicron.runtime.health", description=__doc__)
    p.add_argument("--slot", type=int, required=True)
    args = p.parse_args(argv)
    try:
        print(probe(args.slot), flush=True)
    except Exception as exc:  # any failure of the device is the answer, not a crash
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
