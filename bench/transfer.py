"""State transfer against state size: bandwidth, peak memory, and recovery of a real run.

Three sizes of the example GPT (``bench/sized_gpt.py``: about 5 MB, 100 MB and 1 GB of
state, parameters plus AdamW's two moments). For each, in one run:

- **bandwidth and peak memory** (processes on this machine, loopback, gloo): the streamed
  transfer of :mod:`unicron.runtime.transfer` from one holder and from two holders (in parallel
  above one chunk of model; below, the transfer takes the first alone) to a
  joiner whose model is built but whose optimizer has no state yet (as after a restart),
  every member's state laid out as a worker lays it out (``transfer.lay_out_parameters``
  when it starts, ``lay_out_optimizer_state`` after a step); the
  blob transfer it replaced (``torch.save`` of the whole state into one buffer, broadcast,
  ``torch.load``); and the floor, a plain ``ProcessGroupGloo.broadcast`` of the same bytes
  already flat in one buffer. Each is timed on the receiver from the start of the transfer
  to its end, on a group whose connections are already up (as in a transition, where the
  ledger exchange has made them). Peak memory is the receiver's and the sender's resident
  set high-water mark during the transfer (``VmHWM``, reset through ``/proc/self/clear_refs``)
  minus their resident set before it: the extra memory the transfer costs. A joiner must
  allocate the optimizer's moments (2/3 of the state) in any case.
- **recovery** (a real ``unicron run``, 2 workers, ``--reduce fast``, no checkpoint):
  worker 1 is SIGKILLed mid-step at step 2; ``recovery_s`` is the first step finished after
  the fault minus the fault (the survivor goes on alone), ``rejoin_s`` the first step
  finished by an epoch that has the restarted worker back (it forked, built its model and
  received the state), ``transfer_s`` that epoch's transition (``transition_end``).

The machine is shared with other jobs (2 cores): every arm runs ``REPS[size]`` times, the
arms interleaved (one of each per repetition), and each is summarised by the median of its
repetitions, the floor included (``bandwidth_over_floor`` is each stream's sample over the
floor's median, so its median is the ratio of the medians). Small states are cheap to repeat
and noisy (a 5 MB floor takes 4-7 ms), so they get more repetitions, in odd counts (a real
median): 9 at 5 MB, 3 at 100 MB, 2 at 1 GB (the mean of two). Recovery runs: two per size,
one in ``--quick`` and at 1 GB.
``python -m bench --scenario transfer`` (or ``python -m bench.transfer [--quick]``) writes
``bench/results/transfer.json`` and the plot ``bench/results/transfer.png``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    Row,
    bench_parser,
    free_port,
    make_row,
    print_table,
    save_figure,
    save_scenario,
)
from bench.events import read_events

SCENARIO = "transfer"
ROOT = Path(__file__).resolve().parents[1]
ARMS = ("floor", "stream", "stream x2", "blob")
"""floor: plain broadcast of flat bytes; stream: unicron.runtime.transfer, one holder;
stream x2: two holders, each a share (a model within one chunk, the 5 MB size, comes from the
first alone, ``transfer.senders``, point to point over the epoch's group); blob: one
torch.save'd buffer, broadcast (what the stream replaced)"""


# -- memory ---------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the resident-set high-water mark; return the resident set now (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def _peak_extra(before: int) -> int:
    return _status_kb("VmHWM") * 1024 - before


# -- one measurement: holders and a joiner in processes -------------------------------------
def _member(arm: str, size: str, rank: int, world: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from bench.sized_gpt import build
    from unicron.protocol import EpochInfo, epoch_info_key, epoch_key
    from unicron.runtime.group import EpochGroup, EpochWatch
    from unicron.runtime.transfer import (
        inventory,
        lay_out_optimizer_state,
        lay_out_parameters,
        model_tensors,
        state_tensors,
        transfer,
        warm_up,
    )

    torch.set_num_threads(1)
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")  # as the agent starts every worker
    warm_up(torch.device("cpu"))  # as every worker does when it starts
    joiner = rank == world - 1
    model, opt, _ = build(size, seed=1 if joiner else 0)
    lay_out_parameters(model)  # as every worker does when it starts
    if not joiner:  # a trained holder: give AdamW its moments with one step
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lay_out_optimizer_state(opt)  # as a worker does after its first step
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(300))
    if rank == 0:
        store.set(
            epoch_info_key("b", 1), EpochInfo(1, tuple(range(world)), (0,) * world, False).to_json()
        )
        store.set(epoch_key("b"), "1")
    watch = EpochWatch(store, "b")
    while watch.latest() < 1:
        time.sleep(0.01)
    g = EpochGroup(store, watch, watch.info(1), rank, slice_s=0.05, timeout_s=300.0)
    g.rendezvous()
    # a worker takes its inventory while the ledger exchange's all-gather is on the wire
    have = (
        inventory(model_tensors(model), opt, manifest=not joiner)
        if arm.startswith("stream")
        else None
    )
    g.allreduce(torch.zeros(1))  # connections up, as after the ledger exchange
    flat = None
    if arm == "floor":
        flat = (
            torch.cat([t.reshape(-1).float() for t in state_tensors(model, opt)[1]])
            if not joiner
            else None
        )
        n = torch.tensor([0 if flat is None else flat.numel()], dtype=torch.int64)
        g.broadcast(n, 0)
        flat = flat if flat is not None else torch.empty(int(n.item()))
        g.allreduce(torch.zeros(1))
    before = _reset_peak()
    t0 = time.perf_counter()
    nbytes = 0
    if arm == "floor":
        assert flat is not None
        g.broadcast(flat, 0)
        nbytes = flat.numel() * 4
    elif arm.startswith("stream"):
        holders = list(range(world - 1))
        stats = transfer(
            g,
            model,
            opt,
            holders=holders,
            needers=[world - 1],
            device=torch.device("cpu"),
            have=have,
            agreed=True,  # one model's layout on every member, as the ledger exchange finds
        )
        nbytes = stats.nbytes
    else:
        nbytes = _blob(g, model, opt, joiner)
    seconds = time.perf_counter() - t0
    extra = _peak_extra(before)
    g.allreduce(torch.zeros(1))
    out.put((rank, seconds, nbytes, extra))


def _blob(g: Any, model: Any, opt: Any, joiner: bool) -> int:
    """The transfer unicron used before the stream: one serialized blob, broadcast."""
    import io

    import torch

    if not joiner:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    g.broadcast(size, 0)
    if joiner:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    g.broadcast(payload, 0)
    if joiner:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    return int(size.item())


def measure(arm: str, size: str) -> dict[str, float]:
    """One transfer of ``size``'s state by ``arm``: the joiner's seconds, bytes and peak extra
    memory, and the largest peak extra memory of a sender."""
    world = 3 if arm == "stream x2" else 2
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_member, args=(arm, size, r, world, port, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[float, int, int]] = {}
    try:
        deadline = time.monotonic() + 600
        while len(results) < world:
            if time.monotonic() > deadline or not all(
                p.is_alive() or p.exitcode == 0 for p in procs
            ):
                raise RuntimeError(
                    f"{arm} {size}: failed (exit codes {[p.exitcode for p in procs]})"
                )
            try:
                rank, s, n, extra = out.get(timeout=0.5)
                results[rank] = (s, n, extra)
            except Exception:
                continue
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    seconds, nbytes, extra = results[world - 1]
    return {
        "seconds": seconds,
        "mb": nbytes / 1e6,
        "gb_per_s": nbytes / seconds / 1e9,
        "joiner_extra_mb": extra / 1e6,
        "sender_extra_mb": max(results[r][2] for r in range(world - 1)) / 1e6,
    }


# -- recovery in a real run -----------------------------------------------------------------
RUN_STEPS = {"5MB": 80, "100MB": 30, "1GB": 10}
"""steps of a recovery run: enough that the survivor, stepping alone, is still training when
the restarted worker is ready (a worker that comes back after the last step is not counted)"""


def recovery(size: str, workdir: Path, fault_step: int = 2) -> dict[str, float]:
    """A real ``unicron run`` of ``size`` with worker 1 SIGKILLed at ``fault_step``."""
    steps = RUN_STEPS[size]
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "unicron",
        "run",
        "--nproc-per-node",
        "2",
        "--quiet",
        "--reduce",
        "fast",
        "--checkpoint-every",
        "0",
        "--events",
        str(events),
        "--log-dir",
        str(workdir / "logs"),
        "--inject",
        f"crash:rank=1,step={fault_step}",
        str(ROOT / "bench" / "sized_gpt.py"),
        "--size",
        size,
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True, env=env)
    evs = read_events(events)
    fault = next(e["ts"] for e in evs if e["event"] == "fault_injected")
    after = [e for e in evs if e["ts"] > fault]
    first = next(e for e in after if e["event"] == "step_end" and e["step"] >= fault_step)
    back = next(e["epoch"] for e in after if e["event"] == "epoch_begin" and 1 in e["members"])
    rejoin = next(e for e in after if e["event"] == "step_end" and e["epoch"] == back)
    trans = next(e for e in after if e["event"] == "transition_end" and e["epoch"] == back)
    return {
        "recovery_s": first["ts"] - fault,
        "rejoin_s": rejoin["ts"] - fault,
        "transfer_s": trans["duration_s"],
    }


