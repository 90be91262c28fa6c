"""What a task's worker processes start with on a node: the environment every one of them,
the zygote and the health probes share (:func:`base_env`), and what one slot's worker adds
(:func:`slot_env`: its slot, incarnation, faults to fire, place in its replica and device).

Pure functions of the task's :class:`~unicron.control.agent.AgentConfig` and the agent's
addresses; the agent (:class:`~unicron.control.agent.Agent`) calls them when it starts the
zygote, a worker or a probe, and ``unicron run`` calls :func:`import_env` for the zygote it
starts before its agents (:func:`unicron.runtime.launcher.prewarm`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Collection, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unicron.control import replicas
from unicron.protocol import (
    ENV_AGENT,
    ENV_AUTHKEY,
    ENV_BELL,
    ENV_FAULTS,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_PP_STAGE,
    ENV_SLOT,
    ENV_STORE,
    ENV_STORE_KEY,
    ENV_TASK,
    ENV_THREADS,
    ENV_TP_RANK,
)
from unicron.runtime import device as D

if TYPE_CHECKING:
    from unicron.control.agent import AgentConfig

__all__ = [
    "SECRETS",
    "Account",
    "AgentAddresses",
    "base_env",
    "device_env",
    "import_env",
    "killpg",
    "signal_worker",
    "slot_env",
    "start_plainly",
]

log = logging.getLogger("unicron.control.agent")

SECRETS = frozenset(("UNICRON_TOKEN",))
"""environment variables of the agent's process its workers never inherit"""


@dataclass(frozen=True)
class Account:
    """The unprivileged account a node's agent runs its tasks' processes as (``unicron agent
    --run-as``): the zygote, the workers it forks, a fallback worker and the health probes."""

    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def named(cls, who: str) -> Account:
        """The account ``who`` (a name or a numeric uid); :class:`KeyError` if none."""
        import pwd

        pw = pwd.getpwuid(int(who)) if who.isdigit() else pwd.getpwnam(who)
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir)

    def env(self) -> dict[str, str]:
        """What a process of this account is told about itself."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def cannot_run(self) -> str | None:
        """Why this account cannot start this Python with unicron (a directory it may not
        enter, say), or ``None`` when it can: ``unicron agent --run-as`` asks once at start."""
        user, group, extra_groups = as_account(self)
        try:
            done = subprocess.run(
                [sys.executable, "-c", "import unicron.runtime.launcher"],
                user=user, group=group, extra_groups=extra_groups, capture_output=True,
                text=True, timeout=120, cwd="/", env={**os.environ, **self.env()},
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{sys.executable}: {exc}"
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return None

    def owns(self, path: Path) -> None:
        """Give ``path`` (a directory its processes write logs into) to this account."""
        os.chown(path, self.uid, self.gid)


RESOLVER = "timeout:1 attempts:2"
"""glibc's resolver options in a worker (:func:`import_env`): a dropped query is asked
again after 1 s, not 5"""


def import_env(threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a zygote's imports read from its environment, for ``threads`` torch threads on
    top of ``base`` (default: this process's): torch's thread pools, its C++ log level,
    gloo's lazy connect and the resolver's patience (a setting the task gave stays). Part of
    every zygote's environment (:func:`base_env`), and all of one started before its task is
    known (:func:`unicron.runtime.launcher.prewarm`).

    ``RES_OPTIONS``: every TCPStore connection a worker opens (one per process group of an
    epoch) makes a reverse DNS query: torch formats the address it connects through,
    ``::ffff:127.0.0.1`` for a store on 127.0.0.1, with ``getnameinfo``, which ``/etc/hosts``
    does not answer for an IPv4-mapped address. Where the resolver drops one, glibc waits 5 s
    before it asks again (measured here: 2 of 60 connections to a TCPStore on 127.0.0.1 took
    5.008 s), and every member of the epoch being joined waited for that one (the stall
    detector killed it as stuck). A second's wait, twice, bounds that; the answer itself is
    never used."""
    base = os.environ if base is None else base
    return {
        "TORCH_CPP_LOG_LEVEL": base.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        "TORCH_GLOO_LAZY_INIT": base.get("TORCH_GLOO_LAZY_INIT", "1"),  # inside a sliced wait
        "RES_OPTIONS": base.get("RES_OPTIONS", RESOLVER),
        ENV_THREADS: str(threads),
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass(frozen=True)
class AgentAddresses:
    """Where a worker reaches its task: the training store, its agent's socket and doorbell,
    and the key that opens the socket."""

    task: str
    store: str
    store_key: str
    """the task's capability on the store (:mod:`unicron.control.storeserver`)"""
    agent: str
    bell: str
    authkey: bytes


def base_env(config: AgentConfig, at: AgentAddresses) -> dict[str, str]:
    """What every worker, the zygote and the probes start with: this process's environment
    without the coordinator's credentials (:data:`SECRETS`: a training script and whatever it
    imports never hold a token of the cluster), the task's settings, and the task file's
    ``env`` (allow-listed: :func:`~unicron.control.taskspec.refused_env`)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    if config.account is not None:
        env.update(config.account.env())
    env.update(config.env)
    env.update(import_env(config.threads, env))
    env.update(
        {
            ENV_TASK: at.task,
            ENV_NODE: str(config.node),
            ENV_STORE: at.store,
            ENV_STORE_KEY: at.store_key,
            ENV_AGENT: at.agent,
            ENV_BELL: at.bell,
            ENV_AUTHKEY: at.authkey.hex(),
            **config.settings.env(),
        }
    )
    return env


def slot_env(
    config: AgentConfig, slot: int, incarnation: int, fired: Collection[str]
) -> dict[str, str]:
    """What the worker in ``slot`` adds to :func:`base_env`: its slot and incarnation, the
    faults still to fire in it (``fired``: those the node saw already), its place in its
    replica (as the coordinator said, else among this node's slots alone:
    :mod:`unicron.control.replicas`) and its device."""
    faults = [
        f.spec
        for f in config.faults
        if (f.rank == slot or f.node == config.node) and f.spec not in fired
    ]
    tp, pp = config.settings.tp, config.settings.pp
    place = config.places.get(slot)
    if place is None:
        place = replicas.places({s: config.node for s in config.slots}, (tp, pp))[slot]
    return {
        ENV_SLOT: str(slot),
        ENV_INCARNATION: str(incarnation),
        ENV_FAULTS: ";".join(faults),
        ENV_TP_RANK: str(place % tp),
        ENV_PP_STAGE: str(place // tp),
        **device_env(config, slot),
    }


def device_env(config: AgentConfig, slot: int) -> dict[str, str]:
    """The slot's device (this node's GPUs round robin) and torchrun's ``LOCAL_RANK``."""
    kind = config.env.get(D.ENV_DEVICE_KIND, "cpu")
    gpus = D.gpu_count() if kind == "cuda" else 0
    return D.slot_env(kind, config.slots.index(slot), len(config.slots), gpus)


