"""Performance model: presets, memory and time model, configuration search, calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from unicron.planner import (
    GPU_PRESETS,
    MEGATRON_2021,
    MODEL_PRESETS,
    GPUSpec,
    ModelSpec,
    PerfOptions,
    best_config,
    predict_measurement,
    state_bytes,
    throughput_table,
)

A100 = GPU_PRESETS["A100-80GB"]


def test_presets_exist_with_the_usual_sizes() -> None:
    for key in ("A100-80GB", "A800-80GB", "H100-80GB"):
        assert GPU_PRESETS[key].name == key
    sizes = {"gpt-1.3b": 1.3e9, "gpt-2.7b": 2.7e9, "gpt-6.7b": 6.7e9, "gpt-13b": 13e9}
    sizes["gpt-175b"] = 175e9
    for key, n in sizes.items():
        assert MODEL_PRESETS[key].params == pytest.approx(n, rel=0.08), key


def test_flops_per_token_is_6n_plus_attention() -> None:
    m = MODEL_PRESETS["gpt-175b"]
    assert m.flops_per_token == 6 * m.params + 12 * m.layers * m.seq_len * m.hidden
    assert state_bytes(m) == 14 * m.params


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": 0}, "layers"),
        ({"hidden": 100, "heads": 3}, "hidden"),
        ({"vocab": -1}, "vocab"),
        ({"name": ""}, "name"),
    ],
)
def test_model_spec_rejects_bad_values(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = dict(name="m", layers=2, hidden=64, heads=4, seq_len=128, vocab=1000)
    base.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        ModelSpec(**base)  # type: ignore[arg-type]


def test_gpu_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"^peak_flops:"):
        GPUSpec(name="x", peak_flops=0, memory_bytes=1, intra_node_bw=1, inter_node_bw=1)
    with pytest.raises(ValueError, match=r"^memory_usable_fraction:"):
        PerfOptions(memory_usable_fraction=1.5)


def test_175b_does_not_fit_on_one_node_but_does_on_many() -> None:
    m = MODEL_PRESETS["gpt-175b"]
    assert best_config(m, 1536, 8, A100, 8) is None
    cfg = best_config(m, 1536, 1024, A100, 8)
    assert cfg is not None
    assert cfg.tp * cfg.pp * cfg.dp == 1024
    assert 8 % cfg.tp == 0 and m.heads % cfg.tp == 0 and m.layers % cfg.pp == 0
    assert cfg.memory_bytes_per_gpu <= 0.9 * A100.memory_bytes
    per_gpu = cfg.achieved_flops / 1024
    assert 0.3 * A100.peak_flops < per_gpu < 0.64 * A100.peak_flops


def test_smaller_memory_forces_more_model_parallelism() -> None:
    m = MODEL_PRESETS["gpt-13b"]
    small = GPUSpec(
        name="small",
        peak_flops=A100.peak_flops,
        memory_bytes=24 * 2**30,
        intra_node_bw=A100.intra_node_bw,
        inter_node_bw=A100.inter_node_bw,
    )
    big_cfg = best_config(m, 512, 64, A100, 8)
    small_cfg = best_config(m, 512, 64, small, 8)
    assert big_cfg is not None and small_cfg is not None
    assert small_cfg.tp * small_cfg.pp >= big_cfg.tp * big_cfg.pp
    assert small_cfg.memory_bytes_per_gpu <= 0.9 * small.memory_bytes
    assert small_cfg.achieved_flops <= big_cfg.achieved_flops


def test_more_gpus_train_faster_until_the_batch_runs_out() -> None:
    m = MODEL_PRESETS["gpt-6.7b"]
    flops = [best_config(m, 512, k, A100, 8) for k in (8, 16, 32, 64, 128)]
    values = [c.achieved_flops for c in flops if c is not None]
    assert len(values) == 5 and values == sorted(values)
    # a global batch of 4 sequences cannot feed 64 data-parallel replicas of a 1.3B model
    tiny = MODEL_PRESETS["gpt-1.3b"]
    cfg = best_config(tiny, 4, 64, A100, 8)
    assert cfg is None or cfg.dp <= 4


def test_throughput_table_matches_best_config_and_is_memoised() -> None:
    m = MODEL_PRESETS["gpt-13b"]
    table = throughput_table(m, 1024, 128, A100, 8, unit=8)
    assert table.shape == (17,) and table[0] == 0.0
    assert not table.flags.writeable
    assert throughput_table(m, 1024, 128, A100, 8, unit=8) is table
    for u in (1, 2, 5, 16):
        cfg = best_config(m, 1024, 8 * u, A100, 8)
        assert table[u] == (cfg.achieved_flops if cfg else 0.0)
    big = throughput_table(MODEL_PRESETS["gpt-175b"], 1536, 128, A100, 8, unit=8)
    assert big[1] == 0.0 and big[-1] > 0


def test_calibration_against_megatron_2021() -> None:
    errors = []
    for meas in MEGATRON_2021:
        predicted = predict_measurement(meas, A100)
        assert predicted is not None, meas.model.name
        errors.append(predicted / meas.tflops_per_gpu - 1)
    assert max(abs(e) for e in errors) < 0.10
    assert math.sqrt(float(np.mean(np.square(errors)))) < 0.06
