"""Durable checkpoints: the last tier of the nearest principle (docs/checkpoint.md).

A checkpoint is a directory per committed step, ``ROOT/step-000000120/``, holding state dicts
written with ``torch.save`` (``model.pt``, ``optim.pt``, ``train.pt``: the committed step, the
ledger's parameters and the RNG states) and ``manifest.json`` (step, world, reduce mode, a
description of the model, and each file's size and SHA-256). It is written under a temporary
name (``.tmp-step-...-PID``), every file and the directory are fsynced, then it is renamed into
place and the root is fsynced: a reader sees a whole checkpoint or none. A checkpoint whose
files do not match its manifest is skipped with a warning and the previous one is used.

The state is the full (data-parallel) state, so a checkpoint written by W workers loads at
any other world size. Three parts, who calls them:

- storage (:func:`write`, :func:`newest`, :func:`load`, :func:`prune`): the worker's writer
  thread, the runner's ``--resume`` checks, the coordinator (:func:`has_checkpoint`);
- the interval policy (:func:`choose_interval`): pure, ``now`` and rates passed in;
- :class:`Checkpointer`: rank 0 of each epoch, at every step boundary (``due`` then ``save``:
  the copy is taken on the training thread, the write happens on a background thread).

torch is imported where it is used, so that ``unicron run`` checks ``--resume`` input without
paying for it.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unicron.errors import UsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("unicron.runtime.checkpoint")

FORMAT = 1
MANIFEST = "manifest.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
PROGRESS = "progress.json"
"""written by ``unicron run`` when it stops: how many steps the run had committed, so a
``--resume`` can say how many steps it redoes"""


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line saying why."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a checkpoint directory holds (``manifest.json``)."""

    step: int
    """committed steps in this state: training goes on with step ``step``"""
    world: int
    """replicas of the epoch that wrote it (any world size can load it)"""
    reduce: str
    """``exact`` or ``fast``: a run goes on only in the mode that wrote it"""
    model: dict[str, list[Any]]
    """the model's state_dict: name -> [shape, dtype]"""
    ledger: dict[str, int]
    """the micro-batch ledger's parameters (with ``step``: the data position)"""
    files: dict[str, dict[str, Any]]
    """file name -> {"size": bytes, "sha256": hex}"""
    created_ts: float
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> Manifest:
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise CheckpointError(f"manifest format {d.get('format')!r}, expected {FORMAT}")
        return cls(**d)

    def nbytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def describe_model(state: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """The model description kept in a manifest: each state_dict entry's shape and dtype."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state.items()}


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:09d}"


# -- writing ---------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: Any) -> None:
    """A small JSON file through a temporary name, fsynced, renamed (the progress record)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    _write_file(tmp, json.dumps(obj).encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write(
    root: Path,
    parts: Mapping[str, Any],
    *,
    step: int,
    world: int,
    reduce: str,
    model: dict[str, list[Any]],
    ledger: dict[str, int],
    keep: int = 0,
    now: float,
) -> Path:
    """Write ``parts`` (file stem -> object for ``torch.save``) as the checkpoint of ``step``.

    Temporary directory, each file and the manifest fsynced, the directory fsynced, renamed,
    the root fsynced; then ``keep`` > 0 prunes all but the newest ``keep``. If a valid
    checkpoint of ``step`` already exists (a step redone after a fallback) it is kept.
    """
    import torch

    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    final = step_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{threading.get_ident()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files: dict[str, dict[str, Any]] = {}
    for stem, obj in parts.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        name = f"{stem}.pt"
        _write_file(tmp / name, data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = Manifest(
        step=step, world=world, reduce=reduce, model=model, ledger=ledger, files=files,
        created_ts=now,
    )  # fmt: skip
    _write_file(tmp / MANIFEST, manifest.to_json().encode())
    _fsync_dir(tmp)
    if final.exists():
        try:
            verify(final)
            shutil.rmtree(tmp)  # the same committed step: the same bits
            return final
        except CheckpointError:
            _discard(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if keep > 0:
        prune(root, keep)
    return final


def remove_stale(root: Path) -> None:
    """Remove temporary directories left by writers that died (their pid is gone)."""
    for p in root.glob(f"{TMP_PREFIX}{PREFIX}*"):
        try:
            pid = int(p.name.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (complete ones: with a manifest);
    returns what was deleted. Called by :func:`write` after each new checkpoint. In a shard's
    directory (``root/shardK``, :func:`shard_root`) the newest ``keep`` steps that every
    shard has whole are kept, and whatever is newer: each shard's writer prunes its own, and
    one that ran ahead of a writer that died must not delete the last step the others have
    (found by the cluster soak: shard 0 kept steps 297-298, shard 1 295-296, and the task's
    state, in no replica any more, was in no checkpoint either)."""
    assert keep > 0
    complete = [p for p in steps(root) if (p / MANIFEST).exists()]
    gone = complete[:-keep]
    whole = _whole_steps(root)
    if whole:
        floor = whole[-keep] if len(whole) >= keep else whole[0]
        gone = [p for p in complete if int(p.name[len(PREFIX) :]) < floor]
    for p in gone:
        _discard(p)
    return gone


def _whole_steps(root: Path) -> list[int]:
    """The steps every shard directory beside ``root`` (``shardK``) has complete, oldest
    first; empty where ``root`` is no shard's or no step is whole yet."""
    name = root.name
    if not (name.startswith("shard") and name[5:].isdigit()) or not root.parent.is_dir():
        return []
    shards = [p for p in root.parent.iterdir()
              if p.name.startswith("shard") and p.name[5:].isdigit() and p.is_dir()]  # fmt: skip
    have = [{int(p.name[len(PREFIX) :]) for p in steps(s) if (p / MANIFEST).exists()}
            for s in shards]  # fmt: skip
    return sorted(set.intersection(*have)) if have else []


def _discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of the way first (a kill while its files
    are being deleted must not leave a step directory without its manifest)."""
    trash = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-del")
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another writer discarded it first
        return
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------------
def steps(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (by step)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and p.is_dir():
            found.append((int(p.name[len(PREFIX) :]), p))
    return [p for _, p in sorted(found)]


def read_manifest(path: Path) -> Manifest:
    try:
        raw = (path / MANIFEST).read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({exc.strerror})") from exc
    try:
        manifest = Manifest.from_json(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is not a manifest ({exc})") from exc
    if step_dir(path.parent, manifest.step).name != path.name:
        raise CheckpointError(f"{path}: manifest says step {manifest.step}")
    return manifest


def _read_checked(path: Path, name: str, expect: Mapping[str, Any]) -> bytes:
    try:
        data = (path / name).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: {name} unreadable ({exc.strerror})") from exc
    if len(data) != expect["size"]:
        raise CheckpointError(f"{path}: {name} has {len(data)} bytes, manifest {expect['size']}")
    if hashlib.sha256(data).hexdigest() != expect["sha256"]:
        raise CheckpointError(f"{path}: {name} fails its SHA-256 checksum")
    return data


def verify(path: Path) -> Manifest:
    """The manifest of ``path`` if every file matches its size and checksum, else raise
    :class:`CheckpointError` with the reason."""
    manifest = read_manifest(path)
    for name, expect in manifest.files.items():
        _read_checked(path, name, expect)
    return manifest


def newest(
    root: Path, *, check_files: bool = True, skipped: list[str] | None = None
) -> tuple[Path, Manifest] | None:
    """The newest checkpoint under ``root`` that passes :func:`verify` (only the manifest
    with ``check_files=False``); each one that fails is skipped with a warning (or, given
    ``skipped``, its reason appended there)."""
    for path in reversed(steps(root)):
        try:
            manifest = verify(path) if check_files else read_manifest(path)
        except CheckpointError as exc:
            if skipped is None:
                log.warning("skipping checkpoint: %s", exc)
            else:
                skipped.append(str(exc))
            continue
        return path, manifest
    return None


def has_checkpoint(
    root: Path | None,
    own: tuple[int, int] = (1, 1),
    layouts: Sequence[tuple[int, int]] = (),
) -> bool:
    """Whether ``root`` holds a complete checkpoint (manifests present; cheap: the coordinator
    asks it when deciding whether a task can outlive its last replica): of a model-parallel
    task (its own ``(tp, pp)`` layout ``own``, and the others it may run at) a step that every
    shard of one layout has (:func:`layout_dir`, :func:`shard_root`): a checkpoint one of
    whose writers died before writing its shard cannot be loaded."""
    if root is None:
        return False
    for layout in dict.fromkeys((own, *layouts)):
        shards = _shard_steps(layout_dir(root, own, layout), layout[0] * layout[1])
        written = [{s for s, p in found.items() if (p / MANIFEST).exists()} for found in shards]
        if set.intersection(*written):
            return True
    return False


def layout_dir(root: Path, own: tuple[int, int], layout: tuple[int, int]) -> Path:
    """Where a model-parallel task whose own layout is ``own`` (``(tp, pp)``) keeps the
    checkpoints of ``layout``: ``root`` for its own, ``root/ppP`` for another pipeline depth,
    ``root/tpTppP`` for another tensor-parallel degree (a layout change)."""
    if layout == own:
        return root
    tp, pp = layout
    return root / (f"pp{pp}" if tp == own[0] else f"tp{tp}pp{pp}")


def shard_root(root: Path, place: int, tp: int) -> Path:
    """Where the shard of place ``place`` of a replica of ``tp`` ranks (``tp * pp``) is
    checkpointed: ``root`` itself for a replica of one rank, else ``root/shard{place}`` (each
    written by the rank of replica 0 at that place, at the same steps: :class:`Checkpointer`'s
    caller sees to it)."""
    return root if tp == 1 else root / f"shard{place}"


def load_newest_shard(root: Path, place: int, tp: int) -> tuple[Manifest, dict[str, Any]] | None:
    """The shard of place ``place`` at the newest step whose checkpoint verifies in every
    shard (every rank of a replica decides alike: the same files, read by each), or ``None``.
    With ``tp`` 1, :func:`load_newest`."""
    if tp == 1:
        return load_newest(root)
    shards = _shard_steps(root, tp)
    for step in sorted(set.intersection(*(set(d) for d in shards)), reverse=True):
        try:
            for c in range(tp):
                verify(shards[c][step])
            return load(shards[place][step])
        except CheckpointError as exc:
            log.warning("skipping checkpoint of step %d: %s", step, exc)
    return None


def load(path: Path) -> tuple[Manifest, dict[str, Any]]:
    """Read a checkpoint, checking each file's bytes against the manifest as it is read;
    returns the manifest and file stem -> loaded object."""
    import torch

    manifest = read_manifest(path)
    parts = {}
    for name, expect in manifest.files.items():
        data = _read_checked(path, name, expect)
        parts[name.removesuffix(".pt")] = torch.load(io.BytesIO(data), weights_only=True)
    return manifest, parts


def load_newest(root: Path) -> tuple[Manifest, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that reads back whole (each one that does not is
    skipped with a warning), or ``None``. Called by a worker when no replica holds the state."""
    for path in reversed(steps(root)):
        try:
            return load(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def mismatch(
    manifest: Manifest, *, model: dict[str, list[Any]], ledger: dict[str, int], reduce: str
) -> str | None:
    """Why a run cannot go on from ``manifest`` (another model, data layout or reduce mode),
    or ``None``. One line."""
    if manifest.reduce != reduce:
        return f"checkpoint step {manifest.step} was written with --reduce {manifest.reduce}"
    if manifest.model != model:
        names = sorted(set(manifest.model) ^ set(model))
        diff = [k for k in model if k in manifest.model and manifest.model[k] != model[k]]
        what = f"entries {names[:3]}" if names else f"{diff[:1]} {manifest.model[diff[0]]}"
        return f"checkpoint step {manifest.step} holds another model ({what} differ)"
    if manifest.ledger != ledger:
        return f"checkpoint step {manifest.step} has another data layout: {manifest.ledger}"
    return None


# -- the interval (pure) -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class IntervalSettings:
    """How often rank 0 writes a checkpoint."""

    every_steps: int | None = None
    """a fixed interval in committed steps; ``None``: Young/Daly from the measured cost and
    the failure rate (the default); 0: never"""
    mtbf_s: float = 3 * 3600.0
    """the configured mean time between failures of the task: the prior that the observed
    failures refine (``--mtbf``)"""
    keep: int = 3
    """checkpoints kept on disk (older ones are pruned); 0: all"""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0 or None, got {self.every_steps}")
        if not self.mtbf_s > 0 or math.isinf(self.mtbf_s):
            raise ValueError(f"mtbf_s must be a finite number > 0, got {self.mtbf_s}")
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")


@dataclass(frozen=True)
class Interval:
    """The chosen interval: in seconds of training (auto) or in steps (fixed), and why."""

    seconds: float | None
    steps: int | None
    reason: str


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum, sqrt(2 x cost x MTBF), which Daly's refinement keeps as its
    leading term: the interval that minimises checkpoint cost plus expected lost work."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def mtbf_estimate_s(*, prior_mtbf_s: float, elapsed_s: float, failures: int) -> float:
    """The failure rate's estimate: the configured MTBF counts as one failure observed over
    ``prior_mtbf_s`` (a Gamma prior), to which this run's failures and time are added."""
    return (prior_mtbf_s + max(elapsed_s, 0.0)) / (failures + 1)


def choose_interval(
    settings: IntervalSettings,
    *,
    cost_s: float | None,
    write_s: float | None,
    elapsed_s: float,
    failures: int,
) -> Interval:
    """The interval to use now. ``cost_s``: the measured step-time cost of one checkpoint
    (the copy on the training thread plus any wait for the previous write), ``write_s``: the
    measured background write time; ``None`` before the first checkpoint."""
    if settings.every_steps is not None:
        what = "never" if settings.every_steps == 0 else f"every {settings.every_steps} steps"
        return Interval(None, settings.every_steps, f"fixed: {what} (--checkpoint-every)")
    if cost_s is None:
        return Interval(math.inf, None, "auto: the copy cost is measured at a step boundary")
    mtbf = mtbf_estimate_s(prior_mtbf_s=settings.mtbf_s, elapsed_s=elapsed_s, failures=failures)
    yd = young_daly_s(max(cost_s, 1e-6), mtbf)
    why = (
        f"auto: Young/Daly sqrt(2 x cost {cost_s:.4f} s x MTBF {mtbf:.0f} s) = {yd:.1f} s "
        f"(MTBF: prior {settings.mtbf_s:.0f} s, {failures} failure(s) in {elapsed_s:.0f} s)"
    )
    if write_s is not None and write_s > yd:
        return Interval(write_s, None, why + f"; raised to the write time {write_s:.2f} s")
    return Interval(yd, None, why)


# -- rank 0's writer --------------------------------------------------------------------------
@dataclass
class Snapshot:
    """A copy of the committed state, taken at a step boundary (independent of later steps)."""

    step: int
    parts: dict[str, Any]
    model: dict[str, list[Any]]


def snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    ledger: dict[str, int],
    data: Sequence[int] = (-1, -1),
) -> Snapshot:
    """Copy everything needed to continue exactly: model, optimizer, committed step, ledger
    description, the data position (a user's sampler's epoch and position; ``(-1, -1)`` with
    the ledger's own order) and RNG states."""

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train = {
        "step": step,
        "ledger": dict(ledger),
        "data": [int(x) for x in data],
        "rng": _rng_states(),
        # the optimizer state's parameters by name, in its order: another layout's shard
        # finds its entries here (unicron.runtime.byname)
        "params": param_names(model, optimizer),
    }
    parts = {"model": state, "optim": copy.deepcopy(optimizer.state_dict()), "train": train}
    return Snapshot(step=step, parts=parts, model=describe_model(state))


def _shard_steps(root: Path, places: int) -> list[dict[int, Path]]:
    """Per place of a replica of ``places`` ranks, its checkpoint directories by step."""
    return [
        {int(p.name[len(PREFIX) :]): p for p in steps(shard_root(root, c, places))}
        for c in range(places)
    ]


def newest_step(root: Path, places: int) -> int:
    """The newest step under ``root`` that every one of ``places`` shards has (-1: none);
    verified when loaded (:func:`load_newest_shard`)."""
    found = [set(d) for d in _shard_steps(root, places)]
    return max(set.intersection(*found) if found else set(), default=-1)


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names in the model, in the optimizer's order (its state
    dict's indices; "" for one the model does not name)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names.get(id(p), "") for g in optimizer.param_groups for p in g["params"]]


def restore(
    parts: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load a checkpoint's parts into ``model`` and ``optimizer`` and the RNGs; the step."""

    model.load_state_dict(parts["model"])
    optimizer.load_state_dict(parts["optim"])
    set_rng_states(parts["train"]["rng"])
    return int(parts["train"]["step"])


def _rng_states() -> dict[str, Any]:
    """torch's CPU generator, Python's, numpy's global one and, once CUDA is initialised,
    each GPU's: as tensors and plain values, so the checkpoint loads with ``weights_only``."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form: a tuple with the key array
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [str(kind), torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(rng: Mapping[str, Any]) -> None:
    """Put back what :func:`_rng_states` read (a checkpoint without numpy's or the GPUs'
    states, or written with another GPU count, leaves those generators as they are)."""
    import numpy as np
    import torch

    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@dataclass(kw_only=True)
class Checkpointer:
    """Rank 0's checkpoints: decides at each step boundary (:meth:`due`), copies the state on
    the training thread and writes it on a background thread (:meth:`save`); one write at a
    time. ``emit(event, **fields)`` goes to the event log (``checkpoint_interval``,
    ``checkpoint_saved``); it may be called from the writer thread."""

    root: Path
    settings: IntervalSettings
    reduce: str
    ledger: dict[str, int]
    emit: Callable[..., None]
    started: float = field(default_factory=time.time)
    failures: int = 0
    cost_s: float | None = None
    write_s: float | None = None
    last_step: int = -1
    last_ts: float = 0.0
    interval: Interval | None = None
    _writer: threading.Thread | None = None

    def note_failure(self) -> None:
        """A member was lost (an urgent epoch): the observed failure rate goes up."""
        self.failures += 1

    def at_boundary(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        world: int,
        now: float,
        data: Sequence[int] = (-1, -1),
    ) -> None:
        """Called by rank 0 right after each commit (``step`` steps committed): checkpoint if
        the interval says so (:meth:`decide`)."""
        if self.decide(model, optimizer, step=step, now=now, data=data):
            self.save(model, optimizer, step=step, world=world, now=now, data=data)

    def decide(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        now: float,
        data: Sequence[int] = (-1, -1),
    ) -> bool:
        """Whether the interval says to checkpoint at ``step``. With the automatic interval
        the first call only measures the cost (a copy, discarded) and says no, so the first
        checkpoint comes one interval later."""
        if self.settings.every_steps is None and self.cost_s is None:
            t0 = time.perf_counter()
            snapshot(model, optimizer, step=step, ledger=self.ledger, data=data)
            self.cost_s, self.last_ts = time.perf_counter() - t0, now
            self._update_interval(now)
            return False
        return self.due(step, now)

    def due(self, step: int, now: float) -> bool:
        """Whether the state committed at ``step`` should be checkpointed."""
        if step <= self.last_step:
            return False
        self._update_interval(now)
        assert self.interval is not None
        if self.interval.steps is not None:
            return self.interval.steps > 0 and step % self.interval.steps == 0
        assert self.interval.seconds is not None
        return now - self.last_ts >= self.interval.seconds

    def _update_interval(self, now: float) -> None:
        new = choose_interval(
            self.settings,
            cost_s=self.cost_s,
            write_s=self.write_s,
            elapsed_s=now - self.started,
            failures=self.failures,
        )
        if _differs(self.interval, new):
            self.interval = new
            self.emit(
                "checkpoint_interval",
                interval_s=None if new.seconds is None else round(new.seconds, 3),
                interval_steps=new.steps,
                cost_s=None if self.cost_s is None else round(self.cost_s, 6),
                failures=self.failures,
                reason=new.reason,
            )

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
             world: int, now: float, data: Sequence[int] = (-1, -1)) -> None:  # fmt: skip
        """Copy the committed state now (the step-time cost, measured), write it in the
        background. Called by rank 0 right after step ``step - 1`` committed."""
        t0 = time.perf_counter()
        if self._writer is not None:
            self._writer.join()
        snap = snapshot(model, optimizer, step=step, ledger=self.ledger, data=data)
        self.cost_s = time.perf_counter() - t0
        self.last_step, self.last_ts = step, now
        self._writer = threading.Thread(
            target=self._write, args=(snap, world, self.cost_s), daemon=True, name="checkpoint"
        )
        self._writer.start()

    def _write(self, snap: Snapshot, world: int, cost_s: float) -> None:
        t0 = time.perf_counter()
        try:
            path = write(
                self.root, snap.parts, step=snap.step, world=world, reduce=self.reduce,
                model=snap.model, ledger=self.ledger, keep=self.settings.keep, now=time.time(),
            )  # fmt: skip
        except Exception as exc:  # a failed write must not end training: report it
            log.warning("checkpoint of step %d not written: %s", snap.step, exc)
            self.emit("checkpoint_saved", step=snap.step, ok=False, error=str(exc)[:300])
            return
        self.write_s = time.perf_counter() - t0
        self.emit(
            "checkpoint_saved",
            step=snap.step,
            ok=True,
            path=str(path),
            bytes=read_manifest(path).nbytes(),
            copy_s=round(cost_s, 6),
            write_s=round(self.write_s, 6),
        )

    def join(self) -> None:
        """Wait for the write in flight (the worker calls it before it reports ``done``)."""
        if self._writer is not None:
            self._writer.join()


def at_boundary_of(
    ckpt: Checkpointer,
    store: Any,
    key: str,
    *,
    rank: int,
    size: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    world: int,
    now: float,
    data: Sequence[int] = (-1, -1),
) -> None:
    """A member of rank ``rank`` after a commit (``step`` steps committed), in an epoch of
    replicas of ``size`` ranks: replica 0's ranks checkpoint their place's shard (with one
    rank, rank 0 the whole state) when the interval says so, every shard at the same steps:
    every K steps each decides alone; with the automatic interval rank 0 names the step two
    boundaries ahead on ``store`` under ``key`` (the others pass a boundary only after rank 0
    voted for the step between: they read it in time). Called by the worker."""
    if rank >= size:
        return
    if size == 1 or ckpt.settings.every_steps is not None:
        ckpt.at_boundary(model, optimizer, step=step, world=world, now=now, data=data)
        return
    agreed_on = agreed(
        ckpt, store, key, rank=rank, model=model, optimizer=optimizer, step=step, now=now, data=data
    )
    if agreed_on:
        ckpt.save(model, optimizer, step=step, world=world, now=now, data=data)


def agreed(
    ckpt: Checkpointer,
    store: Any,
    key: str,
    *,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    now: float,
    data: Sequence[int] = (-1, -1),
) -> bool:
    """Whether the state committed at ``step`` is checkpointed, the same answer for every
    member that asks: rank 0 decides (its interval, :meth:`Checkpointer.decide`) and names the
    step two boundaries ahead on ``store`` under ``key``; every member reads it (one passes a
    boundary only after rank 0 voted for the step between, so it reads in time). Called by
    :func:`at_boundary_of` for replica 0's ranks, and by every member when a checkpoint needs
    them all (a sharded optimizer's gather, :mod:`unicron.runtime.zero`). Every K steps
    needs no agreement: each member answers ``step % K == 0`` alone."""
    every = ckpt.settings.every_steps
    if every is not None:
        return every > 0 and step > 0 and step % every == 0
    at = store.add(key, 0)
    if rank == 0 and at < step and ckpt.decide(model, optimizer, step=step, now=now, data=data):
        at = store.add(key, step + 2 - at)
    return bool(at == step)


def _differs(old: Interval | None, new: Interval) -> bool:
    """Whether ``new`` is worth announcing: another kind, or 20% away from ``old``."""
    if old is None or (old.seconds is None) != (new.seconds is None):
        return True
    if new.seconds is None or old.seconds is None:
        return old.steps != new.steps
    return abs(new.seconds - old.seconds) > 0.2 * max(new.seconds, old.seconds)


def take_progress(root: Path) -> int | None:
    """Steps the run being resumed from ``root`` had committed (its :data:`PROGRESS` record,
    read once and removed: a later resume after a crash must not read a stale count), or
    ``None`` when it did not stop cleanly. Called when a resumed task starts."""
    path = root / PROGRESS
    try:
        committed = int(json.loads(path.read_text(encoding="utf-8"))["committed_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path.unlink()
    return committed


def record_progress(root: Path | None, committed: int | None) -> None:
    """Write how many steps a run committed beside its checkpoints (for a later resume);
    nothing without checkpoints or a known count. Called when ``unicron run`` ends."""
    if root is None or committed is None or not has_checkpoint(root):
        return
    try:
        write_json_atomic(root / PROGRESS, {"committed_steps": committed})
    except OSError as exc:
        log.warning("progress record not written: %s", exc)


def check_resume(root: Path, reduce: str, *, flag: str) -> list[str]:
    """Going on from ``root`` (``unicron run --resume DIR``, a task file's ``checkpoint:
    {resume: true, dir: DIR}``): a writable directory whose newest valid checkpoint was
    written in the same reduce mode (the worker checks the model when it loads it). Raises
    :class:`~unicron.errors.UsageError` with one line (``flag`` names the setting); returns
    the reasons checkpoints newer than the one used were skipped."""
    if not root.is_dir():
        raise UsageError(f"{flag} {root}: no such directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {root}: no permission to write (new checkpoints go there)")
    skipped: list[str] = []
    # a model-parallel task's shards (shard_root): the first one's stand for all (each rank
    # reads the newest step every shard has)
    sharded = not steps(root) and (root / "shard0").is_dir()
    found = newest(root / "shard0" if sharded else root, skipped=skipped)
    if found is None:
        why = f"{len(skipped)} checkpoint(s), none valid ({skipped[0]})" if skipped else "empty"
        raise UsageError(f"{flag} {root}: no checkpoint to go on from: {why}")
    manifest = found[1]
    if manifest.reduce != reduce:
        raise UsageError(
            f"{flag} {root}: checkpoint step {manifest.step} was written in reduce mode "
            f"{manifest.reduce}; go on in that mode (--reduce {manifest.reduce})"
        )
    return skipped
