"""A small byte-level GPT, its corpus and its dataset: the model every example, test and
benchmark trains, so that Unicron and the baselines compare on the same work.

The corpus is generated (seeded, nothing downloaded): sentences from a small grammar, so a
byte-level model has real structure to learn and the loss falls visibly within 100 steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_SUBJECTS = [
    "the cluster",
    "a worker",
    "the agent",
    "the coordinator",
    "every replica",
    "the planner",
    "a node",
    "the task",
    "our model",
    "the optimizer",
]
_VERBS = [
    "heals",
    "detects",
    "restarts",
    "replans",
    "reduces",
    "commits",
    "skips",
    "rejoins",
    "measures",
    "schedules",
]
_OBJECTS = [
    "the failure",
    "a hung collective",
    "the lost micro-batches",
    "its state",
    "the next step",
    "a straggler",
    "the global batch",
    "the checkpoint",
    "every gradient",
    "the new epoch",
]
_ENDS = [
    " quickly.",
    " in place.",
    " without a restart.",
    " bit for bit.",
    " at once.",
    " before the timeout.",
    ".",
]


def make_corpus(n_bytes: int = 200_000, seed: int = 1234) -> bytes:
    """Deterministic English-like text of about ``n_bytes`` bytes."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        words = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS))
        s = " ".join(words) + rng.choice(_ENDS)
        s = s[0].upper() + s[1:] + ("\n" if rng.random() < 0.15 else " ")
        parts.append(s)
        size += len(s)
    return "".join(parts).encode()[:n_bytes]


class ByteDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Index-addressable windows of ``seq_len + 1`` bytes: item i is (x, y), y = x shifted."""

    def __init__(self, data: bytes, seq_len: int = 64) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 2
    dim: int = 128
    heads: int = 4
    dropout: float = 0.1


SIZES = {
    # 0.47M parameters (5.6 MB of state with AdamW's moments): the tests, the demo, the bench
    "example": GPTConfig(),
    "100m": GPTConfig(layers=14, dim=768, heads=12),  # 99.7M: the reduce at scale (bench)
}
"""model sizes by name (``--model-size``)"""


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim),
            nn.GELU(),
            nn.Linear(4 * cfg.dim, cfg.dim),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer over bytes."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        mask = torch.triu(torch.full((cfg.seq_len, cfg.seq_len), -math.inf), diagonal=1)
        self.mask: torch.Tensor
        self.register_buffer("mask", mask, persistent=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross-entropy of one micro-batch."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def adversarial_loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """:func:`loss_fn` times 2^k, k drawn in -40..40 from the micro-batch's seeded generator:
    one micro-batch's gradient up to 2^80 times another's, beyond what a float64 sum of
    float32 values holds exactly."""
    k = int(torch.randint(-40, 41, ()).item())
    return loss_fn(model, batch) * 2.0**k


def build(
    seed: int = 0, cfg: GPTConfig | None = None, *, size: str = "example"
) -> tuple[GPT, torch.optim.Optimizer, ByteDataset]:
    """The model (seeded), its AdamW optimizer and the dataset, as every script uses them.

    ``size`` names a configuration of :data:`SIZES` (``cfg``, if given, wins).
    """
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}: choose from {', '.join(SIZES)}")
    cfg = cfg or SIZES[size]
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, ByteDataset(make_corpus(), cfg.seq_len)
