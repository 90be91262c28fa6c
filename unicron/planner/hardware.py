"""GPU specifications for the performance model (DESIGN.md, planning).

:class:`GPUSpec` is plain data: :func:`unicron.planner.perf.best_config` reads it, the
``unicron plan`` spec loader builds one from a preset name or a custom mapping, and the
cluster simulator passes one in. Figures are vendor datasheet values for SXM parts; the
bandwidths are *unidirectional, per GPU* (what one GPU can push while all its peers do the
same), which is what a ring collective sees.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One GPU type as the performance model sees it."""

    name: str
    """Label shown in tables (e.g. ``"A100-80GB"``)."""
    peak_flops: float
    """Dense bf16 tensor-core peak, FLOP/s per GPU (no sparsity)."""
    memory_bytes: float
    """Device memory, bytes."""
    intra_node_bw: float
    """NVLink/NVSwitch bandwidth inside a node, bytes/s per GPU, one direction."""
    inter_node_bw: float
    """Network bandwidth between nodes, bytes/s per GPU (its share of the node's NICs)."""
    fp8_peak_flops: float = 0.0
    """Dense FP8 tensor-core peak, FLOP/s per GPU; 0 where the GPU has no FP8 (A100)."""
    memory_bw: float = 2.0e12
    """Device memory (HBM) bandwidth, bytes/s: prices the optimizer step."""
    efficiency: float = 0.75
    """Fraction of ``peak_flops`` a very large bf16 GEMM sustains inside training (fitted per
    GPU generation on the calibration runs, docs/planner.md); the performance model scales
    it down for small hidden sizes and micro-batches."""
    attention_efficiency: float = 0.6
    """Flash-attention kernels' efficiency relative to the GEMMs' on this GPU (fitted)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        for field in ("peak_flops", "memory_bytes", "intra_node_bw", "inter_node_bw", "memory_bw"):
            value = getattr(self, field)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{field}: must be a positive finite number, got {value!r}")
        if not (0 <= self.fp8_peak_flops < float("inf")):
            raise ValueError(
                f"fp8_peak_flops: must be >= 0 and finite, got {self.fp8_peak_flops!r}"
            )
        for field in ("efficiency", "attention_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 2:
                raise ValueError(f"{field}: must be in (0, 2], got {value!r}")


# Fitted on the calibration runs (unicron/planner/data/runs.yaml, docs/planner.md):
# ``python -m unicron.planner.calibration --fit`` refits (from the constants in force; the
# calibration set leaves a ridge along which repeated refits drift, docs/planner.md).
EFFICIENCY_AMPERE = 0.86
EFFICIENCY_HOPPER = 0.645
ATTENTION_AMPERE = 0.53
ATTENTION_HOPPER = 0.38

GPU_PRESETS: dict[str, GPUSpec] = {
    # A100 SXM 80GB: 312 TFLOP/s bf16, no FP8; HBM2e 2,039 GB/s; NVLink3 600 GB/s
    # bidirectional; DGX A100 / Selene has 8 x 200 Gb/s HDR InfiniBand per node, one per GPU.
    "A100-80GB": GPUSpec(
        name="A100-80GB",
        peak_flops=312e12,
        memory_bytes=80 * GIB,
        intra_node_bw=300 * GB,
        inter_node_bw=25 * GB,
        memory_bw=2039 * GB,
        efficiency=EFFICIENCY_AMPERE,
        attention_efficiency=ATTENTION_AMPERE,
    ),
    # A100 SXM 40GB: same compute, HBM2 1,555 GB/s.
    "A100-40GB": GPUSpec(
        name="A100-40GB",
        peak_flops=312e12,
        memory_bytes=40 * GIB,
        intra_node_bw=300 * GB,
        inter_node_bw=25 * GB,
        memory_bw=1555 * GB,
        efficiency=EFFICIENCY_AMPERE,
        attention_efficiency=ATTENTION_AMPERE,
    ),
    # A800 SXM 80GB: the export variant of the A100; same compute and memory, NVLink cut
    # to 400 GB/s bidirectional. The Unicron paper's cluster: assume one 200 Gb/s NIC per GPU.
    "A800-80GB": GPUSpec(
        name="A800-80GB",
        peak_flops=312e12,
        memory_bytes=80 * GIB,
        intra_node_bw=200 * GB,
        inter_node_bw=25 * GB,
        memory_bw=2039 * GB,
        efficiency=EFFICIENCY_AMPERE,
        attention_efficiency=ATTENTION_AMPERE,
    ),
    # H100 SXM 80GB: 989 TFLOP/s dense bf16, 1,979 dense FP8; HBM3 3,350 GB/s; NVLink4
    # 900 GB/s bidirectional; DGX H100 has 8 x 400 Gb/s NDR per node, one per GPU (50 GB/s).
    "H100-80GB": GPUSpec(
        name="H100-80GB",
        peak_flops=989e12,
        memory_bytes=80 * GIB,
        intra_node_bw=450 * GB,
        inter_node_bw=50 * GB,
        fp8_peak_flops=1979e12,
        memory_bw=3350 * GB,
        efficiency=EFFICIENCY_HOPPER,
        attention_efficiency=ATTENTION_HOPPER,
    ),
    # H200 SXM 141GB: the H100 chip (same peaks and links) with 141 GB of HBM3e at
    # 4,800 GB/s. No public training run to fit on: it takes the H100's efficiency.
    "H200-141GB": GPUSpec(
        name="H200-141GB",
        peak_flops=989e12,
        memory_bytes=141 * GB,
        intra_node_bw=450 * GB,
        inter_node_bw=50 * GB,
        fp8_peak_flops=1979e12,
        memory_bw=4800 * GB,
        efficiency=EFFICIENCY_HOPPER,
        attention_efficiency=ATTENTION_HOPPER,
    ),
}
