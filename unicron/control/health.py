"""Health: what the workers' reports and the passing of time say about them and their nodes.

Judges over a task's :class:`~unicron.control.book.TaskBook`, called by its
:class:`~unicron.control.coordinator.Coordinator` under its lock: the reports that feed the
detectors (:func:`epoch_entered`, :func:`step_started`, :func:`step_computed`, an agent's
:func:`heartbeat`), and on every tick the checks that find a fault: silent nodes
(:func:`check_heartbeats`), hangs and stragglers from the step monitor
(:func:`check_monitor`, :mod:`unicron.detect.monitor`, with the evidence of peers and CPU
time, :mod:`unicron.detect.busy`), stalls outside a step (:func:`check_stalls`,
:mod:`unicron.detect.stall`). A fault found here is written as an ``error_detected`` event and
handed to :mod:`~unicron.control.failures`, which asks the escalation what to do; a hang or a
stall that needs no policy is killed here (its exit comes back as a failure). It also sets the
exchange rhythm (:func:`next_exchange_s`, :func:`judge_now`).
"""

from __future__ import annotations

import logging

from unicron.control import failures, membership
from unicron.control.book import TaskBook, TaskState
from unicron.control.effects import WriteStoreKey
from unicron.detect.busy import Cpu, Sample, own_compute_s
from unicron.detect.classify import classify_detector
from unicron.detect.stall import Phase, Progress, find_stall, stall_deadline_s
from unicron.protocol import state_bytes_key

log = logging.getLogger("unicron.control.coordinator")

FAST_EXCHANGE_S = 0.05
"""the rhythm asked of a node the coordinator waits on (:func:`next_exchange_s`); the slow
rhythm is half of ``suspect_after_s``, so a healthy idle node is never suspect"""

REJOIN_GRACE_S = 10.0
"""how much longer the members that hold a task's state may take to join an epoch whose
other members hold none, in the moments after the training store moved or a coordinator
took over the task: a member waits out its store request's bound (3 s,
``runtime/bounded.py``) and asks its agent where the store serves now, and the agent may
first have to find the new coordinator (1 s to connect and 3 s to answer for each address
that stays silent). Without it a joiner spawned with the new address waited 5 s for the
members that held the state, and the stall detector killed them all (the cluster soak)"""

LATE_HALF_LIFE_S = 30.0
"""a node's lateness (:func:`lateness`) halves every this many seconds: a starved spell widens
its silence allowance for about a minute"""

LONE_HANG_OVERRUN = 2.0
"""a step past its hang allowance is confirmed hung when every other member finished it;
with only some of them done, or alone in its epoch (no peer to vouch; killing costs a
checkpoint reload), once it has lasted this many times its allowance"""
FINISH_WRITES = 3
"""State writes a member may make between the last commit and its done report: the background
checkpoint it waits for, the one that write waited for, and (replica 0) the final files"""
LAST_COPY_HANG_OVERRUN = 6.0
"""... and the last live copy of the task's state, with no checkpoint, whose CPU time gives
no verdict (:func:`check_suspect`): killing it fails the task. A stall of such a member
outside a step is given as many stall deadlines (:func:`check_stalls`)"""
STARVED_STALL_OVERRUN = LAST_COPY_HANG_OVERRUN
"""a member its peers wait for outside a step whose CPU readings showed it starved in this
wait (its thread runnable, waiting for a CPU: :func:`unicron.detect.busy.waiting`), and not
blocked since, is given this many stall deadlines from that first reading before it counts
as stalled"""


# -- reports -------------------------------------------------------------------------------
def heartbeat(b: TaskBook, node: int, now: float, read_until: float | None) -> None:
    """The agent of ``node`` is alive, and every report its workers sent before
    ``read_until`` has been handed over: the detectors judge that node's workers at that
    moment, never on reports still in flight. An agent back later than the rhythm this
    coordinator asked of it (:attr:`TaskBook.asked_s`) was starved or slowed on its way: that
    lateness is kept (:func:`lateness`) and its next silence given as much more."""
    last, asked = b.heartbeats.get(node), b.asked_s.get(node)
    if last is not None and asked is not None and now - last - asked > lateness(b, node, now):
        b.lateness[node] = (min(now - last - asked, b.settings.heartbeat_timeout_s), now)
    b.heartbeats[node] = now
    b.read_until[node] = now if read_until is None else read_until


