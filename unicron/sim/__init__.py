"""Trace-driven cluster simulator: compares recovery policies at scale (issue 6).

Modules: :mod:`~unicron.sim.trace` (CSV and generated failure traces),
:mod:`~unicron.sim.engine` (discrete-event core and workloads),
:mod:`~unicron.sim.policies` (Unicron and the baselines), :mod:`~unicron.sim.metrics`,
:mod:`~unicron.sim.report`, :mod:`~unicron.sim.command` (``unicron simulate``).
"""
