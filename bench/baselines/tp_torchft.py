"""The torchft baseline at a model-parallel layout: replica groups of ``T x P`` ranks (``P``
pipeline stages of ``T`` tensor-parallel ranks), torchft's Manager and DDP wrapper across
them.

One torchrun per replica group, started with a lighthouse running
(``torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000``)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 3 -m bench.baselines.tp_torchft --replica-id Q \\
        --replicas N --lighthouse http://HOST:PORT --steps S --marker-dir DIR [--events FILE] \\
        [--pp P] [--dim D --hidden H] [--inject SPEC]

The same model, micro-batches and seeds as ``examples/train_llama_parallel.py`` under
``unicron run --tp T --pp P`` (``bench/baselines/tp_ckpt.py``'s setup): the group's ranks
split the model with ``unicron.parallel``'s layers and stages over the group's own gloo
process group (a group per stage for its tensor-parallel sums, a two-rank group per link
between stages, micro-batches one at a time through the stages), and each rank's Manager
(group rank = place: stage x T + tensor rank) joins torchft's quorum, whose process group
reduces each shard's gradients across the replica groups. This is
how torchft runs a model-parallel replica (its HSDP recipe with TP or PP in place of FSDP): a
lost rank breaks its group's sums or links, so its torchrun restarts the whole group, which
rejoins through the quorum and takes each rank's shard from the same group rank of a live
group (torchft's checkpoint transport); meanwhile the other groups go on without it, their
global batch smaller (the lost group's micro-batches are dropped, not recomputed: torchft's
semantics). Group rank 0 writes events (``epoch_begin`` per attempt, ``step_end`` with the
step's participants as ``replicas``, ``task_end``); faults are ``unicron run --inject`` specs
for launch rank ``Q * T * P + place``, fired once per run.
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
from unicron.parallel import PairLink, PipelineParallel, TensorParallel
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
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica group")
    p.add_argument("--dim", type=int, default=llama_parallel.LlamaConfig.dim)
    p.add_argument("--hidden", type=int, default=llama_parallel.LlamaConfig.hidden)
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--timeout-s", type=float, default=60.0, help="torchft's default: 60")
    args = p.parse_args()
    setup_threads(args.marker_dir)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    P = args.pp
    T, stage, t = size // P, rank // (size // P), rank % (size // P)
    rid = args.replica_id
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(args.events if rank == 0 else None)
    launch_rank = rid * size + rank  # the rank a spec names: Unicron's slot of this place
    faults = FaultPlan.from_specs(args.inject, args.marker_dir, launch_rank,
                                  EventWriter(args.events))  # fmt: skip
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    # the group's own ranks: a group per stage (its tensor-parallel sums), a pair per link;
    # every rank creates every group, in one order (new_group is collective)
    sums = [dist.new_group([s * T + k for k in range(T)]) for s in range(P)]
    pairs = {(s, k): dist.new_group([s * T + k, (s + 1) * T + k])
             for s in range(P - 1) for k in range(T)}  # fmt: skip
    tp = TensorParallel(t, T)
    tp.bind(sums[stage])
    pp = PipelineParallel(stage, P, tp)

    def link(s: int) -> PairLink:  # the link from stage s to s + 1 at this tensor rank
        pair, group = [s * T + t, (s + 1) * T + t], pairs[(s, t)]
        return PairLink(lambda x, src: dist.broadcast(x, src=pair[src], group=group),
                        pair.index(rank))  # fmt: skip

    pp.bind_epoch(link(stage - 1) if stage > 0 else None,
                  link(stage) if stage < P - 1 else None, RuntimeError)  # fmt: skip
    cfg = llama_parallel.LlamaConfig(dim=args.dim, hidden=args.hidden)
    model, opt, dataset = llama_parallel.build(tp, seed=SEED, cfg=cfg, pp=pp if P > 1 else None)
    model.train()

    # the group's store: torchrun's MASTER_ADDR and MASTER_PORT
    manager = make_manager(model, opt, args.timeout_s, args.lighthouse, rid, rank=rank,
                           world_size=size)  # fmt: skip
    if attempt == 0:
        start_barrier(Path(args.marker_dir), launch_rank, args.replicas * size)
    # a pipeline's gradients are reduced after its backward passes, not from DDP's hooks: on
    # its error path torchft 0.2's hook asserts inside the backward pass (see below), which
    # in a pipeline skips the stage's gradient send, and the stage before waits out its
    # timeout for it (tried: both groups then timed out in should_commit and started over)
    ddp = torchft.DistributedDataParallel(manager, model) if P == 1 else model
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
                last = i == len(mine) - 1
                ctx = ddp.no_sync() if P == 1 and not last else contextlib.nullcontext()
                with ctx:
                    out = llama_parallel.loss_fn(ddp, batch)
                    if pp.last:  # the loss the earlier stages receive with the gradient
                        pp.loss = float(out.detach())
                    (out / len(mine)).backward()
                total += float(out.detach())
            if P > 1:
                _reduce(manager, model)
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


def _reduce(manager: torchft.Manager, model: torch.nn.Module) -> None:
    """The replica groups' mean of this rank's gradients, in one flat buffer (as DDP's bucket
    would): torchft's fault-tolerant all-reduce, whose error the manager records (the step
    is then discarded at should_commit)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    main()
    exit_now()
