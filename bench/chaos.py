"""The fault soak: about a hundred mixed faults in one run, healed, and still bit-exact.

One node, 4 workers, the example GPT. A seeded schedule (:func:`schedule`) injects crashes,
hangs, every error kind of the classification table and slow workers, on every slot, a few
steps apart, each on a slot the earlier faults have not taken out; the escalation's minute is
scaled to :data:`TIME_SCALE` seconds, as the faults are ~100x denser than a cluster's. The
same training runs once without faults; both must end with the same parameters. From
the faulty run's event log (:func:`measure_faults`), per fault: the time to its detection
(the first ``error_detected`` about its slot at or after it) and to the next finished step;
per kind the worst detection against the goal (a hang found within ``max(3 x median step,
1 s) + 0.5 s`` after the first step); exclusions, readmissions and waits; steps lost
(finished steps reported again, i.e. redone from a checkpoint).

    python -m bench.chaos [--quick] [--faults N] [--seed S] [--gap G] [--keep DIR]  # make soak
    python -m bench.chaos --tp 2      # the same on model-parallel replicas (make soak-parallel)
    python -m bench.chaos --tp 2 --workers 8   # four such replicas
    python -m bench.chaos --tp 2 --pp 2 --pp-choices 1 --workers 8   # and layout changes
    python -m bench.chaos --tp 2 --pp 2 --pp-choices 1 --tp-choices 1 --workers 8  # degrees too
    python -m bench.chaos --tp 2 --pp 2 --workers 8 --schedule 1f1b   # Megatron's pipeline order
    python -m bench.chaos --zero                 # the optimizer's state sharded (--zero 1)
    python -m bench.chaos --store     # the store's process killed too (make soak-store)

With ``--tp T`` and/or ``--pp P`` the run is ``examples/train_llama_parallel.py`` on replicas
of ``T x P`` of the workers (``--workers``, default 4; data parallel over the rest): a fault
takes a replica out of the step while its other ranks wait, and the result must still be the
fault-free run's. With ``--tp-choices`` the task also changes its tensor-parallel degree,
which sums in another order: ``bitwise_identical`` is then expected 0, and
``max_param_diff`` (the largest difference of a parameter from the fault-free run's, the
two runs' shards joined whole) says how far the run went from the fault-free one.

With ``--store`` the rounds of kinds include ``store``: at its step this driver kills the
training store's process (``kill -9``; the run starts a new one and every worker finds it,
docs/cluster.md, When the store dies); its detection is the run's ``control_plane`` record
of the loss, its recovery the next finished step.

Writes ``bench/results/chaos.json`` (rows) and prints the table. Not part of ``python -m
bench``: it is a long scenario of its own.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster.harness import EventTail
from bench.common import Row, bench_parser, make_row, print_table, save_scenario
from bench.events import Event, read_events, steps_redone
from unicron.detect.classify import KINDS
from unicron.parallel import SCHEDULES

SCENARIO = "chaos"
ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4
FIRST_STEP = 4
"""no fault before this step (the task's cold start has its own, long allowance)"""
ERROR_KINDS = tuple(sorted(k for k in KINDS if k != "unknown"))
FAULT_KINDS = ("crash", "hang", "slow", *(f"error:{k}" for k in ERROR_KINDS))
TIME_SCALE = 2.0
"""the soak's minute, in seconds: its faults come ~100x as often as a real cluster's, so the
escalation's window (``--restart-window``) and the probe cool-down (``--readmit-after``), a
minute each by default, are scaled down to this; at full scale every slot would exceed its
restart limit and the node its failing-slot limit within seconds, and the task would spend
the run excluded rather than healing"""
OUT_STEPS = {"slow": 50, "error:ecc": 40}
"""steps after a fault during which its slot is presumed out (detected, restarted, or excluded
until its health probe passes: a probe is a fresh Python process, seconds on a loaded
machine); other kinds restart in a few steps, or reattempt in place"""
OUT_STEPS_DEFAULT = 10
STORE = "store"
"""the kind of a fault this driver makes itself: the store's process killed (``--store``)"""


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule: its ``--inject`` spec, and the kind it is reported under."""

    spec: str
    kind: str
    rank: int
    step: int


def schedule(
    faults: int, seed: int, gap: int = 5, workers: int = WORKERS, store: bool = False
) -> tuple[list[Planned], int]:
    """``faults`` faults, one every ``gap`` steps from :data:`FIRST_STEP`, each kind in turn
    (shuffled rounds, so every kind occurs about equally often), on random slots among those
    the earlier faults have presumably not taken out (:data:`OUT_STEPS`): a fault planned on
    a slot that is restarting or excluded at its step never fires. Returns the faults and the
    number of steps the run needs (a tail after the last fault). ``store``: the kinds include
    :data:`STORE` (rank -1: no slot is taken out)."""
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < faults:
        round_ = [*FAULT_KINDS, *([STORE] if store else [])]
        rng.shuffle(round_)
        kinds += round_
    planned = []
    back_at = dict.fromkeys(range(workers), 0)  # slot -> first step it is presumed back
    for i, kind in enumerate(kinds[:faults]):
        step = FIRST_STEP + i * gap
        if kind == STORE:
            planned.append(Planned(f"store:step={step}", kind, -1, step))
            continue
        live = [r for r in range(workers) if back_at[r] <= step]
        rank = rng.choice(live) if live else min(back_at, key=lambda r: (back_at[r], r))
        back_at[rank] = step + OUT_STEPS.get(kind, OUT_STEPS_DEFAULT)
        if kind == "crash":
            spec = f"crash:rank={rank},step={step}"
        elif kind == "hang":
            spec = f"hang:rank={rank},step={step}"
        elif kind == "slow":
            spec = f"slow:rank={rank},step={step},factor=4"
        else:
            spec = f"error:rank={rank},step={step},kind={kind.split(':', 1)[1]}"
        planned.append(Planned(spec, kind, rank, step))
    return planned, FIRST_STEP + faults * gap + 20


def _run(
    workdir: Path,
    steps: int,
    specs: list[str],
    timeout_s: float,
    layout: tuple[int, int] = (1, 1),
    workers: int = WORKERS,
    depths: str = "",
    zero: bool = False,
    kills: list[int] | None = None,
    degrees: str = "",
    order: str = "gpipe",
) -> tuple[list[Event], float, list[float]]:
    """One ``unicron run``: its events, wall time, and when the store was killed (at the
    first commit of each step of ``kills``); ``order``: the pipeline's order of micro-batches
    (the example's ``--schedule``)."""
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    tp, pp = layout
    script = "train_gpt.py" if layout == (1, 1) else "train_llama_parallel.py"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(workers), "--quiet",
           "--tp", str(tp), "--pp", str(pp), *(["--pp-choices", depths] if depths else []),
           *(["--tp-choices", degrees] if degrees else []),
           *(["--zero", "1"] if zero else []),
           "--events", str(events), "--log-dir", str(workdir / "logs"),
           "--readmit-after", str(TIME_SCALE), "--restart-window", str(TIME_SCALE),
           "--checkpoint-every", "10",
           *(a for s in specs for a in ("--inject", s)),
           str(ROOT / "examples" / script), "--steps", str(steps),
           *(["--schedule", order] if layout != (1, 1) else []),
           "--out", str(workdir / "out")]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    killed = _kill_store(proc, events, kills or [], t0 + timeout_s)
    try:
        _, stderr = proc.communicate(timeout=max(t0 + timeout_s - time.monotonic(), 1.0))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"unicron run exited {proc.returncode}: {stderr[-2000:]}")
    return read_events(events), wall, killed


