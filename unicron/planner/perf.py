"""Performance model: how fast a GPT model trains on k GPUs (DESIGN.md, planning).

:func:`best_config` searches the Megatron-LM style 3D parallel configurations (tensor,
pipeline and data parallel degree, micro-batch size, activation recomputation) of a model
on ``k`` GPUs, drops the ones that do not fit in memory, estimates the iteration time of
each and returns the fastest. :func:`throughput_table` tabulates its achieved FLOP/s over
allocation sizes; the solver (:mod:`unicron.planner.solver`), the ``unicron plan`` command
and the cluster simulator read those tables. Everything here is a pure function of plain
data; the results are memoised because the simulator asks for the same tables again and
again.

Assumptions (docs/planner.md explains and calibrates them):

- Mixed-precision Adam as in Megatron-LM: bf16 weights, fp32 main gradients, fp32 master
  weights and two fp32 moments: 18 bytes per parameter, or 6 + 12/dp with the distributed
  optimizer (optimizer state sharded over the data-parallel group).
- Activations per layer and micro-batch from Korthikanti et al. 2022 (arXiv 2205.05198)
  with sequence parallelism: ``s*b*h*34/t`` bytes, plus ``5*a*s^2*b/t`` for the attention
  scores unless flash attention is on (default). Full recomputation keeps only the
  ``2*s*b*h/t`` layer inputs plus one layer's working set. 1F1B keeps ``min(p, m)``
  micro-batches in flight on the first stage.
- Time: compute at ``peak * efficiency``, efficiency growing with the hidden size and the
  tokens per micro-batch (two saturating factors, fitted to published measurements); the
  slowest pipeline stage (its layers plus the logit layer) sets the pace;
  non-interleaved 1F1B with a bubble of ``(p - 1)`` micro-batch slots; tensor-parallel
  all-reduces (4 per layer, 6 with recomputation) on the intra-node links, never
  overlapped; pipeline point-to-point sends with the scatter/gather optimisation; one
  gradient all-reduce (or reduce-scatter + all-gather) per iteration, not overlapped.
- Placement: tensor parallel innermost (inside a node), then data, then pipeline
  parallel. A collective uses the inter-node bandwidth as soon as its group spans nodes.
- Achieved FLOP/s counts model FLOPs only (:attr:`ModelSpec.flops_per_token`), not the
  recomputed forward pass: it is useful work, which is what WAF should weigh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from unicron.planner.hardware import GIB, GPUSpec


def _require_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT (decoder-only transformer) model shape."""

    name: str
    """Label shown in tables (e.g. ``"gpt-13b"``)."""
    layers: int
    """Transformer layers ``l``."""
    hidden: int
    """Hidden size ``h``; a multiple of ``heads``."""
    heads: int
    """Attention heads ``a``."""
    seq_len: int
    """Sequence length ``s`` in tokens."""
    vocab: int
    """Vocabulary size ``V`` (padded)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        for field in ("layers", "hidden", "heads", "seq_len", "vocab"):
            _require_positive_int(field, getattr(self, field))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden: must be a multiple of heads ({self.heads}), got {self.hidden}"
            )

    @property
    def params(self) -> int:
        """Parameter count, Narayanan et al. 2021 eq. 2: ``12lh^2 + 13lh + (V+s)h``."""
        n_layers, h = self.layers, self.hidden
        return 12 * n_layers * h * h + 13 * n_layers * h + (self.vocab + self.seq_len) * h

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward, no recomputation: ``6N + 12lsh``.

        ``6N`` covers the weight matmuls (2 forward, 4 backward per weight), ``12lsh`` the
        attention score and value matmuls; it equals Narayanan et al. 2021 eq. 3 without
        its recomputed forward pass.
        """
        return 6.0 * self.params + 12.0 * self.layers * self.seq_len * self.hidden

    @property
    def recompute_flops_per_token(self) -> float:
        """Extra FLOPs per token when every layer's forward pass is recomputed."""
        return self.layers * (24.0 * self.hidden**2 + 4.0 * self.seq_len * self.hidden)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    # GPT-3 family shapes (Brown et al. 2020, table 2.1), sequence 2048, Megatron vocab 51200.
    "gpt-1.3b": _gpt("gpt-1.3b", 24, 2048, 16),
    "gpt-2.7b": _gpt("gpt-2.7b", 32, 2560, 32),
    "gpt-6.7b": _gpt("gpt-6.7b", 32, 4096, 32),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-30b": _gpt("gpt-30b", 48, 7168, 56),
    "gpt-70b": _gpt("gpt-70b", 80, 8192, 64),
    "gpt-175b": _gpt("gpt-175b", 96, 12288, 96),
}


