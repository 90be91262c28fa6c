"""The Slurm example's pure parts: Slurm's host lists, the demo's generated ``slurm.conf``
and task file, and the ``unicron`` commands ``examples/slurm/unicron.sbatch`` runs.

Where Slurm's client is installed (``scontrol``), the generated configuration is parsed by
Slurm itself and the host lists are expanded by it too; elsewhere those two tests skip. The
whole demo (daemons, a job, a lost node) is ``make slurm-demo``, not part of this suite.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from unicron.cli import COMMANDS, build_parser
from unicron.control.taskspec import parse
from unicron.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "unicron.sbatch"
LISTS = {
    "n0": ["n0"],
    "n[0-2]": ["n0", "n1", "n2"],
    "n[0,2]": ["n0", "n2"],
    "n[0-2,5],gpu07": ["n0", "n1", "n2", "n5", "gpu07"],
    "gpu[01-03]": ["gpu01", "gpu02", "gpu03"],
    "a,b[8-10]": ["a", "b8", "b9", "b10"],
}


def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slurm_demo", ROOT / "examples/slurm_demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["slurm_demo"] = mod  # dataclasses look the module up while it is made
    spec.loader.exec_module(mod)
    return mod


def conf(tmp_path: Path, **over: object) -> object:
    kw: dict[str, object] = {
        "controller": "vm",
        "controller_addr": "10.213.9.1",
        "controller_port": 16817,
        "nodes": (("n0", "10.213.9.2"), ("n1", "10.213.9.3"), ("n2", "10.213.9.4")),
        "workdir": tmp_path,
        "munge_socket": tmp_path / "munge.sock",
    }
    return demo().SlurmConf(**{**kw, **over})


@pytest.mark.parametrize("hostlist", sorted(LISTS))
def test_hostlists_expand_as_slurm_does(hostlist: str) -> None:
    assert demo().expand_hostlist(hostlist) == LISTS[hostlist]


BAD = ["", "n[1-", "n[a]", "n[3-1]", ",n1", "n1,", "n]0[", "rack[1-2]-gpu"]


@pytest.mark.parametrize("bad", BAD)
def test_malformed_hostlists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm host list"):
        demo().expand_hostlist(bad)


def test_the_conf_names_every_node_at_its_address_and_keeps_to_its_directory(
    tmp_path: Path,
) -> None:
    text = conf(tmp_path).render()  # type: ignore[attr-defined]
    pairs = [line.split("=", 1) for line in text.splitlines() if not line.startswith("#")]
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)) + 2 and keys.count("NodeName") == 3  # one line a key
    d = dict(pairs)
    assert d["SlurmctldHost"] == "vm(10.213.9.1)" and d["SlurmctldPort"] == "16817"
    assert d["AuthType"] == "auth/munge" and d["AuthInfo"] == f"socket={tmp_path}/munge.sock"
    for i in range(3):
        assert f"NodeName=n{i} NodeAddr=10.213.9.{i + 2} CPUs=1 " in text
    assert "PartitionName=demo Nodes=n0,n1,n2 " in text
    paths = [v for k, v in pairs if k.endswith(("File", "Dir", "Location"))]
    assert len(paths) == 6 and all(p.startswith(f"{tmp_path}/") for p in paths)
    assert d["SlurmdSpoolDir"].endswith("/spool/%n")  # one per slurmd on one file system


def test_bad_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nodes"):
        conf(tmp_path, nodes=())
    with pytest.raises(ValueError, match="cpus"):
        conf(tmp_path, cpus=0)
    with pytest.raises(ValueError, match="controller_port"):
        conf(tmp_path, controller_port=70000)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's client is not installed")
def test_slurm_itself_reads_the_conf_and_agrees_on_hostlists(tmp_path: Path) -> None:
    path = tmp_path / "slurm.conf"
    path.write_text(conf(tmp_path, cpus=2).render())  # type: ignore[attr-defined]
    env = {"SLURM_CONF": str(path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    for hostlist, want in LISTS.items():
        out = subprocess.run(
            ["scontrol", "show", "hostnames", hostlist], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr  # an unknown key or bad value fails the parse
        assert out.stdout.split() == want
    path.write_text(path.read_text() + "NoSuchKey=1\n")  # the check can fail
    out = subprocess.run(["scontrol", "show", "hostnames", "n0"], env=env, capture_output=True)
    assert out.returncode != 0


def test_the_demo_task_file_is_a_valid_task(tmp_path: Path) -> None:
    import yaml

    spec = parse(yaml.safe_load(demo().task_file("gpt", 40, 3)))
    assert (spec.workers.min, spec.workers.max, spec.args) == (1, 3, ["--steps", "40"])
    assert Path(spec.script).is_file() and spec.checkpoint.dir is None
    spec = parse(yaml.safe_load(demo().task_file("gpt", 40, 3, checkpoint=tmp_path)))
    assert (spec.checkpoint.every, spec.checkpoint.dir) == (5, str(tmp_path))


def options(command: str) -> set[str]:
    """The option strings ``unicron COMMAND`` has, exactly as spelled (no abbreviations)."""
    mod, _, prefix = COMMANDS[command][0].partition(":")
    p = argparse.ArgumentParser()
    getattr(importlib.import_module(mod), f"add_{prefix}_arguments" if prefix else "add_arguments")(
        p
    )
    return {s for a in p._actions for s in a.option_strings}


def sbatch_commands() -> list[tuple[str, list[str]]]:
    """Each ``-m unicron COMMAND ...`` of the sbatch script (continuations joined): the
    command and its options."""
    text = re.sub(r"\\\n\s*", " ", SBATCH.read_text())
    found = []
    for m in re.finditer(r"-m unicron (\w+)([^\n|&>;']*)", text):
        words = shlex.split(m.group(2).replace('"', ""))
        found.append((m.group(1), [w for w in words if w.startswith("--")]))
    return found


def test_the_sbatch_script_runs_real_commands_with_flags_they_accept() -> None:
    found = sbatch_commands()
    assert {c for c, _ in found} >= {"coordinator", "agent", "status", "submit", "logs", "cancel"}
    for command, flags in found:
        known = options(command)
        assert set(flags) <= known, f"unicron {command}: {set(flags) - known} unknown"
    agent = dict(found)["agent"]
    assert {"--node-name", "--slots", "--log-dir"} <= set(agent)
    with pytest.raises(UsageError):  # the check can fail: a flag the CLI does not have
        build_parser("agent").parse_args(["agent", "--no-such-flag"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_sbatch_script_parses_and_asks_for_what_node_failure_needs() -> None:
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    text = SBATCH.read_text()
    assert "#SBATCH --no-kill" in text  # else Slurm ends the job with its first lost node
    assert re.search(r"srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1", text)


def test_the_sbatch_script_keeps_the_events_as_json_lines() -> None:
    # the demo (and a person) reads the task's events back from the state directory as JSON
    # Lines: `unicron logs` prints them so only with --json (readable lines by default)
    text = re.sub(r"\\\n\s*", " ", SBATCH.read_text())
    kept = [m.group(0) for m in re.finditer(r"-m unicron logs [^\n]*>[^\n]*\.jsonl", text)]
    assert kept and all("--json" in line for line in kept)