def _kill_store(
    run: subprocess.Popen[str], events: Path, steps: list[int], deadline: float
) -> list[float]:
    """Kill ``run``'s store process (``kill -9``) once each of ``steps`` has committed; when
    it was done, each time (a step the run never reaches is skipped). The event log is
    followed from where it was read last (:class:`bench.cluster.harness.EventTail`), not
    parsed whole every poll: this driver shares the run's two cores."""
    killed: list[float] = []
    tail, read, top = EventTail(events, poll_s=0.05).start(), 0, -1
    for step in sorted(steps):
        while run.poll() is None and time.monotonic() < deadline:
            lines = tail.snapshot()[read:]
            read += len(lines)
            ends = [s.event["step"] for s in lines if s.event.get("event") == "step_end"]
            top = max([top, *ends])
            if top >= step:
                break
            time.sleep(0.05)
        found = subprocess.run(["pgrep", "-P", str(run.pid), "-f", "unicron.control.store"],
                               capture_output=True, text=True)  # fmt: skip
        for pid in found.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(time.time())
    tail.stop()
    return killed


def _kind(e: Event) -> str:
    return e["fault"] if e["fault"] != "error" else f"error:{e.get('kind')}"


def measure_faults(events: list[Event], store_kills: Sequence[float] = ()) -> dict[str, Any]:
    """Per fault fired: detection and recovery times, grouped by kind; and the run's counts.
    ``store_kills``: when the driver killed the store (found by the run's ``control_plane``
    record of the loss)."""
    fired = [e for e in events if e["event"] == "fault_injected"]
    detections = [e for e in events if e["event"] == "error_detected"]
    ends = [e for e in events if e["event"] == "step_end"]
    by_kind: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    undetected = 0
    losses = [
        e for e in events if e["event"] == "control_plane" and "store was lost" in e.get("what", "")
    ]
    for ts in store_kills:
        seen = next((e for e in losses if e["ts"] >= ts), None)
        if seen is None:
            undetected += 1
            continue
        by_kind[STORE]["detection_s"].append(float(seen["ts"]) - ts)
        nxt = next((e for e in ends if e["ts"] > seen["ts"]), None)
        if nxt is not None:
            by_kind[STORE]["recovery_s"].append(float(nxt["ts"]) - ts)
    for f in fired:
        ts, slot = float(f["ts"]), f.get("rank")
        found = next((d for d in detections if d.get("slot") == slot and d["ts"] >= ts), None)
        if found is None:
            undetected += 1
            continue
        k = by_kind[_kind(f)]
        k["detection_s"].append(float(found["ts"]) - ts)
        nxt = next((e for e in ends if e["ts"] > found["ts"]), None)
        if nxt is not None:
            k["recovery_s"].append(float(nxt["ts"]) - ts)
    acts = [e.get("action") for e in events if e["event"] == "action"]
    durations = [float(e["duration_s"]) for e in ends if "duration_s" in e]
    return {
        "fired": len(fired) + len(store_kills),
        "undetected": undetected,
        "by_kind": by_kind,
        "exclusions": acts.count("exclude"),
        "readmissions": acts.count("readmit"),
        "waits": acts.count("wait"),
        "restarts": acts.count("restart"),
        "reattempts": acts.count("reattempt"),
        "steps_lost": steps_redone(events),
        "median_step_s": statistics.median(durations) if durations else None,
    }


