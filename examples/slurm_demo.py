"""The Slurm demo: ``make slurm-demo`` (root; Debian's ``slurm-wlm`` and ``munge``).

A real Slurm on this one machine: ``slurmctld`` on the host side of a
:mod:`unicron.control.netns` lab and one ``slurmd`` in each of its network namespaces (three
"machines", nodes ``n0``-``n2``, each with its own address, as ``slurmd -N NAME``), with
MUNGE authentication under a key made for the run. Then, as a Slurm user would:

1. ``sbatch examples/slurm/unicron.sbatch task.yaml`` on the three nodes: the coordinator on
   the first, one agent per node through ``srun``, a small GPT trained on three workers;
2. mid-training, ``scontrol update nodename=n1 state=down``: Slurm takes the node away (its
   agent and worker are killed, the job goes on without it: ``--no-kill``), and Unicron heals
   the task on the two nodes left;
3. the job ends when the task does; the demo checks that the job completed, the task healed
   and finished, and that its parameters equal those of a fault-free ``unicron run`` on three
   workers, bit for bit;
4. ``n1`` resumed, a second job (``sbatch --requeue``, a checkpoint every 5 steps) is
   requeued at step 15 (``scontrol requeue``): all its processes are killed, Slurm starts the
   script again, which starts a new coordinator and resubmits the task to go on from its
   newest checkpoint; it must end with the same parameters too (``--no-requeue`` skips it).

Everything is torn down whatever happens: the job cancelled, the daemons stopped, the
namespaces removed (with everything still running in them), the work directory deleted
(``--keep`` keeps it). Without ``slurmctld``/``slurmd``/``munged`` it installs ``slurmctld
slurmd slurm-client munge`` with apt-get when run as root, else exits 2 saying what to install.

The pure parts (the generated ``slurm.conf``, Slurm's host lists) are tested in
``tests/test_slurm_demo.py``; this run itself is not in the default test suite (a few
minutes on 2 cores: 3-4 in all).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
"""a job's final states (``scontrol show job``)"""
LOST = "n1"
"""the node Slurm takes away mid-training (n0 runs the batch script and the coordinator)"""