def lateness(b: TaskBook, node: int, now: float) -> float:
    """How much later than asked the agent of ``node`` has come back lately: the largest
    overdue time of its arrivals (at most the heartbeat timeout), each halved every
    :data:`LATE_HALF_LIFE_S` since (0: never late, or a new agent)."""
    late, at = b.lateness.get(node, (0.0, now))
    return late * 0.5 ** (max(now - at, 0.0) / LATE_HALF_LIFE_S)


def silence_allowed_s(b: TaskBook, node: int, now: float) -> float:
    """How long ``node`` may be silent before it is lost (:func:`check_heartbeats`): the
    heartbeat timeout, plus its agent's recent :func:`lateness` (so at most twice the
    timeout). A host starved of CPU delays a round trip of its agent's thread by seconds at
    times (beside CPU burners, where `unicron run`'s agents share the coordinator's process, a
    2.1 s silence failed a task that had no checkpoint; `bench/results/loaded-history.md`,
    stop 67); a node that kept its rhythm keeps the plain timeout. So does every node while an
    in-band error waits out its grace: the grace (``error_grace_s``) is longer than the
    timeout so that a node lost behind that error is found before it is reattempted."""
    timeout = b.settings.heartbeat_timeout_s
    if b.slots.pending_errors():
        return timeout
    return timeout + lateness(b, node, now)


def worker_ready(b: TaskBook, slot: int, microbatches: int | None, state_bytes: int) -> None:
    """The worker in ``slot`` built its model and waits for an epoch: a model of its own,
    not the task's state once a step committed (a takeover presumes the state in every slot
    until a census or this says otherwise)."""
    o = b.slots[slot]
    o.readied()
    # in no epoch yet: no commit up to this one is its (one announced with it already, after a
    # takeover's census said it was ready, is its first)
    o.born = max(o.born, b.epoch - 1 if slot in b.members else b.epoch)
    if b.trained:
        o.has_state = False
    b.microbatches = microbatches or b.microbatches
    if state_bytes > b.state_bytes:  # kept on the store for a coordinator that takes over
        b.state_bytes = state_bytes
        b.effects.append(WriteStoreKey(state_bytes_key(b.task), str(state_bytes)))


def epoch_entered(b: TaskBook, slot: int, epoch: int, now: float) -> None:
    """The worker in ``slot`` enters ``epoch`` (rendezvous, ledger exchange, state): its state
    moves to the epoch's layout, done by its first step there (:func:`step_started`). A late
    report of its previous worker (an epoch no later than this one's start) is dropped. A
    holder's shard, at the layout it holds it in, is a source of the epoch's hand-over
    (:attr:`TaskBook.sources`)."""
    o = b.slots[slot]
    if not o.predates(epoch):
        return
    if epoch == b.epoch and o.has_state and o.killed_at is None:
        b.sources = {epoch: b.sources.get(epoch, set()) | b.shards(slot)}
    o.progress = Progress(epoch, Phase.JOIN, -1, now)
    b.cpu.entered(slot)
    o.entering_lay = b.epoch_layouts.get(epoch)
    if o.done is not None and int(o.done.get("epoch", -1)) < epoch:
        o.done = None  # a finished worker serves a newer epoch: it reports again from there