def scenario_name(
    gap: int,
    layout: tuple[int, int] = (1, 1),
    workers: int = WORKERS,
    depths: str = "",
    zero: bool = False,
    store: bool = False,
    degrees: str = "",
    order: str = "gpipe",
) -> str:
    """``chaos`` for the default spacing, workers and replicas of one rank; another
    spacing's, worker count's or layout's rows go to a file of their own (``chaos-gap3``,
    ``chaos-w8-tp2``, ``chaos-w8-tp2-pp2-ppc1`` with ``--pp-choices 1``, ``chaos-zero``
    with the optimizer's state sharded, ``chaos-store`` with the store killed too,
    ``chaos-w8-tp2-pp2-1f1b`` with the pipeline in 1F1B's order)."""
    tp, pp = layout
    parts = [SCENARIO] + ([f"gap{gap}"] if gap != 5 else [])
    parts += [f"w{workers}"] if workers != WORKERS else []
    parts += [f"tp{tp}"] if tp > 1 else []
    parts += [f"pp{pp}"] if pp > 1 else []
    parts += [f"ppc{depths.replace(',', '')}"] if depths else []
    parts += [f"tpc{degrees.replace(',', '')}"] if degrees else []
    parts += ["zero"] if zero else []
    parts += [STORE] if store else []
    parts += [order] if order != "gpipe" else []
    return "-".join(parts)


def state_by_name(out: Path, tp: int) -> list[dict[str, Any]]:
    """A run's final parameters (``--out``: ``final.pt``, or a file per place of replica 0)
    merged by name per tensor-parallel rank: the same for two runs that ended at different
    pipeline depths (a layout change) with the same state."""
    import torch

    files = sorted(out.glob("final.shard*.pt"), key=lambda p: int(p.stem.split("shard")[1]))
    if not files:
        return [dict(torch.load(out / "final.pt"))]
    merged: list[dict[str, Any]] = [{} for _ in range(tp)]
    for place, path in enumerate(files):
        merged[place % tp].update(torch.load(path))
    return merged


