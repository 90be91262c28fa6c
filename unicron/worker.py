"""The worker API: the user's script hands over its model, optimizer, loss and dataset.

A training script calls :func:`train` once, under ``unicron run``::

    result = unicron.worker.train(model=model, optimizer=opt, loss_fn=loss_fn,
                                  dataset=ds, micro_batch_size=4, num_microbatches=8, steps=100)

and Unicron runs the steps: the deterministic micro-batch ledger
(:mod:`unicron.runtime.ledger`), a fresh gloo group per epoch (:mod:`unicron.runtime.group`),
local gradient sums per replica kept until
the step commits and reduced exactly in buckets as the backward pass ends
(:mod:`unicron.runtime.reduce`), partial-results reuse and state from the nearest replica when the
membership changes. The user's model code does not change.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unicron.control.protocol import (
    ENV_CHECKPOINT,
    ENV_CHECKPOINT_EVERY,
    ENV_CHECKPOINT_KEEP,
    ENV_CHECKPOINT_MTBF,
    ENV_FAULTS,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_ON_LOST,
    ENV_REDUCE,
    ENV_RESUME,
    ENV_SLOT,
    ENV_STORE,
    ENV_TASK,
    EpochInfo,
    done_key,
    trained_key,
    usage_key,
)
from unicron.errors import UsageError
from unicron.runtime import checkpoint as C
from unicron.runtime import device as D
from unicron.runtime import ledger as L
from unicron.runtime import reduce as R
from unicron.runtime.group import CollectiveError, EpochGroup, EpochOver, EpochWatch
from unicron.runtime.inject import Fault, parse
from unicron.runtime.link import AgentLink, connect_agent
from unicron.runtime.transfer import transfer

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

ABANDONED: list[EpochGroup] = []
"""every group this process built, kept until it exits: freeing a gloo group whose abandoned
collective still waits on a dead peer joins its I/O thread, which never returns"""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What :func:`train` returns on every worker that finished the task."""

    steps: int
    final_loss: float
    params_sha256: str
    rank: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """What ``unicron run`` tells a worker through its environment
    (:mod:`unicron.control.protocol`)."""

    task: str
    slot: int
    node: int
    incarnation: int
    store_host: str
    store_port: int
    faults: tuple[Fault, ...]
    reduce: str = "exact"
    on_lost: str = "recompute"
    slice_s: float = 0.05
    """how long a collective is waited for between two looks at the epoch key"""
    timeout_s: float = 300.0
    """last-resort bound on one collective or rendezvous (the process-group timeout)"""
    max_reattempts: int = 2
    """SEV3 errors retried in place per step before the error ends the process"""
    checkpoint: Path | None = None
    """the persistent checkpoints' directory: written by rank 0, read only when no replica
    holds the state (docs/checkpoint.md)"""
    checkpoint_every: int | None = 0
    """committed steps between two checkpoints (0: never write one; None: auto, Young/Daly)"""
    checkpoint_mtbf_s: float = C.IntervalSettings.mtbf_s
    checkpoint_keep: int = C.IntervalSettings.keep
    resume: bool = False
    """the task goes on from the newest checkpoint (``unicron run --resume``)"""

    @classmethod
    def from_env(cls) -> WorkerContext:
        if ENV_STORE not in os.environ:
            raise RuntimeError(
                "unicron.worker.train() runs under the launcher: "
                "`unicron run --nproc-per-node N SCRIPT [ARGS]`"
            )
        host, port = os.environ[ENV_STORE].rsplit(":", 1)
        specs = os.environ.get(ENV_FAULTS, "")
        return cls(
            task=os.environ[ENV_TASK],
            slot=int(os.environ[ENV_SLOT]),
            node=int(os.environ.get(ENV_NODE, "0")),
            incarnation=int(os.environ.get(ENV_INCARNATION, "0")),
            store_host=host,
            store_port=int(port),
            faults=tuple(parse(s) for s in specs.split(";") if s),
            reduce=os.environ.get(ENV_REDUCE, "exact"),
            checkpoint=Path(os.environ[ENV_CHECKPOINT]) if os.environ.get(ENV_CHECKPOINT) else None,
            checkpoint_every=_every(os.environ.get(ENV_CHECKPOINT_EVERY, "0")),
            checkpoint_mtbf_s=float(os.environ.get(ENV_CHECKPOINT_MTBF, cls.checkpoint_mtbf_s)),
            checkpoint_keep=int(os.environ.get(ENV_CHECKPOINT_KEEP, cls.checkpoint_keep)),
            resume=os.environ.get(ENV_RESUME) == "1",
            on_lost=os.environ.get(ENV_ON_LOST, "recompute"),
        )