def step_started(
    b: TaskBook, slot: int, step: int, now: float, epoch: int | None, cpu_s: float | None
) -> None:
    """The worker in ``slot`` began computing ``step``: the monitor's clock starts, and it
    holds the state (a joiner's was handed over in its epoch's entry: before, only its
    ``StepComputed`` said so, and a holder's crash in between failed the task as if the state
    were gone). A late report of an older epoch from a worker left out of the current one (it
    waits for its replica: :func:`~unicron.control.membership.announce` forgot its step)
    starts nothing: its step ended with that epoch, and timing it would find a waiting rank
    hung. A report of an epoch no later than the one its worker was started in (:attr:`Slot.
    born`) is its previous worker's, held by the agent while the crash went at once: it says
    nothing of the new worker (found beside CPU burners: a dead worker's late ``StepBegan``
    made its fresh successor a holder, the last real holders were restarted for their own
    errors, and the task failed one restart later on its successors' "no member holds the
    model state" instead of the user's error)."""
    o = b.slots[slot]
    if epoch is not None and (not o.predates(epoch) or (epoch < b.epoch and slot not in b.members)):
        return
    known = o.progress
    ep = epoch if epoch is not None else (known.epoch if known else b.epoch)
    o.progress = Progress(ep, Phase.COMPUTE, step, now)
    o.has_state = True  # a step begins once the state is synced (a joiner: handed over)
    if ep in b.epoch_layouts:  # ... at the epoch's layout
        o.state_lay, o.entering_lay = b.epoch_layouts[ep], None
    b.cpu.began(slot, step, None if cpu_s is None else Sample(now, cpu_s))
    if b.monitor is not None:
        b.monitor.step_started(slot, step, now)


def waiting_on_replica(
    b: TaskBook, slot: int, step: int, epoch: int, waiting: bool, now: float
) -> None:
    """The worker in ``slot`` waits (or no longer waits) on its replica's other ranks inside
    ``step``: while it waits it is in a collective (``REDUCE``, as a member waiting for its
    peers), so a hang of the rank it waits for is that rank's alone (its peers' evidence,
    :func:`check_suspect`), never its own; then it computes again."""
    o = b.slots[slot]
    p = o.progress
    if (
        p is None
        or p.epoch != epoch
        or p.step != step
        or p.phase
        not in (
            Phase.COMPUTE,
            Phase.REDUCE,
        )
    ):
        return  # a late report of an older step or epoch
    if waiting and p.phase is Phase.COMPUTE:
        o.progress = Progress(epoch, Phase.REDUCE, step, now)
    elif not waiting and p.phase is Phase.REDUCE and o.computed != step:
        o.progress = Progress(epoch, Phase.COMPUTE, step, p.since)


def step_computed(
    b: TaskBook,
    slot: int,
    step: int,
    now: float,
    *,
    compute_s: float,
    microbatches: int | None,
    cpu_s: float | None,
    queued_s: float | None,
    epoch: int | None = None,
) -> None:
    """The worker in ``slot`` finished computing ``step`` (it now reduces): it holds the
    state; the monitor learns the step time, without ``queued_s`` (the part its thread waited
    for a CPU: an oversubscribed machine's run queue is not the worker's speed). A report of
    an epoch no later than the one its worker was started in is its previous worker's, as in
    :func:`step_started`: it says nothing of the new one."""
    s = b.slots[slot]
    if epoch is not None and not s.predates(epoch):
        return
    ep = _epoch_of(b, slot)
    s.computed, s.computed_epoch = step, ep
    cost = b.cpu.computed(slot, step, cpu_s)
    s.has_state, s.fresh = True, False
    s.progress = Progress(ep, Phase.REDUCE, step, now)
    own_s = own_compute_s(compute_s, queued_s)
    if microbatches:
        s.mb_compute_s = own_s / microbatches
    if b.monitor is not None:
        b.monitor.step_finished(slot, step, own_s, now, microbatches=microbatches, cpu_s=cost)
    b.escalation.healthy(slot=slot, now=now)


# -- the exchange rhythm (docs/cluster.md, The rhythm) ---------------------------------------
def judge_now(b: TaskBook, node: int, now: float) -> bool:
    """Whether an exchange of ``node`` runs the detectors itself instead of leaving them to
    the ticker: when a worker of the node is past its hang deadline as far as its reports go,
    while a hang is suspected and waits on evidence, and while an in-band error waits out its
    grace period. Most exchanges judge nothing: the detectors' cost is the ticker's."""
    if not b.active():
        return False
    if b.slots.suspects() or b.slots.pending_errors():
        return True
    if b.monitor is None:
        return False
    at = min(now, b.read_until.get(node, now))
    return any(o.node == node and b.monitor.due(s, at) for s, o in b.slots.items())


