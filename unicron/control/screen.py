"""What the cluster service checks in an agent's reports before a task's coordinator hears
them (:func:`screen`, called by :meth:`unicron.control.cluster.Cluster.exchange`): a report
about a slot the node does not hold is dropped, a report no agent of this release sends is
refused whole (:class:`Invalid`, HTTP 422).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from unicron import messages as M
from unicron.control.state import NodeRow, TaskRow

log = logging.getLogger("unicron.control.cluster")


class Invalid(ValueError):
    """The request is well-formed but unusable (HTTP 422). ``index``: the position of the
    report that made it so in the exchange's ``reports`` (the 422's ``refused``), so the
    agent drops that one report and sends the others again; ``None`` when no one report is
    to blame."""

    def __init__(self, why: str, *, index: int | None = None) -> None:
        super().__init__(why)
        self.index = index


WORKER_EVENTS = frozenset(
    ("step_end", "transition_end", "fault_injected", "checkpoint_saved", "checkpoint_interval")
)
"""the event-log records a worker writes (:mod:`unicron.worker`, its checkpointer); any other
name in an agent's report is a forgery (the coordinator writes the rest itself)"""
_INT_FIELDS = ("epoch", "step", "slot", "rank", "node")
_EXTRA = {"returncode": int}
"""what a :class:`~unicron.messages.Detected` report may carry besides its fields"""


def screen(node: NodeRow, task: TaskRow, epoch: int, reports: list[M.Report]) -> list[M.Report]:
    """The reports of ``node``'s agent about ``task`` (now at ``epoch``) that the task's
    coordinator may hear, checked against what the cluster knows before it does.

    A report about a slot this node does not hold is dropped, with a log line: a slot the
    task gave back meanwhile (a race, logged at info), or another node's slot (a forgery,
    logged as a warning: an agent reports for its own node only). A report no agent of this
    release sends is refused whole (:class:`Invalid`, 422 with the reason, logged): an event
    name a worker does not write, an event whose ``epoch``/``step``/``slot``/``rank``/``node``
    is not an integer, a step's ``step_end`` without them, an epoch the coordinator has not
    announced yet (a replay from the future), a detection with fields of its own; the first
    such report's position is the error's ``index``."""
    kept: list[M.Report] = []
    for i, r in enumerate(reports):
        why = _malformed(r, epoch)
        if why:
            log.warning("task %s: refused the exchange of node %s: %s", task.uid, node.name, why)
            raise Invalid(f"reports[{i}]: {why}", index=i)
        slot = getattr(r, "slot", None)
        if isinstance(r, M.Event) and isinstance(r.fields.get("slot"), int):
            slot = r.fields["slot"]
        holder = (
            task.placement[slot] if slot is not None and 0 <= slot < len(task.placement) else -2
        )
        if slot is not None and holder != node.id:
            level = logging.INFO if holder == -1 else logging.WARNING
            whose = "given back" if holder == -1 else "not on this node"
            log.log(level, "task %s: dropped %s of node %s for slot %s (%s)", task.uid,
                    type(r).__name__, node.name, slot, whose)  # fmt: skip
            continue
        kept.append(r)
    return kept


def _malformed(r: M.Report, epoch: int) -> str:
    """Why report ``r`` cannot come from an agent of this release ("" if it can)."""
    name = type(r).__name__
    for f in dataclasses.fields(r):
        value = getattr(r, f.name)
        # a time or a duration that is not finite is forged; a diverged loss is the task's news
        if isinstance(value, float) and not math.isfinite(value) and f.name != "final_loss":
            return f"{name}.{f.name} is not a finite number"
    if isinstance(r, M.Event):
        if r.name not in WORKER_EVENTS:
            return f"event {r.name[:40]!r} is not one a worker writes"
        bad = [k for k in _INT_FIELDS if k in r.fields and type(r.fields[k]) is not int]
        if bad:
            return f"event {r.name}: {bad[0]} is not an integer"
        if r.name == "step_end" and not ("epoch" in r.fields and "step" in r.fields):
            return "event step_end: needs epoch and step"
        if r.name == "transition_end" and "step" not in r.fields:
            return "event transition_end: needs step"
    said = getattr(r, "epoch", None)
    if isinstance(r, M.Event):
        said = r.fields.get("epoch")
    if said is not None and said > epoch:
        return f"{name}: epoch {said} is not announced (the task is at epoch {epoch})"
    if isinstance(r, M.Detected):
        for k, v in r.extra.items():
            if k not in _EXTRA or type(v) is not _EXTRA[k]:
                return f"Detected: extra field {str(k)[:40]!r} is not one an agent sends"
    return ""


@dataclasses.dataclass
class Heard:
    """How many of each agent's reports per task the cluster has handed to the task's
    coordinator, by the running index its link gives them
    (:class:`unicron.control.client.TaskLink`, the exchange's ``first``). An exchange whose
    answer was lost on the way back (a reply past the client's timeout, a connection cut) is
    sent again with its reports; those handed over already are not applied twice (a crash
    applied twice counted two restarts against the slot's limit, and announced an epoch
    more). An agent's new instance counts from 0; a census (sent last, after a failed
    exchange) carries no index and is always heard."""

    _next: dict[tuple[str, str], tuple[str, int]] = dataclasses.field(default_factory=dict)

    def unheard(
        self, uid: str, name: str, instance: str, first: int | None, reports: list[M.Report]
    ) -> tuple[list[M.Report], int | None]:
        """The ``reports`` of this exchange not handed over yet, and the index to
        :meth:`note` once they are (``None``: an exchange without indices)."""
        if first is None:
            return reports, None
        held, upto = self._next.get((uid, name), (instance, 0))
        upto = upto if held == instance else 0
        indexed = [r for r in reports if not isinstance(r, M.Census)]
        skip = min(max(upto - first, 0), len(indexed))
        if skip:
            log.warning("node %s, task %s: %d report(s) heard already (an answer lost on its "
                        "way back?): not applied again", name, uid, skip)  # fmt: skip
        census = [r for r in reports if isinstance(r, M.Census)]
        return indexed[skip:] + census, max(upto, first + len(indexed))

    def note(self, uid: str, name: str, instance: str, upto: int | None) -> None:
        """Every report of ``name``'s agent ``instance`` for task ``uid`` below ``upto`` was
        handed to the coordinator."""
        if upto is not None:
            self._next[(uid, name)] = (instance, upto)
