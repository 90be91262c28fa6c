"""The accelerator check: the demo's faults on CUDA, and what that verified. One command:

    python -m bench.gpu_check [--steps 40] [--workdir DIR]

Needs a machine with CUDA (exits 2 without one). It runs, with ``unicron run --device cuda``:

1. the health probe on ``cuda:0`` (``python -m unicron.runtime.health``, as the agent runs it);
2. ``tests/scripts/device_report.py`` on every slot: the device each worker got from
   ``unicron.worker.device()``, its ``LOCAL_RANK``, and where its parameters and AdamW
   moments live after training;
3. the demo (``examples/train_gpt.py``) fault-free, then with the demo's faults (worker 1
   SIGKILLed at a quarter of the run, worker 0 at five eighths) and, with NCCL, a hang of
   worker 2 (its peers must leave the stuck collective by aborting the communicator). The
   faulty run must finish every step, restart the killed workers, stream their state from a
   peer (``transition_end`` with ``state_source`` ``peer_node``), and end with a final loss
   close to the fault-free one (``--reduce fast`` on CUDA: not bitwise);
4. the model-parallel example (``examples/train_llama_parallel.py``) at TP=2 x PP=2 x DP=2 on
   eight slots, fault-free, then losing rank 2 (stage 1, rank 0 of its tensor-parallel
   group) mid-micro-batch and later rank 5 (stage 0 of the other replica), with no
   checkpoint to fall back on: every step committed once, only the two dead ranks
   restarted, epochs of whole replicas, a restarted rank's shard streamed from the same
   place of the live replica, and the final loss close to the fault-free one (whether the
   parameters are bitwise equal too is printed, not checked); then the same with the
   tensor parallelism of PyTorch's DTensor (``--tp-api dtensor``, :mod:`unicron.dtensor`,
   a mesh of device type ``cuda``), and with DTensor and each stage a torch ``PipelineStage``
   (``--pp-api torch``, :mod:`unicron.pipelining`);
5. a change of the tensor-parallel degree: TP=2 x DP=2 on four slots with ``--tp-choices 1``
   losing slot 1 to an ECC error (excluded): the task goes on at TP=1 x DP=3 on the other
   three, the split weights' slices and their AdamW moments joined on the GPU
   (``transition_end`` with ``state_source`` ``reshard``, no checkpoint), every step once, the
   final loss close to the fault-free TP=2 run's.

``--only N,M`` runs only those sections (1 and 2 always run: they say whether the GPU works).

Workers: one per GPU (NCCL) when there are two or more GPUs, else two workers sharing the
one GPU (gloo with CUDA tensors staged through the CPU: NCCL refuses two ranks on one device).
It prints one line per verified fact and exits 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import bench_parser

ROOT = Path(__file__).resolve().parents[1]


def _pythonpath() -> str:
    """The checkout first, then whatever PYTHONPATH the caller set (packages carried to a
    machine without an install, say)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _unicron(
    workdir: Path,
    nproc: int,
    script: Path,
    args: list[str],
    faults: list[str],
    flags: tuple[str, ...] = (),
) -> Any:
    workdir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "unicron",
        "run",
        "--device",
        "cuda",
        "--nproc-per-node",
        str(nproc),
        "--quiet",
        "--events",
        str(workdir / "events.jsonl"),
        "--log-dir",
        str(workdir / "logs"),
        "--checkpoint-every",
        "0",
        *flags,
    ]
    for spec in faults:
        cmd += ["--inject", spec]
    proc = _run([*cmd, str(script), *args], timeout=900)
    events = workdir / "events.jsonl"
    return proc, _events(events) if events.exists() else []


class Checks:
    """Collects verified (or failed) facts and prints each as it is decided."""

    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, ok: bool, what: str, detail: str = "") -> None:
        self.failed += not ok
        print(f"{'VERIFIED' if ok else 'FAILED  '}  {what}{f'  ({detail})' if detail else ''}")


def _close(a: Any, b: Any) -> bool:
    return a is not None and b is not None and abs(a - b) <= 0.05 * abs(a)


