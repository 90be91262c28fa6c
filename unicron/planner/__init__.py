"""Cost-aware planning (DESIGN.md): model descriptions, performance model and its
calibration, WAF, reward and the DP solver.

Pure library: the ``unicron plan`` command (:mod:`unicron.planner.command`), the coordinator
and the cluster simulator all call :func:`solve` on :class:`TaskState` lists built from
:func:`throughput_table`. Importing this package does not import torch.
"""

from unicron.planner.baselines import equal_share, greedy_marginal, proportional_share, total_waf
from unicron.planner.hardware import GPU_PRESETS, GPUSpec
from unicron.planner.model import MODEL_PRESETS, ModelSpec
from unicron.planner.perf import (
    DEFAULT_OPTIONS,
    Layout,
    ParallelConfig,
    PerfOptions,
    best_config,
    evaluate,
    layout_table,
    state_bytes,
    throughput_table,
)
from unicron.planner.solver import (
    Plan,
    TaskState,
    expected_time_to_failure_s,
    solve,
    transition_time_s,
    waf,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "GPUSpec",
    "Layout",
    "ModelSpec",
    "ParallelConfig",
    "PerfOptions",
    "Plan",
    "TaskState",
    "best_config",
    "equal_share",
    "evaluate",
    "expected_time_to_failure_s",
    "greedy_marginal",
    "layout_table",
    "proportional_share",
    "solve",
    "state_bytes",
    "throughput_table",
    "total_waf",
    "transition_time_s",
    "waf",
]
