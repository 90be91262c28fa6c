"""The physical floor of a recovery: build a process group and move the state once.

A worker that takes over after a failure needs at least a fresh process group and the model
and optimizer state from a peer. Two processes on this machine do exactly that and nothing
else: both wait at a store barrier, then build a ``ProcessGroupGloo`` on a fresh
``PrefixStore`` and broadcast the state (the parameters and AdamW's two moments, flattened
into one float32 buffer beforehand, so the copy is not timed) from rank 0 to rank 1 over
loopback. The floor is rank 1's time from the barrier to the end of the broadcast. Nothing
else that a real recovery does is counted (detection, deciding, the interrupted step), so
``measured recovery / floor`` says how far a system is from what the hardware allows.

``python -m bench --scenario floor`` runs it; :func:`measure_floor` returns the samples.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

from bench.common import Row, free_port, make_row

SCENARIO = "floor"


def _state_buffer() -> tuple[object, int]:
    """The example model's parameters and AdamW moments as one flat float32 tensor."""
    import torch

    from examples.gpt import build, loss_fn

    model, opt, dataset = build(0)
    x, y = dataset[0]
    loss_fn(model, (x[None], y[None])).backward()
    opt.step()  # creates the moments
    tensors = [p.detach() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    return flat, flat.numel() * 4


def _worker(rank: int, port: int, reps: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    flat, nbytes = _state_buffer()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(60))
    times = []
    for rep in range(reps):
        store.add(f"barrier/{rep}", 1)
        while int(store.add(f"barrier/{rep}", 0)) < 2:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(f"floor/{rep}", store), rank, 2, timedelta(seconds=60)
        )
        buf = flat if rank == 0 else torch.empty_like(flat)  # type: ignore[arg-type]
        pg.broadcast(buf, 0).wait()  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
        if rank == 1:
            assert torch.equal(buf, flat)  # type: ignore[arg-type]
    if rank == 1:
        out.put((times, nbytes))


def measure_floor(reps: int) -> tuple[list[float], int]:
    """``reps`` samples of the floor (seconds) and the state size (bytes)."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, reps, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 300
        while out.empty():
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"floor measurement failed (exit codes {codes})")
            time.sleep(0.05)
        times, nbytes = out.get(timeout=5)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return times, nbytes


def run(quick: bool) -> list[Row]:
    """Rows of the floor scenario: the floor itself and the state size."""
    times, nbytes = measure_floor(reps=10 if quick else 30)
    mb = nbytes / 1e6
    note = (
        f"ProcessGroupGloo build + broadcast of {mb:.1f} MB (params + AdamW moments) "
        "over loopback, 2 processes"
    )
    return [
        make_row(system="floor", scenario=SCENARIO, metric="floor_s", values=times, note=note),
        make_row(system="floor", scenario=SCENARIO, metric="state_mb", values=[mb], unit="MB"),
    ]
