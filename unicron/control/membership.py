"""Membership and epochs: who trains together, and when a new epoch is announced.

Judges over a task's :class:`~unicron.control.book.TaskBook`, called by its
:class:`~unicron.control.coordinator.Coordinator` under its lock (and by the other judges:
:mod:`~unicron.control.failures` reforms after a loss): the first epoch (:func:`maybe_start`),
ready workers joining (:func:`grow`), an epoch of the survivors or a wait below the minimum
after a loss (:func:`reform`), the planner's moves (:func:`add_slot`, :func:`release_slots`),
commits (:func:`step_committed`), the end (:func:`worker_done`, :func:`fail`) and the take-over
of a running task after a coordinator's restart (:func:`adopt`: what the store said comes in
as values). Each changes the book and appends its effects there.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from typing import Any

from unicron.control import replicas
from unicron.control.book import Outcome, TaskBook, TaskState, whole
from unicron.control.effects import AnnounceEpoch, WriteStoreKey
from unicron.control.slots import SlotState
from unicron.detect.classify import Action
from unicron.detect.stall import Phase, Progress
from unicron.messages import Kill, Spawn
from unicron.protocol import EpochInfo, done_key, state_bytes_key, trained_key

log = logging.getLogger("unicron.control.coordinator")


def adopt(
    b: TaskBook,
    now: float,
    info: EpochInfo | None,
    *,
    trained: bool,
    committed: int,
    state_bytes: int = 0,
) -> None:
    """Take over the task as its workers left it: epoch ``info`` read from the store (``None``:
    no epoch was announced, it starts as a new task does), ``trained`` whether a step had
    committed, ``committed`` the last step the old coordinator logged, ``state_bytes`` the
    state's size the store kept (0: unknown until a worker's ``Ready``; before, a takeover
    always forgot it, and the peers of a large state's final writer had the flat
    ``stall_cold_s`` to write theirs). Every slot is presumed alive until its agent's census
    says otherwise, every node heard from now."""
    b.state_bytes = max(b.state_bytes, state_bytes)
    b.adopting = set(b.slots.nodes())
    b.moved_at = now  # the agents find this coordinator, the workers perhaps a new store
    if info is None:
        return
    b.epoch = info.epoch
    # members of this epoch or older report commits the old coordinator logged
    b.logged_before = (b.epoch, committed)
    # a slot given back since that epoch is nobody's now (found by the cluster soak: a
    # coordinator that announced it again failed to start, KeyError, again and again)
    members = tuple(m for m in info.members if m in b.slots)
    gone = [m for m in info.members if m not in b.slots]
    own = b.settings.own
    lay = (info.tp or own[0], info.pp or own[1])  # the log's are spelled out, the store's not
    b.layout = (0, 0) if lay == own else lay
    b.members = replicas.whole(b.slots, members, b.lay) if gone else members
    b.trained = trained
    b.state = TaskState.RUNNING if b.members else TaskState.WAITING
    if b.state is TaskState.WAITING:
        b.waiting_since, b.waiting_reason = now, "adopted with no members"
    else:
        b.adopted_at = now  # until a step commits (:func:`unicron.control.health.check_stalls`)
    b.epoch_layouts[b.epoch], b.epoch_members[b.epoch] = b.layout, b.members
    for slot, o in b.slots.items():
        if slot in b.members:
            o.readied()
            o.entering_lay = b.layout  # the adopted epoch's, maybe only announced
        o.has_state = b.trained or slot in b.members
        o.fresh = not b.trained
    if gone and b.members:
        slots = ", ".join(map(str, gone))
        announce(b, b.members, urgent=True, now=now, reason=f"slot(s) {slots} given back")
    for node in b.slots.nodes():
        b.heartbeats[node] = now
    # their agents are still finding this coordinator: only the full timeout judges them
    b.suspects_from = now + b.settings.heartbeat_timeout_s
    b.last_tick = now


def step_committed(b: TaskBook, epoch: int, step: int) -> bool:
    """A member reports that ``step`` committed in ``epoch``: True for the first report of it.
    The first commit makes a freshly built model no longer the task's state (the ``trained``
    store key, which starting workers read, is written here), except in the members of the
    epoch it committed in whose workers were started before it: they computed the step,
    whether their agents have said so yet or not (found beside CPU burners: PP=2 x DP=2 on
    four nodes, node 3's reports of steps 0 and 1 not in when rank 0's commit and then slot
    1's crash were; slot 3, the live replica's stage 1, counted as holding nothing, and the
    task failed as if the state were gone). A member restarted since (its crash reported
    before the commit) holds a fresh model (:attr:`Slot.born`)."""
    key = (epoch, step)
    if key in b.commits:
        return False
    old_epoch, old_step = b.logged_before
    if epoch <= old_epoch and step <= old_step:
        return False  # logged by the coordinator this one took over from
    b.commits.add(key)
    b.commit_epoch = max(b.commit_epoch, epoch)
    b.adopted_at = None
    if not b.trained:
        b.trained = True
        b.effects.append(WriteStoreKey(trained_key(b.task), "1"))
        took_part = _took_part(b, epoch)
        for slot, o in b.slots.items():
            if slot in took_part and o.predates(epoch):  # and its worker lives since
                o.has_state, o.fresh = True, False
            elif o.fresh:  # a fresh model started before the first commit: not the state
                o.has_state = False
    return True


def _took_part(b: TaskBook, epoch: int) -> tuple[int, ...]:
    """The members of ``epoch``; of one before this coordinator's first (it adopted the task
    at a later one), every slot: its members are not known here, and a rank of that epoch may
    now wait outside the adopted one with its copy (a worker that built its model since is
    told apart by :attr:`Slot.born`, from the agents' census)."""
    known = b.epoch_members
    if epoch in known or not known or epoch > min(known):
        return known.get(epoch, ())
    return tuple(b.slots)


def committed_steps(b: TaskBook) -> int | None:
    """Steps committed so far, this run and any run it resumed (``None``: unknown)."""
    here = max((step + 1 for _, step in b.commits), default=0)
    before = b.settings.committed_before
    return None if before is None and not here else max(here, before or 0)


def worker_done(b: TaskBook, slot: int, report: dict[str, Any], now: float) -> None:
    """The worker in ``slot`` finished the last step. The task is DONE (the ``done`` key
    written, which ends the workers' waits) once every live member of the current epoch has
    (:func:`all_done`): until then a finished worker stays, for a newer epoch may need what
    it holds (a member whose last update's broadcast was cut by a loss, a joiner), and it
    reports again from there."""
    if b.state is TaskState.FAILED:
        return
    o = b.slots[slot]
    o.done = report
    lay = b.epoch_layouts.get(int(report.get("epoch", -1)))  # None: before a takeover
    if lay is not None and int(report.get("rank", b.size_at(lay))) < b.size_at(lay):
        b.final_written.add((lay, int(report.get("shard", 0))))  # replica 0: its file written
    known = o.progress
    o.progress = Progress(
        known.epoch if known else b.epoch, Phase.DONE, report.get("steps", -1), now
    )
    # every replica applied every update: they must agree bit for bit, place by place (a
    # tensor-parallel replica's ranks hold different shards) of the layout they finished in
    # (a report of a worker lost before a layout change holds the old layout's shards)
    shas: dict[tuple[tuple[int, int], int], set[str]] = {}
    for x in b.slots.values():
        if x.done:
            lay = b.epoch_layouts.get(int(x.done.get("epoch", -1)), b.layout)
            key = (lay, int(x.done.get("shard", 0)))
            shas.setdefault(key, set()).add(x.done["params_sha256"])
    if any(len(found) > 1 for found in shas.values()):
        differ = sorted(sha for found in shas.values() if len(found) > 1 for sha in found)
        fail(b, f"replicas finished with different parameters: {differ}", now)
        return
    if report.get("rank") == 0 or not b.outcome:
        b.outcome = Outcome(TaskState.DONE, "finished", report)
    now_shas = {k: found for (lay, k), found in shas.items() if lay == b.layout}
    if b.size > 1 and len(now_shas) == b.size:
        # the whole model's digest: its shards' digests in place order
        per_shard = [next(iter(now_shas[k])) for k in range(b.size)]
        whole = hashlib.sha256(",".join(per_shard).encode()).hexdigest()
        result = {**b.outcome.result, "params_sha256": whole, "shards_sha256": per_shard}
        b.outcome = Outcome(TaskState.DONE, "finished", result)
    conclude_if_done(b)


def all_done(b: TaskBook) -> bool:
    """Whether every live member of the current epoch has reported the task's last step
    (in this epoch or an earlier one: a finished worker's state does not change), and one
    at least lives."""
    live = [b.slots[m] for m in b.members if b.slots[m].alive]
    return bool(live) and all(o.done is not None for o in live)


def final_files_written(b: TaskBook) -> bool:
    """Whether every place of replica 0 at the current layout has reported done: its ranks
    write the final files (a file per shard, :func:`unicron.runtime.boundary.finish`) before
    they report, so a report from rank ``< size`` in an epoch of this layout is its place's
    file (:attr:`TaskBook.final_written`, kept by :func:`worker_done`: the reporter may have
    died or been restarted since). A writer lost before its report leaves its place
    unwritten: the task must form a new epoch, whose replica 0 is of live members (finished
    workers enter it and finish again there). Found: a DP=2 run whose rank 0 was killed in
    the last step's update ended ``ok`` with no ``final.pt``."""
    return all((b.layout, place) in b.final_written for place in range(b.size))


def conclude_if_done(b: TaskBook) -> bool:
    """An active task whose every live member has reported done (:func:`all_done`), with its
    final files written (:func:`final_files_written`), is DONE: the ``done`` key tells the
    waiting workers. Called after each report and after each loss (a member lost or gone
    after all the others finished leaves nothing to heal, unless it was to write a final
    file: then the caller goes on to a new epoch). Returns whether the task ended here."""
    if not (b.active() and all_done(b) and final_files_written(b)):
        return False
    b.state = TaskState.DONE
    b.effects.append(WriteStoreKey(done_key(b.task), "done"))
    return True


def finished(b: TaskBook) -> bool:
    """True once the task is over and every member of the last epoch has reported."""
    if b.state is TaskState.FAILED:
        return True
    if b.state is not TaskState.DONE:
        return False
    return all(b.slots[m].done is not None or not b.slots[m].alive for m in b.members)


def fail(b: TaskBook, reason: str, now: float, *, usage: bool = False) -> None:
    """Give the task up (``usage``: a worker found bad input, exit 2)."""
    if b.state is TaskState.FAILED:
        return
    b.state = TaskState.FAILED
    b.outcome = Outcome(TaskState.FAILED, reason, usage=usage)
    b.effects.append(WriteStoreKey(done_key(b.task), "failed"))
    if not usage:  # bad input is the runner's one line on stderr
        log.error("task %s failed: %s", b.task, reason)


# -- the planner's moves -------------------------------------------------------------------
def add_slot(b: TaskBook, slot: int, node: int, now: float, reason: str, place: int) -> None:
    """The cluster gives the task ``slot`` on ``node``: a worker starts there, at ``place``
    in its replica (the cluster adds a replica's slots one by one: those known so far may
    group otherwise), and joins the next epoch, at a step boundary, with the state from the
    nearest replica. A ``reconfigure`` action says why."""
    if slot in b.slots or b.over():
        return
    b.slots.add(slot, node)
    b.started(slot)
    b.action(Action.RECONFIGURE, slot, f"slot {slot} added: {reason}", 1, now)
    b.send(node, Spawn(slot, fresh=True, place=place))


def release_slots(b: TaskBook, slots: list[int], now: float, reason: str) -> None:
    """The cluster takes ``slots`` back: one epoch goes on without them; their workers are
    stopped once every remaining member entered it (:func:`stop_leavers`)."""
    leaving = []
    for slot in slots:
        s = b.slots.get(slot)
        if s is None or s.leaving:
            continue
        b.action(Action.RECONFIGURE, slot, f"slot {slot} released: {reason}", 1, now)
        if not s.alive:
            b.forget(slot)
            b.slots.remove(slot)
        else:
            s.to(SlotState.LEAVING)
            leaving.append(slot)
    lay = layout(b, [s for s in _usable(b) if s not in leaving])
    rest = replicas.whole(b.slots, [m for m in b.members if m not in leaving], b.lay_at(lay))
    if (rest != b.members or lay != b.layout) and b.active():
        gone = ", ".join(map(str, leaving))
        announce(b, rest, urgent=False, now=now, reason=f"slot(s) {gone} released", lay=lay)


def worker_left(b: TaskBook, slot: int) -> None:
    """The worker in ``slot`` exited cleanly: after the task ended, or stopped because its
    slot goes to another task (then the slot is the task's no more)."""
    s = b.slots.get(slot)
    if s is None:
        return
    s.ended()
    if s.leaving:
        b.forget(slot)
        b.slots.remove(slot)
    conclude_if_done(b)  # the others finished: it was the last to report


def stop_leavers(b: TaskBook) -> None:
    """Stop the workers of released slots once every member entered the epoch without
    them (they finished the step they were in; nothing of theirs is needed)."""
    for slot, s in list(b.slots.items()):
        if s.state is not SlotState.LEAVING or slot in b.members:
            continue
        entered = all(
            (p := b.slots.progress_of(m)) is not None and p.epoch >= b.epoch for m in b.members
        )
        if entered or not b.members or b.over():
            s.to(SlotState.STOPPING)
            b.send(s.node, Kill(slot, None, leave=True))


def in_transition(b: TaskBook) -> bool:
    """An epoch not every member has entered yet, or a leaver not yet stopped."""
    if b.state is not TaskState.RUNNING:
        return False
    return any(
        (p := b.slots.progress_of(m)) is None or p.epoch < b.epoch for m in b.members
    ) or any(o.state is SlotState.LEAVING for o in b.slots.values())


# -- epochs --------------------------------------------------------------------------------
def layout(b: TaskBook, usable: Sequence[int]) -> tuple[int, int]:
    """The ``(tp, pp)`` layout of the next epoch (``(0, 0)``: the task's own): of the task's
    layouts (:attr:`~unicron.control.book.CoordinatorSettings.layouts`), the one whose whole
    replicas of the ``usable`` slots (not excluded: those that train now or will once
    restarted) train fastest by the performance model
    (:attr:`~unicron.control.book.CoordinatorSettings.rate`: a task that describes its
    ``model`` in a cluster), else the one that trains the most of them. Among equals: the
    task's own when it trains every usable slot (the task is whole again), else the current
    one (a move that gains nothing is not made), else the task's own, else the first. A slot
    lost for good (excluded, its node lost, given to another task) can change it; a restart
    cannot. Pure."""
    layouts = b.settings.layouts
    if not layouts:
        return 0, 0
    trained = {lay: len(replicas.whole(b.slots, usable, lay)) for lay in layouts}
    score: dict[tuple[int, int], float] = {lay: float(n) for lay, n in trained.items()}
    rate = b.settings.rate
    if rate is not None:
        priced = {lay: rate(lay[0], lay[1], n) if n else 0.0 for lay, n in trained.items()}
        if any(v > 0 for v in priced.values()):  # else nothing fits: count the slots
            score = priced
    best = max(score.values())
    own = layouts[0]
    current = b.layout if b.layout[0] else own
    if score[own] == best and (trained[own] == len(usable) or current == own):
        choice = own
    elif score.get(current) == best:
        choice = current
    else:
        choice = next(lay for lay in layouts if score[lay] == best)
    return (0, 0) if choice == own else choice


def _usable(b: TaskBook) -> list[int]:
    """The task's slots that are neither excluded nor given to another task, in slot
    order."""
    return [s for s, o in sorted(b.slots.items()) if not o.excluded and not o.leaving]


def maybe_start(b: TaskBook, now: float) -> None:
    """The first epoch: every usable slot ready, or enough of them once the start times out."""
    if b.started_at is None:
        b.started_at = now
    usable = _usable(b)
    lay = layout(b, usable)
    ready = replicas.whole(b.slots, [s for s in usable if b.slots[s].ready], b.lay_at(lay))
    timed_out = now - b.started_at > b.settings.start_timeout_s
    if ready and (
        len(ready) == len(usable) or (timed_out and len(ready) >= b.settings.min_workers)
    ):
        b.state = TaskState.RUNNING
        announce(b, ready, urgent=False, now=now, reason="start", lay=lay)


def grow(b: TaskBook, now: float) -> None:
    """Ready workers outside the membership join the next epoch (at a step boundary, or at
    once when the task is below its minimum)."""
    joiners = tuple(
        s
        for s, o in sorted(b.slots.items())
        if o.ready and o.alive and not o.excluded and s not in b.members
    )
    lay = layout(b, _usable(b))
    grown = replicas.whole(b.slots, b.members + joiners, b.lay_at(lay))
    joiners = tuple(s for s in grown if s not in b.members)
    if not b.members and _shard_on_its_way(b, grown):
        return  # a replica being restarted brings a shard the others lack: it joins too
    if joiners and len(grown) >= b.settings.min_workers:
        below = b.state is TaskState.WAITING or len(b.members) < b.settings.min_workers
        running(b, now)
        announce(
            b,
            grown,
            urgent=below,
            now=now,
            reason=f"slot(s) {', '.join(map(str, joiners))} ready to join",
            lay=lay,
        )


def _shard_on_its_way(b: TaskBook, candidates: tuple[int, ...]) -> bool:
    """Model parallel, nobody training: whether ``candidates`` lack some place's shard that a
    living rank outside them holds while its replica's lost rank is being restarted. Both
    replicas lost a rank in the same step: each alone would roll back to the checkpoint,
    together they hold every shard (the wait is one restart). Shards are counted at the
    layout each rank holds its state in (:meth:`TaskBook.shards`)."""
    if not b.trained:
        return False
    have = b.shards_of(s for s in candidates if b.slots[s].has_state)
    if whole(have):
        return False  # they hold every place's shard at some layout: nothing to wait for
    for s, o in b.slots.items():
        if s in candidates or not o.alive or not o.has_state:
            continue
        for lay, _place in b.shards(s) - have:
            if lay == (1, 1):
                continue  # the whole model: no replica of one rank waits for another
            group = replicas.group_of(b.slots, s, lay)
            if any(b.slots[m].state is SlotState.STARTING for m in group):
                return True
    return False


def reform(b: TaskBook, now: float, reason: str) -> bool:
    """After members were lost: fail the task if it cannot go on, else announce an epoch of
    the survivors, or (below the task's minimum, where it is worth nothing) wait for
    restarted or readmitted workers to bring it back; when every member left alive has
    finished (:func:`all_done`), the task is DONE instead. Returns False if the task ended
    (failed or DONE)."""
    if b.over():  # a slot given away, or a node, lost after the end: nothing to heal (found
        return False  # in review: a leaver's exit after DONE made a DONE task WAITING)
    if conclude_if_done(b):  # a member lost after the others finished: nothing left to heal
        return False
    # whole replicas only: the living ranks of a broken one wait outside the epoch
    usable = _usable(b)
    lay = layout(b, usable)
    survivors = replicas.whole(b.slots, [m for m in b.members if b.slots[m].alive], b.lay_at(lay))
    if b.active() and survivors and all_done(b) and b.state_held():
        # every live member finished and a final file is unwritten (its writer lost before
        # its report): the others finish again in an epoch of their own, a live replica 0
        # writing it, whatever the minimum (no step is left to train; found in review: a
        # lost node left fewer than --min-workers, and a finished task failed or waited)
        if survivors != b.members or lay != b.layout:
            announce(b, survivors, urgent=True, now=now, reason=reason, lay=lay)
        return True
    # slots that can come back: usable ones, excluded ones a health probe may readmit (none
    # if probes are turned off, nor where the script itself failed every time), and those
    # of lost nodes only where nodes return (a cluster)
    probing = math.isfinite(b.settings.readmit_after_s)
    returns = b.settings.nodes_return
    recoverable = [
        s
        for s, o in b.slots.items()
        if not o.excluded
        or (o.node in b.lost_nodes and returns)
        or (probing and o.node not in b.lost_nodes and not o.broken_script)
    ]
    minimum = b.settings.min_workers
    spare = b.spare_slots if returns else 0  # a cluster's planner may give other slots
    why = ""
    if b.state is TaskState.PENDING and len(usable) < minimum:
        # never started (e.g. a script that cannot even import): nothing to wait for
        why = (
            f"{len(usable)} usable slot(s) left, fewer than the minimum of "
            f"{minimum}, before the task started"
        )
    elif len(recoverable) + spare < minimum:
        why = (
            f"{len(recoverable)} slot(s) left that can be used again"
            + (f" and {spare} the cluster could give" if spare else "")
            + f", fewer than the minimum of {minimum}"
        )
    elif b.active() and not b.state_held() and not b.has_checkpoint():
        why = "every replica holding the model state is gone (no checkpoint to fall back on)"
    if why:
        fail(b, f"{why}; last error: {b.last_error}", now)
        return False
    b.confirm_entered()  # the state held, maybe by joiners alone: they hold it from now on
    if survivors == b.members and lay == b.layout and len(usable) >= minimum:
        return True
    if len(survivors) < minimum:
        for slot in replicas.orphans(b.slots, b.members, survivors):
            b.forget(slot)
        b.members = survivors  # no epoch below the minimum: wait for capacity
        if len(usable) >= minimum:
            then = "waiting for restarted workers"
        elif len(recoverable) >= minimum:
            then = (
                f"{len(usable)} usable slot(s): waiting for excluded slots or nodes to pass "
                "their health probe or return"
            )
        else:
            then = f"{len(recoverable)} slot(s) of its own: waiting for the cluster to give more"
        live = len(survivors)
        wait(b, now, f"{live} live worker(s), fewer than the minimum of {minimum}; {then}")
        return True
    if survivors != b.members or lay != b.layout:
        announce(b, survivors, urgent=True, now=now, reason=reason, lay=lay)
    return True


def wait(b: TaskBook, now: float, reason: str) -> None:
    """Below the minimum: WAITING (an ``action`` event says why), until capacity is back
    or the give-up deadline passes."""
    if b.state is TaskState.WAITING and reason == b.waiting_reason:
        return
    if b.state is not TaskState.WAITING:
        b.waiting_since = now
    b.state, b.waiting_reason = TaskState.WAITING, reason
    log.warning("task %s waiting: %s", b.task, reason)
    b.emit(
        "action",
        ts=now,
        task=b.label,
        epoch=b.epoch,
        action="wait",
        severity=1,
        reason=f"{reason} (giving up after {b.settings.give_up_after_s:g} s)",
    )


def running(b: TaskBook, now: float) -> None:
    """Capacity is back: WAITING ends."""
    if b.state is TaskState.WAITING:
        assert b.waiting_since is not None
        log.warning("task %s: capacity back after %.1f s", b.task, now - b.waiting_since)
        b.state, b.waiting_since, b.waiting_reason = TaskState.RUNNING, None, ""


def check_give_up(b: TaskBook, now: float) -> None:
    """Fail a task that waited for capacity past its give-up deadline."""
    assert b.waiting_since is not None
    if now - b.waiting_since > b.settings.give_up_after_s:
        fail(
            b,
            f"gave up after waiting {now - b.waiting_since:.0f} s for capacity "
            f"(give-up deadline {b.settings.give_up_after_s:g} s): {b.waiting_reason}; "
            f"last error: {b.last_error}",
            now,
        )


def store_moved(b: TaskBook, now: float, why: str, *, lost: bool = True) -> None:
    """The task's store was lost and a new one serves (``why``): write there what the workers
    read (the task trained or over), and announce the members again, in a new epoch, urgent
    (each member left its epoch when the store stopped answering; nothing of the old store
    is known to the new one, and the ledger exchange settles a step whose commit vote the
    store took with it: :func:`unicron.runtime.transition.sync`). ``lost=False``: the same
    store serves, only a request of this coordinator failed (what it wrote may be missing)."""
    what = "the training store was lost" if lost else "a request to the training store failed"
    if lost:
        b.moved_at = now  # the workers must find the new store (health.REJOIN_GRACE_S)
    b.emit("control_plane", ts=now, task=b.label, what=f"{what}: {why}", epoch=b.epoch)
    if b.trained:
        b.effects.append(WriteStoreKey(trained_key(b.task), "1"))
    if b.state_bytes:
        b.effects.append(WriteStoreKey(state_bytes_key(b.task), str(b.state_bytes)))
    if b.over():
        b.effects.append(WriteStoreKey(done_key(b.task), b.state.value))
    elif b.members:
        reason = "the training store moved" if lost else "a store request failed"
        announce(b, b.members, urgent=True, now=now, reason=reason)


def announce(
    b: TaskBook,
    members: tuple[int, ...],
    *,
    urgent: bool,
    now: float,
    reason: str,
    lay: tuple[int, int] | None = None,
) -> None:
    """A new epoch of ``members`` (none: nobody to tell; the next epoch is made of the workers
    that come back), at layout ``lay`` (:func:`layout`; ``None``: the current one).
    Its joins are timed here, so an adopted epoch's watch ends (``adopted_at``)."""
    b.adopted_at = None
    for slot in replicas.orphans(b.slots, b.members, members):
        b.forget(slot)  # waits outside the epoch: its last step is no hang
    joined = not set(members) <= set(b.members)  # a newcomer: every member's next step waits
    b.members = members
    rebuilt = lay is not None and bool(members) and lay != b.layout
    if rebuilt:  # another layout's files (same names, other shards) are written again
        b.final_written.clear()
    if lay is not None and members:
        b.layout = lay
    if not members:
        return
    b.epoch += 1
    b.epoch_layouts[b.epoch], b.epoch_members[b.epoch] = b.layout, members
    if b.monitor is not None:  # membership changed: step times may too (a new layout: cold)
        b.monitor.reset_expectation(rebuilt=rebuilt, joined=joined)
    info = EpochInfo(
        b.epoch,
        members,
        tuple(b.slots[m].node for m in members),
        urgent,
        published_ts=now,
        pp=b.layout[1],
        tp=b.layout[0],
    )
    b.emit(
        "plan",
        ts=now,
        task=b.label,
        epoch=b.epoch,
        allocation={b.label: len(members)},
        reason=reason,
    )
    b.effects.append(AnnounceEpoch(b.task, info))
    b.emit(
        "epoch_begin",
        ts=now,
        task=b.label,
        epoch=b.epoch,
        members=list(members),
        urgent=urgent,
        reason=reason,
        **(dict(zip(("tp", "pp"), b.lay, strict=True)) if b.settings.layouts else {}),
    )
