"""The worker API: Unicron's step loop, or the user's own.

Two ways in, one implementation. A script that has no loop of its own hands everything over
to :func:`train`, under ``unicron run``::

    result = unicron.worker.train(model=model, optimizer=opt, loss_fn=loss_fn,
                                  dataset=ds, micro_batch_size=4, num_microbatches=8, steps=100)

A script that keeps its loop uses the step API (:class:`Loop`, :class:`Step`;
``docs/loop.md`` shows the diff against a plain PyTorch loop)::

    loop = unicron.worker.Loop(model=model, optimizer=opt, dataset=ds,
                               micro_batch_size=4, num_microbatches=8, steps=100)
    for step in loop:                    # a step of the task, as often as it takes to commit
        for batch in step:               # this replica's micro-batches of it, seeded
            step.backward(loss_fn(model, batch))
        step.commit()                    # reduce, vote, optimizer step; False: epoch changed

:func:`train` is that loop. Behind both: the deterministic micro-batch ledger
(:mod:`unicron.runtime.ledger`) or the user's sampler, a fresh gloo group per epoch
(:mod:`unicron.runtime.group`), local gradient sums per replica kept until the step commits and
reduced exactly in buckets as the backward pass ends (:mod:`unicron.runtime.reduce`),
partial-results reuse and state from the nearest replica when the membership changes. The
user's model code does not change.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from unicron import messages as M
from unicron.detect.busy import read_queued_s
from unicron.errors import UsageError
from unicron.parallel import (
    SCHEDULES,
    PipelineParallel,
    TensorParallel,
    fsdp_parallel,
    pipeline_parallel,
    schedule,
    tensor_parallel,
)
from unicron.protocol import (
    EpochInfo,
    host_port,
    store_answers,
    trained_key,
)
from unicron.runtime import boundary, replica, transition
from unicron.runtime import checkpoint as C
from unicron.runtime import device as D
from unicron.runtime import ledger as L
from unicron.runtime import reduce as R
from unicron.runtime.bounded import BoundedStore
from unicron.runtime.context import (
    WorkerContext,
    check_out,
    default_collate,
    device_for,
    epoch_env,
)
from unicron.runtime.data import Data, LedgerData, SamplerData
from unicron.runtime.gradients import Reducer
from unicron.runtime.group import (
    CollectiveError,
    EpochGroup,
    EpochOver,
    EpochWatch,
    StoreLost,
    store_calls,
)
from unicron.runtime.inject import Fault, FaultPlan, slow_down, stop_self
from unicron.runtime.link import AgentLink, connect_agent
from unicron.runtime.microbatches import MicroBatches, refuse
from unicron.runtime.reshard import Shard
from unicron.runtime.step import Step
from unicron.runtime.transfer import (
    lay_out_optimizer_state,
    lay_out_parameters,
    warm_up,
)
from unicron.runtime.transition import layout_root
from unicron.runtime.zero import Zero

if TYPE_CHECKING:
    from unicron.pipelining import Stage

T = TypeVar("T")
_C = TypeVar("_C")  # what a pipeline's forward pass hands its backward pass
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
Rebuild = Callable[
    [TensorParallel, PipelineParallel], tuple[torch.nn.Module, torch.optim.Optimizer]
]
"""The script's builder of its shard for another layout: given this rank's tensor-parallel
place (unchanged) and a pipeline stage, the model (seeded like the first build: its numbers
are replaced by the task's state) and its optimizer"""

ABANDONED: list[EpochGroup] = []
"""every group this process built, kept until it exits: freeing a gloo group whose abandoned
collective still waits on a dead peer joins its I/O thread, which never returns"""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What :func:`train` returns (and :attr:`Loop.result` holds) on every worker that
    finished the task."""

    steps: int
    final_loss: float
    params_sha256: str
    rank: int
    epoch: int


def device() -> torch.device:
    """This worker's device (``cpu`` or ``cuda:N``), as the agent mapped its slot; the script
    may build its model there (``train`` and ``Loop`` move it there in any case). It stays the
    same in every epoch, unlike ``LOCAL_RANK`` (:func:`epoch_env`)."""
    return D.current()


# -- the step API ------------------------------------------------------------------------------
class Loop:
    """Train with your own loop under ``unicron run``: iterate it for the steps.

    ``dataset[i]`` returns sample ``i``; ``collate`` makes a batch of a list of samples. Each
    step is ``num_microbatches`` micro-batches of ``micro_batch_size`` samples, spread over the
    replicas. The samples come from the ledger's seeded permutation, or from ``sampler`` (any
    ``torch.utils.data.Sampler`` whose order follows ``set_epoch``; its position is committed
    with each step). Rank 0 of the final epoch writes ``out/final.pt``. When the loop ends,
    :attr:`result` holds the outcome (None on a worker still waiting to join when the task
    finished). Bad use raises :class:`UsageError` (``unicron run`` exits 2), before any state
    changes.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        micro_batch_size: int,
        num_microbatches: int,
        steps: int,
        seed: int = 0,
        collate: Callable[[Sequence[Any]], Any] = default_collate,
        sampler: Any = None,
        out: str | Path | None = None,
        rebuild: Rebuild | None = None,
    ) -> None:
        ctx = WorkerContext.from_env("unicron.worker.Loop")
        if steps < 1:
            raise UsageError(f"steps must be >= 1, got {steps}")
        ledger = L.Ledger(
            dataset_len=len(dataset),
            micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches,
            seed=seed,
        )  # ValueError for bad sizes
        data: Data = (
            LedgerData(ledger)
            if sampler is None
            else SamplerData(sampler, num_microbatches, micro_batch_size)
        )
        link = connect_agent()
        self._runner = _Runner(
            ctx=ctx,
            link=link,
            model=model,
            optimizer=optimizer,
            dataset=dataset,
            collate=collate,
            steps=steps,
            out=Path(out) if out else None,
            ledger=ledger,
            data=data,
            seed=seed,
            device=device_for(model, ctx, link),
            rebuild=rebuild,
        )
        self._iterated = False

    @property
    def result(self) -> TrainResult | None:
        return self._runner.result

    @property
    def model(self) -> torch.nn.Module:
        """The model trained now: the one handed in, or after a layout change the shard
        ``rebuild`` built (the loop's body computes with this one)."""
        return self._runner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of :attr:`model`."""
        return self._runner.optimizer

    def __iter__(self) -> Iterator[Step]:
        if self._iterated:
            raise UsageError("a unicron.worker.Loop is iterated once (it is the whole run)")
        self._iterated = True
        return self._runner.attempts()


def train(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None = None,
    dataset: Any,
    micro_batch_size: int,
    num_microbatches: int,
    steps: int,
    seed: int = 0,
    out: str | Path | None = None,
    collate: Callable[[Sequence[Any]], Any] = default_collate,
    sampler: Any = None,
    rebuild: Rebuild | None = None,
    schedule: str = "1f1b",
    stage: Stage | None = None,
) -> TrainResult | None:
    """Train for ``steps`` global steps of ``num_microbatches`` x ``micro_batch_size`` samples:
    the step API's loop (:class:`Loop`) with ``loss_fn(model, batch)``, the mean loss of one
    micro-batch. Returns ``None`` on a worker that was still waiting to join when the task
    finished. ``rebuild`` lets the task change its layout with its worker count
    (:data:`Rebuild`; the task's ``pp_choices``). ``schedule``: a pipeline's order of the
    micro-batches (:func:`unicron.parallel.schedule`): ``"1f1b"`` (the default: the stages
    overlap, a stage holding at most as many micro-batches' activations as there are stages
    from it to the last), ``"gpipe"`` (every forward pass, then every backward pass: the same
    overlap, every micro-batch's activations held until its backward pass) or ``"sequential"``
    (each micro-batch through the stages and back before the next: a stage idle while the
    others compute); the same bits in every order. Without a pipeline the micro-batches go
    one at a time. ``stage``: instead of ``loss_fn``, this slot's pipeline stage as torch's
    ``PipelineStage`` (:class:`unicron.pipelining.Stage`, which holds the loss function),
    computed in ``schedule``'s order."""
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if (loss_fn is None) == (stage is None):
        raise UsageError(
            "train(): give loss_fn(model, batch), or a stage (unicron.pipelining.Stage) "
            "holding its own loss_fn(output, target), not both"
        )
    if stage is not None and rebuild is not None:
        raise UsageError("train(): a stage (torch's PipelineStage) keeps its layout: no rebuild")
    loop = Loop(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        steps=steps,
        seed=seed,
        collate=collate,
        sampler=sampler,
        out=out,
        rebuild=rebuild,
    )
    for step in loop:
        if stage is not None:
            stage.begin(num_microbatches)
            _pipelined(step, schedule, stage.forward, functools.partial(stage.backward, step))
        elif step.stages > 1 and schedule != "sequential":
            assert loss_fn is not None
            _pipelined(step, schedule, functools.partial(loss_fn, loop.model), step.backward)
        else:
            assert loss_fn is not None
            for batch in step:
                step.backward(loss_fn(loop.model, batch))
        step.commit()
    return loop.result


def _pipelined(
    step: Step, kind: str, forward: Callable[[Any], _C], backward: Callable[[_C], None]
) -> None:
    """Compute ``step``'s micro-batches on this pipeline stage in ``kind``'s order
    (:func:`unicron.parallel.schedule`): what each forward pass returns (its loss) kept until
    its backward pass. A broken attempt (a neighbour lost) yields no more batches: the passes
    left are skipped, and the commit says so."""
    batches = step.batches()
    computed: collections.deque[_C] = collections.deque()
    for fwd, _ in schedule(kind, step.todo, step.stage, step.stages):
        if fwd:
            batch = next(batches, None)
            if batch is None:
                break  # the attempt broke
            computed.append(forward(batch))
        else:
            backward(computed.popleft())
    while computed:  # after a break: the first drops the attempt's work here, the rest nothing
        backward(computed.popleft())


def _store_client(ctx: WorkerContext, connect_s: float | None = None) -> dist.Store:
    """A new connection to the coordinator's store (the runner's own, and one for each
    epoch's process group), every key under the task's capability. ``connect_s``: give up
    connecting after that long (else the requests' timeout, ``ctx.timeout_s``)."""
    timeout = datetime.timedelta(seconds=ctx.timeout_s)
    tcp = dist.TCPStore(
        ctx.store_host,
        ctx.store_port,
        is_master=False,
        timeout=timeout if connect_s is None else datetime.timedelta(seconds=connect_s),
    )
    tcp.set_timeout(timeout)
    return dist.PrefixStore(ctx.store_key, tcp) if ctx.store_key else tcp


STORE_RETRY_S = 0.1
"""how often a worker whose store is gone asks its agent where it serves now"""
STORE_PROBE_S = 0.25
"""how long a probe of that address may take (a store answers in a millisecond; a lost
host's silence must not hold the worker while its agent learns the new address)"""


def _find_store(
    ctx: WorkerContext, link: AgentLink, *, ask: bool = True
) -> tuple[WorkerContext, BoundedStore]:
    """The training store stopped answering (:class:`~unicron.runtime.group.StoreLost`):
    ask the agent where it serves now until a connection there answers, and return the
    context with that address and the connection. The cluster starts a lost store again
    within a tick (on the same port where it can), and the agent hears of a new address with
    its node's next heartbeat; until then the old address is tried. Called by
    :meth:`_Runner._leave`; the worker then waits there for the next epoch. ``ask=False``:
    the worker's first connection, at the address it was spawned with before asking the agent
    (found by the cluster soak: a worker restarted just after the store moved, its agent not
    yet told, sat in torch's connect to the dead address for the whole request timeout)."""
    said = time.monotonic()
    while True:
        address = (link.where_store() if ask else "") or f"{ctx.store_host}:{ctx.store_port}"
        ask = True
        host, port = host_port(address)
        moved = dataclasses.replace(ctx, store_host=host, store_port=port)
        try:
            if store_answers(address, STORE_PROBE_S):
                store = BoundedStore(_store_client(moved, connect_s=1.0))
                store.check([trained_key(ctx.task)])
                return moved, store
        except (RuntimeError, ValueError):  # DistNetworkError: gone again
            pass
        if time.monotonic() - said > 10.0:
            print(f"unicron: no training store answers at {address} yet", flush=True)
            said = time.monotonic()
        time.sleep(STORE_RETRY_S)


def _sev3(exc: Exception) -> bool:
    """Whether ``exc`` is a SEV3 error (a reset connection, a transient timeout): retried in
    place, in the same epoch, a bounded number of times, the agent and coordinator told;
    anything else, or a retry that fails again, ends the process (it is restarted)."""
    from unicron.detect.classify import Severity, classify_exception

    return classify_exception(exc).severity is Severity.SEV3


def _reducer(
    ctx: WorkerContext, shard: Shard, m: int, device: torch.device, stray: Callable[[], None]
) -> Reducer:
    """The gradient side of ``shard`` (:meth:`_Runner._adopt`): over its trainable
    parameters, or with ``--fsdp`` over FSDP2's shards (:mod:`unicron.runtime.fsdp`, whose
    state dicts then hold the place's plain shards)."""
    common: dict[str, Any] = dict(exact=ctx.reduce == "exact", bucket_cap_mb=ctx.bucket_cap_mb,
                                  device=device, stray=stray)  # fmt: skip
    if ctx.fsdp == 1:
        return Reducer([p for p in shard.model.parameters() if p.requires_grad], m, **common)
    # torch's FSDP2 and DTensor: imported by the tasks that use them (1.5 s of a start)
    from unicron.runtime.fsdp import FsdpReducer, local_state

    local_state(shard.model, shard.optimizer)
    return FsdpReducer(shard.model, shard.pipe.tp, m, **common)


@dataclass(kw_only=True)
class _Runner:
    """The epoch and step machinery of one worker, driven by :class:`Loop`: epochs, the
    ledger exchange and state transfer, each attempt's micro-batches, the commit."""

    ctx: WorkerContext
    link: AgentLink
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Any
    collate: Callable[[Sequence[Any]], Any]
    steps: int
    out: Path | None
    ledger: L.Ledger
    data: Data
    seed: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0  # committed steps
    has_state: bool = True
    groups: list[EpochGroup] = field(default_factory=list)
    result: TrainResult | None = None
    missing: list[int] = field(default_factory=list)  # ids of `step` nobody living has done
    ckpt: C.Checkpointer | None = None  # rank 0's checkpoints (every member may become it)
    held: list[set[int]] = field(default_factory=list)  # ids of `step` each member has done
    laid_out: bool = False  # the optimizer's state is in stream order (lay_out_optimizer_state)
    # -- the replica (tp x pp ranks; docs/runtime.md, Model-parallel replicas)
    par: TensorParallel = field(default_factory=tensor_parallel)
    pipe: PipelineParallel = field(default_factory=pipeline_parallel)
    dp: EpochGroup | None = None  # this epoch's members at this place, one per replica
    rebuild: Rebuild | None = None  # the script's builder of a shard for another layout
    shard: Shard | None = None  # what this worker trains (model, optimizer, stage)
    old: Shard | None = None  # a layout change: the shard that holds the state, until moved
    zero: Zero | None = None  # the optimizer's state sharded across replicas (zero 1)
    grads: Reducer = field(init=False)  # the shard's gradients (_adopt)
    mb: MicroBatches = field(init=False)  # the shard's micro-batches of the step (_adopt)

    def __post_init__(self) -> None:
        self.faults = FaultPlan(list(self.ctx.faults), emit=self._event, rank=self.ctx.slot,
                                act=self._act)  # fmt: skip
        self.ctx, self.store = _find_store(self.ctx, self.link, ask=False)
        self.watch = EpochWatch(self.store, self.ctx.task)
        # a freshly built model is the task's state only until the first step commits (the
        # coordinator says when, through the store; read again at every ledger exchange)
        trained = self._steady(lambda: self.store.check([trained_key(self.ctx.task)]))
        self.has_state = not trained and not self.ctx.resume
        check_out(self.out, trained=trained)  # one nobody can write: exit 2 before a step
        if self.ctx.fsdp > 1:  # the replica's ranks are FSDP's (unicron.fsdp)
            self.pipe = PipelineParallel(0, 1, fsdp_parallel())
            self.par = self.pipe.tp
        if (self.par.size, self.pipe.stages) != (self.ctx.tp, self.ctx.pp):
            raise RuntimeError(
                f"tensor x pipeline parallel {self.par.size} x {self.pipe.stages} in a task of "
                f"tp {self.ctx.tp} x pp {self.ctx.pp}"
            )
        self.M = self.ledger.num_microbatches
        self._adopt(Shard(self.model, self.optimizer, self.pipe))
        # staging buffers and first calls of the state transfer, paid now rather than in a
        # transition (the group's wire: the device with NCCL, else the CPU)
        nccl = os.environ.get(D.ENV_BACKEND, "gloo") == "nccl"
        warm_up(self.device if nccl else torch.device("cpu"))

    def _adopt(self, shard: Shard) -> None:
        """Train ``shard`` from now on (the script's model when the worker starts; a shard
        of another layout built by the script's ``rebuild``): its reducer, micro-batches,
        place and checkpoints. What it computed of a step before is dropped."""
        if self.shard is not None:
            self.grads.close()
            if self.ckpt is not None:
                self.ckpt.join()
        self.shard, self.model, self.optimizer = shard, shard.model, shard.optimizer
        self.pipe, self.par = shard.pipe, shard.pipe.tp
        self.grads = _reducer(
            self.ctx, shard, self.M, self.device, lambda: self.mb.stray_backward()
        )
        self.mb = MicroBatches(grads=self.grads, par=self.par, pipe=self.pipe, faults=self.faults,
                               tp=self.par.size, pp=self.pipe.stages,
                               fsdp=self.ctx.fsdp > 1)  # fmt: skip
        self._stepping, self.laid_out = False, False
        self.optimizer.register_step_pre_hook(self._optimizer_step)
        self.zero = Zero(self.model, self.optimizer) if self.ctx.zero else None
        self.R = self.par.size * self.pipe.stages
        """ranks per replica (an epoch's members are whole replicas, in order)"""
        self.place = self.pipe.stage * self.par.size + self.par.rank
        """this rank's place in its replica (its shard of the state)"""
        if self.ctx.checkpoint is not None:
            every, keep = self.ctx.checkpoint_every, self.ctx.checkpoint_keep
            settings = C.IntervalSettings(
                every_steps=every, mtbf_s=self.ctx.checkpoint_mtbf_s, keep=keep
            )
            self.ckpt = C.Checkpointer(
                root=C.shard_root(
                    layout_root(self.ctx, self.par.size, self.pipe.stages), self.place, self.R
                ),
                settings=settings,
                reduce=self.ctx.reduce,
                ledger=self.ledger.describe(),
                emit=self._event,
            )
        # the state in stream order, so that a transfer sends and receives it in place: the
        # parameters now, the optimizer's state after the step that creates it (_apply)
        lay_out_parameters(self.model)

    # -- the loops --------------------------------------------------------------------------
    def attempts(self) -> Iterator[Step]:
        """The steps to compute, epoch after epoch, until the task is over (:class:`Loop`
        hands this generator to the user's ``for`` loop; the ``done`` key, written once every
        member reported done: :func:`unicron.control.membership.worker_done`). A finished
        worker stays: a newer epoch may need what it holds (values a member missed when its
        last update's broadcast was cut, state for a joiner), and it reports again there."""
        # an epoch announced before this process was ready names its previous incarnation (a
        # restart): never join it, even if it is still the newest (a lone worker's restart)
        epoch, last_loss = self._steady(lambda: self.watch.latest()), float("nan")
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        # the state a joiner receives: the model and (AdamW-like) two moments per parameter
        self.link.send(M.Ready(slot=self.ctx.slot, ts=time.time(), microbatches=self.M,
                            state_bytes=3 * model_bytes))  # fmt: skip
        reported, whole = -1, False  # the epoch last reported done in; the state whole here
        while True:
            # not after an entry cut midway (a shard half moved), nor with an update's broadcast
            # cut (Zero.stale): the next epoch brings the values
            owed = self.zero is not None and bool(self.zero.stale)
            if whole and self.step >= self.steps and not owed and reported != epoch:
                self._finish(epoch, last_loss)
                reported = epoch
            info = self._wait_for_epoch(after=epoch)
            if info is None:
                return  # the task is over (finished or failed), with or without this worker
            epoch = info.epoch
            try:
                with store_calls():
                    g, todo = self._enter(info)
            except EpochOver as exc:
                self._leave(exc, epoch)
                whole = False
                continue
            first, whole = True, True
            while self.step < self.steps:
                if not first:
                    if (over := self._newer_epoch(g)) is not None:
                        self._leave(over, epoch)
                        break
                    shares = L.assign(range(self.M), g.world // self.R)
                    todo = shares[g.rank // self.R]
                    self.held = [set(share) for share in shares]
                first = False
                attempt = self._begin(g, todo)
                yield attempt
                if not attempt.closed:
                    refuse(
                        f"step {attempt.index}: the loop went on without step.commit() "
                        "(call it once per step, after the step's micro-batches)"
                    )
                self.mb.attempt = None
                if attempt.committed and attempt.loss is not None:
                    last_loss = attempt.loss  # also where broken after it (a cut broadcast)
                if attempt.broken is not None:
                    self._leave(attempt.broken, epoch)
                    break

    def _newer_epoch(self, g: EpochGroup) -> EpochOver | None:
        """At a step boundary: why the members leave ``g``'s epoch here (a newer one is
        announced, or the store is gone), or ``None``. The commit's vote read the newest epoch
        with its outcome (:attr:`EpochGroup.latest_seen`), a few milliseconds ago: no round
        trip of its own."""
        latest, g.latest_seen = g.latest_seen, None
        try:
            latest = self.watch.latest() if latest is None else latest
        except StoreLost as exc:
            return exc
        return EpochOver("new epoch at the step boundary") if latest > g.info.epoch else None

    def _leave(self, exc: EpochOver, epoch: int) -> None:
        """Leave the current epoch's group; a failed collective is reported to the agent,
        unless the store is gone (gloo's connections are made through it): then, as for any
        :class:`StoreLost`, find the store again (:func:`_find_store`). A store found again
        that still holds this epoch was lost to this worker alone (a request past its bound
        on a machine slowed to a crawl): reported like a failed collective, so that the
        coordinator gives the members a new epoch (the others wait in this one)."""
        self.groups[-1].leave()
        if isinstance(exc, CollectiveError) and self._store_gone():
            exc = StoreLost(str(exc))
        if isinstance(exc, StoreLost):
            self._reconnect()
            try:  # a new store holds the next epoch (or none yet), never this one
                if self.watch.latest() != epoch:
                    return
            except StoreLost:
                return
            cause: BaseException = exc
        elif isinstance(exc, CollectiveError):
            cause = exc.cause
        else:
            return
        self.link.send(M.Error(type_name=type(cause).__name__, message=str(cause),
                               in_band=True, step=self.step, epoch=epoch))  # fmt: skip

    def _finish(self, epoch: int, last_loss: float) -> None:
        """Report the task's last step done (:func:`unicron.runtime.boundary.finish`)."""
        sha, rank = boundary.finish(self, epoch, last_loss)
        self.result = TrainResult(
            steps=self.step, final_loss=last_loss, params_sha256=sha, rank=rank, epoch=epoch
        )

    def _wait_for_epoch(self, after: int) -> EpochInfo | None:
        """Block until the newest epoch is newer than ``after`` and includes this slot."""
        while True:
            try:
                latest = self.watch.latest()
                if latest > after:
                    info = self.watch.info(latest)
                    if self.ctx.slot in info.members:
                        return info
                if self.watch.task_over():
                    return None
            except StoreLost:
                self._reconnect()
                continue
            time.sleep(self.ctx.slice_s / (1 if self.result else 5))  # finished: less often

    def _store_gone(self) -> bool:
        try:
            self.watch.task_over()
        except StoreLost:
            return True
        return False

    def _steady(self, read: Callable[[], T]) -> T:
        """``read`` from the store, found again (:meth:`_reconnect`) each time it is lost or
        gives no answer within its bound: before the worker is in an epoch a slow store is
        nothing to die of (found beside CPU burners: a worker starting up got no answer to
        its first ``check`` in 3 s, died, and was restarted as an unknown error)."""
        while True:
            try:
                with store_calls():
                    return read()
            except StoreLost:
                self._reconnect()

    def _reconnect(self) -> None:
        """Read epochs from where the store serves now (:func:`_find_store`)."""
        self.ctx, self.store = _find_store(self.ctx, self.link)
        self.watch = EpochWatch(self.store, self.ctx.task)

    def _enter(self, info: EpochInfo) -> tuple[EpochGroup, list[int]]:
        """Join epoch ``info``: rendezvous, ledger exchange, state; this member's share of
        the interrupted step's missing micro-batches."""
        t0 = time.time()
        self.link.send(M.EpochEntered(slot=self.ctx.slot, ts=time.time(), epoch=info.epoch))
        rank, self.faults.members = info.members.index(self.ctx.slot), len(info.members)
        store = (self.ctx.store_host, self.ctx.store_port)
        os.environ.update(epoch_env(info, self.ctx.slot, store))  # torchrun's variables
        g = EpochGroup(
            self.store,
            self.watch,
            info,
            rank,
            slice_s=self.ctx.slice_s,
            timeout_s=self.ctx.timeout_s,
            pg_store=functools.partial(_store_client, self.ctx),
            backend=os.environ.get(D.ENV_BACKEND, "gloo"),
            device=self.device,
        )
        self.groups.append(g)
        ABANDONED.append(g)  # an old gloo group with a pending operation blocks its destructor
        g.rendezvous()
        self._relayout(info.tp or self.ctx.tp, info.pp or self.ctx.pp, rank)
        self._replica_groups(g)
        if info.urgent and self.ckpt is not None:
            self.ckpt.note_failure()  # the observed failure rate sets the checkpoint interval
        reused, source = transition.sync(self, g)
        if reused and self.ctx.on_lost == "drop":
            self.missing = []  # the control: the interrupted step's global batch shrinks
        shares = L.assign(self.missing, g.world // self.R)
        self.held = [held | set(share) for held, share in zip(self.held, shares, strict=True)]
        if rank == 0:
            self._event(
                "transition_end",
                epoch=info.epoch,
                rank=0,
                step=self.step,
                duration_s=round(time.time() - (info.published_ts or t0), 6),
                state_source=source,
                microbatches_reused=reused,
                microbatches_recomputed=len(self.missing) if reused else 0,
                members=list(info.members),
            )
        return g, shares[rank // self.R]

    def _replica_groups(self, g: EpochGroup) -> None:
        """This member's groups in epoch ``g`` (:func:`unicron.runtime.replica.bind`)."""

        def said(waiting: bool) -> None:
            # a long wait on the replica is its other ranks' doing: say so, so that the hang
            # detector looks at them (a hung rank's partners wait; they do not hang)
            self.link.send(M.WaitingOnReplica(slot=self.ctx.slot, ts=time.time(), step=self.step,
                                              epoch=g.info.epoch, waiting=waiting))  # fmt: skip

        self.dp = replica.bind(
            g, place=self.place, par=self.par, pipe=self.pipe, device=self.device, said=said
        )

    # -- transition: ledger exchange and nearest-source state ---------------------------------
    def _relayout(self, tp: int, pp: int, rank: int) -> None:
        """Entering an epoch at ``tp`` tensor-parallel ranks and ``pp`` pipeline stages as
        member ``rank``: train this rank's shard of that layout (the script's ``rebuild``
        makes it; the shard holding the state is kept as the source until
        :func:`unicron.runtime.transition.sync` has moved it)."""
        place = rank % (tp * pp)
        where = (tp, place % tp, pp, place // tp)  # degree, tensor-parallel rank, depth, stage
        here = (self.par.size, self.par.rank, self.pipe.stages, self.pipe.stage)
        if where == here:
            return
        old = self.old
        if old is not None and (*old.part, old.pipe.stages, old.pipe.stage) == where:
            self.old = None  # back at the layout whose state is here
            self._adopt(old)
            return
        if self.rebuild is None:
            refuse(
                f"the task runs at tp {tp} x pp {pp} now (its layout changed with its worker "
                "count): hand train() or Loop a rebuild(tp, pp) that builds the model and "
                "optimizer of any layout (docs/runtime.md, Layout changes)"
            )
        if old is None and self.has_state and self.step > 0:
            self.old = self.shard  # the committed state, until the new shard is filled
        assert self.shard is not None
        par = self.par if (tp, where[1]) == self.shard.part else TensorParallel(where[1], tp)
        pipe = PipelineParallel(where[3], pp, par)
        model, optimizer = self.rebuild(par, pipe)
        model.to(self.device)  # in place: the optimizer keeps its parameter objects
        self._adopt(Shard(model, optimizer, pipe))

    # -- one attempt at a step ------------------------------------------------------------------
    def _begin(self, g: EpochGroup, todo: list[int]) -> Step:
        """Hand out step ``self.step`` with this member's micro-batches ``todo``; ``_held``
        says what every member's local sums will hold once it computed its own."""
        step = self.step
        # ts: when it began here (the agent may read it late on a loaded machine)
        self.link.send(M.StepBegan(slot=self.ctx.slot, ts=time.time(), step=step,
                                   epoch=g.info.epoch, cpu_s=time.thread_time(),
                                   tid=threading.get_native_id()))  # fmt: skip
        for attempt in range(self.ctx.max_reattempts + 1):
            try:
                for kind in ("node", "hang", "error"):
                    self.faults.fire_due(kind, step)
                break
            except Exception as exc:  # nothing is computed yet: a SEV3 error is retried here
                if not _sev3(exc) or attempt >= self.ctx.max_reattempts:
                    raise  # the process exits and is restarted
                self.link.send(M.Error(type_name=type(exc).__name__, message=str(exc),
                                       in_band=True, in_place=True, step=step))  # fmt: skip
        self.par.reset()
        assert self.dp is not None
        self.grads.start(self.dp, [R.cover(ids, self.M) for ids in self.held])
        self.mb.crash_at = self.faults.crash_point(step, self.mb.count(len(todo)))
        self.mb.attempt = Step(self, step, todo, g)
        return self.mb.attempt

    def _own_compute_s(self, s: Step) -> float:
        """What attempt ``s`` has cost this worker's own compute so far, for an injected
        ``slow`` fault to multiply: on a CPU the computing thread's CPU time (gloo moves the
        replica's sums and links on threads of its own, so a wait on a peer is not in it; the
        step's wall time is, and a slow rank of a pipeline, waited for by its peers and
        waiting for them, multiplied its own slowness step after step: the soak's 4x-slow
        rank grew to a hang), on an accelerator the wall time (its kernels run off the
        thread)."""
        if self.device.type == "cpu":
            return time.thread_time() - s.cpu_at_start
        return time.perf_counter() - s.began

    def make_batch(self, step: int, mb: int) -> Any:
        """Seed the micro-batch's randomness, collate its samples, move them to the device."""
        D.seed(L.mb_seed(self.seed, step, mb), self.device)
        batch = self.collate([self.dataset[i] for i in self.data.samples(step, mb)])
        return D.to_device(batch, self.device)

    def _optimizer_step(self, *_: Any) -> None:
        """Optimizer pre-step hook: while the task trains, only the commit steps it."""
        if not self._stepping and self.result is None:
            refuse(
                "optimizer.step() called by the script: step.commit() steps the optimizer "
                "after the reduce and the vote; remove the call"
            )

    def commit(self, s: Step, before_optimizer: Callable[[], object] | None) -> bool:
        """Reduce, vote, apply (see :meth:`Step.commit`)."""
        self.mb.check_open(s, "step.commit()")
        self.pipe.flush()  # what this stage sent is delivered, or the attempt is broken
        if self.par.broken is not None:  # the replica broke in this attempt: nobody commits
            self.mb.clear()  # its sums here mean nothing (a send failed after they were made)
            self.grads.clear()
            s.closed = True
            self.groups[-1].abort(s.index)
            why = self.par.broken
            s.broken = why if isinstance(why, EpochOver) else CollectiveError(why)
            return False
        self.mb.check_whole(s)
        if self.mb.crash_at >= self.mb.count(len(s.microbatches)):
            self.faults.fire_due("crash", s.index)
        s.closed = True
        g, step = self.groups[-1], s.index
        factor = self.faults.slowdown(step)
        if factor > 1.0:
            slow_down(self._own_compute_s(s) * (factor - 1.0), on_cpu=self.device.type == "cpu")
        queued_now = read_queued_s()
        self.link.send(
            M.StepComputed(
                slot=self.ctx.slot,
                step=step,
                microbatches=len(s.microbatches),
                compute_s=time.perf_counter() - s.began,
                ts=time.time(),
                cpu_s=time.thread_time(),
                queued_s=(
                    None
                    if queued_now is None or s.queued_at_start is None
                    else queued_now - s.queued_at_start
                ),
                epoch=g.info.epoch,
            )
        )
        try:
            grads, losses, whole = self.grads.finish()
            if not g.vote(step):
                raise EpochOver(f"step {step} not committed in epoch {g.info.epoch}")
        except EpochOver as exc:  # left the reduce (or it failed): make sure nobody commits
            g.abort(step)
            s.broken = exc
            return False
        kept = [x for x in losses if x == x]  # NaN: a micro-batch nobody holds (drop)
        cut: EpochOver | None = None
        try:
            self._apply(grads, whole, len(kept), before_optimizer)
        except EpochOver as exc:  # a sharded optimizer's broadcast of the update was cut:
            cut = exc  # committed all the same (every value has its holders), then we leave
        s.loss = sum(kept) / len(kept)
        # every member reports the commit (the agent logs one step_end per epoch and step), so
        # the record survives a rank 0 that dies right after committing
        self._event(
            "step_end",
            epoch=g.info.epoch,
            rank=g.rank,
            step=step,
            loss=round(s.loss, 6),
            duration_s=round(time.perf_counter() - s.began, 6),
            workers=g.world,
        )
        self.step += 1
        self.data.advance()
        self.grads.clear()
        self.mb.done.clear()
        if cut is None:
            cut = boundary.checkpoint(self, g.rank)
        s.committed = True
        s.broken = cut
        return True

    def _apply(
        self,
        grads: list[torch.Tensor],
        whole: torch.Tensor,
        count: int,
        before_optimizer: Callable[[], object] | None = None,
    ) -> None:
        """Step the optimizer with the mean gradient of the step's reduced sums: ``grads``,
        views of ``whole``, which is divided at once (one operation, not one per parameter;
        the same quotient in every element)."""
        assert count == self.M or self.ctx.on_lost == "drop", f"reduced {count} of {self.M}"
        self.grads.apply(grads, whole, self.M if self.ctx.on_lost == "recompute" else count)
        if before_optimizer is not None:
            before_optimizer()
        self._stepping = True
        try:
            fire = functools.partial(self.faults.fire_in_update, self.step)
            if self.zero is not None:
                assert self.dp is not None
                self.zero.step(self.dp, sent=fire)
            else:
                self.optimizer.step()
                fire()
        finally:
            self._stepping = False
            self.grads.clear_grads()
        if not self.laid_out and self.zero is None:
            self.laid_out = lay_out_optimizer_state(self.optimizer)

    # -- faults -----------------------------------------------------------------------------
    def _act(self, fault: Fault) -> None:
        """An injected fault's effect here (:class:`~unicron.runtime.inject.FaultPlan`): a
        node fault is the agent's to carry out, with the whole node."""
        if fault.fault != "node":
            stop_self(fault)
            return
        self.link.send(M.NodeFault())
        time.sleep(3600)  # the agent takes the whole node down with this process

    def _event(self, event: str, **fields: Any) -> None:
        fields.setdefault("task", self.ctx.task)
        fields.setdefault("node", self.ctx.node)
        now = time.time()
        self.link.send(M.Event(ts=now, name=event, fields={"ts": now, **fields}))