def _every(raw: str) -> int | None:
    return None if raw == "auto" else int(raw)


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, in ``state_dict`` order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def device() -> torch.device:
    """This worker's device (``cpu`` or ``cuda:N``), as the agent mapped its slot; the script
    may build its model there (``train`` moves it there in any case). ``LOCAL_RANK`` is set
    too, as under torchrun."""
    return D.current()


def default_collate(items: Sequence[Any]) -> Any:
    """Stack a list of samples (tensors, or tuples of tensors) into one batch."""
    first = items[0]
    if isinstance(first, tuple | list):
        return type(first)(torch.stack([it[i] for it in items]) for i in range(len(first)))
    return torch.stack(list(items))


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    dataset: Any,
    micro_batch_size: int,
    num_microbatches: int,
    steps: int,
    seed: int = 0,
    out: str | Path | None = None,
    collate: Callable[[Sequence[Any]], Any] = default_collate,
) -> TrainResult | None:
    """Train for ``steps`` global steps of ``num_microbatches`` x ``micro_batch_size`` samples.

    ``loss_fn(model, batch)`` returns the mean loss of one micro-batch; ``dataset[i]`` returns
    sample ``i``. Rank 0 of the final epoch writes ``out/final.pt`` (the model's state_dict).
    Returns ``None`` on a worker that was still waiting to join when the task finished.
    """
    if steps < 1:
        raise ValueError(f"train(): steps must be >= 1, got {steps}")
    ctx = WorkerContext.from_env()
    link = connect_agent()
    dev = _device_for(model, ctx, link)
    runner = _Runner(
        ctx=ctx,
        link=link,
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        dataset=dataset,
        collate=collate,
        steps=steps,
        out=Path(out) if out else None,
        ledger=L.Ledger(
            dataset_len=len(dataset),
            micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches,
            seed=seed,
        ),
        seed=seed,
        device=dev,
    )
    return runner.run()