@dataclass(frozen=True, kw_only=True)
class PerfOptions:
    """Knobs of the performance model; the defaults are the calibrated ones."""

    efficiency_max: float = 0.67
    """Fraction of peak a very large GEMM reaches (fitted, docs/planner.md)."""
    efficiency_half_hidden: float = 800.0
    """Hidden size at which the hidden-size factor of the efficiency is 1/2 (fitted)."""
    efficiency_half_tokens: float = 128.0
    """Tokens per micro-batch at which the micro-batch factor of the efficiency is 1/2."""
    memory_usable_fraction: float = 0.9
    """Share of device memory the model may fill (the rest: CUDA context, NCCL buffers,
    allocator fragmentation)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over the data-parallel group (Megatron's distributed optimizer)."""
    flash_attention: bool = True
    """No ``s^2`` attention-score activations (Dao et al. 2022)."""
    allow_recompute: bool = True
    """Try full activation recomputation when a configuration does not fit without it."""
    max_micro_batch: int = 16
    """Largest micro-batch size searched (powers of two dividing the global batch)."""
    grad_bytes: int = 4
    """Bytes per gradient element on the wire (fp32 main gradients)."""

    def __post_init__(self) -> None:
        if not 0 < self.efficiency_max <= 1:
            raise ValueError(f"efficiency_max: must be in (0, 1], got {self.efficiency_max}")
        if not self.efficiency_half_hidden >= 0:
            raise ValueError("efficiency_half_hidden: must be >= 0")
        if not self.efficiency_half_tokens >= 0:
            raise ValueError("efficiency_half_tokens: must be >= 0")
        if not 0 < self.memory_usable_fraction <= 1:
            raise ValueError("memory_usable_fraction: must be in (0, 1]")
        _require_positive_int("max_micro_batch", self.max_micro_batch)
        _require_positive_int("grad_bytes", self.grad_bytes)


DEFAULT_OPTIONS = PerfOptions()


