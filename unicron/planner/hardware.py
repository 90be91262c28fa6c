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

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        for field in ("peak_flops", "memory_bytes", "intra_node_bw", "inter_node_bw"):
            value = getattr(self, field)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{field}: must be a positive finite number, got {value!r}")


GPU_PRESETS: dict[str, GPUSpec] = {
    # A100 SXM 80GB: 312 TFLOP/s bf16; NVLink3 600 GB/s bidirectional; DGX A100 / Selene
    # has 8 x 200 Gb/s HDR InfiniBand per node, one per GPU (25 GB/s).
    "A100-80GB": GPUSpec(
        name="A100-80GB",
        peak_flops=312e12,
        memory_bytes=80 * GIB,
        intra_node_bw=300 * GB,
        inter_node_bw=25 * GB,
    ),
    # A800 SXM 80GB: the export variant of the A100; same compute and memory, NVLink cut
    # to 400 GB/s bidirectional. The Unicron paper's cluster: assume one 200 Gb/s NIC per GPU.
    "A800-80GB": GPUSpec(
        name="A800-80GB",
        peak_flops=312e12,
        memory_bytes=80 * GIB,
        intra_node_bw=200 * GB,
        inter_node_bw=25 * GB,
    ),
    # H100 SXM 80GB: 989 TFLOP/s dense bf16; NVLink4 900 GB/s bidirectional; DGX H100 has
    # 8 x 400 Gb/s NDR per node, one per GPU (50 GB/s).
    "H100-80GB": GPUSpec(
        name="H100-80GB",
        peak_flops=989e12,
        memory_bytes=80 * GIB,
        intra_node_bw=450 * GB,
        inter_node_bw=50 * GB,
    ),
}