def joined_state(out: Path, tp: int) -> dict[str, Any]:
    """A run's final parameters (``--out``) as the whole model's entries, whatever layout it
    ended at (``tp`` tensor-parallel ranks): the split entries' slices joined in rank order
    (:func:`unicron.parallel.split_dims` of the example Llama), the others taken once."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import llama_parallel

    from unicron.parallel import TensorParallel, split_dims

    dims = split_dims(llama_parallel.build(TensorParallel(0, 1))[0])
    files = sorted(out.glob("final.shard*.pt"), key=lambda p: int(p.stem.split("shard")[1]))
    pieces: dict[str, dict[int, Any]] = {}
    for place, path in enumerate(files or [out / "final.pt"]):
        for name, t in torch.load(path).items():
            pieces.setdefault(name, {})[place % tp] = t
    return {
        name: torch.cat([by[r] for r in sorted(by)], dims[name]) if name in dims and tp > 1
        else by[0]
        for name, by in pieces.items()
    }  # fmt: skip


def max_param_diff(a: Path, b: Path, tp_a: int, tp_b: int) -> float:
    """The largest difference of an entry of two runs' final parameters, joined whole
    (:func:`joined_state`); inf if they hold other entries."""
    x, y = joined_state(a, tp_a), joined_state(b, tp_b)
    if x.keys() != y.keys():
        return float("inf")
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def same_state(a: Path, b: Path, tp: int) -> bool:
    """Whether two runs' final parameters are equal bit for bit, entry by entry."""
    import torch

    x, y = state_by_name(a, tp), state_by_name(b, tp)
    return all(
        xs.keys() == ys.keys() and all(torch.equal(xs[k], ys[k]) for k in xs)
        for xs, ys in zip(x, y, strict=True)
    )


