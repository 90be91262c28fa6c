"""Performance model: how fast a transformer trains on k GPUs (DESIGN.md, planning).

:func:`best_config` searches the parallel layouts people run (tensor, context, pipeline
with uneven and interleaved stages, data parallel with the distributed optimizer or fully
sharded, expert parallel for mixtures of experts, micro-batch size, no / selective / full
activation recomputation) of a :class:`~unicron.planner.model.ModelSpec` on exactly ``k``
GPUs, drops the ones that do not fit in memory, estimates the iteration time of each and
returns the fastest, or a layout with memory headroom when the fastest fills the GPU and
the two are closer than the model's own error. :func:`evaluate` prices one given layout
(the calibration in :mod:`unicron.planner.calibration` calls it on published runs).
:func:`throughput_table` tabulates achieved FLOP/s over allocation sizes for the solver,
the ``unicron plan`` command and the cluster simulator. Everything is a pure function of
plain data, memoised. docs/planner.md states every assumption and the calibration.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from unicron.planner.hardware import GIB, GPUSpec
from unicron.planner.layout import (
    RECOMPUTE_MODES,
    SHARDINGS,
    SPLITS,
    Layout,
    ParallelConfig,
    launch_problems,
    megatron_flops_per_gpu,
    stage_layers,
)
from unicron.planner.model import MODEL_PRESETS, ModelSpec, _require_positive_int

PRECISIONS = ("bf16", "fp8")
_DP_BUCKET_BYTES = 40e6 * 4  # Megatron-LM's gradient buckets: 40M fp32 elements


@dataclass(frozen=True, kw_only=True)
class PerfOptions:
    """Knobs of the performance model; the defaults are the calibrated ones (docs/planner.md)."""

    efficiency_max: float | None = None
    """Fraction of peak a very large GEMM reaches; None: the GPU's own
    (:attr:`~unicron.planner.hardware.GPUSpec.efficiency`)."""
    stack_efficiency: float = 1.0
    """Multiplier for the software stack: 1 for current Megatron-Core / PyTorch FSDP with
    flash attention; the Megatron-LM of 2021 (fp16, no fused kernels) was fitted lower."""
    efficiency_half_hidden: float = 940.0
    """Hidden size at which the hidden-size factor of the efficiency is 1/2 (fitted)."""
    efficiency_half_tokens: float = 56.0
    """Tokens per micro-batch at which the micro-batch factor of the efficiency is 1/2
    (fitted)."""
    fp8_efficiency: float = 0.83
    """An FP8 GEMM's fraction of FP8 peak relative to a bf16 GEMM's fraction of bf16 peak
    (fitted)."""
    precision: str = "bf16"
    """``bf16``, or ``fp8`` (Transformer Engine: the GEMMs in FP8, attention in bf16)."""
    memory_usable_fraction: float = 0.9
    """Share of device memory the model may fill (the rest: CUDA context, NCCL buffers,
    allocator fragmentation)."""
    distributed_optimizer: bool = True
    """Allow sharding the optimizer state over the data-parallel group (ZeRO-1)."""
    optimizer_copies: int = 1
    """Keepers of each share of a sharded optimizer state (``dist-opt``): 1, Megatron's
    distributed optimizer; 2, Unicron's ``zero: 1``, where a lost rank's share lives on its
    buddy (docs/runtime.md, Sharded optimizer state): ``min(1, 2/dp)`` of the state kept and
    stepped per GPU instead of ``1/dp``."""
    grad_sharding: bool = True
    """Allow sharding the gradients too (``optim-grads``: Megatron-FSDP's ``optim_grads``
    strategy, ZeRO-2; Meta's FSDP for Llama 3): reduce-scattered every micro-batch."""
    fsdp: bool = True
    """Allow fully sharded data parallelism (weights, gradients and optimizer state sharded)."""
    flash_attention: bool = True
    """No ``s^2`` attention-score activations and causal blocks skipped (Dao et al. 2022)."""
    allow_recompute: bool = True
    """Try selective, then full activation recomputation when a layout does not fit without."""
    selective_recompute: bool = True
    """Offer selective recomputation (Korthikanti et al. 2022; not in the Megatron-LM of 2021)."""
    interleave: bool = True
    """Try interleaved (virtual) pipeline stages."""
    context_parallel: bool = True
    """Try context parallelism for sequences of 8K tokens and more."""
    overlap: bool = True
    """Overlap data-parallel reduce-scatter / all-gather with the backward / forward pass,
    context-parallel ring exchange with attention, and pipeline sends in interleaved
    schedules, as Megatron-Core and PyTorch FSDP do."""
    overlap_cost: float = 0.47
    """Share of an overlapped transfer's time that still slows the compute it hides behind
    (communication kernels take SMs and memory bandwidth; fitted)."""
    tp_comm_hidden: float = 0.5
    """Share of tensor-parallel communication hidden behind GEMMs when ``overlap`` is on."""
    latency_intra_s: float = 5e-6
    """Per-step latency of a collective inside a node, seconds."""
    latency_inter_s: float = 15e-6
    """Per-step latency of a collective across nodes, seconds; a collective over ``n`` ranks
    pays ``2 ceil(log2 n)`` steps (tree), so 16,384 ranks cost more than 64."""
    max_micro_batch: int = 16
    """Largest micro-batch size searched (powers of two dividing the global batch)."""
    grad_bytes: int = 4
    """Bytes per gradient element on the wire (fp32 main gradients)."""
    model_error: float = 0.10
    """Relative error of the model's time estimate (held-out, docs/planner.md): two layouts
    closer than this are a tie for the headroom rule."""
    headroom_fraction: float = 0.10
    """Share of usable memory a preferred layout leaves free."""
    exact_batch: bool = True
    """The global batch is a whole number of micro-batches on every replica, as Megatron-Core
    requires (``global_batch % (micro_batch * dp) == 0``). False: a replica may run
    ``ceil(global_batch / (micro_batch * dp))``, the batch padded, as the systems the cluster
    simulator compares reshape theirs to any GPU count (:mod:`unicron.sim.engine`)."""

    def __post_init__(self) -> None:
        if self.efficiency_max is not None and not 0 < self.efficiency_max <= 1:
            raise ValueError(f"efficiency_max: must be in (0, 1], got {self.efficiency_max}")
        for name in ("stack_efficiency", "fp8_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 2:
                raise ValueError(f"{name}: must be in (0, 2], got {value!r}")
        if not self.efficiency_half_hidden >= 0:
            raise ValueError("efficiency_half_hidden: must be >= 0")
        if not self.efficiency_half_tokens >= 0:
            raise ValueError("efficiency_half_tokens: must be >= 0")
        if not 0 < self.memory_usable_fraction <= 1:
            raise ValueError("memory_usable_fraction: must be in (0, 1]")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("tp_comm_hidden", "model_error", "headroom_fraction", "overlap_cost"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name}: must be in [0, 1), got {value!r}")
        for name in ("latency_intra_s", "latency_inter_s"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: must be in [0, 1) seconds")
        _require_positive_int("max_micro_batch", self.max_micro_batch)
        _require_positive_int("grad_bytes", self.grad_bytes)
        if self.optimizer_copies not in (1, 2):
            raise ValueError(f"optimizer_copies: must be 1 or 2, got {self.optimizer_copies!r}")


DEFAULT_OPTIONS = PerfOptions()


def state_bytes(model: ModelSpec) -> float:
    """Bytes of training state to move in a transition: bf16 weights + fp32 master + Adam.

    14 bytes per parameter (gradients are recomputed, not moved). Called by the command and
    the simulator to price :func:`unicron.planner.solver.transition_time_s`.
    """
    return 14.0 * model.params


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _latency(ranks: int, inter: bool, o: PerfOptions) -> float:
    if ranks <= 1:
        return 0.0
    alpha = o.latency_inter_s if inter else o.latency_intra_s
    return alpha * 2.0 * math.ceil(math.log2(ranks))


def _group_bw(size: float | np.ndarray, stride: int, gpu: GPUSpec, gpn: int) -> np.ndarray:
    """Bandwidth per GPU of a ring collective over ``size`` ranks spaced ``stride`` apart.

    Inside a node: NVLink. Across nodes, NCCL runs one ring per NIC, so a node's members of
    the group share its NICs: ``members per node x inter_node_bw``, at most NVLink's.
    """
    size = np.asarray(size, dtype=np.float64)
    per_node = np.minimum(size, max(1, gpn // stride))
    across = np.minimum(gpu.intra_node_bw, per_node * gpu.inter_node_bw)
    return np.where(size * stride > gpn, across, gpu.intra_node_bw)


def _logit_layers(model: ModelSpec) -> float:
    """The output layer's work in transformer layers (model FLOPs): ``V h / (W + 2 s h)``."""
    per_layer = model.attention_weights + model.router_weights
    per_layer += model.active_experts * model.expert_weights
    return model.vocab * model.hidden / (per_layer + 2.0 * model.seq_len * model.hidden)


@functools.lru_cache(maxsize=4096)
def best_split(model: ModelSpec, pp: int, vp: int) -> Layout | None:
    """The layer split the search gives ``pp`` stages of ``vp`` virtual stages: among the
    splits Megatron-Core accepts (:func:`stage_layers`), the least work on the slowest stage
    (the last also runs the output layer), then the fewest layers on the first stage (it
    holds the most micro-batches in flight), then the simplest flags (even, embedding-loss,
    first-last). Llama 3 405B's 126 layers on 16 stages: 7, 14 x 8, 7 (Grattafiori et al.
    2024, section 3.3.2), i.e. ``embedding-loss`` with vp 1, 2, 4 or 8. Returns a Layout
    with only ``pp``, ``vp`` and the split fields set, or None when no split is legal."""
    layers, logit = model.layers, _logit_layers(model)
    best: tuple[float, int, int] | None = None
    pick: Layout | None = None

    def consider(lay: Layout, rank: int) -> None:
        nonlocal best, pick
        got = stage_layers(layers, lay)
        if got is None:
            return
        first, mid, last = got
        key = (round(max(first, mid, last + logit), 9), first, rank)
        if best is None or key < best:
            best, pick = key, lay

    consider(Layout(pp=pp, vp=vp), 0)
    if pp == 1:
        return pick
    consider(Layout(pp=pp, vp=vp, split="embedding-loss"), 1)
    # first-last: the middle stages equal, the first and last no fuller than a middle one
    # (pp 2: any two multiples of vp); only the best (first, last) per middle is priced
    mids = [0] if pp == 2 else range(vp, layers // (pp - 2) + 1, vp)
    for mid in mids:
        rest = layers - (pp - 2) * mid
        cap = rest if pp == 2 else mid
        options = [
            (max(f, mid, rest - f + logit), f)
            for f in range(vp, min(cap, rest - vp) + 1, vp)
            if (rest - f) % vp == 0 and vp <= rest - f <= cap
        ]
        if options:
            _, f = min(options)
            lay = Layout(pp=pp, vp=vp, split="first-last", first_layers=f, last_layers=rest - f)
            consider(lay, 2)
    return pick


def _exposed(comm: Any, window: float, o: PerfOptions) -> Any:
    """Time ``comm`` adds when overlapped with ``window`` seconds of compute: what sticks
    out, plus :attr:`PerfOptions.overlap_cost` of what is hidden."""
    hidden = np.minimum(comm, window)
    return comm - hidden + o.overlap_cost * hidden


def _efficiency(hidden: int, tokens: float, gpu: GPUSpec, o: PerfOptions) -> float:
    e_max = o.efficiency_max if o.efficiency_max is not None else gpu.efficiency
    return (
        e_max
        * o.stack_efficiency
        * hidden
        / (hidden + o.efficiency_half_hidden)
        * tokens
        / (tokens + o.efficiency_half_tokens)
    )


def _evaluate(
    model: ModelSpec,
    global_batch: int,
    lay: Layout,
    dp: np.ndarray,
    gpu: GPUSpec,
    gpn: int,
    o: PerfOptions,
) -> tuple[np.ndarray, np.ndarray]:
    """Iteration time (s) and peak memory per GPU (bytes) of ``lay`` for every data-parallel
    degree in ``dp`` (``lay.dp`` is ignored): one numpy pass prices a whole table column."""
    h, s, l_ = model.hidden, model.seq_len, model.layers
    tp, pp, cp, vp, ep, b = lay.tp, lay.pp, lay.cp, lay.vp, lay.ep, lay.micro_batch
    k = model.active_experts
    m = np.ceil(global_batch / (b * dp))
    tokens = b * s / cp  # tokens of one micro-batch on one GPU (before tensor parallelism)
    full = lay.recompute == "full"
    fp8 = o.precision == "fp8" and gpu.fp8_peak_flops > 0

    # -- compute: one micro-batch through one layer (forward + backward), per GPU ---------
    dense_w = model.attention_weights + model.router_weights
    expert_w = k * model.expert_weights
    mult = 8.0 if full else 6.0  # forward 2, backward 4, recomputed forward 2 per weight
    e_dense = _efficiency(h, tokens, gpu, o)
    e_expert = _efficiency(h, tokens * k * ep / model.experts, gpu, o) if model.is_moe else e_dense
    gemm_peak = gpu.fp8_peak_flops * o.fp8_efficiency if fp8 else gpu.peak_flops
    t_gemm = tokens * mult * (dense_w / e_dense + expert_w / e_expert) / tp / gemm_peak
    if o.flash_attention:  # causal blocks skipped; the backward (2.5 forwards) recomputes scores
        attn = 0.5 * 4.0 * s * h * (3.5 + (1.0 if full else 0.0))
        e_attn = e_dense * gpu.attention_efficiency
    else:  # the whole s x s square; recomputation (selective or full) redoes the forward
        attn = 4.0 * s * h * (3.0 + (0.0 if lay.recompute == "none" else 1.0))
        e_attn = e_dense
    t_attn = tokens * attn / tp / (gpu.peak_flops * e_attn)
    t_layer = t_gemm + t_attn
    t_logit = tokens * 6.0 * model.vocab * h / tp / (gemm_peak * e_dense)
    split = stage_layers(l_, lay)
    if split is None:
        raise ValueError(
            f"layout: Megatron-Core cannot split {l_} layers as {lay.split!r} over pp={pp} "
            f"vp={vp} (first_layers={lay.first_layers}, last_layers={lay.last_layers})"
        )
    first_layers, mid_layers, last_layers = split
    if pp == 1:
        work = l_ + t_logit / t_layer
    else:
        work = max(first_layers, mid_layers, last_layers + t_logit / t_layer)
    t_comp = work * t_layer  # the slowest stage sets the pace

    # -- communication per micro-batch on the slowest stage ----------------------------------
    n_stage = work if pp > 1 else float(l_)
    t_comm = np.zeros_like(dp, dtype=np.float64)
    if tp > 1:
        n_coll = 6 if full else 4
        vol = n_coll * 2.0 * (tp - 1) / tp * 2.0 * tokens * h
        t_tp = vol / gpu.intra_node_bw + n_coll * _latency(tp, False, o)
        t_comm += n_stage * t_tp * (1.0 - (o.tp_comm_hidden if o.overlap else 0.0))
    if cp > 1:
        inter = tp * cp > gpn
        vol = 3.0 * (cp - 1) * 2.0 * 2.0 * tokens * model.kv_dim / tp
        t_cp = vol / float(_group_bw(cp, tp, gpu, gpn))
        t_cp += 3 * (cp - 1) * (o.latency_inter_s if inter else o.latency_intra_s)
        t_comm += n_stage * (_exposed(t_cp, t_attn, o) if o.overlap else t_cp)
    if model.is_moe and ep > 1:
        inter = tp * cp * ep > gpn
        n_a2a = 6 if full else 4
        vol = n_a2a * (ep - 1) / ep * tokens * k * h * 2.0 / tp
        t_ep = vol / float(_group_bw(ep, tp * cp, gpu, gpn))
        t_comm += n_stage * (t_ep + n_a2a * _latency(ep, inter, o))
    if pp > 1:
        p2p_inter = tp * cp * dp >= gpn
        bw = np.where(p2p_inter, gpu.inter_node_bw, gpu.intra_node_bw)
        alpha = np.where(p2p_inter, o.latency_inter_s, o.latency_intra_s)
        if vp > 1 and o.overlap:  # interleaved 1F1B overlaps its sends with compute
            t_comm += vp * 2.0 * alpha
        else:
            t_comm += vp * 2.0 * (2.0 * tokens * h / tp / bw + alpha)

    # -- parameters held by the fullest GPU ---------------------------------------------------
    per_layer = model.dense_layer_params / tp + model.expert_layer_params / (tp * ep)
    dense_share = model.dense_layer_params / tp / per_layer
    table = model.vocab * h
    positions = s * h if model.learned_positions else 0
    if pp == 1:
        p_first = p_last = l_ * per_layer + model.embedding_params / tp
    else:
        p_first = first_layers * per_layer + (table + positions) / tp
        p_last = last_layers * per_layer + table / tp
    p_mid = mid_layers * per_layer
    p_gpu = max(p_first, p_last, p_mid)
    shard = dp * cp
    sharded = dense_share / shard + (1 - dense_share) / np.maximum(shard / ep, 1)
    kept = np.minimum(1.0, o.optimizer_copies * sharded)  # dist-opt's share of a GPU

    # -- data-parallel communication (per iteration, or per micro-batch with FSDP) --------------
    dp_inter = tp * shard > gpn
    bw = _group_bw(shard, tp, gpu, gpn)
    lat = np.where(
        shard > 1,
        np.where(dp_inter, o.latency_inter_s, o.latency_intra_s) * 2.0 * np.ceil(np.log2(shard)),
        0.0,
    )
    frac = (shard - 1) / shard
    rs_rounds = (np.ceil(m / pp) if vp > 1 else m) if lay.sharding == "optim-grads" else 1.0
    t_fsdp = np.zeros_like(t_comm)
    if lay.sharding == "fsdp":
        # all-gather bf16 weights forward and backward, reduce-scatter gradients
        t_f = frac * p_gpu * (4.0 + o.grad_bytes) / bw + 3 * n_stage * lat
        t_fsdp = _exposed(t_f, t_comp, o) if o.overlap else t_f
        t_dp = np.zeros_like(t_comm)
    else:
        buckets = math.ceil(p_gpu * o.grad_bytes / _DP_BUCKET_BYTES)
        rs_window: Any = 2.0 / 3.0 * t_comp * vp
        if lay.sharding == "dist-opt":
            t_rs = frac * p_gpu * o.grad_bytes / bw
            t_ag = frac * p_gpu * 2.0 / bw
        elif lay.sharding == "optim-grads":
            # no whole gradient is kept: a virtual stage's is reduce-scattered (in fp32) once
            # its backward has run for every micro-batch of a group of pp (interleaved: the
            # schedule runs them back to back), else after every micro-batch (1F1B)
            t_rs = rs_rounds * frac * p_gpu * o.grad_bytes / bw
            t_ag = frac * p_gpu * 2.0 / bw
            rs_window = rs_window * rs_rounds
        else:
            t_rs = 2.0 * frac * p_gpu * o.grad_bytes / bw
            t_ag = np.zeros_like(t_comm)
        if o.overlap:
            t_rs = _exposed(t_rs, rs_window, o)
            t_ag = _exposed(t_ag, 1.0 / 3.0 * t_comp * vp, o)
        t_dp = t_rs + t_ag + 2 * buckets * lat * rs_rounds
    # optimizer step: read and write fp32 master weights, two moments and the gradient
    share: Any = 1.0 if lay.sharding == "ddp" else kept if lay.sharding == "dist-opt" else sharded
    t_opt = p_gpu * share * 32.0 / gpu.memory_bw

    t_slot = t_comp + t_comm + t_fsdp
    t_iter = (m + (pp - 1) / vp) * t_slot + t_dp + t_opt

    # -- memory: the fullest of the first stage (embedding, most micro-batches in flight), the
    # second (a full middle stage, nearly as many in flight) and the last (logits) ------------
    def state(params: float) -> np.ndarray:
        if lay.sharding == "ddp":
            out = params * 18.0 + 0.0 * shard
        elif lay.sharding == "dist-opt":
            out = params * (6.0 + 12.0 * kept)
        elif lay.sharding == "optim-grads":  # bf16 weights whole; fp32 grads, master, Adam sharded
            out = params * (2.0 + 16.0 * sharded)
        else:  # fsdp: everything sharded, plus two layers' weights gathered at a time
            out = params * 18.0 * sharded + 2.0 * 2.0 * per_layer * np.minimum(shard, 2)
        return out + (params if fp8 else 0.0)  # FP8 copies of the weights

    def held(rank: int) -> np.ndarray:
        """Micro-batches of its own layers pipeline rank ``rank`` holds at its peak: 1F1B's
        ``pp - rank``; the interleaved schedule's warm-up forwards (Megatron-Core:
        ``2 (pp - rank - 1) + (vp - 1) pp``, all of them when there are no more) plus one, each
        a virtual stage of ``1/vp`` of the rank's layers."""
        if vp == 1:
            return np.minimum(m, pp - rank)
        return np.minimum(m * vp, 2 * (pp - rank - 1) + (vp - 1) * pp + 1) / vp

    def peak(params: float, act: Any) -> np.ndarray:
        """State plus activations; with ``optim-grads`` the whole-gradient buffers of the
        virtual stages being accumulated and reduce-scattered (two) live only once the
        backward has freed one virtual stage's activations (1F1B: two buckets at a time)."""
        base = state(params) + act
        if lay.sharding != "optim-grads":
            return base
        if vp == 1:
            return base + 2.0 * _DP_BUCKET_BYTES
        buffers = 2.0 * params / vp * o.grad_bytes
        return np.maximum(base, base - act / vp + buffers)

    logits = 2 * 2.0 * tokens * model.vocab / tp  # bf16 logits and their gradient
    if pp == 1:
        mem = peak(p_gpu, _activations(model, lay, tokens, l_, 1.0, o) + logits)
    else:
        act_first = _activations(model, lay, tokens, first_layers, held(0), o)
        act_last = _activations(model, lay, tokens, last_layers, held(pp - 1), o) + logits
        mem = np.maximum(peak(p_first, act_first), peak(p_last, act_last))
        if pp > 2:
            act_mid = _activations(model, lay, tokens, mid_layers, held(1), o)
            mem = np.maximum(mem, peak(p_mid, act_mid))
    return t_iter, mem


def _activations(
    model: ModelSpec,
    lay: Layout,
    tokens: float,
    layers: int,
    in_flight: float | np.ndarray,
    o: PerfOptions,
) -> float | np.ndarray:
    """Activation bytes of ``layers`` layers with ``in_flight`` micro-batches stashed:
    Korthikanti et al. 2022 (arXiv 2205.05198) generalised to GQA, SwiGLU and experts."""
    h, f, tp = model.hidden, model.ffn, lay.tp
    k = model.active_experts
    attn = 2 * h + 2 * h + 4 * model.kv_dim + 2 * h + (h if model.bias else 0)
    mlp = 2 * h + k * ((6 if model.gated else 4) * f) + (h if model.bias else 0)
    per_token = attn + mlp + 4 * h  # + the two norms' inputs
    if lay.recompute == "selective":
        per_token -= k * 2 * f  # the activation function's output is recomputed
    full_layer = tokens * per_token / tp
    if not o.flash_attention and lay.recompute == "none":
        full_layer += 5.0 * model.heads * model.seq_len * tokens / tp  # scores, softmax, mask
    if lay.recompute == "full":
        return layers * in_flight * 2.0 * tokens * h / tp + full_layer
    return layers * in_flight * full_layer


def _micro_batches(global_batch: int, o: PerfOptions) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= o.max_micro_batch and global_batch % b == 0]


def _context_degrees(model: ModelSpec, o: PerfOptions) -> list[int]:
    out = [1]
    if o.context_parallel and model.seq_len >= 8192:
        out += [c for c in (2, 4, 8, 16, 32) if model.seq_len % (2 * c) == 0]
    return out


def _layouts_of_base(
    model: ModelSpec, global_batch: int, tp: int, cp: int, pp: int, o: PerfOptions
) -> Iterator[Layout]:
    """Every layout with these tensor, context and pipeline degrees (dp left at 1): the
    virtual stages whose layer split Megatron-Core accepts (:func:`best_split`), expert
    degrees dividing the experts, the shardings, micro-batches and recomputation modes."""
    splits = [best_split(model, pp, 1)]
    if o.interleave and pp > 1:
        splits += [best_split(model, pp, v) for v in range(2, 9)]
    eps = [e for e in range(1, model.experts + 1) if model.experts % e == 0]
    shardings = ["dist-opt" if o.distributed_optimizer else "ddp"]
    if o.distributed_optimizer and o.grad_sharding:
        shardings.append("optim-grads")
    if o.fsdp and pp == 1:
        shardings.append("fsdp")
    modes: tuple[str, ...] = RECOMPUTE_MODES if o.allow_recompute else ("none",)
    if not o.selective_recompute:
        modes = tuple(r for r in modes if r != "selective")
    for split in splits:
        if split is None:
            continue
        for ep in eps:
            for sharding in shardings:
                for b in _micro_batches(global_batch, o):
                    for rec in modes:
                        yield replace(
                            split,
                            tp=tp,
                            cp=cp,
                            ep=ep,
                            micro_batch=b,
                            sharding=sharding,
                            recompute=rec,
                        )


def _valid_dp(
    model: ModelSpec, global_batch: int, lay: Layout, dp: np.ndarray, o: PerfOptions
) -> np.ndarray:
    """Mask of the data-parallel degrees ``lay`` can run with."""
    b = lay.micro_batch
    # Megatron-Core: a whole number of micro-batches on every replica; else no replica idle
    exact = np.mod(global_batch, b * dp) == 0
    ok = exact if o.exact_batch else dp <= global_batch // b
    if lay.vp > 1:  # interleaved 1F1B needs a multiple of pp micro-batches
        ok &= np.ceil(global_batch / (b * dp)) % lay.pp == 0
    if lay.ep > 1:
        ok &= (dp * lay.cp) % lay.ep == 0
    return ok


@dataclass(frozen=True)
class _Search:
    """Per GPU count k (index), the fastest fitting layout and the fastest with headroom."""

    layouts: tuple[Layout, ...]
    best_t: np.ndarray
    best_i: np.ndarray
    best_mem: np.ndarray
    room_t: np.ndarray
    room_i: np.ndarray
    room_mem: np.ndarray


def _bases(
    model: ModelSpec, gpn: int, o: PerfOptions, max_gpus: int
) -> Iterator[tuple[int, int, int]]:
    s = model.seq_len
    for tp in _divisors(gpn):
        if model.heads % tp or model.kv % tp or tp > max_gpus or s % tp:
            continue
        for cp in _context_degrees(model, o):
            if cp > 1 and (s % (2 * cp) or (s // cp) % tp):  # load-balanced causal chunks
                continue
            for pp in range(1, min(model.layers, max_gpus // (tp * cp)) + 1):
                yield tp, cp, pp


def _search(
    model: ModelSpec,
    global_batch: int,
    gpu: GPUSpec,
    gpn: int,
    o: PerfOptions,
    max_gpus: int,
    exact: bool,
) -> _Search:
    """Search every layout on 1..max_gpus GPUs (or exactly max_gpus when ``exact``)."""
    usable = gpu.memory_bytes * o.memory_usable_fraction
    roomy = usable * (1.0 - o.headroom_fraction)
    n = max_gpus + 1
    best_t, best_i, best_mem = np.full(n, np.inf), np.full(n, -1), np.zeros(n)
    room_t, room_i, room_mem = np.full(n, np.inf), np.full(n, -1), np.zeros(n)
    layouts: list[Layout] = []
    for tp, cp, pp in _bases(model, gpn, o, max_gpus):
        base = tp * cp * pp
        if exact:
            if max_gpus % base:
                continue
            dp = np.array([max_gpus // base], dtype=np.float64)
        else:
            dp = np.arange(1, max_gpus // base + 1, dtype=np.float64)
        ks = (dp * base).astype(np.int64)
        for lay in _layouts_of_base(model, global_batch, tp, cp, pp, o):
            ok = _valid_dp(model, global_batch, lay, dp, o)
            if not ok.any():
                continue
            t, mem = _evaluate(model, global_batch, lay, dp, gpu, gpn, o)
            fits = ok & (mem <= usable)
            if not fits.any():
                continue
            idx = len(layouts)
            layouts.append(lay)
            kk, tt, mm = ks[fits], t[fits], mem[fits]
            better = tt < best_t[kk]
            best_t[kk[better]] = tt[better]
            best_i[kk[better]] = idx
            best_mem[kk[better]] = mm[better]
            room = (mm <= roomy) & (tt < room_t[kk])
            room_t[kk[room]] = tt[room]
            room_i[kk[room]] = idx
            room_mem[kk[room]] = mm[room]
    return _Search(tuple(layouts), best_t, best_i, best_mem, room_t, room_i, room_mem)


def _config(
    model: ModelSpec,
    global_batch: int,
    k: int,
    found: _Search,
    gpu: GPUSpec,
    o: PerfOptions,
) -> ParallelConfig | None:
    """The pick at k GPUs: the fastest layout, unless it leaves less than the headroom and a
    layout that leaves it is slower by less than the model's own error."""
    i = int(found.best_i[k])
    if i < 0:
        return None
    t, mem, note = float(found.best_t[k]), float(found.best_mem[k]), ""
    usable = gpu.memory_bytes * o.memory_usable_fraction
    j = int(found.room_i[k])
    tight = mem > usable * (1.0 - o.headroom_fraction)
    if tight and j >= 0 and found.room_t[k] <= t * (1.0 + o.model_error):
        slower = float(found.room_t[k]) / t - 1.0
        note = (
            f"memory headroom: {found.room_mem[k] / GIB:.0f} of {usable / GIB:.0f} GiB used "
            f"instead of {mem / GIB:.0f} GiB, {100 * slower:.1f}% slower, within the model's "
            f"{100 * o.model_error:.0f}% error"
        )
        i, t, mem = j, float(found.room_t[k]), float(found.room_mem[k])
    base = found.layouts[i]
    lay = replace(base, dp=k // (base.tp * base.cp * base.pp))
    flops = model.flops_per_token * global_batch * model.seq_len / t
    return ParallelConfig(
        lay.tp,
        lay.pp,
        lay.dp * lay.cp,
        lay.micro_batch,
        t,
        flops,
        mem,
        lay.recompute == "full",
        layout=lay,
        usable_bytes=usable,
        note=note,
    )


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
    """The layout of ``model`` on exactly ``gpus`` GPUs, or None if none fits. Memoised.

    The fastest one, except that a layout leaving :attr:`PerfOptions.headroom_fraction` of
    memory free wins when it is slower by less than :attr:`PerfOptions.model_error`
    (:attr:`ParallelConfig.note` then says so). Ties go to the layout searched first
    (smaller tp, cp, pp, vp, ep, micro-batch), so the answer is deterministic.
    """
    _check_args(global_batch, gpus, gpus_per_node)
    if gpus == 0:
        return None
    found = _search(model, global_batch, gpu, gpus_per_node, options, gpus, exact=True)
    return _config(model, global_batch, gpus, found, gpu, options)


def fitting_layouts(
    model: ModelSpec,
    global_batch: int,
    gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    options: PerfOptions = DEFAULT_OPTIONS,
) -> list[ParallelConfig]:
    """Every layout the search tries on exactly ``gpus`` GPUs that fits in memory, fastest
    first: what ``unicron plan --layouts N`` lists beside its pick (:func:`best_config` is the
    first of these, or a slower one with headroom). Each satisfies :func:`launch_problems`."""
    _check_args(global_batch, gpus, gpus_per_node)
    usable = gpu.memory_bytes * options.memory_usable_fraction
    out = []
    for tp, cp, pp in _bases(model, gpus_per_node, options, gpus):
        base = tp * cp * pp
        if gpus % base:
            continue
        dp = np.array([float(gpus // base)])
        for lay in _layouts_of_base(model, global_batch, tp, cp, pp, options):
            if not _valid_dp(model, global_batch, lay, dp, options)[0]:
                continue
            t, mem = _evaluate(model, global_batch, lay, dp, gpu, gpus_per_node, options)
            if float(mem[0]) > usable:
                continue
            full = replace(lay, dp=gpus // base)
            out.append(
                ParallelConfig(
                    tp,
                    pp,
                    full.dp * cp,
                    lay.micro_batch,
                    float(t[0]),
                    model.flops_per_token * global_batch * model.seq_len / float(t[0]),
                    float(mem[0]),
                    lay.recompute == "full",
                    layout=full,
                    usable_bytes=usable,
                )
            )
    out.sort(key=lambda c: c.iter_time_s)
    return out


@functools.lru_cache(maxsize=256)
def _table_search(
    model: ModelSpec, global_batch: int, max_gpus: int, gpu: GPUSpec, gpn: int, o: PerfOptions
) -> _Search:
    return _search(model, global_batch, gpu, gpn, o, max_gpus, exact=False)


@functools.lru_cache(maxsize=1024)
def _configs(
    model: ModelSpec,
    global_batch: int,
    max_gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    unit: int,
    options: PerfOptions,
) -> tuple[ParallelConfig | None, ...]:
    """The pick on ``u * unit`` GPUs for ``u = 0 .. max_gpus // unit`` (None where nothing
    fits), from one search: what :func:`throughput_table` and :func:`layout_table` read."""
    found = _table_search(model, global_batch, max_gpus, gpu, gpus_per_node, options)
    configs = (
        _config(model, global_batch, u * unit, found, gpu, options)
        for u in range(1, max_gpus // unit + 1)
    )
    return (None, *configs)


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
    configs = _configs(model, global_batch, max_gpus, gpu, gpus_per_node, unit, options)
    out = np.array([0.0 if c is None else c.achieved_flops for c in configs], dtype=np.float64)
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

    0.0 where no configuration fits; entry ``u`` equals :func:`best_config` on ``u * unit``
    GPUs. One vectorised search prices every GPU count at once (each layout over all its
    data-parallel degrees). The array is memoised and read-only: the simulator and the
    command call this for every task on every event.
    """
    _check_args(global_batch, max_gpus, gpus_per_node)
    _require_positive_int("unit", unit)
    return _table(model, global_batch, max_gpus, gpu, gpus_per_node, unit, options)


def layout_table(
    model: ModelSpec,
    global_batch: int,
    max_gpus: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    unit: int = 1,
    options: PerfOptions = DEFAULT_OPTIONS,
) -> tuple[ParallelConfig | None, ...]:
    """The configuration behind each entry of :func:`throughput_table` (the same search):
    entry ``u`` is :func:`best_config` on ``u * unit`` GPUs, None where nothing fits.
    Memoised; the simulator asks which layout a task runs on each node count."""
    _check_args(global_batch, max_gpus, gpus_per_node)
    _require_positive_int("unit", unit)
    return _configs(model, global_batch, max_gpus, gpu, gpus_per_node, unit, options)


def evaluate(
    model: ModelSpec,
    global_batch: int,
    layout: Layout,
    gpu: GPUSpec,
    gpus_per_node: int,
    options: PerfOptions = DEFAULT_OPTIONS,
) -> ParallelConfig:
    """Price one given layout, fitting or not (the calibration compares it with published
    runs; :attr:`ParallelConfig.memory_bytes_per_gpu` against :attr:`ParallelConfig.usable_bytes`
    says whether the model thinks it fits)."""
    _check_args(global_batch, layout.gpus, gpus_per_node)
    dp = np.array([float(layout.dp)])
    t, mem = _evaluate(model, global_batch, layout, dp, gpu, gpus_per_node, options)
    time_s = float(t[0])
    return ParallelConfig(
        layout.tp,
        layout.pp,
        layout.dp * layout.cp,
        layout.micro_batch,
        time_s,
        model.flops_per_token * global_batch * model.seq_len / time_s,
        float(mem[0]),
        layout.recompute == "full",
        layout=layout,
        usable_bytes=gpu.memory_bytes * options.memory_usable_fraction,
    )


__all__ = [
    "DEFAULT_OPTIONS",
    "GIB",
    "MODEL_PRESETS",
    "RECOMPUTE_MODES",
    "SHARDINGS",
    "SPLITS",
    "Layout",
    "ModelSpec",
    "ParallelConfig",
    "PerfOptions",
    "best_config",
    "best_split",
    "evaluate",
    "fitting_layouts",
    "launch_problems",
    "layout_table",
    "megatron_flops_per_gpu",
    "stage_layers",
    "state_bytes",
    "throughput_table",
]
