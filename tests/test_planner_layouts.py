"""Every layout the planner prints is one Megatron-Core launches (issue #38, item 1).

A property test: over the presets and odd shapes (layer counts that divide nothing, GQA,
long sequences, experts), every GPU count up to a few nodes and a few large ones, the layout
the search picks satisfies :func:`unicron.planner.perf.launch_problems`, and so does every
fitting layout it lists. The checker is written from Megatron-Core's rules, apart from the
search's generators, and is itself checked on layouts Megatron refuses.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from unicron.planner import GPU_PRESETS, MODEL_PRESETS, Layout, ModelSpec
from unicron.planner.perf import (
    DEFAULT_OPTIONS,
    _config,
    _table_search,
    best_config,
    fitting_layouts,
    launch_problems,
)

H100 = GPU_PRESETS["H100-80GB"]
A100 = GPU_PRESETS["A100-80GB"]
LLAMA = MODEL_PRESETS["llama3-405b"]

ODD = [
    replace(MODEL_PRESETS["llama3-8b"], name="odd-61", layers=61),
    replace(MODEL_PRESETS["llama3-70b"], name="odd-70b-45", layers=45, seq_len=32768),
    replace(MODEL_PRESETS["gpt-13b"], name="odd-13b-heads40", seq_len=4096),
    replace(MODEL_PRESETS["gpt-1.3b"], name="odd-1.3b-27", layers=27, seq_len=1000),
    replace(MODEL_PRESETS["mixtral-8x7b"], name="odd-moe-30", layers=30),
]
MODELS = [MODEL_PRESETS[n] for n in ("gpt-1.3b", "gpt-13b", "llama3-8b", "mixtral-8x7b")] + ODD


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("batch", [96, 512])
def test_every_printed_layout_launches(model: ModelSpec, batch: int) -> None:
    """Each GPU count from 1 to 96 (one search prices them all), as `unicron plan` picks."""
    found = _table_search(model, batch, 96, H100, 8, DEFAULT_OPTIONS)
    picked = 0
    for k in range(1, 97):
        cfg = _config(model, batch, k, found, H100, DEFAULT_OPTIONS)
        if cfg is None:
            continue
        assert cfg.layout is not None and cfg.layout.gpus == k
        assert launch_problems(model, batch, cfg.layout) == [], (k, cfg.describe())
        picked += 1
    assert picked >= 20  # the property is not vacuous: most counts have a layout


@pytest.mark.parametrize(
    ("model", "batch", "gpus"),
    [
        (MODEL_PRESETS["llama3-70b"], 128, 64),
        (replace(MODEL_PRESETS["llama3-70b"], layers=80), 1024, 1536),
        (MODEL_PRESETS["gpt-175b"], 1536, 1024),
        (replace(LLAMA, seq_len=131072), 128, 16384),
    ],
    ids=["70b-64", "70b-1536", "175b-1024", "405b-128k"],
)
def test_large_clusters_and_every_fitting_layout_launch(
    model: ModelSpec, batch: int, gpus: int
) -> None:
    cfg = best_config(model, batch, gpus, H100, 8)
    assert cfg is not None and cfg.layout is not None
    assert launch_problems(model, batch, cfg.layout) == []
    listed = fitting_layouts(model, batch, gpus, H100, 8)
    assert listed and listed[0].iter_time_s <= cfg.iter_time_s
    for c in listed:
        assert c.layout is not None and launch_problems(model, batch, c.layout) == []


def test_the_checker_refuses_what_megatron_refuses() -> None:
    ok = Layout(tp=8, pp=16, vp=8, dp=128, split="embedding-loss", sharding="optim-grads")
    assert launch_problems(LLAMA, 2048, ok) == []
    bad = {
        "vp does not divide the layers per stage": replace(ok, split="even"),
        "80 layers on pp4 with vp8": replace(ok, pp=4, dp=512),
        "tp 16 over 8 KV heads": replace(ok, tp=16, dp=64),
        "batch not a multiple of mb x dp": replace(ok, micro_batch=32),
        "interleaving with too few micro-batches": replace(ok, micro_batch=2, vp=4, dp=128),
        "cp whose chunks do not split the sequence": replace(ok, cp=3),
        "fsdp with pipelining": replace(ok, sharding="fsdp"),
    }
    assert launch_problems(replace(LLAMA, layers=80), 2048, bad.pop("80 layers on pp4 with vp8"))
    for why, lay in bad.items():
        assert launch_problems(LLAMA, 2048, lay), why
    gpt = MODEL_PRESETS["gpt-175b"]  # 96 layers: 8 per stage on pp12, in 4 virtual stages, not 3
    assert launch_problems(gpt, 1536, Layout(tp=8, pp=12, vp=4, dp=8)) == []
    assert launch_problems(gpt, 1536, Layout(tp=8, pp=12, vp=3, dp=8))
    moe = MODEL_PRESETS["mixtral-8x7b"]
    assert launch_problems(moe, 256, Layout(tp=1, dp=64, ep=3))  # 8 experts


def test_meta_layout_is_among_the_fitting_ones_at_16384_h100s() -> None:
    """Llama 3 405B, 16M tokens per batch at 8K: TP8 PP16 DP128, no recomputation, the
    interleaved schedule with the embedding and loss counted as layers (Grattafiori et al.
    2024, section 3.3.2) and gradients sharded with the optimizer state."""
    listed = fitting_layouts(LLAMA, 2048, 16384, H100, 8)
    meta = [
        c
        for c in listed
        if c.layout is not None
        and (c.layout.tp, c.layout.cp, c.layout.pp, c.layout.dp) == (8, 1, 16, 128)
        and c.layout.recompute == "none"
        and c.layout.vp > 1
    ]
    assert meta, "Meta's layout does not fit under the memory model"
    best = meta[0]
    assert best.layout is not None and best.layout.split == "embedding-loss"
    assert best.layout.sharding == "optim-grads"
    assert best.memory_bytes_per_gpu <= best.usable_bytes
