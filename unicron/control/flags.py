"""The task settings as ``unicron run`` flags, derived from the task file's model.

A setting that a task file and ``unicron run`` share has one definition: its field in
:class:`~unicron.control.taskspec.TaskSpec` (or its ``checkpoint`` mapping), with its
default, its bounds and its description. :data:`SHARED` says which flag stands for which
field; :func:`add_to` makes the argparse flags from the fields (type, choices, default,
help), :func:`task_fields` turns the parsed flags back into the task file's fields, and
:func:`check` validates them against the same model, naming the flag of every problem on one
line. The runner (:mod:`unicron.control.runner`) calls all three; the agent and the worker
get the values through the task's assignment, never a default of their own.
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from unicron.control.taskspec import Checkpoint, TaskSpec
from unicron.errors import UsageError


@dataclass(frozen=True)
class Flag:
    """One shared setting: the task file's field (``checkpoint.keep`` inside the mapping)
    and the flag of ``unicron run``."""

    field: str
    flag: str
    metavar: str | None = None
    default_note: str = ""
    """said instead of the field's default where the flag's default differs (``--reduce``:
    the device's)"""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


SHARED: tuple[Flag, ...] = (
    Flag("reduce", "--reduce", default_note="exact on cpu, fast on cuda"),
    Flag("device", "--device"),
    Flag("on_lost", "--on-lost"),
    Flag("bucket_cap_mb", "--bucket-cap-mb", "MB"),
    Flag("threads", "--threads", "N"),
    Flag("tp", "--tp", "N"),
    Flag("pp", "--pp", "N"),
    Flag("pp_choices", "--pp-choices", "P,Q"),
    Flag("tp_choices", "--tp-choices", "T,U"),
    Flag("zero", "--zero", "0|1"),
    Flag("fsdp", "--fsdp", "N"),
    Flag("checkpoint.every", "--checkpoint-every", "K|auto"),
    Flag("checkpoint.mtbf", "--mtbf", "S"),
    Flag("checkpoint.keep", "--checkpoint-keep", "N"),
    Flag("readmit_after", "--readmit-after", "S"),
    Flag("restart_window", "--restart-window", "S"),
    Flag("give_up_after", "--give-up-after", "S"),
)
"""Every task setting ``unicron run`` takes as a flag, in its ``--help`` order."""

FILE_ONLY = frozenset(
    ["name", "script", "args", "workers", "weight", "inject", "env", "model", "global_batch"]
)
"""Task-file fields that are not one of :data:`SHARED`: ``unicron run`` has them in another
form (``--task``, the script and its arguments, ``--nnodes``/``--nproc-per-node`` and
``--min-workers``, ``--inject``) or a cluster's placement alone uses them."""

CHECKPOINT_FILE_ONLY = frozenset(["dir", "resume"])
"""``checkpoint`` fields that ``unicron run`` takes as ``--checkpoint-dir`` and ``--resume``
(one directory, checked against the other's)."""


def field_of(path: str) -> FieldInfo:
    """The pydantic field behind ``path`` (``bucket_cap_mb``, ``checkpoint.keep``)."""
    model: type[BaseModel] = TaskSpec
    head, _, rest = path.partition(".")
    if rest:
        assert head == "checkpoint", path
        model, head = Checkpoint, rest
    return model.model_fields[head]


def _choices(info: FieldInfo) -> tuple[str, ...] | None:
    if typing.get_origin(info.annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(info.annotation))
    return None


def _kind(info: FieldInfo) -> type:
    """What argparse parses the flag as: the field's number type, else text."""
    return info.annotation if info.annotation in (int, float) else str  # type: ignore[return-value]


def _say(value: Any) -> str:
    if value == []:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def add_to(p: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`SHARED` to ``p``: its type, choices, default and help from
    its field."""
    for f in SHARED:
        info = field_of(f.field)
        default = None if f.default_note or info.default_factory else info.default
        said = f.default_note or _say(info.get_default(call_default_factory=True))
        p.add_argument(
            f.flag,
            dest=f.dest,
            type=_kind(info),
            choices=_choices(info),
            default=default,
            metavar=f.metavar,
            help=f"{info.description} (default {said})",
        )


def task_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags of :data:`SHARED` as task-file fields (``checkpoint`` a mapping)."""
    out: dict[str, Any] = {}
    for f in SHARED:
        value = getattr(args, f.dest)
        if value is None:
            continue  # the field's default, or the device's (--reduce)
        if f.field == "checkpoint.every" and isinstance(value, str) and value.isdigit():
            value = int(value)
        head, _, rest = f.field.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[head] = value
    return out


def check(args: argparse.Namespace, fields: Mapping[str, Any] | None = None) -> None:
    """Validate the flags of :data:`SHARED` against the task file's model; raise
    :class:`~unicron.errors.UsageError` naming the flag of every problem, on one line."""
    by_loc = {tuple(f.field.split(".")): f.flag for f in SHARED}
    data = {"name": "run", "script": "run", **(fields or task_fields(args))}
    tp, pp, fsdp = data.get("tp", 1), data.get("pp", 1), data.get("fsdp", 1)
    if all(isinstance(n, int) and n >= 1 for n in (tp, pp, fsdp)):
        # whole replicas, as many as any layout needs: the runner checks the counts itself
        data.setdefault("workers", {"min": tp * pp * fsdp, "max": tp * pp * fsdp * 64})
    try:
        TaskSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            flag = next((by_loc[loc[:n]] for n in (2, 1) if loc[:n] in by_loc), None)
            got = err.get("input")
            if flag is None:
                problems.append(err["msg"].removeprefix("Value error, "))
            elif isinstance(got, float) and math.isnan(got):
                problems.append(f"{flag}: {err['msg']}, got nan")
            else:
                problems.append(f"{flag}: {err['msg']}, got {got!r}")
        raise UsageError("; ".join(dict.fromkeys(problems))) from None
