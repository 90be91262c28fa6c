"""Model descriptions: parameter counts of the presets against the published ones, FLOPs,
and inconsistent fields rejected with the field named."""

from __future__ import annotations

import pytest

from unicron.planner import MODEL_PRESETS, ModelSpec

# Published parameter counts: GPT-3 (Brown et al. 2020, table 2.1), Llama 3 (the Hugging Face
# model cards of Meta-Llama-3-8B / -70B and Llama-3.1-405B: 8.03B, 70.6B, 405.9B),
# Mixtral 8x7B (Jiang et al. 2024: 46.7B total, 12.9B active per token).
PUBLISHED = {
    "gpt-1.3b": 1.3e9,
    "gpt-2.7b": 2.7e9,
    "gpt-6.7b": 6.7e9,
    "gpt-13b": 13.0e9,
    "gpt-175b": 175.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,
}


@pytest.mark.parametrize(("name", "params"), sorted(PUBLISHED.items()))
def test_preset_parameter_counts_match_the_published_ones(name: str, params: float) -> None:
    rel = 0.08 if name.startswith("gpt-") and name != "gpt-175b" else 0.005
    assert MODEL_PRESETS[name].params == pytest.approx(params, rel=rel)


def test_mixtral_counts_active_experts_only_in_flops() -> None:
    m = MODEL_PRESETS["mixtral-8x7b"]
    assert m.active_params == pytest.approx(12.9e9, rel=0.005)
    dense_equivalent = 6 * (m.matmul_weights_per_token) + 12 * m.layers * m.seq_len * m.hidden
    assert m.flops_per_token == dense_equivalent
    assert m.flops_per_token < 6 * m.params / 3  # far below what all 8 experts would cost


def test_llama3_70b_is_not_counted_as_a_gpt_shape() -> None:
    # the old planner saw 65.6B: multi-head attention and a 4h GELU feed-forward
    m = MODEL_PRESETS["llama3-70b"]
    gpt_like = ModelSpec(name="x", layers=80, hidden=8192, heads=64, seq_len=8192, vocab=128256)
    assert m.kv == 8 and m.ffn == 28672 and m.gated and not m.tied_embeddings
    assert gpt_like.params < 68e9 < m.params


def test_gpt3_flops_are_megatron_eq3_without_the_recompute_pass() -> None:
    m = MODEL_PRESETS["gpt-175b"]
    n, h, s, v = m.layers, m.hidden, m.seq_len, m.vocab
    eq3_per_token = 96 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert m.flops_per_token + m.recompute_flops_per_token == pytest.approx(eq3_per_token, rel=2e-3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": 0}, "layers"),
        ({"hidden": 100, "heads": 3}, "hidden"),
        ({"vocab": -1}, "vocab"),
        ({"name": ""}, "name"),
        ({"kv_heads": 3}, "kv_heads"),
        ({"experts": 8, "active_experts": 9}, "active_experts"),
        ({"ffn_hidden": 0}, "ffn_hidden"),
    ],
)
def test_model_spec_rejects_inconsistent_fields(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = dict(name="m", layers=2, hidden=64, heads=4, seq_len=128, vocab=1000)
    base.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        ModelSpec(**base)  # type: ignore[arg-type]
