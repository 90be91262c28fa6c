"""A plain DDP loop: the torchrun baseline's workers, started directly, with no checkpoints.

``python -m bench.baselines.ddp_loop --nproc 4 --steps N --workdir DIR [--events FILE]`` starts
N processes of ``train_ckpt`` with the ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables torchrun
would set, and waits for them; a worker's failure fails the run. It is the reference for
steady-state step time: what training costs with nothing watching it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def main() -> int:
    """Start the workers and return the first non-zero exit code (0 if all succeed)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--model-size", default="example", help="a name of examples.gpt.SIZES")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "bench.baselines.train_ckpt",
        "--steps",
        str(args.steps),
        "--ckpt-every",
        "0",
        "--ckpt-dir",
        args.workdir,
        "--model-size",
        args.model_size,
    ]
    if args.events:
        cmd += ["--events", args.events]
    procs = []
    for rank in range(args.nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.nproc),
            "LOCAL_WORLD_SIZE": str(args.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [proc.wait() for proc in procs]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    raise SystemExit(main())
