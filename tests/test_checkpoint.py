"""Durable checkpoints, unit level: atomic under kill -9, checksummed, pruned; the interval.

The writer runs in forked children that are SIGKILLed at random moments; afterwards every
checkpoint directory that exists is complete and the newest loads to exactly what was saved.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from unicron.runtime import checkpoint as C

pytestmark = pytest.mark.timeout(120)

LEDGER = {"dataset_len": 100, "micro_batch_size": 4, "num_microbatches": 8, "seed": 0}
N = 1 << 18  # 1 MiB of float32 per tensor: a write takes long enough to be interrupted


def _parts(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    model = {"w": torch.rand(N, generator=g), "b": torch.full((7,), float(step))}
    return {
        "model": model,
        "optim": {"state": {0: {"exp_avg": torch.rand(N, generator=g)}}, "param_groups": []},
        "train": {"step": step, "ledger": LEDGER},
    }


def _write(root: Path, step: int, keep: int = 0) -> Path:
    parts = _parts(step)
    return C.write(
        root, parts, step=step, world=2, reduce="exact", model=C.describe_model(parts["model"]),
        ledger=LEDGER, keep=keep, now=time.time(),
    )  # fmt: skip


def _writer_loop(root: str, first: int) -> None:
    torch.set_num_threads(1)
    step = first
    while True:
        _write(Path(root), step, keep=2)
        step += 1


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    else:
        assert a == b


@pytest.mark.e2e
def test_kill_9_of_the_writer_never_leaves_a_broken_checkpoint(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(14)
    # kill moments spread over about three writes as long as one takes here and now (a
    # loaded machine writes slower; a fixed window would kill most writers before their first)
    t0 = time.perf_counter()
    _write(tmp_path / "probe", 0)
    window_s = max(0.25, 3 * (time.perf_counter() - t0))
    root, first, loaded = tmp_path / "ck", 0, 0
    for _ in range(24):
        p = ctx.Process(target=_writer_loop, args=(str(root), first), daemon=True)
        p.start()
        time.sleep(rng.uniform(0.0, window_s))
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        # every checkpoint directory is whole: a kill leaves at most a temporary directory
        for path in C.steps(root):
            C.verify(path)
        found = C.load_newest(root)
        if found is not None:
            manifest, parts = found
            _assert_equal(parts, _parts(manifest.step))
            first, loaded = manifest.step + 1, loaded + 1
    assert loaded >= 10, f"only {loaded} of 24 trials had a checkpoint to load"
    # the next writer removes what dead writers left
    _write(root, first)
    assert not list(root.glob(f"{C.TMP_PREFIX}*"))


def test_files_and_directories_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a power cut may not undo: every file and the temporary directory reach the disk
    before the rename publishes the checkpoint, and the root after it."""
    log: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        log.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    root = tmp_path / "ck"
    final = _write(root, 7)
    monkeypatch.undo()
    at = log.index(("rename", str(final)))
    synced = [Path(p) for what, p in log[:at] if what == "fsync"]
    files = [p.name for p in synced if p.parent.parent == root]  # in the temporary directory
    tmp = [i for i, p in enumerate(synced) if p.parent == root and p.name.startswith(C.TMP_PREFIX)]
    assert sorted(files) == sorted(["model.pt", "optim.pt", "train.pt", C.MANIFEST]), log
    assert tmp and tmp[-1] == len(synced) - 1, log  # the directory last, after its files
    assert ("fsync", str(root)) in log[at + 1 :], log