def next_exchange_s(b: TaskBook, node: int, now: float) -> float:
    """How soon the agent of ``node`` should come back with nothing to report: slow
    (``suspect_after_s / 2``) while nothing is due; fast (:data:`FAST_EXCHANGE_S`) while a
    detector or an action waits on fresh reports (an in-band error in its grace period, a
    suspected hang, a slow step not yet judged a straggler, an epoch not every member entered
    yet, a leaver not yet stopped); timed to the hang deadline of a worker of the node
    computing a step, so a hang is judged there (as of the agent's last read)."""
    idle = b.settings.suspect_after_s / 2
    if not b.active():
        return idle
    if b.slots.pending_errors() or b.slots.suspects() or membership.in_transition(b):
        return FAST_EXCHANGE_S
    if b.monitor is not None and b.monitor.slow_suspected():
        return FAST_EXCHANGE_S  # the next step reports say whether it is a straggler
    wait = idle
    if b.monitor is not None:
        read = b.read_until.get(node, now)  # the agent's clock, as the deadlines
        for slot, o in b.slots.items():
            deadline = b.monitor.hang_deadline(slot) if o.node == node else None
            if deadline is not None and deadline > read:
                wait = min(wait, deadline - read)
    return max(wait, FAST_EXCHANGE_S)


# -- silent nodes --------------------------------------------------------------------------
def check_heartbeats(b: TaskBook, now: float) -> None:
    """A node silent past its allowance (:func:`silence_allowed_s`: the heartbeat timeout, more
    for a node late lately) is lost, and so is a suspect one (silent past
    ``suspect_after_s``) once a living worker reported a failed collective since it was last
    heard: :func:`unicron.control.failures.node_lost` decides what follows. The failed
    collective must be of the current epoch and half the suspect delay old (the slow
    exchange rhythm): a failure that explains it (a crash elsewhere, reported at once, which
    announces an epoch) has come in by then (found in review: a crash's peer reported its
    failed collective 30 ms before the crash itself, and a healthy node 0.55 s late beside
    CPU burners was declared lost for it). A coordinator that
    did not run for a while itself judges nobody on that tick, and for a heartbeat timeout
    after an adoption (agents still finding the new coordinator, a new store perhaps, while
    their workers report the failed collectives of the takeover) the full timeout alone
    judges."""
    stalled = b.last_tick is not None and now - b.last_tick > b.settings.suspect_after_s
    b.last_tick = now
    if stalled:  # this process itself did not run for a while: every agent looks silent
        for node in b.heartbeats:
            b.heartbeats[node] = max(b.heartbeats[node], now)
        return
    aged = now - b.settings.suspect_after_s / 2
    symptoms = [
        e.ts
        for s in b.slots.values()
        if (e := s.pending_error) is not None and e.epoch >= b.epoch and e.ts <= aged
    ]
    for node, last in list(b.heartbeats.items()):  # node_lost may forget one
        silent = now - last
        suspect_confirmed = (
            now >= b.suspects_from
            and silent > b.settings.suspect_after_s
            and any(ts > last for ts in symptoms)
        )
        past = silent > b.settings.heartbeat_timeout_s  # the allowance only then: never less
        if node in b.lost_nodes or not (
            (past and silent > silence_allowed_s(b, node, now)) or suspect_confirmed
        ):
            continue
        failures.node_lost(b, node, silent, now, suspect_confirmed=suspect_confirmed)


# -- hangs and stragglers ------------------------------------------------------------------
def check_monitor(b: TaskBook, now: float) -> None:
    """Act on the step monitor's verdicts. A step past its hang deadline is a hang only once
    every other member has finished computing that step: when several members are late
    together the machine is slow (or a collective is stuck). With only some peers done, or
    alone in its epoch, the step must have lasted :data:`LONE_HANG_OVERRUN` times its
    allowance (:func:`check_suspect`). A slow step goes to the straggler policy."""
    if b.monitor is None:
        return
    for slot in b.slots.suspects():
        check_suspect(b, slot, now)
    for d in b.monitor.check(now, b.known_until(now)):
        o = b.slots.get(d.worker)
        if o is None or not o.alive:
            continue
        verdict = classify_detector(d.kind)
        if d.kind == "hang":
            o.suspected(d.step, verdict, d.reason)
            check_suspect(b, d.worker, now)
            continue
        b.detected(d.worker, d.step, verdict, now, "monitor", reason=d.reason)
        failures.worker_slow(b, d.worker, verdict, now)


