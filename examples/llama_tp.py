"""A small Llama-style model that splits over a tensor-parallel replica, and its data.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, written in
plain PyTorch with :mod:`unicron.parallel`'s layers where Megatron-LM splits a Llama: the
query, key and value projections and the MLP's gate and up projections keep this rank's
heads and hidden units (column parallel), the attention output and the MLP's down
projection sum the ranks' parts (row parallel). Embeddings, norms and the output head are
replicated. With ``tp`` 1 it is an ordinary model. Trained on the byte corpus of ``gpt.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gpt import ByteDataset, make_corpus
from torch import nn

from unicron.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel


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


def check(cfg: LlamaConfig, tp: int) -> str | None:
    """Why ``cfg`` cannot split over ``tp`` ranks (``None``: it can)."""
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("hidden", cfg.hidden)):
        if n % tp:
            return f"{what} ({n}) is not divisible by tp ({tp})"
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


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.heads, self.kv_heads = cfg.heads // tp.size, cfg.kv_heads // tp.size
        self.q = ColumnParallelLinear(cfg.dim, cfg.heads * self.head_dim, tp)
        self.k = ColumnParallelLinear(cfg.dim, cfg.kv_heads * self.head_dim, tp)
        self.v = ColumnParallelLinear(cfg.dim, cfg.kv_heads * self.head_dim, tp)
        self.o = RowParallelLinear(cfg.heads * self.head_dim, cfg.dim, tp)

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
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate = ColumnParallelLinear(cfg.dim, cfg.hidden, tp)
        self.up = ColumnParallelLinear(cfg.dim, cfg.hidden, tp)
        self.down = RowParallelLinear(cfg.hidden, cfg.dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.dim), Attention(cfg, tp)
        self.norm2, self.mlp = RMSNorm(cfg.dim), MLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """A decoder-only Llama-style transformer over bytes, this rank's shard of it."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        why = check(cfg, tp.size)
        if why is not None:
            raise ValueError(why)
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, tp) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope(cfg)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross-entropy of one micro-batch."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(
    tp: TensorParallel, seed: int = 0, cfg: LlamaConfig | None = None
) -> tuple[Llama, torch.optim.Optimizer, ByteDataset]:
    """This rank's shard of the model (seeded: every rank draws the same whole weights), its
    AdamW optimizer and the dataset."""
    cfg = cfg or LlamaConfig()
    torch.manual_seed(seed)
    model = Llama(cfg, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, ByteDataset(make_corpus(), cfg.seq_len)
