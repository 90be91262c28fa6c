"""The torchft baseline at a tensor-parallel layout: replica groups of ``T`` ranks, torchft's
Manager and DDP wrapper across them.

One torchrun per replica group, started with a lighthouse running
(``torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000``)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 3 -m bench.baselines.tp_torchft --replica-id Q \\
        --replicas N --lighthouse http://HOST:PORT --steps S --marker-dir DIR [--events FILE] \\
        [--dim D --hidden H] [--inject SPEC]

The same model, micro-batches and seeds as ``examples/train_llama_parallel.py`` under
``unicron run --tp T`` (``bench/baselines/tp_ckpt.py``'s setup): the group's ranks split the
model with ``unicron.parallel``'s layers over the group's own gloo process group (its
tensor-parallel sums), and each rank's Manager (group rank = tensor rank) joins torchft's
quorum, whose process group reduces each shard's gradients across the replica groups. This is
how torchft runs a model-parallel replica (its HSDP recipe with TP in place of FSDP): a lost
rank breaks its group's tensor-parallel sums, so its torchrun restarts the whole group, which
rejoins through the quorum and takes each rank's shard from the same group rank of a live
group (torchft's checkpoint transport); meanwhile the other groups go on without it, their
global batch smaller (the lost group's micro-batches are dropped, not recomputed: torchft's
semantics). Group rank 0 writes events (``epoch_begin`` per attempt, ``step_end`` with the
step's participants as ``replicas``, ``task_end``); faults are ``unicron run --inject`` specs
for launch rank ``Q * T + tensor rank``, fired once per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torchft

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama_parallel

from bench.baselines.loop import CPU, EventWriter, FaultPlan, exit_now, setup_threads
from bench.baselines.train_torchft import make_manager, start_barrier
from unicron.parallel import TensorParallel
from unicron.runtime.device import seed
from unicron.runtime.digest import params_sha256
from unicron.runtime.ledger import Ledger, assign, mb_seed

MICROBATCHES, MICRO_BATCH_SIZE, SEED = 8, 4, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="e.g. http://127.0.0.1:29510")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--marker-dir", required=True, help="where fired faults are remembered")
    p.add_argument("--dim", type=int, default=llama_parallel.LlamaConfig.dim)
    p.add_argument("--hidden", type=int, default=llama_parallel.LlamaConfig.hidden)
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--timeout-s", type=float, default=60.0, help="torchft's default: 60")
    args = p.parse_args()
    setup_threads(args.marker_dir)
    rank, tp_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rid = args.replica_id
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(args.events if rank == 0 else None)
    launch_rank = rid * tp_size + rank  # the rank a spec names: Unicron's slot of this place
    faults = FaultPlan.from_specs(args.inject, args.marker_dir, launch_rank,
                                  EventWriter(args.events))  # fmt: skip
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    tp = TensorParallel(rank, tp_size)
    tp.bind(dist.group.WORLD)  # the group's own ranks: its tensor-parallel sums
    cfg = llama_parallel.LlamaConfig(dim=args.dim, hidden=args.hidden)
    model, opt, dataset = llama_parallel.build(tp, seed=SEED, cfg=cfg)
    model.train()

    # the group's store: torchrun's MASTER_ADDR and MASTER_PORT
    manager = make_manager(model, opt, args.timeout_s, args.lighthouse, rid, rank=rank,
                           world_size=tp_size)  # fmt: skip
    if attempt == 0:
        start_barrier(Path(args.marker_dir), launch_rank, args.replicas * tp_size)
    ddp = torchft.DistributedDataParallel(manager, model)
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=MICRO_BATCH_SIZE,
                    num_microbatches=MICROBATCHES, seed=SEED)  # fmt: skip
    mine = assign(range(MICROBATCHES), args.replicas)[rid]
    events.emit("epoch_begin", epoch=attempt, rank=rid, step=manager.current_step())
    loss = float("nan")
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        manager.start_quorum()  # may heal this group's shards from a live group
        step = manager.current_step()
        total = 0.0
        try:
            for i, mb in enumerate(mine):
                faults.maybe_fire(step, i, len(mine))
                seed(mb_seed(SEED, step, mb), CPU)
                batch = torch.utils.data.default_collate(
                    [dataset[j] for j in ledger.samples(step, mb)]
                )
                ctx = ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext()
                with ctx:
                    out = llama_parallel.loss_fn(ddp, batch)
                    (out / len(mine)).backward()
                total += float(out.detach())
        except AssertionError:
            # torchft 0.2's DDP comm hook asserts on its error path once the manager recorded
            # a collective error (train_torchft.py says more): the step is discarded below
            if manager.errored() is None:
                raise
            ddp = torchft.DistributedDataParallel(manager, model)
        if manager.should_commit():
            opt.step()
            loss = total / len(mine)
            events.emit("step_end", epoch=attempt, rank=rid, step=step, loss=loss,
                        duration_s=time.perf_counter() - t0,
                        replicas=manager.num_participants())  # fmt: skip
        else:
            events.emit("error_detected", rank=rid, step=step, kind="collective",
                        method="torchft should_commit", severity="step discarded")  # fmt: skip
    events.emit("task_end", rank=rid, status="done", steps=manager.current_step(),
                final_loss=loss, params_sha256=params_sha256(model))  # fmt: skip
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    main()
    exit_now()