def check_suspect(b: TaskBook, slot: int, now: float) -> None:
    """Kill a suspected hang once the evidence is in (or forget it: it moved on, or left)."""
    o = b.slots[slot]
    assert o.suspect is not None
    step, verdict, reason = o.suspect.step, o.suspect.verdict, o.suspect.reason
    p = o.progress
    if not o.alive or p is None or p.phase is not Phase.COMPUTE or p.step != step:
        o.suspect = None  # it moved on, or it is gone
        return
    # the evidence: every peer finished the step (a starved machine slows several workers
    # at once, a hang one); or one did and the step has lasted twice its allowance (two
    # hangs at once) or its CPU time stood still; or, alone in the epoch, the step has
    # lasted twice its allowance. A worker whose CPU time advances is starved: left to run
    at = b.known_until(now)[slot]
    allowances = _overrun(b, slot, at)
    overrun = allowances >= LONE_HANG_OVERRUN
    assert b.monitor is not None
    cpu, why = b.cpu.judge(slot, step, factor=b.monitor.settings.hang_factor, now=now)
    # held, and judged again next tick: a worker starved on a loaded machine (WORKING); or
    # one whose CPU readings the agents send, only not this step's yet (a loaded machine
    # starves the agent too): without that evidence the wall clock alone decides, at the
    # larger overrun
    late = cpu is Cpu.UNKNOWN and b.cpu.sampling and not overrun
    if cpu is Cpu.WORKING or late:
        if o.held != step:
            o.held = step
            log.info("task %s: slot %d past its hang allowance: %s", b.label, slot, why)
        return
    # its CPU time standing still is what several late peers would otherwise have to show
    idle = cpu is Cpu.IDLE
    peer = peers_all_ahead(b, slot, step) or ((overrun or idle) and peer_ahead(b, slot, step))
    lone = not peer and overrun and alone(b, slot)
    if not (peer or lone):
        return
    last = allowances >= LAST_COPY_HANG_OVERRUN
    killing = bool(b.slots.kills_under_way(now) - {slot})
    evident = idle or lone or last
    if (killing or (b.cpu.sampling and not evident)) and not b.state_survives(slot):
        # the last live copy of the state, and no checkpoint: killing it fails the task, so
        # never while another worker's kill is under way (its exit ends the collectives this
        # one may wait in), and where the agents read CPU time only its standing still
        # condemns it, or a far larger overrun (its other threads may queue for ever: a left
        # epoch's gloo loop); held, and judged again every tick. Found beside CPU
        # burners: a ZeRO rank, main thread still while its other threads queued for a CPU,
        # killed at 2x while its buddy's kill was under way; and two ranks stuck six
        # allowances, both killed in one tick: a share lost, the task failed, each time
        if o.held != step:
            o.held = step
            log.warning("task %s: slot %d past its hang allowance, not killed: the last "
                        "copy of the state, and %s", b.label, slot, why)  # fmt: skip
        return
    if not (idle or overrun) and not b.other_holders(slot):
        # the last live copy of its state (model parallel: of its shard): killed only on
        # the evidence that would kill it alone (its CPU idle, or twice the allowance); a
        # worker merely slow finishes, where killing it would send the task to its
        # checkpoint (the cluster soak: a 4x-slow rank killed beside its hung peer)
        return
    if cpu is not Cpu.UNKNOWN:
        reason += f"; {why}"
    o.suspect = None
    # alone, and the task's only copy of its state: if it is merely slow it may still
    # finish, so it is reported and left running
    spare = lone and not b.state_survives(slot)
    if lone:
        reason += f"; alone in its epoch: confirmed at {LONE_HANG_OVERRUN:g}x the allowance"
    if spare:
        reason += "; not killed: no other replica and no checkpoint hold the state"
        log.warning("slot %d: %s", slot, reason)
    b.detected(slot, step, verdict, now, "monitor", reason=reason)
    if not spare:
        b.kill(slot, verdict, now)


