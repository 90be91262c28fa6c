"""What ``unicron run`` tells a worker (:class:`WorkerContext`, read from its environment),
torchrun's variables for each epoch (:func:`epoch_env`), the check of the final state's
directory (:func:`check_out`) and its atomic write (:func:`save_atomic`): the worker API's
(:mod:`unicron.worker`) plumbing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unicron import messages as M
from unicron import protocol as P
from unicron.errors import UsageError
from unicron.protocol import (
    ENV_FAULTS,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_SLOT,
    ENV_STORE,
    ENV_STORE_KEY,
    ENV_TASK,
    EpochInfo,
    host_port,
)
from unicron.runtime import checkpoint as C
from unicron.runtime import device as D
from unicron.runtime.inject import Fault, parse
from unicron.runtime.link import AgentLink

log = logging.getLogger(__name__)

LAUNCHER = "`unicron run --nproc-per-node N SCRIPT [ARGS]`"


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """What ``unicron run`` tells a worker through its environment
    (:mod:`unicron.protocol`)."""

    task: str
    slot: int
    node: int
    incarnation: int
    store_host: str
    store_port: int
    faults: tuple[Fault, ...]
    store_key: str = ""
    """the task's capability on the cluster's store, put in front of every key ("": none,
    a store of torch's own: the unit tests')"""
    reduce: str = "exact"
    on_lost: str = "recompute"
    bucket_cap_mb: float = P.BUCKET_CAP_MB
    """the gradient buckets' bound (``unicron run --bucket-cap-mb``; the first bucket's is
    the smaller of it and :data:`unicron.runtime.reduce.FIRST_BUCKET_MB`)"""
    slice_s: float = 0.05
    """how long a collective is waited for between two looks at the epoch key"""
    timeout_s: float = 300.0
    """last-resort bound on one collective or rendezvous (the process-group timeout)"""
    max_reattempts: int = 2
    """SEV3 errors retried in place per step before the error ends the process"""
    checkpoint: Path | None = None
    """the persistent checkpoints' directory: written by rank 0, read only when no replica
    holds the state (docs/checkpoint.md)"""
    checkpoint_every: int | None = 0
    """committed steps between two checkpoints (0: never write one; None: auto, Young/Daly)"""
    checkpoint_mtbf_s: float = C.IntervalSettings.mtbf_s
    checkpoint_keep: int = C.IntervalSettings.keep
    resume: bool = False
    """the task goes on from the newest checkpoint (``unicron run --resume``)"""
    tp: int = 1
    """tensor-parallel ranks per stage; this slot's rank is :mod:`unicron.parallel`'s"""
    pp: int = 1
    """pipeline stages per replica; this slot's stage is :mod:`unicron.parallel`'s"""
    zero: int = 0
    """1: the optimizer's state is sharded across replicas (:mod:`unicron.runtime.zero`)"""
    fsdp: int = 1
    """FSDP ranks per replica (then ``tp``, a stage's ranks, are they):
    :mod:`unicron.runtime.fsdp`"""

    @classmethod
    def from_env(cls, api: str = "unicron.worker.train()") -> WorkerContext:
        """The context of this worker; :class:`UsageError` naming ``api`` outside ``unicron
        run``."""
        if ENV_STORE not in os.environ:
            raise UsageError(f"{api} runs under the launcher: {LAUNCHER}")
        host, port = host_port(os.environ[ENV_STORE])
        specs = os.environ.get(ENV_FAULTS, "")
        settings = P.WorkerSettings.from_env(os.environ)
        return cls(
            task=os.environ[ENV_TASK],
            slot=int(os.environ[ENV_SLOT]),
            node=int(os.environ.get(ENV_NODE, "0")),
            incarnation=int(os.environ.get(ENV_INCARNATION, "0")),
            store_host=host,
            store_port=port,
            store_key=os.environ.get(ENV_STORE_KEY, ""),
            faults=tuple(parse(s) for s in specs.split(";") if s),
            reduce=settings.reduce,
            checkpoint=Path(settings.checkpoint) if settings.checkpoint else None,
            checkpoint_every=_every(settings.checkpoint_every),
            checkpoint_mtbf_s=settings.checkpoint_mtbf_s,
            checkpoint_keep=settings.checkpoint_keep,
            resume=settings.resume,
            on_lost=settings.on_lost,
            bucket_cap_mb=settings.bucket_cap_mb,
            tp=settings.tp,
            pp=settings.pp,
            zero=settings.zero,
            fsdp=settings.fsdp,
        )


