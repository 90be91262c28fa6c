"""Model descriptions for the performance model: the shapes people train (DESIGN.md, planning).

:class:`ModelSpec` describes a decoder-only transformer: GPT-3 style (multi-head attention,
4h GELU feed-forward, biases, learned positions, tied embeddings) or Llama style
(grouped-query attention, SwiGLU of width ``ffn_hidden``, no biases, rotary positions,
untied embeddings, a 128K vocabulary), dense or mixture-of-experts. :mod:`unicron.planner.perf`
prices it; the ``unicron plan`` spec loader and the cluster simulator name it through
:data:`MODEL_PRESETS`. Parameter counts of the presets are checked against the published
ones in tests/test_planner_model.py; docs/planner.md lists the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer; the optional fields default to the GPT-3 shape."""

    name: str
    """Label shown in tables (e.g. ``"gpt-13b"``)."""
    layers: int
    """Transformer layers ``l``."""
    hidden: int
    """Hidden size ``h``; a multiple of ``heads``."""
    heads: int
    """Query heads ``a``."""
    seq_len: int
    """Sequence length ``s`` in tokens (up to 128K and beyond; context parallelism splits it)."""
    vocab: int
    """Vocabulary size ``V`` (padded)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: as many as ``heads``. Divides ``heads``."""
    ffn_hidden: int | None = None
    """Feed-forward width ``F``; None: ``4 h``."""
    gated: bool = False
    """Gated feed-forward (SwiGLU: three ``h x F`` matrices instead of two)."""
    bias: bool = True
    """Linear layers and norms carry biases (GPT-3, LayerNorm) or not (Llama, RMSNorm)."""
    tied_embeddings: bool = True
    """The output layer shares the input embedding's weights."""
    learned_positions: bool = True
    """A learned ``s x h`` position table (GPT-3); False for rotary or ALiBi positions."""
    experts: int = 1
    """Feed-forward experts per layer (mixture of experts); 1: dense."""
    active_experts: int = 1
    """Experts each token is routed to (top-k); at most ``experts``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        for field in ("layers", "hidden", "heads", "seq_len", "vocab", "experts"):
            _require_positive_int(field, getattr(self, field))
        _require_positive_int("active_experts", self.active_experts)
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden: must be a multiple of heads ({self.heads}), got {self.hidden}"
            )
        if self.kv_heads is not None:
            _require_positive_int("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"kv_heads: must divide heads ({self.heads}), got {self.kv_heads}")
        if self.ffn_hidden is not None:
            _require_positive_int("ffn_hidden", self.ffn_hidden)
        if self.active_experts > self.experts:
            raise ValueError(
                f"active_experts: must be <= experts ({self.experts}), got {self.active_experts}"
            )

    # -- shape helpers -------------------------------------------------------------------

    @property
    def kv(self) -> int:
        """Key/value heads actually used."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads * h / heads``."""
        return self.kv * (self.hidden // self.heads)

    @property
    def ffn(self) -> int:
        """Feed-forward width actually used."""
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    # -- parameter counts ----------------------------------------------------------------

    @property
    def attention_weights(self) -> int:
        """Matmul weights of one attention block: Q and output ``h x h``, K and V ``h x kv_dim``."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    @property
    def expert_weights(self) -> int:
        """Matmul weights of one feed-forward block (one expert)."""
        return (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def router_weights(self) -> int:
        return self.hidden * self.experts if self.is_moe else 0

    def _layer_small(self) -> int:
        """Biases and norm weights of one layer, except the experts' biases."""
        h = self.hidden
        if not self.bias:
            return 2 * h  # two RMSNorm scales
        return 2 * h + 2 * self.kv_dim + 4 * h  # Q,K,V,out biases; two LayerNorms

    def _expert_small(self) -> int:
        if not self.bias:
            return 0
        return (2 if self.gated else 1) * self.ffn + self.hidden

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one layer that every GPU of a tensor-parallel group shares out:
        attention, norms, router (everything but the experts)."""
        return self.attention_weights + self.router_weights + self._layer_small()

    @property
    def expert_layer_params(self) -> int:
        """Parameters of all the experts of one layer (the feed-forward block when dense)."""
        return self.experts * (self.expert_weights + self._expert_small())

    @property
    def embedding_params(self) -> int:
        """Input embedding, output layer (unless tied), position table, final norm."""
        h = self.hidden
        table = self.vocab * h * (1 if self.tied_embeddings else 2)
        return (
            table
            + (self.seq_len * h if self.learned_positions else 0)
            + (2 if self.bias else 1) * h
        )

    @property
    def params(self) -> int:
        """Total parameter count (all experts). For the GPT-3 shape this is Narayanan et al.
        2021 eq. 2, ``12lh^2 + 13lh + (V+s)h``, plus the final LayerNorm."""
        per_layer = self.dense_layer_params + self.expert_layer_params
        return self.layers * per_layer + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters a token goes through: the routed experts only (== params when dense)."""
        per_expert = self.expert_weights + self._expert_small()
        per_layer = self.dense_layer_params + self.active_experts * per_expert
        return self.layers * per_layer + self.embedding_params

    # -- FLOPs -----------------------------------------------------------------------------

    @property
    def matmul_weights_per_token(self) -> int:
        """Weights a token multiplies by, forward: every layer's attention, router, routed
        experts, and the output layer (embedding lookups are not matmuls)."""
        per_layer = self.attention_weights + self.router_weights
        per_layer += self.active_experts * self.expert_weights
        return self.layers * per_layer + self.vocab * self.hidden

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward, no recomputation: ``6 W + 12 l s h``.

        ``W`` = :attr:`matmul_weights_per_token` (2 FLOPs forward, 4 backward per weight);
        ``12 l s h`` the attention score and value matmuls over the whole ``s x s`` square
        (the convention of Megatron-LM, PaLM and llm-foundry: causal masking is not
        subtracted). For the GPT-3 shape ``W`` is ``N`` less biases, norms and embedding
        lookups, so this is Narayanan et al. 2021 eq. 3 without its recomputed forward pass.
        """
        return 6.0 * self.matmul_weights_per_token + 12.0 * self.layers * self.seq_len * self.hidden

    @property
    def recompute_flops_per_token(self) -> float:
        """Extra FLOPs per token when every layer's forward pass is recomputed."""
        per_layer = 2.0 * (self.attention_weights + self.router_weights)
        per_layer += 2.0 * self.active_experts * self.expert_weights
        return self.layers * (per_layer + 4.0 * self.seq_len * self.hidden)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200
    )


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, seq_len: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=8,
        ffn_hidden=ffn,
        gated=True,
        bias=False,
        tied_embeddings=False,
        learned_positions=False,
        seq_len=seq_len,
        vocab=128256,
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
    # Llama 3 (Grattafiori et al. 2024, arXiv 2407.21783, table 3): GQA with 8 KV heads,
    # SwiGLU, RMSNorm, RoPE, untied 128,256-token vocabulary; pre-training sequence 8,192.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 53248, 8192),
    # Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088): the Mistral 7B shape with 8 SwiGLU
    # experts per layer, top-2 routing, 32,000-token vocabulary; trained here at 4,096.
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        gated=True,
        bias=False,
        tied_embeddings=False,
        learned_positions=False,
        seq_len=4096,
        vocab=32000,
        experts=8,
        active_experts=2,
    ),
}

__all__ = ["MODEL_PRESETS", "ModelSpec"]
