"""The agent's reports: what a worker's message becomes before the coordinator sees it.

A real :class:`~unicron.control.agent.Agent` (its listener; no zygote, no worker started) is
handed worker messages as its loop would hand them; the coordinator's side is in
``tests/test_coordinator.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

from unicron.control import messages as M
from unicron.control.agent import Agent, AgentConfig


def test_step_reports_carry_the_time_the_worker_sent_them(tmp_path: Path) -> None:
    # the monitor times a step from its begin to its end as the worker saw them: an agent
    # that reads its sockets 1.2 s late on a loaded machine (the soak's 2.38 s hang detection)
    # must not start the hang clock 1.2 s late, nor shorten or stretch the learned durations
    config = AgentConfig(node=0, slots=[0], script="train.py", argv=[], faults=[], log_dir=tmp_path)
    agent = Agent(config, link=None, task="t", store_address="127.0.0.1:1")  # type: ignore[arg-type]
    try:
        sent = time.time() - 1.2
        agent._from_worker(0, "step_begin", {"step": 7, "epoch": 2, "ts": sent})
        agent._from_worker(0, "step_done", {"step": 7, "compute_s": 0.1, "ts": sent + 0.1})
        began, computed = agent._reports
        assert isinstance(began, M.StepBegan) and began.ts == sent
        assert isinstance(computed, M.StepComputed) and computed.ts == sent + 0.1
        # a time in the future (never on one host's clock) is not believed
        agent._from_worker(0, "step_begin", {"step": 8, "epoch": 2, "ts": time.time() + 60})
        assert agent._reports[-1].ts <= time.time()
    finally:
        agent.stop()