def _every(raw: str) -> int | None:
    return None if raw == "auto" else int(raw)


def check_out(out: Path | None, *, trained: bool) -> None:
    """Whether the final files can go into ``out`` (``None``: the script writes none), asked
    by every worker as it starts (the ``_Runner`` of :class:`unicron.worker.Loop`). Before
    the task has trained, a path nobody can write is the user's mistake: ``UsageError``, and
    ``unicron run`` exits 2 before a step (before, the last step's write failed in every
    worker, each was restarted, and the trained state was lost: found as a new user would,
    ``--out`` under a file). Once it has trained, a worker started since (a restart, a slot
    added) only logs it: its node's trouble (a mount gone, a passing error) must not end a
    run that trained."""
    why = None if out is None else unwritable(out)
    if why is not None and not trained:
        raise UsageError(why)
    if why is not None:
        log.warning("%s (the task has trained: it goes on, the final write may fail)", why)


def unwritable(out: Path) -> str | None:
    """Why the final files cannot go into ``out`` (``None``: they can): the directory made
    now, as the final write would make it, and a file created and removed there (a name of
    its own: workers of other hosts may share the directory)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".unicron-probe-"):
            pass
    except OSError as exc:
        return f"the output directory {out} cannot be written: {exc.strerror or exc}"
    return None


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def epoch_env(info: EpochInfo, slot: int, store: tuple[str, int]) -> dict[str, str]:
    """torchrun's variables for this worker in epoch ``info`` (``docs/loop.md``): ``RANK`` and
    ``WORLD_SIZE`` of the epoch, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` among the epoch's
    members on this worker's node, ``GROUP_RANK`` the node's index among the epoch's nodes,
    ``MASTER_ADDR``/``MASTER_PORT`` the coordinator's store (the same in every epoch).
    The worker sets them in ``os.environ`` as it enters each epoch."""
    rank = info.members.index(slot)
    node = info.nodes[rank]
    local = [s for s, n in zip(info.members, info.nodes, strict=True) if n == node]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(info.members)),
        "LOCAL_RANK": str(local.index(slot)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "GROUP_RANK": str(sorted(set(info.nodes)).index(node)),
        "MASTER_ADDR": store[0],
        "MASTER_PORT": str(store[1]),
        "UNICRON_EPOCH": str(info.epoch),
    }


def default_collate(items: Sequence[Any]) -> Any:
    """Stack a list of samples (tensors, tuples of tensors, or dicts of tensors) into one
    batch; ``torch.utils.data.default_collate`` works as well."""
    first = items[0]
    if isinstance(first, Mapping):
        return {k: torch.stack([it[k] for it in items]) for k in first}
    if isinstance(first, tuple | list):
        return type(first)(torch.stack([it[i] for it in items]) for i in range(len(first)))
    return torch.stack(list(items))


def device_for(model: torch.nn.Module, ctx: WorkerContext, link: AgentLink) -> torch.device:
    """Check the slot's device and memory before anything is built, then move the model there
    (the worker's :class:`~unicron.worker.Loop` calls it). Bad input (a device the node
    lacks, a model too large for the slot) ends the whole run with exit code 2: the agent is
    told first, then this process exits."""
    try:
        dev = D.current()
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = -(-local_world // max(1, D.gpu_count())) if dev.type == "cuda" else 1
        D.check_fits(numel, ctx.reduce, D.slot_memory(dev, local_world, sharing), dev)
    except UsageError as exc:
        link.send(M.Error(type_name="UsageError", message=str(exc), usage=True))
        raise SystemExit(2) from exc
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model.to(dev)  # in place: the optimizer keeps the same parameter objects
    return dev
