"""The coordinator: one per cluster. Owns the task's membership and decides every epoch.

It hosts the ``TCPStore`` that every process group rendezvous on (keys scoped by task and
epoch, :mod:`unicron.protocol`), turns what agents report (a worker ready, failed, raised,
finished) into decisions through the escalation policy (:mod:`unicron.escalation`), announces
epochs, and asks agents to restart or kill workers. Agents call the ``worker_*`` methods and
:meth:`Coordinator.tick` from their supervision loop; nothing here blocks.

Task states (:class:`TaskState`): ``PENDING`` (workers starting) -> ``RUNNING`` -> ``DONE`` or
``FAILED``; ``RUNNING`` stays ``RUNNING`` across epochs (a transition is an epoch change).
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from unicron.classify import Action, Scope, Verdict, classify_detector
from unicron.escalation import Escalation
from unicron.events import EventLog
from unicron.protocol import EpochInfo, done_key, epoch_info_key, epoch_key

log = logging.getLogger("unicron.coordinator")


class TaskState(enum.Enum):
    """PENDING -> RUNNING (first epoch announced) -> DONE (a member finished the last step)
    or FAILED (fewer usable slots than the minimum, or no replica holds the state)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class AgentHandle(Protocol):
    """What the coordinator asks of a node's agent."""

    node: int

    def spawn(self, slot: int) -> None: ...
    def kill(self, slot: int, verdict: Verdict | None = None) -> None: ...
    def probe(self, slot: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    min_workers: int = 1
    """the task is worth nothing below this many workers: it fails (exit 1) instead"""
    start_timeout_s: float = 120.0
    """the first epoch starts with the ready workers after this long, if they are enough"""
    checkpoint: Path | None = None
    """the task's persistent checkpoint: when every replica is gone the task goes on from it
    (if it exists) instead of failing"""
    heartbeat_timeout_s: float = 2.0
    """a node whose agent has not been heard from for this long is lost (SEV1, excluded)"""
    suspect_after_s: float = 0.5
    """a node silent for this long is *suspect*; a suspect node is lost at once when a living
    worker elsewhere reports a failed collective (the in-band symptom of a lost peer), so a
    node loss need not wait out the whole heartbeat timeout"""
    readmit_after_s: float = 60.0
    """an excluded slot (not a lost or excluded node) gets a health probe this long after its
    exclusion, twice as long after each further one; a probe that passes brings it back (a
    new worker joins the next epoch). ``math.inf``: never"""
    error_grace_s: float = 2.5
    """an in-band error with no process or node failure within this long is healed by a
    reattempt: a new epoch of the same members (fresh process group), keeping every local sum.
    Longer than the heartbeat timeout, so a lost node is not mistaken for a flaky link."""

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        if not self.error_grace_s >= 0:
            raise ValueError(f"error_grace_s must be >= 0, got {self.error_grace_s}")
        if not self.readmit_after_s > 0:
            raise ValueError(f"readmit_after_s must be > 0, got {self.readmit_after_s}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if not 0 < self.suspect_after_s <= self.heartbeat_timeout_s:
            raise ValueError(
                f"suspect_after_s must be in (0, heartbeat_timeout_s], got {self.suspect_after_s}"
            )


@dataclass
class _Slot:
    node: int
    ready: bool = False
    alive: bool = True  # a process exists or is being started
    excluded: bool = False
    done: dict[str, Any] | None = None
    last_error: str = ""
    has_state: bool = True  # it holds the task's committed state (or will after a sync)


@dataclass
class Outcome:
    """How the task ended, for the runner's exit code and report."""

    state: TaskState
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    usage: bool = False  # failed on bad input (a worker's check before training): exit 2


class Coordinator:
    """Membership and decisions for one task (the embedded coordinator of ``unicron run``)."""

    def __init__(
        self,
        *,
        task: str,
        slots: dict[int, int],
        events: EventLog,
        escalation: Escalation,
        settings: CoordinatorSettings,
        host: str = "127.0.0.1",
    ) -> None:
        self.task = task
        self.events = events
        self.escalation = escalation
        self.settings = settings
        self.slots = {s: _Slot(node=n) for s, n in slots.items()}
        self.agents: dict[int, AgentHandle] = {}
        self.state = TaskState.PENDING
        self.epoch = 0
        self.members: tuple[int, ...] = ()
        self.outcome: Outcome | None = None
        self.started_at: float | None = None
        self._pending_errors: dict[int, tuple[float, Verdict]] = {}
        self._last_failure_ts = float("-inf")
        self._lock = threading.RLock()
        self.heartbeats: dict[int, float] = {}  # node -> when its agent was last heard from
        self._computed: dict[int, int] = {}  # slot -> last step it finished computing
        self._trained = False  # a step committed: a fresh worker's model is no longer the state
        self._commits: set[tuple[int, int]] = set()  # (epoch, step) reported committed
        self._last_error = ""
        self._last_tick: float | None = None
        self.lost_nodes: set[int] = set()
        self._excluded_at: dict[int, float] = {}  # slot -> when it was excluded (or re-probed)
        self._exclusions: dict[int, int] = {}  # slot -> times excluded: the probe backoff
        self._probing: set[int] = set()
        self.microbatches: int | None = None  # per global batch, learned from the workers
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60)
        )
        self.store_address = f"{host}:{self.store.port}"

    def attach(self, agent: AgentHandle) -> None:
        self.agents[agent.node] = agent

    # -- reports from agents ----------------------------------------------------------------
    def worker_ready(self, slot: int, now: float) -> None:
        """The worker in ``slot`` built its model and waits for an epoch."""
        with self._lock:
            self.slots[slot].ready = True
            self.slots[slot].alive = True
            self.tick(now)

    def worker_failed(self, slot: int, verdict: Verdict, now: float) -> None:
        """The worker process in ``slot`` is gone (the agent already logged the detection)."""
        with self._lock:
            s = self.slots[slot]
            s.ready = s.alive = False
            s.last_error = verdict.reason
            self._last_failure_ts = now
            self._pending_errors.pop(slot, None)
            if self.state in (TaskState.DONE, TaskState.FAILED):
                return
            self._last_error = verdict.reason
            if s.excluded:  # the coordinator itself took it out (a dropped straggler)
                self._reform(now, f"slot {slot} excluded")
                return
            decision = self.escalation.decide(verdict, slot=slot, node=s.node, now=now)
            self._action(decision.action, slot, decision.reason, int(decision.severity), now)
            if decision.exclude_node or (
                verdict.scope is Scope.NODE and decision.action is Action.EXCLUDE
            ):
                for other, o in self.slots.items():
                    if o.node == s.node:
                        o.excluded = True
                        if o.alive:
                            o.alive = o.ready = False  # doomed: not a member of the next epoch
                            self.agents[o.node].kill(other, verdict)
            if decision.exclude_slot or decision.action is Action.EXCLUDE:
                self._exclude(slot, now)
            if not self._reform(now, f"slot {slot} lost: {verdict.kind}"):
                return
            if not s.excluded:
                s.alive = True  # its restart: a member of a later epoch once it is ready
                s.has_state = not self._trained
                self.agents[s.node].spawn(slot)

    def worker_error(self, slot: int, verdict: Verdict, now: float, *, in_place: bool) -> None:
        """An error raised inside a living worker (in-band).

        ``in_place``: the worker already retried the step in place (SEV3), and the decision is
        only recorded, unless the escalation says the retries are used up (then the worker is
        restarted). Otherwise (a collective failed) it is healed in :meth:`tick`.
        """
        with self._lock:
            if not in_place:
                self._pending_errors.setdefault(slot, (now, verdict))
                return
            s = self.slots[slot]
            decision = self.escalation.decide(verdict, slot=slot, node=s.node, now=now)
            self._action(decision.action, slot, decision.reason, int(decision.severity), now)
            if decision.action is not Action.REATTEMPT:
                self.agents[s.node].kill(slot, verdict)

    def worker_slow(
        self, slot: int, verdict: Verdict, mb_compute_s: dict[int, float], now: float
    ) -> None:
        """A straggler: ask the planner whether the task's WAF is higher without it; act on
        the answer (drop the slot, or keep it and say why)."""
        with self._lock:
            if slot not in self.members or self.state is not TaskState.RUNNING:
                return
            peers = [t for s, t in mb_compute_s.items() if s != slot and s in self.members]
            if slot not in mb_compute_s or not peers:
                return
            from unicron.straggler import straggler_plan

            drop, reason = straggler_plan(
                world=len(self.members),
                microbatches=self.microbatches or len(self.members),
                peer_mb_s=sorted(peers)[len(peers) // 2],
                slow_mb_s=mb_compute_s[slot],
                min_workers=self.settings.min_workers,
            )
            s = self.slots[slot]
            if drop:
                self._action(Action.EXCLUDE, slot, f"straggler dropped: {reason}", 1, now)
                self._exclude(slot, now)
                self.agents[s.node].kill(slot, verdict)
            else:
                self._action(Action.RECONFIGURE, slot, f"straggler kept: {reason}", 1, now)

    def worker_done(self, slot: int, report: dict[str, Any], now: float) -> None:
        """The worker in ``slot`` finished the last step (every member of the epoch will)."""
        with self._lock:
            if self.state is TaskState.FAILED:
                return
            self.slots[slot].done = report
            shas = {o.done["params_sha256"] for o in self.slots.values() if o.done}
            if len(shas) > 1:  # every replica applied every update: they must agree bit for bit
                self.state = TaskState.DONE
                self.store.set(done_key(self.task), "failed")
                self.outcome = Outcome(
                    TaskState.FAILED, f"replicas finished with different parameters: {sorted(shas)}"
                )
                return
            if self.state is TaskState.RUNNING:
                self.state = TaskState.DONE
                self.store.set(done_key(self.task), "done")
            if (report.get("rank") == 0 or not self.outcome) and len(shas) == 1:
                self.outcome = Outcome(TaskState.DONE, "finished", report)

    def finished(self) -> bool:
        """True once the task is over and every member of the last epoch has reported."""
        with self._lock:
            if self.state is TaskState.FAILED:
                return True
            if self.state is not TaskState.DONE:
                return False
            return all(
                self.slots[m].done is not None or not self.slots[m].alive for m in self.members
            )

    # -- decisions over time ----------------------------------------------------------------
    def step_computed(self, slot: int, step: int) -> None:
        """The worker in ``slot`` finished computing ``step`` (it may still be reducing): it
        holds the state; and once anyone computes step 1, step 0 has committed."""
        with self._lock:
            self._computed[slot] = step
            self.slots[slot].has_state = True
            self._trained = self._trained or step >= 1

    def peer_ahead(self, slot: int, step: int) -> bool:
        """Whether another member of the current epoch finished computing ``step``: the
        evidence that ``slot``, still in that step past its deadline, hangs alone."""
        with self._lock:
            return any(m != slot and self._computed.get(m, -1) >= step for m in self.members)

    def alone(self, slot: int) -> bool:
        """Whether ``slot`` is the only member of the current epoch: no peer can vouch that
        its step hangs rather than the machine being slow."""
        with self._lock:
            return self.members == (slot,)

    def state_survives(self, slot: int) -> bool:
        """Whether the task's state outlives the worker in ``slot``: another live replica
        holds it, or there is a checkpoint (the condition ``_reform`` goes on with)."""
        with self._lock:
            return any(s != slot for s in self._holders()) or self._has_checkpoint()

    def first_commit_report(self, epoch: int, step: int) -> bool:
        """True for the first report of ``step`` committed in ``epoch`` (every member sends
        one; the event log keeps one)."""
        with self._lock:
            key = (epoch, step)
            if key in self._commits:
                return False
            self._commits.add(key)
            return True

    def over(self) -> bool:
        """The task is done or failed (waiting workers are leaving)."""
        return self.state in (TaskState.DONE, TaskState.FAILED)

    def heartbeat(self, node: int, now: float) -> None:
        """The agent of ``node`` is alive (called on every round of its loop)."""
        with self._lock:
            self.heartbeats[node] = now

    def tick(self, now: float) -> None:
        """Notice lost nodes, start the first epoch, grow with ready workers, heal lone
        in-band errors. Called by every agent's loop and by the runner."""
        with self._lock:
            self._check_heartbeats(now)
            if self.state is TaskState.PENDING:
                self._maybe_start(now)
            elif self.state is TaskState.RUNNING:
                self._heal_errors(now)
                self._probe_excluded(now)
                joiners = tuple(
                    s
                    for s, o in sorted(self.slots.items())
                    if o.ready and o.alive and not o.excluded and s not in self.members
                )
                grown = self.members + joiners
                if joiners and len(grown) >= self.settings.min_workers:
                    self._announce(
                        grown,
                        urgent=len(self.members) < self.settings.min_workers,
                        now=now,
                        reason=f"slot(s) {', '.join(map(str, joiners))} ready to join",
                    )

    def _check_heartbeats(self, now: float) -> None:
        stalled = (
            self._last_tick is not None and now - self._last_tick > self.settings.suspect_after_s
        )
        self._last_tick = now
        if stalled:  # this process itself did not run for a while: every agent looks silent
            for node in self.heartbeats:
                self.heartbeats[node] = max(self.heartbeats[node], now)
            return
        symptoms = [ts for ts, _ in self._pending_errors.values()]
        for node, last in self.heartbeats.items():
            silent = now - last
            suspect_confirmed = silent > self.settings.suspect_after_s and any(
                ts > last for ts in symptoms
            )
            if node in self.lost_nodes or not (
                silent > self.settings.heartbeat_timeout_s or suspect_confirmed
            ):
                continue
            self.lost_nodes.add(node)
            self._last_failure_ts = now
            verdict = classify_detector("heartbeat_lost")
            slots = sorted(s for s, o in self.slots.items() if o.node == node)
            self.events.emit(
                "error_detected",
                ts=now,
                task=self.task,
                node=node,
                kind=verdict.kind,
                severity=int(verdict.severity),
                method="heartbeat",
                silent_s=round(now - last, 3),
                reason=f"no heartbeat from node {node} for {silent:.2f} s"
                + (" and a collective failed on a living peer" if suspect_confirmed else ""),
            )
            if self.state in (TaskState.DONE, TaskState.FAILED):
                continue
            decision = self.escalation.decide(verdict, slot=slots[0], node=node, now=now)
            self.events.emit(
                "action",
                task=self.task,
                epoch=self.epoch,
                node=node,
                action=str(decision.action),
                severity=int(decision.severity),
                reason=decision.reason,
                slots=slots,
            )
            for s in slots:
                o = self.slots[s]
                o.excluded, o.alive, o.ready = True, False, False
            self._last_error = decision.reason
            self._reform(now, f"node {node} lost")

    def _maybe_start(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now
        usable = [s for s, o in sorted(self.slots.items()) if not o.excluded]
        ready = tuple(s for s in usable if self.slots[s].ready)
        timed_out = now - self.started_at > self.settings.start_timeout_s
        if ready and (
            len(ready) == len(usable) or (timed_out and len(ready) >= self.settings.min_workers)
        ):
            self.state = TaskState.RUNNING
            self._announce(ready, urgent=False, now=now, reason="start")

    def _heal_errors(self, now: float) -> None:
        for slot, (ts, verdict) in list(self._pending_errors.items()):
            if self._last_failure_ts >= ts - self.settings.error_grace_s:
                del self._pending_errors[slot]  # a symptom of a process failure, already healed
            elif now - ts > self.settings.error_grace_s:
                del self._pending_errors[slot]
                s = self.slots[slot]
                decision = self.escalation.decide(verdict, slot=slot, node=s.node, now=now)
                self._action(decision.action, slot, decision.reason, int(decision.severity), now)
                if decision.action is Action.REATTEMPT:
                    self._announce(
                        self.members,
                        urgent=True,
                        now=now,
                        reason=f"reattempt after {verdict.kind} on slot {slot}",
                    )
                else:  # escalated: restart the process; its exit is handled as a failure
                    self.agents[s.node].kill(slot, verdict)

    def _reform(self, now: float, reason: str) -> bool:
        """After members were lost: fail the task if it cannot go on, else announce an epoch of
        the survivors, or (below the task's minimum, where it is worth nothing) wait for
        restarted workers to bring it back. Returns False if the task failed."""
        survivors = tuple(m for m in self.members if self.slots[m].alive)
        usable = [s for s, o in self.slots.items() if not o.excluded]
        holders = self._holders()
        why = ""
        if len(usable) < self.settings.min_workers:
            why = (
                f"{len(usable)} usable slot(s) left, fewer than the minimum of "
                f"{self.settings.min_workers}"
            )
        elif self.state is TaskState.RUNNING and not holders and not self._has_checkpoint():
            why = "every replica holding the model state is gone (no checkpoint to fall back on)"
        if why:
            self.fail(f"{why}; last error: {self._last_error}", now)
            return False
        if survivors == self.members:
            return True
        if len(survivors) < self.settings.min_workers:
            self.members = survivors  # no epoch below the minimum: wait for the restarts
            log.warning(
                "task %s below its minimum (%d workers): waiting", self.task, len(survivors)
            )
            return True
        self._announce(survivors, urgent=True, now=now, reason=reason)
        return True

    def _holders(self) -> list[int]:
        """The live slots that hold the task's committed state (or will after a sync)."""
        return [s for s, o in self.slots.items() if o.alive and o.has_state]

    def _nodes_out(self) -> set[int]:
        """Nodes lost or excluded as a whole: their slots are not probed or readmitted."""
        return self.lost_nodes | self.escalation.excluded_nodes()

    def _exclude(self, slot: int, now: float) -> None:
        """Take ``slot`` out of the plan until a health probe brings it back."""
        self.slots[slot].excluded = True
        self._excluded_at[slot] = now
        self._exclusions[slot] = self._exclusions.get(slot, 0) + 1

    def _probe_due(self, slot: int) -> float:
        """When the excluded ``slot`` may be probed: the cool-down doubles per exclusion."""
        backoff = 2.0 ** (self._exclusions.get(slot, 1) - 1)
        return self._excluded_at[slot] + self.settings.readmit_after_s * backoff

    def _probe_excluded(self, now: float) -> None:
        """Ask the agents to probe the excluded slots whose cool-down is over (slots of a
        lost or excluded node stay out: their node, not the slot, is what failed)."""
        dead_nodes = self._nodes_out()
        for slot in self._excluded_at:
            o = self.slots[slot]
            # o.alive: its last worker's exit is not handled yet (a dropped straggler)
            if slot in self._probing or not o.excluded or o.alive or o.node in dead_nodes:
                continue
            if now >= self._probe_due(slot) and o.node in self.agents:
                log.info("task %s: probing excluded slot %d", self.task, slot)
                try:
                    self.agents[o.node].probe(slot)
                except OSError as exc:  # could not start it: try again after another wait
                    self._excluded_at[slot] = now
                    log.warning("task %s: probe of slot %d not started: %s", self.task, slot, exc)
                    continue
                self._probing.add(slot)

    def probe_done(self, slot: int, ok: bool, detail: str, now: float) -> None:
        """The health probe of the excluded ``slot`` ended (called by its agent): readmit it
        and start a worker there, or keep it out for twice as long (an ``action`` either way)."""
        with self._lock:
            self._probing.discard(slot)
            o = self.slots[slot]
            if not o.excluded or o.alive or self.state is not TaskState.RUNNING:
                return
            if o.node in self._nodes_out():
                return  # its node went meanwhile: the slot's own health no longer matters
            if not ok:
                self._exclude(slot, now)  # again: the next wait doubles
                wait_s = self._probe_due(slot) - now
                reason = f"slot {slot} failed its health probe ({detail}); next in {wait_s:.0f} s"
                self._action(Action.EXCLUDE, slot, reason, 1, now)
                return
            excluded_s = now - self._excluded_at[slot]
            self.escalation.readmit(slot=slot)
            o.excluded, o.alive, o.ready = False, True, False
            o.has_state = not self._trained
            reason = f"slot {slot} passed its health probe after {excluded_s:.1f} s out: {detail}"
            self._action(Action.READMIT, slot, reason, 1, now)
            self.agents[o.node].spawn(slot)

    def _has_checkpoint(self) -> bool:
        return self.settings.checkpoint is not None and self.settings.checkpoint.exists()

    def fail(self, reason: str, now: float, *, usage: bool = False) -> None:
        """Give the task up: waiting workers exit, the runner exits 1 with ``reason`` (2 with
        ``usage``: a worker found bad input before training, e.g. a model too large)."""
        with self._lock:
            if self.state in (TaskState.DONE, TaskState.FAILED):
                return
            self.state = TaskState.FAILED
            self.outcome = Outcome(TaskState.FAILED, reason, usage=usage)
            self.store.set(done_key(self.task), "failed")
            if not usage:  # bad input is the runner's one line on stderr
                log.error("task %s failed: %s", self.task, reason)

    # -- effects ----------------------------------------------------------------------------
    def _announce(self, members: tuple[int, ...], *, urgent: bool, now: float, reason: str) -> None:
        self.members = members
        if not members:
            return  # nobody to tell; the next epoch is made of the workers that come back
        self.epoch += 1
        info = EpochInfo(
            self.epoch,
            members,
            tuple(self.slots[m].node for m in members),
            urgent,
            published_ts=now,
        )
        self.events.emit(
            "plan",
            ts=now,
            task=self.task,
            epoch=self.epoch,
            allocation={self.task: len(members)},
            reason=reason,
        )
        self.store.set(epoch_info_key(self.task, self.epoch), info.to_json())
        self.store.set(epoch_key(self.task), str(self.epoch))
        self.events.emit(
            "epoch_begin",
            ts=now,
            task=self.task,
            epoch=self.epoch,
            members=list(members),
            urgent=urgent,
            reason=reason,
        )

    def _action(self, action: Action, slot: int, reason: str, severity: int, now: float) -> None:
        self.events.emit(
            "action",
            ts=now,
            task=self.task,
            epoch=self.epoch,
            rank=slot,
            slot=slot,
            node=self.slots[slot].node,
            action=str(action),
            severity=severity,
            reason=reason,
        )

    def close(self) -> None:
        """Stop serving the store (after every worker is gone)."""
        del self.store