def test_a_flipped_byte_is_detected_and_the_previous_checkpoint_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    _write(root, 5)
    bad = _write(root, 10)
    data = bytearray((bad / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "model.pt").write_bytes(bytes(data))
    with pytest.raises(C.CheckpointError, match=r"model\.pt fails its SHA-256"):
        C.verify(bad)
    with caplog.at_level(logging.WARNING, logger="unicron.runtime.checkpoint"):
        found = C.newest(root)
        loaded = C.load_newest(root)
    assert found is not None and found[1].step == 5
    assert loaded is not None and loaded[0].step == 5
    _assert_equal(loaded[1], _parts(5))
    assert "skipping checkpoint" in caplog.text and "step-000000010" in caplog.text


def test_a_truncated_file_or_missing_manifest_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, 1)
    p2, p3 = _write(root, 2), _write(root, 3)
    (p3 / C.MANIFEST).unlink()
    with open(p2 / "optim.pt", "r+b") as f:
        f.truncate(100)
    found = C.newest(root)
    assert found is not None and found[1].step == 1


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (2, 4, 6, 8):
        _write(root, step, keep=2)
    assert [p.name for p in C.steps(root)] == ["step-000000006", "step-000000008"]
    manifest = C.verify(C.step_dir(root, 8))
    assert manifest.step == 8 and manifest.world == 2 and manifest.reduce == "exact"
    assert set(manifest.files) == {"model.pt", "optim.pt", "train.pt"}
    assert manifest.model == {"w": [[N], "float32"], "b": [[7], "float32"]}


def test_mismatch_names_the_model_layout_or_reduce_mode(tmp_path: Path) -> None:
    m = C.verify(_write(tmp_path, 3))
    same = {"model": m.model, "ledger": LEDGER, "reduce": "exact"}
    assert C.mismatch(m, **same) is None  # type: ignore[arg-type]
    assert "--reduce exact" in str(C.mismatch(m, **{**same, "reduce": "fast"}))  # type: ignore[arg-type]
    other = {"w": [[N + 1], "float32"], "b": [[7], "float32"]}
    assert "another model" in str(C.mismatch(m, **{**same, "model": other}))  # type: ignore[arg-type]
    layout = {**LEDGER, "micro_batch_size": 2}
    assert "data layout" in str(C.mismatch(m, **{**same, "ledger": layout}))  # type: ignore[arg-type]


# -- the interval ------------------------------------------------------------------------------
def test_young_daly_and_the_failure_rate() -> None:
    assert C.young_daly_s(2.0, 3600.0) == pytest.approx(120.0)
    # the prior counts as one failure over its MTBF; observed failures pull it down
    assert C.mtbf_estimate_s(prior_mtbf_s=3600.0, elapsed_s=0.0, failures=0) == 3600.0
    assert C.mtbf_estimate_s(prior_mtbf_s=3600.0, elapsed_s=3600.0, failures=3) == 1800.0
    s = C.IntervalSettings(mtbf_s=3600.0)
    calm = C.choose_interval(s, cost_s=2.0, write_s=1.0, elapsed_s=0.0, failures=0)
    stormy = C.choose_interval(s, cost_s=2.0, write_s=1.0, elapsed_s=3600.0, failures=3)
    assert calm.seconds == pytest.approx(120.0) and "Young/Daly" in calm.reason
    assert stormy.seconds == pytest.approx(math.sqrt(2 * 2.0 * 1800.0))
    # never more often than a write takes
    slow = C.choose_interval(s, cost_s=0.001, write_s=30.0, elapsed_s=0.0, failures=0)
    assert slow.seconds == 30.0 and "write time" in slow.reason
    first = C.choose_interval(s, cost_s=None, write_s=None, elapsed_s=0.0, failures=0)
    assert first.seconds == math.inf and "measured" in first.reason
    fixed = C.choose_interval(
        C.IntervalSettings(every_steps=5), cost_s=2.0, write_s=1.0, elapsed_s=0.0, failures=9
    )
    assert fixed.steps == 5 and fixed.seconds is None and "fixed" in fixed.reason


@pytest.mark.parametrize(
    "kw", [{"every_steps": -1}, {"mtbf_s": 0.0}, {"mtbf_s": math.inf}, {"keep": -1}]
)
def test_interval_settings_are_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        C.IntervalSettings(**kw)


