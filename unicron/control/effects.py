"""What a task's coordinator decided to do, as values, and the executor that does it.

The coordinator's judges (:mod:`~unicron.control.membership`, :mod:`~unicron.control.health`,
:mod:`~unicron.control.readmission`, :mod:`~unicron.control.failures`) change only the
coordinator's own book (membership, slots, detectors: :mod:`unicron.control.book`) and
describe everything that reaches outside it as an :data:`Effect`: an event-log record, a key
on the task's store, an epoch announced, an action queued for a node's agent.
:meth:`Coordinator.decide_exchange` and :meth:`Coordinator.decide_tick` return them without
carrying them out (what the unit tests read); every other entry point hands them to an
:class:`Executor` before it returns, in the order they were decided.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from unicron.control.events import EventLog
from unicron.messages import AgentAction, Kill, Spawn
from unicron.protocol import EpochInfo, epoch_info_key, epoch_key
from unicron.runtime.group import ControlStore

log = logging.getLogger("unicron.control.effects")


@dataclass(frozen=True)
class LogEvent:
    """Write one record to the task's event log (``fields`` without a ``ts``: stamped when
    written)."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteStoreKey:
    """Set ``key`` on the task's store (``trained``, ``done``: :mod:`unicron.protocol`)."""

    key: str
    value: str


@dataclass(frozen=True)
class AnnounceEpoch:
    """Publish epoch ``info`` of ``task``: its description first, then the pointer to it that
    workers watch (:func:`~unicron.protocol.epoch_key`)."""

    task: str
    info: EpochInfo


@dataclass(frozen=True)
class Tell:
    """Queue ``action`` (:class:`~unicron.messages.Spawn`, ``Kill`` or ``Probe``) for
    the agent of ``node``: it takes it with its next exchange."""

    node: int
    action: AgentAction


Effect = LogEvent | WriteStoreKey | AnnounceEpoch | Tell


def on_their_way(
    node: int, outbox: dict[int, deque[AgentAction]], effects: list[Effect]
) -> frozenset[tuple[type, int]]:
    """The actions for the agent of ``node`` not taken yet, as (type, slot): in the node's
    ``outbox``, or among ``effects`` (decided, not carried out)."""
    told = [e.action for e in effects if isinstance(e, Tell) and e.node == node]
    return frozenset((type(a), a.slot) for a in [*outbox.get(node, ()), *told])


def stale(action: AgentAction) -> bool:
    """An action meant for one incarnation of an agent's workers (``Kill``, ``Spawn``): one
    still queued when a new agent replaces the old is not the new one's to take."""
    return isinstance(action, Kill | Spawn)


class Executor:
    """Carries out effects on the task's store, its event log and its agents' queues."""

    def __init__(
        self, *, store: ControlStore, events: EventLog, outbox: dict[int, deque[AgentAction]]
    ) -> None:
        self.store: ControlStore | None = store
        self.events = events
        self.outbox = outbox
        self.store_failed = False
        """a store request failed on the connection (the store or its host is gone): the
        cluster starts a new store and hands it over (:meth:`Coordinator.store_moved`), which
        writes again what the task's workers read there; until then store effects are dropped"""

    def close(self) -> None:
        """Let go of the store (its owner stops serving it)."""
        self.store = None

    def run(self, effects: Iterable[Effect]) -> None:
        """Carry out ``effects`` in order."""
        for e in effects:
            if isinstance(e, LogEvent):
                self.events.emit(e.name, **e.fields)
            elif isinstance(e, WriteStoreKey | AnnounceEpoch):
                self._write(e)
            elif isinstance(e, Tell):
                self.outbox.setdefault(e.node, deque()).append(e.action)
            else:
                raise TypeError(f"not an effect: {e!r}")

    def _write(self, e: WriteStoreKey | AnnounceEpoch) -> None:
        assert self.store is not None, "the store is closed"
        if self.store_failed:
            return
        try:
            if isinstance(e, WriteStoreKey):
                self.store.set(e.key, e.value)
            else:
                self.store.set(epoch_info_key(e.task, e.info.epoch), e.info.to_json())
                self.store.set(epoch_key(e.task), str(e.info.epoch))
        except dist.DistNetworkError as exc:
            log.warning("the training store stopped answering (%s); waiting for a new one", exc)
            self.store_failed = True