def _device_for(model: torch.nn.Module, ctx: WorkerContext, link: AgentLink) -> torch.device:
    """Check the slot's device and memory before anything is built, then move the model there.
    Bad input (a device the node lacks, a model too large for the slot) ends the whole run with
    exit code 2: the agent is told first, then this process exits."""
    try:
        dev = D.current()
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = -(-local_world // max(1, D.gpu_count())) if dev.type == "cuda" else 1
        D.check_fits(numel, ctx.reduce, D.slot_memory(dev, local_world, sharing), dev)
    except UsageError as exc:
        link.send({"type": "error", "usage": True, "type_name": "UsageError",
                   "message": str(exc), "traceback": "", "in_band": False})  # fmt: skip
        raise SystemExit(2) from exc
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model.to(dev)  # in place: the optimizer keeps the same parameter objects
    return dev


@dataclass(kw_only=True)
class _Runner:
    """The epoch and step loop of one worker (everything :func:`train` does)."""

    ctx: WorkerContext
    link: AgentLink
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    dataset: Any
    collate: Callable[[Sequence[Any]], Any]
    steps: int
    out: Path | None
    ledger: L.Ledger
    seed: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0  # committed steps
    has_state: bool = True
    done: set[int] = field(default_factory=set)  # micro-batches of `step` in `sums`
    fired: set[str] = field(default_factory=set)
    groups: list[EpochGroup] = field(default_factory=list)
    _missing: list[int] = field(default_factory=list)  # ids of `step` nobody living has done
    ckpt: C.Checkpointer | None = None  # rank 0's checkpoints (every member may become it)
    _held: list[set[int]] = field(default_factory=list)  # ids of `step` each member has done
    _exchange: R.Exchange | None = None  # the reduction the last micro-batch's hooks start

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params), torch.float32)
        cap, first = (
            int(mb * 2**20) // dtype.itemsize for mb in (R.BUCKET_CAP_MB, R.FIRST_BUCKET_MB)
        )
        self.layout = R.Layout.plan([p.numel() for p in self.params], cap, first)
        self.sums = R.LocalSums(
            self.layout,
            self.ledger.num_microbatches,
            exact=self.ctx.reduce == "exact",
            dtype=dtype,
            device=self.device,
        )
        self._spaces: dict[int, R.Workspace] = {}
        self._in_backward = self._last = False
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
        self.store = dist.TCPStore(
            self.ctx.store_host,
            self.ctx.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.ctx.timeout_s),
        )
        # a freshly built model is the task's state only until the first step commits (the
        # coordinator says when, through the store; read again at every ledger exchange)
        self.has_state = not self.store.check([trained_key(self.ctx.task)])
        self.has_state = self.has_state and not self.ctx.resume
        if self.ctx.checkpoint is not None:
            every, keep = self.ctx.checkpoint_every, self.ctx.checkpoint_keep
            settings = C.IntervalSettings(
                every_steps=every, mtbf_s=self.ctx.checkpoint_mtbf_s, keep=keep
            )
            self.ckpt = C.Checkpointer(
                root=self.ctx.checkpoint,
                settings=settings,
                reduce=self.ctx.reduce,
                ledger=self._ledger_desc(),
                emit=self._event,
            )
        self.watch = EpochWatch(self.store, self.ctx.task)
        self.M = self.ledger.num_microbatches

    def _store_client(self) -> dist.Store:
        """A new connection to the coordinator's store, for one epoch's process group only."""
        return dist.TCPStore(
            self.ctx.store_host,
            self.ctx.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.ctx.timeout_s),
        )

    # -- the loops --------------------------------------------------------------------------
    def run(self) -> TrainResult | None:
        # an epoch announced before this process was ready names its previous incarnation (a
        # restart): never join it, even if it is still the newest (a lone worker's restart)
        epoch, last_loss = self.watch.latest(), float("nan")
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        # the state a joiner receives: the model and (AdamW-like) two moments per parameter
        self.link.send({"type": "ready", "microbatches": self.M, "bytes": 3 * model_bytes})
        while self.step < self.steps:
            info = self._wait_for_epoch(after=epoch)
            if info is None:
                return None  # the task finished (or failed) without this worker
            epoch = info.epoch
            try:
                last_loss = self._run_epoch(info)
            except CollectiveError as exc:
                self.groups[-1].leave()
                self.link.send(
                    {
                        "type": "error",
                        "type_name": type(exc.cause).__name__,
                        "message": str(exc.cause),
                        "traceback": "",
                        "in_band": True,
                        "step": self.step,
                        "epoch": epoch,
                    }
                )
            except EpochOver:
                self.groups[-1].leave()
        if self.ckpt is not None:
            self.ckpt.join()
        group = self.groups[-1]
        sha = params_sha256(self.model)
        if group.rank == 0 and self.out is not None:
            save_atomic(self.model.state_dict(), self.out / "final.pt")
        self.link.send(
            {
                "type": "done",
                "steps": self.step,
                "final_loss": last_loss,
                "params_sha256": sha,
                "rank": group.rank,
                "epoch": epoch,
            }
        )
        return TrainResult(
            steps=self.step, final_loss=last_loss, params_sha256=sha, rank=group.rank, epoch=epoch
        )

    def _wait_for_epoch(self, after: int) -> EpochInfo | None:
        """Block until the newest epoch is newer than ``after`` and includes this slot."""
        while True:
            latest = self.watch.latest()
            if latest > after:
                info = self.watch.info(latest)
                if self.ctx.slot in info.members:
                    return info
            if self.store.check([done_key(self.ctx.task)]):
                return None
            time.sleep(self.ctx.slice_s / 5)

    def _run_epoch(self, info: EpochInfo) -> float:
        t0 = time.time()
        self.link.send({"type": "epoch", "epoch": info.epoch})
        rank = info.members.index(self.ctx.slot)
        g = EpochGroup(
            self.store,
            self.watch,
            info,
            rank,
            slice_s=self.ctx.slice_s,
            timeout_s=self.ctx.timeout_s,
            pg_store=self._store_client,
            backend=os.environ.get(D.ENV_BACKEND, "gloo"),
            device=self.device,
        )
        self.groups.append(g)
        ABANDONED.append(g)  # an old gloo group with a pending operation blocks its destructor
        g.rendezvous()
        if info.urgent and self.ckpt is not None:
            self.ckpt.note_failure()  # the observed failure rate sets the checkpoint interval
        reused, source = self._sync(g)
        if reused and self.ctx.on_lost == "drop":
            self._missing = []  # the control: the interrupted step's global batch shrinks
        shares = L.assign(self._missing, g.world)
        todo = shares[rank]
        owned = [held | set(share) for held, share in zip(self._held, shares, strict=True)]
        if rank == 0:
            self._event(
                "transition_end",
                epoch=info.epoch,
                rank=0,
                step=self.step,
                duration_s=round(time.time() - (info.published_ts or t0), 6),
                state_source=source,
                microbatches_reused=reused,
                microbatches_recomputed=len(self._missing) if reused else 0,
                members=list(info.members),
            )
        loss = float("nan")
        first = True
        while self.step < self.steps:
            if not first and self.watch.superseded(info.epoch, urgent_only=False):
                raise EpochOver("new epoch at the step boundary")
            if not first:
                shares = L.assign(range(self.M), g.world)
                todo, owned = shares[rank], [set(share) for share in shares]
            first = False
            loss = self._step(g, todo, owned)
        return loss

    # -- transition: ledger exchange and nearest-source state ---------------------------------
    def _sync(self, g: EpochGroup) -> tuple[int, str]:
        """Agree on the committed step, give state to members without it, find missing ids.

        Returns (micro-batches reused, where this epoch's joiners got state from).
        """
        if self.step == 0 and self.has_state and self.store.check([trained_key(self.ctx.task)]):
            self.has_state = False  # a fresh model, and a step has committed since it was built
        mask = [1 if mb in self.done else 0 for mb in range(self.M)]
        digest = int.from_bytes(bytes.fromhex(params_sha256(self.model))[:7], "big")
        mine = torch.tensor(
            [self.step if self.has_state else -1, self.ctx.node, digest, *mask], dtype=torch.int64
        )
        rows = [r.tolist() for r in g.allgather(mine)]
        target = max(r[0] for r in rows)
        if target < 0:  # every replica is gone: the last resort, the persistent checkpoint
            self._load_checkpoint()
            self._missing = list(range(self.M))
            self._held = [set() for _ in rows]
            return 0, "checkpoint"
        # members at the newest step with the first such member's parameters hold the state;
        # the others (joiners, and replicas that differ, e.g. models built with other seeds)
        # receive it, as DDP's first broadcast would
        ref = next(row[2] for row in rows if row[0] == target)
        holders = [r for r, row in enumerate(rows) if row[0] == target and row[2] == ref]
        needers = [r for r in range(len(rows)) if r not in holders]
        source = "local"
        if needers:
            # the nearest holders (on the needers' node, else all) each stream a share
            near = [h for h in holders if rows[h][1] == rows[needers[0]][1]]
            source = "peer_node" if near else "peer_remote"
            transfer(g, self.model, self.optimizer, holders=near or holders, needers=needers,
                     device=self.device)  # fmt: skip
            if g.rank in needers:
                self.step, self.has_state = target, True
        done_sets = [{mb for mb in range(self.M) if rows[r][3 + mb]} for r in holders]
        if g.rank in needers:
            self.done.clear()
            self.sums.clear()
        self._held = [
            done_sets[holders.index(r)] if r in holders else set() for r in range(len(rows))
        ]
        self._missing = L.missing(done_sets, self.M)
        return self.M - len(self._missing), source

    def _load_checkpoint(self) -> None:
        """Every replica is gone: go on from the newest valid checkpoint (a checkpoint of
        another model, data layout or reduce mode stops the task: exit 2)."""
        root = self.ctx.checkpoint
        found = C.load_newest(root) if root is not None else None
        if found is None:
            raise RuntimeError("no member of the epoch holds the model state and no checkpoint")
        manifest, parts = found
        why = C.mismatch(
            manifest,
            model=C.describe_model(self.model.state_dict()),
            ledger=self._ledger_desc(),
            reduce=self.ctx.reduce,
        )
        if why is not None:
            flag = "--resume" if self.ctx.resume else "--checkpoint-dir"
            self.store.set(usage_key(self.ctx.task), f"{flag} {root}: {why}")
            raise SystemExit(2)
        self.step, self.has_state = C.restore(parts, self.model, self.optimizer), True
        if self.ckpt is not None:
            self.ckpt.last_step = self.step  # no need to write what was just read
        self.sums.clear()
        self.done.clear()

    def _ledger_desc(self) -> dict[str, int]:
        lg = self.ledger
        return {
            "dataset_len": lg.dataset_len,
            "micro_batch_size": lg.micro_batch_size,
            "num_microbatches": lg.num_microbatches,
            "seed": lg.seed,
        }

    def _maybe_checkpoint(self, rank: int) -> None:
        """Rank 0 checkpoints the committed state when the interval says so: the copy is
        taken here, at the step boundary; the write runs in the background."""
        if rank != 0 or self.ckpt is None:
            return
        world, now = self.groups[-1].world, time.time()
        self.ckpt.at_boundary(self.model, self.optimizer, step=self.step, world=world, now=now)

    # -- one step ---------------------------------------------------------------------------
    def _step(self, g: EpochGroup, todo: list[int], owned: list[set[int]]) -> float:
        """One step: ``todo`` are this member's micro-batches, ``owned[r]`` every member's
        micro-batches at the end of its computation (what its local sums will hold)."""
        step = self.step
        self.link.send({"type": "step_begin", "step": step, "epoch": g.info.epoch})
        t0 = time.perf_counter()
        held = [R.cover(ids, self.M) for ids in owned]
        reused = owned[g.rank] - set(todo)
        for attempt in range(self.ctx.max_reattempts + 1):
            # the last micro-batch's gradient hooks start the exchange's buckets
            self._exchange = ex = R.Exchange(g, self.sums, self._space(g), held)
            try:
                self._compute(step, todo)
                break
            except Exception as exc:
                # a retry must not repeat a started collective nor miss a reused sum
                retry = not ex.launched and reused <= self.done
                if not (retry and self._reattempt(exc, step, attempt)):
                    raise
        compute_s = time.perf_counter() - t0
        self._slow(step, compute_s)
        self.link.send(
            {
                "type": "step_done",
                "step": step,
                "microbatches": len(todo),
                "compute_s": time.perf_counter() - t0,
            }
        )
        try:
            grads, losses = ex.finish()
        except EpochOver:  # left the reduce (or it failed): make sure nobody commits the step
            g.abort(step)
            raise
        finally:
            self._exchange = None
        if not g.vote(step):
            raise EpochOver(f"step {step} not committed in epoch {g.info.epoch}")
        kept = [x for x in losses if x == x]  # NaN: a micro-batch nobody holds (drop)
        self._apply(grads, len(kept))
        loss = sum(kept) / len(kept)
        # every member reports the commit (the agent logs one step_end per epoch and step), so
        # the record survives a rank 0 that dies right after committing
        self._event(
            "step_end",
            epoch=g.info.epoch,
            rank=g.rank,
            step=step,
            loss=round(loss, 6),
            duration_s=round(time.perf_counter() - t0, 6),
            workers=g.world,
        )
        self.step += 1
        self.sums.clear()
        self.done.clear()
        self._maybe_checkpoint(g.rank)
        return loss

    def _compute(self, step: int, todo: list[int]) -> None:
        """This replica's micro-batches of ``step`` (those not already in its local sum)."""
        self._maybe_fire("node", step)
        self._maybe_fire("hang", step)
        self._maybe_fire("error", step)
        crash_at = self._crash_point(step, len(todo))
        last = max((mb for mb in todo if mb not in self.done), default=None)
        for i, mb in enumerate(todo):
            if i == crash_at:
                self._maybe_fire("crash", step)
            if mb not in self.done:
                self._microbatch(step, mb, last=mb == last)
        if crash_at >= len(todo):
            self._maybe_fire("crash", step)

    def _reattempt(self, exc: Exception, step: int, attempt: int) -> bool:
        """SEV3 errors (a reset connection, a transient timeout) are retried in place, in the
        same epoch, a bounded number of times; the agent and coordinator are told. Anything
        else, or a retry that fails again, propagates: the process exits and is restarted."""
        from unicron.detect.classify import Severity, classify_exception

        verdict = classify_exception(exc)
        if verdict.severity is not Severity.SEV3 or attempt >= self.ctx.max_reattempts:
            return False
        self.link.send(
            {
                "type": "error",
                "type_name": type(exc).__name__,
                "message": str(exc),
                "traceback": "",
                "in_band": True,
                "in_place": True,
                "step": step,
            }
        )
        return True

    def _microbatch(self, step: int, mb: int, *, last: bool) -> None:
        """Forward and backward one micro-batch; its gradients go into the local sums from the
        gradient hooks (:meth:`_grad_ready`), the last one's also into the exchange."""
        torch.manual_seed(L.mb_seed(self.seed, step, mb))
        batch = self.collate([self.dataset[i] for i in self.ledger.samples(step, mb)])
        batch = D.to_device(batch, self.device)
        for p in self.params:
            p.grad = None
        self.sums.begin(mb)
        self._in_backward, self._last = True, last
        try:
            loss = self.loss_fn(self.model, batch)
            loss.backward()
            finished = self.sums.end(float(loss.detach()))
        except BaseException:
            self.sums.abandon()  # half-added gradients spoil the sums: redo the step's work
            self.done.clear()
            raise
        finally:
            self._in_backward = False
        if last and self._exchange is not None:
            for b in finished:
                self._exchange.ready(b)
        self.done.add(mb)

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Gradient hook: parameter ``index``'s gradient of the current micro-batch is in."""
        if not self._in_backward:
            return  # a backward pass of the user's own, outside a step
        bucket = self.sums.add(index, param.grad)
        param.grad = None
        if bucket is not None and self._last and self._exchange is not None:
            self._exchange.ready(bucket)

    def _space(self, g: EpochGroup) -> R.Workspace:
        """The exchange's buffers of epoch ``g``: fresh in each epoch, since a collective of
        an abandoned epoch may still write into the buffers it was given."""
        epoch = g.info.epoch
        if epoch not in self._spaces:
            self._spaces = {epoch: R.Workspace(self.layout, g.world, self.sums.dtype, self.device)}
        return self._spaces[epoch]

    def _apply(self, grads: list[torch.Tensor], count: int) -> None:
        """Step the optimizer with the mean gradient of the step's reduced sums."""
        assert count == self.M or self.ctx.on_lost == "drop", f"reduced {count} of {self.M}"
        expected = self.M if self.ctx.on_lost == "recompute" else count
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.div_(expected).view_as(p).to(p.dtype)
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    # -- faults -----------------------------------------------------------------------------
    def _faults(self, kind: str, step: int) -> list[Fault]:
        return [
            f
            for f in self.ctx.faults
            if f.fault == kind and f.step == step and f.spec not in self.fired
        ]

    def _crash_point(self, step: int, n: int) -> int:
        for f in self._faults("crash", step):
            return n // 2 if f.mb is None else f.mb
        return -1

    def _maybe_fire(self, kind: str, step: int) -> None:
        for f in self._faults(kind, step):
            self.fired.add(f.spec)
            self._event(
                "fault_injected",
                fault=f.fault,
                kind=f.kind,
                spec=f.spec,
                step=step,
                rank=self.ctx.slot,
            )
            if kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "error":
                from unicron.detect.classify import make_exception

                raise make_exception(f.kind or "user")
            elif kind == "node":
                self.link.send({"type": "node_fault"})
                time.sleep(3600)  # the agent takes the whole node down with this process

    def _slow(self, step: int, compute_s: float) -> None:
        factors = [f.factor for f in self.ctx.faults if f.fault == "slow" and f.step <= step]
        for f in self.ctx.faults:
            if f.fault == "slow" and f.step == step and f.spec not in self.fired:
                self.fired.add(f.spec)
                self._event(
                    "fault_injected",
                    fault="slow",
                    spec=f.spec,
                    step=step,
                    rank=self.ctx.slot,
                    factor=f.factor,
                )
        if factors:
            time.sleep(compute_s * (max(f or 1.0 for f in factors) - 1.0))

    def _event(self, event: str, **fields: Any) -> None:
        fields.setdefault("task", self.ctx.task)
        fields.setdefault("node", self.ctx.node)
        self.link.send({"type": "event", "event": event, "fields": {"ts": time.time(), **fields}})
