"""What a worker's start costs, forked from the zygote or as a fresh interpreter, and what a
digest of the state costs: the figures docs/runtime.md's start-up and digest choices rest on.

- ``ready_s[zygote]`` / ``ready_s[fresh]``: from the request to start a worker to the moment
  its script has built a model and taken one optimizer step (the worker's first step, less
  the training). ``zygote``: :mod:`unicron.runtime.launcher`'s fork server, started and
  warmed first, asked over its own protocol (``SpawnWorker``) as the agent asks it; the
  forked child connects to this process as it would to its agent. ``fresh``: ``python -m
  unicron.runtime.launcher worker SCRIPT``, the fallback when the zygote is gone. The two
  are measured in turns.
- ``digest_s[SIZE]``: :func:`unicron.runtime.digest.params_sha256` over the example GPT whose
  training state (parameters and AdamW's moments) is about SIZE (``bench/sized_gpt.py``):
  what taking the digest at every transition would cost each member (it is taken at step 0
  and at the task's end only; docs/runtime.md, One step).

``python -m bench.startup [--quick]`` or ``python -m bench --scenario startup``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from bench.common import RESULTS_DIR, Row, bench_parser, make_row, print_table, save_scenario
from unicron.messages import Exited, Spawned, SpawnWorker, ZygoteUp, from_wire, to_wire
from unicron.protocol import ENV_AGENT, ENV_AUTHKEY, ENV_INCARNATION, ENV_SLOT, ENV_THREADS

SCENARIO = "startup"
PLAN = {False: (8, ("5MB", "100MB", "1GB"), 5), True: (2, ("5MB",), 2)}
"""quick -> (starts per way, state sizes, digests per size)"""

SCRIPT = """\
import sys, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 64)).square().mean().backward()
opt.step()
with open(sys.argv[1], "w") as f:
    f.write(repr(time.time()))
"""
"""the worker: a model built and one optimizer step taken, then the time it was ready"""


class _Agent:
    """This process as the zygote's agent: it takes the zygote's and its children's
    connections (a child says hello before its script runs) and keeps them open."""

    def __init__(self) -> None:
        self.key = os.urandom(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.conns: list[Connection] = []
        self._first = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.listener.address
        return f"{host}:{port}"

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.listener.accept())
            except OSError:
                return
            self._first.set()

    def zygote(self, timeout: float = 120.0) -> Connection:
        if not self._first.wait(timeout):
            raise RuntimeError("the zygote did not connect")
        conn = self.conns[0]
        up = from_wire(conn.recv())
        assert isinstance(up, ZygoteUp), up
        return conn


def _ready_at(path: Path, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text:
            return float(text)
        time.sleep(0.002)
    raise RuntimeError(f"the worker never wrote {path}")


def starts(n: int, tmp: Path) -> dict[str, list[float]]:
    """``n`` worker starts each way, in turns: seconds from the request to the ready stamp."""
    script = tmp / "worker.py"
    script.write_text(SCRIPT)
    env = {**os.environ, ENV_THREADS: "1"}
    agent = _Agent()
    zenv = {**env, ENV_AGENT: agent.address, ENV_AUTHKEY: agent.key.hex()}
    log = open(tmp / "zygote.log", "ab")  # noqa: SIM115  # open for the zygote's life
    zygote = subprocess.Popen([sys.executable, "-m", "unicron.runtime.launcher", "zygote"],
                              env=zenv, stdout=log, stderr=log)  # fmt: skip
    out: dict[str, list[float]] = {"zygote": [], "fresh": []}
    try:
        conn = agent.zygote()
        for i in range(n):
            stamp = tmp / f"z{i}"
            t0 = time.time()
            ask = SpawnWorker(slot=0, incarnation=i, env={ENV_SLOT: "0", ENV_INCARNATION: str(i)},
                              script=str(script), argv=(str(stamp),),
                              log=str(tmp / "worker.log"))  # fmt: skip
            conn.send(to_wire(ask))
            while not isinstance(got := from_wire(conn.recv()), Spawned):
                assert isinstance(got, Exited), got  # an earlier child's end
            out["zygote"].append(_ready_at(stamp) - t0)
            stamp = tmp / f"f{i}"
            t0 = time.time()
            proc = subprocess.Popen([sys.executable, "-m", "unicron.runtime.launcher", "worker",
                                     str(script), str(stamp)], env=env)  # fmt: skip
            out["fresh"].append(_ready_at(stamp) - t0)
            proc.wait(60)
    finally:
        zygote.kill()
        zygote.wait(30)
        agent.listener.close()
        log.close()
    return out


def digests(sizes: tuple[str, ...], reps: int) -> dict[str, list[float]]:
    """Seconds of :func:`params_sha256` over the model of each state size, ``reps`` times."""
    from bench import sized_gpt
    from unicron.runtime.digest import params_sha256

    out: dict[str, list[float]] = {}
    for size in sizes:
        model, _, _ = sized_gpt.build(size)
        params_sha256(model)  # the first pass faults the pages in
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            params_sha256(model)
            xs.append(time.perf_counter() - t0)
        out[size] = xs
        del model
    return out


def run(quick: bool) -> list[Row]:
    """The rows of this scenario."""
    n, sizes, reps = PLAN[quick]
    load = os.getloadavg()[0]
    where = f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
    with tempfile.TemporaryDirectory(prefix="unicron-startup-") as tmp:
        got = starts(n, Path(tmp))
    rows: list[Row] = []
    for way, xs in got.items():
        what = "forked from the warm zygote" if way == "zygote" else "a fresh interpreter"
        note = (f"{what}: request to a model built and one AdamW step taken; {n} starts each "
                f"way, in turns; {where}")  # fmt: skip
        rows.append(make_row(system=way, scenario=SCENARIO, metric=f"ready_s[{way}]",
                             values=xs, unit="s", note=note))  # fmt: skip
    z, f = statistics.median(got["zygote"]), statistics.median(got["fresh"])
    rows.append(make_row(system="zygote", scenario=SCENARIO, metric="ready_vs_fresh",
                         values=[z / f], unit="x", status="derived",
                         note="median zygote start / median fresh start, same run"))  # fmt: skip
    for size, xs in digests(sizes, reps).items():
        note = (f"params_sha256 over the example GPT with about {size} of training state "
                f"(its parameters: a third of it), {reps} passes; {where}")  # fmt: skip
        rows.append(make_row(system="unicron", scenario=SCENARIO, metric=f"digest_s[{size}]",
                             values=xs, unit="s", note=note))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.startup", __doc__, quick="2 starts each way, the 5 MB digest only")
    p.add_argument("--out", default=None,
                   help="results directory (default bench/results; --quick writes nothing "
                   "unless given)")  # fmt: skip
    args = p.parse_args(argv)
    rows = run(args.quick)
    print_table(rows, title="A worker's start, and a digest of the state")
    out = Path(args.out) if args.out else (None if args.quick else RESULTS_DIR)
    if out is not None:
        save_scenario(rows, SCENARIO, out, replace=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
