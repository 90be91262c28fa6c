"""One definition per task setting (:mod:`unicron.control.flags`): ``unicron run``'s flags
are derived from the task file's model, and the two agree on defaults, choices, help and
bounds."""

from __future__ import annotations

import argparse
import typing

import pytest

from unicron.control import flags as F
from unicron.control import runner
from unicron.control.taskspec import Checkpoint, TaskSpec, parse
from unicron.errors import UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unicron run")
    runner.add_arguments(p)
    return p


def test_every_task_field_is_a_flag_or_said_to_be_the_files_alone() -> None:
    shared = {f.field for f in F.SHARED}
    top = {name for name in TaskSpec.model_fields if name != "checkpoint"}
    assert top - {f for f in shared if "." not in f} == F.FILE_ONLY
    inner = set(Checkpoint.model_fields)
    assert inner - {f.split(".")[1] for f in shared if "." in f} == F.CHECKPOINT_FILE_ONLY


@pytest.mark.parametrize("flag", F.SHARED, ids=lambda f: f.flag)
def test_each_flag_takes_its_default_choices_and_help_from_its_field(flag: F.Flag) -> None:
    info = F.field_of(flag.field)
    action = next(a for a in _parser()._actions if flag.flag in a.option_strings)
    assert info.description and info.description in " ".join((action.help or "").split())
    if flag.default_note:
        assert action.default is None and flag.default_note in (action.help or "")
    elif info.default_factory is not None:  # a list: not given, the field's (empty) default
        assert action.default is None and "(default none)" in (action.help or "")
    else:
        assert action.default == info.default
    if typing.get_origin(info.annotation) is typing.Literal:
        assert tuple(action.choices or ()) == typing.get_args(info.annotation)


@pytest.mark.parametrize("flag", [f for f in F.SHARED if f.metavar in ("MB", "N", "S")],
                         ids=lambda f: f.flag)  # fmt: skip
def test_a_value_out_of_bounds_is_refused_alike_by_the_flag_and_the_task_file(
    flag: F.Flag,
) -> None:
    args = _parser().parse_args([flag.flag, "-1", "train.py"])
    with pytest.raises(UsageError) as cli:
        F.check(args)
    head, _, rest = flag.field.partition(".")
    data = {"name": "t", "script": "t.py", head: {rest: -1} if rest else -1}
    with pytest.raises(UsageError) as file:
        parse(data)
    said = str(file.value).split(": ", 1)[1]  # "bucket_cap_mb: Input should be ..."
    assert str(cli.value) == f"{flag.flag}: {said}, got {-1.0 if flag.metavar != 'N' else -1}"


def test_the_flags_become_the_same_task_as_the_file_says() -> None:
    args = _parser().parse_args(
        ["--bucket-cap-mb", "4", "--threads", "2", "--checkpoint-every", "5", "--mtbf", "60",
         "--readmit-after", "inf", "--on-lost", "drop", "train.py"]
    )  # fmt: skip
    got = F.task_fields(args)
    assert got == {
        "device": "cpu",
        "on_lost": "drop",
        "bucket_cap_mb": 4.0,
        "threads": 2,
        "tp": 1,
        "pp": 1,
        "zero": 0,
        "fsdp": 1,
        "checkpoint": {"every": 5, "mtbf": 60.0, "keep": 3},
        "readmit_after": float("inf"),
        "restart_window": 60.0,
        "give_up_after": 600.0,
    }
    spec = parse({"name": "t", "script": "t.py", **got})
    assert spec.bucket_cap_mb == 4.0 and spec.checkpoint.every == 5 and spec.reduce == "exact"


def test_the_buckets_default_is_one_number() -> None:
    from unicron import protocol
    from unicron.runtime import reduce

    assert TaskSpec.model_fields["bucket_cap_mb"].default == protocol.BUCKET_CAP_MB
    assert reduce.BUCKET_CAP_MB == protocol.BUCKET_CAP_MB


def test_the_workers_settings_go_through_their_environment_unchanged() -> None:
    """The agent writes a task's settings to its workers' environment and the worker reads
    them back (:class:`unicron.protocol.WorkerSettings`): every field has its variable, and
    every value, default or not, comes back as it went."""
    import dataclasses

    from unicron.protocol import WORKER_ENV, WorkerSettings

    assert set(WORKER_ENV) == {f.name for f in dataclasses.fields(WorkerSettings)}
    assert WorkerSettings.from_env(WorkerSettings().env()) == WorkerSettings()
    odd = WorkerSettings(reduce="fast", on_lost="drop", bucket_cap_mb=0.25, checkpoint="/c",
                         checkpoint_every="auto", checkpoint_mtbf_s=61.5, checkpoint_keep=0,
                         resume=True)  # fmt: skip
    assert WorkerSettings.from_env(odd.env()) == odd
    assert WorkerSettings.from_env({}) == WorkerSettings()  # nothing set: the defaults


def test_the_workers_defaults_are_the_task_files() -> None:
    from unicron.protocol import WorkerSettings

    w, spec = WorkerSettings(), TaskSpec.model_validate({"name": "t", "script": "t.py"})
    assert (w.reduce, w.on_lost, w.bucket_cap_mb) == (spec.reduce, spec.on_lost, spec.bucket_cap_mb)
    ck = spec.checkpoint
    assert (w.checkpoint_mtbf_s, w.checkpoint_keep, w.resume) == (ck.mtbf, ck.keep, ck.resume)
