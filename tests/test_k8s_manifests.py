"""The Kubernetes example (``examples/k8s/``), checked offline: no cluster here.

Every manifest is validated against the Kubernetes API schema (``kubernetes-validate``,
strict: an unknown field is an error) for the oldest and the newest version it ships; then
what the schema cannot see: the names one object uses exist in another (Secret and key,
claims, the Service's selector and target port, the agents' coordinator URL), each
Deployment's and DaemonSet's selector matches its pods, every ``$(VAR)`` a command uses is
defined in its container, the commands are real ``unicron`` commands with options that the
CLI accepts, the agents' ``--slots`` equals the GPUs they ask for, and the example task
file is a valid task whose script is in the repository (the image copies it).
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from unicron.cli import COMMANDS, build_parser
from unicron.control import taskspec
from unicron.errors import UsageError

kv = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[1] / "examples" / "k8s"
FILES = sorted(K8S.glob("*.yaml"))
MANIFESTS = [p for p in FILES if p.name != "task.yaml"]


def docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def of(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every workload."""
    pods = [
        d["spec"]["template"]["spec"] for d in docs() if d["kind"] in ("Deployment", "DaemonSet")
    ]
    return [(pod, c) for pod in pods for c in pod["containers"]]


def versions() -> list[str]:
    shipped = sorted(kv.utils.all_versions(), key=lambda v: tuple(map(int, v.split("."))))
    return [shipped[0], shipped[-1]]


@pytest.mark.parametrize("version", versions())
def test_every_manifest_is_valid_against_the_api_schema(version: str) -> None:
    assert {p.name for p in MANIFESTS} == {"agents.yaml", "coordinator.yaml", "secret.yaml",
                                            "storage.yaml"}  # fmt: skip
    for doc in docs():
        kv.validate(doc, version, strict=True)  # raises with the field's path


def test_the_schema_check_can_fail() -> None:
    svc = of("Service")["unicron-coordinator"]
    bad = {**svc, "spec": {**svc["spec"], "prots": svc["spec"]["ports"]}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, versions()[-1], strict=True)


def test_selectors_match_their_pods_and_the_service_finds_the_coordinator() -> None:
    for kind in ("Deployment", "DaemonSet"):
        for d in of(kind).values():
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = of("Service")["unicron-coordinator"]
    pod = of("Deployment")["unicron-coordinator"]["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    (container,) = pod["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["targetPort"] in named
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"]["port"] in named
    assert f"{named[port['targetPort']]}" == flag(container["command"], "--port")


def test_secrets_and_claims_that_pods_use_exist() -> None:
    secrets, claims = of("Secret"), of("PersistentVolumeClaim")
    assert containers()
    for pod, c in containers():
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets, ref
                assert ref["key"] in secrets[ref["name"]].get("stringData", {}), ref
        mounted = {m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounted <= set(volumes)
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        token = [e for e in c["env"] if e["name"] == "UNICRON_TOKEN"]
        assert token, f"{c['name']}: no UNICRON_TOKEN: every request needs the token"


def options(command: str) -> set[str]:
    """The option strings ``unicron COMMAND`` has, exactly as spelled (no abbreviations)."""
    mod, _, prefix = COMMANDS[command][0].partition(":")
    p = argparse.ArgumentParser()
    getattr(importlib.import_module(mod), f"add_{prefix}_arguments" if prefix else "add_arguments")(
        p
    )
    return {s for a in p._actions for s in a.option_strings}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_commands_are_unicron_commands_with_options_the_cli_accepts() -> None:
    seen = set()
    for _, c in containers():
        argv = c["command"]
        assert argv[0] == "unicron"
        defined = {e["name"] for e in c.get("env", [])}
        used = {v for a in argv for v in re.findall(r"\$\((\w+)\)", a)}
        assert used <= defined, f"{c['name']}: {used - defined} not in its env"
        args = build_parser(argv[1]).parse_args(argv[1:])  # UsageError on a wrong option
        spelled = {a for a in argv if a.startswith("--")}
        assert spelled <= options(argv[1]), f"unicron {argv[1]}: {spelled - options(argv[1])}"
        seen.add(args.command)
    assert seen == {"coordinator", "agent"}
    with pytest.raises(UsageError):  # the check can fail
        build_parser("agent").parse_args(["agent", "--slots", "8", "--no-such-flag"])
    assert "--slot" not in options("agent")


def test_agents_reach_the_service_and_ask_for_as_many_gpus_as_slots() -> None:
    svc = of("Service")["unicron-coordinator"]
    (agent,) = of("DaemonSet")["unicron-agent"]["spec"]["template"]["spec"]["containers"]
    url = urlsplit(flag(agent["command"], "--coordinator"))
    assert url.hostname == svc["metadata"]["name"]
    assert url.port == svc["spec"]["ports"][0]["port"]
    gpus = agent["resources"]["limits"]["nvidia.com/gpu"]
    assert flag(agent["command"], "--slots") == gpus == agent["resources"]["requests"][
        "nvidia.com/gpu"]  # fmt: skip
    (coordinator,) = of("Deployment")["unicron-coordinator"]["spec"]["template"]["spec"][
        "containers"]  # fmt: skip
    mounts = {m["mountPath"]: m["name"] for m in coordinator["volumeMounts"]}
    assert mounts[flag(coordinator["command"], "--state-dir")] == "state"


def test_the_example_task_is_valid_and_its_files_are_shared() -> None:
    spec = taskspec.load(K8S / "task.yaml")  # the script must exist: the image copies it
    assert spec.device == "cuda" and spec.checkpoint.dir is not None
    shared = {m["mountPath"] for _, c in containers() for m in c["volumeMounts"]
              if m["name"] == "shared"}  # fmt: skip
    assert shared == {"/shared"}
    assert spec.checkpoint.dir.startswith("/shared/")  # every worker writes there