def _overrun(b: TaskBook, slot: int, at: float) -> float:
    """How many hang allowances the current step of ``slot`` has lasted at ``at``."""
    assert b.monitor is not None
    overrun = b.monitor.overrun(slot, at)
    return 0.0 if overrun is None else overrun


def peer_ahead(b: TaskBook, slot: int, step: int) -> bool:
    """Whether another member of the current epoch finished computing ``step`` in the epoch
    ``slot`` computes it in: the evidence that ``slot``, still in that step past its
    deadline, hangs alone. (A step finished in an earlier epoch says nothing of its retry in
    a later one: under load a member waiting on the new epoch's first collective was killed
    on such stale evidence.)"""
    epoch = _epoch_of(b, slot)
    return any(m != slot and b.slots.computed_of(m, epoch) >= step for m in b.members)


def peers_all_ahead(b: TaskBook, slot: int, step: int) -> bool:
    """Whether every other member of the current epoch that can vouch for ``slot``
    (:func:`vouchers`) finished computing ``step`` in the epoch ``slot`` computes it in."""
    others, epoch = vouchers(b, slot), _epoch_of(b, slot)
    return bool(others) and all(b.slots.computed_of(m, epoch) >= step for m in others)


def _epoch_of(b: TaskBook, slot: int) -> int:
    """The epoch ``slot`` last said it computes in (the task's, before it said anything)."""
    p = b.slots.progress_of(slot)
    return b.epoch if p is None else p.epoch


def alone(b: TaskBook, slot: int) -> bool:
    """Whether no other member of the current epoch can vouch that the step of ``slot``
    hangs rather than the machine being slow (:func:`vouchers`)."""
    return not vouchers(b, slot)


def vouchers(b: TaskBook, slot: int) -> list[int]:
    """The other members of the current epoch that compute alongside ``slot``: each has
    finished a step since it (re)started, or is computing one. A worker that joined the
    epoch while ``slot`` was in its step and has computed nothing waits in the rendezvous
    for ``slot`` itself: it says nothing about the machine's speed."""
    return [
        m
        for m in b.members
        if m != slot
        and (
            b.slots.computed_of(m) >= 0
            or ((p := b.slots.progress_of(m)) is not None and p.phase is Phase.COMPUTE)
        )
    ]


# -- stalls outside a step -----------------------------------------------------------------
def stall_deadline(b: TaskBook) -> float:
    """How long a member may wait on its peers outside a step (:mod:`unicron.detect.stall`):
    an adopted task is warm at once (its logged pace), not cold for ``stall_cold_s``."""
    s = b.settings
    pace = b.monitor.pace_s() if b.monitor is not None else None
    pace = b.logged_pace_s if pace is None else pace
    return stall_deadline_s(
        pace_s=pace,
        state_bytes=b.state_bytes,
        factor=s.stall_factor,
        floor_s=s.stall_floor_s,
        cold_s=s.stall_cold_s,
        transfer_bytes_per_s=s.stall_transfer_bytes_per_s,
    )


def _finding_the_store(
    b: TaskBook, behind: tuple[int, ...], waited_s: float, deadline_s: float, now: float
) -> bool:
    """Whether the members ``behind`` (the task's only holders of its state, waited for by
    members that hold none) may still be finding the store that moved, or the coordinator
    that took over, a moment ago: :data:`REJOIN_GRACE_S` more before they count as stalled.
    Killing them would send the task to its checkpoint."""
    if b.moved_at is None or now - b.moved_at >= deadline_s + REJOIN_GRACE_S:
        return False
    if waited_s >= deadline_s + REJOIN_GRACE_S:
        return False
    held = {m for m in b.members if m in b.slots and b.slots[m].has_state}
    return bool(held) and held <= set(behind)


