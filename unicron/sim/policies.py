"""The policies the simulator compares, by name: Unicron's (:mod:`unicron.sim.unicron_policy`)
and the baselines (:mod:`unicron.sim.baselines`), over the base of :mod:`unicron.sim.policy`
(what a policy is, how a failure is seen), with :func:`make_policy` and every tunable
constant's source (:data:`CONSTANTS`, docs/simulator.md's table).
"""

from __future__ import annotations

from typing import Literal

from unicron.sim.baselines import (
    ARTIFACT_COMMIT,
    ARTIFACT_POINTS,
    BAMBOO_ARTIFACT_OOM,
    BAMBOO_OVER_OOBLECK,
    BAMBOO_REBALANCE_S,
    OOBLECK_RECONFIGURE_S,
    VARUNA_CHECKPOINT_S,
    VARUNA_RESTART_S,
    Bamboo,
    Megatron,
    Megatron30,
    MegatronWait,
    Oobleck,
    TorchFT,
    Varuna,
    per_model,
)
from unicron.sim.policy import COMM_KINDS, LLAMA3_STORAGE_BW_PER_NODE, Method, Policy, method_of
from unicron.sim.unicron_policy import Unicron, UnicronAll

__all__ = [
    "ARTIFACT_COMMIT",
    "ARTIFACT_POINTS",
    "BAMBOO_ARTIFACT_OOM",
    "BAMBOO_OVER_OOBLECK",
    "BAMBOO_REBALANCE_S",
    "COMM_KINDS",
    "CONSTANTS",
    "LLAMA3_STORAGE_BW_PER_NODE",
    "OOBLECK_RECONFIGURE_S",
    "POLICIES",
    "VARUNA_CHECKPOINT_S",
    "VARUNA_RESTART_S",
    "Bamboo",
    "Megatron",
    "Megatron30",
    "MegatronWait",
    "Method",
    "Oobleck",
    "Policy",
    "TorchFT",
    "Unicron",
    "UnicronAll",
    "Varuna",
    "make_policy",
    "method_of",
    "per_model",
]


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Unicron,
        UnicronAll,
        Megatron,
        Megatron30,
        MegatronWait,
        Oobleck,
        Varuna,
        Bamboo,
        TorchFT,
    )
}
"""Policy name -> class, in report order (``--policies`` takes these names)."""


def make_policy(name: str, *, initial: Literal["planner", "proportional"] = "planner") -> Policy:
    """A policy with its default constants; ``initial`` applies to the baselines only."""
    cls = POLICIES[name]
    if issubclass(cls, Unicron):
        return cls.measured()
    return cls(initial=initial)


A = "Oobleck artifact"
CONSTANTS: tuple[tuple[str, str, str], ...] = (
    # (policy, field, source) for every constant docs/simulator.md lists; the value is the
    # policy's default (Unicron's: make_policy's, read from bench/results).
    ("unicron", "exception_detect_s", "measured: bench/results/error.json, comm kinds"),
    ("unicron", "exit_detect_s", "measured: bench/results/crash.json, error.json"),
    ("unicron", "node_detect_s", "measured: bench/results/node.json detection_heartbeat_s"),
    ("unicron", "hang_floor_s", "measured: bench/results/hang.json detection_s"),
    ("unicron", "hang_factor", "DESIGN.md: hang threshold 3 x step"),
    ("unicron", "regroup_s", "assumption: MegaScale (NSDI'24) section 3.5, init < 30 s"),
    ("unicron", "host_copy_bw_per_gpu", "assumption: PCIe 4.0 x16, ~25 GB/s per GPU"),
    ("unicron", "storage_bw_per_node", "Llama 3 (arXiv 2407.21783) 3.3.4: 2 TB/s / 2,048 nodes"),
    ("unicron", "checkpoint_mtbf_s", "the runtime's checkpoint.mtbf default (3 h)"),
    ("megatron", "timeout_s", "Megatron-LM --distributed-timeout-minutes default 10"),
    ("megatron", "exit_detect_s", "assumption: launcher tears the job down"),
    ("megatron", "restart_s", "assumption: schedule, launch, NCCL init"),
    ("megatron", "checkpoint_interval_s", "assumption: typical of large runs"),
    ("megatron", "storage_bw_per_node", "Llama 3 (arXiv 2407.21783) 3.3.4: 2 TB/s / 2,048 nodes"),
    ("varuna", "node_detect_s", "assumption: manager heartbeat"),
    ("varuna", "checkpoint_every_iters", f"{A} varuna_simulator.py checkpoint_per_iter"),
    ("varuna", "max_stall_fraction", "assumption: artifact's scenarios stall ~6 %"),
    ("varuna", "cost_scale", f"{A}: per-model checkpoint and restart times (x1)"),
    ("oobleck", "failure_detect_s", "assumption: agents' connections drop"),
    ("oobleck", "lost_step_scale", f"{A} oobleck_simulator.py: the step in flight is wasted"),
    ("oobleck", "cost_scale", f"{A}: per-model reconfiguration 2-10 s (x1)"),
    ("bamboo", "redundancy_factor", f"{A}: Bamboo / Oobleck BERT-large tputs, 15-30 nodes"),
    ("bamboo", "cost_scale", f"{A}: per-model rebuild 76-450 s (x1)"),
    ("torchft", "timeout_s", "torchft Manager timeout default 60 s"),
    ("torchft", "error_detect_s", "assumption"),
    ("torchft", "restart_s", "assumption"),
    ("torchft", "heal_bw_per_node", "A800 preset: 8 x 200 Gb/s NICs"),
)
"""Every tunable constant of the policies with its source (docs/simulator.md's table)."""
