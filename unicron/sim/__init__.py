"""Trace-driven cluster simulator: compares recovery policies at scale (docs/simulator.md).

Modules: :mod:`~unicron.sim.trace` (CSV and generated failure traces),
:mod:`~unicron.sim.engine` (discrete-event core, the node pool, workloads),
:mod:`~unicron.sim.task` (a task's spec, performance data and timeline),
:mod:`~unicron.sim.policies` (Unicron and the baselines, their sourced constants),
:mod:`~unicron.sim.measured` (Unicron's constants from ``bench/results``),
:mod:`~unicron.sim.crosscheck` (our baselines beside the Oobleck artifact's figures),
:mod:`~unicron.sim.metrics`, :mod:`~unicron.sim.report`, :mod:`~unicron.sim.command`
(``unicron simulate``).
"""