def check_stalls(b: TaskBook, now: float) -> None:
    """A transition or reduce that never ends: kill the members the others wait for (a hang
    outside a step), or, when the collective itself is stuck, let the escalation decide
    (:func:`unicron.control.failures.collective_stuck`). An adopted epoch in which nothing
    committed for a stall deadline past the agents' return is announced again: a member that
    stopped mid-step before the takeover has no clock here (its partners said they wait to
    the old coordinator), and joining a new epoch is what it cannot do (found by the cluster
    soak: a stopped tensor-parallel rank went unnoticed for two minutes)."""
    if b.state is not TaskState.RUNNING or not b.members:
        return
    if _finishing(b):
        _check_finish(b, now)
        return
    deadline = stall_deadline(b)
    if b.adopted_at is not None and now - b.adopted_at > deadline + b.settings.heartbeat_timeout_s:
        b.adopted_at = None
        reason = "no step committed since the takeover"
        membership.announce(b, b.members, urgent=True, now=now, reason=reason)
        return
    known = b.known_until(now)
    stall = find_stall(
        epoch=b.epoch,
        members=b.members,
        progress=b.slots.progress(),
        now=min(known[m] for m in b.members),
        deadline_s=deadline,
    )
    if stall is None or _finding_the_store(b, stall.behind, stall.waited_s, deadline, now):
        return
    if stall.stuck:
        failures.collective_stuck(b, stall.reason, now)
        for m in b.members:  # judged once: their clocks restart with the new epoch
            if m in b.slots:
                b.slots[m].progress = None
        return
    if b.slots.kills_under_way(now) - set(stall.behind):
        return  # another worker's kill is under way: its exit may end this wait (next tick)
    last = [s for s in stall.behind if b.slots[s].alive and not b.state_survives(s)]
    if last and stall.waited_s < LAST_COPY_HANG_OVERRUN * deadline:
        # the last live copies of (part of) the state, and no checkpoint: killing them fails
        # the task, where a member merely slow joins late; held, and judged again every
        # tick, up to as many deadlines as a last copy's hang is given. Found beside CPU
        # burners: a ZeRO member, its shares' buddy restarted a moment before, slow to join
        # on a machine whose store answered late, killed at the deadline: a share lost
        for s in last:
            if b.slots[s].spared != b.epoch:
                b.slots[s].spared = b.epoch
                log.warning("task %s: %s; slot %d not killed yet: the last copy of the "
                            "state, and no checkpoint", b.label, stall.reason, s)  # fmt: skip
        return
    # waiting for a CPU, not stuck: held, and judged again every tick. Found beside CPU
    # burners: a ZeRO member just restarted, through its step's vote but not heard from in
    # the next step for 12 s (its threads runnable, 61 ms of CPU in that time), killed at the
    # deadline as "stuck in an earlier phase"
    behind = tuple(s for s in stall.behind if not _starved(b, s, stall.reason, deadline, now))
    if not behind:
        return
    verdict = classify_detector("stall")
    for slot in behind:
        o = b.slots[slot]
        if not o.alive:
            continue
        p = o.progress
        b.detected(slot, p.step if p else None, verdict, now, "stall", reason=stall.reason)
        o.progress, o.starved = None, None
        b.kill(slot, verdict, now)
    for m in b.members:  # the waiters' clocks restart: judged once per stall
        p = b.slots.progress_of(m)
        if p is not None and p.epoch == b.epoch and m not in stall.behind:
            b.slots[m].progress = Progress(p.epoch, p.phase, p.step, now)