def signal_worker(pid: int, sig: int, account: Account | None) -> bool:
    """Send ``sig`` to a worker's ``pid``, where the process runs as ``account`` (when the
    agent runs workers as one): a pid a worker names (its hello, a zygote's word) never turns
    the agent's own power (root's) against a process that is not a worker's. Whether it was
    sent."""
    if account is not None:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            return False  # gone
        if uid != account.uid:
            log.warning("not signalling pid %d: it runs as uid %d, not as %s", pid, uid,
                        account.name)  # fmt: skip
            return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def killpg(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads (a process :func:`start_plainly` started,
    a zygote or a probe, and anything it started)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def start_plainly(
    module_args: list[str], env: dict[str, str], log: Path, account: Account | None = None
) -> subprocess.Popen[bytes]:
    """``python -m unicron.runtime.launcher MODULE_ARGS`` as a process of its own session,
    its output appended to ``log``: a worker when the zygote is gone, or the zygote itself;
    as ``account`` where given (:func:`as_account`)."""
    user, group, extra_groups = as_account(account)
    with open(log, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "unicron.runtime.launcher", *module_args],
            env=env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            user=user,
            group=group,
            extra_groups=extra_groups,
        )


def as_account(account: Account | None) -> tuple[int | None, int | None, list[int] | None]:
    """``subprocess.Popen``'s ``user``, ``group`` and ``extra_groups`` that start a process as
    ``account`` (its uid, its group, none of the agent's supplementary groups); for ``None``,
    the ones that change nothing."""
    if account is None:
        return None, None, None
    return account.uid, account.gid, []
