"""A parallel layout (:class:`Layout`: tensor, context, pipeline, virtual, data and expert
degrees, sharding, recomputation, the stage split), its priced form
(:class:`ParallelConfig`), and the rules a launcher holds it to (:func:`stage_layers`,
:func:`launch_problems`: what Megatron-Core accepts). The search and the pricing are in
:mod:`unicron.planner.perf`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from unicron.planner.model import ModelSpec, _require_positive_int

RECOMPUTE_MODES = ("none", "selective", "full")
SHARDINGS = ("ddp", "dist-opt", "optim-grads", "fsdp")
SPLITS = ("even", "first-last", "embedding-loss")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout of one task: who splits what. ``tp * cp * pp * dp`` GPUs."""

    tp: int = 1
    """Tensor-parallel degree (inside one node; sequence parallelism on)."""
    pp: int = 1
    """Pipeline stages; the layers need not divide (the first and last stages may hold fewer)."""
    dp: int = 1
    """Data-parallel degree."""
    cp: int = 1
    """Context-parallel degree: the sequence split over ``cp`` GPUs (ring attention)."""
    vp: int = 1
    """Virtual stages per pipeline stage (interleaved 1F1B); 1: plain 1F1B."""
    ep: int = 1
    """Expert-parallel degree (mixture of experts), taken from the ``dp * cp`` group."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    sharding: str = "dist-opt"
    """``ddp`` (replicated state), ``dist-opt`` (optimizer state sharded, ZeRO-1),
    ``optim-grads`` (optimizer state and gradients sharded, ZeRO-2) or ``fsdp`` (all)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (attention core and activation
    functions) or ``full`` (every layer's forward pass)."""
    split: str = "even"
    """How the layers go onto the pipeline stages, as Megatron-Core can be told: ``even``
    (``layers / pp`` each), ``first-last`` (``--decoder-first/last-pipeline-num-layers``:
    :attr:`first_layers` and :attr:`last_layers`, the middle stages equal) or
    ``embedding-loss`` (``--account-for-embedding/loss-in-pipeline-split``: the embedding and
    the loss count as one layer each, so the first and last stages hold one layer fewer)."""
    first_layers: int = 0
    """Layers of the first stage with ``split="first-last"``; 0 otherwise."""
    last_layers: int = 0
    """Layers of the last stage with ``split="first-last"``; 0 otherwise."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "vp", "ep", "micro_batch"):
            _require_positive_int(name, getattr(self, name))
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding: must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {self.split!r}")
        if self.split == "first-last":
            _require_positive_int("first_layers", self.first_layers)
            _require_positive_int("last_layers", self.last_layers)
        elif self.first_layers or self.last_layers:
            raise ValueError("first_layers, last_layers: only with split='first-last'")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class ParallelConfig:
    """One parallel configuration of a task and its estimated performance."""

    tp: int
    """Tensor-parallel degree (inside one node)."""
    pp: int
    """Pipeline-parallel degree."""
    dp: int
    """GPUs / (tp * pp): the data-parallel degree times the context-parallel degree, so that
    ``tp * pp * dp`` is the GPU count (:attr:`layout` has each degree)."""
    micro_batch: int
    """Sequences per micro-batch."""
    iter_time_s: float
    """Estimated seconds per training iteration (one global batch)."""
    achieved_flops: float
    """Model FLOP/s over all GPUs of the task (:attr:`ModelSpec.flops_per_token`)."""
    memory_bytes_per_gpu: float
    """Estimated peak memory of the fullest GPU, bytes."""
    recompute: bool = False
    """Whether full activation recomputation is on."""
    layout: Layout | None = None
    """The whole layout (context, virtual, expert parallelism, sharding, recomputation)."""
    usable_bytes: float = 0.0
    """Memory the model may fill on one GPU, bytes (for headroom)."""
    note: str = ""
    """Why this layout and not the fastest one (the headroom rule), or empty."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        """Compact label, e.g. ``tp8 pp16 vp8 split-embedding-loss dp128 mb1 optim-grads``;
        shown by ``unicron plan``. Every token is one Megatron-Core setting (docs/planner.md,
        "Layouts a launcher accepts")."""
        lay = self.layout or Layout(
            tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch
        )
        parts = [f"tp{lay.tp}"]
        if lay.cp > 1:
            parts.append(f"cp{lay.cp}")
        parts.append(f"pp{lay.pp}")
        if lay.vp > 1:
            parts.append(f"vp{lay.vp}")
        if lay.split == "first-last":
            parts.append(f"first{lay.first_layers} last{lay.last_layers}")
        elif lay.split == "embedding-loss":
            parts.append("split-embedding-loss")
        parts.append(f"dp{lay.dp}")
        if lay.ep > 1:
            parts.append(f"ep{lay.ep}")
        parts.append(f"mb{lay.micro_batch}")
        parts.append(lay.sharding)
        if lay.recompute != "none":
            parts.append(f"recompute-{lay.recompute}")
        return " ".join(parts)


def stage_layers(layers: int, lay: Layout) -> tuple[int, int, int] | None:
    """Transformer layers of the first stage, of each middle stage and of the last stage of
    ``lay`` (middle 0 when ``pp <= 2``), or None where Megatron-Core refuses the split.

    Megatron-Core's rules (TransformerConfig checks; the ``--decoder-first/last-pipeline-
    num-layers`` and ``--account-for-embedding/loss-in-pipeline-split`` options): ``even``
    needs ``layers % pp == 0``; ``first-last`` needs the middle stages equal; with ``vp``
    virtual stages every stage's layer count is a multiple of ``vp``, except with
    ``embedding-loss``, where ``layers + 2`` must be a multiple of ``pp * vp`` (the first
    virtual stage holds the embedding in place of a layer, the last the loss). Called by the
    search (:func:`best_split`), the pricing (:func:`evaluate`) and :func:`launch_problems`.
    """
    pp, vp = lay.pp, lay.vp
    if pp == 1:
        return (layers, 0, layers) if vp == 1 and lay.split == "even" else None
    if pp > layers:
        return None
    if lay.split == "even":
        if layers % pp or (layers // pp) % vp:
            return None
        n = layers // pp
        return n, (n if pp > 2 else 0), n
    if lay.split == "embedding-loss":
        if (layers + 2) % (pp * vp) or (layers + 2) // pp < 2:
            return None
        n = (layers + 2) // pp
        return n - 1, (n if pp > 2 else 0), n - 1
    first, last = lay.first_layers, lay.last_layers
    rest = layers - first - last
    if pp == 2:
        mid = 0
        if rest != 0:
            return None
    else:
        if rest < pp - 2 or rest % (pp - 2):
            return None
        mid = rest // (pp - 2)
    if first % vp or last % vp or mid % vp:
        return None
    return first, mid, last


def launch_problems(model: ModelSpec, global_batch: int, layout: Layout) -> list[str]:
    """Why Megatron-Core (or PyTorch FSDP, for ``fsdp``) would refuse to start ``layout``:
    one sentence per broken rule, none when it launches. The rules, from Megatron-Core's
    argument and TransformerConfig checks: query and key/value heads divisible by ``tp``;
    the sequence divisible by ``tp`` (sequence parallelism) and, with context parallelism,
    by ``2 cp`` with ``s / cp`` divisible by ``tp``; the layer split legal
    (:func:`stage_layers`: ``vp`` divides each stage's layers); interleaving only with
    pipelining and a multiple of ``pp`` micro-batches; experts divisible by ``ep`` and ``ep``
    dividing ``dp * cp``; the global batch a multiple of ``micro_batch * dp``; FSDP without
    pipelining. tests/test_planner_layouts.py holds every layout the search prints to it."""
    lay, out = layout, []
    if model.heads % lay.tp or model.kv % lay.tp:
        out.append(f"tp={lay.tp} does not divide {model.heads} heads and {model.kv} KV heads")
    s = model.seq_len
    if s % lay.tp:
        out.append(f"sequence {s} not divisible by tp={lay.tp} (sequence parallelism)")
    if lay.cp > 1 and (s % (2 * lay.cp) or (s // lay.cp) % lay.tp):
        out.append(f"sequence {s} not divisible by 2 cp ({2 * lay.cp}) with s/cp by tp")
    split = stage_layers(model.layers, lay)
    if split is not None:  # checked again here, apart from stage_layers' own rules
        first, mid, last = split
        total = first + last + max(lay.pp - 2, 0) * mid if lay.pp > 1 else first
        if lay.split == "embedding-loss":
            whole = (model.layers + 2) % (lay.pp * lay.vp) == 0
        else:
            whole = all(n % lay.vp == 0 for n in (first, mid, last))
        if total != model.layers or not whole or (lay.vp > 1 and lay.pp == 1):
            split = None
    if split is None:
        out.append(
            f"{model.layers} layers cannot be split {lay.split!r} over pp={lay.pp} vp={lay.vp}"
        )
    if model.experts % lay.ep or (lay.dp * lay.cp) % lay.ep:
        out.append(f"ep={lay.ep} must divide {model.experts} experts and dp*cp={lay.dp * lay.cp}")
    if global_batch % (lay.micro_batch * lay.dp):
        out.append(
            f"global batch {global_batch} not a multiple of micro-batch {lay.micro_batch} "
            f"x dp {lay.dp}"
        )
    elif lay.vp > 1 and (global_batch // (lay.micro_batch * lay.dp)) % lay.pp:
        out.append(f"interleaving needs a multiple of pp={lay.pp} micro-batches")
    if lay.sharding == "fsdp" and lay.pp > 1:
        out.append("fsdp (PyTorch FULL_SHARD) is searched without pipelining")
    return out


def megatron_flops_per_gpu(model: ModelSpec, global_batch: int, gpus: int, iter_s: float) -> float:
    """FLOP/s per GPU as Narayanan et al. 2021 report it (eq. 3, counts the recompute pass)."""
    n_layers, h, s, v = model.layers, model.hidden, model.seq_len, model.vocab
    f = 96.0 * global_batch * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))
    return f / iter_s / gpus
