"""The cluster's figures: coordinator ``kill -9``, the control plane under load, node loss.

Three scenarios, each its own module and results file (``bench/results/<scenario>.json``):

- ``cluster-kill`` (:mod:`bench.cluster.kill`): time from a killed coordinator's restart
  until the task commits again, steps lost, bitwise result;
- ``cluster-load`` (:mod:`bench.cluster.load`): request latency and CPU with 200 synthetic
  agents and 20 tasks, and the state directory after a soak;
- ``cluster-node`` (:mod:`bench.cluster.node`): node loss on a cluster of real agents against
  torchrun's elastic agents.

``python -m bench.cluster`` runs them (``make bench-cluster``); ``python -m bench --scenario
cluster-kill`` runs one inside the suite, which leaves them out unless named. Method:
docs/benchmarks.md ("The cluster"). :mod:`bench.cluster.harness` starts the processes.
"""
