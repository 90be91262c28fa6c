"""A small Llama-style model that splits over a model-parallel replica, and its data.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, written in
plain PyTorch with :mod:`unicron.parallel`'s parts where Megatron-LM splits a Llama. Tensor
parallel: the query, key and value projections and the MLP's gate and up projections keep
this rank's heads and hidden units (column parallel), the attention output and the MLP's
down projection sum the ranks' parts (row parallel); embeddings, norms and the output head
are replicated. Pipeline parallel: each stage holds an equal share of the layers, the first
the embedding, the last the final norm and the head; a stage receives its input from the
previous one and sends its output on. With ``tp`` and ``pp`` 1 it is an ordinary model.
Trained on the byte corpus of ``gpt.py``.

``dtensor=True`` splits the same model with PyTorch's own tensor parallelism instead: the
blocks are built of whole ``nn.Linear`` layers and split by ``parallelize_module``'s
``ColwiseParallel`` / ``RowwiseParallel`` plan (:func:`plan`, through
:func:`unicron.dtensor.parallelize`). Both draw the same numbers and make the same sums, so
both train to the same bits. ``torch_stage=True`` builds a stage for PyTorch's own
``PipelineStage`` (:func:`stage`): it takes the previous stage's output and returns its own,
where the default stage receives and sends through :mod:`unicron.parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gpt import ByteDataset, make_corpus
from torch import nn

from unicron.parallel import (
    ColumnParallelLinear,
    PipelineParallel,
    RowParallelLinear,
    TensorParallel,
)


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 2
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 256
    rope_theta: float = 10000.0


def check(cfg: LlamaConfig, tp: int, pp: int = 1) -> str | None:
    """Why ``cfg`` cannot split over ``tp`` ranks and ``pp`` stages (``None``: it can)."""
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("hidden", cfg.hidden)):
        if n % tp:
            return f"{what} ({n}) is not divisible by tp ({tp})"
    if cfg.dim % (2 * cfg.heads) or cfg.heads % cfg.kv_heads:
        return (
            f"dim ({cfg.dim}) must be a multiple of 2 x heads ({cfg.heads}) and heads of "
            f"kv_heads ({cfg.kv_heads})"
        )
    if cfg.layers % pp:
        return f"layers ({cfg.layers}) is not divisible by pp ({pp}): stages of equal layers"
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary embedding, per position and half head dimension."""
    half = cfg.dim // cfg.heads // 2
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotary embedding to ``x`` (batch, heads, time, head_dim)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def linear(kind: str, n_in: int, n_out: int, tp: TensorParallel, dtensor: bool) -> nn.Module:
    """A layer that splits ``kind`` ("column" or "row") over the replica's ranks: one of
    :mod:`unicron.parallel`'s, or (``dtensor``) a whole ``nn.Linear`` that :func:`plan` splits
    once its block is built (the same numbers drawn: ``nn.Linear`` without a bias)."""
    if dtensor:
        return nn.Linear(n_in, n_out, bias=False)
    layer = ColumnParallelLinear if kind == "column" else RowParallelLinear
    return layer(n_in, n_out, tp)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, dtensor: bool = False) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.heads, self.kv_heads = cfg.heads // tp.size, cfg.kv_heads // tp.size
        self.q = linear("column", cfg.dim, cfg.heads * self.head_dim, tp, dtensor)
        self.k = linear("column", cfg.dim, cfg.kv_heads * self.head_dim, tp, dtensor)
        self.v = linear("column", cfg.dim, cfg.kv_heads * self.head_dim, tp, dtensor)
        self.o = linear("row", cfg.heads * self.head_dim, cfg.dim, tp, dtensor)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos[:t], sin[:t]), rotate(k, cos[:t], sin[:t])
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, dtensor: bool = False) -> None:
        super().__init__()
        self.gate = linear("column", cfg.dim, cfg.hidden, tp, dtensor)
        self.up = linear("column", cfg.dim, cfg.hidden, tp, dtensor)
        self.down = linear("row", cfg.hidden, cfg.dim, tp, dtensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, dtensor: bool = False) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.dim), Attention(cfg, tp, dtensor)
        self.norm2, self.mlp = RMSNorm(cfg.dim), MLP(cfg, tp, dtensor)
        if dtensor and tp.size > 1:
            import unicron.dtensor  # PyTorch's tensor parallel API: imported when used

            unicron.dtensor.parallelize(self, plan())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def plan() -> dict[str, Any]:
    """A block's tensor-parallel plan in PyTorch's terms, Megatron-LM's split: the query,
    key, value, gate and up projections column-wise (this rank's heads and hidden units),
    the attention output and the down projection row-wise (their partial outputs summed)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    column = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
    return {**{n: ColwiseParallel() for n in column},
            "attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()}  # fmt: skip


class Llama(nn.Module):
    """A decoder-only Llama-style transformer over bytes, this rank's shard of it: its
    stage's layers (``pp``), of each its slice (``tp``)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TensorParallel,
        pp: PipelineParallel | None = None,
        dtensor: bool = False,
        torch_stage: bool = False,
    ) -> None:
        super().__init__()
        stages = 1 if pp is None else pp.stages
        why = check(cfg, tp.size, stages)
        if why is not None:
            raise ValueError(why)
        self.cfg, self.pp = cfg, pp
        self.torch_stage = torch_stage  # a stage of torch's PipelineStage: plain in and out
        # every rank draws the whole model (the same RNG stream), then keeps its stage's part
        tok = nn.Embedding(cfg.vocab, cfg.dim)
        blocks = [Block(cfg, tp, dtensor) for _ in range(cfg.layers)]
        norm, head = RMSNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab, bias=False)
        first = pp is None or pp.first
        last = pp is None or pp.last
        per = cfg.layers // stages
        stage = 0 if pp is None else pp.stage
        self.tok = tok if first else None
        # named by their place in the whole model (blocks.3 on any stage that holds it): a
        # layout change moves the state by name (docs/runtime.md, Layout changes)
        mine = range(stage * per, (stage + 1) * per)
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in mine})
        self.norm = norm if last else None
        self.head = head if last else None
        cos, sin = rope(cfg)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The logits (the last stage), or the micro-batch's loss as the other stages know
        it (a scalar that the backward pass starts from). A stage of torch's
        ``PipelineStage`` (``torch_stage``) takes the previous stage's output as ``idx`` and
        returns its own: the ``PipelineStage`` moves them."""
        if self.tok is not None:
            x = self.tok(idx)
        elif self.torch_stage:
            x = idx
        else:  # a later stage: the previous stage's output
            assert self.pp is not None
            x = self.pp.receive((*idx.shape, self.cfg.dim))
        for block in self.blocks.values():
            x = block(x, self.cos, self.sin)
        if self.head is None or self.norm is None:
            if self.torch_stage:
                return x
            assert self.pp is not None
            return self.pp.send(x)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross-entropy of one micro-batch (a stage before the last: the loss
    that comes back from it)."""
    x, y = batch
    logits = model(x)
    if logits.dim() == 0:
        return logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(
    tp: TensorParallel,
    seed: int = 0,
    cfg: LlamaConfig | None = None,
    pp: PipelineParallel | None = None,
    dtensor: bool = False,
    torch_stage: bool = False,
    fsdp: bool = False,
) -> tuple[Llama, torch.optim.Optimizer, ByteDataset]:
    """This rank's shard of the model (seeded: every rank draws the same whole weights), its
    AdamW optimizer and the dataset; ``dtensor``: split by PyTorch's tensor parallel API;
    ``torch_stage``: a stage for torch's ``PipelineStage`` (:func:`stage`); ``fsdp``: each
    block, then the whole model, sharded by PyTorch's ``fully_shard`` over the replica's FSDP
    ranks (``unicron run --fsdp F``), the optimizer made after."""
    cfg = cfg or LlamaConfig()
    torch.manual_seed(seed)
    model = Llama(cfg, tp, pp, dtensor, torch_stage)
    if fsdp:
        import unicron.fsdp  # torch's FSDP2: imported when used

        for block in model.blocks.values():
            unicron.fsdp.fully_shard(block)
        unicron.fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, ByteDataset(make_corpus(), cfg.seq_len)


def logits_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy from the last stage's logits (torch's schedules' form)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def stage(model: Llama, micro_batch_size: int) -> Any:
    """``model`` (built with ``torch_stage=True``) as torch's ``PipelineStage`` of its slot,
    driven by Unicron (:class:`unicron.pipelining.Stage`): the shapes a stage takes and gives."""
    import unicron.pipelining  # torch's pipelining: imported when used

    cfg, pp = model.cfg, model.pp
    tokens = torch.zeros(micro_batch_size, cfg.seq_len, dtype=torch.long)
    hidden = torch.zeros(micro_batch_size, cfg.seq_len, cfg.dim)
    logits = torch.zeros(micro_batch_size, cfg.seq_len, cfg.vocab)
    first, last = pp is None or pp.first, pp is None or pp.last
    return unicron.pipelining.Stage(
        model, loss_fn=logits_loss, example_input=tokens if first else hidden,
        example_output=logits if last else hidden,
    )  # fmt: skip
