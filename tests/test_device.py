"""Devices per slot (:mod:`unicron.runtime.device`): the pure rules, the worker API on the CPU path,
and bad input (a device the node lacks, a reduce mode the device does not support, a model too
large for a slot) refused with exit code 2 before training starts, nothing left running."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from unicron.errors import UsageError
from unicron.runtime import device as D

SCRIPTS = Path(__file__).parent / "scripts"


def test_backend_follows_the_device() -> None:
    assert D.backend("cpu", 4, 0) == "gloo"
    assert D.backend("cuda", 4, 8) == "nccl"
    assert D.backend("cuda", 4, 1) == "gloo"  # slots share a GPU: NCCL refuses that


def test_the_agent_maps_a_nodes_slots_to_its_gpus_round_robin() -> None:
    assert [D.slot_device("cuda", r, 2) for r in range(4)] == ["cuda:0", "cuda:1"] * 2
    assert D.slot_device("cpu", 3, 2) == "cpu"
    env = D.slot_env("cuda", 1, 4, 8)
    assert env == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", D.ENV_DEVICE: "cuda:1"}


def test_the_worker_learns_its_device_from_its_environment() -> None:
    assert D.current({}) == torch.device("cpu")
    assert D.current({D.ENV_DEVICE: "cpu", "LOCAL_RANK": "2"}) == torch.device("cpu")
    if D.gpu_count() == 0:  # this machine: asking for a GPU is bad input
        with pytest.raises(UsageError, match="cuda:2"):
            D.current({D.ENV_DEVICE_KIND: "cuda", "LOCAL_RANK": "2"})


def test_bad_device_and_reduce_combinations_are_refused() -> None:
    D.check("cpu", "exact", 0)
    D.check("cuda", "fast", 1)
    with pytest.raises(UsageError, match="--reduce exact is not supported with --device cuda"):
        D.check("cuda", "exact", 8)
    with pytest.raises(UsageError, match="no CUDA device"):
        D.check("cuda", "fast", 0)
    assert D.default_reduce("cpu") == "exact" and D.default_reduce("cuda") == "fast"


def test_a_microbatch_seed_draws_what_torch_manual_seed_draws_without_formatting_stacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's per-micro-batch seed is torch.manual_seed's on CPU (the same dropout
    masks, so runs keep their bits and the baselines draw alike), minus the stack trace that
    torch formats for each accelerator backend it seeds lazily."""
    torch.manual_seed(1234)
    want = torch.rand(8), torch.randn(3, 3)
    D.seed(1234, torch.device("cpu"))
    got = torch.rand(8), torch.randn(3, 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))

    formatted: list[int] = []
    real = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a: formatted.append(1) or real(*a))
    D.seed(7, torch.device("cpu"))
    assert formatted == []
    torch.manual_seed(7)  # what it replaces: one trace per backend not initialized
    assert formatted


def test_a_model_too_large_for_a_slot_is_refused() -> None:
    D.check_fits(1000, "exact", 40_000, torch.device("cpu"))
    with pytest.raises(UsageError, match="does not fit"):
        D.check_fits(1001, "exact", 32_000, torch.device("cpu"))
    assert D.slot_memory(torch.device("cpu"), 4) * 4 > 2**28  # MemTotal, shared by 4 slots


def _survivors(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker`` (this test's own temp directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd and "pytest" not in cmd:
                found.append(f"{pid}: {cmd}")
    return found


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "cuda", "--reduce", "exact"), "--reduce exact is not supported"),
        (("--device", "cuda"), "no CUDA device"),
    ],
)
@pytest.mark.skipif(D.gpu_count() > 0, reason="the CPU path: this node must lack a GPU")
def test_cuda_asked_of_a_node_without_it_or_with_exact_mode_exits_2(
    run: Any, flags: tuple[str, ...], message: str
) -> None:
    r = run("--nproc-per-node", "2", *flags, steps=2, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one clear line
    assert not r.events  # before anything started


@pytest.mark.e2e
def test_a_model_too_large_for_the_slots_exits_2_and_nothing_is_left_running(
    run: Any, tmp_path: Path
) -> None:
    r = run("--nproc-per-node", "2", script=SCRIPTS / "huge_model.py", steps=None, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "the model does not fit" in r.stderr and "1099512.7M parameters" in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line
    assert r.stderr.startswith("unicron: error: the model does not fit")
    assert not r.of("step_end") and not r.of("epoch_begin")
    assert r.task_end["status"] == "failed"
    assert not r.of("action")  # refused, not restarted
    assert not _survivors(str(tmp_path)), _survivors(str(tmp_path))


@pytest.mark.e2e
def test_each_worker_trains_on_its_device_and_learns_its_local_rank(
    run: Any, tmp_path: Path
) -> None:
    out = tmp_path / "where"
    r = run("--nproc-per-node", "2", script=SCRIPTS / "device_report.py", steps=None,
            script_args=("--out", str(out)), timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(p.read_text() for p in out.glob("slot*.txt"))
    assert lines == ["cpu 0 2 ['cpu']", "cpu 1 2 ['cpu']"], lines


class _StuckWork:
    """An NCCL work that never completes (a peer is gone)."""

    def is_completed(self) -> bool:
        return False


class _Communicator:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


@pytest.mark.e2e
@pytest.mark.timeout(30)
def test_a_superseded_nccl_epoch_is_left_by_aborting_its_communicator() -> None:
    """The NCCL wait logic on the CPU: a collective that never completes is polled in slices;
    once a newer epoch is announced the communicator is aborted (once) and the epoch left,
    long before the group's timeout. (The real NCCL path is unverified: docs/runtime.md.)"""
    import threading
    import time

    import torch.distributed as dist

    from unicron.protocol import EpochInfo, epoch_info_key, epoch_key
    from unicron.runtime.group import EpochGroup, EpochOver, EpochWatch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(epoch_info_key("t", 1), EpochInfo(1, (0, 1), (0, 0), False).to_json())
    store.set(epoch_key("t"), "1")
    watch = EpochWatch(store, "t")
    g = EpochGroup(store, watch, watch.info(1), 0, slice_s=0.05, timeout_s=60.0,
                   backend="nccl", device=torch.device("cuda", 0))  # fmt: skip
    assert g.wire == torch.device("cuda", 0)
    comm = _Communicator()
    g.pg = comm

    def announce() -> None:
        time.sleep(0.3)
        store.set(epoch_info_key("t", 2), EpochInfo(2, (0,), (0,), True).to_json())
        store.set(epoch_key("t"), "2")

    threading.Thread(target=announce).start()
    t0 = time.monotonic()
    with pytest.raises(EpochOver, match="aborted"):
        g.wait(_StuckWork())
    assert time.monotonic() - t0 < 5.0
    assert comm.aborted == 1
    g.leave()  # the worker leaves again on EpochOver: still aborted once
    assert comm.aborted == 1
