"""The contract between coordinator, agent and workers that is not a message, in one place.

Store keys (on the coordinator's TCPStore) are scoped by task and epoch; nothing of an old
epoch is reused. Environment variables carry what a worker needs at start-up
(:class:`WorkerSettings` the task's settings among them); :class:`EpochInfo` is one
membership as the store holds it. The messages on an agent's local socket and between agents
and coordinators are :mod:`unicron.messages`.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import struct
from dataclasses import dataclass, fields
from typing import Any

# -- environment handed to every worker --------------------------------------------------
ENV_TASK = "UNICRON_TASK"
ENV_SLOT = "UNICRON_SLOT"  # launch rank: the slot's index, stable across restarts
ENV_NODE = "UNICRON_NODE"
ENV_INCARNATION = "UNICRON_INCARNATION"  # 0 for the first start of a slot, +1 per restart
ENV_STORE = "UNICRON_STORE"  # host:port of the coordinator's TCPStore
ENV_STORE_KEY = "UNICRON_STORE_KEY"  # the task's capability there: its keys' prefix
ENV_AGENT = "UNICRON_AGENT"  # host:port of the agent's listener
ENV_BELL = "UNICRON_AGENT_BELL"  # host:port of the agent's doorbell (UDP), see :func:`quiet`
ENV_AUTHKEY = "UNICRON_AUTHKEY"  # hex
ENV_FAULTS = "UNICRON_FAULTS"  # --inject specs still to fire in this slot, joined by ";"
ENV_REDUCE = "UNICRON_REDUCE"  # exact | fast
ENV_ON_LOST = "UNICRON_ON_LOST"  # recompute | drop
ENV_BUCKET_CAP_MB = "UNICRON_BUCKET_CAP_MB"  # the gradient buckets' bound (MB)
BUCKET_CAP_MB = 25.0
"""the buckets' bound when a task does not say (DDP's ``bucket_cap_mb`` default): the task
file's default, the agent's and the worker's; :mod:`unicron.runtime.reduce`, which imports
nothing of the project, keeps the same number (a test holds them equal)"""
ENV_THREADS = "UNICRON_THREADS"
STACKS_SIGNAL = signal.SIGUSR1
"""a worker writes every thread's Python stack to its log on this signal (``faulthandler``): the
agent sends it to a worker it kills as hung, :data:`STACKS_GRACE_S` before the SIGKILL"""
STACKS_GRACE_S = 0.1
"""how long the agent lets a hung worker write its stacks before it kills it, at least"""
STACKS_MAX_GRACE_S = 1.0
"""... and at most, while nothing has reached the worker's log yet (a loaded machine may not
run the worker within the first 0.1 s: kills of stuck workers went unexplained there)"""
ENV_NATIVE_STACKS = "UNICRON_NATIVE_STACKS"
"""set to ``1`` in an agent's environment (a diagnosis, off by default): before it kills a
worker as hung it also writes the worker's native stacks, every thread's C and Python frames,
to the worker's log with ``py-spy dump --native`` where ``py-spy`` is installed (what a
thread blocked inside a C++ call waits for; ``faulthandler`` shows its last Python line).
Dear: seconds of a core per dump (docs/detection.md)"""
ENV_CHECKPOINT = "UNICRON_CHECKPOINT"  # directory of the persistent checkpoints (last resort)
ENV_CHECKPOINT_EVERY = "UNICRON_CHECKPOINT_EVERY"  # steps between checkpoints; 0: none; auto
ENV_CHECKPOINT_MTBF = "UNICRON_CHECKPOINT_MTBF"  # configured MTBF (s) for the auto interval
ENV_CHECKPOINT_KEEP = "UNICRON_CHECKPOINT_KEEP"  # checkpoints kept; 0: all
ENV_RESUME = "UNICRON_RESUME"  # "1": the task goes on from the newest checkpoint
ENV_TP = "UNICRON_TP"  # tensor-parallel degree: ranks per replica (1: a replica is one rank)
ENV_TP_RANK = "UNICRON_TP_RANK"  # the slot's tensor-parallel rank in its stage (0 .. tp-1)
ENV_PP = "UNICRON_PP"  # pipeline stages per replica (1: no pipeline)
ENV_PP_STAGE = "UNICRON_PP_STAGE"  # the slot's pipeline stage in its replica (0 .. pp-1)
ENV_PP_CHOICES = "UNICRON_PP_CHOICES"  # other pipeline depths the task may run at: "1,4"
ENV_TP_CHOICES = "UNICRON_TP_CHOICES"  # other tensor-parallel degrees it may run at: "1"
ENV_ZERO = "UNICRON_ZERO"  # "1": the optimizer's state is sharded across replicas (ZeRO-1)
ENV_FSDP = "UNICRON_FSDP"  # FSDP ranks per replica (1: none): the UNICRON_TP ranks of a stage


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """The task settings every worker reads from its environment, each defined once: its
    variable (:data:`WORKER_ENV`), its default and its text. The cluster makes them from the
    task file (:meth:`unicron.control.cluster.Cluster` assignment, as ``settings``), the agent
    writes them (:meth:`env`), the worker reads them (:meth:`from_env`)."""

    reduce: str = "exact"
    on_lost: str = "recompute"
    bucket_cap_mb: float = BUCKET_CAP_MB
    checkpoint: str = ""
    """the persistent checkpoints' directory ("": none)"""
    checkpoint_every: str = "0"
    """committed steps between checkpoints, or ``auto`` (Young/Daly); "0": never"""
    checkpoint_mtbf_s: float = 3 * 3600.0
    checkpoint_keep: int = 3
    resume: bool = False
    tp: int = 1
    """ranks per pipeline stage of a replica, tensor parallel (docs/runtime.md,
    Model-parallel replicas)"""
    pp: int = 1
    """pipeline stages per replica (a replica is ``tp * pp`` ranks of one node)"""
    pp_choices: str = ""
    """the other pipeline depths the task may run at, comma-separated (a layout change:
    :func:`unicron.parallel.pipeline_depths`)"""
    tp_choices: str = ""
    """the other tensor-parallel degrees the task may run at, comma-separated (a layout
    change that re-slices the state: :func:`unicron.parallel.layouts`)"""
    zero: int = 0
    """1: each parameter's optimizer state on two replicas, not on all
    (:mod:`unicron.runtime.zero`)"""
    fsdp: int = 1
    """FSDP ranks per replica (:mod:`unicron.runtime.fsdp`); they are the ``tp`` ranks of a
    stage then (``tp`` counts a stage's ranks on one node: tensor-parallel x FSDP)"""

    def env(self) -> dict[str, str]:
        """The variables a worker of these settings starts with."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                text = "1" if value else "0"
            else:
                text = repr(value) if isinstance(value, float) else str(value)
            out[WORKER_ENV[f.name]] = text
        return out

    @classmethod
    def from_env(cls, environ: Any) -> WorkerSettings:
        """The settings in ``environ`` (a variable that is not set keeps its default)."""
        defaults = cls()
        given: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(WORKER_ENV[f.name])
            if raw is None:
                continue
            kind = type(getattr(defaults, f.name))
            given[f.name] = raw == "1" if kind is bool else kind(raw)
        return cls(**given)


WORKER_ENV = {
    "reduce": ENV_REDUCE,
    "on_lost": ENV_ON_LOST,
    "bucket_cap_mb": ENV_BUCKET_CAP_MB,
    "checkpoint": ENV_CHECKPOINT,
    "checkpoint_every": ENV_CHECKPOINT_EVERY,
    "checkpoint_mtbf_s": ENV_CHECKPOINT_MTBF,
    "checkpoint_keep": ENV_CHECKPOINT_KEEP,
    "resume": ENV_RESUME,
    "tp": ENV_TP,
    "pp": ENV_PP,
    "pp_choices": ENV_PP_CHOICES,
    "tp_choices": ENV_TP_CHOICES,
    "zero": ENV_ZERO,
    "fsdp": ENV_FSDP,
}
"""each :class:`WorkerSettings` field's environment variable"""