# -- the pure parts ----------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's host list syntax, as ``scontrol show hostnames`` expands it: ``n[0-2,5],gpu07``
    -> ``n0 n1 n2 n5 gpu07`` (zero padding kept: ``gpu[01-03]`` -> ``gpu01 ...``). One
    bracket per name, at its end (Slurm 22.05 expands nothing after one); a malformed list
    raises ValueError."""
    names: list[str] = []
    parts = re.findall(r"[^,\[\]]+(?:\[[^\]]*\])?", hostlist)
    if not hostlist or ",".join(parts) != hostlist:
        raise ValueError(f"not a Slurm host list: {hostlist!r}")
    for part in parts:
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]", part)
        if m is None:
            if "[" in part or "]" in part or not part:
                raise ValueError(f"not a Slurm host list: {hostlist!r}")
            names.append(part)
            continue
        prefix, ranges = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(f"not a Slurm host list: {hostlist!r}")
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{width}d}")
    return names


@dataclass(frozen=True, kw_only=True)
class SlurmConf:
    """A throwaway cluster's ``slurm.conf``: everything under ``workdir``, MUNGE on its own
    socket, nodes at their own addresses. Pure: :meth:`render` writes nothing."""

    controller: str
    """the controller's host name: must be this machine's short host name (slurmctld checks)"""
    controller_addr: str
    """where the nodes reach it (the lab's bridge)"""
    controller_port: int
    nodes: tuple[tuple[str, str], ...]
    """(name, address) per slurmd"""
    cpus: int = 1
    """CPUs per node as Slurm counts them: the slots ``unicron.sbatch`` gives each agent"""
    workdir: Path
    munge_socket: Path

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("nodes: at least one (name, address)")
        if not 1 <= self.cpus <= 1024:
            raise ValueError(f"cpus must be in 1..1024, got {self.cpus}")
        if not 0 < self.controller_port < 65536:
            raise ValueError(f"controller_port must be in 1..65535, got {self.controller_port}")

    def render(self) -> str:
        w = self.workdir
        lines = [
            "# written by examples/slurm_demo.py for one run; removed with its directory",
            "ClusterName=unicrondemo",
            f"SlurmctldHost={self.controller}({self.controller_addr})",
            f"SlurmctldPort={self.controller_port}",
            "SlurmdPort=6818",  # each slurmd in its own namespace: no clash
            # Debian's Slurm 22.05 has no auth/slurm (23.11 and later): MUNGE, our own key
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={w}/ctld",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/slurmctld.log",
            f"SlurmdLogFile={w}/slurmd-%n.log",
            # a job's processes are found by their parents (no cgroup hierarchy of our own)
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # the nodes' CPUs are the configured ones, not this machine's
            "SlurmdParameters=config_overrides",
            # a node set DOWN stays down until resumed; one that stopped answering comes back
            "ReturnToService=1",
            "SlurmdTimeout=10",
            "SlurmctldTimeout=10",
            "MessageTimeout=5",
            "InactiveLimit=0",
            "KillWait=2",
        ]
        lines += [
            f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for name, addr in self.nodes
        ]
        names = ",".join(name for name, _ in self.nodes)
        lines.append(f"PartitionName=demo Nodes={names} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"


CGROUP_CONF = (
    "# slurmd loads a cgroup plugin even with proctrack/linuxproc; v1 is what this host has\n"
    "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
)


def task_file(name: str, steps: int, workers: int, *, checkpoint: Path | None = None) -> str:
    """The demo's task: the small GPT for ``steps`` steps on up to ``workers`` workers (one
    suffices to go on); with ``checkpoint``, a checkpoint there every 5 steps."""
    text = (
        f"name: {name}\nscript: {HERE / 'train_gpt.py'}\nargs: [--steps, '{steps}']\n"
        f"workers: {{min: 1, max: {workers}}}\n"
    )
    return text + (f"checkpoint: {{every: 5, dir: {checkpoint}}}\n" if checkpoint else "")


# -- the machine -------------------------------------------------------------------------------


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None]


def install() -> None:
    """apt-get the daemons (root only); waits for another apt's dpkg lock (10 minutes)."""
    cmd = ["apt-get", "install", "-y", "--no-install-recommends",
           "-o", "DPkg::Lock::Timeout=600", *PACKAGES]  # fmt: skip
    print("installing:", " ".join(cmd), flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Demo:
    """The run (see the module docstring): :meth:`up`, :meth:`train`, :meth:`close`."""

    def __init__(self, workdir: Path, *, steps: int, nodes: int = 3) -> None:
        from unicron.control import netns

        self.workdir, self.steps, self.count = workdir, steps, nodes
        self.procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self.net = netns.Lab(nodes)
        self.token = secrets.token_hex(16)
        self.job: str | None = None
        self.conf = SlurmConf(
            controller=socket.gethostname().split(".")[0],
            controller_addr=self.net.host_address,
            controller_port=free_port(self.net.host_address),
            nodes=tuple((f"n{h.index}", h.address) for h in self.net.members),
            workdir=workdir,
            munge_socket=workdir / "munge.sock",
        )
        self.env = {
            **os.environ,
            "SLURM_CONF": str(workdir / "slurm.conf"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
            "UNICRON_PYTHON": sys.executable,
            "UNICRON_TOKEN": self.token,
            "UNICRON_STATE_ROOT": str(workdir / "unicron"),
            "UNICRON_AGENT_FLAGS": "--allow-root",  # the demo's jobs run as root
        }

    # -- bring-up ---------------------------------------------------------------------------
    def up(self) -> None:
        w = self.workdir
        w.chmod(0o711)  # munged wants the socket's directory searchable by all
        for d in ("ctld", *(f"spool/{n}" for n, _ in self.conf.nodes)):
            (w / d).mkdir(parents=True)
        key = w / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        (w / "slurm.conf").write_text(self.conf.render())
        (w / "cgroup.conf").write_text(CGROUP_CONF)
        self.start(["munged", "-F", f"--socket={self.conf.munge_socket}", f"--key-file={key}",
                    f"--pid-file={w}/munged.pid", f"--log-file={w}/munged.log",
                    f"--seed-file={w}/munged.seed"], "munged")  # fmt: skip
        self.until(lambda: self.conf.munge_socket.exists(), 30, "munged's socket")
        self.start(["slurmctld", "-D", "-i", "-f", str(w / "slurm.conf")], "slurmctld")
        for host in self.net.members:
            name = f"n{host.index}"
            log = open(w / f"slurmd-{name}.out", "wb")  # noqa: SIM115
            self.procs.append(self.net.popen(
                host.index, ["slurmd", "-D", "-N", name, "-f", str(w / "slurm.conf")],
                env=self.env, stdout=log, stderr=log,
            ))  # fmt: skip
            log.close()
        self.until(lambda: self.idle_nodes() == self.count, 60, f"{self.count} idle nodes")

    def start(self, argv: Sequence[str], name: str) -> None:
        log = open(self.workdir / f"{name}.out", "wb")  # noqa: SIM115
        proc = subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        log.close()
        self.procs.append(proc)

    def slurm(self, *argv: str) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
        return out.stdout

    def idle_nodes(self) -> int:
        for proc in self.procs:
            if proc.poll() is not None:
                what = " ".join(map(str, proc.args)) if isinstance(proc.args, list) else "?"
                raise RuntimeError(f"{what} exited ({proc.returncode}); see {self.workdir}")
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            states = self.slurm("sinfo", "-h", "-N", "-o", "%N %t").split("\n")
            return sum(line.split()[1] == "idle" for line in states if line.strip())
        return 0

    def until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached in {timeout_s:.0f} s ({self.workdir})")
            time.sleep(0.25)

    # -- the job ----------------------------------------------------------------------------
    def job_info(self) -> dict[str, str]:
        assert self.job is not None
        text = self.slurm("scontrol", "show", "job", "-o", self.job)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def submit(self, task: Path, *options: str) -> None:
        out = self.slurm(
            "sbatch", f"--nodes={self.count}", f"--output={self.workdir}/job-%j.out",
            f"--chdir={self.workdir}", *options, str(HERE / "slurm" / "unicron.sbatch"), str(task),
        )  # fmt: skip
        self.job = out.split()[-1]
        print(" ".join(["sbatch", *options]) + f": job {self.job}", flush=True)

    def wait_step(self, step: int) -> None:
        """Until the task (on the coordinator of the job's first node) has committed ``step``."""
        from unicron.control.client import Client

        head = self.conf.nodes[0][1]
        client = Client(f"http://{head}:29400", self.token, timeout_s=10.0)

        def at() -> bool:
            state = self.job_info()["JobState"]
            if state not in ("PENDING", "RUNNING", "CONFIGURING"):
                raise RuntimeError(f"job {self.job} {state} early; see {self.workdir}")
            with contextlib.suppress(Exception):
                return bool(client.request("GET", "/v1/tasks/gpt")["step"] >= step)
            return False

        self.until(at, 300, f"the task at step {step}")

    def wait_end(self, start: int) -> dict[str, Any]:
        """Until the job has ended after ``start`` requeues; its end, the task's view and
        events as the script wrote them."""
        self.until(lambda: self.job_info()["JobState"] in ENDED
                   and int(self.job_info()["Restarts"]) >= start, 600, "the job's end")  # fmt: skip
        info = self.job_info()
        state = self.workdir / "unicron" / f"unicron-{self.job}.{start}"
        self.job = None
        return {
            "job_state": info["JobState"], "exit_code": info["ExitCode"],
            "restarts": int(info["Restarts"]),
            "view": json.loads((state / "gpt.json").read_text()),
            "events": [json.loads(line) for line in (state / "gpt.events.jsonl").open()],
        }  # fmt: skip

    def train(self) -> dict[str, Any]:
        """Submit, lose ``n1`` mid-training, wait for the end; what was seen."""
        task = self.workdir / "task.yaml"
        task.write_text(task_file("gpt", self.steps, self.count))
        self.submit(task)
        self.wait_step(10)
        before = self.job_info()["NodeList"]
        print(f"the job runs on {before}; the task is at step 10", flush=True)
        print(f"scontrol update nodename={LOST} state=down", flush=True)
        self.slurm("scontrol", "update", f"nodename={LOST}", "state=down",
                   "reason=unicron slurm-demo: node lost")  # fmt: skip
        self.until(lambda: self.job_info()["NodeList"] != before, 30, "the job's shrinking")
        after = self.job_info()["NodeList"]
        print(f"Slurm removed {LOST} from the job: now on {after}", flush=True)
        return {"nodes_before": before, "nodes_after": after, **self.wait_end(0)}

    def requeue(self) -> dict[str, Any]:
        """``n1`` resumed; a job with ``--requeue`` and a checkpoint every 5 steps, requeued
        by ``scontrol requeue`` at step 15: its second start must go on from a checkpoint."""
        self.slurm("scontrol", "update", f"nodename={LOST}", "state=resume")
        self.until(lambda: self.idle_nodes() == self.count, 60, f"{LOST} back")
        ckpt = self.workdir / "checkpoints"
        task = self.workdir / "task-requeue.yaml"
        task.write_text(task_file("gpt", self.steps, self.count, checkpoint=ckpt))
        self.submit(task, "--requeue")
        self.wait_step(15)
        print(f"the task is at step 15; scontrol requeue {self.job}", flush=True)
        self.slurm("scontrol", "requeue", str(self.job))
        # Slurm holds a requeued job back for two minutes (its begin time); no need here
        self.until(lambda: self.job_info()["JobState"] == "PENDING", 60, "the job requeued")
        self.slurm("scontrol", "update", f"jobid={self.job}", "starttime=now")
        return self.wait_end(1)

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent: the job, the namespaces with all that runs there, the daemons."""
        if self._closed:
            return
        self._closed = True
        if self.job is not None:
            with contextlib.suppress(Exception):
                self.slurm("scancel", self.job)
        self.net.close()  # every process in the namespaces: slurmd, steps, unicron
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def reference(workdir: Path, steps: int, workers: int) -> str | None:
    """The fault-free ``unicron run`` on this machine: its parameters' SHA-256."""
    from unicron.control.events import read_events
    from unicron.control.report import task_end

    events = workdir / "reference.jsonl"
    subprocess.run(
        [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(workers), "--quiet",
         "--events", str(events), "--log-dir", str(workdir / "reference-logs"),
         str(HERE / "train_gpt.py"), "--steps", str(steps)],
        check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    end = task_end(read_events(events)) or {}
    return end.get("params_sha256")


def verdict(seen: dict[str, Any], want: str | None, steps: int) -> list[str]:
    """What went wrong, if anything (empty: the demo passed)."""
    view, events = seen["view"], seen["events"]
    problems = []
    if seen["job_state"] != "COMPLETED" or seen["exit_code"] != "0:0":
        problems.append(f"the job ended {seen['job_state']} ({seen['exit_code']})")
    if LOST in expand_hostlist(seen["nodes_after"]):
        problems.append(f"{LOST} still in the job: {seen['nodes_after']}")
    if view["state"] != "done":
        problems.append(f"the task ended {view['state']}: {view.get('outcome')}")
    if not any(e["event"] == "error_detected" for e in events):
        problems.append("no error_detected event: the node's loss was not seen")
    widths = [e.get("workers") for e in events if e["event"] == "step_end"]
    if 2 not in widths:
        problems.append(f"no step on two workers (workers per step: {sorted(set(widths))})")
    committed = [e["step"] for e in events if e["event"] == "step_end"]
    if committed != list(range(steps)):
        problems.append(f"steps committed: {committed}, not 0..{steps - 1} once each")
    got = (view.get("outcome") or {}).get("params_sha256")
    if got is None or got != want:
        problems.append(f"params sha256 {got} differs from the fault-free run's {want}")
    return problems


def sha(seen: dict[str, Any]) -> str | None:
    return (seen["view"].get("outcome") or {}).get("params_sha256")


def verdict_requeue(seen: dict[str, Any], want: str | None, steps: int) -> list[str]:
    """The requeued job's problems: it must have started twice, gone on from a checkpoint
    (taken every 5 steps, requeued at step 15 or a little after) and ended as the fault-free
    run did."""
    problems = []
    if (seen["job_state"], seen["exit_code"], seen["restarts"]) != ("COMPLETED", "0:0", 1):
        problems.append(
            f"ended {seen['job_state']} ({seen['exit_code']}), {seen['restarts']} restarts"
        )
    if seen["view"]["state"] != "done":
        problems.append(f"the task ended {seen['view']['state']}: {seen['view'].get('outcome')}")
    committed = [e["step"] for e in seen["events"] if e["event"] == "step_end"]
    first = committed[0] if committed else -1
    if not 5 <= first <= 25 or committed != list(range(first, steps)):
        problems.append(f"its second start committed {committed[:3]}..., not from a checkpoint")
    if sha(seen) is None or sha(seen) != want:
        problems.append(f"params sha256 {sha(seen)} differs from the fault-free run's {want}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        help="skip the second job (requeued mid-run, it goes on from its checkpoint)",
    )
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("slurm-demo: run as root (slurmd, network namespaces)", file=sys.stderr)
        return 2
    if missing():
        install()
        if missing():
            print(f"slurm-demo: still missing: {' '.join(missing())}", file=sys.stderr)
            return 2
    from unicron.control import netns

    if (why := netns.available()) is not None:
        print(f"slurm-demo: {why}", file=sys.stderr)
        return 2
    # SIGTERM (a timeout, a CI runner) unwinds like Ctrl-C: the teardown below still runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="unicron-slurm-demo-"))
    t0 = time.monotonic()
    demo: Demo | None = None
    try:
        demo = Demo(workdir, steps=args.steps)
        demo.up()
        print(f"Slurm up: slurmctld and {demo.count} slurmd nodes ({time.monotonic() - t0:.0f} s)")
        seen = demo.train()
        print(f"job {seen['job_state']} (exit {seen['exit_code']}); task {seen['view']['state']}")
        again = demo.requeue() if args.requeue else None
        demo.close()
        want = reference(workdir, args.steps, demo.count)
        problems = verdict(seen, want, args.steps)
        print(f"slurm run, node lost: params sha256 {sha(seen)}")
        if again is not None:
            problems += [f"requeued job: {p}" for p in verdict_requeue(again, want, args.steps)]
            print(f"slurm run, requeued: params sha256 {sha(again)}")
        print(f"unicron run, no fault: params sha256 {want}")
        for problem in problems:
            print(f"FAILED: {problem}")
        if not problems:
            what = "the node Slurm took away" + (" and the requeue" if again else "")
            print(f"bitwise identical: {what} changed nothing ({time.monotonic() - t0:.0f} s)")
        return 1 if problems else 0
    finally:
        if demo is not None:
            demo.close()
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
