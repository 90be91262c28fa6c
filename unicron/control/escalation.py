"""Escalation: from one classified failure to the action to take, given what came before.

The table (:mod:`unicron.detect.classify`) says what *one* failure deserves. Each task's
coordinator owns one :class:`Escalation`; :mod:`unicron.control.failures` calls
:meth:`Escalation.decide` on every detected error (a worker's report, a process exit, a
detector), carries out the returned :class:`Decision` and logs it as an ``action`` event with
its ``reason``. :mod:`unicron.control.health` calls :meth:`Escalation.healthy` when a slot
completes a step, :mod:`unicron.control.readmission` calls :meth:`Escalation.readmit` when an
excluded slot passed its health probe or a lost node came back. Its memory of each slot is a
:class:`SlotRecord`, kept on the coordinator's slot table (:meth:`Escalation.bind`). Pure
policy: the clock is passed in as ``now``.

Rules, in order (``decide``):

1. an excluded slot or node stays excluded (the decision repeats it), except a slot of an
   excluded node that runs the task's last copies of the state (``last_copies``): the
   rules below judge it by its own history, and its node's exclusion stands (rule 5 does
   not apply to it);
2. SEV3 (reattempt): up to ``max_reattempts`` per slot since its last healthy step (and
   within ``restart_window_s``); one more escalates to SEV2;
3. SEV2 (restart): restart in the slot, unless the slot has failed more than
   ``restart_limit`` times in ``restart_window_s``: then SEV1, the slot is excluded; when
   every one of those failures was the training script's own Python error (kind ``user``),
   for good (:attr:`SlotRecord.broken_script`: no health probe mends a script, so none
   readmits it, and a task whose every slot is so excluded fails with the script's error
   instead of cycling through probes and restarts);
4. SEV1 from the table: EXCLUDE the slot or the node as the verdict's scope says, or
   RECONFIGURE (replan, nothing excluded);
5. a node with ``node_failure_limit`` distinct slots excluded or failing (SEV2 or worse, not
   counting the user's own errors) within ``restart_window_s`` is excluded as a whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from unicron.detect.classify import Action, Scope, Severity, Verdict

__all__ = ["Decision", "Escalation", "EscalationSettings", "SlotRecord"]

NODE_SUSPECT = frozenset(
    {"ecc", "cuda", "illegal_memory", "nccl", "segfault", "bus_error", "hang", "heartbeat_lost"}
)
"""kinds that may be the node's hardware or driver: only these count toward excluding a node
(a killed process, an exit, a user error or a reset connection says nothing about the node)"""


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # also catches NaN
        raise ValueError(f"EscalationSettings.{name} must be in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EscalationSettings:
    """Limits of :class:`Escalation`; defaults and reasons in ``docs/detection.md``."""

    max_reattempts: int = 2
    """SEV3 reattempts a slot gets (since its last healthy step) before escalating to SEV2"""
    restart_limit: int = 3
    """restarts a slot gets within ``restart_window_s``; the next failure excludes it (SEV1)"""
    restart_window_s: float = 60.0
    """the window over which failures are counted (reattempts, restarts, a node's slots)"""
    node_failure_limit: int = 3
    """distinct slots of one node excluded or failing within the window that exclude the node"""

    def __post_init__(self) -> None:
        _check_range("max_reattempts", self.max_reattempts, 0, 1_000)
        _check_range("restart_limit", self.restart_limit, 0, 1_000)
        _check_range("restart_window_s", self.restart_window_s, 0.001, 86_400.0)
        _check_range("node_failure_limit", self.node_failure_limit, 1, 100_000)


@dataclass(frozen=True)
class Decision:
    """What the coordinator does about one failure, and why (the ``action`` event).

    ``severity`` is the one acted on (after escalation, so it may differ from the verdict's);
    ``exclude_slot`` / ``exclude_node`` say what to take out of the plan before replanning.
    ``kind`` is the verdict's kind.
    """

    action: Action
    severity: Severity
    reason: str
    exclude_slot: bool = False
    exclude_node: bool = False
    kind: str = ""


@dataclass
class SlotRecord:
    """The policy's memory of one slot: its recent failures and whether it is excluded on
    its own account. A coordinator keeps these on its slots
    (:attr:`unicron.control.slots.Slot.record`, :meth:`Escalation.bind`)."""

    node: int
    reattempts: deque[float] = field(default_factory=deque)
    failures: deque[float] = field(default_factory=deque)  # SEV2 restarts asked for
    hardware: deque[float] = field(default_factory=deque)  # failures that may be the node's
    script: deque[float] = field(default_factory=deque)  # the training script's own errors
    excluded: bool = False  # excluded on its own account until readmitted
    broken_script: bool = False
    """excluded because the training script failed there every time (rule 3): not probed,
    not readmitted by a probe"""


class Escalation:
    """The escalation policy's memory: per-slot reattempts and restarts, exclusions. The
    per-slot part is a mapping of :class:`SlotRecord` (a plain dict of its own until
    :meth:`bind` hands it the slots' records)."""

    def __init__(self, settings: EscalationSettings | None = None) -> None:
        self.settings = settings or EscalationSettings()
        self._slots: MutableMapping[int, SlotRecord] = {}
        self._excluded_nodes: set[int] = set()

    def bind(self, records: MutableMapping[int, SlotRecord]) -> None:
        """Keep the per-slot memory in ``records`` (a coordinator's slot table,
        :meth:`unicron.control.slots.SlotTable.records`), before the first decision."""
        assert not self._slots, "bound after it decided"
        self._slots = records

    def decide(
        self, verdict: Verdict, *, slot: int, node: int, now: float, last_copies: bool = False
    ) -> Decision:
        """Decide what to do about ``verdict`` on ``slot`` (of ``node``) at ``now``.

        ``last_copies``: ``node`` is excluded, but the task's only copies of its state run
        there (the coordinator keeps them): the slot is judged alone, so that a failing one is
        restarted in place and takes the state from its neighbours, within its own restart
        limit, rather than the task losing a copy at every failure until only a checkpoint
        is left.
        """
        s = self._slot(slot, node, now)
        kind = verdict.kind
        kept = last_copies and node in self._excluded_nodes
        if node in self._excluded_nodes and not kept:
            return Decision(
                Action.EXCLUDE, Severity.SEV1, f"{kind} on node {node}: node is excluded",
                exclude_node=True, kind=kind,
            )  # fmt: skip
        if s.excluded:
            return Decision(
                Action.EXCLUDE, Severity.SEV1, f"{kind} on slot {slot}: slot is excluded",
                exclude_slot=True, kind=kind,
            )  # fmt: skip
        if verdict.severity is Severity.SEV1:
            return self._sev1(verdict, slot, node, now)
        prefix = f"{kind} on slot {slot}"
        if kept:
            prefix += f" (node {node} is excluded but holds the task's last copies)"
        if verdict.severity is Severity.SEV3:
            limit = self.settings.max_reattempts
            if len(s.reattempts) < limit:
                s.reattempts.append(now)
                reason = f"{prefix}: reattempt {len(s.reattempts)} of {limit}"
                return Decision(Action.REATTEMPT, Severity.SEV3, reason, kind=kind)
            prefix += f": {limit} reattempts failed, escalated to SEV2"
        return self._sev2(kind, prefix, slot, node, now, judge_node=not kept)

    def healthy(self, *, slot: int, now: float) -> None:
        """``slot`` completed a step at ``now``: its reattempt count starts again."""
        s = self._slots.get(slot)
        if s is not None:
            s.reattempts.clear()

    def excluded_slots(self) -> frozenset[int]:
        """Slots excluded one by one (a node's exclusion is in :meth:`excluded_nodes`)."""
        return frozenset(k for k, s in self._slots.items() if s.excluded)

    def excluded_nodes(self) -> frozenset[int]:
        """Nodes excluded as a whole."""
        return frozenset(self._excluded_nodes)

    def readmit(self, *, slot: int | None = None, node: int | None = None) -> None:
        """A slot or a node is healthy again: back in the plan. A slot starts its reattempt
        and restart counts again but keeps its hardware-suspect failures, which still count
        toward its node's ``node_failure_limit`` within the window (a node whose slots fail one
        after another is excluded even if each passed a probe in between); a node's
        readmission clears its slots' histories, not their own exclusions."""
        if slot is not None:
            s = self._slots.get(slot)
            if s is not None:
                s.excluded = s.broken_script = False
                s.reattempts.clear()
                s.failures.clear()
                s.script.clear()
        if node is not None:
            self._excluded_nodes.discard(node)
            for k in [k for k, s in self._slots.items() if s.node == node and not s.excluded]:
                del self._slots[k]

    # ---- internals ----------------------------------------------------------------------

    def _slot(self, slot: int, node: int, now: float) -> SlotRecord:
        s = self._slots.setdefault(slot, SlotRecord(node))
        s.node = node
        horizon = now - self.settings.restart_window_s
        for times in (s.reattempts, s.failures, s.hardware, s.script):
            while times and times[0] <= horizon:
                times.popleft()
        return s

    def _sev1(self, verdict: Verdict, slot: int, node: int, now: float) -> Decision:
        kind = verdict.kind
        if verdict.action is not Action.EXCLUDE:
            reason = f"{kind} on slot {slot}: {verdict.action} (SEV1)"
            return Decision(verdict.action, Severity.SEV1, reason, kind=kind)
        if verdict.scope is Scope.NODE:
            self._excluded_nodes.add(node)
            reason = f"{kind} on node {node}: node excluded"
            return Decision(Action.EXCLUDE, Severity.SEV1, reason, exclude_node=True, kind=kind)
        return self._exclude_slot(kind, f"{kind} on slot {slot}: slot excluded", slot, node, now)

    def _sev2(
        self, kind: str, prefix: str, slot: int, node: int, now: float, *, judge_node: bool = True
    ) -> Decision:
        s = self._slots[slot]
        s.reattempts.clear()
        s.failures.append(now)
        if kind in NODE_SUSPECT:
            s.hardware.append(now)
        if kind == "user":
            s.script.append(now)
        limit, window = self.settings.restart_limit, self.settings.restart_window_s
        if len(s.failures) > limit:
            reason = f"{prefix}: failed {len(s.failures)} times in {window:g} s: slot excluded"
            if len(s.script) == len(s.failures):
                s.broken_script = True
                reason += " for good (the training script's own error every time: no health "
                reason += "probe mends that)"
            return self._exclude_slot(kind, reason, slot, node, now)
        if judge_node and self._node_failing(node, now):
            return self._exclude_node(kind, prefix, node, now, slot_excluded=False)
        reason = f"{prefix}: restart (restart {len(s.failures)} of {limit} in {window:g} s)"
        return Decision(Action.RESTART, Severity.SEV2, reason, kind=kind)

    def _exclude_slot(self, kind: str, reason: str, slot: int, node: int, now: float) -> Decision:
        s = self._slots.setdefault(slot, SlotRecord(node))
        s.excluded = True
        # the exclusion stays evidence against the node for the window, even once readmitted
        s.hardware.append(now)
        if self._node_failing(node, now):
            return self._exclude_node(kind, reason, node, now, slot_excluded=True)
        return Decision(Action.EXCLUDE, Severity.SEV1, reason, exclude_slot=True, kind=kind)

    def _exclude_node(
        self, kind: str, reason: str, node: int, now: float, *, slot_excluded: bool
    ) -> Decision:
        self._excluded_nodes.add(node)
        failing = self._failing_slots(node, now)
        reason += f"; node {node} has {len(failing)} failing slots {failing}: node excluded"
        return Decision(
            Action.EXCLUDE,
            Severity.SEV1,
            reason,
            exclude_slot=slot_excluded,
            exclude_node=True,
            kind=kind,
        )

    def _failing_slots(self, node: int, now: float) -> list[int]:
        """Slots of ``node`` excluded, or with a hardware-suspect failure in the window."""
        horizon = now - self.settings.restart_window_s
        return sorted(
            k
            for k, s in self._slots.items()
            if s.node == node and (s.excluded or any(t > horizon for t in s.hardware))
        )

    def _node_failing(self, node: int, now: float) -> bool:
        return len(self._failing_slots(node, now)) >= self.settings.node_failure_limit