@dataclass(frozen=True)
class ParallelConfig:
    """One parallel configuration of a task and its estimated performance."""

    tp: int
    """Tensor-parallel degree (inside one node)."""
    pp: int
    """Pipeline-parallel degree (divides the layers)."""
    dp: int
    """Data-parallel degree; ``tp * pp * dp`` is the GPU count."""
    micro_batch: int
    """Sequences per micro-batch."""
    iter_time_s: float
    """Estimated seconds per training iteration (one global batch)."""
    achieved_flops: float
    """Model FLOP/s over all GPUs of the task."""
    memory_bytes_per_gpu: float
    """Estimated peak memory of the fullest GPU, bytes."""
    recompute: bool = False
    """Whether full activation recomputation is on."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def state_bytes(model: ModelSpec) -> float:
    """Bytes of training state to move in a transition: bf16 weights + fp32 master + Adam.

    14 bytes per parameter (gradients are recomputed, not moved). Called by the command and
    the simulator to price :func:`unicron.planner.solver.transition_time_s`.
    """
    return 14.0 * model.params


def _stage_params(model: ModelSpec, tp: int, pp: int) -> float:
    """Parameters held by one GPU of the fullest stage (the one with the embeddings)."""
    h = model.hidden
    per_layer = 12 * h * h + 13 * h
    embed = (model.vocab + model.seq_len) * h
    return (model.layers // pp * per_layer + embed) / tp


def _efficiency(model: ModelSpec, micro_batch: int, opts: PerfOptions) -> float:
    h = model.hidden
    tokens = micro_batch * model.seq_len
    return (
        opts.efficiency_max
        * h
        / (h + opts.efficiency_half_hidden)
        * tokens
        / (tokens + opts.efficiency_half_tokens)
    )


def _memory(
    model: ModelSpec, tp: int, pp: int, dp: int, b: int, m: int, recompute: bool, o: PerfOptions
) -> float:
    p_gpu = _stage_params(model, tp, pp)
    per_param = 6.0 + 12.0 / dp if o.distributed_optimizer else 18.0
    tokens = b * model.seq_len
    h = model.hidden
    full_layer = tokens * h * 34.0 / tp
    if not o.flash_attention:
        full_layer += 5.0 * model.heads * model.seq_len * tokens / tp
    layers_here = model.layers // pp
    in_flight = min(pp, m)
    if recompute:
        acts = layers_here * in_flight * 2.0 * tokens * h / tp + full_layer
    else:
        acts = layers_here * in_flight * full_layer
    logits = 2 * 4.0 * tokens * model.vocab / tp  # fp32 logits and their gradient
    return p_gpu * per_param + acts + logits


def _iter_time(
    model: ModelSpec,
    tp: int,
    pp: int,
    dp: int,
    b: int,
    m: int,
    recompute: bool,
    gpu: GPUSpec,
    gpus_per_node: int,
    o: PerfOptions,
) -> float:
    tokens = b * model.seq_len
    h = model.hidden
    # the slowest stage sets the pace: its share of the layers plus the logit layer
    layer = (
        72.0 * h * h
        + 12.0 * model.seq_len * h
        + (24.0 * h * h + 4.0 * model.seq_len * h if recompute else 0.0)
    )
    stage_flops = model.layers // pp * layer + 6.0 * model.vocab * h
    t_comp = tokens * stage_flops / tp / (gpu.peak_flops * _efficiency(model, b, o))
    t_tp = 0.0
    if tp > 1:
        n_allreduce = 6 if recompute else 4
        t_tp = (
            model.layers
            / pp
            * n_allreduce
            * 2.0
            * (tp - 1)
            / tp
            * (2.0 * tokens * h)
            / gpu.intra_node_bw
        )
    t_p2p = 0.0
    if pp > 1:
        bw = gpu.inter_node_bw if tp * dp >= gpus_per_node else gpu.intra_node_bw
        t_p2p = 2.0 * (2.0 * tokens * h / tp) / bw
    t_pipe = (m + pp - 1) * (t_comp + t_tp + t_p2p)
    t_dp = 0.0
    if dp > 1:
        bw = gpu.inter_node_bw if tp * dp > gpus_per_node else gpu.intra_node_bw
        p_gpu = _stage_params(model, tp, pp)
        if o.distributed_optimizer:  # reduce-scatter gradients, all-gather bf16 weights
            t_dp = (dp - 1) / dp * p_gpu * (o.grad_bytes + 2.0) / bw
        else:  # ring all-reduce of the gradients
            t_dp = 2.0 * (dp - 1) / dp * p_gpu * o.grad_bytes / bw
    return t_pipe + t_dp


def _candidates(
    model: ModelSpec,
    global_batch: int,
    gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    o: PerfOptions,
    fixed: tuple[int, int] | None = None,
    force_recompute: bool = False,
) -> Iterator[ParallelConfig]:
    usable = gpu.memory_bytes * o.memory_usable_fraction
    micro_batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= o.max_micro_batch]
    micro_batches = [b for b in micro_batches if global_batch % b == 0]
    for tp in _divisors(gpus_per_node):
        if model.heads % tp or gpus % tp:
            continue
        for pp in _divisors(model.layers):
            if (gpus // tp) % pp or (fixed is not None and (tp, pp) != fixed):
                continue
            dp = gpus // (tp * pp)
            if _stage_params(model, tp, pp) * (6.0 + 12.0 / dp) > usable:
                continue
            for b in micro_batches:
                total_mb = global_batch // b
                if total_mb < dp:  # a replica with nothing to do: use fewer GPUs instead
                    break
                m = math.ceil(total_mb / dp)  # the ledger may spread micro-batches unevenly
                options = (True,) if force_recompute else (False, True)
                for recompute in options:
                    if recompute and not (o.allow_recompute or force_recompute):
                        continue
                    mem = _memory(model, tp, pp, dp, b, m, recompute, o)
                    if mem > usable:
                        continue
                    t = _iter_time(model, tp, pp, dp, b, m, recompute, gpu, gpus_per_node, o)
                    flops = model.flops_per_token * global_batch * model.seq_len / t
                    yield ParallelConfig(tp, pp, dp, b, t, flops, mem, recompute)
                    break  # recomputation only ever costs time: skip it once one fits


def _check_args(global_batch: int, gpus: int, gpus_per_node: int) -> None:
    _require_positive_int("global_batch", global_batch)
    _require_positive_int("gpus_per_node", gpus_per_node)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus: must be a non-negative integer, got {gpus!r}")


@functools.lru_cache(maxsize=65536)
def best_config(
    model: ModelSpec,
    global_batch: int,
    gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    options: PerfOptions = DEFAULT_OPTIONS,
) -> ParallelConfig | None:
    """The fastest configuration of ``model`` on exactly ``gpus`` GPUs, or None if none fits.

    Ties go to the configuration listed first (smaller tp, then smaller pp, then smaller
    micro-batch), so the answer is deterministic. Memoised.
    """
    _check_args(global_batch, gpus, gpus_per_node)
    if gpus == 0:
        return None
    best: ParallelConfig | None = None
    for cfg in _candidates(model, global_batch, gpus, gpu, gpus_per_node, options):
        if best is None or cfg.iter_time_s < best.iter_time_s:
            best = cfg
    return best


@functools.lru_cache(maxsize=1024)
def _table(
    model: ModelSpec,
    global_batch: int,
    max_gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    unit: int,
    options: PerfOptions,
) -> np.ndarray:
    out = np.zeros(max_gpus // unit + 1, dtype=np.float64)
    for u in range(1, len(out)):
        cfg = best_config(model, global_batch, u * unit, gpu, gpus_per_node, options)
        if cfg is not None:
            out[u] = cfg.achieved_flops
    out.setflags(write=False)
    return out


def throughput_table(
    model: ModelSpec,
    global_batch: int,
    max_gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    unit: int = 1,
    options: PerfOptions = DEFAULT_OPTIONS,
) -> np.ndarray:
    """Achieved FLOP/s with ``u * unit`` GPUs for ``u = 0 .. max_gpus // unit``.

    0.0 where no configuration fits. The array is memoised and read-only: the simulator and
    the command call this for every task on every event.
    """
    _check_args(global_batch, max_gpus, gpus_per_node)
    _require_positive_int("unit", unit)
    return _table(model, global_batch, max_gpus, gpu, gpus_per_node, unit, options)


def megatron_flops_per_gpu(model: ModelSpec, global_batch: int, gpus: int, iter_s: float) -> float:
    """FLOP/s per GPU as Narayanan et al. 2021 report it (eq. 3, counts the recompute pass)."""
    n_layers, h, s, v = model.layers, model.hidden, model.seq_len, model.vocab
    f = 96.0 * global_batch * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))
    return f / iter_s / gpus


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One published end-to-end throughput measurement used for calibration."""

    model: ModelSpec
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    """As published: Megatron FLOPs (recompute pass included) per second per GPU, in 1e12."""


