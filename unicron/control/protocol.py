"""The wire contract between coordinator, agent and workers, in one place.

Store keys (on the coordinator's TCPStore) are scoped by task and epoch; nothing of an old
epoch is reused. Worker -> agent messages are plain dicts over an authenticated
``multiprocessing.connection``; their ``type`` field is one of :data:`MESSAGES`. Environment
variables carry what a worker needs at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# -- environment handed to every worker --------------------------------------------------
ENV_TASK = "UNICRON_TASK"
ENV_SLOT = "UNICRON_SLOT"  # launch rank: the slot's index, stable across restarts
ENV_NODE = "UNICRON_NODE"
ENV_INCARNATION = "UNICRON_INCARNATION"  # 0 for the first start of a slot, +1 per restart
ENV_STORE = "UNICRON_STORE"  # host:port of the coordinator's TCPStore
ENV_AGENT = "UNICRON_AGENT"  # host:port of the agent's listener
ENV_AUTHKEY = "UNICRON_AUTHKEY"  # hex
ENV_FAULTS = "UNICRON_FAULTS"  # --inject specs still to fire in this slot, joined by ";"
ENV_REDUCE = "UNICRON_REDUCE"  # exact | fast
ENV_ON_LOST = "UNICRON_ON_LOST"  # recompute | drop
ENV_THREADS = "UNICRON_THREADS"
ENV_CHECKPOINT = "UNICRON_CHECKPOINT"  # directory of the persistent checkpoints (last resort)
ENV_CHECKPOINT_EVERY = "UNICRON_CHECKPOINT_EVERY"  # steps between checkpoints; 0: none; auto
ENV_CHECKPOINT_MTBF = "UNICRON_CHECKPOINT_MTBF"  # configured MTBF (s) for the auto interval
ENV_CHECKPOINT_KEEP = "UNICRON_CHECKPOINT_KEEP"  # checkpoints kept; 0: all
ENV_RESUME = "UNICRON_RESUME"  # "1": the task goes on from the newest checkpoint

# -- messages to the agent -----------------------------------------------------------------
MESSAGES = frozenset(
    {
        # from a worker (unicron.worker, through unicron.runtime.link)
        "hello",  # slot, pid, incarnation: first message on connect
        "ready",  # microbatches, bytes: the model is built; waiting for an epoch with this slot
        "epoch",  # epoch: entered it (rendezvous, ledger exchange, state transfer follow)
        "event",  # event, fields: an event-log record for the agent to write
        "step_begin",  # step, epoch: the monitor's clock starts
        "step_done",  # step, compute_s, microbatches: computed; the reduce and vote follow
        "error",  # type_name, message, traceback, step, in_band, in_place, epoch: an error
        "done",  # steps, final_loss, params_sha256, rank, epoch: the last step committed
        "node_fault",  # the injected node fault: the agent takes its node down
        # from the zygote (unicron.runtime.launcher)
        "zygote",  # the fork server is up
        "spawned",  # slot, pid: a worker was forked
        "exit",  # pid, returncode: a forked worker ended
    }
)


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


def usage_key(task: str) -> str:
    """Set by a worker to a one-line reason when the task's input is unusable (a checkpoint of
    another model): ``unicron run`` stops everything and exits 2 with it."""
    return f"{task}/usage"


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

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": self.members,
                "nodes": self.nodes,
                "urgent": self.urgent,
                "published_ts": self.published_ts,
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
        )