def _model_parallel(
    work: Path, gpus: int, check: Checks, api: str = "unicron", pp_api: str = "unicron"
) -> str | None:
    """Section 4 of the module's docstring: TP=2 x PP=2 x DP=2 on CUDA, two ranks lost;
    ``api``: the example's ``--tp-api`` (``dtensor``: PyTorch's tensor parallelism, a DTensor
    mesh of device type ``cuda``); ``pp_api``: its ``--pp-api`` (``torch``: each stage a torch
    ``PipelineStage``). Returns the fault-free run's parameters' digest."""
    nproc, steps = 8, 12
    layout = ("--tp", "2", "--pp", "2")
    script = ROOT / "examples" / "train_llama_parallel.py"
    faults = [f"crash:rank=2,step={steps // 3},mb=1", f"crash:rank=5,step={steps * 2 // 3}"]
    backend = "nccl" if gpus >= nproc else f"gloo ({nproc} slots share {gpus} GPU(s))"
    label = f"{api} TP" + ("" if pp_api == "unicron" else f", {pp_api} PP")
    print(f"model-parallel ({label}): TP=2 x PP=2 x DP=2 on {nproc} slots, backend {backend}")
    args = ["--steps", str(steps), "--tp-api", api, "--pp-api", pp_api]
    name = f"mp-{api}" + ("" if pp_api == "unicron" else f"-{pp_api}")
    clean_p, clean = _unicron(work / f"{name}-clean", nproc, script, args, [], layout)
    healed_p, healed = _unicron(work / f"{name}-healed", nproc, script, args, faults, layout)
    check(clean_p.returncode == 0, f"model-parallel ({label}) fault-free CUDA run finished",
          clean_p.stderr[-300:])  # fmt: skip
    check(healed_p.returncode == 0, f"model-parallel ({label}) faulty CUDA run finished "
          f"({', '.join(faults)})", healed_p.stderr[-300:])  # fmt: skip
    committed = sorted(e["step"] for e in healed if e["event"] == "step_end")
    check(committed == list(range(steps)), f"all {steps} steps committed once",
          f"{committed}")  # fmt: skip
    restarted = sorted(
        e["slot"] for e in healed if e["event"] == "action" and e.get("action") == "restart"
    )
    check(restarted == [2, 5], "only the two dead ranks restarted", f"{restarted}")
    epochs = [e["members"] for e in healed if e["event"] == "epoch_begin"]
    check(bool(epochs) and all(len(m) % 4 == 0 for m in epochs),
          "every epoch of whole replicas (4 ranks each)", f"{epochs}")  # fmt: skip
    peers = [
        e
        for e in healed
        if e["event"] == "transition_end" and str(e.get("state_source", "")).startswith("peer")
    ]
    check(bool(peers), "a restarted rank's shard streamed from the live replica on CUDA",
          f"{len(peers)} transitions")  # fmt: skip
    ends = [[e for e in run if e["event"] == "task_end"] for run in (clean, healed)]
    a, b = (end[-1].get("final_loss") if end else None for end in ends)
    check(_close(a, b), "model-parallel final loss within 5% of the fault-free one",
          f"{a} vs {b}")  # fmt: skip
    sha = [end[-1].get("params_sha256") if end else None for end in ends]
    print(f"note: model-parallel ({label}) parameters bitwise equal to the fault-free run: "
          f"{sha[0] is not None and sha[0] == sha[1]}")  # fmt: skip
    return sha[0]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.gpu_check", __doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workdir", default=None)
    p.add_argument("--only", default="", metavar="N,M",
                   help="run only these sections of 3, 4, 5 (1 and 2 always run)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("python -m bench.gpu_check: no CUDA device here; run it on a GPU machine")
        return 2
    gpus = torch.cuda.device_count()
    nccl = gpus >= 2
    nproc = min(gpus, 4) if nccl else 2
    backend = "nccl" if nccl else "gloo (2 workers share cuda:0)"
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; {nproc} workers, backend {backend}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="unicron-gpu-check-"))
    check = Checks()

    env = {**os.environ, "PYTHONPATH": _pythonpath(), "UNICRON_DEVICE": "cuda:0"}
    probe = subprocess.run(
        [sys.executable, "-m", "unicron.runtime.health", "--slot", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    check(
        probe.returncode == 0 and "cuda:0" in probe.stdout,
        "health probe on cuda:0",
        probe.stdout.strip() or probe.stderr.strip()[-300:],
    )

    where = work / "where"
    proc, _ = _unicron(
        work / "device", nproc, ROOT / "tests/scripts/device_report.py", ["--out", str(where)], []
    )
    files = [where / f"slot{r}.txt" for r in range(nproc)]
    lines = [f.read_text() for f in files if f.exists()]
    # "DEVICE LOCAL_RANK LOCAL_WORLD_SIZE [devices of the parameters and AdamW moments]"
    expected = [f"cuda:{r % gpus} {r} {nproc} ['cuda:{r % gpus}']" for r in range(nproc)]
    ok = proc.returncode == 0 and lines == expected
    check(
        ok,
        "each slot's device, LOCAL_RANK, parameters and AdamW moments on its GPU",
        "; ".join(lines) or proc.stderr[-500:],
    )

    only = {int(x) for x in args.only.split(",") if x.strip()} or {3, 4, 5}
    if 3 in only:
        _demo(work, gpus, nproc, nccl, args.steps, check)
    if 4 in only:
        hand = _model_parallel(work, gpus, check)
        dtensor = _model_parallel(work, gpus, check, "dtensor")
        print(f"note: the DTensor-split fault-free run has the hand-written layers' bits: "
              f"{hand is not None and hand == dtensor}")  # fmt: skip
        torch_pp = _model_parallel(work, gpus, check, "dtensor", "torch")
        print(f"note: the fault-free run with torch's PipelineStage has the hand-written "
              f"stages' bits: {hand is not None and hand == torch_pp}")  # fmt: skip
    if 5 in only:
        _tp_change(work, gpus, check)
    print(f"logs: {work}")
    print(f"{'all checks passed' if not check.failed else f'{check.failed} check(s) FAILED'}")
    return 1 if check.failed else 0


def _demo(work: Path, gpus: int, nproc: int, nccl: bool, s: int, check: Checks) -> None:
    """Section 3 of the module's docstring: the demo's faults on CUDA."""
    faults = [f"crash:rank=1,step={s // 4}", f"crash:rank=0,step={s * 5 // 8}"]
    if nccl and nproc >= 3:
        faults.append(f"hang:rank=2,step={s // 2}")
    train = ROOT / "examples" / "train_gpt.py"
    clean_p, clean = _unicron(work / "clean", nproc, train, ["--steps", str(s)], [])
    healed_p, healed = _unicron(work / "healed", nproc, train, ["--steps", str(s)], faults)
    check(clean_p.returncode == 0, "fault-free CUDA run finished", clean_p.stderr[-300:])
    check(
        healed_p.returncode == 0,
        f"faulty CUDA run finished ({', '.join(faults)})",
        healed_p.stderr[-300:],
    )
    ends = [e for e in healed if e["event"] == "task_end"]
    steps = ends[-1].get("steps") if ends else None
    check(steps == s, f"all {s} steps committed", f"steps={steps}")
    restarts = [e for e in healed if e["event"] == "action" and e.get("action") == "restart"]
    check(len(restarts) >= 2, "killed workers restarted in their slots", f"{len(restarts)}")
    peers = [
        e
        for e in healed
        if e["event"] == "transition_end" and str(e.get("state_source", "")).startswith("peer")
    ]
    check(
        bool(peers),
        "a restarted worker received the state streamed from a peer on CUDA",
        f"{len(peers)} transitions",
    )
    if nccl and nproc >= 3:
        hang = [e for e in healed if e["event"] == "error_detected" and e.get("slot") == 2]
        check(
            bool(hang),
            "a hung NCCL member detected; its peers left the collective",
            json.dumps(hang[:1]),
        )
    a = next((e.get("final_loss") for e in clean if e["event"] == "task_end"), None)
    b = ends[-1].get("final_loss") if ends else None
    check(_close(a, b), "final loss of the faulty run within 5% of the fault-free one",
          f"{a} vs {b}")  # fmt: skip


def _tp_change(work: Path, gpus: int, check: Checks) -> None:
    """Section 5 of the module's docstring: TP=2 -> TP=1 on CUDA, the state re-sliced."""
    nproc, steps = 4, 16
    script = ROOT / "examples" / "train_llama_parallel.py"
    layout = ("--tp", "2")
    print(f"tensor-parallel degree change: TP=2 x DP=2 on {nproc} slots sharing {gpus} GPU(s)")
    args = ["--steps", str(steps)]
    fault = ["error:rank=1,step=3,kind=ecc"]
    clean_p, clean = _unicron(work / "tpc-clean", nproc, script, args, [], layout)
    flags = (*layout, "--tp-choices", "1", "--readmit-after", "1000")
    moved_p, moved = _unicron(work / "tpc-moved", nproc, script, args, fault, flags)
    check(clean_p.returncode == 0, "TP=2 fault-free CUDA run finished", clean_p.stderr[-300:])
    check(moved_p.returncode == 0, "TP=2 -> TP=1 CUDA run finished", moved_p.stderr[-300:])
    committed = sorted(e["step"] for e in moved if e["event"] == "step_end")
    check(committed == list(range(steps)), f"all {steps} steps committed once", f"{committed}")
    epochs = [(e.get("tp"), e["members"]) for e in moved if e["event"] == "epoch_begin"]
    check((1, [0, 2, 3]) in epochs, "the task went on at TP=1 x DP=3 on slots 0, 2, 3",
          f"{epochs}")  # fmt: skip
    sources = [e["state_source"] for e in moved if e["event"] == "transition_end"]
    check("reshard" in sources and "checkpoint" not in sources,
          "the state re-sliced in memory on CUDA (no checkpoint)", f"{sources}")  # fmt: skip
    ends = [[e for e in run if e["event"] == "task_end"] for run in (clean, moved)]
    a, b = (end[-1].get("final_loss") if end else None for end in ends)
    check(_close(a, b), "final loss within 5% of the fault-free TP=2 run", f"{a} vs {b}")


if __name__ == "__main__":
    raise SystemExit(main())
