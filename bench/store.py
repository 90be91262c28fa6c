"""The training store behind its door against torch's own TCPStore server: a commit's latency.

Every step ends in a commit vote on the store (:meth:`unicron.runtime.group.EpochGroup.vote`:
an ``add``, the last voter's ``compare_set``, the others' ``wait`` and ``multi_get``). The
cluster's store is now :mod:`unicron.control.storeserver` (torch's protocol, every key checked
against its task's capability, in Python); before, it was torch's C++ server, which checks
nothing. Here W processes vote R times, as W members of one epoch would, against each
server in its own process, and a single client times a ``check`` round trip; the two
servers are measured in turns, three times each. Reported: the
median and 99th percentile of a member's vote (from its ``add`` to knowing the outcome) and
of a ``check``, per server.

``python -m bench.store [--quick]`` or ``python -m bench --scenario store``.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    Row,
    bench_parser,
    make_row,
    print_table,
    save_scenario,
    write_summary,
)

SCENARIO = "store"
SERVERS = ("torch", "unicron")
WHAT = {
    "torch": "torch's C++ TCPStore server (checks nothing)",
    "unicron": "unicron.control.storeserver (the capability of every key checked)",
}
PLAN = {False: ((4, 8), 300, 2000), True: ((4,), 50, 300)}
"""quick -> (members per vote, votes, check round trips), per round"""
ROUNDS = 3
"""each server measured this many times, in turns"""


def _torch_server(port_out: Any, stop: Any) -> None:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port_out.put(master.port)
    stop.wait()


def _client(address: str, key: str) -> Any:
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    tcp = dist.TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=60))
    return dist.PrefixStore(key, tcp) if key else tcp


def _member(address: str, key: str, rank: int, world: int, votes: int, out: Any) -> None:
    s = _client(address, key)
    times = []
    for step in range(votes):
        decision = f"t/1/decide/{step}"
        t0 = time.perf_counter()
        if s.add(f"t/1/vote/{step}", 1) == world:
            s.compare_set(decision, "", "commit")
        else:
            s.wait([decision])
            s.multi_get([decision, "t/epoch"])
        times.append(time.perf_counter() - t0)
        if s.add(f"t/1/after/{step}", 1) == world:  # the next vote begins when every member
            s.set(f"t/1/go/{step}", "1")  # knows this one's outcome
        else:
            s.wait([f"t/1/go/{step}"])
    out.put((rank, times))


def _votes(address: str, key: str, world: int, votes: int) -> list[float]:
    ctx = mp.get_context("fork")
    setup = _client(address, key)
    setup.set("t/epoch", "1")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(address, key, r, world, votes, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return [t for _, times in got for t in times[5:]]  # the first votes connect lazily


def _checks(address: str, key: str, n: int) -> list[float]:
    s = _client(address, key)
    s.set("t/epoch", "1")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.check(["t/epoch"])
        times.append(time.perf_counter() - t0)
    return times


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def measure(
    server: str, worlds: tuple[int, ...], votes: int, checks: int
) -> dict[str, list[float]]:
    """Every sample of one server: ``vote[W]`` per world size W, and ``check``."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="unicron-bench-store-") as tmp:
        if server == "torch":
            port_q, stop = ctx.Queue(), ctx.Event()
            proc = ctx.Process(target=_torch_server, args=(port_q, stop))
            proc.start()
            address, key = f"127.0.0.1:{port_q.get(timeout=60)}", ""
        else:
            from unicron.control import store as S
            from unicron.control.storeserver import capability

            info, popen = S.start(Path(tmp), "127.0.0.1", die_with_us=True)
            address, key = info.address, capability(S.secret_of(Path(tmp)), "t")
        try:
            got = {f"vote[{w}]": _votes(address, key, w, votes) for w in worlds}
            got["check"] = _checks(address, key, checks)
        finally:
            if server == "torch":
                stop.set()
                proc.join(30)
            else:
                popen.terminate()
                popen.wait(30)
    return got


def run(quick: bool) -> list[Row]:
    """The rows of this scenario."""
    worlds, votes, checks = PLAN[quick]
    load = os.getloadavg()[0]
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in SERVERS}
    for _ in range(ROUNDS):  # the servers in turns: a change of the machine's load hits both
        for server in SERVERS:
            for what, xs in measure(server, worlds, votes, checks).items():
                samples[server].setdefault(what, []).extend(xs)
    rows: list[Row] = []
    for server in SERVERS:
        for what, xs in samples[server].items():
            what_ = WHAT[server]
            note = (
                f"{what_}; {len(xs)} samples on loopback, each server in its own process; load "
                f"average {load:.1f} / {os.cpu_count()} CPUs at the start"
            )
            kind, _, rest = what.partition("[")
            tag = f"[{rest[:-1]} members]" if rest else ""
            for metric, value in ((f"{kind}_ms{tag}", statistics.median(xs)),
                                  (f"{kind}_p99_ms{tag}", _p99(xs))):  # fmt: skip
                rows.append(make_row(system=server, scenario=SCENARIO, metric=metric,
                                     values=[value * 1e3], unit="ms", note=note))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.store", __doc__, quick="4 members, fewer votes")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="The training store: a vote and a check, torch's server and ours")
    save_scenario(rows, SCENARIO, RESULTS_DIR, replace=not quick)
    write_summary(RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
