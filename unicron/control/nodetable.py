"""The cluster's nodes: which agents' machines it knows, by id and name, which are live, and
the rules by which an agent registers, speaks and is fenced.

A plain table without a lock: :class:`unicron.control.cluster.Cluster` owns one and calls it
under its own lock; what the rules need of the tasks (the slots they hold on a node, the
tasks that went on without it) comes in as arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from unicron.control.planning import Node
from unicron.control.state import NodeRow

__all__ = ["Conflict", "Fenced", "NodeTable", "NotFound"]

log = logging.getLogger("unicron.control.cluster")


class NotFound(LookupError):
    """An unknown task or node (HTTP 404)."""


class Conflict(RuntimeError):
    """The request contradicts the cluster's state (HTTP 409)."""


class Fenced(RuntimeError):
    """An agent of a node the cluster declared lost (HTTP 410): a partition ended, not a
    death. Its workers are out of their tasks' epochs; it must stop them and register again
    (as a new process under the node's name), which brings the node back to its tasks."""


class NodeTable:
    """Every node the cluster knows (:attr:`by_id`), found by name on every request.
    ``timeout_s``: a node silent this long is lost (and a new agent may take its name);
    ``save``: writes a node's row (SQLite)."""

    def __init__(
        self, rows: Iterable[NodeRow], now: float, timeout_s: float, save: Callable[[NodeRow], None]
    ) -> None:
        self.by_id: dict[int, Node] = {r.id: Node(r, last_seen=now) for r in rows}
        self._by_name = {n.row.name: n for n in self.by_id.values()}
        self.timeout_s = timeout_s
        self._save = save

    def register(
        self, row: NodeRow, now: float, gpus: int | None, used: Callable[[int], int]
    ) -> tuple[Node, str]:
        """An agent starts (or reconnects) with ``row`` (its id is ignored): its node and
        what happened, ``"new"``, ``"back"`` (a new process under the name of a lost node:
        the tasks placed there are told) or ``"same"``. A new process under the name of a
        node still heartbeating is refused (:class:`Conflict`), as is one that comes back
        with fewer slots than its tasks hold (``used``: slots held on a node id)."""
        name = row.name
        node = self._by_name.get(name)
        if node is None:
            nid = max(self.by_id, default=-1) + 1
            node = Node(NodeRow(nid, name, row.slots, row.address, row.instance, now), now)
            self.by_id[nid] = self._by_name[name] = node
            node.gpus = gpus
            self._save(node.row)
            log.info("node %s registered as node %d with %d slot(s)", name, nid, row.slots)
            return node, "new"
        what = "same"
        if node.row.instance != row.instance:
            silent = now - node.last_seen
            if not node.lost and silent < self.timeout_s:
                raise Conflict(
                    f"node {name} is live (its agent heartbeated {silent:.1f} s ago); "
                    "stop it first or choose another --node-name"
                )
            held = used(node.row.id)
            if row.slots < held:
                raise Conflict(
                    f"node {name} comes back with {row.slots} slot(s); its tasks hold {held}"
                )
            node.row = NodeRow(node.row.id, name, row.slots, row.address, row.instance, now)
            self._save(node.row)
            log.info("node %s (node %d) is back", name, node.row.id)
            what = "back"
        node.last_seen, node.lost, node.gpus = now, False, gpus
        return node, what

    def speaking(self, name: str, instance: str, now: float, dropped: Callable[[int], list[str]]
                 ) -> Node:  # fmt: skip
        """The node of a heartbeat or an exchange, seen at ``now``. A node a task dropped as
        lost (``dropped``: the names of the tasks that went on without a node id) does not
        come back by speaking again (a partition healed, or a silence only that task's own
        judgement saw, its agent slow to find a new coordinator): its workers there hold an
        epoch the task left, so its agent is told to stop them and register anew
        (:class:`Fenced`), and the node counts as lost until it does. A node only the ticker
        marked lost (a silence no task acted on: an agent starved for a few seconds on a
        loaded host) is simply live again."""
        node = self._by_name.get(name)
        if node is None:
            raise NotFound(f"no node named {name}: register first")
        if node.row.instance != instance:
            raise Conflict(f"node {name} was taken over by another agent process")
        gone = dropped(node.row.id)
        if gone:  # a task judges by its own heartbeats: it may drop a node the table has not
            node.lost = True  # ... and its agent's new registration brings it back
            raise Fenced(
                f"node {name} was declared lost ({now - node.last_seen:.1f} s silent) and "
                f"task(s) {', '.join(gone)} went on without it: its workers there are "
                "out of their epoch; stop them and register again"
            )
        if node.lost:
            log.info("node %s speaks again after %.1f s; no task dropped it", name,
                     now - node.last_seen)  # fmt: skip
            node.lost = False
        node.last_seen = now
        return node

    def live(self, now: float) -> dict[int, NodeRow]:
        """The rows of the nodes neither lost nor silent past the timeout, by id."""
        return {
            nid: n.row
            for nid, n in sorted(self.by_id.items())
            if not n.lost and now - n.last_seen < self.timeout_s
        }

    def heard(self, now: float) -> None:
        """Every node not lost counts as heard at ``now`` (the service answers from then on:
        :meth:`unicron.control.cluster.Cluster.start_ticker`)."""
        for node in self.by_id.values():
            if not node.lost:
                node.last_seen = max(node.last_seen, now)

    def mark_silent(self, now: float) -> list[Node]:
        """Mark lost every node silent past the timeout (a tick): those newly lost."""
        out = []
        for node in self.by_id.values():
            if not node.lost and now - node.last_seen > self.timeout_s:
                node.lost = True
                out.append(node)
                log.warning("node %s is lost (silent %.1f s)", node.row.name, now - node.last_seen)
        return out

    def views(self, now: float, used: Callable[[int], int]) -> list[dict[str, Any]]:
        """Every node for ``unicron status`` and the API."""
        return [
            {
                "name": n.row.name,
                "id": nid,
                "slots": n.row.slots,
                "used": used(nid),
                "address": n.row.address,
                "state": "lost" if n.lost else "up",
                "silent_s": round(now - n.last_seen, 3),
            }
            for nid, n in sorted(self.by_id.items())
        ]