# -- the scenario ---------------------------------------------------------------------------
REPS = {"5MB": 9, "100MB": 3, "1GB": 2}
"""repetitions of each arm per size: odd where a measurement is cheap (a real median)"""


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``)."""
    sizes = ("5MB", "100MB") if quick else ("5MB", "100MB", "1GB")
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    failed: dict[tuple[str, str], str] = {}
    for size in sizes:
        for rep in range(REPS[size]):
            for arm in ARMS:  # interleaved: every arm once per repetition
                key = (arm, size)
                if key in failed:
                    continue
                try:
                    m = measure(arm, size)
                except RuntimeError as exc:
                    failed[key] = str(exc)
                    continue
                samples.setdefault(key, []).append(m)
                print(
                    f"  {size} rep {rep + 1} {arm}: {m['seconds'] * 1e3:.1f} ms, "
                    f"{m['gb_per_s']:.2f} GB/s, joiner +{m['joiner_extra_mb']:.0f} MB, "
                    f"sender +{m['sender_extra_mb']:.0f} MB",
                    flush=True,
                )
    rec: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-transfer-") as tmp:
        for size in sizes:
            for rep in range(1 if size == "1GB" or quick else 2):
                try:
                    r = recovery(size, Path(tmp) / f"{size}-{rep}")
                except (subprocess.SubprocessError, StopIteration) as exc:
                    failed[("unicron run", size)] = f"{type(exc).__name__}: {exc}"
                    break
                rec.setdefault(size, []).append(r)
                print(
                    f"  {size} recovery rep {rep + 1}: "
                    + ", ".join(f"{k}={v:.3g}" for k, v in r.items()),
                    flush=True,
                )
    rows = _rows(sizes, samples, rec, failed)
    _plot(rows, ROOT / "bench" / "results" / "transfer.png")
    return rows


def _rows(
    sizes: tuple[str, ...],
    samples: dict[tuple[str, str], list[dict[str, float]]],
    rec: dict[str, list[dict[str, float]]],
    failed: dict[tuple[str, str], str],
) -> list[Row]:
    rows: list[Row] = []
    for (system, size), reason in failed.items():
        rows.append(
            make_row(
                system=system,
                scenario=SCENARIO,
                metric=f"seconds[{size}]",
                status="failed",
                note=reason[:300],
            )
        )
    for size in sizes:
        for arm in ARMS:
            ms = samples.get((arm, size))
            if not ms:
                continue
            mb = ms[0]["mb"]
            for metric, unit in (
                ("seconds", "s"),
                ("gb_per_s", "GB/s"),
                ("joiner_extra_mb", "MB"),
                ("sender_extra_mb", "MB"),
            ):
                rows.append(
                    make_row(
                        system=arm,
                        scenario=SCENARIO,
                        metric=f"{metric}[{size}]",
                        values=[m[metric] for m in ms],
                        unit=unit,
                        note=f"{mb:.1f} MB moved",
                    )
                )
        floor = samples.get(("floor", size))
        for arm in ("stream", "stream x2", "blob"):
            ms = samples.get((arm, size))
            if floor and ms:
                f = statistics.median(m["gb_per_s"] for m in floor)  # as every row's median
                rows.append(
                    make_row(
                        system=arm,
                        scenario=SCENARIO,
                        metric=f"bandwidth_over_floor[{size}]",
                        status="derived",
                        values=[m["gb_per_s"] / f for m in ms],
                        unit="1",
                        note=f"goal >= 0.7; floor {f:.2f} GB/s",
                    )
                )
        for metric in ("recovery_s", "rejoin_s", "transfer_s"):
            if rec.get(size):
                rows.append(
                    make_row(
                        system="unicron run",
                        scenario=SCENARIO,
                        metric=f"{metric}[{size}]",
                        unit="s",
                        values=[r[metric] for r in rec[size]],
                        note=f"2 workers, {RUN_STEPS[size]} steps, --reduce fast, crash at step 2",
                    )
                )
    return rows


def _plot(rows: list[Row], path: Path) -> None:
    """Recovery, extra memory and bandwidth against state size, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = {"5MB": 4.6, "100MB": 96.4, "1GB": 1025.5}

    def series(system: str, metric: str) -> tuple[list[float], list[float]]:
        pts = sorted(
            (mb[r["metric"].split("[")[1][:-1]], r["median"])
            for r in rows
            if r["system"] == system
            and r["metric"].startswith(metric + "[")
            and r["median"] is not None
        )
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        (
            axes[0],
            "time after the fault (s)",
            [
                ("unicron run", "recovery_s", "recovery (next step)"),
                ("unicron run", "rejoin_s", "restarted worker back"),
                ("unicron run", "transfer_s", "transition with transfer"),
            ],
        ),
        (
            axes[1],
            "joiner's extra peak memory (MB)",
            [
                ("stream", "joiner_extra_mb", "stream"),
                ("blob", "joiner_extra_mb", "blob (before)"),
                ("stream", "sender_extra_mb", "stream, sender"),
                ("blob", "sender_extra_mb", "blob, sender"),
            ],
        ),
        (
            axes[2],
            "bandwidth (GB/s)",
            [
                ("floor", "gb_per_s", "floor: plain broadcast"),
                ("stream", "gb_per_s", "stream"),
                ("stream x2", "gb_per_s", "stream, 2 holders"),
                ("blob", "gb_per_s", "blob"),
            ],
        ),
    )
    for ax, ylabel, lines in panels:
        for system, metric, label in lines:
            x, y = series(system, metric)
            if x:
                ax.plot(x, y, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("state size (MB: parameters + AdamW moments)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("State transfer against state size (loopback, gloo, shared 2-core machine)")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.transfer", __doc__, quick="smaller sizes and fewer repetitions")
    rows = run(p.parse_args(argv).quick)
    print_table(rows, title="state transfer against state size")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