def run(
    quick: bool,
    faults: int | None = None,
    seed: int = 0,
    keep: Path | None = None,
    gap: int = 5,
    layout: tuple[int, int] = (1, 1),
    workers: int = WORKERS,
    depths: str = "",
    zero: bool = False,
    store: bool = False,
    degrees: str = "",
    order: str = "gpipe",
) -> list[Row]:
    """The rows of this scenario; ``keep``: leave both runs' event logs and worker logs there;
    ``gap``: steps between two faults; ``layout``: (tp, pp) of the replicas; ``workers``: on
    the one node; ``zero``: the faulted run shards the optimizer's state (``--zero 1``; the
    fault-free run it is compared with does not: the same bits); ``store``: the driver kills
    the store too (:data:`STORE` among the kinds); ``order``: the faulted run's pipeline
    order (the fault-free run keeps GPipe's: every order trains to the same bits)."""
    n = faults if faults is not None else (24 if quick else 100)
    planned, steps = schedule(n, seed, gap, workers, store)
    timeout_s = 120.0 + steps * 2.0
    with tempfile.TemporaryDirectory(prefix="unicron-bench-chaos-") as tmp:
        where = keep if keep is not None else Path(tmp)
        _, clean_wall, _ = _run(where / "clean", steps, [], timeout_s, layout, workers)
        specs = [p.spec for p in planned if p.kind != STORE]
        kills = [p.step for p in planned if p.kind == STORE]
        faulty, wall, killed = _run(
            where / "faulty",
            steps,
            specs,
            timeout_s,
            layout,
            workers,
            depths,
            zero,
            kills,
            degrees,
            order,
        )
        # by name: a run that ended at another pipeline depth holds the same entries; at
        # another tensor-parallel degree, the slices joined whole
        last = [e for e in faulty if e["event"] == "epoch_begin"][-1:]
        tp_end = int(last[0].get("tp", layout[0])) if last else layout[0]
        drift = 0.0
        if degrees:
            drift = max_param_diff(where / "clean" / "out", where / "faulty" / "out",
                                   layout[0], tp_end)  # fmt: skip
            exact = drift == 0.0
        else:
            exact = same_state(where / "clean" / "out", where / "faulty" / "out", layout[0])
    end = next(e for e in faulty if e["event"] == "task_end")
    m = measure_faults(faulty, killed)
    healed = m["fired"] - m["undetected"] if end.get("status") == "ok" else 0
    median_step = m["median_step_s"] or 0.0
    goal = max(3 * median_step, 1.0) + 0.5
    name = scenario_name(gap, layout, workers, depths, zero, store, degrees, order)
    base = dict(system="unicron", scenario=name)
    what = "" if layout == (1, 1) else f", replicas of tp {layout[0]} x pp {layout[1]}"
    what += f" (also pp {depths})" if depths else ""
    what += f" (also tp {degrees})" if degrees else ""
    what += ", optimizer state sharded (--zero 1; fault-free run unsharded)" if zero else ""
    what += f", the store killed {len(killed)} times" if store else ""
    what += (
        f", the pipeline in {order}'s order (fault-free run: gpipe's)" if order != "gpipe" else ""
    )
    setup = (
        f"{n} faults planned, one every {gap} steps, seed {seed}, {steps} steps, "
        f"{workers} workers on 1 node{what}"
    )
    rows = [
        make_row(**base, metric="faults_injected", values=[m["fired"]], unit="", note=setup),
        make_row(**base, metric="faults_healed", values=[healed], unit="",
                 note=f"detected and followed by a finished step; {m['undetected']} undetected"),
        make_row(**base, metric="steps_lost", values=[m["steps_lost"]], unit="",
                 note="steps finished twice (redone after a checkpoint reload); goal 0"),
        make_row(**base, metric="bitwise_identical", values=[1.0 if exact else 0.0], unit="",
                 note="the faulty run's final parameters == the fault-free run's, by name"),
        *([make_row(**base, metric="max_param_diff", values=[drift], unit="",
                    note="the largest difference of a parameter from the fault-free run's "
                    "(another tensor-parallel degree sums in another order)")]
          if degrees else []),
        make_row(**base, metric="wall_s", values=[wall], unit="s",
                 note=f"the faulty run; load average {os.getloadavg()[0]:.1f} at its end, "
                 f"{os.cpu_count()} cores"),
        make_row(**base, metric="wall_fault_free_s", values=[clean_wall], unit="s",
                 note="the same steps without faults"),
        make_row(**base, metric="median_step_s", values=[median_step], unit="s",
                 note=f"detection goal max(3 x median step, 1 s) + 0.5 s = {goal:.2f} s"),
    ]  # fmt: skip
    for name in ("exclusions", "readmissions", "waits", "restarts", "reattempts"):
        rows.append(make_row(**base, metric=name, values=[m[name]], unit="", note="actions"))
    for kind, figs in sorted(m["by_kind"].items()):
        det = figs["detection_s"]
        over = sum(1 for d in det if d > goal)
        note = f"{len(det)} faults; worst {max(det):.2f} s; {over} over the {goal:.2f} s goal"
        rows.append(make_row(**base, metric=f"detection_s[{kind}]", values=det, unit="s",
                             note=note))  # fmt: skip
        if figs["recovery_s"]:
            rows.append(make_row(**base, metric=f"recovery_s[{kind}]", values=figs["recovery_s"],
                                 unit="s", note="fault to the next finished step"))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.chaos", __doc__, quick="24 faults instead of 100")
    p.add_argument("--faults", type=int, default=None, help="faults to plan (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=int, default=5, help="steps between two faults (default 5)")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' logs in this new dir")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica stage")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica")
    p.add_argument("--workers", type=int, default=WORKERS, help=f"default {WORKERS}")
    p.add_argument("--pp-choices", default="", metavar="P,Q",
                   help="other pipeline depths the task may run at (a layout change)")  # fmt: skip
    p.add_argument("--tp-choices", default="", metavar="T,U",
                   help="other tensor-parallel degrees the task may run at")  # fmt: skip
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer's state in the faulted run (--zero 1)")  # fmt: skip
    p.add_argument("--store", action="store_true",
                   help="also kill the training store's process (a kind of fault)")  # fmt: skip
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe",
                   help="the faulted run's pipeline order (--pp > 1; default gpipe)")  # fmt: skip
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.tp < 1 or args.pp < 1 or args.workers % (args.tp * args.pp):
        p.error(f"--tp x --pp must divide the {args.workers} workers")
    if args.faults is not None and args.faults < 1:
        p.error("--faults must be >= 1")
    if args.gap < 1:
        p.error("--gap must be >= 1")
    if args.schedule != "gpipe" and args.pp == 1:
        p.error(f"--schedule {args.schedule}: a schedule orders a pipeline's stages (--pp > 1)")
    if args.keep is not None and args.keep.exists():
        p.error(f"--keep {args.keep}: already exists")
    layout = (args.tp, args.pp)
    if args.zero and (args.pp_choices or args.tp_choices):
        p.error("--zero with --pp-choices or --tp-choices: a task with a sharded optimizer "
                "keeps its layout")  # fmt: skip
    rows = run(args.quick, args.faults, args.seed, args.keep, args.gap, layout, args.workers,
               args.pp_choices, args.zero, args.store, args.tp_choices, args.schedule)  # fmt: skip
    print_table(rows, title="Fault soak: mixed faults in one run")
    name = scenario_name(args.gap, layout, args.workers, args.pp_choices, args.zero, args.store,
                         args.tp_choices, args.schedule)  # fmt: skip
    save_scenario(rows, name, ROOT / "bench" / "results", replace=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