def _starved(b: TaskBook, slot: int, reason: str, deadline: float, now: float) -> bool:
    """Whether ``slot``, waited for outside a step, is starved rather than stalled: its CPU
    readings showed it waiting for a CPU in this wait (since its last report), none has shown
    it blocked since (fresh readings come and go on a loaded machine, the agent starved too,
    and a starved thread gets a slice now and then), and the first of them came less than
    :data:`STARVED_STALL_OVERRUN` deadlines ago. The first evidence of a wait is logged. (The
    wait is told by its progress's time, compared for equality only: the coordinator's clock
    times the hold.)"""
    o = b.slots[slot]
    if not o.alive:
        return False
    cpu, why = b.cpu.waiting(slot, now)
    wait = o.progress.since if o.progress is not None else None
    if o.starved is not None and o.starved[0] != wait:
        o.starved = None  # evidence of an earlier wait
    if cpu is Cpu.IDLE or b.cpu.read_at(slot) is None:
        o.starved = None
        return False
    if cpu is Cpu.WORKING and o.starved is None:
        o.starved = (wait, now)
        log.warning("task %s: %s; slot %d not killed yet: %s", b.label, reason, slot, why)
    return o.starved is not None and now - o.starved[1] < STARVED_STALL_OVERRUN * deadline


def finish_deadline(b: TaskBook) -> float:
    """How long after the first member's done report of an epoch its peers may take to report
    theirs: a first epoch's stall allowance (``stall_cold_s``) and :data:`FINISH_WRITES`
    writes of the state at the conservative rate. A writer of the final files (replica 0)
    is given :data:`LAST_COPY_HANG_OVERRUN` times as long (:func:`_check_finish`)."""
    s = b.settings
    return s.stall_cold_s + FINISH_WRITES * b.state_bytes / s.stall_transfer_bytes_per_s


def _check_finish(b: TaskBook, now: float) -> None:
    """The last step is committed and a member reported done in the current epoch: the
    others write their final files and report too. A live member that has not within
    :func:`finish_deadline` of the first report is hung after the end (a final write that
    never returns, a script stuck past its loop): it is killed, and its loss ends the task
    (:func:`unicron.control.membership.conclude_if_done`) or, where it was to write a final
    file, forms an epoch whose replica 0 writes it. Before, such a task never ended. A
    writer of the final files (it may be writing a large state to slow storage: found in
    review) and the last live copy of (part of) the state are given as many deadlines as a
    last copy in a stall."""
    known = b.known_until(now)
    done = _done_in_epoch(b)
    waited = min(known[m] for m in b.members) - min(done.values())
    deadline = finish_deadline(b)
    if waited <= deadline or b.slots.kills_under_way(now):
        return
    late = [m for m in b.members if m not in done and b.slots[m].alive]
    writers = set(b.members[: b.size])  # replica 0: epoch ranks below its size
    for slot in late:
        held = slot in writers or not b.state_survives(slot)
        if held and waited < LAST_COPY_HANG_OVERRUN * deadline:
            continue
        verdict = classify_detector("stall")
        reason = (
            f"slot {slot}: no done report {waited:.0f} s after its first peer's (the last "
            f"step committed; bound {deadline:.0f} s)"
        )
        p = b.slots[slot].progress
        b.detected(slot, p.step if p else None, verdict, now, "stall", reason=reason)
        b.kill(slot, verdict, now)


def _done_in_epoch(b: TaskBook) -> dict[int, float]:
    """The members that reported done in the current epoch, and when."""
    out: dict[int, float] = {}
    for m in b.members:
        p = b.slots.progress_of(m)
        if p is not None and p.phase is Phase.DONE and p.epoch == b.epoch:
            out[m] = p.since
    return out


def _finishing(b: TaskBook) -> bool:
    """Whether a member reported done in the current epoch: its peers are past the last
    step's vote too, writing their final files (before, its report ended the task and the
    judges with it; a slow final write must not be killed as a stall: :func:`_check_finish`
    bounds it), or they left the epoch for a newer one (an in-band error: that path heals
    it)."""
    return bool(_done_in_epoch(b))


__all__ = [
    "FAST_EXCHANGE_S",
    "LONE_HANG_OVERRUN",
    "REJOIN_GRACE_S",
    "STARVED_STALL_OVERRUN",
    "alone",
    "check_heartbeats",
    "check_monitor",
    "check_stalls",
    "epoch_entered",
    "heartbeat",
    "judge_now",
    "next_exchange_s",
    "peer_ahead",
    "peers_all_ahead",
    "stall_deadline",
    "step_computed",
    "step_started",
]