STORE_MAGIC = 0x3C85F7CE
"""torch's TCPStore client opens a connection with its ``VALIDATE`` command (0) and this
number; its ``PING`` (13) carries a 4-byte nonce that the store sends back
(:mod:`unicron.control.storeserver` serves the protocol)"""


def store_answers(address: str, timeout_s: float) -> bool:
    """Whether a store answers at ``host:port`` within ``timeout_s`` (a validation and a
    ping, as torch's client opens). Asked before a TCPStore client connects to a store that
    moved (:func:`unicron.worker._find_store`): that client's validation waits without a bound
    for a listener that accepts and never answers (the old port taken by another program,
    a host half gone)."""
    nonce = secrets.token_bytes(4)
    try:
        with socket.create_connection(host_port(address), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(struct.pack("<BI", 0, STORE_MAGIC) + bytes([13]) + nonce)
            got = b""
            while len(got) < 4:
                part = sock.recv(4 - len(got))
                if not part:
                    return False
                got += part
            return got == nonce
    except (OSError, ValueError):
        return False


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (:data:`ENV_AGENT`, :data:`ENV_BELL`,
    :data:`ENV_STORE`, a store's address)."""
    host, port = address.rsplit(":", 1)
    return host, int(port)


def epoch_key(task: str) -> str:
    """Latest epoch number of the task (a decimal string)."""
    return f"{task}/epoch"


def epoch_info_key(task: str, epoch: int) -> str:
    """JSON :class:`EpochInfo` of one epoch, written before :func:`epoch_key` points at it."""
    return f"{task}/epoch/{epoch}"


def epoch_prefix(task: str, epoch: int) -> str:
    """Prefix of everything that belongs to one epoch: process group, votes, barrier."""
    return f"{task}/{epoch}"


def trained_key(task: str) -> str:
    """Set when the task's first step committed: from then on a freshly built model is not
    the task's state (a worker started later must receive it, or load the checkpoint)."""
    return f"{task}/trained"


def state_bytes_key(task: str) -> str:
    """The task's state in bytes (model and optimizer, the largest a worker's ``Ready`` said),
    written by the coordinator as it learns it: a coordinator that takes the task over reads
    it, to bound the final writes (and joins) before any worker is ready again."""
    return f"{task}/state_bytes"


def usage_key(task: str) -> str:
    """Set by a worker to a one-line reason when the task's input is unusable (a checkpoint of
    another model): ``unicron run`` stops everything and exits 2 with it."""
    return f"{task}/usage"


def checkpoint_at_key(task: str) -> str:
    """The step at which a model-parallel task's shards are checkpointed next, named by rank
    0 two boundaries ahead (:func:`unicron.runtime.checkpoint.at_boundary_of`)."""
    return f"{task}/checkpoint_at"


def done_key(task: str) -> str:
    """Set when the task finished or failed: waiting workers exit."""
    return f"{task}/done"


@dataclass(frozen=True)
class EpochInfo:
    """One membership: ``members`` are slots in rank order; ``urgent`` if it drops a member
    of the previous epoch (members leave in-flight collectives at once), else members switch at
    the next step boundary; ``nodes`` maps each member's slot to its node."""

    epoch: int
    members: tuple[int, ...]
    nodes: tuple[int, ...]
    urgent: bool
    published_ts: float = 0.0
    pp: int = 0
    """the pipeline depth the epoch runs at (0: the task's own; another of its
    ``pp_choices`` after a layout change)"""
    tp: int = 0
    """the tensor-parallel degree the epoch runs at (0: the task's own; another of its
    ``tp_choices`` after a layout change)"""

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": self.members,
                "nodes": self.nodes,
                "urgent": self.urgent,
                "published_ts": self.published_ts,
                "pp": self.pp,
                "tp": self.tp,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> EpochInfo:
        d: dict[str, Any] = json.loads(raw)
        return cls(
            d["epoch"],
            tuple(d["members"]),
            tuple(d["nodes"]),
            bool(d["urgent"]),
            float(d.get("published_ts", 0.0)),
            int(d.get("pp", 0)),
            int(d.get("tp", 0)),
        )
