"""Run the Oobleck artifact's own simulators and print their figures as the YAML of
``examples/sim/oobleck-artifact.yaml``'s ``models`` section.

Usage (the artifact is not part of this repository; check it out first)::

    git clone -b sosp23-artifact https://github.com/SymbioticLab/Oobleck /tmp/oobleck
    python examples/sim/oobleck_artifact_run.py /tmp/oobleck/tools/simulator

Each cell is the call ``eval_tput_vs_freq.py``'s ``run_simulator_on_traces`` makes (seed
None, start_hour 0, steps_per_run 200000, time_hard_stop True; Varuna with
no_small_model_fallback False), on the six traces 5m .. 6h (that script runs five; 5m is its
``traces/5m.csv``). ``throughput`` is the result's ``average_performance``; ``effective`` is
the fraction each simulator prints after ``Effective Time:``. Standard library only, as the
simulators are; about 15 s per model.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from typing import Any

MODELS = {
    # the artifact's model -> (ours, global batch: the simulators' samples_per_step, full_tput:
    # the first entry of the model's ``tputs`` table in oobleck_simulator.py, lines 408, 473,
    # 538, 603, 668: Oobleck's measured samples/s on 30 nodes)
    "GPT-3-6_7b": ("gpt-6.7b", 1024, 5.507784136),
    "GPT-3-2_7b": ("gpt-2.7b", 512, 9.214308445),
    "GPT-3-medium": ("gpt-350m", 819, 38.46834258),
    "GPT-2-ours": ("gpt2-medium", 1024, 110.006361),
    "BERT-large": ("bert-large", 8192, 368.2457947),
}
TRACES = ("5m", "10m", "30m", "1h", "3h", "6h")


def cell(sim_cls: Any, model: str, trace: str, **extra: Any) -> tuple[float, float]:
    """(average samples/s, effective-time fraction) of one simulator on one trace."""
    with open(f"traces/{trace}.csv") as f:
        sim = sim_cls(
            seed=None,
            start_hour=0,
            generate_addition_probabilities=None,
            removal_probability=None,
            generate_graphs=False,
            spot_instance_trace=f,
            model=model,
            steps_per_run=200000,
            time_hard_stop=True,
            **extra,
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = sim.simulate()
    m = re.search(r"Effective Time:[^,]+, (\S+)", out.getvalue())
    assert m is not None, "the simulator printed no Effective Time"
    return float(result.average_performance), float(m.group(1))


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: oobleck_artifact_run.py ARTIFACT/tools/simulator", file=sys.stderr)
        return 2
    os.chdir(sys.argv[1])
    sys.path.insert(0, ".")
    from bamboo_simulator import Simulator as Bamboo
    from oobleck_simulator import Simulator as Oobleck
    from varuna_simulator import Simulator as Varuna

    print("models:")
    for model, (ours, batch, full) in MODELS.items():
        print(f"  {model}:\n    ours: {ours}\n    global_batch: {batch}\n    full_tput: {full}")
        print("    traces:")
        for trace in TRACES:
            print(f"      {trace}:")
            for name, cls, extra in (
                ("oobleck", Oobleck, {}),
                ("varuna", Varuna, {"no_small_model_fallback": False}),
                ("bamboo", Bamboo, {}),
            ):
                tput, eff = cell(cls, model, trace, **extra)
                print(f"        {name}: {{throughput: {tput:.6g}, effective: {eff:.6g}}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