def test_the_checkpointer_writes_at_its_interval_and_logs_why(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ck = C.Checkpointer(
        root=tmp_path, settings=C.IntervalSettings(mtbf_s=100.0), reduce="fast", ledger=LEDGER,
        emit=lambda e, **f: events.append((e, f)), started=0.0,
    )  # fmt: skip
    ck.at_boundary(model, opt, step=1, world=3, now=1.0)  # measures the copy, writes nothing
    assert ck.cost_s is not None and not C.steps(tmp_path)
    interval = math.sqrt(2 * ck.cost_s * 101.0)
    ck.at_boundary(model, opt, step=2, world=3, now=1.0 + interval * 0.5)
    assert not C.steps(tmp_path)
    ck.at_boundary(model, opt, step=3, world=3, now=1.0 + interval * 1.01)
    ck.join()
    assert [p.name for p in C.steps(tmp_path)] == ["step-000000003"]
    names = [e for e, _ in events]
    assert names[:2] == ["checkpoint_interval", "checkpoint_saved"], names
    assert "Young/Daly" in events[0][1]["reason"]
    assert events[1][1]["ok"] and events[1][1]["step"] == 3 and events[1][1]["write_s"] > 0
    manifest, parts = C.load(C.step_dir(tmp_path, 3))
    assert manifest.world == 3 and manifest.reduce == "fast"
    fresh = torch.nn.Linear(3, 2)
    assert C.restore(parts, fresh, torch.optim.AdamW(fresh.parameters())) == 3
    assert torch.equal(fresh.weight, model.weight)


def test_a_fixed_interval_writes_every_k_steps(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ck = C.Checkpointer(
        root=tmp_path, settings=C.IntervalSettings(every_steps=2, keep=0), reduce="exact",
        ledger=LEDGER, emit=lambda e, **f: None,
    )  # fmt: skip
    for step in range(1, 6):
        ck.at_boundary(model, opt, step=step, world=1, now=float(step))
    ck.join()
    assert [p.name for p in C.steps(tmp_path)] == ["step-000000002", "step-000000004"]


def test_the_benchmark_measures_the_extra_cost_within_one_run() -> None:
    """bench/checkpoint.py's figures: a step carrying a checkpoint against the steps of the
    same run that carry none (the checkpoint of step s falls in step s's wall time)."""
    from bench.checkpoint import figures

    ts, events = 0.0, []
    for step in range(12):
        ts += 1.5 if step in (5, 10) else 1.0  # steps 5 and 10 carry checkpoints 5 and 10
        events.append({"event": "step_end", "step": step, "ts": ts})
    events += [{"event": "checkpoint_saved", "step": s, "ok": True, "copy_s": 0.1, "write_s": 0.3}
               for s in (5, 10)]  # fmt: skip
    f = figures(events, warmup=3)
    assert f["step_extra_s"] == pytest.approx(0.5) and f["checkpoints"] == 2
    assert f["train_s"] == pytest.approx(9.0)  # steps 4..11 (3 is the first one timed)
    assert f["overhead_est_pct"] == pytest.approx(100 * 0.5 * 2 / 9.0)
    assert f["step_median_s"] == 1.0 and f["copy_s"] == 0.1 and f["write_s"] == 0.3


def test_failures_seen_shorten_the_automatic_interval_and_the_log_says_why(
    tmp_path: Path,
) -> None:
    """Each member lost (an urgent epoch) counts as a failure: the MTBF estimate falls, the
    Young/Daly interval with it, and a new ``checkpoint_interval`` event gives the reason."""
    events: list[tuple[str, dict[str, Any]]] = []
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ck = C.Checkpointer(
        root=tmp_path, settings=C.IntervalSettings(mtbf_s=100.0), reduce="exact", ledger=LEDGER,
        emit=lambda e, **f: events.append((e, f)), started=0.0,
    )  # fmt: skip
    ck.at_boundary(model, opt, step=1, world=2, now=0.0)  # measures the copy
    calm = ck.interval
    for _ in range(3):
        ck.note_failure()
    ck.due(2, now=0.0)
    stormy = ck.interval
    assert calm is not None and stormy is not None and calm.seconds and stormy.seconds
    assert stormy.seconds == pytest.approx(calm.seconds / 2)  # MTBF 100 s -> 25 s
    logged = [f for e, f in events if e == "checkpoint_interval"]
    assert len(logged) == 2 and logged[1]["failures"] == 3, logged
    assert "3 failure(s)" in logged[1]["reason"] and "MTBF 25 s" in logged[1]["reason"]


def test_the_rng_states_come_back_through_a_written_checkpoint(tmp_path: Path) -> None:
    """torch's, Python's and numpy's global generators draw the same after a restore (the
    GPUs' too where CUDA is initialised: not on these machines)."""
    import numpy as np

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    snap = C.snapshot(model, opt, step=5, ledger=LEDGER)
    expected = (torch.rand(4), random.random(), np.random.rand(4))
    C.write(
        tmp_path, snap.parts, step=5, world=1, reduce="exact", model=snap.model,
        ledger=LEDGER, keep=0, now=time.time(),
    )  # fmt: skip
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    _, parts = C.load(C.step_dir(tmp_path, 5))
    assert C.restore(parts, model, opt) == 5
    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(4), expected[2])


def test_a_shard_that_ran_ahead_keeps_the_last_step_every_shard_has(tmp_path: Path) -> None:
    """Each shard's writer prunes its own directory: one that ran ahead of a writer that died
    must keep the newest step every shard has whole, or the task's state is in no checkpoint
    (found by the cluster soak: shard 0 kept 297-298, shard 1 295-296)."""
    s0, s1 = tmp_path / "shard0", tmp_path / "shard1"
    for step in (1, 2, 3):
        _write(s0, step, keep=2)
        _write(s1, step, keep=2)
    for step in (4, 5, 6):  # shard 1's writer died after step 3
        _write(s0, step, keep=2)
    assert [p.name for p in C.steps(s0)] == [f"step-{s:09d}" for s in (2, 3, 4, 5, 6)]
    assert C.newest_step(tmp_path, 2) == 3
    _write(s1, 4, keep=2)
    _write(s1, 5, keep=2)  # caught up: steps 4 and 5 are whole, shard 0 drops 2 and 3 next
    _write(s0, 7, keep=2)
    assert [p.name for p in C.steps(s0)] == [f"step-{s:09d}" for s in (4, 5, 6, 7)]
    assert [p.name for p in C.steps(s1)] == [f"step-{s:09d}" for s in (4, 5)]


def test_a_checkpoint_counts_only_when_every_shard_of_one_layout_has_the_step(
    tmp_path: Path,
) -> None:
    """The coordinator's question (can the task outlive its last replica?): a TP=2 checkpoint
    one of whose writers died before writing its shard cannot be loaded, so it does not count
    (the task fails at once instead of restarting workers that find nothing); another
    layout's complete one does (a layout change: ``tp1pp1``, ``pp2``)."""
    from unicron.runtime.checkpoint import MANIFEST, PREFIX, has_checkpoint, layout_dir

    def written(where: Path, step: int) -> None:
        d = where / f"{PREFIX}{step:09d}"
        d.mkdir(parents=True)
        (d / MANIFEST).write_text("{}")

    own = (2, 1)
    assert layout_dir(tmp_path, own, own) == tmp_path
    assert layout_dir(tmp_path, own, (2, 2)) == tmp_path / "pp2"
    assert layout_dir(tmp_path, own, (1, 1)) == tmp_path / "tp1pp1"
    written(tmp_path / "shard0", 2)
    assert not has_checkpoint(tmp_path, own, [(1, 1)])
    written(tmp_path / "tp1pp1", 4)
    assert has_checkpoint(tmp_path, own, [(1, 1)])
    assert not has_checkpoint(tmp_path, own)  # the other layout is not the task's
    written(tmp_path / "shard1", 2)
    assert has_checkpoint(tmp_path, own)
    assert not has_checkpoint(None) and not has_checkpoint(tmp_path / "none")
