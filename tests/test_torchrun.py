"""torchrun's face of ``unicron run``: its flag spellings (mapped or refused with a reason) and
the variables a worker finds in its environment in each epoch (pure parts, no processes)."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import TRAIN
from unicron.control import runner
from unicron.errors import UsageError
from unicron.protocol import EpochInfo
from unicron.worker import epoch_env


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    runner.add_arguments(p)
    args = p.parse_args([*argv, str(TRAIN)])
    runner.validate(args)
    return args


def test_torchrun_spellings_mean_ours() -> None:
    args = _parse("--nproc_per_node", "3", "--nnodes", "2:2", "--rdzv_id", "job7", "--standalone")
    assert (args.nproc_per_node, args.nnodes, args.task) == (3, 2, "job7")
    assert _parse("--nproc-per-node", "cpu").nproc_per_node >= 1
    assert _parse("--log_dir", "/tmp/x").log_dir == "/tmp/x"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-restarts", "3"], ["--max-restarts is not supported", "escalation"]),
        (["--max_restarts=3"], ["--max-restarts is not supported"]),
        (["--rdzv-backend", "c10d"], ["--rdzv-backend", "coordinator's store"]),
        (["--rdzv_endpoint", "h:29400"], ["--rdzv-endpoint"]),
        (["--master-port", "29500"], ["--master-port", "MASTER_PORT"]),
        (["--node-rank", "1"], ["--node-rank", "unicron agent"]),
        (["--no-python"], ["--no-python", "script"]),
        (["-m"], ["--module", "script"]),
        (["--nnodes", "1:4"], ["elastic ranges are not supported"]),
        (["--nproc-per-node", "gpux"], ["--nproc-per-node must be"]),
    ],
)
def test_torchrun_flags_without_a_meaning_here_are_refused_with_why(
    argv: list[str], words: list[str]
) -> None:
    with pytest.raises(UsageError) as exc:
        _parse(*argv)
    assert "\n" not in str(exc.value)
    for word in words:
        assert word in str(exc.value)


def test_epoch_env_is_torchruns_view_of_the_epoch() -> None:
    # slots 0..3 on node 0, 4..7 on node 1; slot 1 failed: epoch 2 has the other seven
    info = EpochInfo(2, (0, 2, 3, 4, 5, 6, 7), (0, 0, 0, 1, 1, 1, 1), urgent=True)
    env = epoch_env(info, 5, ("127.0.0.1", 4321))
    assert env == {
        "RANK": "4",
        "WORLD_SIZE": "7",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4321",
        "UNICRON_EPOCH": "2",
    }
    node0 = epoch_env(info, 3, ("127.0.0.1", 4321))
    assert (node0["RANK"], node0["LOCAL_RANK"], node0["LOCAL_WORLD_SIZE"]) == ("2", "2", "3")
