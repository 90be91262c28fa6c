"""The torchft baseline: one replica group of one process, torchft's DDP wrapper and Manager.

Start a lighthouse (``torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000``), then one
process per replica with ``--replica-id i --replicas N``; the bench harness restarts a replica
that dies, as torchrun would per replica group. Each process hosts its own group's TCPStore
(torchft's Manager connects to a store it does not host). Same model, micro-batches, faults and
event log as the other baselines; when a replica is lost torchft goes on with the survivors, so
the global batch shrinks until it is back (torchft's semantics, not Unicron's).
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torchft
from torch.distributed import TCPStore

from bench.baselines.loop import (
    EventWriter,
    FaultPlan,
    Trainer,
    accumulate,
    local_microbatches,
    setup_threads,
)
from unicron.runtime.digest import params_sha256


def parse_args() -> argparse.Namespace:
    """Command line of one replica."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="e.g. http://127.0.0.1:29510")
    p.add_argument("--marker-dir", required=True, help="where fired faults are remembered")
    p.add_argument("--events", default=None)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--timeout-s", type=float, default=60.0, help="torchft's default: 60")
    p.add_argument(
        "--replicas-per-node",
        type=int,
        default=1,
        help="replica i is on node i // this; a node fault kills the node's replicas together",
    )
    return p.parse_args()


def start_barrier(folder: Path, rid: int, replicas: int, timeout_s: float = 300.0) -> None:
    """Wait until every replica of the first launch is up, so that all start together.

    A replica restarted later finds the barrier open and joins through torchft's quorum.
    """
    opened = folder / "barrier-open"
    (folder / f"ready-{rid}").touch()
    deadline = time.monotonic() + timeout_s
    while not opened.exists():
        if all((folder / f"ready-{i}").exists() for i in range(replicas)):
            opened.touch()
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {rid}: the other replicas did not start in {timeout_s} s")
        time.sleep(0.02)


def make_manager(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    timeout_s: float,
    lighthouse: str,
    replica: int,
    **where: Any,
) -> torchft.Manager:
    """The Manager of replica group ``replica`` as every torchft arm of the benchmarks runs it:
    the quorum's gloo group, a synchronous quorum of at least one group, each rank's
    ``model`` and ``opt`` as the state a recovering group takes; ``where``: the group's rank,
    world size and store where they are not torchrun's (``rank``, ``world_size``,
    ``store_addr``, ``store_port``). Also used by ``bench/baselines/tp_torchft.py``."""

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    timeout = timedelta(seconds=timeout_s)
    return torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        **({"rank": 0, "world_size": 1} | where),
    )


def main() -> None:
    """One replica of the torchft baseline."""
    args = parse_args()
    setup_threads(args.marker_dir)
    rid = args.replica_id
    events = EventWriter(args.events)
    per_node = max(args.replicas_per_node, 1)
    faults = FaultPlan.from_specs(
        args.inject,
        args.marker_dir,
        rid,
        events,
        node=rid // per_node,
        node_leader=rid % per_node == 0,
    )
    trainer = Trainer.create()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(trainer.model, trainer.opt, args.timeout_s, args.lighthouse, rid,
                           store_addr="127.0.0.1", store_port=store.port)  # fmt: skip
    start_barrier(Path(args.marker_dir), rid, args.replicas)
    model = torchft.DistributedDataParallel(manager, trainer.model)
    opt = torchft.Optimizer(manager, trainer.opt)
    ids = local_microbatches(rid, args.replicas)
    scale = 1.0 / len(ids)  # the manager averages over the participating replicas
    events.emit("epoch_begin", epoch=0, rank=rid, step=manager.current_step())

    loss = float("nan")
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)  # starts the quorum; may heal from a peer
        step = manager.current_step()
        try:
            loss = accumulate(
                model,
                trainer,
                step,
                ids,
                scale,
                model.no_sync,
                faults.at(step, len(ids)),
            )
        except AssertionError:
            # torchft 0.2.0's DDP comm hook asserts on the error path (ddp.py, `assert
            # fut._fut`) once the manager has recorded a collective error; the step is then
            # discarded by should_commit(), as torchft intends.
            # The reducer is left mid-reduction, so the wrapper is built again (a few ms).
            if manager.errored() is None:
                raise
            model = torchft.DistributedDataParallel(manager, trainer.model)
        if manager.should_commit():
            trainer.opt.step()
            events.emit(
                "step_end",
                rank=rid,
                step=step,
                loss=loss,
                duration_s=time.perf_counter() - t0,
                replicas=manager.num_participants(),
            )
        else:
            events.emit(
                "error_detected",
                rank=rid,
                step=step,
                kind="collective",
                method="torchft should_commit",
                severity="step discarded",
            )
    events.emit(
        "task_end",
        rank=rid,
        status="done",
        steps=manager.current_step(),
        final_loss=loss,
        params_sha256=params_sha256(trainer.model),
    )
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
