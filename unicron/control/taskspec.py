"""A task file (``unicron submit TASK.yaml``): what to train, on how many workers, how.

::

    name: gpt                       # letters, digits, '.', '_', '-'
    script: examples/train_gpt.py   # relative to the task file; must exist on every node
    args: [--steps, 60]             # numbers are taken as their text ("60")
    workers: {min: 2, max: 4}       # the task waits (queued) until it can have min
    weight: 1.0                     # the planner's priority (> 0)
    reduce: exact                   # exact | fast
    bucket_cap_mb: 25               # the gradient buckets' bound (MB), as DDP's
    threads: 1                      # torch threads per worker
    tp: 1                           # tensor-parallel ranks per pipeline stage
    pp: 1                           # pipeline stages per replica (tp * pp ranks, one node)
    pp_choices: []                  # other depths it may run at with fewer workers: [1]
    tp_choices: []                  # other tensor-parallel degrees it may run at: [1]
    checkpoint: {every: auto, keep: 3, mtbf: 10800}   # also dir, resume
    device: cpu                     # cpu | cuda
    give_up_after: 600              # seconds below min before the task fails
    readmit_after: 60               # seconds before an excluded slot is probed
    restart_window: 60              # seconds over which the escalation counts failures
    inject: []                      # fault specs, as ``unicron run --inject``
    env: {HF_HOME: /data/hf}        # added to the workers' environment (not LD_*, PYTHON*...)
    model: {preset: gpt-1.3b}       # the planner's description (optional), as ``unicron plan``
    global_batch: 256               # sequences per step, for ``model`` (required with it)

A relative ``script`` or ``checkpoint.dir`` is taken from the task file's folder. Examples
of every kind: ``examples/tasks/*.yaml``.

Validated with pydantic (unknown fields, wrong types and inconsistent values are refused);
:func:`load` turns the problems into one line that names every one of them
(:class:`~unicron.errors.UsageError`). The service validates the same model again on
``POST /v1/tasks`` (a 422 naming the field).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from unicron.errors import UsageError
from unicron.protocol import BUCKET_CAP_MB

if TYPE_CHECKING:
    from unicron.planner import ModelSpec

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class Workers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(1, ge=1, le=4096)
    max: int = Field(1, ge=1, le=4096)

    @model_validator(mode="after")
    def _ordered(self) -> Workers:
        if self.min > self.max:
            raise ValueError(f"workers: min ({self.min}) is above max ({self.max})")
        return self


class Checkpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    every: int | Literal["auto"] = Field(
        "auto",
        description="rank 0 writes a persistent checkpoint (read only when no replica holds "
        "the state any more) every K steps, or at the Young/Daly interval sqrt(2 x measured "
        "cost x MTBF) (auto; 0: never)",
    )
    keep: int = Field(3, ge=0, description="checkpoints kept on disk, older ones deleted (0: all)")
    mtbf: float = Field(
        3 * 3600.0,
        gt=0,
        allow_inf_nan=False,
        description="expected seconds between failures, refined by the failures seen; sets "
        "the auto checkpoint interval",
    )
    dir: str | None = None
    """where checkpoints go (default: the coordinator's STATE_DIR/tasks/UID/checkpoints)"""
    resume: bool = False
    """go on from the newest valid checkpoint in ``dir``"""

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> Checkpoint:
        if self.resume and not self.dir:
            raise ValueError("checkpoint: resume needs dir")
        return self

    @field_validator("every")
    @classmethod
    def _every(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be an integer >= 0 or 'auto'")
        return v


class TaskSpec(BaseModel):
    """One task, as submitted (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    script: str = Field(min_length=1, max_length=4096)
    args: list[str] = Field(default_factory=list)
    workers: Workers = Field(default_factory=lambda: Workers.model_validate({}))
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    reduce: Literal["exact", "fast"] = Field(
        "exact",
        description="exact: a fixed summation tree of float32 sums, bitwise independent of "
        "failures; fast: float32 (the only mode on cuda, and its default)",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="cpu (gloo), or cuda: each slot gets one of the node's GPUs (round robin; "
        "NCCL when every slot has its own, else gloo); the script learns it from "
        "unicron.worker.device() and LOCAL_RANK",
    )
    on_lost: Literal["recompute", "drop"] = Field(
        "recompute",
        description="micro-batches lost with a failed worker: recompute them (the failure-free "
        "update) or drop them (the global batch shrinks; a control)",
    )
    bucket_cap_mb: float = Field(
        BUCKET_CAP_MB,
        gt=0,
        le=4096,
        allow_inf_nan=False,
        description="bound of one gradient bucket of the reduce, MB, as DDP's bucket_cap_mb; "
        "any value gives the same bits in exact mode",
    )
    threads: int = Field(1, ge=1, le=256, description="torch threads per worker")
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="tensor-parallel ranks per pipeline stage of a replica (the script "
        "builds its shard: unicron.parallel); a replica that loses a rank waits out of the "
        "step, its other ranks alive, until the rank is back",
    )
    pp: int = Field(
        1,
        ge=1,
        le=64,
        description="pipeline stages per replica, each tp ranks: a replica is tp x pp slots "
        "of one node (the script builds its stage: unicron.parallel)",
    )
    pp_choices: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="pipeline depths the task may also run at, comma-separated: with fewer "
        "workers for good (an excluded slot, a lost node) each epoch runs at the one whose "
        "whole replicas train the most of them (pp again once all are back); the state "
        "moves between layouts in memory (the script hands train() a rebuild)",
    )
    tp_choices: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="tensor-parallel degrees the task may also run at, comma-separated: "
        "with pp_choices, each epoch runs at the (tp, pp) layout whose whole replicas train "
        "the most workers; the state is re-sliced between degrees in memory (the script "
        "hands train() a rebuild; another degree sums in another order, so bits may differ)",
    )
    zero: int = Field(
        0,
        ge=0,
        le=1,
        description="1: shard the optimizer's state across replicas (ZeRO-1): each "
        "parameter's state is kept by two of them, on two nodes where there are, and a lost "
        "rank's share comes from the other; 0: every replica keeps all of it",
    )
    fsdp: int = Field(
        1,
        ge=1,
        le=64,
        description="FSDP ranks per replica, on one node: they shard the model, its "
        "gradients and its optimizer's state with PyTorch's fully_shard (the script shards it "
        "on unicron.fsdp.mesh()) and compute different micro-batches; a replica that loses a "
        "rank waits out of the step, as at tp",
    )
    checkpoint: Checkpoint = Field(default_factory=lambda: Checkpoint.model_validate({}))
    give_up_after: float = Field(
        600.0,
        gt=0,
        description="below the minimum of workers the task waits for capacity (restarts, "
        "excluded slots or nodes passing their health probe) this many seconds, then fails "
        "(inf: never)",
    )
    readmit_after: float = Field(
        60.0,
        gt=0,
        description="an excluded slot gets a health probe this many seconds after its "
        "exclusion (twice as long after each further one) and rejoins if it passes (inf: never)",
    )
    restart_window: float = Field(
        60.0,
        ge=0.001,
        le=86_400,
        description="the escalation's memory, seconds: more than 3 restarts of a slot, or 3 "
        "failing slots of a node, within it exclude it; an excluded slot that stayed back "
        "this long starts its probe backoff again",
    )
    # a long chaos schedule: the cluster soak plans 1,080 faults for one task
    inject: list[str] = Field(default_factory=list, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    model: dict[str, Any] | None = None
    global_batch: int | None = Field(None, ge=1, le=1 << 24)

    @field_validator("args", mode="before")
    @classmethod
    def _args_as_text(cls, v: Any) -> Any:
        """``[--steps, 150]``: YAML reads 150 as a number; a script's argument is its text."""
        if isinstance(v, list):
            return [_text(a) for a in v]

    @model_validator(mode="before")
    @classmethod
    def _reduce_for_device(cls, data: Any) -> Any:
        """No ``reduce`` given: the device's default, as ``unicron run`` chooses it."""
        if isinstance(data, dict) and "reduce" not in data and data.get("device") == "cuda":
            return {**data, "reduce": "fast"}
        return data

    @model_validator(mode="after")
    def _device_supports_reduce(self) -> TaskSpec:
        """``unicron run``'s check (:func:`unicron.runtime.device.check`), on every submit."""
        from unicron.runtime.device import REDUCE_MODES

        if self.reduce not in REDUCE_MODES[self.device]:
            allowed = ", ".join(REDUCE_MODES[self.device])
            raise ValueError(
                f"reduce {self.reduce} is not supported with device {self.device} (supported: "
                f"{allowed}); see docs/runtime.md, Accelerators"
            )
        return self

    @model_validator(mode="after")
    def _whole_replicas(self) -> TaskSpec:
        """Workers come in whole replicas of ``tp * pp`` ranks."""
        n = self.replica_ranks
        if n > 1 and (self.workers.min % n or self.workers.max % n):
            raise ValueError(
                f"workers: min ({self.workers.min}) and max ({self.workers.max}) must be "
                f"multiples of tp x fsdp x pp ({n}): a replica is that many workers"
            )
        return self

    @field_validator("pp_choices", "tp_choices", mode="before")
    @classmethod
    def _depths(cls, v: Any) -> Any:
        """``--pp-choices 2,1`` (the flag's text) as the list."""
        return depths_of(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _layouts(self) -> TaskSpec:
        """Each pipeline depth the task may run at is in 1..64 and its replica fits in the
        task's workers (ranks beyond whole replicas wait: the chosen depth trains most)."""
        for pp in self.pp_choices:
            if pp < 1 or pp > 64:
                raise ValueError(f"pp_choices: {pp} is not a pipeline depth in 1..64")
            if self.tp * pp > self.workers.max:
                raise ValueError(
                    f"pp_choices: at pp {pp} a replica is {self.tp * pp} workers, more than the "
                    f"task's maximum ({self.workers.max})"
                )
        for tp in self.tp_choices:
            if tp < 1 or tp > 64:
                raise ValueError(f"tp_choices: {tp} is not a tensor-parallel degree in 1..64")
            if tp * min(self.depths) > self.workers.max:
                raise ValueError(
                    f"tp_choices: at tp {tp} a replica is at least {tp * min(self.depths)} "
                    f"workers, more than the task's maximum ({self.workers.max})"
                )
        return self

    @model_validator(mode="after")
    def _zero_layouts(self) -> TaskSpec:
        """A sharded optimizer keeps one layout: its shares are by parameter of a place."""
        if self.zero and (self.pp_choices or self.tp_choices):
            which = "pp_choices" if self.pp_choices else "tp_choices"
            raise ValueError(
                f"zero 1 with {which}: a task with a sharded optimizer keeps its layout "
                "(docs/runtime.md, Sharded optimizer state)"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_alone(self) -> TaskSpec:
        """FSDP inside a replica is the replica's whole split, for now."""
        if self.fsdp > 1:
            other = [
                name
                for name, on in (
                    ("tp", self.tp > 1), ("pp", self.pp > 1), ("zero 1", self.zero),
                    ("pp_choices", self.pp_choices), ("tp_choices", self.tp_choices),
                )
                if on
            ]  # fmt: skip
            if other:
                raise ValueError(
                    f"fsdp {self.fsdp} with {other[0]}: an FSDP replica is not split otherwise "
                    "yet (docs/runtime.md, FSDP inside a replica)"
                )
        return self

    @property
    def block(self) -> int:
        """A replica stage's ranks on one node: ``tp`` tensor-parallel x ``fsdp`` ranks."""
        return self.tp * self.fsdp

    @property
    def depths(self) -> tuple[int, ...]:
        """The pipeline depths the task runs at: ``pp``, then the other choices."""
        return (self.pp, *dict.fromkeys(d for d in self.pp_choices if d != self.pp))

    @property
    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees the task runs at: ``tp``, then the other choices."""
        return (self.block, *dict.fromkeys(t for t in self.tp_choices if t != self.tp))

    @property
    def layouts(self) -> tuple[tuple[int, int], ...]:
        """The ``(tp, pp)`` layouts the task runs at, its own first (as
        :func:`unicron.parallel.layouts` reads them in the worker)."""
        return tuple((t, p) for t in self.degrees for p in self.depths)

    @property
    def smallest_layout(self) -> tuple[int, int]:
        """The ``(tp, pp)`` of its fewest ranks per replica (the first such in
        :attr:`layouts`): the grain the planner gives and takes slots in, and groups them by
        (the coordinator picks the layout for the count it gets)."""
        return min(self.layouts, key=lambda lay: lay[0] * lay[1])

    @property
    def smallest_replica(self) -> int:
        """Ranks per replica at :attr:`smallest_layout`."""
        tp, pp = self.smallest_layout
        return tp * pp

    @property
    def replica_ranks(self) -> int:
        """Ranks per replica: ``tp * fsdp * pp``."""
        return self.block * self.pp

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            why = refused_env(name) or ("longer than 4096 characters" if len(value) > 4096 else "")
            if why:
                raise ValueError(f"{name}: {why}")
        return v

    @field_validator("inject")
    @classmethod
    def _faults(cls, v: list[str]) -> list[str]:
        from unicron.detect.classify import KINDS
        from unicron.runtime.inject import parse

        for spec in v:
            try:
                parse(spec, KINDS)
            except UsageError as exc:
                raise ValueError(str(exc)) from exc
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from unicron.planner.spec import _model

            try:
                _model(v, "model")
            except UsageError as exc:
                raise ValueError(str(exc)) from exc
        return v

    @model_validator(mode="after")
    def _global_batch_with_model(self) -> TaskSpec:
        """The performance model prices a model at a global batch: both, or neither."""
        if (self.model is None) != (self.global_batch is None):
            raise ValueError(
                "model and global_batch go together (the planner prices a model at a global "
                "batch: sequences per step)"
            )
        return self

    def planner_model(self) -> ModelSpec | None:
        """The task's ``model`` as the planner's :class:`~unicron.planner.ModelSpec` (None
        without one); the cluster's allocation prices the task with it."""
        if self.model is None:
            return None
        from unicron.planner.spec import _model

        return _model(self.model, "model")

    @field_validator("give_up_after", "readmit_after")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if math.isnan(v):
            raise ValueError("must be a number of seconds")
        return v

    def check_script(self) -> None:
        """The script must be a file here (the service checks on submit: the nodes share the
        file system with it in every setup this repository runs)."""
        if not Path(self.script).is_file():
            raise UsageError(f"task {self.name}: script not found: {self.script}")


def depths_of(text: str) -> list[int]:
    """``--pp-choices``' or ``--tp-choices``' text (``"1,4"``) as numbers; ``ValueError`` if
    it is not."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"{text!r}: whole numbers separated by commas") from exc


def _text(value: Any) -> Any:
    """A number (not a boolean: ``yes`` is likely a mistake) as the text a shell would pass."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
ENV_REFUSED_PREFIXES = ("LD_", "PYTHON", "UNICRON_", "TORCH_", "GLOO_", "NCCL_")
"""a task's ``env`` may not set these: the dynamic loader's (``LD_PRELOAD``,
``LD_LIBRARY_PATH``), Python's start-up (``PYTHONPATH``, ``PYTHONSTARTUP``), and what the
agent itself tells its workers (docs/security.md)"""
ENV_REFUSED = frozenset(
    [
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "IFS",
        "BASH_ENV",
        "ENV",
        "MALLOC_CONF",
        "GCONV_PATH",
        "LOCALDOMAIN",
        "HOSTALIASES",
        "RES_OPTIONS",
        "TMPDIR",
        "CUDA_VISIBLE_DEVICES",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    ]
)
"""... nor these names: what finds programs and libraries, or what the agent sets per slot"""
ENV_ALLOWED = frozenset(["UNICRON_PRELOAD"])
"""... except these: the modules the task's own zygote imports before its workers start
(:data:`unicron.runtime.launcher.ENV_PRELOAD`; the script could import them itself)"""


def refused_env(name: str) -> str:
    """Why a task file's ``env`` may not set ``name`` ("" if it may)."""
    if not ENV_NAME.match(name):
        return "not an environment variable name"
    if name in ENV_ALLOWED:
        return ""
    if name in ENV_REFUSED or name.startswith(ENV_REFUSED_PREFIXES):
        return "a task may not set it (the loader's, Python's or the agent's; docs/security.md)"
    return ""


def one_line(exc: ValidationError) -> str:
    """A pydantic error as one line: every problem, each with its field's path, ``; ``
    between them."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "task"
        problems.append(f"{where}: {err['msg']}")
    return "; ".join(problems)


def parse(data: Any, *, base: Path | None = None) -> TaskSpec:
    """A task spec from parsed YAML/JSON; a relative script is taken from ``base``."""
    if not isinstance(data, dict):
        raise UsageError("a task file must be a mapping of fields")
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        raise UsageError(one_line(exc)) from None
    if base is not None and not Path(spec.script).is_absolute():
        spec = spec.model_copy(update={"script": str((base / spec.script).resolve())})
    ck = spec.checkpoint
    if base is not None and ck.dir and not Path(ck.dir).is_absolute():
        ck = ck.model_copy(update={"dir": str((base / ck.dir).resolve())})
        spec = spec.model_copy(update={"checkpoint": ck})
    return spec


def load(path: Path) -> TaskSpec:
    """Read and validate a task file; one line on any problem."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    try:
        spec = parse(data, base=path.resolve().parent)
        spec.check_script()
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return spec
