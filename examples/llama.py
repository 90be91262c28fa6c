"""A tiny Llama-architecture causal language model from Hugging Face ``transformers``, and its
data: built from ``LlamaConfig`` with random (seeded) weights, trained on the byte corpus that
``gpt.py`` generates. Nothing is downloaded.
"""

from __future__ import annotations

import torch
from gpt import make_corpus
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 64


def config() -> LlamaConfig:
    """2 layers, hidden size 64, grouped-query attention (4 heads, 2 key/value heads), bytes
    as tokens: ~107K parameters."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of ``seq_len`` bytes as Hugging Face samples: ``input_ids`` and ``labels`` (the
    model shifts the labels itself)."""

    def __init__(self, data: bytes, seq_len: int = SEQ_LEN) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": ids, "labels": ids}


def build(seed: int = 0) -> tuple[LlamaForCausalLM, torch.optim.Optimizer, TokenDataset]:
    """The model (seeded, float32), its AdamW optimizer, the dataset."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, TokenDataset(make_corpus())