def _m(
    layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, b: int, tf: float
) -> Measurement:
    model = ModelSpec(
        name=f"megatron-{layers}x{hidden}",
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq_len=2048,
        vocab=51200,
    )
    return Measurement(model=model, tp=tp, pp=pp, gpus=gpus, global_batch=b, tflops_per_gpu=tf)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21 (arXiv 2104.04473): table 1 (weak scaling, 1.7B to 1T parameters) and
# table 2 (PTD-P rows, GPT-3 175B at 384/768/1536 GPUs, t=8, p=12). A100-80GB, Selene
# (8 x HDR 200 Gb/s per node), activation recomputation on, fp16.
MEGATRON_2021: tuple[Measurement, ...] = (
    _m(24, 2304, 24, 1, 1, 32, 512, 137),
    _m(30, 3072, 32, 2, 1, 64, 512, 138),
    _m(36, 4096, 32, 4, 1, 128, 512, 142),
    _m(40, 6144, 48, 8, 1, 256, 1024, 135),
    _m(48, 8192, 64, 8, 2, 512, 1536, 138),
    _m(60, 10240, 80, 8, 4, 1024, 1792, 140),
    _m(80, 12288, 96, 8, 8, 1536, 2304, 148),
    _m(96, 16384, 128, 8, 16, 1920, 2160, 155),
    _m(105, 20480, 128, 8, 35, 2520, 2520, 163),
    _m(128, 25600, 160, 8, 64, 3072, 3072, 163),
    _m(96, 12288, 96, 8, 12, 384, 1536, 153),
    _m(96, 12288, 96, 8, 12, 768, 1536, 149),
    _m(96, 12288, 96, 8, 12, 1536, 1536, 141),
)


def predict_measurement(
    meas: Measurement, gpu: GPUSpec, options: PerfOptions = DEFAULT_OPTIONS
) -> float | None:
    """Predicted TFLOP/s per GPU, in the published unit, for the published (tp, pp, dp).

    Recomputation is forced (the runs used it); the micro-batch is searched. None if the
    configuration does not fit in the model's memory estimate.
    """
    opts = replace(options, distributed_optimizer=False)  # not in Megatron-LM of 2021
    best: ParallelConfig | None = None
    for cfg in _candidates(
        meas.model,
        meas.global_batch,
        meas.gpus,
        gpu,
        8,
        opts,
        fixed=(meas.tp, meas.pp),
        force_recompute=True,
    ):
        if best is None or cfg.iter_time_s < best.iter_time_s:
            best = cfg
    if best is None:
        return None
    per_gpu = megatron_flops_per_gpu(meas.model, meas.global_batch, meas.gpus, best.iter_time_s)
    return per_gpu / 1e12


__all__ = [
    "DEFAULT_OPTIONS",
    "GIB",
    "MEGATRON_2021",
    "MODEL_PRESETS",
    "Measurement",
    "ModelSpec",
    "ParallelConfig",
    "PerfOptions",
    "best_config",
    "megatron_flops_per_gpu",
    "predict_measurement",
    "state_bytes",
    "throughput_table",
]
